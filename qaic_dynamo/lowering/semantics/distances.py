"""Distances and norms of pairs with no ONNX function: ``hypot``, ``cdist``, ``pdist``.

``cdist`` takes the difference directly, as eager does for p != 2 and for small inputs.
For p = 2 with more than 25 rows on either side (or ``compute_mode`` 1) eager expands
``|a - b|^2`` into matrix products instead, which is faster and less exact: near a zero
distance it loses about ``sqrt(eps) |a|`` (4.9e-4 for two equal unit-scale float32 rows,
where the direct difference gives 0). The direct difference is kept there too - it is
never further from the exact distance than eager's, though it can differ from eager's
by eager's own error.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from qaic_dynamo.errors import LoweringError
from qaic_dynamo.lowering.semantics.common import FLOATS

__all__ = ["cdist", "hypot", "pdist"]

#: The largest pairwise-difference tensor built (elements); above it the piece runs eagerly.
MAX_PAIR_ELEMENTS = 1 << 24
#: The most rows pdist is written out for (two slices a row).
MAX_PDIST_ROWS = 128


def hypot(x: Any, y: Any) -> Any:
    """``sqrt(x^2 + y^2)`` without overflow or underflow, as C's ``hypot``: an infinite
    operand gives inf even beside a NaN. float32 in double."""
    dtype = torch.result_type(x, y)
    if dtype not in FLOATS:
        return NotImplemented
    a, b = torch.broadcast_tensors(x.double().abs(), y.double().abs())
    big, small = torch.maximum(a, b), torch.minimum(a, b)
    ratio = small / torch.where(big == 0, 1.0, big)
    out = big * torch.sqrt(1 + ratio * ratio)
    out = torch.where(torch.isinf(a) | torch.isinf(b), float("inf"), out)
    return out.to(dtype)


def _norm_of_differences(diff: torch.Tensor, p: float) -> torch.Tensor:
    if p == 0:
        return (diff != 0).to(diff.dtype).sum(-1)
    if math.isinf(p):
        return diff.abs().amax(-1) if diff.shape[-1] else diff.abs().sum(-1)
    if p == 1:
        return diff.abs().sum(-1)
    if p == 2:
        return torch.sqrt((diff * diff).sum(-1))
    return diff.abs().pow(p).sum(-1).pow(1.0 / p)


def _direct_only(*sizes: int, name: str) -> None:
    if not all(isinstance(s, int) for s in sizes):
        raise LoweringError(f"{name} with a dynamic size; runs eagerly")
    if math.prod(sizes) > MAX_PAIR_ELEMENTS:
        raise LoweringError(f"{name}: {math.prod(sizes)} pairwise differences exceed {MAX_PAIR_ELEMENTS}; runs eagerly")


def cdist(x1: Any, x2: Any, p: float, compute_mode: Any = None) -> Any:
    if x1.dtype not in FLOATS or p < 0:
        return NotImplemented  # eager's own error for p < 0
    r1, r2 = x1.shape[-2], x2.shape[-2]
    batch = torch.broadcast_shapes(x1.shape[:-2], x2.shape[:-2])
    _direct_only(*batch, r1, r2, x1.shape[-1], name="cdist")
    a = x1.expand(*batch, *x1.shape[-2:]).unsqueeze(-2)
    b = x2.expand(*batch, *x2.shape[-2:]).unsqueeze(-3)
    return _norm_of_differences(a - b, p)


def pdist(x: Any, p: float = 2.0) -> Any:
    """The distances of rows i < j, in that order."""
    if x.dtype not in FLOATS or p < 0:
        return NotImplemented
    n, m = x.shape
    _direct_only(n * (n - 1) // 2, m, name="pdist")
    if not isinstance(n, int) or n > MAX_PDIST_ROWS:
        raise LoweringError(f"pdist of {n} rows: written out up to {MAX_PDIST_ROWS}; runs eagerly")
    if n < 2:
        return x.new_zeros(0)
    # Row i against rows i+1.., by static slices (no index constants in the graph).
    first = torch.cat([x[i : i + 1].expand(n - 1 - i, m) for i in range(n - 1)])
    second = torch.cat([x[i + 1 :] for i in range(n - 1)])
    return _norm_of_differences(first - second, p)
