"""Order statistics with no ONNX function: ``median`` / ``nanmedian`` (the lower median,
as the ``(n - 1) // 2``-th entry of a sort) and ``sort(stable=True)``.

Which index eager returns among equal values is its own kernel's business (a median's
``nth_element``; a stable sort's first-come order, which ONNX's TopK does not promise),
and so is where a NaN lands. A call whose slices hold equal values where it matters, or a
NaN, runs eagerly (``eager_unless``); every other call gets eager's answer exactly.
"""

from __future__ import annotations

from typing import Any

import torch

from qaic_dynamo.lowering.semantics.common import FLOATS, eager_unless
from qaic_dynamo.lowering.semantics.reductions import kthvalue_by_sort

__all__ = ["median", "median_dim", "nanmedian", "nanmedian_dim", "sort_stable"]


def median(x: Any) -> Any:
    """``median()`` / ``nanmedian()`` of every element."""
    if x.dtype not in FLOATS or x.numel() == 0:
        return NotImplemented
    flat = x.reshape(-1)
    eager_unless(~torch.isnan(flat), "median with a NaN")
    return kthvalue_by_sort(flat, (flat.shape[0] - 1) // 2 + 1, 0)[0]


def median_dim(x: Any, dim: int, keepdim: bool = False) -> Any:
    """``median(dim)``: (values, indices)."""
    if x.dtype not in FLOATS or x.numel() == 0:
        return NotImplemented
    if x.dim() == 0:
        return x.clone(), torch.zeros((), dtype=torch.int64)
    d = dim % x.dim()
    values, indices = kthvalue_by_sort(x, (x.shape[d] - 1) // 2 + 1, d, keepdim=True)
    unique = (x == values).sum(d) == 1  # the median value once: its index is determined
    eager_unless(unique & ~torch.isnan(x).any(d), "median with equal values at the median, or a NaN")
    return (values, indices) if keepdim else (values.squeeze(d), indices.squeeze(d))


def nanmedian_dim(x: Any, dim: int, keepdim: bool = False) -> Any:
    """``nanmedian(dim)``: the lower median of each slice's non-NaN values, as the
    ``(c - 1) // 2``-th of a sort with NaNs taken for +inf (c non-NaN values)."""
    if x.dtype not in FLOATS or x.numel() == 0:
        return NotImplemented
    if x.dim() == 0:
        return x.clone(), torch.zeros((), dtype=torch.int64)
    d = dim % x.dim()
    nan = torch.isnan(x)
    values, indices = torch.sort(torch.where(nan, float("inf"), x), d)
    count = (~nan).sum(d, keepdim=True)
    at = torch.div(count - 1, 2, rounding_mode="floor").clamp(min=0)
    value, index = torch.gather(values, d, at), torch.gather(indices, d, at)
    unique = (x == value).sum(d) == 1
    # an all-NaN slice, and a +inf beside NaNs (which the sort cannot tell apart), are eager's
    plus_inf = torch.isinf(x) & (x > 0)
    eager_unless(
        unique & (count.squeeze(d) > 0) & ~(nan.any(d) & plus_inf.any(d)), "nanmedian with equal values or all NaN"
    )
    return (value, index) if keepdim else (value.squeeze(d), index.squeeze(d))


def nanmedian(x: Any) -> Any:
    """``nanmedian()`` of every element."""
    if x.dtype not in FLOATS or x.numel() == 0:
        return NotImplemented
    return nanmedian_dim(x.reshape(-1), 0)[0]


def sort_stable(x: Any, *, stable: Any = None, dim: int = -1, descending: bool = False) -> Any:
    """``sort.stable``: a sort, where no two values along ``dim`` are equal (then every
    sort is stable)."""
    if not stable:
        return torch.sort(x, dim, descending)
    if x.dtype not in FLOATS or x.dim() == 0:
        return NotImplemented
    values, indices = torch.sort(x, dim, descending)
    d = dim % x.dim()
    n = x.shape[d]
    if n > 1:
        ties = values.narrow(d, 1, n - 1) == values.narrow(d, 0, n - 1)
        eager_unless(~ties & ~torch.isnan(values.narrow(d, 1, n - 1)), "a stable sort of equal values or a NaN")
    return values, indices
