"""Adaptive pooling with no ONNX function: ``adaptive_avg_pool3d`` and
``adaptive_max_pool2d`` (with its indices; ``adaptive_max_pool1d`` goes through it).

The windows are static: output cell i of a dimension of n inputs and o outputs covers
``[floor(i n / o), ceil((i + 1) n / o))``. An average is taken one dimension at a time.
A max is taken per output cell over its window flattened row-major, whose first largest
element is the one eager's kernel keeps (it replaces the running max only when strictly
larger) - except for NaNs, which eager's kernel prefers, last one first: a call with a NaN
runs eagerly (``eager_unless``).
"""

from __future__ import annotations

from typing import Any

import torch

from qaic_dynamo.errors import LoweringError
from qaic_dynamo.lowering.semantics.common import FLOATS, eager_unless

__all__ = ["MAX_POOL_CELLS", "adaptive_avg_pool3d", "adaptive_max_pool2d"]

#: The most output cells (per plane) an adaptive max pool is written out for.
MAX_POOL_CELLS = 256


def _window(i: int, n: int, o: int) -> tuple[int, int]:
    return (i * n) // o, -((-(i + 1) * n) // o)


def _adaptive_mean(x: torch.Tensor, dim: int, out_size: int) -> torch.Tensor:
    n = x.shape[dim]
    parts = []
    for i in range(out_size):
        start, end = _window(i, n, out_size)
        parts.append(x.narrow(dim, start, end - start).mean(dim, keepdim=True))
    return torch.cat(parts, dim)


def adaptive_avg_pool3d(x: Any, output_size: Any) -> Any:
    if x.dtype not in FLOATS or not all(isinstance(s, int) for s in output_size):
        return NotImplemented
    if x.numel() == 0:
        return x.new_zeros((*x.shape[:-3], *output_size))
    out = x
    for k, size in enumerate(output_size):
        out = _adaptive_mean(out, x.dim() - 3 + k, size)
    return out


def adaptive_max_pool2d(x: Any, output_size: Any) -> Any:
    """(values, indices into each input plane, row-major)."""
    if x.dtype not in FLOATS or x.numel() == 0:
        return NotImplemented
    oh, ow = output_size
    h, w = x.shape[-2:]
    if not all(isinstance(v, int) for v in (oh, ow, h, w)):
        return NotImplemented
    if oh * ow > MAX_POOL_CELLS:
        raise LoweringError(f"adaptive_max_pool2d to {oh}x{ow}: written out up to {MAX_POOL_CELLS} cells; runs eagerly")
    eager_unless(~torch.isnan(x), "adaptive_max_pool2d with a NaN")
    values, indices = [], []
    for i in range(oh):
        hs, he = _window(i, h, oh)
        for j in range(ow):
            ws, we = _window(j, w, ow)
            window = x[..., hs:he, ws:we].reshape(*x.shape[:-2], (he - hs) * (we - ws))
            best = window.argmax(-1, keepdim=True)
            values.append(torch.gather(window, -1, best))
            width = we - ws
            row = torch.div(best, width, rounding_mode="floor")
            indices.append((hs + row) * w + ws + (best - row * width))
    shape = (*x.shape[:-2], oh, ow)
    return torch.cat(values, -1).reshape(shape), torch.cat(indices, -1).reshape(shape)
