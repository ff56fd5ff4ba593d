"""The qaic ops' ONNX translations: onnxscript functions in domain ``com.qualcomm.cloud``.

They are onnxscript functions, so every lowered model carries their definition in
``model.functions`` and any ONNX runtime can execute them; the QAIC compiler maps the
domain to its own kernels.

``KVCacheScatter(cache, slot_mapping, updates)`` is ``qaic::kv_cache_scatter`` (the
functional ``reshape_and_cache``) in ONNX, for one cache; the op registry
(``qaic_dynamo.ops.QAIC_OPS``) names it as that op's ``onnx_function``:
  cache        [num_blocks, heads, block_size, head_size]  (retained state)
  slot_mapping [T] int64, -1 = padding
  updates      [T', heads, head_size], T' >= T (rows past T are padding)
It writes ``updates[t]`` to (slot // block_size, :, slot % block_size) with ScatterND.

How it reaches a model: torch.onnx's exporter converts every model to the requested opset
with onnxscript's version converter, which inlines all functions first, even when no
conversion is needed. So the translation emits a plain ``com.qualcomm.cloud``
``KVCacheScatter`` node (:data:`kv_cache_scatter_node`, an op with an explicit schema; the
converter leaves custom domains alone) and the lowering then attaches the function body
(:func:`function_protos`) to ``model.functions``. :data:`TRANSLATIONS` maps each
function name to the torch.onnx translation of the op it stands for.

Padding needs care: ScatterND reads a negative index as counting from the end, so a -1
slot would silently overwrite the last slot of the cache. Padded rows are therefore
*redirected* to repeat the first real token's write (same slot, same value): ScatterND
leaves the order of duplicate writes undefined, but when the duplicates carry identical
values every order gives the same result. A batch with no real token at all rewrites slot
0 with its own current value. Either way padding changes nothing.
"""

from __future__ import annotations

from typing import TypeVar, Union

import onnxscript
from onnx import defs
from onnxscript import opset18 as op
from onnxscript.onnx_types import BFLOAT16, FLOAT, FLOAT16, INT64
from onnxscript.values import Op, Opset

from qaic_dynamo.ops.registry import QAIC_DOMAIN

__all__ = [
    "TRANSLATIONS",
    "CtxGather",
    "CtxGatherCB",
    "CtxScatter",
    "CtxScatterCB",
    "KVCacheScatter",
    "function_protos",
    "kv_cache_scatter_node",
]
qaic_opset = Opset(QAIC_DOMAIN, 1)

# typing.Union, not ``|``: onnxscript's converter reads the bound and cannot read a types.UnionType.
TFloat = TypeVar("TFloat", bound=Union[FLOAT, FLOAT16, BFLOAT16])  # noqa: UP007


@onnxscript.script(qaic_opset, default_opset=op)
def KVCacheScatter(cache: TFloat, slot_mapping: INT64, updates: TFloat) -> TFloat:
    zero = op.Constant(value_ints=[0])
    one = op.Constant(value_ints=[1])
    two = op.Constant(value_ints=[2])
    three = op.Constant(value_ints=[3])
    four = op.Constant(value_ints=[4])
    shape = op.Shape(cache)
    heads = op.Slice(shape, one, two)
    block_size = op.Slice(shape, two, three)

    num_tokens = op.Shape(slot_mapping)
    rows = op.Slice(updates, zero, num_tokens)  # drop padding rows past the slot mapping
    valid = op.GreaterOrEqual(slot_mapping, op.Constant(value_int=0))

    # The write every padded row repeats: the first real token's, or slot 0's own value.
    first = op.ArgMax(op.Cast(valid, to=6), axis=0, keepdims=1)
    first_slot = op.Gather(slot_mapping, first)
    any_valid = op.GreaterOrEqual(first_slot, op.Constant(value_int=0))
    slot0 = op.Reshape(
        op.Gather(op.Gather(cache, zero, axis=0), zero, axis=2),
        op.Concat(one, heads, op.Slice(shape, three, four), axis=0),
    )
    fill_slot = op.Where(any_valid, first_slot, zero)
    fill_row = op.Where(op.Unsqueeze(any_valid, op.Constant(value_ints=[1, 2])), op.Gather(rows, first, axis=0), slot0)
    slot = op.Where(valid, slot_mapping, fill_slot)
    src = op.Where(op.Unsqueeze(valid, op.Constant(value_ints=[1, 2])), rows, fill_row)

    # indices [T, heads, 3] = (block, head, offset)
    grid = op.Concat(num_tokens, heads, axis=0)
    block = op.Expand(op.Unsqueeze(op.Div(slot, block_size), one), grid)
    offset = op.Expand(op.Unsqueeze(op.Mod(slot, block_size), one), grid)
    head = op.Expand(
        op.Unsqueeze(op.Range(op.Constant(value_int=0), op.Squeeze(heads, zero), op.Constant(value_int=1)), zero),
        grid,
    )
    indices = op.Concat(op.Unsqueeze(block, two), op.Unsqueeze(head, two), op.Unsqueeze(offset, two), axis=2)
    return op.ScatterND(cache, indices, src)


@onnxscript.script(qaic_opset, default_opset=op)
def CtxScatter(data: TFloat, position_ids: INT64, updates: TFloat) -> TFloat:
    """QEfficient's retained-state write: updates[b, h, s] -> data[b, h, position_ids[b, s]].

    A padded position (-1) repeats its row's first real write (same slot, same value), or
    rewrites slot 0 with its own value in a row with no real token: as in KVCacheScatter,
    ScatterND's undefined order among duplicates cannot matter, and padding writes nothing
    new (a raw -1 would count from the end and overwrite the last slot).
    """
    zero = op.Constant(value_ints=[0])
    one = op.Constant(value_ints=[1])
    two = op.Constant(value_ints=[2])
    three = op.Constant(value_ints=[3])
    shape = op.Shape(data)
    pshape = op.Shape(position_ids)
    batch = op.Slice(pshape, zero, one)
    seq = op.Slice(pshape, one, two)
    heads = op.Slice(shape, one, two)
    head_dim = op.Slice(shape, three, op.Constant(value_ints=[4]))

    valid = op.GreaterOrEqual(position_ids, op.Constant(value_int=0))  # [B, S]
    first = op.ArgMax(op.Cast(valid, to=6), axis=1, keepdims=1)  # [B, 1]
    first_pos = op.GatherElements(position_ids, first, axis=1)  # [B, 1]
    any_valid = op.GreaterOrEqual(first_pos, op.Constant(value_int=0))
    fill_pos = op.Where(any_valid, first_pos, op.Constant(value_int=0))
    pos = op.Where(valid, position_ids, fill_pos)  # [B, S]

    # The value each padded token writes: its row's first real update, or slot 0's own.
    row_shape = op.Concat(batch, heads, one, head_dim, axis=0)
    first_idx = op.Expand(op.Unsqueeze(first, op.Constant(value_ints=[1, 3])), row_shape)  # [B, H, 1, D]
    first_update = op.GatherElements(updates, first_idx, axis=2)
    slot0 = op.Slice(data, zero, one, two)  # [B, H, 1, D]
    any4 = op.Unsqueeze(any_valid, op.Constant(value_ints=[1, 3]))  # [B, 1, 1, 1]
    fill = op.Where(any4, first_update, slot0)
    valid4 = op.Unsqueeze(valid, op.Constant(value_ints=[1, 3]))  # [B, 1, S, 1]
    src = op.Where(valid4, updates, fill)  # [B, H, S, D]

    # indices [B, H, S, 3] = (b, h, pos[b, s])
    grid = op.Concat(batch, heads, seq, axis=0)
    b_idx = op.Expand(
        op.Unsqueeze(
            op.Range(op.Constant(value_int=0), op.Squeeze(batch, zero), op.Constant(value_int=1)),
            op.Constant(value_ints=[1, 2]),
        ),
        grid,
    )
    h_idx = op.Expand(
        op.Unsqueeze(
            op.Range(op.Constant(value_int=0), op.Squeeze(heads, zero), op.Constant(value_int=1)),
            op.Constant(value_ints=[0, 2]),
        ),
        grid,
    )
    p_idx = op.Expand(op.Unsqueeze(pos, one), grid)
    indices = op.Concat(op.Unsqueeze(b_idx, three), op.Unsqueeze(h_idx, three), op.Unsqueeze(p_idx, three), axis=3)
    return op.ScatterND(data, indices, src)


@onnxscript.script(qaic_opset, default_opset=op)
def CtxGather(data: TFloat, ctx_indices: INT64) -> TFloat:
    """QEfficient's retained-state read: data[b, h, ctx_indices[b, h, n]] -> [B, H, N, D]."""
    return op.GatherND(data, op.Unsqueeze(ctx_indices, op.Constant(value_ints=[3])), batch_dims=2)


@onnxscript.script(qaic_opset, default_opset=op)
def CtxScatterCB(data: TFloat, batch_index: INT64, position_ids: INT64, updates: TFloat) -> TFloat:
    """QEfficient's continuous-batching write: updates[b, h, s] -> data[batch_index[b], h,
    position_ids[b, s]]; rows not named keep their values. Padding (-1) repeats the row's
    first real write, or rewrites slot 0 of its cache row with its own value, as CtxScatter."""
    zero = op.Constant(value_ints=[0])
    one = op.Constant(value_ints=[1])
    two = op.Constant(value_ints=[2])
    three = op.Constant(value_ints=[3])
    shape = op.Shape(data)
    pshape = op.Shape(position_ids)
    batch = op.Slice(pshape, zero, one)
    seq = op.Slice(pshape, one, two)
    heads = op.Slice(shape, one, two)
    head_dim = op.Slice(shape, three, op.Constant(value_ints=[4]))

    valid = op.GreaterOrEqual(position_ids, op.Constant(value_int=0))  # [B, S]
    first = op.ArgMax(op.Cast(valid, to=6), axis=1, keepdims=1)  # [B, 1]
    first_pos = op.GatherElements(position_ids, first, axis=1)  # [B, 1]
    any_valid = op.GreaterOrEqual(first_pos, op.Constant(value_int=0))
    fill_pos = op.Where(any_valid, first_pos, op.Constant(value_int=0))
    pos = op.Where(valid, position_ids, fill_pos)  # [B, S]

    # (row, h, 0) of every batch entry: its cache row's slot 0, read when a row is all padding.
    h_range = op.Range(op.Constant(value_int=0), op.Squeeze(heads, zero), op.Constant(value_int=1))
    grid0 = op.Concat(batch, heads, one, axis=0)
    row0 = op.Expand(op.Unsqueeze(batch_index, op.Constant(value_ints=[2])), grid0)  # [B, H, 1]
    head0 = op.Expand(op.Unsqueeze(h_range, op.Constant(value_ints=[0, 2])), grid0)
    zeros0 = op.Expand(op.Constant(value_ints=[0]), grid0)
    idx0 = op.Concat(op.Unsqueeze(row0, three), op.Unsqueeze(head0, three), op.Unsqueeze(zeros0, three), axis=3)
    slot0 = op.GatherND(data, idx0)  # [B, H, 1, D]

    row_shape = op.Concat(batch, heads, one, head_dim, axis=0)
    first_idx = op.Expand(op.Unsqueeze(first, op.Constant(value_ints=[1, 3])), row_shape)  # [B, H, 1, D]
    first_update = op.GatherElements(updates, first_idx, axis=2)
    any4 = op.Unsqueeze(any_valid, op.Constant(value_ints=[1, 3]))  # [B, 1, 1, 1]
    fill = op.Where(any4, first_update, slot0)
    valid4 = op.Unsqueeze(valid, op.Constant(value_ints=[1, 3]))  # [B, 1, S, 1]
    src = op.Where(valid4, updates, fill)  # [B, H, S, D]

    # indices [B, H, S, 3] = (batch_index[b], h, pos[b, s])
    grid = op.Concat(batch, heads, seq, axis=0)
    b_idx = op.Expand(op.Unsqueeze(batch_index, op.Constant(value_ints=[2])), grid)
    h_idx = op.Expand(op.Unsqueeze(h_range, op.Constant(value_ints=[0, 2])), grid)
    p_idx = op.Expand(op.Unsqueeze(pos, one), grid)
    indices = op.Concat(op.Unsqueeze(b_idx, three), op.Unsqueeze(h_idx, three), op.Unsqueeze(p_idx, three), axis=3)
    return op.ScatterND(data, indices, src)


@onnxscript.script(qaic_opset, default_opset=op)
def CtxGatherCB(data: TFloat, batch_index: INT64, ctx_indices: INT64) -> TFloat:
    """QEfficient's continuous-batching read: data[batch_index[b], h, ctx_indices[b, h, n]]
    -> [B, H, N, D]."""
    one = op.Constant(value_ints=[1])
    three = op.Constant(value_ints=[3])
    ishape = op.Shape(ctx_indices)  # [B, H, N]
    heads = op.Slice(ishape, one, op.Constant(value_ints=[2]))
    h_range = op.Range(
        op.Constant(value_int=0), op.Squeeze(heads, op.Constant(value_ints=[0])), op.Constant(value_int=1)
    )
    b_idx = op.Expand(op.Unsqueeze(batch_index, op.Constant(value_ints=[2])), ishape)
    h_idx = op.Expand(op.Unsqueeze(h_range, op.Constant(value_ints=[0, 2])), ishape)
    indices = op.Concat(
        op.Unsqueeze(b_idx, three), op.Unsqueeze(h_idx, three), op.Unsqueeze(ctx_indices, three), axis=3
    )
    return op.GatherND(data, indices)


def _schema(name: str, inputs: list[tuple[str, str]], output: str) -> defs.OpSchema:
    return defs.OpSchema(
        name,
        QAIC_DOMAIN,
        1,
        inputs=[defs.OpSchema.FormalParameter(n, t) for n, t in inputs],
        outputs=[defs.OpSchema.FormalParameter(output, "T")],
        type_constraints=[("T", ["tensor(float)", "tensor(float16)", "tensor(bfloat16)"], "cache dtype")],
    )


ctx_scatter_node = Op(
    qaic_opset,
    "CtxScatter",
    _schema("CtxScatter", [("data", "T"), ("position_ids", "tensor(int64)"), ("updates", "T")], "out"),
)
ctx_gather_node = Op(
    qaic_opset, "CtxGather", _schema("CtxGather", [("data", "T"), ("ctx_indices", "tensor(int64)")], "out")
)
ctx_scatter_cb_node = Op(
    qaic_opset,
    "CtxScatterCB",
    _schema(
        "CtxScatterCB",
        [("data", "T"), ("batch_index", "tensor(int64)"), ("position_ids", "tensor(int64)"), ("updates", "T")],
        "out",
    ),
)
ctx_gather_cb_node = Op(
    qaic_opset,
    "CtxGatherCB",
    _schema("CtxGatherCB", [("data", "T"), ("batch_index", "tensor(int64)"), ("ctx_indices", "tensor(int64)")], "out"),
)


_SCHEMA = defs.OpSchema(
    "KVCacheScatter",
    QAIC_DOMAIN,
    1,
    inputs=[
        defs.OpSchema.FormalParameter("cache", "T"),
        defs.OpSchema.FormalParameter("slot_mapping", "tensor(int64)"),
        defs.OpSchema.FormalParameter("updates", "T"),
    ],
    outputs=[defs.OpSchema.FormalParameter("updated_cache", "T")],
    type_constraints=[("T", ["tensor(float)", "tensor(float16)", "tensor(bfloat16)"], "cache dtype")],
)

#: Calling this inside a torch.onnx custom translation emits one KVCacheScatter node.
kv_cache_scatter_node = Op(qaic_opset, "KVCacheScatter", _SCHEMA)

_FUNCTIONS = {
    "KVCacheScatter": KVCacheScatter,
    "CtxScatter": CtxScatter,
    "CtxGather": CtxGather,
    "CtxScatterCB": CtxScatterCB,
    "CtxGatherCB": CtxGatherCB,
}


def _translate_kv_cache_scatter(key, value, key_cache, value_cache, slot_mapping):
    """torch.onnx translation of ``qaic::kv_cache_scatter``: one KVCacheScatter per cache."""
    return (
        kv_cache_scatter_node(key_cache, slot_mapping, key),
        kv_cache_scatter_node(value_cache, slot_mapping, value),
    )


#: ONNX function name (a registry entry's ``onnx_function``) -> torch.onnx translation.
TRANSLATIONS = {
    "KVCacheScatter": _translate_kv_cache_scatter,
    "CtxScatter": lambda data, position_ids, updates: ctx_scatter_node(data, position_ids, updates),
    "CtxGather": lambda data, ctx_indices: ctx_gather_node(data, ctx_indices),
    "CtxScatterCB": lambda data, batch_index, position_ids, updates: ctx_scatter_cb_node(
        data, batch_index, position_ids, updates
    ),
    "CtxGatherCB": lambda data, batch_index, ctx_indices: ctx_gather_cb_node(data, batch_index, ctx_indices),
}


def function_protos(used: set[str]) -> list:
    """FunctionProtos of the qaic functions named in ``used``."""
    return [_FUNCTIONS[name].to_function_proto() for name in sorted(used) if name in _FUNCTIONS]
