"""Special functions and sign tests as eager computes them.

``erfc`` and ``special.erfcx`` (and ``special.log_ndtr``, which torch decomposes through
both): the translation computes ``erfc(x) = 1 - erf(x)``, which is 0 once erf rounds to 1
(x > ~4) and has lost most of its digits well before, and ``erfcx`` as ``exp(x**2)``
times that: 0, then NaN past exp's range. Here ``erfc(x) = t exp(-x**2 + P(t))`` with
``t = 1 / (1 + |x| / 2)`` and Numerical Recipes' ten-term P (fractional error below 1.2e-7
for every x), so that ``erfcx(|x|) = t exp(P(t))`` never forms either factor.

``signbit``: the translation tested ``x < 0``, False for -0.0; the sign of a zero shows
in the sign of its reciprocal.
"""

from __future__ import annotations

from typing import Any

import torch

from qaic_dynamo.errors import LoweringError

__all__ = ["erfc", "erfcx", "signbit"]

#: P(t)'s coefficients, constant term first (Numerical Recipes' ``erfcc``).
_ERFCC = (
    -1.26551223,
    1.00002368,
    0.37409196,
    0.09678418,
    -0.18628806,
    0.27886807,
    -1.13520398,
    1.48851587,
    -0.82215223,
    0.17087277,
)


def _t_and_poly(x: Any, name: str) -> Any:
    if x.dtype == torch.float64:
        # The formula's 1.2e-7 would be a silent loss of precision for a double.
        raise LoweringError(f"{name} in float64: no translation is exact to a double; such a piece runs eagerly")
    a = x.abs()
    t = 1 / (1 + 0.5 * a)
    poly = torch.full_like(t, _ERFCC[-1])
    for c in reversed(_ERFCC[:-1]):
        poly = poly * t + c
    return a, t, poly


def erfcx(x: Any) -> Any:
    """``exp(x**2) erfc(x)``: ``t exp(P(t))`` for x >= 0, ``2 exp(x**2) - erfcx(-x)`` below."""
    if not x.is_floating_point():
        return NotImplemented
    _, t, poly = _t_and_poly(x, "special.erfcx")
    at_abs = t * torch.exp(poly)
    return torch.where(x < 0, 2 * torch.exp(x * x) - at_abs, at_abs)


def erfc(x: Any) -> Any:
    """``erfc(x) = t exp(-x**2 + P(t))`` for x >= 0 and ``2 - erfc(-x)`` below: the
    translation's ``1 - erf(x)`` is 0 past x = 4 and loses its digits well before. The
    ``exp(-x**2)`` factor is split as ``exp(-z**2) exp((z - x)(z + x))`` with ``z`` x
    rounded to 1/16, whose square float32 holds exactly (as erfc implementations do)."""
    if not x.is_floating_point():
        return NotImplemented
    a, t, poly = _t_and_poly(x, "erfc")
    z = torch.floor(a * 16) / 16
    at_abs = t * torch.exp(-z * z) * torch.exp((z - a) * (z + a) + poly)
    return torch.where(x < 0, 2 - at_abs, at_abs)


def signbit(x: Any) -> Any:
    """True for negative numbers and -0.0 (integers: the translation's ``x < 0`` is right)."""
    if not x.is_floating_point():
        return NotImplemented
    # Bool "and" / "or" as integer arithmetic (they trace to prims.bitwise_*, untranslated).
    negative = (x < 0).to(torch.int32)
    negative_zero = (x == 0).to(torch.int32) * ((1 / x) < 0).to(torch.int32)
    return negative + negative_zero > 0
