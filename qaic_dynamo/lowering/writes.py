"""In-place writes in a piece: found, and refused where they would reach an input.

An artifact cannot write its inputs (only retained state, the KV cache through
``qaic::unified_kv_cache_update``): a piece that writes an input, or a view of one, in
place is refused, so it runs eagerly instead of losing the write. The Dynamo graph is
checked before the rewrite (:func:`written_tensors`), and the aten graph after the trace
(:func:`refuse_aten_input_writes`) for writes the first check did not recognise.
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

__all__ = ["input_write_error", "is_mutation", "refuse_aten_input_writes", "refuse_writes", "written_tensors"]


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


def refuse_writes(inputs: list[tuple[str, Any]], writes: Iterable[tuple[fx.Node, Any]]) -> None:
    """Raise if a written value (node, fake value) shares its storage with an input's
    (name, fake value): a view of an input shares it too."""
    storages: dict[Any, tuple[int, str]] = {}
    for i, (name, val) in enumerate(inputs):
        if isinstance(val, torch.Tensor):
            storages.setdefault(StorageWeakRef(val.untyped_storage()), (i, name))
    for node, val in writes:
        hit = storages.get(StorageWeakRef(val.untyped_storage())) if isinstance(val, torch.Tensor) else None
        if hit is not None:
            raise input_write_error(node, *hit)


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


def refuse_aten_input_writes(gm: fx.GraphModule) -> None:
    """The aten-level twin of :func:`refuse_input_writes`, for a write the Dynamo-graph
    check did not recognise: every mutable op's written arguments, by the op's schema, must
    not alias an input (functionalising would turn such a write into a copy nobody reads)."""
    refuse_writes(
        [(n.name, n.meta.get("val")) for n in gm.graph.nodes if n.op == "placeholder"],
        (
            (node, w.meta.get("val"))
            for node in gm.graph.nodes
            if is_mutation(node)
            for w in written_tensors(node)
            if isinstance(w, fx.Node)
        ),
    )
