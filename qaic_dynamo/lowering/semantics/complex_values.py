"""Complex-valued ops the translation has no complex variant of, spelled on the real pairs.

In ONNX a complex tensor is a real one with a trailing dimension of 2 (torch.onnx's
lowering, ``view_as_real``'s layout), and ``view_as_real`` / ``view_as_complex`` translate
to nothing at all. So an op with no complex translation can be written on the pairs: a
conjugate negates the second of each pair, a pad pads every dimension but that one, a
cast casts the pairs.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["cast_complex", "conj_physical", "pad_complex"]


def cast_complex(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x.to(dtype)`` for a complex ``x`` and a complex ``dtype``, through the pairs;
    other tensors cast as they are."""
    if not x.is_complex():
        return x.to(dtype)
    return torch.view_as_complex(torch.view_as_real(x).to(dtype.to_real()).contiguous())


def conj_physical(x: Any) -> Any:
    if not x.is_complex():
        return NotImplemented
    pairs = torch.view_as_real(x)
    return torch.view_as_complex(torch.stack([pairs[..., 0], -pairs[..., 1]], dim=-1))


def pad_complex(x: Any, pad: Any, value: Any = 0) -> Any:
    """``constant_pad_nd`` of a complex tensor with zeros (a non-zero complex fill is left
    to the translation, which refuses it)."""
    if not x.is_complex() or value != 0:
        return NotImplemented
    padded = torch.constant_pad_nd(torch.view_as_real(x), [0, 0, *pad], 0.0)
    return torch.view_as_complex(padded.contiguous())
