"""What the semantics modules share: dtype groups, operand casts, scalar rounding."""

from __future__ import annotations

import math
import struct
from typing import Any

import torch

__all__ = [
    "EAGER_UNLESS",
    "FLOATS",
    "is_float_tensor",
    "REDUCED",
    "eager_unless",
    "integer_result",
    "operands",
    "reduced_dims",
    "round_to",
]


FLOATS = (torch.float32, torch.float64)


def is_float_tensor(x: Any) -> bool:
    """A float32 / float64 tensor: what the decompositions written in double take."""
    return isinstance(x, torch.Tensor) and x.dtype in FLOATS


#: The message prefix of an :func:`eager_unless` node (``lowering.checks`` reads it).
EAGER_UNLESS = "qaic:eager-unless:"


def eager_unless(ok: torch.Tensor, why: str) -> None:
    """Declare, inside a decomposition, that the piece's result is eager's only where every
    element of ``ok`` holds: the runner tests it after each run and, where it fails, runs
    that call eagerly instead (``why`` names the case). For a translation exact on a
    bounded domain (a recurrence written out to a fixed number of steps)."""
    torch.ops.aten._assert_async.msg(ok.all(), EAGER_UNLESS + why)


REDUCED = (torch.float16, torch.bfloat16)


def operands(a: Any, b: Any, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    def cast(x: Any) -> torch.Tensor:
        return x.to(dtype) if isinstance(x, torch.Tensor) else torch.scalar_tensor(x, dtype=dtype)

    return cast(a), cast(b)


def round_to(x: float, dtype: torch.dtype) -> float:
    """``x`` rounded to float16 / bfloat16 through float32 (as c10 converts a double
    scalar), in plain Python: inside the trace every tensor op would be traced."""
    if math.isnan(x) or math.isinf(x):
        return x
    try:
        (f32,) = struct.unpack("<f", struct.pack("<f", x))
        if dtype == torch.float16:
            return struct.unpack("<e", struct.pack("<e", f32))[0]
    except OverflowError:  # past the type's range: eager's conversion gives infinity
        return math.copysign(math.inf, x)
    (bits,) = struct.unpack("<I", struct.pack("<f", f32))
    bits = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16  # bfloat16: round to nearest even
    if bits >= 1 << 32 or (bits & 0x7F800000) == 0x7F800000:
        return math.copysign(math.inf, x)
    return struct.unpack("<f", struct.pack("<I", bits))[0]


def integer_result(x: Any, dtype: Any) -> Any:
    """The result type of an integer reduction of ``x`` (``dtype`` if given; integers and
    bool widen to int64, as eager), or None for a floating one."""
    out = dtype or (torch.int64 if not x.dtype.is_floating_point and not x.dtype.is_complex else x.dtype)
    return out if not out.is_floating_point and not out.is_complex and out != torch.bool else None


def reduced_dims(x: Any, dim: Any) -> list[int]:
    """A reduction's dims as a list: one, several, or (None or empty) all of them."""
    if isinstance(dim, int):
        return [dim]
    return list(dim) if dim else list(range(x.dim()))
