"""Symmetric eigenvalues, singular values and the pseudo-inverse - the parts of the
eigen- and singular-value decompositions that are unique - by cyclic Jacobi rotations.

ONNX has no eigensolver. A matrix's size is static in a piece, so Jacobi's method is
written out: :func:`sweeps` sweeps of one rotation per off-diagonal pair, each rotation
``A <- J^T A J`` zeroing ``a_pq``, in double. Jacobi converges quadratically; the call
runs eagerly (``eager_unless``) unless what is left off the diagonal is below
``1e-10 |A|``, so the eigenvalues are exact to double rounding where it is taken.

What is computed is what does not depend on a choice of signs: eigenvalues
(``_linalg_eigh`` without vectors), singular values (``_linalg_svd`` without U and V:
the square roots of ``A^T A``'s eigenvalues) and ``linalg_pinv`` (``V diag(1/s^2) V^T
A^T`` over the singular values above eager's tolerance, or ``Q diag(1/l) Q^T`` for a
Hermitian input). Eigenvectors and U / V themselves - whose signs are LAPACK's choice -
run eagerly, as do matrices larger than :data:`MAX_JACOBI`.
"""

from __future__ import annotations

from typing import Any

import torch

from qaic_dynamo.errors import LoweringError
from qaic_dynamo.lowering.semantics.common import eager_unless
from qaic_dynamo.lowering.semantics.lu import require_float

__all__ = ["MAX_JACOBI", "eigh", "pinv", "svd_values", "sweeps"]

#: The largest matrix Jacobi's rotations are written out for.
MAX_JACOBI = 8


def sweeps(n: int) -> int:
    """Sweeps written out for an n x n matrix (each n(n-1)/2 rotations): one more than
    random symmetric matrices needed to converge in 100 of 100 trials (4 up to n = 4, 5
    at n = 5, 6 at n = 8); the lowering's time grows with them (about 4 s at n = 5)."""
    return 5 if n <= 4 else 6 if n <= 6 else 7


def _static(n: Any, name: str) -> None:
    if not isinstance(n, int) or n > MAX_JACOBI:
        raise LoweringError(f"{name} of a {n}x{n} matrix: Jacobi is written out up to {MAX_JACOBI}; runs eagerly")


def _jacobi(a: torch.Tensor, vectors: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(eigenvalues unsorted, eigenvectors as columns or None) of the symmetric double
    ``a`` (..., n, n)."""
    n = a.shape[-1]
    eye = torch.eye(n, dtype=a.dtype)
    v = eye.expand(a.shape) if vectors else None
    scale = torch.sqrt((a * a).sum((-2, -1)))
    unit = [(torch.arange(n) == k).to(a.dtype) for k in range(n)]
    # per pair: the rotation's diagonal (e_p e_p^T + e_q e_q^T) and skew (e_p e_q^T - e_q e_p^T) parts
    pair = {
        (p, q): (
            torch.outer(unit[p], unit[p]) + torch.outer(unit[q], unit[q]),
            torch.outer(unit[p], unit[q]) - torch.outer(unit[q], unit[p]),
        )
        for p in range(n - 1)
        for q in range(p + 1, n)
    }
    for _ in range(sweeps(n)):
        for p in range(n - 1):
            for q in range(p + 1, n):
                app, aqq, apq = a[..., p, p], a[..., q, q], a[..., p, q]
                rotate = apq != 0
                theta = (aqq - app) / (2 * torch.where(rotate, apq, 1.0))
                sign = torch.where(theta >= 0, 1.0, -1.0)
                t = torch.where(rotate, sign / (theta.abs() + torch.sqrt(theta * theta + 1)), 0.0)
                c = 1 / torch.sqrt(t * t + 1)
                s = t * c
                j = eye + (c - 1)[..., None, None] * pair[(p, q)][0] + s[..., None, None] * pair[(p, q)][1]
                a = j.mT @ a @ j
                if v is not None:
                    v = v @ j
    off = a - torch.diag_embed(torch.diagonal(a, dim1=-2, dim2=-1))
    eager_unless(torch.sqrt((off * off).sum((-2, -1))) <= 1e-10 * scale, "Jacobi's rotations did not converge")
    return torch.diagonal(a, dim1=-2, dim2=-1), v


def _symmetric(a: torch.Tensor, upper: bool) -> torch.Tensor:
    """The symmetric matrix one triangle of ``a`` gives (as LAPACK reads it)."""
    t = torch.triu(a) if upper else torch.tril(a)
    return t + t.mT - torch.diag_embed(torch.diagonal(t, dim1=-2, dim2=-1))


def eigh(A: Any, UPLO: str = "L", compute_v: bool = True) -> Any:
    """``_linalg_eigh`` without eigenvectors: (ascending eigenvalues, empty)."""
    if compute_v:
        return NotImplemented
    require_float("eigvalsh", A)
    _static(A.shape[-1], "eigvalsh")
    values, _ = _jacobi(_symmetric(A.double(), UPLO == "U"), vectors=False)
    return torch.sort(values, -1)[0].to(A.dtype), A.new_empty(0)


def _gram_values(A: torch.Tensor) -> torch.Tensor:
    """Singular values of ``A`` (descending, double) from its smaller Gram matrix."""
    a = A.double()
    gram = a.mT @ a if a.shape[-1] <= a.shape[-2] else a @ a.mT
    values, _ = _jacobi(gram, vectors=False)
    return torch.sqrt(torch.sort(values.clamp(min=0), -1, descending=True)[0])


def svd_values(A: Any, full_matrices: bool = False, compute_uv: bool = True, *, driver: Any = None) -> Any:
    """``_linalg_svd`` without U and V: (empty, descending singular values, empty)."""
    if compute_uv:
        return NotImplemented
    require_float("svdvals", A)
    _static(min(A.shape[-2:]), "svdvals")
    if 0 in A.shape[-2:]:  # no singular values
        return A.new_empty(0), A.new_zeros((*A.shape[:-2], 0)), A.new_empty(0)
    return A.new_empty(0), _gram_values(A).to(A.dtype), A.new_empty(0)


def pinv(A: Any, *, atol: Any = None, rtol: Any = None, hermitian: bool = False) -> Any:
    """``linalg_pinv`` with eager's tolerance: ``max(atol, rtol * largest)``, ``rtol``
    defaulting to ``eps * max(m, n)`` when neither is given (0 when only ``atol`` is)."""
    require_float("pinv", A)
    m, n = A.shape[-2:]
    _static(n if hermitian else min(m, n), "pinv")
    if 0 in (m, n):  # the pseudo-inverse of an empty matrix: empty, transposed
        return A.new_zeros((*A.shape[:-2], n, m))
    a = A.double()
    # eager's default: rtol = eps * max(m, n) when neither is given, 0 when atol alone is
    default_rtol = 0.0 if atol is not None else torch.finfo(A.dtype).eps * max(m, n)

    def tolerance(largest: torch.Tensor) -> torch.Tensor:
        tol = (rtol.double().unsqueeze(-1) if rtol is not None else default_rtol) * largest
        return torch.maximum(atol.double().unsqueeze(-1), tol) if atol is not None else tol

    if hermitian:
        values, q = _jacobi(_symmetric(a, upper=False), vectors=True)
        keep = values.abs() > tolerance(values.abs().amax(-1, keepdim=True))
        inverse = torch.where(keep, 1 / torch.where(keep, values, 1.0), 0.0)
        return ((q * inverse.unsqueeze(-2)) @ q.mT).to(A.dtype)
    wide = n > m  # work on the smaller Gram matrix: pinv(A) = pinv(A^T)^T
    b = a.mT if wide else a
    values, v = _jacobi(b.mT @ b, vectors=True)
    sigma = torch.sqrt(values.clamp(min=0))
    keep = sigma > tolerance(sigma.amax(-1, keepdim=True))
    inverse_sq = torch.where(keep, 1 / torch.where(keep, values, 1.0), 0.0)
    out = (v * inverse_sq.unsqueeze(-2)) @ v.mT @ b.mT
    return (out.mT if wide else out).to(A.dtype)
