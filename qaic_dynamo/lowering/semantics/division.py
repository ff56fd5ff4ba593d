"""Floor and truncating division, remainder and fmod, as eager computes them.

onnxscript translates float floor division as Floor(Div(a, b)) and float remainder as
a - b * Floor(a / b), and integer division with a rounding mode through float32. Eager
(c10's div_floor_floating, the remainder kernel, integer division) gives other values:
``1.0 // 0.1`` is 9 (0.1 is a little above a tenth; Python agrees) where Floor(Div) gives
10, ``x % 0.1`` is 0.1 where the translation gives 0, and an int64 above 2**24 divided
with ``rounding_mode="floor"`` loses its low bits. These decompositions spell eager's
formulas in ops whose translations are exact. Floor and truncating division of float16 /
bfloat16 run in float32 with the scalar unrounded, as eager's kernels do; their remainder
in float32 with the scalar rounded, as eager's does.
"""

from __future__ import annotations

import threading
from typing import Any

import torch

from qaic_dynamo.lowering.semantics.common import FLOATS, REDUCED, operands
from qaic_dynamo.lowering.semantics.reduced_floats import reduced_float_scaling, reduced_wide

__all__ = ["div_mode", "floor_divide", "integer_rest", "remainder"]

_aten = torch.ops.aten
# Set while a decomposition runs the integer division it decomposes into (the
# translation's integer Div is exact), so that it is not decomposed again.
_reentry = threading.local()


def _signs_differ(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return (x < 0) != (y < 0)


def _float_floor_divide(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """c10::div_floor_floating: the quotient of the exact remainder, then floored."""
    mod = torch.fmod(a, b)
    div = (a - mod) / b
    div = torch.where((mod != 0) & _signs_differ(b, mod), div - 1, div)
    floor = torch.floor(div)
    floor = torch.where(div - floor > 0.5, floor + 1, floor)
    quotient = a / b
    floor = torch.where(div != 0, floor, quotient * 0)  # a zero keeps the quotient's sign
    return torch.where(b == 0, quotient, floor)


def _any_floor_divide(a: Any, b: Any, dtype: torch.dtype) -> Any:
    if dtype in FLOATS:
        return _float_floor_divide(*operands(a, b, dtype))
    if dtype in REDUCED:
        # Eager's kernel: tensors in the reduced type (an int64 2051 becomes 2052 in
        # float16), the scalar unrounded, the arithmetic in float32.
        return _float_floor_divide(*reduced_wide(a, b, dtype)).to(dtype)
    if dtype == torch.bool or getattr(_reentry, "integer_division", False):
        return NotImplemented  # (the translation's integer Div and Mod are exact)
    return _integer_quotient(a, b, dtype, "floor")


def _integer_quotient(a: Any, b: Any, dtype: torch.dtype, rounding: str) -> torch.Tensor:
    """The integer quotient, floored or truncated, as eager gives it - also of the minimum
    by -1, which wraps to the minimum: ONNX Runtime's integer Div traps there (SIGFPE), which
    killed the process. Division by -1 is a negation instead; by 0, Div still fails, and the
    piece is re-run eagerly, which raises eager's ZeroDivisionError."""
    a, b = operands(a, b, dtype)
    minus_one = b == -1
    safe = torch.where(minus_one, torch.ones_like(b), b)
    _reentry.integer_division = True
    try:
        quotient = torch.floor_divide(a, safe)  # the translation: integer Div, exact
    finally:
        _reentry.integer_division = False
    if rounding == "trunc":
        # Truncation differs from the floor where the exact remainder is non-zero and the
        # operands' signs differ.
        rest = a - quotient * safe
        quotient = quotient + ((rest != 0) & _signs_differ(a, safe)).to(dtype)
    return torch.where(minus_one, -a, quotient)


def integer_rest(a: Any, b: Any, rounding: str) -> Any:
    """``a - q * b`` for the integer quotient ``q`` (floor: ``remainder``; trunc: ``fmod``),
    exact and wrapping as eager: the translations trap on the minimum by -1 (remainder) or
    go through double (int64 ``fmod(2**53 + 1, 2)`` gave 0)."""
    dtype = torch.result_type(a, b)
    if dtype.is_floating_point or dtype.is_complex or dtype == torch.bool:
        return NotImplemented
    a, b = operands(a, b, dtype)
    return a - _integer_quotient(a, b, dtype, rounding) * b


def floor_divide(a: Any, b: Any) -> Any:
    return _any_floor_divide(a, b, torch.result_type(a, b))


def _float_remainder(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    mod = torch.fmod(a, b)
    return torch.where((mod != 0) & _signs_differ(b, mod), mod + b, mod)


def remainder(a: Any, b: Any) -> Any:
    dtype = torch.result_type(a, b)
    if dtype in FLOATS:
        return _float_remainder(*operands(a, b, dtype))
    if dtype in REDUCED:
        # Eager's kernel: both operands in the reduced type (the scalar rounded), the
        # arithmetic in float32 - the translation's float16 steps gave other last places.
        wa, wb = operands(a, b, dtype)
        return _float_remainder(wa.float(), wb.float()).to(dtype)
    # integers (also by a size, ``x % x.shape[0]``, which has no translation)
    return integer_rest(a, b, "floor")


def div_mode(a: Any, b: Any, *, rounding_mode: str | None = None) -> Any:
    if rounding_mode is None:
        return reduced_float_scaling(_aten.div.Tensor)(a, b)  # true division
    dtype = torch.result_type(a, b)
    if dtype in REDUCED and rounding_mode == "trunc" and (not isinstance(b, torch.Tensor) or b.dim() == 0):
        # by a number: eager divides in float32 by it unrounded, then truncates
        wa, wb = reduced_wide(a, b, dtype)
        return torch.trunc(wa / wb).to(dtype)
    if dtype.is_floating_point:
        return _any_floor_divide(a, b, dtype) if rounding_mode == "floor" else NotImplemented  # trunc(a / b), as eager
    if dtype == torch.bool:
        return NotImplemented
    return _integer_quotient(a, b, dtype, rounding_mode)
