"""QR by Householder reflections, written out step by step as LAPACK's unblocked
kernels take them (see :mod:`~qaic_dynamo.lowering.semantics.lu` for why, and the size
limit): ``geqrf`` (``geqr2``: reflector j from ``dlarfg``, ``beta = -sign(alpha) *
hypot(alpha, |x|)``, ``tau = (beta - alpha) / beta``, so R's diagonal has LAPACK's signs),
``householder_product`` (``orgqr``: the reflectors applied to the identity, last first),
``ormqr`` (Q or Q^T applied to a matrix, on either side) and ``linalg_qr`` in its three
modes. LAPACK's rescaling of a reflector whose norm underflows is left out: it matters
only for subnormal columns.
"""

from __future__ import annotations

from typing import Any

import torch

from qaic_dynamo.lowering.semantics.lu import require_float, static_order

__all__ = ["geqrf", "householder_product", "ormqr", "qr"]


def geqrf(A: Any) -> Any:
    """``geqrf``: (a, tau) - R on and above the diagonal, the reflectors' tails below."""
    require_float("geqrf", A)
    m, n = A.shape[-2:]
    static_order(m, n, name="geqrf")
    k = min(m, n)
    cols = torch.arange(n).view(1, n)
    a = A
    taus = []
    for j in range(k):
        col = a[..., :, j]  # (..., m)
        alpha = col[..., j : j + 1]  # (..., 1)
        below = torch.where(torch.arange(m) > j, col, 0.0)
        xnorm = torch.sqrt((below * below).sum(-1, keepdim=True))
        norm = torch.sqrt(alpha * alpha + xnorm * xnorm)
        beta = torch.where(alpha >= 0, -norm, norm)
        trivial = xnorm == 0  # H = I: tau 0, the column as it is
        safe_beta = torch.where(trivial, 1.0, beta)
        tau = torch.where(trivial, 0.0, (beta - alpha) / safe_beta)
        scale = torch.where(trivial, 1.0, 1 / torch.where(trivial, 1.0, alpha - beta))
        v = torch.where(torch.arange(m) == j, 1.0, below * scale)  # (..., m), 0 above j
        # the trailing columns: A - tau v (v^T A)
        w = (v.unsqueeze(-1) * a).sum(-2, keepdim=True)  # (..., 1, n)
        update = tau.unsqueeze(-1) * v.unsqueeze(-1) * w
        a = torch.where(cols > j, a - update, a)
        ar = torch.arange(m)
        column = torch.where(ar == j, torch.where(trivial, alpha, beta), torch.where(ar > j, below * scale, col))
        a = torch.where(cols == j, column.unsqueeze(-1), a)
        taus.append(tau)
    tau = torch.cat(taus, -1) if taus else A.new_zeros((*A.shape[:-2], 0))
    return a, tau


def _reflector(a: torch.Tensor, j: int) -> torch.Tensor:
    """Reflector j's vector (..., m): 0 above row j, 1 at it, a's column j below."""
    m = a.shape[-2]
    ar = torch.arange(m)
    return torch.where(ar < j, 0.0, torch.where(ar == j, 1.0, a[..., :, j]))


def _apply(c: torch.Tensor, v: torch.Tensor, tau: torch.Tensor, left: bool) -> torch.Tensor:
    """``H c`` (left) or ``c H`` with ``H = I - tau v v^T``."""
    t = tau.unsqueeze(-1).unsqueeze(-1)
    if left:
        return c - t * v.unsqueeze(-1) * (v.unsqueeze(-1) * c).sum(-2, keepdim=True)
    return c - t * (c * v.unsqueeze(-2)).sum(-1, keepdim=True) * v.unsqueeze(-2)


def householder_product(A: Any, tau: Any) -> Any:
    """``linalg_householder_product``: the first n columns of ``H_1 ... H_k``."""
    require_float("householder_product", A, tau)
    m, n = A.shape[-2:]
    static_order(m, n, name="householder_product")
    q = torch.eye(m, n, dtype=A.dtype).expand(A.shape)
    for j in reversed(range(tau.shape[-1])):
        q = _apply(q, _reflector(A, j), tau[..., j], left=True)
    return q


def ormqr(A: Any, tau: Any, C: Any, left: bool = True, transpose: bool = False) -> Any:
    """``ormqr``: ``Q C``, ``Q^T C``, ``C Q`` or ``C Q^T`` with Q from ``geqrf``."""
    require_float("ormqr", A, tau, C)
    static_order(*A.shape[-2:], *C.shape[-2:], name="ormqr")
    k = tau.shape[-1]
    # Q = H_1 ... H_k: Q C applies H_k first; Q^T C = H_k ... H_1 C applies H_1 first.
    order = range(k) if left == transpose else reversed(range(k))
    out = C
    for j in order:
        out = _apply(out, _reflector(A, j), tau[..., j], left=left)
    return out


def qr(A: Any, mode: str = "reduced") -> Any:
    """``linalg_qr``: (Q, R) in mode "reduced", "complete" or "r" (Q empty)."""
    require_float("qr", A)
    m, n = A.shape[-2:]
    static_order(m, n, name="qr")
    k = min(m, n)
    a, tau = geqrf(A)
    if mode == "r":
        return A.new_zeros(0), torch.triu(a[..., :k, :])
    if mode == "complete" and m > n:
        q = torch.eye(m, dtype=A.dtype).expand(*A.shape[:-2], m, m)
        for j in reversed(range(k)):
            q = _apply(q, _reflector(a, j), tau[..., j], left=True)
        return q, torch.triu(a)
    return householder_product(a[..., :, :k], tau), torch.triu(a[..., :k, :])
