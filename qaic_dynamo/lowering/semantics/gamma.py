"""The log-gamma family: ``lgamma``, ``digamma`` and ``polygamma`` (and what torch builds
on them: ``mvlgamma``, ``special.polygamma``), which have no ONNX operator.

* ``lgamma``: Lanczos' approximation (g = 7, nine terms) in double for ``x >= 1/2`` and
  the reflection ``log(pi / |sin(pi x)|) - lgamma(1 - x)`` below, with ``sin(pi x)``
  taken of ``x`` reduced to [-1, 1]; poles (0, -1, ...) and infinities give inf. Closer
  than a float32 ulp, so a float32 result rounds as eager's ``lgammaf``.
* ``digamma`` and ``polygamma(1, x)``: eager's own algorithms (Cephes'), step for step in
  the input's type - the recurrence pushing ``x`` past 10 at most ten steps, written out
  with a mask each, the reflection for negative ``x`` (digamma's ``pi / tan(pi r)`` in
  double, as eager) - so the rounding is eager's too. At a non-positive integer eager's
  trigamma divides by a rounding error (``sin(pi x)``, not 0): such a call runs eagerly.
* ``polygamma(n, x)``, n >= 2: ``(-1)^(n+1) n! zeta(n + 1, x)`` with eager's Hurwitz
  zeta in double: the direct sum until ``q + i > 9`` (at least nine terms), then twelve
  Euler-Maclaurin terms. For ``x < 0`` the direct sum grows with ``-x``; it is written
  out for ``x > -`` :data:`ZETA_NEGATIVE_LIMIT`, and a call with an element below runs
  eagerly (``eager_unless``).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from qaic_dynamo.lowering.semantics.common import FLOATS, eager_unless, is_float_tensor

__all__ = ["ZETA_NEGATIVE_LIMIT", "digamma", "lgamma", "polygamma", "zeta"]

#: Lanczos' coefficients for g = 7, n = 9.
_LANCZOS = (
    0.99999999999980993,
    676.5203681218851,
    -1259.1392167224028,
    771.32342877765313,
    -176.61502916214059,
    12.507343278686905,
    -0.13857109526572012,
    9.9843695780195716e-6,
    1.5056327351493116e-7,
)
#: digamma's asymptotic series (Cephes' A), highest power first.
_PSI_SERIES = (
    8.33333333333333333333e-2,
    -2.10927960927960927961e-2,
    7.57575757575757575758e-3,
    -4.16666666666666666667e-3,
    3.96825396825396825397e-3,
    -8.33333333333333333333e-3,
    8.33333333333333333333e-2,
)
_PSI_10 = 2.25175258906672110764
#: Hurwitz zeta's Euler-Maclaurin divisors (Cephes' A).
_ZETA_A = (
    12.0,
    -720.0,
    30240.0,
    -1209600.0,
    47900160.0,
    -1.8924375803183791606e9,
    7.47242496e10,
    -2.950130727918164224e12,
    1.1646782814350067249e14,
    -4.5979787224074726105e15,
    1.8152105401943546773e17,
    -7.1661652561756670113e18,
)
#: The direct sum of zeta(s, q) is written out for q down to minus this.
ZETA_NEGATIVE_LIMIT = 24


def lgamma(x: Any) -> Any:
    if not is_float_tensor(x):
        return NotImplemented
    y = x.double()
    reflect = y < 0.5
    z = torch.where(reflect, 1 - y, y) - 1
    series = torch.full_like(z, _LANCZOS[0])
    for i, c in enumerate(_LANCZOS[1:], start=1):
        series = series + c / (z + i)
    t = z + 7.5
    at_z = 0.5 * math.log(2 * math.pi) + (z + 0.5) * torch.log(t) - t + torch.log(series)
    # |sin(pi y)| = |sin(pi r)| with r = y - round(y) in [-1/2, 1/2], exact: sin is then
    # accurate to its last bits even where y is within an ulp of an integer
    r = y - torch.round(y)
    reflected = math.log(math.pi) - torch.log(torch.sin(math.pi * r).abs()) - at_z
    out = torch.where(reflect, reflected, at_z)
    out = torch.where((y == 1) | (y == 2), 0.0, out)  # exactly, as eager
    pole = (y <= 0) & (y == torch.floor(y))
    out = torch.where(pole | torch.isinf(y), float("inf"), out)
    return out.to(x.dtype)


def digamma(x: Any) -> Any:
    """Eager's ``calc_digamma``, in the input's type."""
    if not is_float_tensor(x):
        return NotImplemented
    negative = x < 0
    # the reflection term, pi / tan(pi r) with r = x's fractional part, in double
    r = (x - torch.trunc(x)).double()
    r = r - torch.round(r)  # tan has period pi: into [-1/2, 1/2], where sin and cos are accurate
    reflection = (math.pi * torch.cos(math.pi * r) / torch.sin(math.pi * r)).to(x.dtype)
    y = torch.where(negative, 1 - x, x)
    result = torch.zeros_like(x)
    for _ in range(10):  # x > 0 needs at most ten steps to pass 10
        below = y < 10
        result = torch.where(below, result - 1 / y, result)
        y = torch.where(below, y + 1, y)
    z = 1 / (y * y)
    poly = torch.zeros_like(z)
    for c in _PSI_SERIES:
        poly = poly * z + c
    tail = torch.where(y < 1.0e17, z * poly, 0.0)
    value = torch.where(y == 10, result + _PSI_10, result + torch.log(y) - 0.5 / y - tail)
    value = torch.where(negative, value - reflection, value)
    value = torch.where(negative & (x == torch.trunc(x)), float("nan"), value)
    zero_pole = torch.where(1 / x < 0, float("inf"), float("-inf"))  # copysign(inf, -x)
    return torch.where(x == 0, zero_pole, value)


def _trigamma(x: torch.Tensor) -> torch.Tensor:
    """Eager's ``trigamma``, in the input's type."""
    low = x < 0.5
    sin_pi_x = torch.sin(math.pi * x)
    result = torch.where(low, -(math.pi * math.pi) / (sin_pi_x * sin_pi_x), 0.0)
    y = torch.where(low, 1 - x, x)
    for _ in range(6):
        result = result + 1 / (y * y)
        y = y + 1
    ixx = 1 / (y * y)
    result = result + (1 + 1 / (2 * y) + ixx * (1.0 / 6 - ixx * (1.0 / 30 - ixx * (1.0 / 42)))) / y
    return torch.where(low, -result, result)


def _zeta(s: Any, q: torch.Tensor) -> torch.Tensor:
    """Eager's Hurwitz ``zeta(s, q)`` for ``s > 1`` (an int, or a double tensor), in double
    (``q`` double); the special values of ``s`` and ``q`` are :func:`zeta`'s."""
    # The direct sum runs while i < 9 or q + i <= 9: m terms past the first.
    m = torch.where(q > 0, 9.0, torch.clamp(torch.floor(9 - q) + 1, min=9.0))
    total = torch.pow(q, -s)
    for i in range(1, 9 + ZETA_NEGATIVE_LIMIT + 1):
        total = total + torch.where(i <= m, torch.pow(q + i, -s), 0.0)
    w = q + m
    b = torch.pow(w, -s)
    total = total + b * w / (s - 1) - 0.5 * b
    a, k = 1.0, 0.0
    for divisor in _ZETA_A:
        a *= s + k
        b = b / w
        total = total + a * b / divisor
        k += 1
        a *= s + k
        b = b / w
        k += 1
    pole = (q <= 0) & (q == torch.floor(q))
    return torch.where(pole, float("inf"), total)


def polygamma(n: int, x: Any) -> Any:
    if not is_float_tensor(x) or not isinstance(n, int) or n < 0:
        return NotImplemented
    if n == 0:
        return digamma(x)
    if n == 1:
        # At 0, -1, -2, ... eager's sin(pi x) is a rounding error, not 0, so it answers a
        # large finite number, which only eager gives.
        eager_unless(~((x <= 0) & (x == torch.floor(x))), "trigamma at a non-positive integer")
        return _trigamma(x)
    q = x.double()
    eager_unless(torch.isnan(q) | (q > -ZETA_NEGATIVE_LIMIT), f"polygamma of x below -{ZETA_NEGATIVE_LIMIT}")
    sign = 1.0 if n % 2 else -1.0
    return (sign * math.factorial(n) * _zeta(n + 1, q)).to(x.dtype)


def zeta(x: Any, q: Any) -> Any:
    """``special.zeta(x, q)``: eager's Hurwitz zeta, in double - inf at ``x == 1`` and at
    ``q`` a non-positive integer, NaN for ``x < 1`` and for a non-integer ``x`` with
    ``q <= 0``. The direct sum is written out for ``q > -``:data:`ZETA_NEGATIVE_LIMIT`;
    a call with a smaller ``q`` runs eagerly."""
    if not (isinstance(x, torch.Tensor) and isinstance(q, torch.Tensor)):
        return NotImplemented
    dtype = torch.result_type(x, q)
    if dtype not in FLOATS:
        return NotImplemented
    s, b = torch.broadcast_tensors(x.double(), q.double())
    eager_unless(torch.isnan(b) | (b > -ZETA_NEGATIVE_LIMIT), f"zeta of q below -{ZETA_NEGATIVE_LIMIT}")
    value = _zeta(torch.where(s > 1, s, 2.0), b)
    q_nonpositive = b <= 0
    value = torch.where(q_nonpositive & (s != torch.floor(s)), float("nan"), value)
    value = torch.where(q_nonpositive & (b == torch.floor(b)), float("inf"), value)
    value = torch.where(s < 1, float("nan"), value)
    value = torch.where(s == 1, float("inf"), value)
    # x = inf: eager's sum stops at its first term q**-inf where that is 1 or inf
    value = torch.where(torch.isinf(s) & (b == 1), 1.0, value)
    value = torch.where(torch.isinf(s) & (b > 0) & (b < 1), float("inf"), value)
    value = torch.where(torch.isnan(s) | torch.isnan(b), float("nan"), value)
    return value.to(dtype)
