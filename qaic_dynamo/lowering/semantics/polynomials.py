"""The orthogonal polynomials of ``torch.special`` (Chebyshev T/U/V/W and their shifted
forms, Hermite H/He, Laguerre L, Legendre P), as eager's CPU kernels compute them.

Eager evaluates each element by its own special cases (``n < 0``, ``|x| == 1``, ...), a
closed form where one is accurate (``cos(n acos x)`` for Chebyshev T with ``|x| < 1``
and ``n > 6``) and otherwise the three-term recurrence, ``n - 1`` steps. ONNX has no
such op. Here every branch is computed and the element's branch selected, in eager's
order; the recurrence is written out to :data:`MAX_DEGREE` steps and each element takes
the step its degree names. An element that needs more steps than that makes the whole
call run eagerly (:func:`~qaic_dynamo.lowering.semantics.common.eager_unless`), so no
degree is ever answered wrong. A degree given as a number is static: exactly its steps
are written out.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

from qaic_dynamo.errors import LoweringError
from qaic_dynamo.lowering.semantics.common import FLOATS, eager_unless

__all__ = ["MAX_DEGREE", "POLYNOMIALS"]

#: Recurrence steps written out for a degree given as a tensor.
MAX_DEGREE = 32
#: A degree given as a number is unrolled up to this.
MAX_STATIC_DEGREE = 256

Branches = list[tuple[torch.Tensor, Any]]
Step = Callable[[int, torch.Tensor, torch.Tensor], torch.Tensor]


def _select(default: torch.Tensor, branches: Branches) -> torch.Tensor:
    """The first branch whose condition holds, else ``default`` (per element)."""
    out = default
    for cond, value in reversed(branches):
        out = torch.where(cond, value, out)
    return out


def _recurrence(k: torch.Tensor, v1: torch.Tensor, step: Step, steps: int) -> torch.Tensor:
    """``v_k`` of the recurrence from ``v_0 = 1`` and ``v_1`` (``step(j, v_{j-2}, v_{j-1})``
    gives ``v_j``), for every element's ``k`` in 1..steps."""
    out = v1
    p, q = torch.ones_like(v1), v1
    for j in range(2, steps + 1):
        r = step(j, p, q)
        out = torch.where(k == j, r, out)
        p, q = q, r
    return out


def _chebyshev(t_of: Callable[[torch.Tensor], torch.Tensor], kind: str, shifted: bool, closed_above: int) -> Any:
    """Chebyshev ``kind`` (T, U, V, W) in ``t = t_of(x)`` with eager's special cases."""

    def branches(x: torch.Tensor, n: torch.Tensor) -> Branches:
        if x.dtype == torch.float64:
            raise LoweringError(
                f"{'shifted ' if shifted else ''}Chebyshev {kind} in float64: ONNX Runtime has no double Acos; runs eagerly"
            )
        t = t_of(x)
        even = torch.remainder(n, 2) == 0
        one = torch.ones_like(t)
        odd_n = 2 * n + 1
        if shifted:
            at_one, at_minus_one = x == 1, x == 0
        else:
            at_one, at_minus_one = (t.abs() == 1) & (t > 0), (t.abs() == 1) & ~(t > 0)
        theta = torch.acos(t)
        if kind == "T":
            ends = [(at_one, one), (at_minus_one, torch.where(even, one, -one))]
            closed = torch.cos(n * theta)
        elif kind == "U":
            ends = [(at_one, n + 1), (at_minus_one, torch.where(even, n + 1, -(n + 1)))]
            s = torch.sin(theta)
            closed = torch.where(s != 0, torch.sin((n + 1) * theta) / s, (n + 1) * torch.cos((n + 1) * theta) / t)
        elif kind == "V":
            ends = [(at_one, one), (at_minus_one, torch.where(even, odd_n, -odd_n))]
            closed = torch.where(
                torch.sin(theta / 2) != 1,
                torch.cos((n + 0.5) * theta) / torch.cos(theta / 2),
                torch.where(even, odd_n, -odd_n),
            )
        else:  # W
            ends = [(at_one, odd_n), (at_minus_one, torch.where(even, one, -one))]
            plain_end = torch.where(x > 0, odd_n, torch.where(even, one, -one))
            closed = torch.where(
                torch.cos(theta / 2) != 1,
                torch.sin((n + 0.5) * theta) / torch.sin(theta / 2),
                torch.where(even, one, -one) if shifted else plain_end,
            )
        return [*ends, ((n > closed_above) & (t.abs() < 1), closed), (n == 0, one)]

    def recurrence(x: torch.Tensor) -> tuple[torch.Tensor, Step]:
        t = t_of(x)
        v1 = {"T": t, "U": t + t, "V": t + t - 1, "W": t + t + 1}[kind]
        return v1, lambda j, p, q: (t + t) * q - p

    return branches, recurrence


def _hermite(physicists: bool) -> Any:
    def branches(x: torch.Tensor, n: torch.Tensor) -> Branches:
        limit = 128 if x.dtype == torch.float32 else 512  # eager's getHermitianLimit
        return [(n == 0, torch.ones_like(x)), (n > limit, torch.full_like(x, float("nan")))]

    def recurrence(x: torch.Tensor) -> tuple[torch.Tensor, Step]:
        if physicists:
            return x + x, lambda j, p, q: (x + x) * q - (2 * (j - 1)) * p
        return x, lambda j, p, q: x * q - (j - 1) * p

    return branches, recurrence


def _laguerre_branches(x: torch.Tensor, n: torch.Tensor) -> Branches:
    one = torch.ones_like(x)
    return [(x.abs() == 0, one), (n == 0, one)]


def _laguerre_recurrence(x: torch.Tensor) -> tuple[torch.Tensor, Step]:
    return 1 - x, lambda j, p, q: (((j - 1) * 2 + (1 - x)) * q - (j - 1) * p) / j


def _legendre_branches(x: torch.Tensor, n: torch.Tensor) -> Branches:
    one = torch.ones_like(x)
    even = torch.remainder(n, 2) == 0
    return [(x.abs() == 1, torch.where((x > 0) | even, one, -one)), (n == 0, one)]


def _legendre_recurrence(x: torch.Tensor) -> tuple[torch.Tensor, Step]:
    return x, lambda j, p, q: ((2 * (j - 1) + 1) * x * q - (j - 1) * p) / j


def _polynomial(name: str, special: tuple[Callable[..., Branches], Callable[..., Any]]) -> Callable[..., Any]:
    branches_of, recurrence_of = special

    def evaluate(x: Any, n: Any) -> Any:
        if not isinstance(x, torch.Tensor) and not isinstance(n, torch.Tensor):
            return NotImplemented
        dtype = torch.result_type(x, n)
        if dtype not in FLOATS:
            return NotImplemented  # integer or reduced-float results: the op as it is
        like = x if isinstance(x, torch.Tensor) else n
        xt = x.to(dtype) if isinstance(x, torch.Tensor) else torch.full_like(like, x, dtype=dtype)
        if isinstance(n, torch.Tensor):
            nt = torch.trunc(n.to(dtype))
            steps = MAX_DEGREE
        else:  # a number: exactly the steps it needs
            degree = int(n) if math.isfinite(n) else -1
            if degree > MAX_STATIC_DEGREE:
                raise LoweringError(f"{name} of degree {degree}: unrolled up to {MAX_STATIC_DEGREE}; runs eagerly")
            steps = max(degree, 1)
            nt = torch.full_like(like, float(degree), dtype=dtype)
        xt, nt = torch.broadcast_tensors(xt, nt)
        # A NaN or infinite degree casts to INT64_MIN in eager's kernel: negative, so 0.
        negative = (nt < 0) | ~torch.isfinite(nt)
        branches = branches_of(xt, nt)
        k = torch.where(negative, -1.0, nt.clamp(max=steps + 1)).to(torch.int64)
        # In double: eager's kernel (compiled with fused multiply-adds) rounds less than
        # float32 steps do - 13x less at degree 32 - and double rounds less than either.
        v1, step = recurrence_of(xt.double())
        recurrence = _recurrence(k, v1, step, steps).to(dtype)
        taken = torch.zeros_like(negative)
        for cond, _ in branches:
            taken = taken | cond
        if isinstance(n, torch.Tensor):
            eager_unless(negative | taken | (nt <= steps), f"{name} of a degree above {steps}")
        return _select(recurrence, [(negative, torch.zeros_like(xt)), *branches])

    return evaluate


def _shift(x: torch.Tensor) -> torch.Tensor:
    return x + x - 1


_CHEBYSHEV = {
    "chebyshev_polynomial_t": _chebyshev(lambda x: x, "T", False, 6),
    "chebyshev_polynomial_u": _chebyshev(lambda x: x, "U", False, 8),
    "chebyshev_polynomial_v": _chebyshev(lambda x: x, "V", False, 8),
    "chebyshev_polynomial_w": _chebyshev(lambda x: x, "W", False, 8),
    "shifted_chebyshev_polynomial_t": _chebyshev(_shift, "T", True, 6),
    "shifted_chebyshev_polynomial_u": _chebyshev(_shift, "U", True, 6),
    "shifted_chebyshev_polynomial_v": _chebyshev(_shift, "V", True, 6),
    "shifted_chebyshev_polynomial_w": _chebyshev(_shift, "W", True, 4),
    "hermite_polynomial_h": _hermite(physicists=True),
    "hermite_polynomial_he": _hermite(physicists=False),
    "laguerre_polynomial_l": (_laguerre_branches, _laguerre_recurrence),
    "legendre_polynomial_p": (_legendre_branches, _legendre_recurrence),
}

#: aten op (every overload: tensor x and n, scalar x, scalar n) -> its evaluation.
POLYNOMIALS: dict[Any, Callable[..., Any]] = {
    getattr(getattr(torch.ops.aten, f"special_{name}"), overload): _polynomial(f"special.{name}", special)
    for name, special in _CHEBYSHEV.items()
    for overload in ("default", "x_scalar", "n_scalar")
}
