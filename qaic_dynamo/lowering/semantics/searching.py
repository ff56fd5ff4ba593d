"""Searches of a sorted sequence and running extremes, which have no ONNX function.

``searchsorted`` / ``bucketize``: the insertion index is the count of boundaries below
the value (``<`` for the left side, ``<=`` for the right) - eager's binary search gives
the same on a sorted sequence without NaNs. Where a sequence is not sorted, or a NaN is
in play, eager's answer depends on its search path, so that call runs eagerly
(``eager_unless``). ``cummax`` / ``cummin``: the running extreme and its index (the last
of equal ones, a NaN once seen), one step per element along the dim.
"""

from __future__ import annotations

from typing import Any

import torch

from qaic_dynamo.errors import LoweringError
from qaic_dynamo.lowering.semantics.common import eager_unless

__all__ = ["MAX_SCAN", "bucketize", "cumulative_extreme", "searchsorted"]

#: The longest dim a running extreme is written out along.
MAX_SCAN = 64


def _insertion(boundaries: torch.Tensor, values: torch.Tensor, right: bool, out_int32: bool, name: str) -> Any:
    """Insertion indices of ``values`` into the last dim of ``boundaries``, whose leading
    dims are ``values``' (or which is 1-D)."""
    if boundaries.dtype.is_complex or values.dtype.is_complex:
        return NotImplemented
    result = torch.int32 if out_int32 else torch.int64
    if values.numel() == 0 or boundaries.shape[-1] == 0:  # nothing to search, or nowhere
        return torch.zeros(values.shape, dtype=result)
    sortedness = boundaries[..., 1:] >= boundaries[..., :-1]
    eager_unless(
        torch.cat([sortedness.flatten(), ~torch.isnan(boundaries).flatten(), ~torch.isnan(values).flatten()])
        if boundaries.is_floating_point() or values.is_floating_point()
        else sortedness.flatten(),
        f"{name} of an unsorted sequence or a NaN",
    )
    if boundaries.dim() == 1:
        below = boundaries <= values.unsqueeze(-1) if right else boundaries < values.unsqueeze(-1)
    else:
        b = boundaries.unsqueeze(-2)
        v = values.unsqueeze(-1)
        below = b <= v if right else b < v
    return below.to(torch.int64).sum(-1).to(result)


def searchsorted(
    sorted_sequence: Any,
    self: Any,
    *,
    out_int32: bool = False,
    right: bool = False,
    side: Any = None,
    sorter: Any = None,
) -> Any:
    if sorter is not None:  # the positions are those in the sorted view
        sorted_sequence = torch.gather(sorted_sequence, -1, sorter.long())
    right = right or side == "right"
    values = self if isinstance(self, torch.Tensor) else torch.scalar_tensor(self, dtype=sorted_sequence.dtype)
    return _insertion(sorted_sequence, values, right, out_int32, "searchsorted")


def bucketize(self: Any, boundaries: Any, *, out_int32: bool = False, right: bool = False) -> Any:
    values = self if isinstance(self, torch.Tensor) else torch.scalar_tensor(self, dtype=boundaries.dtype)
    return _insertion(boundaries, values, right, out_int32, "bucketize")


def cumulative_extreme(largest: bool) -> Any:
    """``cummax`` / ``cummin``: (values, indices)."""

    def scan(x: Any, dim: int) -> Any:
        if x.dtype.is_complex or x.dtype == torch.bool:
            return NotImplemented
        if x.dim() == 0:
            return x.clone(), torch.zeros((), dtype=torch.int64)
        d = dim % x.dim()
        n = x.shape[d]
        if not isinstance(n, int) or n > MAX_SCAN:
            raise LoweringError(f"cum{'max' if largest else 'min'} along {n} elements: written out up to {MAX_SCAN}")
        if n == 0:
            return x.clone(), torch.zeros_like(x, dtype=torch.int64)
        floating = x.is_floating_point()
        best = x.select(d, 0)
        where = torch.zeros_like(best, dtype=torch.int64)
        values, indices = [best], [where]
        for k in range(1, n):
            cur = x.select(d, k)
            take = cur >= best if largest else cur <= best
            if floating:
                take = take | torch.isnan(cur)
            best = torch.where(take, cur, best)
            where = torch.where(take, k, where)
            values.append(best)
            indices.append(where)
        return torch.stack(values, d), torch.stack(indices, d)

    return scan
