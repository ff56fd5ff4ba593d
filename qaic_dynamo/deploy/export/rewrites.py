"""Graph rewrites that make the exported model what a card (and QEfficient) expects.

* :func:`splits_without_sequences`: onnxscript's torch library lowers ``split`` / ``chunk``
  to ``SplitToSequence`` followed by one ``SequenceAt`` per piece. The model is then a
  sequence-typed graph: onnx's checker refuses it for bfloat16 (``SplitToSequence`` has no
  bfloat16 type), and the models QEfficient hands to qaic-compile hold no sequence ops.
  Every such split with constant sizes, read only through constant positions, becomes one
  ``Split`` with an output per piece.
* :func:`outputs_without_identities`: stitching names graph outputs through ``Identity``
  nodes. A retained-state output must instead be the KV scatter's own output: a runtime
  that binds the KV input and its ``_RetainedState`` output to one buffer then updates it
  in place, where an ``Identity`` would copy the whole cache into it on every call.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import helper, numpy_helper

__all__ = ["outputs_without_identities", "splits_without_sequences"]


def _constants(graph: onnx.GraphProto) -> dict[str, list[int]]:
    """int64 constants of ``graph`` (Constant nodes and initializers) as flat lists, with
    an entry ``name + "#rank"`` holding [rank]."""
    out: dict[str, list[int]] = {}

    def add(name: str, value) -> None:
        if value.dtype == "int64":  # what Split's sizes and SequenceAt's position may be
            out[name] = [int(v) for v in value.reshape(-1)]
            out[name + "#rank"] = [value.ndim]

    for init in graph.initializer:
        if init.data_type == onnx.TensorProto.INT64 and not init.external_data:
            add(init.name, numpy_helper.to_array(init))
    for node in graph.node:
        if node.op_type == "Constant" and node.domain in ("", "ai.onnx"):
            for a in node.attribute:
                if a.name == "value":
                    add(node.output[0], numpy_helper.to_array(a.t))
                elif a.name == "value_int":
                    out[node.output[0]], out[node.output[0] + "#rank"] = [a.i], [0]
                elif a.name == "value_ints":
                    out[node.output[0]], out[node.output[0] + "#rank"] = list(a.ints), [1]
    return out


def _static_dims(model: onnx.ModelProto) -> dict[str, list[int | None]]:
    """Every value's dims as shape inference finds them (None where a dim is symbolic);
    runs on the graph alone, never reading the weights' data."""
    bare = onnx.ModelProto()
    bare.CopyFrom(model)
    for init in bare.graph.initializer:  # dims are all inference needs
        init.ClearField("raw_data")
        del init.external_data[:]
        init.data_location = onnx.TensorProto.DEFAULT
    try:
        inferred = onnx.shape_inference.infer_shapes(bare, strict_mode=False).graph
    except Exception:  # no dims known: only splits with explicit sizes are rewritten
        return {}
    out: dict[str, list[int | None]] = {}
    for v in [*inferred.value_info, *inferred.input, *inferred.output]:
        if v.type.tensor_type.HasField("shape"):
            out[v.name] = [d.dim_value if d.HasField("dim_value") else None for d in v.type.tensor_type.shape.dim]
    for init in model.graph.initializer:
        out[init.name] = list(init.dims)
    return out


def _sizes(
    node: onnx.NodeProto, axis: int, constants: dict[str, list[int]], dims: dict[str, list[int | None]]
) -> list[int] | None:
    """The piece sizes of a SplitToSequence: its 1-D sizes, or for a scalar size (``chunk``)
    equal pieces and a shorter last one over the input's static dim."""
    sizes, rank = constants.get(node.input[1]), constants.get(node.input[1] + "#rank")
    if sizes is None or rank not in ([0], [1]):
        return None
    if rank == [1]:
        return sizes
    shape = dims.get(node.input[0])
    total = shape[axis] if shape is not None and -len(shape) <= axis < len(shape) else None
    if not total or sizes[0] <= 0:
        return None
    step = sizes[0]
    return [min(step, total - k) for k in range(0, total, step)]


def _rewrite(
    nodes: list[onnx.NodeProto],
    constants: dict[str, list[int]],
    dims: dict[str, list[int | None]],
    kept: set[str],
) -> list[onnx.NodeProto] | None:
    """``nodes`` with every rewritable SplitToSequence replaced (None: nothing changed).
    ``kept``: names read from outside ``nodes`` (graph outputs), never rewritten away."""
    consumers: dict[str, list[onnx.NodeProto]] = {}
    for node in nodes:
        for name in node.input:
            consumers.setdefault(name, []).append(node)
    replace: dict[int, list[onnx.NodeProto]] = {}  # id(node) -> what stands in its place
    for node in nodes:
        if node.op_type != "SplitToSequence" or node.domain not in ("", "ai.onnx") or len(node.input) < 2:
            continue
        axis = next((a.i for a in node.attribute if a.name == "axis"), 0)
        sizes = _sizes(node, axis, constants, dims)
        seq = node.output[0]
        readers = consumers.get(seq, [])
        if sizes is None or seq in kept or not readers:
            continue
        positions = []
        for r in readers:
            pos = constants.get(r.input[1]) if r.op_type == "SequenceAt" and len(r.input) == 2 else None
            if pos is None or constants.get(r.input[1] + "#rank") != [0] or not -len(sizes) <= pos[0] < len(sizes):
                break
            positions.append(pos[0] % len(sizes))
        else:
            names = [f"{seq}_split{k}" for k in range(len(sizes))]
            for r, k in zip(readers, positions):
                if names[k] == f"{seq}_split{k}":  # the first reader of piece k names it
                    names[k] = r.output[0]
                    replace[id(r)] = []
                else:
                    replace[id(r)] = [helper.make_node("Identity", [names[k]], [r.output[0]], name=f"{r.name}_id")]
            sizes_name = f"{seq}_sizes"
            const = helper.make_node(
                "Constant",
                [],
                [sizes_name],
                name=f"{node.name}_sizes",
                value=numpy_helper.from_array(np.array(sizes, dtype=np.int64)),
            )
            split = helper.make_node("Split", [node.input[0], sizes_name], names, name=f"{node.name}_split", axis=axis)
            replace[id(node)] = [const, split]
    if not replace:
        return None
    return [m for n in nodes for m in replace.get(id(n), [n])]


def splits_without_sequences(model: onnx.ModelProto) -> int:
    """Rewrite ``model``'s splits in place (see the module docstring); returns how many
    SplitToSequence nodes were replaced."""
    before = sum(n.op_type == "SplitToSequence" for n in model.graph.node)
    if not before:
        return 0
    constants = _constants(model.graph)
    new = _rewrite(list(model.graph.node), constants, _static_dims(model), {o.name for o in model.graph.output})
    if new is None:
        return 0
    used = {i for n in new for i in n.input} | {o.name for o in model.graph.output}
    # The sizes and positions the sequence ops read may now be unused constants.
    new = [n for n in new if n.op_type != "Constant" or any(o in used for o in n.output)]
    del model.graph.node[:]
    model.graph.node.extend(new)
    return before - sum(n.op_type == "SplitToSequence" for n in model.graph.node)


def outputs_without_identities(model: onnx.ModelProto) -> int:
    """Make every graph output that is an ``Identity`` of an inner value that value itself
    (renamed to the output's name); returns how many Identity nodes went."""
    g = model.graph
    nodes = list(g.node)  # held: ids identify nodes only while the objects live
    fixed = {i.name for i in g.input} | {t.name for t in g.initializer}
    outputs = {o.name for o in g.output}
    produced = {o for n in nodes for o in n.output}
    rename: dict[str, str] = {}
    dropped: set[int] = set()
    for n in nodes:
        if n.op_type != "Identity" or n.domain not in ("", "ai.onnx") or n.output[0] not in outputs:
            continue
        x = n.input[0]
        if x in fixed or x in outputs or x in rename or x not in produced:
            continue  # a graph input or another output: the Identity must stay
        rename[x] = n.output[0]
        dropped.add(id(n))
    if not rename:
        return 0
    kept = [n for n in nodes if id(n) not in dropped]
    for n in kept:
        for i, name in enumerate(n.input):
            if name in rename:
                n.input[i] = rename[name]
        for i, name in enumerate(n.output):
            if name in rename:
                n.output[i] = rename[name]
    infos = [v for v in g.value_info if v.name not in rename]
    del g.value_info[:]
    g.value_info.extend(infos)
    del g.node[:]
    g.node.extend(kept)
    return len(dropped)
