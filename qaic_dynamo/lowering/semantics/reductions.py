"""Reductions as eager computes them: integer sums exactly, float32 cumsum in double,
means over empty dims, variances over too few elements, ``any`` over nothing,
``amax``/``amin`` over every dim, and integer ``isclose`` and ``prod``."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

from qaic_dynamo.errors import LoweringError
from qaic_dynamo.lowering.semantics.common import REDUCED, integer_result, reduced_dims

__all__ = [
    "any_as_count",
    "exact_integer_sum",
    "float32_cumsum",
    "float_prod_over_dims",
    "integer_isclose",
    "kthvalue_by_sort",
    "mean_of_maybe_empty",
    "mean_of_all_maybe_empty",
    "var_of_maybe_few",
    "reduce_all_dims",
    "refuse_integer_prod",
]


def reduce_all_dims(op: Any) -> Callable[..., Any]:
    """``amax`` / ``amin`` with ``dim=[]`` (``x.amax()``: every dim, as eager) with the dims
    spelled out: onnxscript's translation requires them."""

    def reduce(x: Any, dim: Any = (), keepdim: bool = False) -> Any:
        if list(dim):
            return NotImplemented
        return op(x, list(range(x.dim())), keepdim) if x.dim() else x.clone()  # a 0-d tensor is its own max

    return reduce


def any_as_count(x: Any, dim: Any = None, keepdim: bool = False) -> Any:
    """``any`` as a count of non-zeros above 0: the translation's ReduceMax of nothing is
    int64's minimum, which casts to True, so ``x[:, n:].any(1)`` at ``n == x.shape[1]`` was
    True (eager False)."""
    dims = reduced_dims(x, dim)
    count = (x != 0).to(torch.float32)  # counts of ones: a positive float sum is never 0
    return (count.sum(dims, keepdim=keepdim) if x.dim() else count) > 0


def integer_isclose(a: Any, b: Any, rtol: float = 1e-05, atol: float = 1e-08, equal_nan: bool = False) -> Any:
    """``isclose`` of integer tensors with eager's formula (the tolerances in the default
    float type): the translation cast the tolerances to the integer type, 0, so
    ``isclose(1000000, 1000001)`` was False (eager True)."""
    if a.is_floating_point() or a.is_complex() or b.is_floating_point() or b.is_complex():
        return NotImplemented
    close = a == b
    if rtol == 0 and atol == 0:
        return close
    # in the default float type, as eager: an int64 difference would wrap at the extremes
    a, b = a.to(torch.get_default_dtype()), b.to(torch.get_default_dtype())
    allowed = atol + (rtol * b).abs()
    actual = (a - b).abs()
    # Bool "and" / "or" as integer arithmetic: they trace to prims.bitwise_* (no translation),
    # and ONNX Runtime's CPU Where has no bool kernel.
    within = (actual <= allowed).to(torch.int32)
    if actual.is_floating_point():
        within = within * torch.isfinite(actual).to(torch.int32)
    return close.to(torch.int32) + within > 0


def float32_cumsum(x: Any, dim: int, *, dtype: Any = None) -> Any:
    """A float32 ``cumsum`` accumulated in double, as eager's CPU kernel does (ONNX
    Runtime's CumSum in float32 gave ``[2**24, 1, 1, 1]`` a running sum stuck at 2**24)."""
    out = dtype or (x.dtype if x.is_floating_point() else None)
    if out != torch.float32:
        return NotImplemented
    return torch.cumsum(x.to(torch.float32).to(torch.float64), dim).to(torch.float32)  # (rounded first, as eager)


def mean_of_maybe_empty(x: Any, dim: Any, keepdim: bool = False, *, dtype: Any = None) -> Any:
    """A floating ``mean`` over dims that may be empty, as a sum over the count: eager's
    mean of nothing is NaN, the translation's ReduceMean gave 0. Dims of a known non-zero
    size keep the translation."""
    dims = reduced_dims(x, dim)
    sizes = [x.shape[d] for d in dims] if x.dim() else []
    if all(isinstance(n, int) and n > 0 for n in sizes) or not (dtype or x.dtype).is_floating_point:
        return NotImplemented
    count = math.prod(sizes)
    out = dtype or x.dtype
    if out in REDUCED:  # eager sums in float32, divides, then rounds once
        return (torch.sum(x, dims, keepdim=keepdim, dtype=torch.float32) / count).to(out)
    return torch.sum(x, dims, keepdim=keepdim, dtype=dtype) / count


def mean_of_all_maybe_empty(x: Any, *, dtype: Any = None) -> Any:
    """``x.mean()`` over every element, as :func:`mean_of_maybe_empty` (eager: NaN for none)."""
    return mean_of_maybe_empty(x, list(range(x.dim())), False, dtype=dtype)


def var_of_maybe_few(x: Any, dims: Any, correction: Any = 1, *, output_dtype: Any = None) -> Any:
    """``prims.var`` (under var, std and their _mean forms) over dims that may hold no more
    than ``correction`` elements, as eager divides: by ``max(N - correction, 0)``, so NaN
    for no elements (the translation gave 0 or -0) and inf or NaN for too few. Dims of a
    known size above the correction keep the translation."""
    dims = reduced_dims(x, dims)
    sizes = [x.shape[d] for d in dims] if x.dim() else []
    if all(isinstance(n, int) for n in sizes) and math.prod(sizes) > correction:
        return NotImplemented
    if not x.is_floating_point():
        return NotImplemented
    ones = torch.ones_like(x)
    mean = x.sum(dims, keepdim=True) / ones.sum(dims, keepdim=True)  # NaN over nothing
    squares = ((x - mean) ** 2).sum(dims)
    return squares / (ones.sum(dims) - correction).clamp(min=0)


def exact_integer_sum(x: Any, dim: Any = None, keepdim: bool = False, *, dtype: Any = None) -> Any:
    """An integer ``sum`` through CumSum in int64, which ONNX Runtime computes exactly: its
    CPU ReduceSum accumulates int64 in double (``[2**53 + 1, 2**53, 1]`` summed to
    ``2**54``) and saturates an int32 sum where eager wraps (the int64 sum cast to int32
    wraps, as eager's). The reduced dims are moved last and flattened; a zero in front
    makes an empty sum 0."""
    out = integer_result(x, dtype)
    if out is None:
        return NotImplemented
    x = x.to(torch.int64)
    n = x.dim()
    dims = sorted({d % n for d in dim} if dim is not None and len(dim) and n else range(n))
    if not dims:  # a 0-d tensor
        return x.to(out)
    kept = [d for d in range(n) if d not in dims]
    flat = x.permute(*kept, *dims).reshape(*[x.shape[d] for d in kept], math.prod(x.shape[d] for d in dims))
    flat = torch.cat([flat.new_zeros(*flat.shape[:-1], 1), flat], dim=-1)
    total = flat.cumsum(-1)[..., -1]
    if keepdim:
        for d in dims:
            total = total.unsqueeze(d)
    return total.to(out)


def refuse_integer_prod(x: Any, *args: Any, dtype: Any = None, **kwargs: Any) -> Any:
    if integer_result(x, dtype) is None:
        return NotImplemented
    raise LoweringError(
        "an integer prod: ONNX Runtime's CPU ReduceProd multiplies int64 in double (3**39 loses its "
        "last digits) and saturates an overflow where eager wraps; such a piece runs eagerly"
    )


def float_prod_over_dims(x: Any, dims: Any, *, output_dtype: Any = None) -> Any:
    """``prims.prod`` (``cumprod``'s and ``vander``'s decompositions reach it) as one
    ``prod`` per dim, which translates; no ONNX function took the prim. Integers stay
    eager, as ``refuse_integer_prod`` explains."""
    if not x.is_floating_point():
        return NotImplemented
    n = x.dim()
    out = x
    for d in sorted({d % n for d in dims} if dims is not None and n else range(n), reverse=True):
        out = torch.prod(out, d)
    if out is x:
        out = x.clone()
    return out.to(output_dtype) if output_dtype is not None else out


def kthvalue_by_sort(x: Any, k: int, dim: int = -1, keepdim: bool = False) -> Any:
    """``kthvalue`` as the k-th entry of a sort along ``dim`` (no ONNX function took it)."""
    if x.dim() == 0:
        return x.clone(), torch.zeros((), dtype=torch.int64)
    values, indices = torch.sort(x, dim)
    d = dim % x.dim()
    values, indices = values.narrow(d, k - 1, 1), indices.narrow(d, k - 1, 1)
    return (values, indices) if keepdim else (values.squeeze(d), indices.squeeze(d))
