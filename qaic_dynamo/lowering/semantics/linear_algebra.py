"""Matrix products as eager computes them.

``addmm`` with an empty inner dimension: ONNX Runtime's Gemm returned ``input`` unscaled
(``beta`` ignored) when ``mat1 @ mat2`` has no terms; eager gives ``beta * input``.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["addmm_maybe_empty_inner"]


def addmm_maybe_empty_inner(input: Any, mat1: Any, mat2: Any, *, beta: Any = 1, alpha: Any = 1) -> Any:
    """``beta * input + alpha * (mat1 @ mat2)`` spelled out where the inner dimension may be
    0; a known non-zero one keeps the translation (one Gemm)."""
    inner = mat1.shape[1]
    if isinstance(inner, int) and inner != 0:
        return NotImplemented
    product = torch.mm(mat1, mat2)
    if alpha != 1:
        product = product * alpha
    if beta == 0:  # eager ignores input then, NaN included
        return product
    return (input * beta if beta != 1 else input) + product
