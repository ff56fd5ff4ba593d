"""Lower one graph piece to accelerator ONNX: the compile half of compile-and-load.

Input: a compilable piece (an FX GraphModule from the partition stage) and fake example
arguments. Output: an artifact directory (``artifact`` defines the format) holding
``model.onnx`` and ``layout.json``, the description the runtime needs to call it.
Lowering never runs the model.

The piece is rewritten by four passes, each a function below, then exported:

1. :func:`sizes_from_tensors` - Dynamo passes symbolic sizes (``s0``) as graph inputs;
   ONNX has no scalar-int inputs for them, so each becomes the size of a tensor input
   that carries it (``aten.sym_size``). Symbolic dims become dynamic ONNX dims, so one
   artifact serves every token count.
2. :func:`kv_updates_to_retained_state` - each KV-cache update (an op whose registry role
   is ``KV_CACHE_UPDATE``) becomes its registry ``lowers_to`` op, the functional
   ``qaic::kv_cache_scatter``, into two new inputs named by the op's retained-state stems
   (``past_key`` / ``past_value``; MLA ``compressed_kv`` / ``k_pe``) whose results are
   the outputs ``<stem>_RetainedState``; one more input, ``slot_mapping``, says where each
   token goes. Several updates in one piece are numbered (``past_key.0``, ...). The layer
   name stays in the layout: the runtime resolves it through the forward context, as the
   eager op does, and binds that layer's cache as both the input and its
   ``_RetainedState`` output, so the update happens in place.
3. :func:`outputs_and_leaves` - tensors leave through ONNX; inputs passed through, sizes,
   constants and the updates' dependency tokens are produced by the runtime instead. A
   piece left with no ONNX output at all (dead code, pass-through, constants) has no
   model: the runtime computes its leaves directly.
4. :func:`export_inputs` - example tensors, names and dynamic dims for the exporter.

Then the piece becomes ONNX by the **direct path** (:func:`aten_graph`, then translation):
one fake-tensor trace of the rewritten graph gives its aten graph, with the decompositions
for every op the ONNX registry lacks applied *during* that trace; each aten node is then
translated through the same onnxscript function library ``torch.onnx`` uses, with a
registry (and every registry op's ONNX function as a custom translation) built once per
process. There is no ``torch.export`` and no ``run_decompositions`` re-trace: a middle
transformer piece lowers in a fraction of the exporter's time. The private torch.onnx
pieces this needs are named in one place (:class:`TorchOnnxInternals`) and used only on
the tested torch. A piece the direct path cannot translate is lowered by torch.onnx's
exporter instead, counted (``num_exporter_fallbacks``) and reported with the op that
forced it.

The model is then cleaned (no unused initializers, explicit opset imports, the qaic
functions attached) and must pass ``onnx.checker.check_model(full_check=True)``.

Anything that cannot be lowered raises :class:`LoweringError` with the reason; the backend
decides whether that means an eager fallback or an error.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import itertools
import logging
import math
import operator
import struct
import sys
import threading
import time
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import onnx
import onnx.inliner
import sympy
import torch
import torch.fx as fx
from torch.fx.passes.fake_tensor_prop import FakeTensorProp
from torch.utils import _pytree as pytree

from qaic_dynamo.artifact import (
    LAYOUT_FILE, MAX_SIZE_CARRIER, ONNX_ELEMENT_TYPES, ONNX_FILE, SIZE_CARRIER_DTYPE, PieceLayout, dtype_name,
)
from qaic_dynamo.config import CompilationConfig
from qaic_dynamo.counter import compilation_counter
from qaic_dynamo.fingerprint import CanonicalNames, canonical_names
from qaic_dynamo.ops import QAIC_DOMAIN, QAIC_OPS, kv_cache_update_op, op_name

__all__ = [
    "LoweringError",
    "PreparedPiece",
    "ProcessWide",
    "decompositions",
    "export_inputs",
    "fake_values",
    "grad_mode_refusal",
    "holds_over_range",
    "unmet_size_assumptions",
    "kv_updates_to_retained_state",
    "finish_model",
    "lower_piece",
    "infer_op_signatures",
    "onnx_registry",
    "translate_aten",
    "outputs_and_leaves",
    "prepare",
    "sizes_from_tensors",
    "TORCH_SEMANTICS",
]

logger = logging.getLogger("qaic_dynamo")
# The exporter warns on every export that torchvision (whose ops we never use) is missing.
logging.getLogger("torch.onnx._internal.exporter._registration").setLevel(logging.ERROR)

#: onnxruntime 1.31 reads IR version <= 13; the exporter's default is within that, but a
#: newer onnx could raise it, so it is capped.
MAX_IR_VERSION = 10


class LoweringError(RuntimeError):
    """A piece could not be lowered; the message says why."""


def _is_symbolic(x: Any) -> bool:
    return isinstance(x, torch.SymInt) and not x.node.expr.is_number


def _hint(x: Any) -> int:
    if isinstance(x, torch.SymInt):
        return int(x.node.hint) if x.node.hint is not None else int(x.node.shape_env.size_hint(x.node.expr))
    return int(x)


# --- the FX rewrite ------------------------------------------------------------------------


@dataclass
class PreparedPiece:
    """A piece rewritten for export: the pure graph, what to export it with, its layout."""

    gm: fx.GraphModule
    example: list[torch.Tensor]
    dynamic_shapes: list[dict[int, Any] | None]
    input_names: list[str]
    output_names: list[str]
    layout: PieceLayout
    #: ``example`` at the dynamic sizes Dynamo saw, the direct trace's second try, with
    #: equal sizes kept apart (None: no dynamic size, or one below 2, which it would fix).
    real_example: list[torch.Tensor] | None = None
    #: The sizes Dynamo gave the piece's tensor inputs (SymInts), in ``example``'s order:
    #: what the second try's size guards must follow from.
    dynamo_sizes: list[tuple[Any, ...]] = field(default_factory=list)
    #: Set by the direct lowering: the trace's size guards, which Dynamo's guards of this
    #: compile imply (in Dynamo's symbols); the layout records them for every reuse.
    size_assumptions: list[sympy.Basic] = field(default_factory=list)


@dataclass
class _Rewrite:
    """State the passes share: the copy of the piece's graph being rewritten."""

    graph: fx.Graph
    example_args: Sequence[Any]
    canon: CanonicalNames
    placeholders: list[fx.Node]  # the copy's placeholders, one per piece argument
    orig_of: dict[fx.Node, fx.Node]  # copy -> original node (which carries meta["val"])
    first_body: fx.Node | None
    symbols: dict[str, list[Any]] = field(default_factory=dict)
    sym_source: dict[sympy.Symbol, tuple[int, int]] = field(default_factory=dict)
    input_sources: list[list[Any]] = field(default_factory=list)
    updates: list[fx.Node] = field(default_factory=list)
    kv_updates: list[dict[str, Any]] = field(default_factory=list)
    retained: list[list[fx.Node]] = field(default_factory=list)
    slot_mapping: fx.Node | None = None
    dep_nodes: dict[fx.Node, str] = field(default_factory=dict)


def _bind_symbols(rw: _Rewrite) -> None:
    """Where the runtime reads each canonical symbol from: a tensor dim or an int input."""
    for i, a in enumerate(rw.example_args):
        if isinstance(a, torch.Tensor):
            for d, size in enumerate(a.shape):
                if isinstance(size, torch.SymInt) and isinstance(size.node.expr, sympy.Symbol):
                    rw.sym_source.setdefault(size.node.expr, (i, d))
                    rw.symbols.setdefault(rw.canon.expr(size.node.expr), ["dim", i, d])
        elif isinstance(a, torch.SymInt) and isinstance(a.node.expr, sympy.Symbol):
            rw.symbols.setdefault(rw.canon.expr(a.node.expr), ["int", i])
        elif not isinstance(a, torch.SymInt):
            raise LoweringError(f"piece input {i} is a {type(a).__name__}; only tensors and sizes can be lowered")


def sizes_from_tensors(rw: _Rewrite) -> None:
    """Pass 1: symbolic-size inputs become sizes of tensor inputs (and are removed).

    A size no tensor input carries as a dimension (a Python int Dynamo made dynamic, such
    as transformers' cache length) gets a carrier instead: the ONNX input becomes a bool
    tensor of that length, which the runtime makes from the int at each call (a piece's
    ONNX has only tensor inputs)."""
    g = rw.graph
    carriers = set()
    for i, (ph, a) in enumerate(zip(rw.placeholders, rw.example_args)):
        if (isinstance(a, torch.SymInt) and ph.users and isinstance(a.node.expr, sympy.Symbol)
                and a.node.expr not in rw.sym_source):
            rw.sym_source[a.node.expr] = (i, 0)
            carriers.add(i)
    for i, (ph, a) in enumerate(zip(rw.placeholders, rw.example_args)):
        if isinstance(a, torch.Tensor):
            rw.input_sources.append(["arg", i])
            continue
        if i in carriers:
            rw.input_sources.append(["size", i])
            with g.inserting_before(rw.first_body):
                size = g.call_function(torch.ops.aten.sym_size.int, (ph, 0))
            ph.replace_all_uses_with(size, delete_user_cb=lambda user: user is not size)
            continue
        if ph.users:
            expr = a.node.expr
            missing = sorted(str(s) for s in expr.free_symbols if s not in rw.sym_source)
            if missing:
                raise LoweringError(f"symbolic input '{rw.orig_of[ph].name}' = {expr} uses {missing}, which no "
                                    "tensor input carries as a dimension")
            with g.inserting_before(rw.first_body):
                size = size_expression(g, expr, {s: (rw.placeholders[j], d) for s, (j, d) in rw.sym_source.items()})
            ph.replace_all_uses_with(size)
        g.erase_node(ph)


def size_expression(g: fx.Graph, expr: sympy.Expr, dims: dict[sympy.Symbol, tuple[fx.Node, int]]) -> Any:
    """FX nodes (at the graph's insertion point) computing a size expression (e.g. ``2*s0``,
    an MoE layer's tokens x top-k) from the tensor dims that carry its symbols: ``dims``
    maps each symbol to a (tensor node, dim). Raises LoweringError for an expression
    that is not sums, products and floor divisions of symbols and integers."""
    if isinstance(expr, sympy.Symbol):
        if expr not in dims:
            raise LoweringError(f"no tensor input carries the size {expr} as a dimension")
        node, d = dims[expr]
        return g.call_function(torch.ops.aten.sym_size.int, (node, d))
    if isinstance(expr, sympy.Integer):
        return int(expr)
    combine = {sympy.Mul: operator.mul, sympy.Add: operator.add}.get(type(expr))
    if combine is None and type(expr).__name__ == "FloorDiv":
        return g.call_function(operator.floordiv, tuple(size_expression(g, a, dims) for a in expr.args))
    if combine is None:
        raise LoweringError(f"cannot compute the size expression {expr} from tensor dims")
    out = None
    for arg in expr.args:
        term = size_expression(g, arg, dims)
        out = term if out is None else g.call_function(combine, (out, term))
    return out


def kv_updates_to_retained_state(rw: _Rewrite) -> None:
    """Pass 2: each KV-cache update becomes a functional scatter into retained state."""
    g = rw.graph
    rw.updates = [n for n in g.nodes if n.op == "call_function" and kv_cache_update_op(n.target) is not None]
    if not rw.updates:
        return
    cache_inputs: list[fx.Node] = []
    with g.inserting_before(rw.first_body):
        for u, node in enumerate(rw.updates):
            op = kv_cache_update_op(node.target)
            suffix = f".{u}" if len(rw.updates) > 1 else ""
            names = [f"{stem}{suffix}" for stem in op.retained_state]
            # The ONNX inputs take these names (the layout's); the FX placeholders, which
            # become Python identifiers, cannot hold the dot (two updates in a piece failed
            # to lower with a SyntaxError).
            cache_inputs += [g.placeholder(n.replace(".", "_")) for n in names[:2]]
            layer = node.kwargs.get("layer_name", node.args[2] if len(node.args) > 2 else None)
            if not isinstance(layer, str):
                raise LoweringError(f"{node.name}: the layer name must be a constant string, got {layer!r}")
            rw.kv_updates.append({"op": op.name, "layer_name": layer, "names": names})
        rw.slot_mapping = g.placeholder("slot_mapping")
    for u, node in enumerate(rw.updates):
        scatter_op = QAIC_OPS[kv_cache_update_op(node.target).lowers_to].overload
        with g.inserting_before(node):
            fixed, cache_dims = [], []
            for t in (node.args[0], node.args[1]):  # MLA passes [T, dim]: caches have one head
                val = rw.orig_of[t].meta["val"]
                heads = 1 if val.dim() == 2 else _hint(val.shape[1])
                cache_dims.append([heads, _hint(val.shape[-1]), dtype_name(val.dtype)])
                if val.dim() == 2:
                    t = g.call_function(torch.ops.aten.unsqueeze.default, (t, 1))
                fixed.append(t)
            rw.kv_updates[u]["cache_dims"] = cache_dims  # [heads, head_size, dtype] per cache
            scatter = g.call_function(
                scatter_op, (fixed[0], fixed[1], cache_inputs[2 * u], cache_inputs[2 * u + 1], rw.slot_mapping)
            )
            rw.retained.append([g.call_function(operator.getitem, (scatter, j)) for j in range(2)])
        rw.dep_nodes[node] = dtype_name(rw.orig_of[node].meta["val"].dtype)


def outputs_and_leaves(rw: _Rewrite, out_val: Any) -> tuple[list[list[Any]], list[dict[str, Any]], str]:
    """Pass 3: the piece's outputs. Tensors computed here become ONNX outputs; inputs
    passed through, sizes, constants and dependency tokens become runtime-made leaves.
    Returns (leaves, outputs, out_spec) and sets the graph's output node."""
    g, canon = rw.graph, rw.canon
    flat, spec = pytree.tree_flatten(out_val)
    leaves: list[list[Any]] = []
    onnx_outputs: list[fx.Node] = []
    out_meta: list[dict[str, Any]] = []
    ph_index = {p: i for i, p in enumerate(rw.placeholders)}
    for leaf in flat:
        if not isinstance(leaf, fx.Node):
            leaves.append(["const", leaf])
        elif leaf in rw.dep_nodes:
            leaves.append(["dep", rw.dep_nodes[leaf]])
        elif leaf in ph_index:
            leaves.append(["arg", ph_index[leaf]])
        else:
            val = rw.orig_of[leaf].meta["val"]
            if isinstance(val, torch.SymInt) and _is_symbolic(val):
                leaves.append(["sym", canon.expr(val.node.expr)])
            elif isinstance(val, (bool, int, float, torch.SymInt)):  # static: the key covers it
                leaves.append(["const", val if not isinstance(val, torch.SymInt) else int(val)])
            elif isinstance(val, torch.Tensor):
                if leaf not in onnx_outputs:
                    onnx_outputs.append(leaf)
                    out_meta.append({
                        "name": f"out{len(onnx_outputs) - 1}",
                        "dtype": dtype_name(val.dtype),
                        "shape": [canon.expr(d.node.expr) if _is_symbolic(d) else _hint(d) for d in val.shape],
                    })
                leaves.append(["onnx", onnx_outputs.index(leaf)])
            else:
                raise LoweringError(f"piece output {leaf.name} is a {type(val).__name__}")
    for node in rw.updates:
        if node.users:  # the copy has no output node yet, so any user is inside the piece
            raise LoweringError(
                f"{node.name}: the dependency token of a cache update is used inside the piece; "
                "only attention (a splitting op) may consume it"
            )
        g.erase_node(node)  # replaced by the scatter; its token is made by the runtime

    outputs: list[dict[str, Any]] = [dict(m, target=["leaf", i]) for i, m in enumerate(out_meta)]
    retained_nodes: list[fx.Node] = []
    for u, upd in enumerate(rw.kv_updates):
        for j, name in enumerate(upd["names"]):
            retained_nodes.append(rw.retained[u][j])
            # Retained state is written in place: its dtype is the cache's, its shape the
            # cache's at call time.
            outputs.append({"name": f"{name}_RetainedState", "target": ["cache", u, j],
                            "dtype": upd["cache_dims"][j][2], "shape": None})
    g.output(tuple(onnx_outputs + retained_nodes))
    return leaves, outputs, pytree.treespec_dumps(spec)


_INPLACE_OPERATORS = frozenset({
    operator.setitem, operator.iadd, operator.isub, operator.imul, operator.itruediv, operator.ifloordiv,
    operator.imod, operator.ipow, operator.iand, operator.ior, operator.ixor, operator.ilshift, operator.irshift,
    operator.imatmul,
})
_PLAIN_OPERATORS = frozenset({operator.and_, operator.or_, operator.not_, operator.is_})
_INPLACE_DUNDERS = frozenset(f"__i{op}__" for op in (
    "add", "sub", "mul", "truediv", "floordiv", "mod", "pow", "and", "or", "xor", "lshift", "rshift", "matmul"))
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
        return [args[i] if i < len(args) else node.kwargs.get(a.name)
                for i, a in enumerate(target._schema.arguments) if a.alias_info is not None and a.alias_info.is_write]
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


def refuse_input_writes(rw: _Rewrite) -> None:
    """An artifact cannot write its inputs (only retained state, the KV cache through
    ``qaic::unified_kv_cache_update``): a piece that writes an input, or a view of one, in
    place - a buffer's ``add_``, a cache of the model's own filled with ``index_copy_`` -
    is refused, so it runs eagerly instead of losing the write."""
    orig = rw.orig_of
    _refuse_writes(
        [(orig[ph].name, orig[ph].meta.get("val")) for ph in rw.placeholders],
        ((orig[node], orig[w].meta.get("val")) for node in rw.graph.nodes for w in written_tensors(node)
         if isinstance(w, fx.Node) and w in orig),
    )


def _refuse_writes(inputs: list[tuple[str, Any]], writes: Iterable[tuple[fx.Node, Any]]) -> None:
    """Raise if a written value (node, fake value) shares its storage with an input's
    (name, fake value): a view of an input shares it too."""
    from torch.multiprocessing.reductions import StorageWeakRef

    storages: dict[Any, tuple[int, str]] = {}
    for i, (name, val) in enumerate(inputs):
        if isinstance(val, torch.Tensor):
            storages.setdefault(StorageWeakRef(val.untyped_storage()), (i, name))
    for node, val in writes:
        hit = storages.get(StorageWeakRef(val.untyped_storage())) if isinstance(val, torch.Tensor) else None
        if hit is not None:
            raise _input_write_error(node, *hit)


def _input_write_error(node: fx.Node, index: int, name: str) -> LoweringError:
    return LoweringError(
        f"{node.name} ({node.op} {getattr(node.target, '__name__', node.target)}) writes in place into piece input "
        f"{index} ('{name}'), and an artifact cannot write its inputs. To compile it, return the new value instead "
        "of writing it in place (KV caches: qaic::unified_kv_cache_update)"
    )


def export_inputs(
    rw: _Rewrite,
) -> tuple[list[torch.Tensor], list[dict[int, Any] | None], list[dict[str, Any]], list[torch.Tensor] | None]:
    """Pass 4: example tensors, dynamic dims and layout entries of the ONNX inputs, and
    examples at the sizes Dynamo saw (None if one is 0 or 1: the trace would fix it)."""
    # Example sizes for the exporter and the direct trace: distinct primes, so a dynamic
    # size never equals a model dimension (2 kv heads, say) and gets specialised to it.
    # They ignore Dynamo's guards, though: code that needs a relation between sizes (a
    # dynamic slice of a fixed-length table, ``w[:x.shape[0]]``) fails to trace at them,
    # and the real sizes, which satisfy every guard, are the second try.
    primes = iter((17, 19, 23, 29, 31, 37, 41, 43, 47, 53, 59, 61, 67, 71, 73, 79, 83, 89, 97))
    hints = {s: _hint(s_int) for s, s_int in _symbol_hints(rw.example_args).items()}
    values = {s: next(primes, max(h, 2)) for s, h in hints.items()}
    real_usable = all(h >= 2 for h in hints.values()) and all(
        _concrete(input_shape(rw.example_args, src)[0], hints) <= MAX_SIZE_CARRIER
        for src in rw.input_sources if src[0] == "size")  # a carrier as long as a seed is not allocated
    example: list[torch.Tensor] = []
    real: list[torch.Tensor] = []
    dynamic: list[dict[int, Any] | None] = []
    inputs: list[dict[str, Any]] = []
    for src in rw.input_sources:
        shape, dtype = input_shape(rw.example_args, src), _input_dtype(rw.example_args, src)
        example.append(torch.zeros([_concrete(d, values) for d in shape], dtype=dtype))
        if real_usable:
            real.append(torch.zeros([_concrete(d, hints) for d in shape], dtype=dtype))
        dyn = {d: torch.export.Dim.DYNAMIC for d, size in enumerate(shape) if _is_symbolic(size)}
        dynamic.append(dyn or None)
        inputs.append({"name": f"arg{src[1]}", "source": src})
    extra: list[torch.Tensor] = []
    for u, upd in enumerate(rw.kv_updates):
        for j, name in enumerate(upd["names"]):
            heads, head_size, dtype = upd["cache_dims"][j]
            extra.append(torch.zeros(4, heads, 4, head_size, dtype=getattr(torch, dtype)))
            dynamic.append({0: torch.export.Dim.DYNAMIC, 2: torch.export.Dim.DYNAMIC})
            inputs.append({"name": name, "source": ["cache", u, j]})
    if rw.slot_mapping is not None:
        extra.append(torch.zeros(3, dtype=torch.int64))
        dynamic.append({0: torch.export.Dim.DYNAMIC})
        inputs.append({"name": "slot_mapping", "source": ["slot_mapping"]})
    return example + extra, dynamic, inputs, (real + extra if real_usable and hints else None)


def input_shape(example_args: Sequence[Any], src: list[Any]) -> tuple[Any, ...]:
    """The shape of the ONNX input that ``src`` (an ``["arg", i]`` or ``["size", i]``
    layout source) binds: the tensor's, or a size carrier's (its length)."""
    a = example_args[src[1]]
    return (a,) if src[0] == "size" else tuple(a.shape)


def _input_dtype(example_args: Sequence[Any], src: list[Any]) -> torch.dtype:
    return SIZE_CARRIER_DTYPE if src[0] == "size" else example_args[src[1]].dtype


def prepare(gm: fx.GraphModule, example_args: Sequence[Any], fake_mode: Any) -> PreparedPiece:
    """Run the four passes over a copy of ``gm``; ``gm`` itself is left untouched (but
    for its nodes' ``meta["val"]``)."""
    fake_values(gm, example_args, fake_mode)
    g = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    out_val = g.graph_copy(gm.graph, env)  # copies everything but the output node
    rw = _Rewrite(
        graph=g,
        example_args=example_args,
        canon=canonical_names(example_args),  # the fingerprint's symbol names
        placeholders=[env[n] for n in gm.graph.nodes if n.op == "placeholder"],
        orig_of={new: old for old, new in env.items()},
        # After the last placeholder: split_module may put a node (a grad-mode switch it
        # carries into the piece) among them, and what is inserted here reads them.
        first_body=_after_placeholders(g),
    )
    _bind_symbols(rw)
    sizes_from_tensors(rw)
    kv_updates_to_retained_state(rw)
    leaves, outputs, out_spec = outputs_and_leaves(rw, out_val)
    refuse_input_writes(rw)
    # A piece's dead code (Dynamo keeps it) must not reach ONNX; an in-place write whose
    # result nothing reads is not dead (fx's own test calls ``x.add_(1)`` pure).
    g.eliminate_dead_code(is_impure_node=lambda n: n.is_impure() or bool(written_tensors(n)))
    g.lint()
    example, dynamic, inputs, real_example = export_inputs(rw)
    layout = PieceLayout(
        inputs=inputs,
        outputs=outputs,
        leaves=leaves,
        out_spec=out_spec,
        symbols=rw.symbols,
        kv_updates=rw.kv_updates,
        num_args=len(example_args),
        has_model=bool(outputs),
    )
    return PreparedPiece(
        fx.GraphModule(gm, g).eval(), example, dynamic, [i["name"] for i in inputs], [o["name"] for o in outputs], layout,
        real_example, [input_shape(example_args, src) for src in rw.input_sources],
    )


def fake_values(gm: fx.GraphModule, example_args: Sequence[Any], fake_mode: Any) -> None:
    """Give every node of ``gm`` its fake value, ``meta["val"]``, for ``example_args``.

    Dynamo recorded each node's value as it traced, in the same fake mode, as
    ``meta["example_value"]``, and ``split_module`` copies node meta into the pieces: a
    piece whose placeholders hold exactly ``example_args`` (the backend's pieces) takes
    those. Running ``FakeTensorProp`` instead re-runs every op on fakes with symbolic
    shapes: 0.1-0.4 s a piece here, as much as its whole aten trace. Any other graph (one
    a node of which lacks the value, or called on other arguments) is propagated.
    """
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    # A node nothing reads may lack one (Dynamo records no value for a call it keeps only
    # for its side effect, e.g. torch._C._log_api_usage_once); dead code is dropped later.
    body = [n for n in gm.graph.nodes if n.op not in ("placeholder", "output") and (n.users or "example_value" in n.meta)]
    if (len(placeholders) == len(example_args)
            and all(n.meta.get("example_value") is a for n, a in zip(placeholders, example_args))
            and all("example_value" in n.meta for n in body)):
        for n in placeholders + body:
            n.meta["val"] = n.meta["example_value"]
        return
    FakeTensorProp(gm, mode=fake_mode).propagate_dont_convert_inputs(*example_args)


def _symbol_hints(example_args: Sequence[Any]) -> dict[sympy.Symbol, torch.SymInt]:
    hints: dict[sympy.Symbol, torch.SymInt] = {}
    for a in example_args:
        sizes = list(a.shape) if isinstance(a, torch.Tensor) else [a]
        for s in sizes:
            if isinstance(s, torch.SymInt):
                for sym in s.node.expr.free_symbols:
                    if sym not in hints and isinstance(s.node.expr, sympy.Symbol):
                        hints[sym] = s
    return hints


def _concrete(size: Any, values: dict[sympy.Symbol, int]) -> int:
    if _is_symbolic(size):
        expr = size.node.expr
        if not expr.free_symbols <= set(values):
            raise LoweringError(f"size {expr} uses a symbol that no input dimension carries")
        return int(expr.xreplace(values))
    return int(size)


# --- export --------------------------------------------------------------------------------


def lower_piece(
    gm: fx.GraphModule,
    example_args: Sequence[Any],
    fake_mode: Any,
    config: CompilationConfig,
    out_dir: Path,
) -> PieceLayout:
    """Lower ``gm`` into ``out_dir`` (``model.onnx`` + ``layout.json``) and return its layout.

    ``layout.stats`` records how: ``lowered_with`` ("direct" or "exporter"),
    ``exporter_fallback`` (why the exporter was needed, naming the op) and the seconds of
    each step (``prepare``, ``aten_trace``, ``translate`` - or the whole exporter -,
    ``checks``, ``save``).
    """
    t0 = time.perf_counter()
    try:
        prepared = prepare(gm, example_args, fake_mode)
    except LoweringError:
        raise
    except Exception as e:  # a rewrite we did not foresee: say where, fall back upstream
        raise LoweringError(f"could not prepare the piece for export: {type(e).__name__}: {e}") from e
    seconds = {"prepare": time.perf_counter() - t0}

    layout = prepared.layout
    _check_bindable(layout, example_args)
    out_dir.mkdir(parents=True, exist_ok=True)
    if layout.has_model:
        t0 = time.perf_counter()
        model, fallback = _export(prepared, config.opset, seconds)
        seconds["translate"] = time.perf_counter() - t0 - seconds.get("aten_trace", 0.0)
        t0 = time.perf_counter()
        model = _finish(model, layout, config.opset)
        seconds["checks"] = time.perf_counter() - t0
        layout.export_seconds = seconds.get("aten_trace", 0.0) + seconds["translate"] + seconds["checks"]
        layout.stats = {
            "nodes": len(model.graph.node),
            "functions": sorted(f"{f.domain}::{f.name}" for f in model.functions),
            "opset": config.opset,
            "lowered_with": "direct" if fallback is None else "exporter",
            "exporter_fallback": fallback,
        }
        canon = canonical_names(example_args)  # the fingerprint's names, which every reuse maps back
        layout.size_assumptions = sorted({canon.expr(e) for e in prepared.size_assumptions})
        compilation_counter.bump(num_onnx_exports=1, num_exporter_fallbacks=int(fallback is not None))
        t0 = time.perf_counter()
        onnx.save(model, str(out_dir / ONNX_FILE))
        seconds["save"] = time.perf_counter() - t0
    layout.stats["seconds"] = seconds
    (out_dir / LAYOUT_FILE).write_text(layout.to_json())
    return layout


def _after_placeholders(g: fx.Graph) -> fx.Node | None:
    nodes = list(g.nodes)
    last = max((i for i, n in enumerate(nodes) if n.op == "placeholder"), default=-1)
    return nodes[last + 1] if last + 1 < len(nodes) else None


def grad_mode_refusal(gm: fx.GraphModule, graph_grad_mode: bool) -> str | None:
    """Why a piece must run eagerly, if it switches grad mode away from the mode its graph
    runs in (Dynamo guards that mode): a ``torch.no_grad()`` or ``enable_grad()`` block in
    the piece, or carried into it across a split (``split_module`` starts every later piece
    of such a block with the switch). A lowered piece's switches do nothing at run time, so
    compiled it would leave the caller's grad mode as it was where eager changes it, and
    return outputs without the autograd history eager gives them. Switches to the graph's
    own mode (transformers' rotary embedding ends its ``no_grad`` block that way, and the
    pieces after it start with that switch) change nothing and are compiled."""
    for node in gm.graph.nodes:
        if (node.op == "call_function" and node.target is torch._C._set_grad_enabled
                and bool(node.args[0]) != graph_grad_mode):
            return (f"the piece switches grad mode {'on' if node.args[0] else 'off'} (torch.enable_grad() / "
                    "torch.no_grad() inside the compiled code), which a lowered piece cannot do; it runs eagerly")
    return None


def _check_bindable(layout: PieceLayout, example_args: Sequence[Any]) -> None:
    """Refuse, before any export, a piece whose ONNX inputs or outputs have a dtype the
    runtime cannot bind (uint8, int8, complex, ...): its artifact could never load."""
    bad = [(o["name"], o.get("dtype")) for o in layout.outputs
           if getattr(torch, str(o.get("dtype")), None) not in ONNX_ELEMENT_TYPES]
    for i in layout.inputs:
        src = i["source"]
        if src[0] == "arg" and isinstance(example_args[src[1]], torch.Tensor):
            dtype = example_args[src[1]].dtype
            if dtype not in ONNX_ELEMENT_TYPES:
                bad.append((i["name"], dtype_name(dtype)))
    if bad:
        raise LoweringError(
            f"the runtime cannot bind {', '.join(f'{n} ({d})' for n, d in bad)}; it binds "
            f"{sorted(dtype_name(d) for d in ONNX_ELEMENT_TYPES)}. Cast to a supported dtype inside the model, "
            "or leave this part to eager PyTorch")


def _finish(model: onnx.ModelProto, layout: PieceLayout, opset: int) -> onnx.ModelProto:
    """Make the exported piece self-contained and clean, and check it."""
    if layout.kv_updates and not any(n.op_type == "KVCacheScatter" and n.domain == QAIC_DOMAIN for n in model.graph.node):
        raise LoweringError("the exported model has no KVCacheScatter node for its cache update")
    model = finish_model(model, opset, keep_roundings=True)
    names = [i.name for i in model.graph.input]
    want = [i["name"] for i in layout.inputs]
    if names != want:
        raise LoweringError(f"the lowered model's inputs differ from the piece's: expected {want}, got {names}")
    return model


_REDUCED_FLOATS = (onnx.TensorProto.FLOAT16, onnx.TensorProto.BFLOAT16)


def _keep_reduced_float_roundings(model: onnx.ModelProto) -> None:
    """Keep the roundings to float16 / bfloat16 that ONNX Runtime's CPU cast insertion
    drops: it runs such ops in float32 and, around a Cast next to one, changes the Cast to
    float32 too, so ``(x.half() * 2).float()`` of a float32 ``x`` came back never rounded
    (1000.123 * 2 gave 2000.246, eager 2000) and a float16 chain widened by a Cast was not
    rounded at its end. An Identity after every Cast to a reduced float and before every
    Cast from one (its kernel takes float16, so the cast insertion leaves those Casts
    alone) keeps them; the session must not remove Identity nodes (``artifact.load``).
    Within a chain of float16 ops ONNX Runtime still rounds once, and Casts inside If / Loop
    bodies (``torch.cond``) are left as they are (docs/usage.md)."""
    types = {v.name: v.type.tensor_type.elem_type
             for v in (*model.graph.input, *model.graph.value_info, *model.graph.output)}
    types.update({t.name: t.data_type for t in model.graph.initializer})
    nodes: list[onnx.NodeProto] = []
    for i, node in enumerate(model.graph.node):
        to = next((a.i for a in node.attribute if a.name == "to"), None) if node.op_type == "Cast" and not node.domain else None
        # An input of unknown type gets one too: an Identity costs nothing where none is needed.
        if to is not None and to not in _REDUCED_FLOATS and types.get(node.input[0], _REDUCED_FLOATS[0]) in _REDUCED_FLOATS:
            kept = f"{node.input[0]}__rounded_{i}"
            nodes.append(onnx.helper.make_node("Identity", [node.input[0]], [kept], name=f"keep_rounding_{i}"))
            node.input[0] = kept
        nodes.append(node)
        if to in _REDUCED_FLOATS:
            rounded = f"{node.output[0]}__rounded_{i}"
            nodes.append(onnx.helper.make_node("Identity", [rounded], [node.output[0]], name=f"keep_rounding_out_{i}"))
            node.output[0] = rounded
    del model.graph.node[:]
    model.graph.node.extend(nodes)


def finish_model(model: onnx.ModelProto, opset: int, check: bool = True, keep_roundings: bool = False) -> onnx.ModelProto:
    """Make a translated model self-contained and clean (onnxscript's helper functions
    inlined, our functions attached, no unused initializers) and, with ``check``, pass
    ``onnx.checker.check_model(full_check=True)``. ``keep_roundings``: for ONNX Runtime
    (:func:`_keep_reduced_float_roundings`; the deployment export's models are for the
    QAIC compiler)."""
    model.ir_version = min(model.ir_version, MAX_IR_VERSION)
    # Helper functions of onnxscript's torch library (pkg.onnxscript.torch_lib) are
    # inlined so the model holds only standard ops and our own functions.
    if len(model.functions):
        model = onnx.inliner.inline_local_functions(model)
    from qaic_dynamo.onnx_functions import function_protos

    used = {n.op_type for n in model.graph.node if n.domain == QAIC_DOMAIN}
    model.functions.extend(function_protos(used))
    # A graph whose outputs are all constants has no nodes, and the exporter then imports
    # no opset; the checker (rightly) rejects that.
    if not any(o.domain in ("", "ai.onnx") for o in model.opset_import):
        model.opset_import.append(onnx.helper.make_opsetid("", opset))
    _remove_unused_initializers(model)
    if keep_roundings:
        _keep_reduced_float_roundings(model)
    if check:
        try:
            onnx.checker.check_model(model, full_check=True)
        except Exception as e:
            raise LoweringError(f"the lowered model fails onnx.checker: {_first_line(e)}") from e
    return model


def _remove_unused_initializers(model: onnx.ModelProto) -> None:
    """Drop initializers no node reads (ONNX Runtime would log each one at load)."""
    used = {name for node in model.graph.node for name in node.input}
    used |= {o.name for o in model.graph.output}
    for node in model.graph.node:  # names read inside subgraphs (If/Loop bodies)
        for attr in node.attribute:
            for sub in ([attr.g] if attr.HasField("g") else []) + list(attr.graphs):
                used |= {name for n in sub.node for name in n.input}
    keep = [init for init in model.graph.initializer if init.name in used]
    if len(keep) != len(model.graph.initializer):
        del model.graph.initializer[:]
        model.graph.initializer.extend(keep)


def _translations() -> dict[Any, Any]:
    """torch.onnx custom translations: every registry op that has an ONNX function."""
    # onnxscript is imported only when something is lowered: loading cached artifacts
    # never needs it.
    from qaic_dynamo.onnx_functions import TRANSLATIONS

    return {op.overload: TRANSLATIONS[op.onnx_function] for op in QAIC_OPS.values() if op.onnx_function}


# --- torch.onnx's private pieces: the one place the lowering names them --------------------

#: The torch the direct path was tested with. Its private exporter modules change between
#: releases, so on any other torch the exporter path is used, with one warning.
TESTED_TORCH = "2.13.0"


@dataclass(frozen=True)
class TorchOnnxInternals:
    """Private torch.onnx modules the direct path uses (torch 2.13):

    * ``_registration.ONNXRegistry`` (its ``_register`` and
      ``_cleanup_registry_based_on_opset_version``), ``OnnxDecompMeta``, ``_get_overload``
      and ``_torchlib._torchlib_registry.get_torchlib_ops`` - aten op -> onnxscript
      function, built the way ``ONNXRegistry.from_torchlib`` builds it (see
      :func:`onnx_registry` for why not through it);
    * ``_decomp.get_onnx_implemented_overloads`` - the ops the registry translates, and
      ``torch._decomp._core_aten_decompositions_post_autograd`` (the core ATen
      decompositions), ``torch._export.utils._is_preservable_cia_op`` and
      ``torch.export.decomp_utils.PRESERVED_ATEN_CIA_OPS``, from which
      :func:`decompositions` builds the table for the ops it lacks;
    * ``_fx_passes.decompose_with_registry`` - the exporter's own decompositions, which
      the exporter fallback runs itself so that the size guards they take can be checked;
    * ``_fx_passes.remove_assertion_nodes``, and from ``fx.passes.type_promotion`` the
      exporter's type-promotion pass (``InsertTypePromotion``, its interpreter, rule table
      and ``get_type_promotion_rule``), run only on the nodes that need it (see
      :func:`insert_type_promotion`);
    * ``_core._translate_fx_graph`` - one FX node at a time into an onnx_ir graph;
    * ``_ir_passes.add_opset_imports``.
    """

    core: Any
    decomp: Any
    torch_decomp: Any
    export_utils: Any
    preserved_cia: Any
    fx_passes: Any
    ir_passes: Any
    registration: Any
    type_promotion: Any


_NEEDED = {
    "core": ("_translate_fx_graph", "export"),
    "decomp": ("get_onnx_implemented_overloads",),
    "torch_decomp": ("_core_aten_decompositions_post_autograd", "decomposition_table"),
    "export_utils": ("_is_preservable_cia_op",),
    "fx_passes": ("decompose_with_registry", "insert_type_promotion_nodes", "remove_assertion_nodes"),
    "type_promotion": ("InsertTypePromotion", "_TypePromotionInterpreter", "TypePromotionTable",
                       "get_type_promotion_rule", "fx_type_utils"),
    "ir_passes": ("add_opset_imports",),
    "registration": ("ONNXRegistry", "OnnxDecompMeta", "_get_overload", "_torchlib_registry"),
}


def check_private_api(probe: Callable[[], str | None], otherwise: str) -> bool:
    """Whether private torch pieces can be used: only on the tested torch, and only if
    ``probe`` (which imports and inspects them) returns None rather than what is missing.
    If not, warns once (per caller's cache) saying what happens ``otherwise`` and why."""
    if torch.__version__.split("+")[0] != TESTED_TORCH:
        why = f"torch {torch.__version__} is not the tested {TESTED_TORCH}"
    else:
        try:
            why = probe()
        except (ImportError, AttributeError) as e:
            why = f"they do not import ({e})"
    if why is None:
        return True
    msg = f"qaic: {otherwise}: {why}"
    logger.warning(msg)
    warnings.warn(msg, RuntimeWarning, stacklevel=3)
    return False


@functools.cache
def torch_onnx_internals() -> TorchOnnxInternals | None:
    """The private pieces, or None (warned once) when this torch is not the tested one or
    lacks one of them; lowering then goes through the public exporter."""
    mods: dict[str, Any] = {}

    def probe() -> str | None:
        import torch._decomp as torch_decomp
        import torch._export.utils as export_utils
        from torch.export.decomp_utils import PRESERVED_ATEN_CIA_OPS
        from torch.onnx._internal.exporter import _core, _decomp, _fx_passes, _ir_passes, _registration
        from torch.onnx._internal.fx.passes import type_promotion

        mods.update(core=_core, decomp=_decomp, fx_passes=_fx_passes, ir_passes=_ir_passes, registration=_registration,
                    type_promotion=type_promotion, torch_decomp=torch_decomp, export_utils=export_utils,
                    preserved_cia=PRESERVED_ATEN_CIA_OPS)
        missing = [f"{m}.{a}" for m, attrs in _NEEDED.items() for a in attrs if not hasattr(mods[m], a)]
        return f"torch lacks {missing}" if missing else None

    if not check_private_api(probe, "lowering through the public torch.onnx exporter (slower)"):
        return None
    return TorchOnnxInternals(**mods)


_registry_lock = threading.Lock()
_registries: dict[int, Any] = {}


def onnx_registry(opset: int) -> Any:
    """:func:`build_onnx_registry`, once per opset and process (under a lock: two threads
    lowering in a cold process build it once)."""
    with _registry_lock:
        if opset not in _registries:
            _registries[opset] = build_onnx_registry(opset)
        return _registries[opset]


def build_onnx_registry(opset: int) -> Any:
    """A new torch.onnx op registry with our translations (use :func:`onnx_registry`).

    The same registry as ``ONNXRegistry.from_torchlib``, built without its one slow step:
    that lists onnxscript's torch library through ``get_torchlib_ops()``, which parses the
    source of every one of ~540 functions (``function_ir``) only to read a domain the
    registry never uses - 0.6 of its 1.2 s here, paid by every cold process that lowers.
    ``test_registry_matches_from_torchlib`` checks that both give the same functions.

    The ONNX signature of each onnxscript function (what dispatch matches a node's
    arguments against) is inferred when a graph first uses its op
    (:func:`infer_op_signatures`), not here: inferring all ~560 up front took 0.3-0.5 s
    of every cold process, for the dozen ops a transformer uses.
    """
    reg = torch_onnx_internals().registration
    # Importing the ops registers them in onnxscript's default registry.
    with deferred_script_conversion():
        from onnxscript.function_libs.torch_lib import ops, registration  # noqa: F401

    registry = reg.ONNXRegistry()
    registry._opset_version = opset
    for meta in reg._torchlib_registry.get_torchlib_ops():
        registry._register(meta.fx_target, meta)
    for qualified_name, funcs in registration.default_registry.items():
        if qualified_name.startswith("internal::"):
            continue
        target = reg._get_overload(qualified_name)
        if target is None:
            continue
        for fn, is_complex in [(f, False) for f in funcs.overloads] + [(f, True) for f in funcs.complex]:
            meta = reg.OnnxDecompMeta(onnx_function=fn, fx_target=target, signature=None, is_custom=False,
                                      is_complex=is_complex, skip_signature_inference=True)
            _UNINFERRED[id(meta)] = meta  # held here, so the id stays its own
            registry._register(target, meta)
    registry._cleanup_registry_based_on_opset_version()
    with _memoized_op_signatures():  # converting our functions builds a signature per op call
        translations = _translations()
    for target, fn in translations.items():
        registry.register_op(target, fn, is_complex=False)
    return registry


#: Prefix of the modules whose onnxscript functions are deferred: onnxscript's torch library.
TORCH_LIB_PREFIX = "onnxscript.function_libs.torch_lib."
_deferral_lock = threading.Lock()
_deferral: dict[str, Any] = {"depth": 0, "saved": None}


def is_torch_lib_function(func: Callable) -> bool:
    # ``__module__`` may be None (a function made by exec without ``__name__``).
    return (getattr(func, "__module__", None) or "").startswith(TORCH_LIB_PREFIX)


@contextlib.contextmanager
def deferred_script_conversion() -> Iterator[None]:
    """While active, onnxscript's function wrappers do their work on a function's first
    use instead of when the function is defined - for functions of onnxscript's torch
    library only (anything else, e.g. a user's module imported by another thread meanwhile,
    is wrapped by onnxscript's own code as usual):

    * ``onnxscript.script(...)(func)`` returns a :func:`deferred_script_function_class`
      instance, an ``OnnxFunction`` that converts ``func``'s Python source to ONNX when
      first used;
    * ``onnxscript.values.TracedOnnxFunction(opset, func)`` is a
      :func:`deferred_signature_traced_function_class` instance, which infers its ONNX
      signature (from ``func``'s annotations) when first asked for it.

    Importing onnxscript's torch library wraps ~50 script-mode and ~440 trace-only
    functions, converting or inferring all of them - ~0.4 s of every cold process that
    lowers, for the dozen functions a transformer's pieces use.

    Entries are counted: the first saves onnxscript's wrappers and installs ours, the last
    exit restores them, whatever the order threads leave in. Once the library is imported
    there is nothing left to defer, and the context does nothing."""
    import onnxscript

    if TORCH_LIB_PREFIX + "ops" in sys.modules:
        yield
        return
    with _deferral_lock:
        if _deferral["depth"] == 0:
            script, traced = onnxscript.script, onnxscript.values.TracedOnnxFunction
            _deferral["saved"] = (script, traced)
            deferred = deferred_script_function_class()

            def deferred_script(opset: Any = None, default_opset: Any = None, **kwargs: Any) -> Callable[[Callable], Any]:
                real = script(opset, default_opset, **kwargs)  # validates the arguments, as before

                def decorate(func: Callable) -> Any:
                    if not is_torch_lib_function(func):
                        return real(func)
                    return deferred(func, functools.partial(real, func), kwargs)

                return decorate

            onnxscript.script = deferred_script
            onnxscript.values.TracedOnnxFunction = deferred_signature_traced_function_class()
        _deferral["depth"] += 1
    try:
        yield
    finally:
        with _deferral_lock:
            _deferral["depth"] -= 1
            if _deferral["depth"] == 0:
                onnxscript.script, onnxscript.values.TracedOnnxFunction = _deferral["saved"]
                _deferral["saved"] = None


@functools.cache
def deferred_script_function_class() -> type:
    """``DeferredScriptFunction(func, convert, kwargs)``: an ``onnxscript.OnnxFunction``
    whose Python function is known at once and whose everything else (``name``,
    ``function_ir``, ``op_signature``, ``to_function_proto()``, calling it...) is answered
    from ``convert()`` - the function as ``onnxscript.script`` converts it - run on first
    use. ``test_deferred_script_functions_equal_onnxscripts_own`` checks the answers."""
    import onnxscript

    class DeferredScriptFunction(onnxscript.OnnxFunction):
        # Deliberately not OnnxFunction.__init__: it is what converts.
        def __init__(self, func: Callable, convert: Callable[[], Any], kwargs: dict[str, Any]) -> None:
            self.function = func
            self.kwargs = kwargs
            self.traceable = False
            self._convert = convert
            self._lock = threading.RLock()
            functools.update_wrapper(self, func)

        @property
        def converted(self) -> Any:
            """The function as ``onnxscript.script`` converts it (converting it once)."""
            with self._lock:
                if "_converted" not in self.__dict__:
                    with _memoized_op_signatures():
                        self.__dict__["_converted"] = self._convert()
            return self.__dict__["_converted"]

        def __getattr__(self, name: str) -> Any:  # what the converted function has and we lack
            if name.startswith("__") or name in ("function", "kwargs", "_convert", "_lock"):
                raise AttributeError(name)
            return getattr(self.converted, name)

        # Properties of OnnxFunction and its base over fields only their __init__ sets.
        name = property(lambda self: self.converted.name)
        opset = property(lambda self: self.converted.opset)
        domain = property(lambda self: self.converted.domain)
        op_schema = property(lambda self: self.converted.op_schema)
        function_ir = property(lambda self: self.converted.function_ir)
        source = property(lambda self: self.converted.source)

        @property
        def op_signature(self) -> Any:
            return self.converted.op_signature

        @op_signature.setter
        def op_signature(self, value: Any) -> None:
            self.converted.op_signature = value

    return DeferredScriptFunction


@functools.cache
def deferred_signature_traced_function_class() -> type:
    """``onnxscript.values.TracedOnnxFunction`` whose ``op_signature`` is inferred on first
    read (by constructing the real one) rather than in ``__init__``.
    ``test_deferred_script_functions_equal_onnxscripts_own`` checks the signatures."""
    import onnxscript

    traced = onnxscript.values.TracedOnnxFunction

    class DeferredSignatureTracedFunction(traced):
        def __new__(cls, opset: Any, func: Callable) -> Any:
            if not is_torch_lib_function(func):  # not ours to defer: onnxscript's own
                return traced(opset, func)
            return super().__new__(cls)

        # TracedOnnxFunction.__init__ but for the inference: Op's own __init__ leaves
        # the signature None.
        def __init__(self, opset: Any, func: Callable) -> None:
            onnxscript.values.Op.__init__(self, opset, func.__name__)
            self.func = func
            functools.update_wrapper(self, func)

        @property
        def op_signature(self) -> Any:
            if self._signature is None:
                self._signature = traced(self.opset, self.func).op_signature
            return self._signature

        @op_signature.setter
        def op_signature(self, value: Any) -> None:
            self._signature = value

    return DeferredSignatureTracedFunction


_signature_lock = threading.Lock()
#: The registry's metas whose signature :func:`infer_op_signatures` has yet to infer, by
#: id (torch's own torchlib metas may skip inference on purpose; those are never touched).
#: Held here, so that no later object can take a freed meta's id.
_UNINFERRED: dict[int, Any] = {}


def infer_op_signatures(registry: Any, graphs: Iterable[fx.Graph] | None) -> None:
    """Infer the ONNX signature of every registry function an op of ``graphs`` may
    dispatch to (every function, for None), as ``OnnxDecompMeta`` does at construction.

    :func:`onnx_registry` leaves them uninferred; dispatch must never see one that way, as
    it would then pick that function whatever the node's argument types."""
    if graphs is None:
        metas = [m for ms in registry.functions.values() for m in ms]
    else:
        targets = {n.target for g in graphs for n in g.nodes if n.op == "call_function"}
        metas = [m for t in targets for m in registry.get_decomps(t)]
    with _signature_lock:
        for meta in metas:
            if _UNINFERRED.get(id(meta)) is meta:
                meta.skip_signature_inference = False
                meta.__post_init__()  # the inference OnnxDecompMeta would have run
                del _UNINFERRED[id(meta)]


@functools.cache
def decompositions(opset: int) -> dict[Any, Any]:
    """Decompositions for every op the registry cannot translate directly (once per opset).

    torch.onnx's ``create_onnx_friendly_decomposition_table`` without the entries it takes
    from ``torch.export.default_decompositions()`` for CompositeImplicitAutograd ops: those
    run the op's CompositeImplicitAutograd kernel, which ``make_fx`` runs anyway for an op
    autograd would have decomposed - and finding them walks every operator of the
    dispatcher, 0.3 of the table's 0.45 s (cProfile) in every cold process. The core ATen
    decompositions and torch._decomp's table are kept, first-found wins, as there.
    Measured: every piece of the reference models and six transformers families, whole
    and regional, lowers to byte-identical ONNX with either table;
    ``test_decompositions_are_the_exporters_without_its_composite_implicit_entries``
    checks the tables.
    """
    internals = torch_onnx_internals()
    translated = set(internals.decomp.get_onnx_implemented_overloads(onnx_registry(opset)))
    core_aten = internals.torch_decomp._core_aten_decompositions_post_autograd()
    table: dict[Any, Any] = {}
    for op, fn in itertools.chain(core_aten.items(), internals.torch_decomp.decomposition_table.items()):
        if op in translated or not hasattr(op, "_schema") or op in table:
            continue
        # Where torch.onnx's table holds the CompositeImplicitAutograd entry (first found),
        # leave the op out: make_fx then runs that same kernel.
        if op not in core_aten and internals.export_utils._is_preservable_cia_op(op) and op not in internals.preserved_cia:
            continue
        table[op] = fn
    for op, ours in TORCH_SEMANTICS.items():
        # Where ours declines (NotImplemented: a dtype it leaves alone), the op's own
        # decomposition, if the table had one, must still run: without it an op the
        # registry cannot translate (index_add) sends the piece to the exporter.
        table[op] = ours if op not in table else _or_else(ours, table[op])
    return table


def _or_else(first: Callable[..., Any], then: Callable[..., Any]) -> Callable[..., Any]:
    """``first``, or ``then`` where ``first`` returns NotImplemented."""

    def decomposition(*args: Any, **kwargs: Any) -> Any:
        out = first(*args, **kwargs)
        return then(*args, **kwargs) if out is NotImplemented else out

    return decomposition


# --- where onnxscript's translation differs from eager: torch's own arithmetic -------------
#
# onnxscript translates float floor division as Floor(Div(a, b)) and float remainder as
# a - b * Floor(a / b), and integer division with a rounding mode through float32. Eager
# (c10's div_floor_floating, the remainder kernel, integer division) gives other values:
# ``1.0 // 0.1`` is 9 (0.1 is a little above a tenth; Python agrees) where Floor(Div) gives
# 10, ``x % 0.1`` is 0.1 where the translation gives 0, and an int64 above 2**24 divided
# with ``rounding_mode="floor"`` loses its low bits. These decompositions, applied in the
# aten trace (and before the exporter's own, on its fallback path), spell eager's formulas
# in ops whose translations are exact. Floor and truncating division of float16 / bfloat16
# run in float32 with the scalar unrounded, as eager's kernels do; their remainder in
# float32 with the scalar rounded, as eager's does (the translation's float16 steps gave
# other last places).

_FLOATS = (torch.float32, torch.float64)
_REDUCED = (torch.float16, torch.bfloat16)


def _operands(a: Any, b: Any, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    def cast(x: Any) -> torch.Tensor:
        return x.to(dtype) if isinstance(x, torch.Tensor) else torch.scalar_tensor(x, dtype=dtype)

    return cast(a), cast(b)


def _signs_differ(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return (x < 0) != (y < 0)


def _float_floor_divide(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """c10::div_floor_floating: the quotient of the exact remainder, then floored."""
    mod = torch.fmod(a, b)
    div = (a - mod) / b
    div = torch.where((mod != 0) & _signs_differ(b, mod), div - 1, div)
    floor = torch.floor(div)
    floor = torch.where(div - floor > 0.5, floor + 1, floor)
    quotient = a / b
    floor = torch.where(div != 0, floor, quotient * 0)  # a zero keeps the quotient's sign
    return torch.where(b == 0, quotient, floor)


def _any_floor_divide(a: Any, b: Any, dtype: torch.dtype) -> Any:
    if dtype in _FLOATS:
        return _float_floor_divide(*_operands(a, b, dtype))
    if dtype in _REDUCED:
        # Eager's kernel: tensors in the reduced type (an int64 2051 becomes 2052 in
        # float16), the scalar unrounded, the arithmetic in float32.
        return _float_floor_divide(*_reduced_wide(a, b, dtype)).to(dtype)
    if dtype == torch.bool or getattr(_reentry, "integer_division", False):
        return NotImplemented  # (the translation's integer Div and Mod are exact)
    return _integer_quotient(a, b, dtype, "floor")


def _integer_quotient(a: Any, b: Any, dtype: torch.dtype, rounding: str) -> torch.Tensor:
    """The integer quotient, floored or truncated, as eager gives it - also of the minimum
    by -1, which wraps to the minimum: ONNX Runtime's integer Div traps there (SIGFPE), which
    killed the process. Division by -1 is a negation instead; by 0, Div still fails, and the
    piece is re-run eagerly, which raises eager's ZeroDivisionError."""
    a, b = _operands(a, b, dtype)
    minus_one = b == -1
    safe = torch.where(minus_one, torch.ones_like(b), b)
    _reentry.integer_division = True
    try:
        quotient = torch.floor_divide(a, safe)  # the translation: integer Div, exact
    finally:
        _reentry.integer_division = False
    if rounding == "trunc":
        # Truncation differs from the floor where the exact remainder is non-zero and the
        # operands' signs differ.
        rest = a - quotient * safe
        quotient = quotient + ((rest != 0) & _signs_differ(a, safe)).to(dtype)
    return torch.where(minus_one, -a, quotient)


def _integer_rest(a: Any, b: Any, rounding: str) -> Any:
    """``a - q * b`` for the integer quotient ``q`` (floor: ``remainder``; trunc: ``fmod``),
    exact and wrapping as eager: the translations trap on the minimum by -1 (remainder) or
    go through double (int64 ``fmod(2**53 + 1, 2)`` gave 0)."""
    dtype = torch.result_type(a, b)
    if dtype.is_floating_point or dtype.is_complex or dtype == torch.bool:
        return NotImplemented
    a, b = _operands(a, b, dtype)
    return a - _integer_quotient(a, b, dtype, rounding) * b


def _reduced_wide(a: Any, b: Any, dtype: torch.dtype) -> tuple[torch.Tensor, Any]:
    """The operands of a float16 / bfloat16 binary op as eager's CPU kernels take them, in
    float32: a tensor rounded to the reduced type first (an int64 2051 becomes 2052 in
    float16), the second operand unrounded when it is a number or a 0-d tensor of another
    type (c10 reads it with ``original_scalar_value<opmath_t>``)."""

    def wide(x: Any, second: bool) -> Any:
        if not isinstance(x, torch.Tensor):
            return torch.scalar_tensor(x, dtype=torch.float32)
        if second and x.dim() == 0 and x.dtype not in (dtype, torch.bool) and isinstance(a, torch.Tensor) and a.dim():
            return x.float()
        return x.to(dtype).float()

    return wide(a, False), wide(b, True)


def _floor_divide(a: Any, b: Any) -> Any:
    return _any_floor_divide(a, b, torch.result_type(a, b))


def _float_remainder(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    mod = torch.fmod(a, b)
    return torch.where((mod != 0) & _signs_differ(b, mod), mod + b, mod)


def _remainder(a: Any, b: Any) -> Any:
    dtype = torch.result_type(a, b)
    if dtype in _FLOATS:
        return _float_remainder(*_operands(a, b, dtype))
    if dtype in _REDUCED:
        # Eager's kernel: both operands in the reduced type (the scalar rounded), the
        # arithmetic in float32 - the translation's float16 steps gave other last places.
        wa, wb = _operands(a, b, dtype)
        return _float_remainder(wa.float(), wb.float()).to(dtype)
    # integers (also by a size, ``x % x.shape[0]``, which has no translation)
    return _integer_rest(a, b, "floor")


def _div_mode(a: Any, b: Any, *, rounding_mode: str | None = None) -> Any:
    if rounding_mode is None:
        return _reduced_float_scaling(_aten.div.Tensor)(a, b)  # true division
    dtype = torch.result_type(a, b)
    if dtype in _REDUCED and rounding_mode == "trunc" and (not isinstance(b, torch.Tensor) or b.dim() == 0):
        # by a number: eager divides in float32 by it unrounded, then truncates
        wa, wb = _reduced_wide(a, b, dtype)
        return torch.trunc(wa / wb).to(dtype)
    if dtype.is_floating_point:
        return _any_floor_divide(a, b, dtype) if rounding_mode == "floor" else NotImplemented  # trunc(a / b), as eager
    if dtype == torch.bool:
        return NotImplemented
    return _integer_quotient(a, b, dtype, rounding_mode)


_reentry = threading.local()


def _masked_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, dropout_p: float = 0.0,
                      is_causal: bool = False, *, attn_mask: torch.Tensor | None = None,
                      scale: float | None = None) -> Any:
    """``scaled_dot_product_attention`` with a mask, as torch's CPU kernel computes it: a
    query row whose keys are all masked out gives zeros (onnxscript's plain Softmax gives
    NaN there, which spreads into anything reduced over that row - a left-padded batch's
    padding rows). The op itself stays (its translation, and its fake kernel, which does not
    compare the key's and value's lengths: dynamic pieces keep tracing at example sizes);
    only those rows are set. sdpa has made a bool mask a float one with -inf by now. The
    logsumexp output is left as the translation gives it (sdpa drops it). Also: grouped
    keys and values are repeated per query head, and bfloat16 runs in float32 (the
    translation fails the checker or has no ONNX Runtime CPU kernel for either). A negative
    ``scale`` goes on the query, as ``-scale`` on ``-query``: the translation scales query
    and key by ``Sqrt(scale)`` each, NaN for a negative scale (every output was NaN)."""
    if getattr(_reentry, "attention", False):
        return NotImplemented
    if dropout_p:
        return _attention_with_dropout(query, key, value, dropout_p, is_causal, attn_mask, scale)
    grouped = query.dim() == 4 and key.shape[1] != query.shape[1]
    wide = query.dtype == torch.bfloat16  # ONNX Runtime's CPU kernels lack bfloat16 Sqrt / MatMul
    negative = isinstance(scale, (int, float)) and scale < 0
    if attn_mask is None and not grouped and not wide and not negative:
        return NotImplemented
    if negative:
        query, scale = -query, -scale
    if grouped:  # the translation's MatMul wants one kv head per query head
        if query.shape[1] % key.shape[1]:
            return NotImplemented
        key = key.repeat_interleave(query.shape[1] // key.shape[1], dim=1)
        value = value.repeat_interleave(query.shape[1] // value.shape[1], dim=1)
    dtype = query.dtype
    if wide:  # computed in float32 and rounded once, as the kernel accumulates in float
        query, key, value = query.float(), key.float(), value.float()
        attn_mask = attn_mask.float() if attn_mask is not None else None
    _reentry.attention = True
    try:
        out, *rest = _aten._scaled_dot_product_flash_attention_for_cpu.default(
            query, key, value, dropout_p, is_causal, attn_mask=attn_mask, scale=scale)
    finally:
        _reentry.attention = False
    if attn_mask is not None:
        dead = (attn_mask == float("-inf")).all(-1, keepdim=True)  # [..., L, 1]: broadcasts to out
        out = out.masked_fill(dead, 0)
    return (out.to(dtype), *rest)


def _attention_with_dropout(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, dropout_p: float,
                            is_causal: bool, attn_mask: torch.Tensor | None, scale: float | None) -> Any:
    """Attention with dropout on its weights (training mode), written out: the translation's
    Dropout has no ``training_mode`` (the identity, by ONNX's definition), so the weights
    were never dropped. Dropout draws from ONNX Runtime's generator, as ``F.dropout`` in a
    lowered piece does."""
    if query.dim() == 4 and key.shape[1] != query.shape[1]:
        key = key.repeat_interleave(query.shape[1] // key.shape[1], dim=1)
        value = value.repeat_interleave(query.shape[1] // value.shape[1], dim=1)
    dtype = query.dtype
    query, key, value = query.float(), key.float(), value.float()
    factor = scale if scale is not None else 1.0 / math.sqrt(query.shape[-1])
    scores = query @ key.transpose(-2, -1) * factor
    if is_causal:
        keep = torch.ones(query.shape[-2], key.shape[-2], dtype=torch.bool).tril()
        scores = scores.masked_fill(~keep, float("-inf"))
    if attn_mask is not None:
        scores = scores.masked_fill(~attn_mask, float("-inf")) if attn_mask.dtype == torch.bool else scores + attn_mask
    dead = (scores == float("-inf")).all(-1, keepdim=True)  # eager's kernel gives such rows zeros
    weights = torch.softmax(scores, -1).masked_fill(dead, 0)
    out = torch.nn.functional.dropout(weights, dropout_p, training=True) @ value
    return out.to(dtype), torch.logsumexp(scores, -1)


def _open_sdpa(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: torch.Tensor | None = None,
               dropout_p: float = 0.0, is_causal: bool = False, *, scale: float | None = None,
               enable_gqa: bool = False) -> Any:
    """sdpa as its CPU kernel runs it in inference: the flash op, a bool mask made a float
    one, which :func:`_masked_attention` then gives eager's masked rows (the exporter path,
    where torch.export keeps sdpa whole)."""
    if query.dim() != 4:
        return NotImplemented
    if attn_mask is not None and attn_mask.dtype == torch.bool:
        attn_mask = torch.zeros(attn_mask.shape, dtype=query.dtype).masked_fill(~attn_mask, float("-inf"))
    return _aten._scaled_dot_product_flash_attention_for_cpu.default(
        query, key, value, dropout_p, is_causal, attn_mask=attn_mask, scale=scale)[0]


def _round_to(x: float, dtype: torch.dtype) -> float:
    """``x`` rounded to float16 / bfloat16 through float32 (as c10 converts a double
    scalar), in plain Python: inside the trace every tensor op would be traced."""
    if math.isnan(x) or math.isinf(x):
        return x
    try:
        (f32,) = struct.unpack("<f", struct.pack("<f", x))
        if dtype == torch.float16:
            return struct.unpack("<e", struct.pack("<e", f32))[0]
    except OverflowError:  # past the type's range: eager's conversion gives infinity
        return math.copysign(math.inf, x)
    (bits,) = struct.unpack("<I", struct.pack("<f", f32))
    bits = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16  # bfloat16: round to nearest even
    if bits >= 1 << 32 or (bits & 0x7F800000) == 0x7F800000:
        return math.copysign(math.inf, x)
    return struct.unpack("<f", struct.pack("<I", bits))[0]


def _reduced_float_comparison(op: Any) -> Callable[..., Any]:
    """``op`` (eq, ne, lt, ...) on a float16 / bfloat16 tensor and a Python float or a 0-d
    tensor of another type, as eager compares: in the reduced type, the scalar rounded to
    it. The exporter's type promotion compares in float32 against the exact scalar instead,
    so ``h >= 0.1`` was False for ``h`` = float16(0.1), which is below 0.1. Rounding the
    scalar first gives eager's answer whatever the comparison is then computed in."""

    def compare(a: Any, b: Any) -> Any:
        dtype = torch.result_type(a, b)
        if dtype not in (torch.float16, torch.bfloat16):
            return NotImplemented

        def rounded(x: Any) -> Any:
            if isinstance(x, torch.Tensor):
                return x.to(dtype) if x.dtype != dtype else x
            if isinstance(x, (float, int)) and not isinstance(x, bool):  # 257 is 256 in bfloat16
                return _round_to(float(x), dtype)
            return x

        ra, rb = rounded(a), rounded(b)
        if all(r is x or (isinstance(x, (float, int)) and r == x) for r, x in ((ra, a), (rb, b))):
            return NotImplemented  # already in the reduced type: the translation compares right
        return op(ra, rb)

    return compare


def _reduce_all_dims(op: Any) -> Callable[..., Any]:
    """``amax`` / ``amin`` with ``dim=[]`` (``x.amax()``: every dim, as eager) with the dims
    spelled out: onnxscript's translation requires them."""

    def reduce(x: Any, dim: Any = (), keepdim: bool = False) -> Any:
        if list(dim):
            return NotImplemented
        return op(x, list(range(x.dim())), keepdim) if x.dim() else x.clone()  # a 0-d tensor is its own max

    return reduce


def _scatter_reduce(x: Any, dim: int, index: Any, src: Any, reduce: str, *, include_self: bool = True) -> Any:
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


def _arange(*args: Any, dtype: torch.dtype | None = None, layout: Any = None, device: Any = None,
            pin_memory: Any = None) -> Any:
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


def _in_float32(op: Any) -> Callable[..., Any]:
    """``op`` on a float16 / bfloat16 tensor computed in float32 and rounded back, as eager's
    CPU kernels compute it (ONNX Runtime's float16 ReduceLogSumExp overflowed past ~709)."""

    def upcast(x: Any, *args: Any, **kwargs: Any) -> Any:
        if x.dtype not in (torch.float16, torch.bfloat16):
            return NotImplemented
        return op(x.float(), *args, **kwargs).to(x.dtype)

    return upcast


def _reduced_float_scaling(op: Any) -> Callable[..., Any]:
    """``op`` (mul, div) of a float16 / bfloat16 tensor by a Python number or a 0-d tensor
    of another float type, as eager's CPU kernels compute it: in float32 with the number
    unrounded (c10's ``original_scalar_value<opmath_t>``), rounded once. The translation
    rounded the number to the tensor's type first: ``h * 1e5`` gave inf, ``h * 1e-8`` and
    ``h / 1e-6`` lost digits (float16 1e-6 is 1.013e-6), ``h * 0.044715`` differed from
    eager in the last place for one value in five."""

    def compute(a: Any, b: Any) -> Any:
        if not isinstance(a, torch.Tensor) or a.dtype not in _REDUCED or isinstance(b, bool):
            return NotImplemented
        if isinstance(b, torch.Tensor):
            if b.dim() != 0 or b.dtype in (a.dtype, torch.bool) or torch.result_type(a, b) != a.dtype:
                return NotImplemented  # a tensor: both in the reduced type, as the translation computes
            b = b.float()  # a 0-d float or integer tensor: its own value, as for a number
        elif not isinstance(b, (int, float)):
            return NotImplemented  # a symbolic size: left to the translation
        return op(a.float(), b).to(a.dtype)

    return compute


def _reduced_float_scaled_sum(op: Any) -> Callable[..., Any]:
    """``op`` (add, sub) of two float16 tensors with an ``alpha``, as eager's vectorized
    CPU kernel computes it: ``a + alpha * b`` in float32 with alpha rounded to float16,
    rounded once. The translation rounded ``alpha * b`` to float16 before the sum (one
    value in 20 differed from eager in the last place). Eager's own scalar loop - strided
    operands, a short broadcast inner dim, the tail of each block - rounds ``alpha * b``
    first, so there some values still differ (as before). bfloat16 is left to the
    translation: ONNX Runtime has no bfloat16 Mul, so such a piece runs eagerly, exactly.
    An alpha past float16's range, which eager refuses, runs eagerly so that it raises."""

    def compute(a: Any, b: Any, *, alpha: Any = 1) -> Any:
        if (isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or alpha == 1
                or not isinstance(a, torch.Tensor) or not isinstance(b, torch.Tensor)
                or a.dtype != torch.float16 or b.dtype != a.dtype):
            return NotImplemented
        rounded = _round_to(float(alpha), a.dtype)
        if math.isinf(rounded) and not math.isinf(alpha):
            raise LoweringError(f"{op}: alpha={alpha} is past float16's range, which eager refuses; the piece runs "
                                "eagerly, where it raises")
        return op(a.float(), b.float() * rounded).to(a.dtype)

    return compute


def _in_place(out_of_place: Callable[..., Any]) -> Callable[..., Any]:
    """The in-place form of a decomposition (``add_`` for ``add``): its result written back."""

    def compute(a: Any, *args: Any, **kwargs: Any) -> Any:
        result = out_of_place(a, *args, **kwargs)
        return NotImplemented if result is NotImplemented else a.copy_(result)

    return compute


def _index_add_in_float32(x: Any, dim: int, index: Any, source: Any, *, alpha: Any = 1) -> Any:
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


def _index_put_in_float32(x: Any, indices: Any, values: Any, accumulate: bool = False) -> Any:
    """float16 / bfloat16 ``index_put(..., accumulate=True)`` in float32, rounded once (no
    float16 add reduction in ONNX Runtime's ScatterND, as above). Eager's CPU kernel adds
    in float16 one write at a time, so where indices repeat the results can differ from
    eager in the last places (docs/usage.md)."""
    if not accumulate or x.dtype not in (torch.float16, torch.bfloat16):
        return NotImplemented
    return _aten.index_put.default(x.float(), indices, values.float(), True).to(x.dtype)


def _layer_norm_in_float32(x: Any, shape: Any, weight: Any = None, bias: Any = None, eps: float = 1e-5) -> Any:
    """float16 / bfloat16 ``native_layer_norm`` in float32, rounded back (as eager's CPU
    kernel accumulates): the translation's LayerNormalization stashes mean and rstd in
    float32 while the graph declares them float16, which fails the ONNX checker - every
    float16 LayerNorm piece ran eagerly."""
    if x.dtype not in (torch.float16, torch.bfloat16):
        return NotImplemented
    widen = (lambda t: t.float() if t is not None else None)
    out, mean, rstd = _aten.native_layer_norm.default(x.float(), shape, widen(weight), widen(bias), eps)
    return out.to(x.dtype), mean.to(x.dtype), rstd.to(x.dtype)


def _log1p(x: Any) -> Any:
    """log(1 + x) without losing x near 0 (onnxscript: Log(x + 1), 0 for x = 1e-8): the
    classic correction log(u) * x / (u - 1) with u = 1 + x; float16 / bfloat16 in float32."""
    if not x.dtype.is_floating_point:
        return NotImplemented
    y = x.float() if x.dtype in (torch.float16, torch.bfloat16) else x
    u = 1 + y
    # divided first: log(u) * y overflows for y past ~3.8e36 in float32
    out = torch.where(u == 1, y, torch.where(torch.isinf(u), torch.log(u), torch.log(u) * (y / (u - 1))))
    return out.to(x.dtype)


def _expm1(x: Any) -> Any:
    """exp(x) - 1 without losing x near 0 (onnxscript: Exp(x) - 1): (u - 1) * x / log(u)
    with u = exp(x); float16 / bfloat16 in float32."""
    if not x.dtype.is_floating_point:
        return NotImplemented
    y = x.float() if x.dtype in (torch.float16, torch.bfloat16) else x
    u = torch.exp(y)
    um1 = u - 1
    # divided first: (u - 1) * y overflows for x past ~84 in float32
    out = torch.where(u == 1, y, torch.where(um1 == -1, um1, torch.where(torch.isinf(u), u, um1 * (y / torch.log(u)))))
    return out.to(x.dtype)


def _atan2(y: Any, x: Any) -> Any:
    """``atan2`` by quadrant, as C's: onnxscript's translation puts y = +0 with x < 0 at
    -pi (eager: pi - any point on the negative real axis), 0 / -0 at 0 (pi) and NaN at 0.
    The sign of a zero is read as its reciprocal's; 0 / 0 divides by 1 instead (atan(+-0)
    then keeps y's sign: ONNX Runtime's Where drops the sign of a zero it takes from its
    first branch), and inf / inf is set apart. The operands are rounded to the result type
    first, as eager does (a float32 1e5 is inf beside float16), float16 / bfloat16 then
    computed in float32, integers in the default dtype. float64 is left to the
    translation (ONNX Runtime has no float64 Atan to run either)."""
    dtype = torch.result_type(y, x)
    out = dtype if dtype.is_floating_point else torch.get_default_dtype()
    if out == torch.float64:
        return NotImplemented
    work = torch.float32 if out in (torch.float16, torch.bfloat16) else out
    y, x = torch.broadcast_tensors(*(t.to(work) for t in _operands(y, x, out)))
    y_neg = (y < 0) | ((y == 0) & (1 / y < 0))
    x_neg = (x < 0) | ((x == 0) & (1 / x < 0))
    half_turn = torch.where(y_neg, torch.full_like(y, -math.pi), torch.full_like(y, math.pi))  # pi with y's sign
    base = torch.atan(y / torch.where((y == 0) & (x == 0), torch.ones_like(x), x))
    r = torch.where(x_neg, base + half_turn, base)
    r = torch.where(torch.isinf(y) & torch.isinf(x), torch.where(x_neg, 0.75 * half_turn, 0.25 * half_turn), r)
    return r.to(out)


def _integer_result(x: Any, dtype: Any) -> Any:
    """The result type of an integer reduction of ``x`` (``dtype`` if given; integers and
    bool widen to int64, as eager), or None for a floating one."""
    out = dtype or (torch.int64 if not x.dtype.is_floating_point and not x.dtype.is_complex else x.dtype)
    return out if not out.is_floating_point and not out.is_complex and out != torch.bool else None


def _reduced_dims(x: Any, dim: Any) -> list[int]:
    """A reduction's dims as a list: one, several, or (None or empty) all of them."""
    if isinstance(dim, int):
        return [dim]
    return list(dim) if dim else list(range(x.dim()))


def _any(x: Any, dim: Any = None, keepdim: bool = False) -> Any:
    """``any`` as a count of non-zeros above 0: the translation's ReduceMax of nothing is
    int64's minimum, which casts to True, so ``x[:, n:].any(1)`` at ``n == x.shape[1]`` was
    True (eager False)."""
    dims = _reduced_dims(x, dim)
    count = (x != 0).to(torch.float32)  # counts of ones: a positive float sum is never 0
    return (count.sum(dims, keepdim=keepdim) if x.dim() else count) > 0


def _integer_pow(base: Any, exponent: Any) -> Any:
    """Integer ``pow`` by a non-negative Python int, by repeated squaring in the integer
    type, exact and wrapping as eager: the translation's Pow works in double (``3**39`` lost
    its last digits, an overflow saturated where eager wraps). By an integer tensor, or
    negative, it runs eagerly."""
    dtype = torch.result_type(base, exponent)
    if dtype.is_floating_point or dtype.is_complex or dtype == torch.bool:
        return NotImplemented
    if isinstance(exponent, torch.Tensor) or not isinstance(base, torch.Tensor):
        raise LoweringError("an integer pow by a tensor: ONNX Runtime's Pow works in double (3**39 loses its last "
                            "digits); such a piece runs eagerly")
    if not isinstance(exponent, int) or exponent < 0:
        return NotImplemented  # a size, or eager's own error for a negative exponent
    result, square, n = torch.ones_like(base, dtype=dtype), base.to(dtype), exponent
    while n:
        if n & 1:
            result = result * square
        n >>= 1
        if n:
            square = square * square
    return result


def _integer_isclose(a: Any, b: Any, rtol: float = 1e-05, atol: float = 1e-08, equal_nan: bool = False) -> Any:
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


def _float32_cumsum(x: Any, dim: int, *, dtype: Any = None) -> Any:
    """A float32 ``cumsum`` accumulated in double, as eager's CPU kernel does (ONNX
    Runtime's CumSum in float32 gave ``[2**24, 1, 1, 1]`` a running sum stuck at 2**24)."""
    out = dtype or (x.dtype if x.is_floating_point() else None)
    if out != torch.float32:
        return NotImplemented
    return torch.cumsum(x.to(torch.float32).to(torch.float64), dim).to(torch.float32)  # (rounded first, as eager)


def _mean_of_maybe_empty(x: Any, dim: Any, keepdim: bool = False, *, dtype: Any = None) -> Any:
    """A floating ``mean`` over dims that may be empty, as a sum over the count: eager's
    mean of nothing is NaN, the translation's ReduceMean gave 0. Dims of a known non-zero
    size keep the translation."""
    dims = _reduced_dims(x, dim)
    sizes = [x.shape[d] for d in dims] if x.dim() else []
    if all(isinstance(n, int) and n > 0 for n in sizes) or not (dtype or x.dtype).is_floating_point:
        return NotImplemented
    count = math.prod(sizes)
    out = dtype or x.dtype
    if out in _REDUCED:  # eager sums in float32, divides, then rounds once
        return (torch.sum(x, dims, keepdim=keepdim, dtype=torch.float32) / count).to(out)
    return torch.sum(x, dims, keepdim=keepdim, dtype=dtype) / count


def _exact_integer_sum(x: Any, dim: Any = None, keepdim: bool = False, *, dtype: Any = None) -> Any:
    """An integer ``sum`` through CumSum in int64, which ONNX Runtime computes exactly: its
    CPU ReduceSum accumulates int64 in double (``[2**53 + 1, 2**53, 1]`` summed to
    ``2**54``) and saturates an int32 sum where eager wraps (the int64 sum cast to int32
    wraps, as eager's). The reduced dims are moved last and flattened; a zero in front
    makes an empty sum 0."""
    out = _integer_result(x, dtype)
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


def _refuse(op: str, why: str) -> Callable[..., Any]:
    """A decomposition that stops the lowering: the piece runs eagerly, with ``why``."""

    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise LoweringError(f"{op}: {why}")

    return refuse


def _refuse_divisor_override(x: Any, kernel_size: Any, stride: Any = (), padding: Any = 0, ceil_mode: bool = False,
                             count_include_pad: bool = True, divisor_override: Any = None) -> Any:
    if divisor_override is None:
        return NotImplemented
    raise LoweringError("avg_pool with divisor_override: the translation ignores it (it divided by the window size); "
                        "such a piece runs eagerly")


def _refuse_integer_prod(x: Any, *args: Any, dtype: Any = None, **kwargs: Any) -> Any:
    if _integer_result(x, dtype) is None:
        return NotImplemented
    raise LoweringError("an integer prod: ONNX Runtime's CPU ReduceProd multiplies int64 in double (3**39 loses its "
                        "last digits) and saturates an overflow where eager wraps; such a piece runs eagerly")


def _batch_norm_no_training(x: Any, weight: Any, bias: Any, running_mean: Any, running_var: Any, momentum: float,
                            eps: float) -> Any:
    """Eval-mode batch norm with its running statistics, as torch's CPU decomposition
    computes it (float16 / bfloat16 in float32), with empty saved statistics. onnxscript's
    translation declares those empty outputs with the channel count, which fails the ONNX
    checker (every eval-mode BatchNorm piece ran eagerly); torch's own decomposition goes
    through ``_native_batch_norm_legit``, whose schema writes the running statistics (the
    piece would run eagerly as one writing its inputs)."""
    work = torch.float32 if x.dtype in (torch.float16, torch.bfloat16) else x.dtype
    shape = [-1] + [1] * (x.dim() - 2)  # channels in dim 1, broadcast over the rest

    def channel(t: Any) -> Any:
        return t.to(work).flatten().reshape(shape)

    out = (x.to(work) - channel(running_mean)) * channel(1 / torch.sqrt(running_var.to(work) + eps))
    if weight is not None:
        out = out * channel(weight)
    if bias is not None:
        out = out + channel(bias)
    return out.to(x.dtype), x.new_zeros((0,)), x.new_zeros((0,))


_aten = torch.ops.aten
#: Ops whose onnxscript translation disagrees with eager, decomposed in the aten trace.
TORCH_SEMANTICS: dict[Any, Callable[..., Any]] = {
    _aten.scatter_reduce.two: _scatter_reduce,
    _aten.arange.default: _arange,
    _aten.arange.start: _arange,
    _aten.arange.start_step: _arange,
    _aten.logsumexp.default: _in_float32(_aten.logsumexp.default),
    _aten.log1p.default: _log1p,
    _aten.native_layer_norm.default: _layer_norm_in_float32,
    _aten.index_add.default: _index_add_in_float32,
    _aten.index_put.default: _index_put_in_float32,
    _aten.expm1.default: _expm1,
    _aten.amax.default: _reduce_all_dims(_aten.amax.default),
    _aten.amin.default: _reduce_all_dims(_aten.amin.default),
    _aten.floor_divide.default: _floor_divide,
    _aten.floor_divide.Scalar: _floor_divide,
    _aten.remainder.Tensor: _remainder,
    _aten.remainder.Scalar: _remainder,
    _aten.remainder.Scalar_Tensor: _remainder,
    _aten.div.Tensor_mode: _div_mode,
    _aten.div.Scalar_mode: _div_mode,
    _aten.atan2.default: _atan2,
    _aten.fmod.Tensor: lambda a, b: _integer_rest(a, b, "trunc"),
    _aten.fmod.Scalar: lambda a, b: _integer_rest(a, b, "trunc"),
    _aten.any.default: _any,
    _aten.any.dim: _any,
    _aten.any.dims: _any,
    _aten.pow.Tensor_Scalar: _integer_pow,
    _aten.pow.Tensor_Tensor: _integer_pow,
    _aten.pow.Scalar: _integer_pow,
    _aten.isclose.default: _integer_isclose,
    _aten.cumsum.default: _float32_cumsum,
    _aten.mean.dim: _mean_of_maybe_empty,
    _aten.sum.default: _exact_integer_sum,
    _aten.sum.dim_IntList: _exact_integer_sum,
    _aten.prod.default: _refuse_integer_prod,
    _aten.prod.dim_int: _refuse_integer_prod,
    # onnxscript's translation (a Loop over a sequence) crashes ONNX Runtime's session
    # creation (a segfault) - and the artifact was on disk by then, for every later process
    **{op: _refuse("embedding_bag", "ONNX Runtime crashes loading onnxscript's translation of it; such a piece runs "
                   "eagerly") for op in (_aten._embedding_bag.default, _aten._embedding_bag_forward_only.default)},
    _aten._native_batch_norm_legit_no_training.default: _batch_norm_no_training,
    _aten.avg_pool2d.default: _refuse_divisor_override,
    _aten.avg_pool3d.default: _refuse_divisor_override,
    _aten._scaled_dot_product_flash_attention_for_cpu.default: _masked_attention,
    **{op: _reduced_float_scaling(op) for op in (_aten.mul.Tensor, _aten.mul.Scalar, _aten.div.Tensor, _aten.div.Scalar)},
    **{op: _reduced_float_scaled_sum(op) for op in (_aten.add.Tensor, _aten.sub.Tensor)},
    **{inplace: _in_place(_reduced_float_scaled_sum(op))
       for inplace, op in ((_aten.add_.Tensor, _aten.add.Tensor), (_aten.sub_.Tensor, _aten.sub.Tensor))},
    **{getattr(_aten, name).Scalar: _reduced_float_comparison(getattr(_aten, name).Scalar)
       for name in ("eq", "ne", "lt", "le", "gt", "ge")},
    **{getattr(_aten, name).Tensor: _reduced_float_comparison(getattr(_aten, name).Tensor)
       for name in ("eq", "ne", "lt", "le", "gt", "ge")},
}


class _DirectPathError(Exception):
    """The direct path cannot lower this piece; ``op`` is the op that forced the fallback."""

    def __init__(self, op: str, reason: str) -> None:
        super().__init__(f"{op}: {reason}")
        self.op = op


class _SizeBranchError(_DirectPathError):
    """The trace took a branch on a dynamic size that Dynamo's guards do not fix. The
    exporter would take the same branch (its guards are checked the same way, see
    :func:`_check_export_guards`), so such a piece runs eagerly rather than serve sizes the
    branch is wrong for."""


def fake_inputs(example: Sequence[torch.Tensor], dynamic_shapes: Sequence[dict[int, Any] | None],
                duck_shape: bool = True) -> list[torch.Tensor]:
    """Fresh fake inputs whose dynamic dims (and only those) are symbols; dims given the
    same *string* name (the deployment export's "batch_size", "ctx_len") are one symbol.
    ``duck_shape=False``: equal example sizes stay separate symbols.

    A private fake mode and shape env: tracing in Dynamo's own would add guards to the
    frame being compiled.
    """
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv, StatelessSymbolicContext

    # Real tensors reach this mode only as a piece's tensor constants (a Dynamo get_attr,
    # e.g. transformers' DynamicCache starts each layer from ``torch.tensor([])``): every
    # input is made fake below. Allowed, they are traced as constants of the aten graph,
    # translated to initializers (their bytes are in the piece's fingerprint).
    mode = FakeTensorMode(shape_env=ShapeEnv(duck_shape=duck_shape), allow_non_fake_inputs=True)
    # Without the fake-tensor dispatch cache: a piece is traced once, so an entry is almost
    # never hit again, and building one with symbolic sizes (validating and re-deriving
    # the output's sizes and strides as sympy expressions) costs more than running the
    # op's meta kernel. Measured: the decoder block's first piece traces in 0.30 s
    # instead of 0.53-0.67 s; the pieces' ONNX is byte-identical.
    mode.cache_enabled = False
    fakes = []
    for t, dynamic in zip(example, dynamic_shapes):
        dims = [DimDynamic.DYNAMIC if d in (dynamic or {}) else DimDynamic.STATIC for d in range(t.dim())]
        fakes.append(mode.from_tensor(t, symbolic_context=StatelessSymbolicContext(dynamic_sizes=dims)))
    # Said equal up front rather than left to whichever op happens to combine two of them
    # (if none does, the ONNX gets one free dim per input).
    named: dict[str, Any] = {}
    for fake, dynamic in zip(fakes, dynamic_shapes):
        for d, name in (dynamic or {}).items():
            if isinstance(name, str):
                torch._check(fake.shape[d] == named.setdefault(name, fake.shape[d]))
    return fakes


def _is_mutation(node: fx.Node) -> bool:
    return node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload) and node.target._schema.is_mutable


def refuse_aten_input_writes(gm: fx.GraphModule) -> None:
    """The aten-level twin of :func:`refuse_input_writes`, for a write the Dynamo-graph
    check did not recognise: every mutable op's written arguments, by the op's schema, must
    not alias an input (functionalising would turn such a write into a copy nobody reads)."""
    _refuse_writes(
        [(n.name, n.meta.get("val")) for n in gm.graph.nodes if n.op == "placeholder"],
        ((node, w.meta.get("val")) for node in gm.graph.nodes if _is_mutation(node)
         for w in written_tensors(node) if isinstance(w, fx.Node)),
    )


def aten_graph(
    fn: Any, example: Sequence[torch.Tensor], dynamic_shapes: Sequence[dict[int, Any] | None], opset: int,
    keep_symbols_apart: bool = False, guards_follow_from: Sequence[tuple[Any, ...]] | None = None,
) -> fx.GraphModule:
    """``fn`` (a piece, or any traceable callable of tensors) as a functional aten graph,
    decomposed to what the registry translates: one fake-tensor trace with the
    decompositions applied during it (no torch.export, no run_decompositions re-trace).
    ``dynamic_shapes[i]`` holds the dynamic dims of ``example[i]``; the example sizes of
    dynamic dims must not be 0 or 1 (they would be specialised). ``keep_symbols_apart``
    (the real sizes' second try, where two sizes may happen to be equal): equal sizes are
    separate symbols, and a trace that took one for the other is refused.
    ``guards_follow_from``: Dynamo's sizes of the first inputs; a trace whose size guards
    (a branch a decomposition took on a size) do not follow from Dynamo's guards on those
    sizes is refused: the ONNX would serve sizes the branch does not hold for."""
    from torch.fx.experimental.proxy_tensor import make_fx

    internals = torch_onnx_internals()
    fakes = fake_inputs(example, dynamic_shapes, duck_shape=not keep_symbols_apart)
    with (
        torch._guards.tracing(None),  # the passes below detect their fake mode through it
        torch.fx.experimental._config.patch(backed_size_oblivious=True),
        torch._dispatch.python.enable_python_dispatcher(),
    ):
        gm = make_fx(fn, decomposition_table=decompositions(opset), tracing_mode="fake")(*fakes)
        # A few decompositions (rms_norm's) write in place; ONNX has no mutation. The
        # second trace is of an aten graph with no decompositions left, so it is cheap.
        if any(_is_mutation(n) for n in gm.graph.nodes):
            refuse_aten_input_writes(gm)
            # Through an Interpreter, so node annotations (preserve_node_meta) carry over.
            first = gm
            gm = make_fx(torch.func.functionalize(lambda *a: fx.Interpreter(first).run(*a), remove="mutations"),
                         tracing_mode="fake")(*fakes)
        insert_type_promotion(gm)
        internals.fx_passes.remove_assertion_nodes(gm)
    # The trace ran in a private shape env whose guards are dropped: if it specialised a
    # dynamic size to a number, the ONNX would silently serve one size. Let the exporter
    # (which refuses such a specialisation for a Dim.DYNAMIC) take the piece instead.
    shape_env = fakes[0].fake_mode.shape_env if fakes else None
    if shape_env is not None:
        fixed = sorted(str(k) for k, v in shape_env.replacements.items() if v.is_number)
        if fixed:
            raise _DirectPathError("(trace)", f"the trace specialised dynamic size(s) {fixed} to constants")
        merged = sorted(f"{k} -> {v}" for k, v in shape_env.replacements.items() if not v.is_number)
        if keep_symbols_apart and merged:
            raise _DirectPathError("(trace)", f"the trace related dynamic sizes {merged}")
        if guards_follow_from is not None:
            implied: list[sympy.Basic] = []
            unproven = _guards_not_implied(fakes, shape_env, guards_follow_from, strict=keep_symbols_apart,
                                           implied=implied)
            if unproven:
                raise _SizeBranchError("(trace)", f"size guards {unproven} do not follow from Dynamo's")
            gm.meta["size_assumptions"] = implied
    _expand_sym_numel(gm)
    _exact_float64_scalars(gm)
    for node in gm.graph.nodes:
        node.meta.setdefault("nn_module_stack", {})  # the translator records it per node
        if node.op == "get_attr":  # a tensor constant: translate its real value
            node.meta["val"] = operator.attrgetter(node.target)(gm)
    return gm


def _exact_float64_scalars(gm: fx.GraphModule) -> None:
    """Python float operands of float64 ops as float64 tensor constants. The translation
    emits a Python float as a float32 constant and casts it, so ``x * 0.1`` on a float64
    ``x`` multiplied by 0.10000000149011612 (eager: 0.1)."""
    count = 0

    def constant(value: float, before: fx.Node) -> fx.Node:
        nonlocal count
        name = f"_qaic_float64_scalar_{count}"
        count += 1
        gm.register_buffer(name, torch.tensor(value, dtype=torch.float64))
        with gm.graph.inserting_before(before):
            return gm.graph.get_attr(name)

    for node in list(gm.graph.nodes):
        val = node.meta.get("val")
        if (node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload)
                or not isinstance(val, torch.Tensor) or val.dtype != torch.float64):
            continue
        if node.target is _aten.scalar_tensor.default and isinstance(node.args[0], float):
            # type promotion wraps a scalar operand so (then translated the same way)
            node.replace_all_uses_with(constant(node.args[0], node))
            gm.graph.erase_node(node)
            continue
        if node.target is _aten.full.default and isinstance(node.args[1], float):
            fill = constant(node.args[1], node)
            with gm.graph.inserting_before(node):
                filled = gm.graph.call_function(_aten.expand.default, (fill, list(node.args[0])))
            filled.meta["val"] = val
            node.replace_all_uses_with(filled)
            gm.graph.erase_node(node)
            continue
        args = list(node.args)
        for i, (param, a) in enumerate(zip(node.target._schema.arguments, node.args)):
            if isinstance(a, float) and isinstance(param.type, torch.TensorType):
                args[i] = constant(a, node)
        node.args = tuple(args)
    if count:
        gm.recompile()


def insert_type_promotion(gm: fx.GraphModule) -> None:
    """The exporter's type-promotion pass (explicit casts where an op's inputs or output
    disagree with its promotion rule), re-running only the nodes it changes.

    ``insert_type_promotion_nodes`` re-runs *every* node on fake tensors to recompute
    values it already has: ~0.7 s on a three-layer Llama trace in which it casts one
    input of one node (a cumsum). Here each node with a rule is first checked against
    the rule using the values the trace recorded (``meta["val"]``); nodes that need no
    cast pass their recorded value through, and the rest go through the exporter's own
    promotion, unchanged. The result is the same graph: a test compares it with the full
    pass's."""
    tp = torch_onnx_internals().type_promotion

    class Selective(tp._TypePromotionInterpreter):
        def run_node(self, n: fx.Node) -> Any:
            if n.op == "call_function" and "val" in n.meta:
                rule = tp.get_type_promotion_rule(n, self.type_promotion_table)
                if rule is None or not _needs_promotion(n, rule):
                    return n.meta["val"]
            return super().run_node(n)

    promote = tp.InsertTypePromotion(gm)
    promote.interpreter = Selective(gm, promote.interpreter.type_promotion_table)
    promote.run()


def _needs_promotion(node: fx.Node, rule: Any) -> bool:
    """Whether the exporter's promotion would cast any argument of ``node`` (its
    ``_maybe_promote_arg`` logic, read off the recorded values)."""
    scalar_dtype = torch_onnx_internals().type_promotion.fx_type_utils.from_scalar_type_to_torch_dtype

    def value(a: Any) -> Any:
        return a.meta["val"] if isinstance(a, fx.Node) else a

    args = pytree.tree_map(value, node.args)
    kwargs = pytree.tree_map(value, dict(node.kwargs))
    info = rule.preview_type_promotion(args, kwargs)

    def casts(v: Any, dtype: torch.dtype | None) -> bool:
        if dtype is None:
            return False
        if isinstance(v, torch.Tensor):
            return v.dtype != dtype
        if isinstance(v, (tuple, list)):
            return any(casts(x, dtype) for x in v)
        scalar = scalar_dtype(type(v))
        return scalar is not None and scalar != dtype

    return any(casts(v, info.args_dtypes.get(i)) for i, v in enumerate(args)) or \
        any(casts(v, info.kwargs_dtypes.get(k)) for k, v in kwargs.items())


def _expand_sym_numel(gm: fx.GraphModule) -> None:
    """``aten.sym_numel(x)`` (a reshape's -1 over symbolic sizes) has no ONNX translation;
    the product of ``x``'s ``sym_size``s has. (torch.export never emits it: there the
    product is already folded into the sizes it traces.)"""
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target is not torch.ops.aten.sym_numel.default:
            continue
        x = node.args[0]
        with gm.graph.inserting_before(node):
            product = None
            for d in range(x.meta["val"].dim()):
                size = gm.graph.call_function(torch.ops.aten.sym_size.int, (x, d))
                size.meta["val"] = x.meta["val"].shape[d]
                product = size if product is None else gm.graph.call_function(operator.mul, (product, size))
                product.meta["val"] = size.meta["val"] if product is size else product.args[0].meta["val"] * size.meta["val"]
                for new in (size, product):  # keep the replaced node's annotations (export's block tags)
                    if "custom" in node.meta:
                        new.meta["custom"] = node.meta["custom"]
            if product is None:  # a 0-d tensor holds one element
                product = 1
        node.replace_all_uses_with(product)
        gm.graph.erase_node(node)
    gm.recompile()


class NegativeZero(float):
    """``-0.0`` that is not equal to ``0.0`` as a dict key. The translation makes one ONNX
    constant per distinct Python number (a dict keyed by value), and ``-0.0 == 0.0``: a
    graph using both got one of them twice (``1 / (x * 0.0 + s)`` at ``s = -0.0`` gave
    -inf, eager inf). Everywhere else it is the float -0.0."""

    def __eq__(self, other: object) -> bool:
        return isinstance(other, float) and float(other) == 0.0 and math.copysign(1.0, other) < 0

    def __ne__(self, other: object) -> bool:
        return not self == other

    def __hash__(self) -> int:
        return hash(("qaic_dynamo.NegativeZero",))


def _keep_negative_zeros_apart(gm: fx.GraphModule) -> None:
    """Every ``-0.0`` argument of the graph (also inside lists) becomes :class:`NegativeZero`."""
    def swap(a: Any) -> Any:
        if type(a) is float and a == 0.0 and math.copysign(1.0, a) < 0:
            return NegativeZero(-0.0)
        if isinstance(a, (list, tuple)):
            items = [swap(x) for x in a]
            return type(a)(items) if any(x is not y for x, y in zip(items, a)) else a
        return a

    for module in gm.modules():
        if isinstance(module, fx.GraphModule):
            for node in module.graph.nodes:
                # Assigned only where a value changes: the setters re-link every use.
                args, kwargs = swap(node.args), {k: swap(v) for k, v in node.kwargs.items()}
                if args is not node.args:
                    node.args = args
                if any(kwargs[k] is not v for k, v in node.kwargs.items()):
                    node.kwargs = kwargs


def translate_aten(gm: fx.GraphModule, input_names: Sequence[str], output_names: Sequence[str], opset: int) -> onnx.ModelProto:
    """Translate an aten graph (from :func:`aten_graph`) node by node through the
    exporter's registry, naming its inputs and outputs. Raises if a node has no
    translation (the piece path then falls back to the exporter)."""
    import onnx_ir as ir

    internals = torch_onnx_internals()
    model = ir.Model(ir.Graph([], [], nodes=[], name="main_graph"), ir_version=MAX_IR_VERSION, producer_name="qaic_dynamo")
    registry = onnx_registry(opset)
    _keep_negative_zeros_apart(gm)
    try:
        infer_op_signatures(registry, [m.graph for m in gm.modules() if isinstance(m, fx.GraphModule)])
        with _memoized_op_signatures():
            internals.core._translate_fx_graph(
                gm.graph, model, graph_like=model.graph, owned_graphs={}, lower="at_conversion", registry=registry
            )
    except Exception as e:
        raise _DirectPathError(_failing_op(e), _first_line(e)) from e
    internals.ir_passes.add_opset_imports(model)
    if len(model.graph.inputs) != len(input_names) or len(model.graph.outputs) != len(output_names):
        raise _DirectPathError("(graph)", f"translated {len(model.graph.inputs)} inputs / {len(model.graph.outputs)} outputs, "
                               f"expected {len(input_names)} / {len(output_names)}")
    # An output that is an input (a piece passing a tensor through) or another output is
    # one value: naming it as the output renamed the input (the piece then failed its
    # input check and ran eagerly - transformers' sliding-window cache layers do this).
    taken = set(model.graph.inputs)
    for k, value in enumerate(list(model.graph.outputs)):
        if value in taken:
            copy = ir.Node("", "Identity", [value], num_outputs=1)
            model.graph.append(copy)
            copy.outputs[0].type, copy.outputs[0].shape = value.type, value.shape
            model.graph.outputs[k] = value = copy.outputs[0]
        taken.add(value)
    for value, name in zip(model.graph.inputs, input_names):
        value.name = name
    for value, name in zip(model.graph.outputs, output_names):
        value.name = name
    return ir.serde.serialize_model(model)


class ProcessWide:
    """A process-wide change held while any user is inside :meth:`held`: ``apply()`` runs
    at the first entry and ``restore(token)`` - with what ``apply`` returned - at the last
    exit, however threads and nesting overlap (a change made and undone per user would
    be undone under another user still inside)."""

    def __init__(self, apply: Callable[[], Any], restore: Callable[[Any], None]) -> None:
        self._apply, self._restore = apply, restore
        self._lock = threading.Lock()
        self._depth = 0
        self._token: Any = None

    @contextlib.contextmanager
    def held(self) -> Iterator[None]:
        with self._lock:
            if self._depth == 0:
                self._token = self._apply()
            self._depth += 1
        try:
            yield
        finally:
            with self._lock:
                self._depth -= 1
                if self._depth == 0:
                    self._restore(self._token)
                    self._token = None


_OP_SIGNATURES: dict[tuple[str, str, int], Any] = {}


def _memoize_op_signatures() -> Any:
    from onnx_ir.schemas import OpSignature

    original = OpSignature.__dict__["from_op_schema"]
    build = original.__func__

    def from_op_schema(cls: type, schema: Any) -> Any:
        key = (schema.domain, schema.name, schema.since_version)
        sig = _OP_SIGNATURES.get(key)
        if sig is None:
            sig = _OP_SIGNATURES[key] = build(cls, schema)
        return sig

    OpSignature.from_op_schema = classmethod(from_op_schema)
    return original


def _unmemoize_op_signatures(original: Any) -> None:
    from onnx_ir.schemas import OpSignature

    OpSignature.from_op_schema = original


#: While translating, ``onnx_ir``'s ``OpSignature.from_op_schema`` answers from a
#: process-wide memo keyed by (domain, op, since_version). The exporter's op recorder
#: rebuilds the signature of an ONNX op's schema on every node it emits (and each build
#: hashes every allowed type of every constraint): about a third of a piece's translation
#: time, for a value that depends only on the schema. The signature is read, never
#: changed, by the recorder. The patch is undone when the last translation in progress
#: (threads may overlap) ends, so nothing outside our own translations sees it.
_memoized_op_signatures = ProcessWide(_memoize_op_signatures, _unmemoize_op_signatures).held


def _guards_not_implied(fakes: Sequence[torch.Tensor], shape_env: Any, dynamo_sizes: Sequence[tuple[Any, ...]],
                        strict: bool = True, implied: list[sympy.Basic] | None = None) -> list[str]:
    """The trace's size guards that Dynamo's guards on the same sizes do not imply (all of
    them where that cannot be decided). ``strict=False`` leaves out guards on sizes Dynamo
    does not know (the KV caches' and slot mapping's, which the runtime binds as it finds
    them). ``implied`` receives the guards that are implied, in Dynamo's symbols: what the
    artifact assumes (see :func:`unmet_size_assumptions`). Reads the ShapeEnv's
    ``guards``, ``deferred_runtime_asserts``, ``get_axioms`` and ``_maybe_evaluate_static``
    (private, torch 2.13); if any is missing, nothing is taken as implied."""
    mapping: dict[sympy.Symbol, sympy.Expr] = {}
    dynamo_env = None
    for fake, sizes in zip(fakes, dynamo_sizes):
        for mine, theirs in zip(fake.shape, sizes):
            if isinstance(mine, torch.SymInt) and isinstance(theirs, torch.SymInt):
                mapping[mine.node.expr] = theirs.node.expr
                dynamo_env = theirs.node.shape_env
    try:
        exprs = [g.expr for g in shape_env.guards]
        exprs += [r.expr for rs in shape_env.deferred_runtime_asserts.values() for r in rs]
        if not exprs:
            return []
        axioms = None  # Dynamo's guards as axioms, read only if a guard needs proving
        unproven = []
        for expr in exprs:
            if not expr.free_symbols <= mapping.keys():
                if strict:
                    unproven.append(str(expr))
                continue
            if dynamo_env is None:
                unproven.append(str(expr))
                continue
            theirs = expr.xreplace(mapping)
            if axioms is None:
                axioms = dynamo_env.get_axioms()
            if not _implied(theirs, dynamo_env, axioms):
                unproven.append(str(expr))
            elif implied is not None and theirs not in (True, sympy.true):  # true of any sizes: nothing to check
                implied.append(theirs)
        return unproven
    except Exception as e:  # a private API moved: prove nothing
        return [f"(cannot check: {type(e).__name__})"]


def _implied(expr: sympy.Basic, shape_env: Any, axioms: Any) -> bool:
    """Whether ``expr`` (in ``shape_env``'s symbols) follows from that env's guards."""
    if expr is sympy.true or expr is True:
        return True
    return shape_env._maybe_evaluate_static(expr, axioms=axioms) == sympy.true or holds_over_range(
        expr, shape_env.var_to_range)


def unmet_size_assumptions(assumptions: Sequence[str], example_args: Sequence[Any]) -> list[str]:
    """The size assumptions of an artifact that Dynamo's guards of this call site do not imply.

    An artifact whose lowering branched on a dynamic size (a decomposition's split at a
    remainder, adaptive pooling's windows) is correct only where the guards of the compile
    it was lowered in hold; its layout lists them (``PieceLayout.size_assumptions``, in the
    fingerprint's canonical symbols), and the key does not: the same graph under weaker
    guards has the same key. So every reuse checks them against the reusing compile's
    guards, with the proof the lowering used. Anything undecidable counts as unmet."""
    if not assumptions:
        return []
    from qaic_dynamo.artifact import parse_size_assumption

    canon = canonical_names(example_args)
    symbol_of = {str(c): s for s, c in canon.symbols.items()}  # canonical name -> this compile's symbol
    shape_env = next((x.node.shape_env for a in example_args
                      for x in ((*a.shape, *a.stride()) if isinstance(a, torch.Tensor) else (a,))
                      if isinstance(x, torch.SymInt)), None)
    unmet = []
    axioms = None
    for text in assumptions:
        try:
            expr = parse_size_assumption(text)
            if not {str(s) for s in expr.free_symbols} <= symbol_of.keys() or shape_env is None:
                unmet.append(text)
                continue
            theirs = expr.xreplace({s: symbol_of[str(s)] for s in expr.free_symbols})
            if axioms is None:
                axioms = shape_env.get_axioms()
            if not _implied(theirs, shape_env, axioms):
                unmet.append(text)
        except Exception:  # a private API moved, or an expression sympy cannot decide
            unmet.append(text)
    return unmet


def holds_over_range(expr: sympy.Basic, ranges: Mapping[sympy.Symbol, Any], limit: int = 4096) -> bool:
    """Whether a guard on one size holds at every value of that size's (finite, small)
    range: sympy does not simplify ``Eq(s, Min(10, s))`` under ``s <= 10``."""
    if len(expr.free_symbols) != 1:
        return False
    (sym,) = expr.free_symbols
    vr = ranges.get(sym)
    from torch.utils._sympy.numbers import int_oo  # sympy takes torch's integer infinity for finite

    if vr is None or any(b in (int_oo, -int_oo, sympy.oo, -sympy.oo) for b in (vr.lower, vr.upper)):
        return False
    if int(vr.upper) - int(vr.lower) > limit:
        return False
    return all(bool(expr.xreplace({sym: sympy.Integer(v)})) for v in range(int(vr.lower), int(vr.upper) + 1))


def _lower_direct(prepared: PreparedPiece, opset: int, seconds: dict[str, float]) -> onnx.ModelProto:
    """Translate the piece's aten graph node by node through the exporter's registry."""
    t0 = time.perf_counter()
    try:
        # At the example sizes, a branch a decomposition takes on a size (a split's
        # remainder at 17) must hold at every size Dynamo sends this graph.
        gm = aten_graph(prepared.gm, prepared.example, prepared.dynamic_shapes, opset,
                        guards_follow_from=prepared.dynamo_sizes)
    except LoweringError:
        raise
    except Exception as at_primes:
        if prepared.real_example is None:
            raise
        try:  # the sizes Dynamo saw satisfy its guards (see export_inputs)
            gm = aten_graph(prepared.gm, prepared.real_example, prepared.dynamic_shapes, opset, keep_symbols_apart=True,
                            guards_follow_from=prepared.dynamo_sizes)
        except _SizeBranchError:
            raise  # never hand such a piece to the exporter (see _SizeBranchError)
        except Exception:
            raise at_primes from None
    seconds["aten_trace"] = time.perf_counter() - t0
    prepared.size_assumptions = list(gm.meta.get("size_assumptions", ()))
    return translate_aten(gm, prepared.input_names, prepared.output_names, opset)


def _failing_op(e: BaseException) -> str:
    """The op named in a translation error ("... target=torch.ops.aten.x.default ..."), or
    the error's type."""
    import re

    match = re.search(r"target=([\w.:]+)", str(e))
    return match.group(1) if match else type(e).__name__


@contextlib.contextmanager
def _exporter_noise_suppressed() -> Iterator[None]:
    """Silence the one warning torch's exporter emits on every export that no caller can
    act on: ``run_decompositions`` deep-copies its module call graph, and unpickling a
    ``LeafSpec`` there raises pytree's deprecation FutureWarning (torch 2.13)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r".*isinstance\(treespec, LeafSpec\).*", category=FutureWarning)
        yield


def _lower_with_exporter(prepared: PreparedPiece, opset: int) -> onnx.ModelProto:
    """The fallback: torch.export, run_decompositions and translation (the exporter core
    with our cached registry when available, else the public ``torch.onnx.export``). An
    export whose size guards do not follow from Dynamo's is tried again at the sizes
    Dynamo saw, as the direct path's trace is."""
    try:
        try:
            return _exported_model(prepared, prepared.example, opset)
        except _SizeBranchError:
            if prepared.real_example is None:
                raise
            return _exported_model(prepared, prepared.real_example, opset)
    except _SizeBranchError as e:
        raise LoweringError(f"its export branches on a dynamic size ({e}); compiled, it would serve sizes the branch "
                            "is wrong for") from e
    except Exception as e:
        raise LoweringError(f"the ONNX exporter failed: {_first_line(e)}{_fix_hint(e)}") from e


#: Other libraries' ops with no ONNX translation, and what a user does instead.
UNTRANSLATABLE_OP_FIXES = {
    "transformers.grouped_mm_fallback": (
        "transformers' default 'grouped_mm' experts run an opaque loop over data-dependent group sizes; call "
        "model.set_experts_implementation('batched_mm') before compiling (qaic_dynamo.LLM does)"),
}


def _fix_hint(e: BaseException) -> str:
    text = str(e)
    return next((f" ({fix})" for op, fix in UNTRANSLATABLE_OP_FIXES.items() if f"'{op}'" in text or f"{op}." in text), "")


def _exported_model(prepared: PreparedPiece, example: Sequence[torch.Tensor], opset: int) -> onnx.ModelProto:
    common = dict(
        dynamic_shapes=tuple(prepared.dynamic_shapes),
        input_names=prepared.input_names,
        output_names=prepared.output_names,
        # The exporter's optimizer would inline KVCacheScatter; ONNX Runtime optimises the
        # graph itself when it loads it, and the QAIC compiler wants the function intact.
        optimize=False,
        verbose=False,
    )
    # The exporter traces with torch.export. Run it outside Dynamo's tracing context,
    # or the guards it records on its own inputs leak into the frame being compiled.
    with torch._guards.tracing(None), _exporter_noise_suppressed():
        # Non-strict only, and here: given a module, the exporter retries a failed
        # non-strict export with strict=True, i.e. with Dynamo - inside the Dynamo
        # compile that called this backend. Dynamo's export then drops the cache entries
        # of the code it was handed (or, for a callable it cannot key, all of them),
        # and the outer compile crashed building its guards on the freed entries
        # (InternalTorchDynamoError or a segfault; seen on a recompile of a model whose
        # float attribute had become a graph input).
        exported = torch.export.export(prepared.gm, tuple(example), dynamic_shapes=tuple(prepared.dynamic_shapes),
                                       strict=False)
        # Eager's arithmetic on this path too (the exporter's own decompositions follow);
        # torch.export keeps sdpa whole, so it is opened to reach the CPU kernel's op.
        exported = exported.run_decompositions(
            {**TORCH_SEMANTICS, _aten.scaled_dot_product_attention.default: _open_sdpa})
        internals = torch_onnx_internals()
        if internals is not None:
            # opset_version=None: the registry already targets the opset, so no version
            # conversion (which would also inline every function) is needed.
            registry = onnx_registry(opset)
            # The exporter's own decompositions, run here (its own run then finds
            # nothing left): a branch they take on a size is a guard to check too.
            exported = internals.fx_passes.decompose_with_registry(exported, registry)
            _check_export_guards(exported, prepared)
            infer_op_signatures(registry, None)  # the exporter's graph is not known before it runs
            program = internals.core.export(exported, registry=registry, opset_version=None, **common)
        else:
            # Only torch.export's guards can be checked: the public exporter's own
            # decompositions happen inside it (docs/usage.md).
            _check_export_guards(exported, prepared)
            program = torch.onnx.export(
                exported, dynamo=True, opset_version=opset, custom_translation_table=_translations(), **common,
            )
        return program.model_proto


def _check_export_guards(exported: Any, prepared: PreparedPiece) -> None:
    """Refuse an export whose size guards (torch.export traced at the example sizes, and
    the decompositions after it, may branch on a size: a split's remainder, a pooling
    window) do not follow from Dynamo's guards; record the implied ones as the
    artifact's assumptions, as the direct path does."""
    if not prepared.dynamo_sizes:
        return
    placeholders = {n.name: n for n in exported.graph.nodes if n.op == "placeholder"}
    values = [placeholders[name].meta.get("val") for name in exported.graph_signature.user_inputs]
    shape_env = next((d.node.shape_env for v in values if isinstance(v, torch.Tensor) for d in v.shape
                      if isinstance(d, torch.SymInt)), None)
    if shape_env is None:
        return
    implied: list[sympy.Basic] = []
    unproven = _guards_not_implied(values, shape_env, prepared.dynamo_sizes, strict=False, implied=implied)
    if unproven:
        raise _SizeBranchError("(export)", f"size guards {unproven} do not follow from Dynamo's")
    prepared.size_assumptions = implied


def _export(prepared: PreparedPiece, opset: int, seconds: dict[str, float]) -> tuple[onnx.ModelProto, str | None]:
    """The piece's ONNX model, and why the exporter had to be used (None: direct path).
    Records ``aten_trace`` (direct path) in ``seconds``."""
    if torch_onnx_internals() is None:
        reason = f"no direct path on torch {torch.__version__} (tested: {TESTED_TORCH})"
    else:
        try:
            return _lower_direct(prepared, opset, seconds), None
        except LoweringError:
            raise
        except _SizeBranchError as e:
            raise LoweringError(f"its lowering branches on a dynamic size ({e}); compiled, it would serve sizes "
                                "the branch is wrong for") from e
        except _DirectPathError as e:
            reason = str(e)
        except Exception as e:  # the trace or a pass failed: the exporter may still manage
            reason = f"{_failing_op(e)}: {_first_line(e)}"
    logger.info("qaic: direct lowering failed (%s); using the exporter", reason)
    return _lower_with_exporter(prepared, opset), reason


def _first_line(e: BaseException) -> str:
    """The exporter's errors are pages long; the reason is in the innermost cause."""
    while e.__cause__ is not None:
        e = e.__cause__
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}"
