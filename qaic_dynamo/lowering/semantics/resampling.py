"""Antialiased interpolation as eager computes it.

The translation of ``_upsample_{bilinear,bicubic}2d_aa`` (ONNX Resize with antialias) is
off for ``align_corners=True`` and for scales that do not divide the size. The operation
is separable and linear: ``out = Wh @ x @ Ww.T`` per channel, with ``Wh`` and ``Ww`` the
op applied to the unit vectors. They are computed once, by eager itself, at trace time
(the sizes must be static) and enter the graph as constants, so every sample matches
eager's own weights.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from qaic_dynamo._compat import outside_trace
from qaic_dynamo.errors import LoweringError

__all__ = ["antialiased_resize"]


def antialiased_resize(op: Any) -> Callable[..., Any]:
    def resize(x: Any, output_size: Any, align_corners: bool, scales_h: Any = None, scales_w: Any = None) -> Any:
        sizes = [*x.shape[-2:], *output_size]
        if not all(isinstance(n, int) for n in sizes) or not x.is_floating_point():
            raise LoweringError(
                "antialiased interpolation with dynamic sizes: its weights are computed at trace time; "
                "such a piece runs eagerly"
            )
        h, w, oh, ow = sizes
        with outside_trace():
            # Each unit vector as an image constant along the other axis, which keeps its
            # size of 2 (resampled to itself, an identity; a size of 1 is not one here).
            eye_h = torch.eye(h, dtype=torch.float64).reshape(h, 1, h, 1).expand(h, 1, h, 2)
            eye_w = torch.eye(w, dtype=torch.float64).reshape(w, 1, 1, w).expand(w, 1, 2, w)
            wh = op(eye_h.contiguous(), [oh, 2], align_corners, scales_h, None)[:, 0, :, 0]  # [h, oh]
            ww = op(eye_w.contiguous(), [2, ow], align_corners, None, scales_w)[:, 0, 0, :]  # [w, ow]
            wh, ww = wh.t().contiguous().to(x.dtype), ww.contiguous().to(x.dtype)
        return torch.matmul(torch.matmul(wh, x), ww)

    return resize
