"""Finish a translated model: self-contained, clean, checked.

onnxscript's helper functions are inlined, the qaic functions attached, unused
initializers dropped and the opset imported explicitly; a model for ONNX Runtime also
keeps its float16 / bfloat16 roundings. Every lowered piece must then pass
``onnx.checker.check_model(full_check=True)``.
"""

from __future__ import annotations

import onnx
import onnx.inliner

from qaic_dynamo.artifact import PieceLayout
from qaic_dynamo.errors import LoweringError
from qaic_dynamo.lowering.common import MAX_IR_VERSION, first_line
from qaic_dynamo.ops import QAIC_DOMAIN

__all__ = ["finish_model", "finish_piece_model", "keep_reduced_float_roundings"]


def finish_piece_model(model: onnx.ModelProto, layout: PieceLayout, opset: int) -> onnx.ModelProto:
    """Make the exported piece self-contained and clean, and check it."""
    if layout.kv_updates and not any(
        n.op_type == "KVCacheScatter" and n.domain == QAIC_DOMAIN for n in model.graph.node
    ):
        raise LoweringError("the exported model has no KVCacheScatter node for its cache update")
    model = finish_model(model, opset, keep_roundings=True)
    names = [i.name for i in model.graph.input]
    want = [i["name"] for i in layout.inputs]
    if names != want:
        raise LoweringError(f"the lowered model's inputs differ from the piece's: expected {want}, got {names}")
    return model


_REDUCED_FLOATS = (onnx.TensorProto.FLOAT16, onnx.TensorProto.BFLOAT16)


def keep_reduced_float_roundings(model: onnx.ModelProto) -> None:
    """Keep the roundings to float16 / bfloat16 that ONNX Runtime's CPU cast insertion
    drops: it runs such ops in float32 and, around a Cast next to one, changes the Cast to
    float32 too, so ``(x.half() * 2).float()`` of a float32 ``x`` came back never rounded
    (1000.123 * 2 gave 2000.246, eager 2000) and a float16 chain widened by a Cast was not
    rounded at its end. An Identity after every Cast to a reduced float and before every
    Cast from one (its kernel takes float16, so the cast insertion leaves those Casts
    alone) keeps them; the session must not remove Identity nodes (``artifact.load``).
    Within a chain of float16 ops ONNX Runtime still rounds once, and Casts inside If / Loop
    bodies (``torch.cond``) are left as they are (docs/usage.md)."""
    types = {
        v.name: v.type.tensor_type.elem_type for v in (*model.graph.input, *model.graph.value_info, *model.graph.output)
    }
    types.update({t.name: t.data_type for t in model.graph.initializer})
    nodes: list[onnx.NodeProto] = []
    for i, node in enumerate(model.graph.node):
        to = (
            next((a.i for a in node.attribute if a.name == "to"), None)
            if node.op_type == "Cast" and not node.domain
            else None
        )
        # An input of unknown type gets one too: an Identity costs nothing where none is needed.
        if (
            to is not None
            and to not in _REDUCED_FLOATS
            and types.get(node.input[0], _REDUCED_FLOATS[0]) in _REDUCED_FLOATS
        ):
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


def finish_model(
    model: onnx.ModelProto, opset: int, check: bool = True, keep_roundings: bool = False
) -> onnx.ModelProto:
    """Make a translated model self-contained and clean (onnxscript's helper functions
    inlined, our functions attached, no unused initializers) and, with ``check``, pass
    ``onnx.checker.check_model(full_check=True)``. ``keep_roundings``: for ONNX Runtime
    (:func:`keep_reduced_float_roundings`; the deployment export's models are for the
    QAIC compiler)."""
    model.ir_version = min(model.ir_version, MAX_IR_VERSION)
    # Helper functions of onnxscript's torch library (pkg.onnxscript.torch_lib) are
    # inlined so the model holds only standard ops and our own functions.
    if len(model.functions):
        model = onnx.inliner.inline_local_functions(model)
    from qaic_dynamo.ops.onnx_functions import function_protos

    used = {n.op_type for n in model.graph.node if n.domain == QAIC_DOMAIN}
    model.functions.extend(function_protos(used))
    # A graph whose outputs are all constants has no nodes, and the exporter then imports
    # no opset; the checker (rightly) rejects that.
    if not any(o.domain in ("", "ai.onnx") for o in model.opset_import):
        model.opset_import.append(onnx.helper.make_opsetid("", opset))
    _remove_unused_initializers(model)
    if keep_roundings:
        keep_reduced_float_roundings(model)
    if check:
        try:
            onnx.checker.check_model(model, full_check=True)
        except Exception as e:
            raise LoweringError(f"the lowered model fails onnx.checker: {first_line(e)}") from e
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
