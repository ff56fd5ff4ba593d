"""Rewrite a piece for export: the four FX passes, and the layout they produce.

Input: a compilable piece (an FX GraphModule from the partition stage) and fake example
arguments. The piece is copied and rewritten, each pass a function below:

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
   model: the runtime computes its leaves directly. An input the piece writes in place
   (:func:`input_writes_written_back`) leaves as one more output, ``written<i>``, which
   the runtime copies into it.
4. :func:`export_inputs` - example tensors, names and dynamic dims for the exporter.

The result, :class:`PreparedPiece`, is a pure graph and its ``PieceLayout``.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import sympy
import torch
import torch.fx as fx
from torch.fx.passes.fake_tensor_prop import FakeTensorProp
from torch.multiprocessing.reductions import StorageWeakRef

from qaic_dynamo._compat import pytree
from qaic_dynamo.artifact import PieceLayout, SymbolNames, canonical_names
from qaic_dynamo.errors import LoweringError
from qaic_dynamo.lowering.common import is_symbolic, size_hint
from qaic_dynamo.lowering.writes import input_write_error, input_writes, writes_metadata, written_tensors
from qaic_dynamo.ops import QAIC_OPS, kv_cache_update_op
from qaic_dynamo.runtime import MAX_SIZE_CARRIER, SIZE_CARRIER_DTYPE, dtype_name

__all__ = [
    "PreparedPiece",
    "after_placeholders",
    "export_inputs",
    "fake_values",
    "input_shape",
    "kv_updates_to_retained_state",
    "outputs_and_leaves",
    "prepare",
    "input_writes_written_back",
    "unwritable_inputs",
    "size_expression",
    "sizes_from_tensors",
]


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
    #: Per tensor argument: its layout ``dtype`` and ``shape`` (for a written-back output).
    input_meta: dict[int, dict[str, Any]] = field(default_factory=dict)
    #: Tensor arguments that cannot be written back, with why (see ``unwritable_inputs``).
    unwritable: dict[int, str] = field(default_factory=dict)


@dataclass
class _Rewrite:
    """State the passes share: the copy of the piece's graph being rewritten."""

    graph: fx.Graph
    example_args: Sequence[Any]
    canon: SymbolNames
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
    written_back: list[int] = field(default_factory=list)  # inputs written in place, by index


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
        if (
            isinstance(a, torch.SymInt)
            and ph.users
            and isinstance(a.node.expr, sympy.Symbol)
            and a.node.expr not in rw.sym_source
        ):
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
            ph.replace_all_uses_with(size, delete_user_cb=lambda user, size=size: user is not size)
            continue
        if ph.users:
            expr = a.node.expr
            missing = sorted(str(s) for s in expr.free_symbols if s not in rw.sym_source)
            if missing:
                raise LoweringError(
                    f"symbolic input '{rw.orig_of[ph].name}' = {expr} uses {missing}, which no "
                    "tensor input carries as a dimension"
                )
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
                heads = 1 if val.dim() == 2 else size_hint(val.shape[1])
                cache_dims.append([heads, size_hint(val.shape[-1]), dtype_name(val.dtype)])
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
            if isinstance(val, torch.SymInt) and is_symbolic(val):
                leaves.append(["sym", canon.expr(val.node.expr)])
            elif isinstance(val, (bool, int, float, torch.SymInt)):  # static: the key covers it
                leaves.append(["const", val if not isinstance(val, torch.SymInt) else int(val)])
            elif isinstance(val, torch.Tensor):
                if leaf not in onnx_outputs:
                    onnx_outputs.append(leaf)
                    out_meta.append({"name": f"out{len(onnx_outputs) - 1}", **_value_meta(val, canon)})
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
            outputs.append(
                {
                    "name": f"{name}_RetainedState",
                    "target": ["cache", u, j],
                    "dtype": upd["cache_dims"][j][2],
                    "shape": None,
                }
            )
    written: list[fx.Node] = []
    for i in rw.written_back:  # the input's value after the piece's writes
        val = rw.orig_of[rw.placeholders[i]].meta["val"]
        outputs.append({"name": f"written{i}", "target": ["write", i], **_value_meta(val, canon)})
        written.append(rw.placeholders[i])
    g.output(tuple(onnx_outputs + retained_nodes + written))
    return leaves, outputs, pytree.treespec_dumps(spec)


def _value_meta(val: torch.Tensor, canon: SymbolNames) -> dict[str, Any]:
    return {
        "dtype": dtype_name(val.dtype),
        "shape": [canon.expr(d.node.expr) if is_symbolic(d) else size_hint(d) for d in val.shape],
    }


def unwritable_inputs(rw: _Rewrite) -> dict[int, str]:
    """The tensor arguments a piece cannot write back, with why: one that requires grad
    (eager's write would join its autograd history) or shares memory with another
    argument (which of two writes lands would be up to the order of the copies)."""
    vals = [rw.orig_of[ph].meta.get("val") for ph in rw.placeholders]
    owners: dict[Any, list[int]] = {}
    for i, v in enumerate(vals):
        if isinstance(v, torch.Tensor):
            owners.setdefault(StorageWeakRef(v.untyped_storage()), []).append(i)
    why: dict[int, str] = {}
    for i, v in enumerate(vals):
        if not isinstance(v, torch.Tensor):
            continue
        others = [j for j in owners[StorageWeakRef(v.untyped_storage())] if j != i]
        if v.requires_grad:
            why[i] = "requires grad"
        elif others:
            why[i] = f"shares its memory with input {others[0]}"
    return why


def input_writes_written_back(rw: _Rewrite, unwritable: dict[int, str]) -> None:
    """An artifact cannot write its inputs (only retained state, the KV cache through
    ``qaic::unified_kv_cache_update``). A piece that writes an input, or a view of one, in
    place - a batch norm's running statistics, a buffer's ``add_`` - returns the input's
    new value as one more output, which the runner copies into it (``written_back``).
    Refused - the piece runs eagerly instead of losing the write - for an input in
    ``unwritable``. (Writes this Dynamo-graph check misses are written back from the aten
    graph: ``aten_trace.written_back_outputs``.)"""
    orig = rw.orig_of
    inputs = [(orig[ph].name, orig[ph].meta.get("val")) for ph in rw.placeholders]
    writes = [
        (node, orig[node], orig[w].meta.get("val"))
        for node in rw.graph.nodes
        for w in written_tensors(node)
        if isinstance(w, fx.Node) and w in orig
    ]
    # A view of an input reshaped in place (squeeze_) is no data to write back, and the
    # compiled output would lose the view: refused.
    reshaped = input_writes(inputs, ((o, v) for node, o, v in writes if writes_metadata(node)))
    for i, node in reshaped.items():
        raise input_write_error(node, i, inputs[i][0])
    hits = input_writes(inputs, ((o, v) for _, o, v in writes))
    for i, node in sorted(hits.items()):
        if i in unwritable or not isinstance(rw.example_args[i], torch.Tensor):
            raise input_write_error(node, i, inputs[i][0])
        rw.written_back.append(i)


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
    hints = {s: size_hint(s_int) for s, s_int in _symbol_hints(rw.example_args).items()}
    values = {s: next(primes, max(h, 2)) for s, h in hints.items()}
    real_usable = all(h >= 2 for h in hints.values()) and all(
        _concrete(input_shape(rw.example_args, src)[0], hints) <= MAX_SIZE_CARRIER
        for src in rw.input_sources
        if src[0] == "size"
    )  # a carrier as long as a seed is not allocated
    example: list[torch.Tensor] = []
    real: list[torch.Tensor] = []
    dynamic: list[dict[int, Any] | None] = []
    inputs: list[dict[str, Any]] = []
    for src in rw.input_sources:
        shape, dtype = input_shape(rw.example_args, src), _input_dtype(rw.example_args, src)
        example.append(torch.zeros([_concrete(d, values) for d in shape], dtype=dtype))
        if real_usable:
            real.append(torch.zeros([_concrete(d, hints) for d in shape], dtype=dtype))
        dyn = {d: torch.export.Dim.DYNAMIC for d, size in enumerate(shape) if is_symbolic(size)}
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
        first_body=after_placeholders(g),
    )
    _bind_symbols(rw)
    sizes_from_tensors(rw)
    kv_updates_to_retained_state(rw)
    unwritable = unwritable_inputs(rw)
    input_writes_written_back(rw, unwritable)
    leaves, outputs, out_spec = outputs_and_leaves(rw, out_val)
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
        fx.GraphModule(gm, g).eval(),
        example,
        dynamic,
        [i["name"] for i in inputs],
        [o["name"] for o in outputs],
        layout,
        real_example,
        [input_shape(example_args, src) for src in rw.input_sources],
        input_meta={
            i: _value_meta(rw.orig_of[ph].meta["val"], rw.canon)
            for i, ph in enumerate(rw.placeholders)
            if isinstance(rw.orig_of[ph].meta.get("val"), torch.Tensor)
        },
        unwritable=unwritable,
    )


def fake_values(gm: fx.GraphModule, example_args: Sequence[Any], fake_mode: Any) -> None:
    """Give every node of ``gm`` its fake value, ``meta["val"]``, for ``example_args``.

    Dynamo recorded each node's value as it traced, in the same fake mode, as
    ``meta["example_value"]``, and ``split_module`` copies node meta into the pieces: a
    piece whose placeholders hold exactly ``example_args`` (the backend's pieces) takes
    those. Running ``FakeTensorProp`` instead re-runs every op on fakes with symbolic
    shapes, as costly as the piece's whole aten trace. Any other graph (one
    a node of which lacks the value, or called on other arguments) is propagated.
    """
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    # A node nothing reads may lack one (Dynamo records no value for a call it keeps only
    # for its side effect, e.g. torch._C._log_api_usage_once); dead code is dropped later.
    body = [
        n for n in gm.graph.nodes if n.op not in ("placeholder", "output") and (n.users or "example_value" in n.meta)
    ]
    if (
        len(placeholders) == len(example_args)
        and all(n.meta.get("example_value") is a for n, a in zip(placeholders, example_args))
        and all("example_value" in n.meta for n in body)
    ):
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
    if is_symbolic(size):
        expr = size.node.expr
        if not expr.free_symbols <= set(values):
            raise LoweringError(f"size {expr} uses a symbol that no input dimension carries")
        return int(expr.xreplace(values))
    return int(size)


def after_placeholders(g: fx.Graph) -> fx.Node | None:
    nodes = list(g.nodes)
    last = max((i for i, n in enumerate(nodes) if n.op == "placeholder"), default=-1)
    return nodes[last + 1] if last + 1 < len(nodes) else None
