"""LU with partial pivoting, and what is built on it: solve, inverse, determinant.

ONNX has no linear-algebra operators, so these pieces ran eagerly. A matrix's size is
static in a piece, so the factorization can be written out step by step in ops ONNX has:
at step j the pivot row is the first with the largest ``|a_ij|`` (LAPACK's ``idamax``),
rows j and p swap by a gather, the column below the pivot is divided by it and the
trailing block takes the rank-1 update - LAPACK's unblocked ``getf2``, batched, with the
same 1-based int32 pivots and ``info`` (the first zero pivot). Rounding differs from
LAPACK's blocked kernels only in the order of the same operations.

The graph grows with the size (about a dozen nodes a step, more for the substitutions),
so matrices larger than :data:`MAX_UNROLLED` run eagerly; so do sizes that are not known
while lowering (a dynamic dimension).
"""

from __future__ import annotations

from typing import Any

import torch

from qaic_dynamo.errors import LoweringError
from qaic_dynamo.lowering.semantics.common import FLOATS

__all__ = [
    "MAX_UNROLLED",
    "batch_broadcast",
    "det",
    "inv_ex",
    "lu_factor_ex",
    "lu_solve",
    "lu_unpack",
    "plu",
    "require_float",
    "slogdet",
    "solve_ex",
    "static_order",
    "substitute",
]

#: The largest matrix dimension written out step by step.
MAX_UNROLLED = 32


def static_order(*sizes: Any, name: str) -> None:
    """Refuse (the piece runs eagerly) a size unknown while lowering or past the limit."""
    for n in sizes:
        if not isinstance(n, int):
            raise LoweringError(f"{name} of a matrix with a dynamic size: it is unrolled at a known size; runs eagerly")
        if n > MAX_UNROLLED:
            raise LoweringError(
                f"{name} of a matrix of size {n}: unrolled only up to {MAX_UNROLLED} (the graph grows with the size); "
                "runs eagerly"
            )


def require_float(name: str, *xs: Any) -> None:
    for x in xs:
        if x.dtype not in FLOATS:
            raise LoweringError(f"{name} in {x.dtype}: unrolled for float32 / float64 only; runs eagerly")


def batch_broadcast(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``a`` and ``b`` (matrices) expanded to one batch shape, as linalg broadcasts."""
    batch = torch.broadcast_shapes(a.shape[:-2], b.shape[:-2])
    return a.expand(*batch, *a.shape[-2:]), b.expand(*batch, *b.shape[-2:])


def lu_factor_ex(A: Any, *, pivot: bool = True, check_errors: bool = False) -> Any:
    """``linalg_lu_factor_ex``: (LU, pivots, info), LAPACK's getf2 steps (see module)."""
    if not pivot or check_errors:
        return NotImplemented  # CUDA-only / raising forms: the op as it is
    require_float("lu_factor", A)
    m, n = A.shape[-2:]
    static_order(m, n, name="lu_factor")
    batch = A.shape[:-2]
    rows = torch.arange(m).view(m, 1)
    cols = torch.arange(n).view(1, n)
    ar = torch.arange(m)
    lu = A
    pivots = []
    info = torch.zeros(batch, dtype=torch.int32)
    for j in range(min(m, n)):
        magnitude = torch.where(ar >= j, lu[..., :, j].abs(), -1.0)
        p = magnitude.argmax(-1, keepdim=True)  # (..., 1), the first largest
        pivots.append(p + 1)
        order = torch.where(ar == j, p, torch.where(ar == p, j, ar))
        lu = torch.gather(lu, -2, order.unsqueeze(-1).expand(*batch, m, n))
        d = lu[..., j : j + 1, j]  # (..., 1)
        info = torch.where((info == 0) & (d[..., 0] == 0), j + 1, info)
        # A zero pivot leaves its column (all zeros below it) unscaled, as getf2 does.
        below = torch.where(ar > j, lu[..., :, j] / torch.where(d == 0, 1.0, d), 0.0)  # (..., m)
        lu = torch.where((cols == j) & (rows > j), below.unsqueeze(-1), lu)
        update = below.unsqueeze(-1) * lu[..., j : j + 1, :]
        lu = torch.where((rows > j) & (cols > j), lu - update, lu)
    piv = torch.cat(pivots, -1).to(torch.int32) if pivots else torch.zeros(*batch, 0, dtype=torch.int32)
    return lu, piv, info


def _permutation(pivots: torch.Tensor, m: int) -> torch.Tensor:
    """The row order LAPACK's swaps give: ``A[perm] = L @ U`` (int64, (..., m))."""
    batch = pivots.shape[:-1]
    ar = torch.arange(m)
    perm = ar.expand(*batch, m)
    for i in range(pivots.shape[-1]):
        q = pivots[..., i : i + 1].long() - 1
        at_i, at_q = perm[..., i : i + 1], torch.gather(perm, -1, q)
        perm = torch.where(ar == i, at_q, torch.where(ar == q, at_i, perm))
    return perm


def lu_unpack(LU: Any, pivots: Any, unpack_data: bool = True, unpack_pivots: bool = True) -> Any:
    """``lu_unpack``: (P, L, U) with ``A = P @ L @ U``."""
    require_float("lu_unpack", LU)
    m, n = LU.shape[-2:]
    static_order(m, n, name="lu_unpack")
    k = min(m, n)
    if unpack_data:
        L = torch.tril(LU[..., :, :k], -1) + torch.eye(m, k, dtype=LU.dtype)
        U = torch.triu(LU[..., :k, :])
    else:
        L = U = LU.new_empty(0)
    if unpack_pivots:
        perm = _permutation(pivots, m)
        P = (perm.unsqueeze(-2) == torch.arange(m).view(m, 1)).to(LU.dtype)
    else:
        P = LU.new_empty(0)
    return P, L, U


def plu(A: Any, *, pivot: bool = True) -> Any:
    """``linalg_lu``: (P, L, U)."""
    if not pivot:
        return NotImplemented
    lu, piv, _ = lu_factor_ex(A)
    return lu_unpack(lu, piv)


def substitute(T: torch.Tensor, B: torch.Tensor, *, upper: bool, unit: bool) -> torch.Tensor:
    """``X`` with ``T @ X = B`` for a triangular ``T`` (batch dims already equal), row by
    row: forward substitution for a lower ``T``, backward for an upper one. Only ``T``'s
    own triangle is read."""
    n = T.shape[-1]
    if 0 in B.shape:  # nothing to solve (ONNX shape inference rejects concatenating empties)
        return B.clone()
    xs: dict[int, torch.Tensor] = {}
    order = range(n - 1, -1, -1) if upper else range(n)
    for i in order:
        r = B[..., i : i + 1, :]
        done = sorted(xs)
        if done:
            lo, hi = done[0], done[-1] + 1  # the rows solved so far are contiguous
            r = r - T[..., i : i + 1, lo:hi] @ torch.cat([xs[j] for j in range(lo, hi)], -2)
        xs[i] = r if unit else r / T[..., i : i + 1, i : i + 1]
    if not xs:
        return B
    return torch.cat([xs[i] for i in range(n)], -2)


def _solve_factored(lu: torch.Tensor, perm: torch.Tensor, B: torch.Tensor, adjoint: bool) -> torch.Tensor:
    """``A^-1 B`` (or ``A^-T B``) from A's LU and row order."""
    if not adjoint:  # A = P L U: X = U^-1 L^-1 P^T B
        pb = torch.gather(B, -2, perm.unsqueeze(-1).expand(B.shape))
        y = substitute(lu, pb, upper=False, unit=True)
        return substitute(lu, y, upper=True, unit=False)
    # A^T = U^T L^T P^T: X = P L^-T U^-T B
    y = substitute(lu.mT, B, upper=False, unit=False)
    z = substitute(lu.mT, y, upper=True, unit=True)
    # P z: row perm[i] of the result is row i of z
    return torch.scatter(z, -2, perm.unsqueeze(-1).expand(z.shape), z)


def lu_solve(LU: Any, pivots: Any, B: Any, *, left: bool = True, adjoint: bool = False) -> Any:
    """``linalg_lu_solve``."""
    require_float("lu_solve", LU, B)
    n = LU.shape[-1]
    static_order(n, B.shape[-1], B.shape[-2], name="lu_solve")
    if not left:  # X A = B  <=>  A^T X^T = B^T
        return lu_solve(LU, pivots, B.mT, left=True, adjoint=not adjoint).mT
    batch = torch.broadcast_shapes(LU.shape[:-2], B.shape[:-2], pivots.shape[:-1])
    lu = LU.expand(*batch, n, n)
    B = B.expand(*batch, *B.shape[-2:])
    perm = _permutation(pivots.expand(*batch, pivots.shape[-1]), n)
    return _solve_factored(lu, perm, B, adjoint)


def solve_ex(A: Any, B: Any, *, left: bool = True, check_errors: bool = False) -> Any:
    """``_linalg_solve_ex``: (result, LU, pivots, info) - LU and pivots of A itself."""
    if check_errors:
        return NotImplemented
    require_float("solve", A, B)
    vector = B.dim() == 1 or (B.dim() == A.dim() - 1 and B.shape == A.shape[:-1])
    b = B.unsqueeze(-1) if vector else B
    lu, piv, info = lu_factor_ex(A)
    static_order(b.shape[-1], name="solve")
    if left:
        lu_b, b_b = batch_broadcast(lu, b)
        perm = _permutation(piv.expand(*lu_b.shape[:-2], piv.shape[-1]), lu.shape[-1])
        x = _solve_factored(lu_b, perm, b_b, adjoint=False)
    else:  # X A = B  <=>  A^T X^T = B^T, from A's own LU
        lu_b, b_b = batch_broadcast(lu, b.mT)
        perm = _permutation(piv.expand(*lu_b.shape[:-2], piv.shape[-1]), lu.shape[-1])
        x = _solve_factored(lu_b, perm, b_b, adjoint=True).mT
    return (x.squeeze(-1) if vector else x), lu, piv, info


def inv_ex(A: Any, *, check_errors: bool = False) -> Any:
    """``linalg_inv_ex``: (inverse, info), as eager: a solve against the identity."""
    if check_errors:
        return NotImplemented
    n = A.shape[-1]
    eye = torch.eye(n, dtype=A.dtype).expand(A.shape)
    x, _, _, info = solve_ex(A, eye)
    return x, info


def _diagonal_and_sign(A: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    # Eager factors A^T (the column-major A LAPACK reads): its LU and pivots are those.
    lu, piv, _ = lu_factor_ex(A.mT)
    n = A.shape[-1]
    swaps = (piv != torch.arange(1, n + 1, dtype=torch.int32)).to(torch.int64).sum(-1)
    parity = 1 - 2 * (swaps % 2)  # (-1) ** swaps
    return lu, piv, torch.diagonal(lu, dim1=-2, dim2=-1), parity.to(A.dtype)


def det(A: Any) -> Any:
    """``_linalg_det``: (det, LU, pivots) - the product of U's diagonal and the swaps' sign."""
    require_float("det", A)
    lu, piv, diag, parity = _diagonal_and_sign(A)
    return diag.prod(-1) * parity, lu, piv


def slogdet(A: Any) -> Any:
    """``_linalg_slogdet``: (sign, log|det|, LU, pivots)."""
    require_float("slogdet", A)
    lu, piv, diag, parity = _diagonal_and_sign(A)
    sign = torch.sign(diag).prod(-1) * parity
    return sign, diag.abs().log().sum(-1), lu, piv
