"""Ops with no ONNX function whose result is fixed by static sizes and plain arithmetic:
``frexp`` (exponent from ``log2``, corrected by one either way, so it is exact),
``nonzero_static`` (each nonzero element's coordinates scattered to its rank among the
nonzero ones) and ``histc`` over the data's own range (``min == max``, which the
translation refuses)."""

from __future__ import annotations

import math
from typing import Any

import torch

from qaic_dynamo.lowering.semantics.common import FLOATS, eager_unless

__all__ = ["frexp", "histc_of_data_range", "nonzero_static"]


def frexp(x: Any) -> Any:
    """(mantissa, exponent) with ``x = mantissa * 2**exponent``, 0.5 <= |mantissa| < 1;
    0, inf and NaN give (x, 0)."""
    if x.dtype not in FLOATS:
        return NotImplemented
    y = x.double()
    finite = torch.isfinite(y) & (y != 0)
    safe = torch.where(finite, y.abs(), 1.0)
    e = torch.floor(torch.log2(safe)) + 1
    m = safe / torch.pow(2.0, e)
    # log2 rounds: one step either way puts the mantissa in [0.5, 1)
    e = torch.where(m >= 1, e + 1, torch.where(m < 0.5, e - 1, e))
    m = safe / torch.pow(2.0, e)
    mantissa = torch.where(finite, torch.where(y < 0, -m, m), y)
    exponent = torch.where(finite, e, 0.0).to(torch.int32)
    return mantissa.to(x.dtype), exponent


def nonzero_static(x: Any, *, size: int, fill_value: int = -1) -> Any:
    """The coordinates of the first ``size`` nonzero elements (row-major), padded with
    ``fill_value``: (size, x.dim()) int64."""
    if not isinstance(size, int) or not all(isinstance(d, int) for d in x.shape):
        return NotImplemented
    rank = x.dim()
    flat = (x != 0).reshape(-1)
    n = flat.shape[0]
    if size == 0 or n == 0 or rank == 0:
        return torch.full((size, rank), fill_value, dtype=torch.int64)
    position = torch.cumsum(flat.to(torch.int64), 0) - 1
    target = torch.where(flat & (position < size), position, size)  # the rest: a row dropped below
    index = torch.arange(n)
    strides = [math.prod(x.shape[k + 1 :]) for k in range(rank)]
    coords = torch.stack([torch.div(index, s, rounding_mode="floor") % d for s, d in zip(strides, x.shape)], -1)
    out = torch.full((size + 1, rank), fill_value, dtype=torch.int64)
    out = out.index_put((target,), coords)
    return out[:size]


def histc_of_data_range(x: Any, bins: int = 100, min: Any = 0, max: Any = 0) -> Any:  # noqa: A002 (torch's names)
    """``histc`` with ``min == max``: the data's range (widened by 1 each way if it is a
    point), each element in bin ``(x - lo) * bins / (hi - lo)`` truncated - eager's
    formula, operation for operation - the top edge in the last bin. A NaN makes the
    range not finite, where eager raises: that call runs eagerly."""
    if min != max or x.dtype not in FLOATS:
        return NotImplemented
    if x.numel() == 0:
        return torch.zeros(bins, dtype=x.dtype)
    lo, hi = x.min(), x.max()
    point = lo == hi
    lo, hi = torch.where(point, lo - 1, lo), torch.where(point, hi + 1, hi)
    # (ONNX Runtime's ReduceMin / ReduceMax skip a NaN that eager's min / max return)
    finite = torch.isfinite(lo) & torch.isfinite(hi) & ~torch.isnan(x).any()
    eager_unless(finite, "histc of a range that is not finite")
    position = ((x.reshape(-1) - lo) * bins / (hi - lo)).to(torch.int64)
    position = torch.where(position == bins, bins - 1, position)
    return (position.unsqueeze(-1) == torch.arange(bins)).sum(0).to(x.dtype)
