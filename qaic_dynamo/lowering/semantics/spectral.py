"""Discrete Fourier transforms computed in double for single-precision inputs.

ONNX Runtime's DFT kernel transforms a length that is not a power of two by the direct
sum, whose rounding error grows with the length: in float32 it came out 15-70x further
from the double-precision result than eager's (pocketfft) for lengths 7 to 127 - beyond
the 1e-4 a float32 result is compared at. The float32 / complex64 transform is done in
float64 / complex128 and rounded once, which is closer to exact than eager. A complex
value is cast through its real pairs (``view_as_real``), which is what it is in ONNX:
the translation has no complex cast.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from qaic_dynamo.lowering.semantics.complex_values import cast_complex

__all__ = ["fft_in_double"]

_WIDE = {torch.float32: torch.float64, torch.complex64: torch.complex128}


def fft_in_double(op: Any) -> Callable[..., Any]:
    """``op`` (``_fft_r2c`` / ``_fft_c2c`` / ``_fft_c2r``) on a float32 / complex64 input,
    in double, rounded back to the result type eager gives."""

    def transform(x: Any, *args: Any, **kwargs: Any) -> Any:
        wide = _WIDE.get(x.dtype)
        if wide is None:
            return NotImplemented  # double already (or a type the translation refuses)
        out = op(cast_complex(x, wide), *args, **kwargs)
        narrow = torch.complex64 if out.is_complex() else torch.float32
        return cast_complex(out, narrow)

    return transform
