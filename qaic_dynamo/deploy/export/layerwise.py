"""Layerwise export: translate one decoder block and stitch it L times.

The model is traced with only its first two decoder blocks (three if the first differs),
the aten graph is cut at the block boundaries (recorded as node annotations), and the
first block and the next are translated once each; the second is stitched L - 1 times
into the merged model, each instance with its own weights and its own retained-state
names. Export time is then flat in depth apart from writing the weights.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import onnx
import torch
import torch.fx as fx
from torch.fx.passes.split_module import split_module

from qaic_dynamo.deploy.export.assemble import io_names
from qaic_dynamo.deploy.export.rewrites import splits_without_sequences
from qaic_dynamo.deploy.export.trace import Trace
from qaic_dynamo.deploy.naming import align_inputs_to_outputs
from qaic_dynamo.errors import BlocksDiffer, ExportError, LoweringError
from qaic_dynamo.lowering import finish_model, size_expression, translate_aten

__all__ = ["BLOCK_ANNOTATION", "layerwise_model"]

#: The node annotation (``torch.fx.traceback.annotate``) that says which block made a node.
BLOCK_ANNOTATION = "qaic_export_block"


def _block_of(node: fx.Node) -> int | None:
    return node.meta.get("custom", {}).get(BLOCK_ANNOTATION)


def _hoist_shared_sizes(gm: fx.GraphModule) -> None:
    """Compute every symbolic size the blocks use before the blocks, from the input dims.

    A symbolic size (e.g. batch x seq for a reshape) is traced once and its node reused
    wherever the same size comes up again, so block 1 may read it from inside block 0,
    and where in a block a size first comes up can differ from block to block (an MoE
    layer's tokens x top-k). Either makes block 0 and block 1 different graphs, and the
    first makes block 1's input a value that is shared, not chained. Computed from the
    model inputs' dims before the blocks, each size is an input every block shares. A
    size that cannot be (not sums, products and floor divisions of input dims, e.g. a
    data-dependent one) stays where it is: if the blocks then differ, the export traces
    a third block to tell shared from chained values."""
    dims: dict[Any, tuple[fx.Node, int]] = {}
    for ph in gm.graph.find_nodes(op="placeholder"):
        val = ph.meta.get("val")
        for d, size in enumerate(val.shape if isinstance(val, torch.Tensor) else ()):
            if isinstance(size, torch.SymInt) and size.node.expr.is_Symbol:
                dims.setdefault(size.node.expr, (ph, d))
    anchor = next(n for n in gm.graph.nodes if n.op != "placeholder")
    hoisted: dict[Any, Any] = {}
    for node in list(gm.graph.nodes):
        b, val = _block_of(node), node.meta.get("val")
        if b is None or not isinstance(val, torch.SymInt):
            continue
        expr = val.node.expr
        if expr in hoisted:  # one node per size, whichever blocks use it
            node.replace_all_uses_with(hoisted[expr])
            gm.graph.erase_node(node)
            continue
        before = set(gm.graph.nodes)
        try:
            with gm.graph.inserting_before(anchor):
                size = size_expression(gm.graph, expr, dims)
        except LoweringError:
            continue
        if not isinstance(size, fx.Node):  # a constant: nothing to share
            continue
        hoisted[expr] = size
        for new in (n for n in gm.graph.nodes if n not in before):
            args = [a.meta["val"] if isinstance(a, fx.Node) else a for a in new.args]
            new.meta["val"] = args[0].shape[args[1]] if new.target is torch.ops.aten.sym_size.int else new.target(*args)
            new.meta["nn_module_stack"] = {}  # the translator records it per node
        node.replace_all_uses_with(size)
        gm.graph.erase_node(node)
    gm.recompile()


def layerwise_model(
    trace: Trace,
    blocks_path: str,
    num_layers: int,
    prefix: str | None,
    opset: int,
    on_layer: Callable[[int], None] = lambda i: None,
) -> tuple[onnx.ModelProto, list[str]]:
    """Cut a trace of the first two or three blocks into pre / blocks / post, translate
    pre, block 0, block 1 and post once each, and stitch block 0 plus ``num_layers - 1``
    instances of block 1 into one model.

    Block 0 is its own part because a first layer may differ from the rest (vLLM-style
    layers start the residual stream there), as the backend's first piece does. Two
    consecutive blocks that are one graph say which block inputs chain from the previous
    block, which are shared, and which are per layer (weights, caches): blocks 0 and 1 of
    a two-block trace, or blocks 1 and 2 of a three-block one. A two-block trace whose
    blocks differ raises :class:`BlocksDiffer` (the caller then traces three)."""

    gm = trace.gm
    traced = trace.num_layers
    _hoist_shared_sizes(gm)
    order = {n: k for k, n in enumerate(gm.graph.nodes)}
    first_block = min((order[n] for n in gm.graph.nodes if _block_of(n) is not None), default=None)
    if first_block is None:
        raise ExportError("layerwise export found no decoder-block nodes; export with layerwise=False")

    def part(node: fx.Node) -> int:
        b = _block_of(node)
        if b is not None:
            return b + 1
        return 0 if order[node] < first_block else traced + 1

    try:
        split = split_module(gm, gm, part, keep_original_order=True)
    except Exception as e:
        raise ExportError(
            f"the decoder blocks are not separable from the rest of the model ({e}); export with layerwise=False"
        ) from e
    calls = {n.target: n for n in split.graph.nodes if n.op == "call_module"}
    names = [f"submod_{k}" for k in range(traced + 2)]
    PRE, POST, blocks = names[0], names[-1], names[1:-1]
    B0, B1, LAST = blocks[0], blocks[1], blocks[-1]
    if set(calls) != set(names):
        raise ExportError(
            f"layerwise export expected pre / {traced} blocks / post, got {sorted(calls)}; use layerwise=False"
        )
    sub = {k: getattr(split, k) for k in calls}
    # The pair of blocks that are one graph: the template's inputs are read off it.
    one, two = blocks[-2], blocks[-1]
    if _graph_signature(sub[one]) != _graph_signature(sub[two]):
        if traced == 2:
            raise BlocksDiffer()
        raise ExportError(
            "the decoder blocks differ structurally (e.g. per-layer attention types or windows); "
            "export with layerwise=False"
        )

    placeholder_kind = dict(zip([n for n in split.graph.nodes if n.op == "placeholder"], trace.inputs))

    def source(arg: fx.Node) -> tuple:
        """("in", kind, ...) for a top-level input, ("out", part, index) for a part's output."""
        if arg.op == "placeholder":
            return ("in",) + tuple(placeholder_kind[arg])
        if (
            arg.op == "call_function"
            and arg.args
            and isinstance(arg.args[0], fx.Node)
            and arg.args[0].op == "call_module"
        ):
            return ("out", arg.args[0].target, arg.args[1])
        if arg.op == "call_module":
            return ("out", arg.target, 0)
        raise ExportError(f"layerwise export cannot follow value {arg.name}")

    srcs = {k: [source(a) for a in calls[k].args] for k in calls}

    def translate(k: str) -> onnx.ModelProto:
        _fill_output_meta(sub[k])
        ins = [f"in{m}" for m in range(len(srcs[k]))]
        outs = [f"out{m}" for m in range(_num_outputs(sub[k]))]
        try:
            # Finished (onnxscript helpers inlined) so the stitched model needs only the
            # qaic functions, which finish_model attaches once at the end.
            part_model = finish_model(translate_aten(sub[k], ins, outs, opset), opset, check=False)
        except Exception as e:
            raise ExportError(f"part {k} could not be translated to ONNX: {e}") from e
        del part_model.functions[:]
        splits_without_sequences(part_model)  # here, while the part still knows its dims
        return part_model

    parts = {k: translate(k) for k in (PRE, B0, B1, POST)}
    outputs, past_name = io_names(trace, range(num_layers), prefix)
    nodes: list[onnx.NodeProto] = []
    initializers: list[onnx.TensorProto] = []
    emitted: dict[str, list[str]] = {}

    def value(src: tuple, layer: int) -> str:
        """The stitched value of a source as seen by ``layer`` (top-level inputs only
        depend on the layer for caches)."""
        if src[0] == "out":
            return emitted[src[1]][src[2]]
        if src[1] == "past":
            return past_name[(layer, src[3])]
        return src[2]  # input_ids / position_ids / a weight by its qualified name

    def emit(k: str, tag: str, inputs: list[str]) -> list[str]:
        return _append_renamed(nodes, initializers, parts[k].graph, tag, {f"in{m}": v for m, v in enumerate(inputs)})

    emitted[PRE] = emit(PRE, "pre", [value(s, 0) for s in srcs[PRE]])
    emitted[B0] = emit(B0, "layers.0", [value(s, 0) for s in srcs[B0]])
    a = blocks.index(one)  # the layer that block `one` is
    w1, w2 = f"{blocks_path}.{a}.", f"{blocks_path}.{a + 1}."
    prev = emitted[B0]
    block_outs = [prev]
    on_layer(0)
    for i in range(1, num_layers):
        ins = []
        for m, (s1, s2) in enumerate(zip(srcs[one], srcs[two])):
            if s2[:2] == ("out", one):  # chained: the previous block's output
                # Layer 1 reads what block 1 read in the trace (block 0 may differ from
                # the rest); later layers the template's own output.
                ins.append(value(srcs[B1][m], i) if i == 1 else prev[s2[2]])
            elif s1 == s2:  # shared by every layer
                ins.append(value(s1, i))
            elif (
                s1[:2] == ("in", "weight")
                and s2[:2] == ("in", "weight")
                and s1[2].startswith(w1)
                and s2[2] == w2 + s1[2][len(w1) :]
            ):
                ins.append(f"{blocks_path}.{i}." + s1[2][len(w1) :])
            elif s1[:2] == ("in", "past") and s2[:2] == ("in", "past") and s1[3] == s2[3]:
                ins.append(past_name[(i, s1[3])])
            elif traced == 2:  # block 0 may be special after all: let a third block tell
                raise BlocksDiffer()
            else:
                raise ExportError(
                    f"block input {m} differs between layers in a way layerwise export cannot map "
                    f"({s1} vs {s2}); use layerwise=False"
                )
        prev = emit(B1, f"layers.{i}", ins)
        block_outs.append(prev)
        on_layer(i)
    emitted[LAST] = prev  # post reads the last block's outputs
    if any(s[0] == "out" and s[1] in blocks[:-1] for s in srcs[POST]):
        raise ExportError("the model reads a non-final decoder block's output after the blocks; use layerwise=False")
    emitted[POST] = emit(POST, "post", [value(s, 0) for s in srcs[POST]])

    # Outputs: logits from post, then each layer's caches at the output positions its
    # block kind had in the trace (layer 0: block 0's, the others: block 1's).
    top = [source(a) for a in split.graph.find_nodes(op="output")[0].args[0]]
    if top[0][:2] != ("out", POST):
        raise ExportError("the logits are not computed after the decoder blocks; use layerwise=False")
    idx0 = [s[2] for s in top[1:] if s[:2] == ("out", B0)]
    idx1 = [s[2] for s in top[1:] if s[:2] == ("out", B1)]
    values = [emitted[POST][top[0][2]]] + [
        block_outs[i][k] for i in range(num_layers) for k in (idx0 if i == 0 else idx1)
    ]
    kept_src = top[len(top) - len(trace.retained) :] if trace.retained else []
    if any(s[0] == "out" and s[1] in blocks for s in kept_src):
        raise ExportError("a retained buffer is written inside the decoder blocks; use layerwise=False")
    values += [value(s, 0) for s in kept_src]
    for v, name in zip(values, outputs):
        nodes.append(onnx.helper.make_node("Identity", [v], [name], name=f"output/{name}"))

    past_vi = {src[3]: parts[B1].graph.input[m] for m, src in enumerate(srcs[B1]) if src[:2] == ("in", "past")}
    graph_inputs = []
    # input_ids, position_ids, and batch_index / comp_ctx_lengths where the export has them.
    for name in [src[1] for src in trace.inputs if src[0] == "input"]:
        vi = next(
            (
                parts[k].graph.input[m]
                for k in (PRE, B0, B1, POST)
                for m, s in enumerate(srcs[k])
                if s == ("in", "input", name)
            ),
            None,
        )
        if vi is None:
            raise ExportError(f"the model does not read {name}")
        graph_inputs.append(_renamed_vi(vi, name))
    graph_inputs += [_renamed_vi(past_vi[j], name) for (i, j), name in past_name.items()]
    kept_vi = {}
    for name in trace.retained:
        vi = next(
            (
                parts[k].graph.input[m]
                for k in (PRE, B0, B1, POST)
                for m, s in enumerate(srcs[k])
                if s == ("in", "retained", name)
            ),
            None,
        )
        if vi is None:
            raise ExportError(f"the model does not read its retained buffer {name!r}")
        kept_vi[name] = vi
        graph_inputs.append(_renamed_vi(vi, name))
    inputs_of = align_inputs_to_outputs(outputs)
    by_input = {n: j for (i, j), n in past_name.items()}
    graph_outputs = [_renamed_vi(parts[POST].graph.output[top[0][2]], "logits")]
    graph_outputs += [
        _renamed_vi(
            past_vi[by_input[inputs_of[name]]] if inputs_of[name] in by_input else kept_vi[inputs_of[name]], name
        )
        for name in outputs[1:]
    ]
    graph = onnx.helper.make_graph(nodes, "main_graph", graph_inputs, graph_outputs, initializer=initializers)
    model = onnx.helper.make_model(graph, opset_imports=list(parts[B1].opset_import), producer_name="qaic_dynamo")
    return finish_model(model, opset, check=False), outputs


def _renamed_vi(vi: onnx.ValueInfoProto, name: str) -> onnx.ValueInfoProto:
    out = onnx.ValueInfoProto()
    out.CopyFrom(vi)
    out.name = name
    return out


def _append_renamed(nodes: list, initializers: list, g: onnx.GraphProto, tag: str, rename: dict[str, str]) -> list[str]:
    """Copy ``g``'s nodes (and constants) into ``nodes``, every value renamed to
    ``tag/name`` unless ``rename`` maps it (the part's inputs)."""

    def name_of(v: str) -> str:
        if not v:
            return v
        return rename.get(v, f"{tag}/{v}")

    for init in g.initializer:
        t = onnx.TensorProto()
        t.CopyFrom(init)
        t.name = name_of(init.name)
        initializers.append(t)
    for n in g.node:
        c = onnx.NodeProto()
        c.CopyFrom(n)
        del c.input[:]
        c.input.extend(name_of(v) for v in n.input)
        del c.output[:]
        c.output.extend(name_of(v) for v in n.output)
        c.name = f"{tag}/{n.name}" if n.name else ""
        if any(a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS) for a in n.attribute):
            raise ExportError(f"layerwise stitching does not handle control flow ({n.op_type}); use layerwise=False")
        nodes.append(c)
    return [name_of(o.name) for o in g.output]


def _graph_signature(gm: fx.GraphModule) -> list[tuple]:
    """A block graph's structure without its node names: op, target and arguments by
    position (placeholders by index)."""
    index = {n: k for k, n in enumerate(gm.graph.nodes)}

    def norm(a: Any) -> Any:
        if isinstance(a, fx.Node):
            return ("node", index[a])
        if isinstance(a, (list, tuple)):
            return tuple(norm(x) for x in a)
        if isinstance(a, dict):
            return tuple(sorted((k, norm(v)) for k, v in a.items()))
        return repr(a)

    return [
        (n.op, str(n.target) if n.op != "placeholder" else "", norm(n.args), norm(n.kwargs)) for n in gm.graph.nodes
    ]


def _num_outputs(gm: fx.GraphModule) -> int:
    out = gm.graph.find_nodes(op="output")[0].args[0]
    return len(out) if isinstance(out, (tuple, list)) else 1


def _fill_output_meta(gm: fx.GraphModule) -> None:
    """split_module's parts return a single value bare; the translator wants a tuple."""
    out = gm.graph.find_nodes(op="output")[0]
    if not isinstance(out.args[0], (tuple, list)):
        out.args = ((out.args[0],),)
        gm.recompile()
