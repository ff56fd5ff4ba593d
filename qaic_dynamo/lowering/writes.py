"""In-place writes in a piece: found, and refused where they would reach an input.

An artifact cannot write its inputs (only retained state, the KV cache through
``qaic::unified_kv_cache_update``): a piece that writes an input, or a view of one, in
place is refused, so it runs eagerly instead of losing the write. The Dynamo graph is
checked before the rewrite (:func:`written_tensors`), and the aten graph after the trace
for writes the first check did not recognise (a builtin such as ``torch.instance_norm``
has no signature to read): those are written back from the functional graph.
"""

from __future__ import annotations

import functools
import inspect
import operator
from collections.abc import Iterable
from typing import Any

import torch
import torch.fx as fx
from torch.multiprocessing.reductions import StorageWeakRef

from qaic_dynamo.errors import LoweringError

__all__ = [
    "input_write_error",
    "input_writes",
    "is_mutation",
    "refuse_writes",
    "returned_written_inputs",
    "writes_metadata",
    "written_tensors",
]


_INPLACE_OPERATORS = frozenset(
    {
        operator.setitem,
        operator.iadd,
        operator.isub,
        operator.imul,
        operator.itruediv,
        operator.ifloordiv,
        operator.imod,
        operator.ipow,
        operator.iand,
        operator.ior,
        operator.ixor,
        operator.ilshift,
        operator.irshift,
        operator.imatmul,
    }
)
_PLAIN_OPERATORS = frozenset({operator.and_, operator.or_, operator.not_, operator.is_})
_INPLACE_DUNDERS = frozenset(
    f"__i{op}__"
    for op in (
        "add",
        "sub",
        "mul",
        "truediv",
        "floordiv",
        "mod",
        "pow",
        "and",
        "or",
        "xor",
        "lshift",
        "rshift",
        "matmul",
    )
)
#: In-place ops that change a tensor's shape or strides, not its data (``v.squeeze_(1)``):
#: an input so changed is not written back - the piece runs eagerly, which keeps the view.
METADATA_WRITES = frozenset(
    {
        "squeeze_",
        "unsqueeze_",
        "transpose_",
        "t_",
        "swapaxes_",
        "swapdims_",
        "as_strided_",
        "resize_",
        "resize_as_",
        "set_",
        "detach_",
        "requires_grad_",
        "share_memory_",
    }
)


def writes_metadata(node: fx.Node) -> bool:
    """Whether ``node`` is one of :data:`METADATA_WRITES`."""
    target = node.target
    if node.op == "call_method":
        return target in METADATA_WRITES
    if isinstance(target, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
        return target.__name__.split(".")[0] in METADATA_WRITES
    return getattr(target, "__name__", "") in METADATA_WRITES


#: Flags that make a function write: ``F.relu(x, True)``, ``F.batch_norm(..., training=True)``
#: (its running statistics), ``F.instance_norm(..., use_input_stats=True)``.
_WRITE_FLAGS = ("inplace", "training", "use_input_stats")


@functools.cache
def _param_positions(target: Any, names: tuple[str, ...]) -> dict[str, int]:
    """Positions of ``names`` among ``target``'s parameters (none without a Python signature)."""
    try:
        params = list(inspect.signature(target).parameters)
    except (TypeError, ValueError):
        return {}
    return {n: params.index(n) for n in names if n in params}


def _argument(node: fx.Node, name: str, position: int | None) -> Any:
    if name in node.kwargs:
        return node.kwargs[name]
    return node.args[position] if position is not None and position < len(node.args) else None


def written_tensors(node: fx.Node) -> list[Any]:
    """The arguments a Dynamo-graph node writes in place (``x.add_(y)``, ``x[i] = v``,
    ``x += y``, ``torch.relu_(x)``, ``out=``, ``inplace=True`` by keyword or position, a
    batch norm's running statistics in training, a mutable op), or []."""
    target, args = node.target, node.args
    if node.op == "call_method":
        writes = (target.endswith("_") and not target.endswith("__")) or target in _INPLACE_DUNDERS
        return [args[0]] if writes and args else []
    if node.op != "call_function":
        return []
    if node.kwargs.get("out") is not None:
        return [node.kwargs["out"]]
    if isinstance(target, torch._ops.OpOverloadPacket):  # torch.ops.aten.foo called in the model
        target = _overload_for(target, node) or target
    if isinstance(target, torch._ops.OpOverload):
        return [
            args[i] if i < len(args) else node.kwargs.get(a.name)
            for i, a in enumerate(target._schema.arguments)
            if a.alias_info is not None and a.alias_info.is_write
        ]
    name = getattr(target, "__name__", "")
    # The trailing underscore marks torch's in-place functions (``torch.relu_``), but the
    # operator module's ``and_`` / ``or_`` / ``not_`` / ``is_`` (``a & b``) write nothing:
    # its in-place forms are the ``i``-prefixed ones.
    by_name = (name.endswith("_") and not name.endswith("__")) or name in _INPLACE_DUNDERS
    if target in _INPLACE_OPERATORS or (by_name and target not in _PLAIN_OPERATORS):
        return [args[0]] if args else []
    flags = _param_positions(target, _WRITE_FLAGS + ("running_mean", "running_var"))
    if _argument(node, "inplace", flags.get("inplace")) is True:
        return [args[0]] if args else [node.kwargs.get("input")]
    if any(_argument(node, f, flags.get(f)) is True for f in ("training", "use_input_stats")):
        return [_argument(node, n, flags.get(n)) for n in ("running_mean", "running_var")]
    return []


def input_writes(inputs: list[tuple[str, Any]], writes: Iterable[tuple[fx.Node, Any]]) -> dict[int, fx.Node]:
    """The inputs (by index) whose storage a written value (node, fake value) shares - a
    view of an input shares it too - each with the first node writing it. Raises for an
    input not in ``allowed`` ... when ``allowed`` is None-like: see :func:`refuse_writes`."""
    storages: dict[Any, list[int]] = {}
    for i, (_, val) in enumerate(inputs):
        if isinstance(val, torch.Tensor):
            storages.setdefault(StorageWeakRef(val.untyped_storage()), []).append(i)
    hits: dict[int, fx.Node] = {}
    for node, val in writes:
        for i in storages.get(StorageWeakRef(val.untyped_storage()), []) if isinstance(val, torch.Tensor) else []:
            hits.setdefault(i, node)
    return hits


def _overload_for(packet: Any, node: fx.Node) -> Any:
    """The overload of ``packet`` a call with ``node``'s arguments resolves to: the first
    (``default`` first) whose schema takes that many positional arguments and those
    keywords, or None."""
    names = sorted(packet.overloads(), key=lambda o: o != "default")
    for name in names:
        overload = getattr(packet, name)
        arguments = overload._schema.arguments
        positional = [a for a in arguments if not a.kwarg_only]
        required = [a for a in positional if not a.has_default_value()]
        if len(required) <= len(node.args) <= len(positional) and set(node.kwargs) <= {a.name for a in arguments}:
            return overload
    return None


def refuse_writes(
    inputs: list[tuple[str, Any]], writes: Iterable[tuple[fx.Node, Any]], allowed: frozenset[int] = frozenset()
) -> None:
    """Raise if a written value (node, fake value) shares its storage with an input's
    (name, fake value) other than the ``allowed`` ones (those written back)."""
    for i, node in input_writes(inputs, writes).items():
        if i not in allowed:
            raise input_write_error(node, i, inputs[i][0])


def input_write_error(node: fx.Node, index: int, name: str) -> LoweringError:
    return LoweringError(
        f"{node.name} ({node.op} {getattr(node.target, '__name__', node.target)}) writes in place into piece input "
        f"{index} ('{name}'), and an artifact cannot write its inputs. To compile it, return the new value instead "
        "of writing it in place (KV caches: qaic::unified_kv_cache_update)"
    )


def is_mutation(node: fx.Node) -> bool:
    return (
        node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload) and node.target._schema.is_mutable
    )


def returned_written_inputs(gm: fx.GraphModule) -> frozenset[int]:
    """The inputs (by index) of an aten graph that a mutable op writes and the graph
    returns itself: those the prepared piece writes back (their new value is already an
    output). Any other input written is written back from the functional graph's
    trailing copy (``aten_trace.written_back_outputs``)."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    output = gm.graph.output_node()
    # Returned as itself: the output is the placeholder, or an in-place op's result (which
    # make_fx records in its place) - either way the input's own memory.
    returned = {
        StorageWeakRef(v.untyped_storage())
        for n in output.all_input_nodes
        if isinstance(v := n.meta.get("val"), torch.Tensor)
    }
    written = input_writes(
        [(n.name, n.meta.get("val")) for n in placeholders],
        (
            (node, w.meta.get("val"))
            for node in gm.graph.nodes
            if is_mutation(node)
            for w in written_tensors(node)
            if isinstance(w, fx.Node)
        ),
    )
    return frozenset(i for i in written if StorageWeakRef(placeholders[i].meta["val"].untyped_storage()) in returned)
