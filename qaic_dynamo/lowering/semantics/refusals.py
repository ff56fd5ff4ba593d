"""Decompositions that stop the lowering: the piece runs eagerly, with the reason."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from qaic_dynamo.errors import LoweringError

__all__ = ["refusal", "refuse_divisor_override"]


def refusal(op: str, why: str) -> Callable[..., Any]:
    """A decomposition that stops the lowering: the piece runs eagerly, with ``why``."""

    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise LoweringError(f"{op}: {why}")

    return refuse


def refuse_divisor_override(
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
    raise LoweringError(
        "avg_pool with divisor_override: the translation ignores it (it divided by the window size); "
        "such a piece runs eagerly"
    )
