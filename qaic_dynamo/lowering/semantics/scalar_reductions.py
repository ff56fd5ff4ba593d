"""Reductions and squeezes of a 0-d tensor, which eager accepts and ONNX cannot express.

Eager reduces a 0-d tensor over ``dim=0`` or ``dim=-1`` (``x.amax(0)``, ``x.topk(1)``,
``F.normalize(x, dim=0)``): the result is the element itself, 0-d. The translations
emit ReduceMax / ReduceProd / TopK / ReduceL2 with ``axes=[0]`` on a rank-0 input, which
ONNX's shape inference rejects (the piece then ran eagerly). Here each is the identity it
is, with eager's result dtype. Also ``squeeze(dim)`` of a dimension whose size is not 1,
a no-op in eager and a shape-inference error as ONNX's Squeeze.

Each function returns ``NotImplemented`` for any other input, so the translation (or the
next semantics entry, :func:`first_of`) handles it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

__all__ = [
    "aminmax_of_scalar",
    "first_of",
    "identity_of_scalar",
    "logical_all_of_scalar",
    "norm_of_scalar",
    "squeeze_sized",
    "sum_of_scalar",
    "topk_of_scalar",
]


def first_of(*fns: Callable[..., Any]) -> Callable[..., Any]:
    """The first of ``fns`` that does not return NotImplemented."""

    def run(*args: Any, **kwargs: Any) -> Any:
        for fn in fns:
            out = fn(*args, **kwargs)
            if out is not NotImplemented:
                return out
        return NotImplemented

    return run


def _promoted(x: Any, dtype: Any) -> Any:
    """sum / prod's result dtype: ``dtype``, else int64 for an integer or bool input."""
    if dtype is not None:
        return x.to(dtype)
    if not (x.is_floating_point() or x.is_complex()):
        return x.to(torch.int64)
    return x.clone()


def identity_of_scalar(x: Any, *args: Any, dtype: Any = None, **kwargs: Any) -> Any:
    """``amax`` / ``amin`` / ``mean`` of a 0-d tensor over its one implicit dim."""
    if x.dim() != 0:
        return NotImplemented
    return x.to(dtype) if dtype is not None else x.clone()


def sum_of_scalar(x: Any, *args: Any, dtype: Any = None, **kwargs: Any) -> Any:
    """``sum`` / ``prod`` over a dim of a 0-d tensor, with their integer promotion."""
    return _promoted(x, dtype) if x.dim() == 0 else NotImplemented


def aminmax_of_scalar(x: Any, *, dim: Any = None, keepdim: bool = False) -> Any:
    return (x.clone(), x.clone()) if x.dim() == 0 else NotImplemented


def topk_of_scalar(x: Any, k: int, dim: int = -1, largest: bool = True, sorted: bool = True) -> Any:  # noqa: A002
    if x.dim() != 0 or k != 1:
        return NotImplemented
    return x.clone(), torch.zeros((), dtype=torch.int64)


def logical_all_of_scalar(x: Any, *args: Any, **kwargs: Any) -> Any:
    if x.dim() != 0:
        return NotImplemented
    # eager's all keeps uint8 for a uint8 input (its legacy result type), else bool
    return (x != 0).to(torch.uint8) if x.dtype == torch.uint8 else x != 0


def norm_of_scalar(x: Any, ord: Any = 2, dim: Any = None, keepdim: bool = False, *, dtype: Any = None) -> Any:  # noqa: A002
    """A vector norm of one element: ``|x|``, or for ``ord=0`` whether it is non-zero."""
    if x.dim() != 0:
        return NotImplemented
    y = x.to(dtype) if dtype is not None else x
    return (y != 0).to(y.dtype) if ord == 0 else y.abs()


def squeeze_sized(x: Any, dim: Any = None) -> Any:
    """``squeeze`` of the listed dims that have size 1 only (eager skips the others)."""
    if dim is None or x.dim() == 0:
        return NotImplemented
    dims = [dim] if isinstance(dim, int) else list(dim)
    keep = [d % x.dim() for d in dims if x.shape[d] == 1]
    if len(keep) == len(dims):
        return NotImplemented
    return torch.squeeze(x, keep) if keep else x.clone()
