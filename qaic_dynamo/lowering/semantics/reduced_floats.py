"""float16 / bfloat16 arithmetic with a Python number, as eager's CPU kernels compute it.

Eager multiplies, divides, adds with an ``alpha`` and compares a reduced-precision tensor
with a number in float32, the number unrounded (or rounded once, where eager rounds it),
and rounds the result once; the translation rounds the number to the tensor's type first.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

from qaic_dynamo.errors import LoweringError
from qaic_dynamo.lowering.semantics.common import REDUCED, round_to

__all__ = [
    "in_float32",
    "in_place",
    "reduced_float_comparison",
    "reduced_float_scaled_sum",
    "reduced_float_scaling",
    "reduced_wide",
]


def reduced_wide(a: Any, b: Any, dtype: torch.dtype) -> tuple[torch.Tensor, Any]:
    """The operands of a float16 / bfloat16 binary op as eager's CPU kernels take them, in
    float32: a tensor rounded to the reduced type first (an int64 2051 becomes 2052 in
    float16), the second operand unrounded when it is a number or a 0-d tensor of another
    type (c10 reads it with ``original_scalar_value<opmath_t>``)."""

    def wide(x: Any, second: bool) -> Any:
        if not isinstance(x, torch.Tensor):
            return torch.scalar_tensor(x, dtype=torch.float32)
        if second and x.dim() == 0 and x.dtype not in (dtype, torch.bool) and isinstance(a, torch.Tensor) and a.dim():
            return x.float()
        return x.to(dtype).float()

    return wide(a, False), wide(b, True)


def reduced_float_comparison(op: Any) -> Callable[..., Any]:
    """``op`` (eq, ne, lt, ...) on a float16 / bfloat16 tensor and a Python float or a 0-d
    tensor of another type, as eager compares: in the reduced type, the scalar rounded to
    it. The exporter's type promotion compares in float32 against the exact scalar instead,
    so ``h >= 0.1`` was False for ``h`` = float16(0.1), which is below 0.1. Rounding the
    scalar first gives eager's answer whatever the comparison is then computed in."""

    def compare(a: Any, b: Any) -> Any:
        dtype = torch.result_type(a, b)
        if dtype not in (torch.float16, torch.bfloat16):
            return NotImplemented

        def rounded(x: Any) -> Any:
            if isinstance(x, torch.Tensor):
                return x.to(dtype) if x.dtype != dtype else x
            if isinstance(x, (float, int)) and not isinstance(x, bool):  # 257 is 256 in bfloat16
                return round_to(float(x), dtype)
            return x

        ra, rb = rounded(a), rounded(b)
        if all(r is x or (isinstance(x, (float, int)) and r == x) for r, x in ((ra, a), (rb, b))):
            return NotImplemented  # already in the reduced type: the translation compares right
        return op(ra, rb)

    return compare


def in_float32(op: Any) -> Callable[..., Any]:
    """``op`` on a float16 / bfloat16 tensor computed in float32 and rounded back, as eager's
    CPU kernels compute it (ONNX Runtime's float16 ReduceLogSumExp overflowed past ~709)."""

    def upcast(x: Any, *args: Any, **kwargs: Any) -> Any:
        if x.dtype not in (torch.float16, torch.bfloat16):
            return NotImplemented
        return op(x.float(), *args, **kwargs).to(x.dtype)

    return upcast


def reduced_float_scaling(op: Any) -> Callable[..., Any]:
    """``op`` (mul, div) of a float16 / bfloat16 tensor by a Python number or a 0-d tensor
    of another float type, as eager's CPU kernels compute it: in float32 with the number
    unrounded (c10's ``original_scalar_value<opmath_t>``), rounded once. The translation
    rounded the number to the tensor's type first: ``h * 1e5`` gave inf, ``h * 1e-8`` and
    ``h / 1e-6`` lost digits (float16 1e-6 is 1.013e-6), ``h * 0.044715`` differed from
    eager in the last place for one value in five."""

    def compute(a: Any, b: Any) -> Any:
        if not isinstance(a, torch.Tensor) or a.dtype not in REDUCED or isinstance(b, bool):
            return NotImplemented
        if isinstance(b, torch.Tensor):
            if b.dim() != 0 or b.dtype in (a.dtype, torch.bool) or torch.result_type(a, b) != a.dtype:
                return NotImplemented  # a tensor: both in the reduced type, as the translation computes
            b = b.float()  # a 0-d float or integer tensor: its own value, as for a number
        elif not isinstance(b, (int, float)):
            return NotImplemented  # a symbolic size: left to the translation
        return op(a.float(), b).to(a.dtype)

    return compute


def reduced_float_scaled_sum(op: Any) -> Callable[..., Any]:
    """``op`` (add, sub) of two float16 tensors with an ``alpha``, as eager's vectorized
    CPU kernel computes it: ``a + alpha * b`` in float32 with alpha rounded to float16,
    rounded once. The translation rounded ``alpha * b`` to float16 before the sum (one
    value in 20 differed from eager in the last place). Eager's own scalar loop - strided
    operands, a short broadcast inner dim, the tail of each block - rounds ``alpha * b``
    first, so there some values still differ (as before). bfloat16 is left to the
    translation: ONNX Runtime has no bfloat16 Mul, so such a piece runs eagerly, exactly.
    An alpha past float16's range, which eager refuses, runs eagerly so that it raises."""

    def compute(a: Any, b: Any, *, alpha: Any = 1) -> Any:
        if (
            isinstance(alpha, bool)
            or not isinstance(alpha, (int, float))
            or alpha == 1
            or not isinstance(a, torch.Tensor)
            or not isinstance(b, torch.Tensor)
            or a.dtype != torch.float16
            or b.dtype != a.dtype
        ):
            return NotImplemented
        rounded = round_to(float(alpha), a.dtype)
        if math.isinf(rounded) and not math.isinf(alpha):
            raise LoweringError(
                f"{op}: alpha={alpha} is past float16's range, which eager refuses; the piece runs "
                "eagerly, where it raises"
            )
        return op(a.float(), b.float() * rounded).to(a.dtype)

    return compute


def in_place(out_of_place: Callable[..., Any]) -> Callable[..., Any]:
    """The in-place form of a decomposition (``add_`` for ``add``): its result written back."""

    def compute(a: Any, *args: Any, **kwargs: Any) -> Any:
        result = out_of_place(a, *args, **kwargs)
        return NotImplemented if result is NotImplemented else a.copy_(result)

    return compute
