"""Average pooling with ``divisor_override``, which the translation ignores (it divided
by the window size).

Without ``ceil_mode`` every window lies inside the padded input, so eager's result is the
window sum over the divisor, and the window sum is the translated average (padding
counted) times the window size. With ``ceil_mode`` a last window may be cut short, and
its sum is not that; such a piece still runs eagerly.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from qaic_dynamo.lowering.semantics.refusals import refuse_divisor_override

__all__ = ["avg_pool_with_divisor"]


def avg_pool_with_divisor(op: Any, dims: int) -> Callable[..., Any]:
    def pool(
        x: Any,
        kernel_size: Any,
        stride: Any = (),
        padding: Any = 0,
        ceil_mode: bool = False,
        count_include_pad: bool = True,
        divisor_override: Any = None,
    ) -> Any:
        if divisor_override is None:
            return NotImplemented
        if ceil_mode:
            return refuse_divisor_override(
                x, kernel_size, stride, padding, ceil_mode, count_include_pad, divisor_override
            )
        kernel = list(kernel_size) * dims if len(kernel_size) == 1 else list(kernel_size)
        window_sum = op(x, kernel_size, stride, padding, False, True, None) * math.prod(kernel)
        return window_sum / divisor_override

    return pool
