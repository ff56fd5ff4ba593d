"""Indexing and creation ops as eager computes them: ``scatter_reduce``, float16
``index_add`` / ``index_put``, and ``arange`` with float bounds."""

from __future__ import annotations

import math
from typing import Any

import torch

_aten = torch.ops.aten

__all__ = ["arange", "index_add_in_float32", "index_put_in_float32", "index_reduce", "scatter_reduce"]


def scatter_reduce(x: Any, dim: int, index: Any, src: Any, reduce: str, *, include_self: bool = True) -> Any:
    """``scatter_reduce`` where onnxscript's translation differs from eager: "mean" (it
    scatters without reducing: the last write wins) and a floating "amax" / "amin" that
    leaves out ``self`` (it fills the touched slots with the type's finite extreme, so an
    all -inf group came back as -3.4e38, not -inf)."""
    if reduce == "mean":
        touched = torch.zeros_like(x, dtype=torch.bool).scatter(dim, index, True)
        base = x if include_self else x.masked_fill(touched, 0)
        total = base.scatter_add(dim, index, src.to(x.dtype))
        count = torch.zeros_like(x).scatter_add(dim, index, torch.ones_like(index, dtype=x.dtype)) + int(include_self)
        count = count.clamp(min=1)  # an untouched slot keeps x (count 0 without self)
        mean = total / count if x.dtype.is_floating_point else total.div(count, rounding_mode="floor")
        return torch.where(touched, mean, x)
    if reduce in ("amax", "amin") and not include_self and x.dtype.is_floating_point:
        touched = torch.zeros_like(x, dtype=torch.bool).scatter(dim, index, True)
        identity = float("-inf") if reduce == "amax" else float("inf")
        return x.masked_fill(touched, identity).scatter_reduce(dim, index, src, reduce, include_self=True)
    return NotImplemented


def index_reduce(x: Any, dim: int, index: Any, source: Any, reduce: str, *, include_self: bool = True) -> Any:
    """``index_reduce`` (no ONNX function): a ``scatter_reduce`` of ``source`` with
    ``index`` spread along ``dim`` - the same reductions ("prod", "mean", "amax", "amin"),
    the same ``include_self``."""
    if x.dim() == 0:  # ONNX Runtime's ScatterElements takes no rank-0 data: as one element
        one = index_reduce(x.reshape(1), 0, index, source.reshape(1), reduce, include_self=include_self)
        return one.reshape(())
    d = dim % source.dim()
    spread = index.reshape([-1 if i == d else 1 for i in range(source.dim())]).expand(source.shape)
    out = scatter_reduce(x, dim, spread, source, reduce, include_self=include_self)
    return x.scatter_reduce(dim, spread, source, reduce, include_self=include_self) if out is NotImplemented else out


def arange(
    *args: Any, dtype: torch.dtype | None = None, layout: Any = None, device: Any = None, pin_memory: Any = None
) -> Any:
    """``arange`` with a float bound or step (or a float64 result) as eager computes it: the
    length ``ceil((end - start) / step)`` and every value ``start + i * step`` in double,
    then cast. onnxscript's translation runs ONNX Range in float32: arange(0.5, 3.2, 0.3)
    had 9 values (eager 10), and float64 ranges float32's rounding."""
    start, end, step = (0, args[0], 1) if len(args) == 1 else (*args, 1)[:3]
    if any(isinstance(v, (torch.SymInt, torch.SymFloat)) for v in (start, end, step)):
        return NotImplemented
    floats = any(isinstance(v, float) for v in (start, end, step))
    result = dtype or (torch.get_default_dtype() if floats else torch.int64)
    if not result.is_floating_point or (not floats and result != torch.float64):
        return NotImplemented  # an integer result truncates the bounds first, as the translation does
    n = max(0, math.ceil((end - start) / step))
    # (the float64 scalars stay exact: see _exact_float64_scalars)
    values = torch.arange(n, dtype=torch.int64, device=device).to(torch.float64) * float(step) + float(start)
    return values.to(result)


def index_add_in_float32(x: Any, dim: int, index: Any, source: Any, *, alpha: Any = 1) -> Any:
    """float16 / bfloat16 ``index_add`` in float32, rounded once: ONNX Runtime's CPU
    ScatterND has no float16 add reduction (every such piece failed at its first run and
    ran eagerly). Where eager's CPU kernel accumulates in float32 and rounds once too - a
    tensor of 2 or more dims indexed along its first or last dim, alpha 1 - the results are
    equal, duplicate indices included. Elsewhere (1-D, a middle dim, another alpha) it adds
    in float16 one write at a time, so where indices repeat the results differ: in the last
    places, or by more once eager's running sum stops growing in float16 (3000 ones added
    to one element: eager 2048, lowered 3000)."""
    if x.dtype not in (torch.float16, torch.bfloat16):
        return NotImplemented
    return _aten.index_add.default(x.float(), dim, index, source.float(), alpha=alpha).to(x.dtype)


def index_put_in_float32(x: Any, indices: Any, values: Any, accumulate: bool = False) -> Any:
    """float16 / bfloat16 ``index_put(..., accumulate=True)`` in float32, rounded once (no
    float16 add reduction in ONNX Runtime's ScatterND, as above). Eager's CPU kernel adds
    in float16 one write at a time, so where indices repeat the results can differ from
    eager in the last places (docs/usage.md)."""
    if not accumulate or x.dtype not in (torch.float16, torch.bfloat16):
        return NotImplemented
    return _aten.index_put.default(x.float(), indices, values.float(), True).to(x.dtype)
