"""Translate an aten graph to ONNX, node by node, through torch.onnx's registry."""

from __future__ import annotations

from collections.abc import Sequence

import onnx
import torch.fx as fx

from qaic_dynamo._compat import torch_onnx_internals
from qaic_dynamo.errors import DirectPathError
from qaic_dynamo.lowering.aten_passes import keep_negative_zeros_apart
from qaic_dynamo.lowering.common import MAX_IR_VERSION, failing_op, first_line
from qaic_dynamo.lowering.registry import onnx_registry
from qaic_dynamo.lowering.signatures import infer_op_signatures, memoized_op_signatures

__all__ = ["translate_aten"]


def translate_aten(
    gm: fx.GraphModule, input_names: Sequence[str], output_names: Sequence[str], opset: int
) -> onnx.ModelProto:
    """Translate an aten graph (from :func:`aten_graph`) node by node through the
    exporter's registry, naming its inputs and outputs. Raises if a node has no
    translation (the piece path then falls back to the exporter)."""
    import onnx_ir as ir

    internals = torch_onnx_internals()
    model = ir.Model(
        ir.Graph([], [], nodes=[], name="main_graph"), ir_version=MAX_IR_VERSION, producer_name="qaic_dynamo"
    )
    registry = onnx_registry(opset)
    keep_negative_zeros_apart(gm)
    try:
        infer_op_signatures(registry, [m.graph for m in gm.modules() if isinstance(m, fx.GraphModule)])
        with memoized_op_signatures():
            internals.core._translate_fx_graph(
                gm.graph, model, graph_like=model.graph, owned_graphs={}, lower="at_conversion", registry=registry
            )
    except Exception as e:
        raise DirectPathError(failing_op(e), first_line(e)) from e
    internals.ir_passes.add_opset_imports(model)
    if len(model.graph.inputs) != len(input_names) or len(model.graph.outputs) != len(output_names):
        raise DirectPathError(
            "(graph)",
            f"translated {len(model.graph.inputs)} inputs / {len(model.graph.outputs)} outputs, "
            f"expected {len(input_names)} / {len(output_names)}",
        )
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
