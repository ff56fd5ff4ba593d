"""Elementwise functions whose translation loses digits or quadrants: log1p, expm1,
atan2, and integer powers."""

from __future__ import annotations

import math
from typing import Any

import torch

from qaic_dynamo.errors import LoweringError
from qaic_dynamo.lowering.semantics.common import operands

__all__ = ["atan2", "expm1", "integer_pow", "log1p", "nan_ignoring"]


def log1p(x: Any) -> Any:
    """log(1 + x) without losing x near 0 (onnxscript: Log(x + 1), 0 for x = 1e-8): the
    classic correction log(u) * x / (u - 1) with u = 1 + x; float16 / bfloat16 in float32."""
    if not x.dtype.is_floating_point:
        return NotImplemented
    y = x.float() if x.dtype in (torch.float16, torch.bfloat16) else x
    u = 1 + y
    # divided first: log(u) * y overflows for y past ~3.8e36 in float32
    out = torch.where(u == 1, y, torch.where(torch.isinf(u), torch.log(u), torch.log(u) * (y / (u - 1))))
    return out.to(x.dtype)


def expm1(x: Any) -> Any:
    """exp(x) - 1 without losing x near 0 (onnxscript: Exp(x) - 1): (u - 1) * x / log(u)
    with u = exp(x); float16 / bfloat16 in float32."""
    if not x.dtype.is_floating_point:
        return NotImplemented
    y = x.float() if x.dtype in (torch.float16, torch.bfloat16) else x
    u = torch.exp(y)
    um1 = u - 1
    # divided first: (u - 1) * y overflows for x past ~84 in float32
    out = torch.where(u == 1, y, torch.where(um1 == -1, um1, torch.where(torch.isinf(u), u, um1 * (y / torch.log(u)))))
    return out.to(x.dtype)


def atan2(y: Any, x: Any) -> Any:
    """``atan2`` by quadrant, as C's: onnxscript's translation puts y = +0 with x < 0 at
    -pi (eager: pi - any point on the negative real axis), 0 / -0 at 0 (pi) and NaN at 0.
    The sign of a zero is read as its reciprocal's; 0 / 0 divides by 1 instead (atan(+-0)
    then keeps y's sign: ONNX Runtime's Where drops the sign of a zero it takes from its
    first branch), and inf / inf is set apart. The operands are rounded to the result type
    first, as eager does (a float32 1e5 is inf beside float16), float16 / bfloat16 then
    computed in float32, integers in the default dtype. float64 is left to the
    translation (ONNX Runtime has no float64 Atan to run either)."""
    dtype = torch.result_type(y, x)
    out = dtype if dtype.is_floating_point else torch.get_default_dtype()
    if out == torch.float64:
        return NotImplemented
    work = torch.float32 if out in (torch.float16, torch.bfloat16) else out
    y, x = torch.broadcast_tensors(*(t.to(work) for t in operands(y, x, out)))
    y_neg = (y < 0) | ((y == 0) & (1 / y < 0))
    x_neg = (x < 0) | ((x == 0) & (1 / x < 0))
    half_turn = torch.where(y_neg, torch.full_like(y, -math.pi), torch.full_like(y, math.pi))  # pi with y's sign
    base = torch.atan(y / torch.where((y == 0) & (x == 0), torch.ones_like(x), x))
    r = torch.where(x_neg, base + half_turn, base)
    r = torch.where(torch.isinf(y) & torch.isinf(x), torch.where(x_neg, 0.75 * half_turn, 0.25 * half_turn), r)
    return r.to(out)


def integer_pow(base: Any, exponent: Any) -> Any:
    """Integer ``pow`` by a non-negative Python int, by repeated squaring in the integer
    type, exact and wrapping as eager: the translation's Pow works in double (``3**39`` lost
    its last digits, an overflow saturated where eager wraps). By an integer tensor, or
    negative, it runs eagerly."""
    dtype = torch.result_type(base, exponent)
    if dtype.is_floating_point or dtype.is_complex or dtype == torch.bool:
        return NotImplemented
    if isinstance(exponent, torch.Tensor) or not isinstance(base, torch.Tensor):
        raise LoweringError(
            "an integer pow by a tensor: ONNX Runtime's Pow works in double (3**39 loses its last "
            "digits); such a piece runs eagerly"
        )
    if not isinstance(exponent, int) or exponent < 0:
        return NotImplemented  # a size, or eager's own error for a negative exponent
    result, square, n = torch.ones_like(base, dtype=dtype), base.to(dtype), exponent
    while n:
        if n & 1:
            result = result * square
        n >>= 1
        if n:
            square = square * square
    return result


def nan_ignoring(largest: bool) -> Any:
    """``fmax`` / ``fmin`` (prims): the larger / smaller operand, a NaN only where both are
    NaN; there is no ONNX function for the prims, so the piece ran eagerly."""

    def pick(a: Any, b: Any) -> Any:
        out = torch.maximum(a, b) if largest else torch.minimum(a, b)
        if not out.is_floating_point():
            return out
        return torch.where(torch.isnan(a), b, torch.where(torch.isnan(b), a, out))

    return pick
