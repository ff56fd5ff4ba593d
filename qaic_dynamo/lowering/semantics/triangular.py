"""Triangular solves and the Cholesky family, written out step by step (see
:mod:`~qaic_dynamo.lowering.semantics.lu` for why, and for the size limit).

Cholesky is the column-by-column ``potf2``: ``l_jj = sqrt(a_jj - sum_k l_jk^2)`` and the
column below it, reading only the lower triangle (the upper one for ``upper=True``), with
``info`` the first column whose pivot is not positive. Past that column the factor is not
defined (LAPACK leaves it partly computed; here it holds NaNs); ``info`` says so either way.
"""

from __future__ import annotations

from typing import Any

import torch

from qaic_dynamo.lowering.semantics.lu import batch_broadcast, require_float, static_order, substitute

__all__ = ["cholesky", "cholesky_ex", "cholesky_inverse", "cholesky_solve", "solve_triangular", "triangular_solve"]


def solve_triangular(A: Any, B: Any, *, upper: bool, left: bool = True, unitriangular: bool = False) -> Any:
    """``linalg_solve_triangular``: ``A X = B`` (or ``X A = B``)."""
    require_float("solve_triangular", A, B)
    static_order(*A.shape[-2:], *B.shape[-2:], name="solve_triangular")
    if not left:  # X A = B  <=>  A^T X^T = B^T, A^T triangular the other way
        return solve_triangular(A.mT, B.mT, upper=not upper, unitriangular=unitriangular).mT
    a, b = batch_broadcast(A, B)
    return substitute(a, b, upper=upper, unit=unitriangular)


def triangular_solve(b: Any, A: Any, upper: bool = True, transpose: bool = False, unitriangular: bool = False) -> Any:
    """``triangular_solve``: (X with ``op(A) X = b``, A broadcast and copied)."""
    require_float("triangular_solve", A, b)
    static_order(*A.shape[-2:], *b.shape[-2:], name="triangular_solve")
    a, bb = batch_broadcast(A, b)
    t, up = (a.mT, not upper) if transpose else (a, upper)
    return substitute(t, bb, upper=up, unit=unitriangular), a.clone()


def cholesky_ex(A: Any, *, upper: bool = False, check_errors: bool = False) -> Any:
    """``linalg_cholesky_ex``: (L, info) - or (U, info) with ``A = U^T U``."""
    if check_errors:
        return NotImplemented
    require_float("cholesky", A)
    n = A.shape[-1]
    static_order(n, name="cholesky")
    a = A.mT if upper else A  # the triangle read is then the lower one
    ar = torch.arange(n)
    columns: list[torch.Tensor] = []
    info = torch.zeros(A.shape[:-2], dtype=torch.int32)
    for j in range(n):
        c = a[..., :, j]  # (..., n)
        if columns:
            done = torch.stack(columns, -1)  # (..., n, j)
            c = c - (done @ done[..., j, :].unsqueeze(-1)).squeeze(-1)
        d = c[..., j]
        info = torch.where((info == 0) & ~(d > 0), j + 1, info)
        root = torch.sqrt(d).unsqueeze(-1)
        columns.append(torch.where(ar > j, c / root, torch.where(ar == j, root, 0.0)))
    if not columns:
        return A.clone(), info
    factor = torch.stack(columns, -1)
    return (factor.mT if upper else factor), info


def cholesky(A: Any, upper: bool = False) -> Any:
    """``cholesky`` (the deprecated API): the factor alone."""
    return cholesky_ex(A, upper=upper)[0]


def _from_factor(L: Any, B: Any, upper: bool) -> Any:
    """``(L L^T)^-1 B`` (``(U^T U)^-1 B`` for ``upper``)."""
    lower = L.mT if upper else L
    y = substitute(lower, B, upper=False, unit=False)
    return substitute(lower.mT, y, upper=True, unit=False)


def cholesky_solve(B: Any, L: Any, upper: bool = False) -> Any:
    """``cholesky_solve``: ``X`` with ``A X = B`` from A's Cholesky factor."""
    require_float("cholesky_solve", B, L)
    static_order(*L.shape[-2:], *B.shape[-2:], name="cholesky_solve")
    lb, bb = batch_broadcast(L, B)
    return _from_factor(lb, bb, upper)


def cholesky_inverse(L: Any, upper: bool = False) -> Any:
    """``cholesky_inverse``: ``A^-1`` from A's Cholesky factor."""
    require_float("cholesky_inverse", L)
    n = L.shape[-1]
    static_order(n, name="cholesky_inverse")
    return _from_factor(L, torch.eye(n, dtype=L.dtype).expand(L.shape), upper)
