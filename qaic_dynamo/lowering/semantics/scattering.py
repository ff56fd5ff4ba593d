"""Writes into a copy by index with no ONNX function of their own, spelled as the
scatters the translation has: ``put`` (a flat ``index_put``), ``scatter`` with a
``reduce`` (``scatter_reduce`` with ``include_self``), ``diagonal_scatter`` (the
diagonal picked out by a mask and gathered from ``src``)."""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["diagonal_scatter", "put", "scatter_with_reduce"]

_aten = torch.ops.aten
_REDUCE = {"add": "sum", "multiply": "prod"}


def put(x: Any, index: Any, source: Any, accumulate: bool = False) -> Any:
    """``put``: ``x`` flattened, ``source`` written (or added) at ``index`` (negative
    counts from the end, as eager)."""
    flat = x.reshape(-1)
    idx = index.reshape(-1)
    idx = torch.where(idx < 0, idx + flat.shape[0], idx)
    return _aten.index_put.default(flat, [idx], source.reshape(-1), accumulate).reshape(x.shape)


def scatter_with_reduce(x: Any, dim: int, index: Any, src: Any, *, reduce: str) -> Any:
    """``scatter(..., reduce="add" | "multiply")`` (a tensor or a number as ``src``)."""
    if reduce not in _REDUCE:
        return NotImplemented
    values = src if isinstance(src, torch.Tensor) else torch.full(index.shape, src, dtype=x.dtype)
    return x.scatter_reduce(dim, index, values.to(x.dtype), _REDUCE[reduce], include_self=True)


def diagonal_scatter(x: Any, src: Any, offset: int = 0, dim1: int = 0, dim2: int = 1) -> Any:
    """``x`` with its ``offset`` diagonal over (dim1, dim2) replaced by ``src``."""
    if src.shape[-1] == 0:
        return x.clone()
    moved = x.movedim((dim1, dim2), (-2, -1))
    a, b = moved.shape[-2:]
    rows = torch.arange(a).view(a, 1)
    cols = torch.arange(b).view(1, b)
    on = (cols - rows) == offset
    length = src.shape[-1]
    # element (r, c) of the diagonal is src[..., r - first_row]
    position = (rows - max(-offset, 0)).clamp(0, length - 1).expand(a, b)
    batch = moved.shape[:-2]
    spread = torch.gather(src.unsqueeze(-2).expand(*batch, a, length), -1, position.expand(*batch, a, b))
    return torch.where(on, spread.to(x.dtype), moved).movedim((-2, -1), (dim1, dim2))
