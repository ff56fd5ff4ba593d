"""Ops on tensors with no elements, whose translation ONNX Runtime rejects: ``im2col``
(``unfold``) and ``pixel_unshuffle`` (a Reshape to a shape with a zero it cannot infer),
``cat`` of nothing but empty tensors (the translation drops empty inputs, then has none).
The result has no elements either: it is made at its shape."""

from __future__ import annotations

import functools
from typing import Any

import torch

__all__ = ["cat_of_empties", "im2col_of_empty", "pixel_unshuffle_of_empty"]


def im2col_of_empty(x: Any, kernel_size: Any, dilation: Any, padding: Any, stride: Any) -> Any:
    if x.numel() != 0:
        return NotImplemented
    blocks = 1
    for i in range(2):
        size = x.shape[-2 + i] + 2 * padding[i] - dilation[i] * (kernel_size[i] - 1) - 1
        blocks *= size // stride[i] + 1
    channels = x.shape[-3] * kernel_size[0] * kernel_size[1]
    return x.new_zeros((*x.shape[:-3], channels, blocks))


def pixel_unshuffle_of_empty(x: Any, downscale_factor: int) -> Any:
    if x.numel() != 0:
        return NotImplemented
    r = downscale_factor
    c, h, w = x.shape[-3:]
    return x.new_zeros((*x.shape[:-3], c * r * r, h // r, w // r))


def cat_of_empties(tensors: Any, dim: int = 0) -> Any:
    if not tensors or any(t.numel() != 0 for t in tensors):
        return NotImplemented
    # eager's legacy rule: a 1-D empty tensor is skipped beside tensors of another rank
    kept = [t for t in tensors if not (t.dim() == 1 and t.shape[0] == 0)] or list(tensors)
    d = dim % kept[0].dim()
    shape = list(kept[0].shape)
    shape[d] = sum(t.shape[d] for t in kept)
    dtype = functools.reduce(torch.promote_types, (t.dtype for t in tensors))
    return torch.zeros(shape, dtype=dtype)
