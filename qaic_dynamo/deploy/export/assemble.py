"""Assemble the exported ONNX model: names, dims, external weights, the whole-model path."""

from __future__ import annotations

from pathlib import Path

import onnx
import torch

from qaic_dynamo.deploy.export.trace import Trace
from qaic_dynamo.deploy.naming import (
    RETAINED_STATE_SUFFIX,
    align_inputs_to_outputs,
    apply_kv_cache_prefix,
    retained_state_names,
)
from qaic_dynamo.errors import ExportError
from qaic_dynamo.lowering import finish_model, translate_aten
from qaic_dynamo.runtime import ONNX_ELEMENT_TYPES

__all__ = ["external_weights", "io_names", "name_dims", "whole_model"]


def io_names(trace: Trace, layers: range, prefix: str | None) -> tuple[list[str], dict[tuple[int, int], str]]:
    """The model's output names (logits, then every layer's retained outputs, prefixed) and
    each (layer, j) cache's input name, derived from its output name."""
    outputs = ["logits"]
    for i in layers:
        outputs += retained_state_names(trace.stems.get(i, trace.stems[max(trace.stems)]), i)
    outputs += [f"{name}{RETAINED_STATE_SUFFIX}" for name in trace.retained]
    outputs = apply_kv_cache_prefix(outputs, prefix)
    inputs_of = align_inputs_to_outputs(outputs)
    past_name = {}
    k = 1
    for i in layers:
        for j in range(len(trace.stems.get(i, trace.stems[max(trace.stems)]))):
            past_name[(i, j)] = inputs_of[outputs[k]]
            k += 1
    return outputs, past_name


def name_dims(model: onnx.ModelProto) -> None:
    """Symbolic dims get QEfficient's names: batch_size, seq_len, ctx_len, and with continuous
    batching full_batch_size (the KV caches' rows), with CCL comp_ctx_lengths."""
    inputs = {v.name: v.type.tensor_type.shape.dim for v in model.graph.input}
    rename: dict[str, str] = {}
    ids = inputs["input_ids"]
    rename[ids[0].dim_param] = "batch_size"
    rename[ids[1].dim_param] = "seq_len"
    if "comp_ctx_lengths" in inputs:
        rename[inputs["comp_ctx_lengths"][0].dim_param] = "comp_ctx_lengths"
    for dims in inputs.values():
        if len(dims) == 4 and dims[2].dim_param:
            rename[dims[2].dim_param] = "ctx_len"
            if dims[0].dim_param and dims[0].dim_param not in rename:  # not batch_size: its own rows
                rename[dims[0].dim_param] = "full_batch_size"
    for value in [*model.graph.input, *model.graph.output, *model.graph.value_info]:
        for d in value.type.tensor_type.shape.dim:
            if d.dim_param in rename:
                d.dim_param = rename[d.dim_param]


def external_weights(model: onnx.ModelProto, weights: dict[str, torch.Tensor], data_path: Path) -> None:
    """Weights (graph inputs, or names the stitched nodes read) become initializers whose
    bytes are written straight from the tensors to ``data_path`` (ONNX external data),
    once: putting them in the protobuf first and letting ``onnx.save`` move them out
    copies every byte twice."""
    keep = [v for v in model.graph.input if v.name not in weights]
    # Whole-model exports name them as inputs; stitched ones only reference them.
    used = ({v.name for v in model.graph.input} | {x for n in model.graph.node for x in n.input}) & set(weights)
    del model.graph.input[:]
    model.graph.input.extend(keep)
    offset = 0
    with open(data_path, "wb") as f:
        for name in sorted(used):
            t = weights[name].contiguous()
            if t.dtype not in ONNX_ELEMENT_TYPES:
                raise ExportError(f"weight {name} is {t.dtype}, which ONNX cannot store; cast the model first")
            raw = t.reshape(-1).view(torch.uint8).numpy()
            tensor = onnx.TensorProto(
                name=name,
                data_type=ONNX_ELEMENT_TYPES[t.dtype],
                dims=list(t.shape),
                data_location=onnx.TensorProto.EXTERNAL,
            )
            for key, value in (("location", data_path.name), ("offset", str(offset)), ("length", str(raw.nbytes))):
                tensor.external_data.add(key=key, value=value)
            f.write(memoryview(raw))
            offset += raw.nbytes
            model.graph.initializer.append(tensor)


def whole_model(trace: Trace, prefix: str | None, opset: int) -> tuple[onnx.ModelProto, list[str]]:
    outputs, past_name = io_names(trace, range(trace.num_layers), prefix)
    names = [x[1] if x[0] != "past" else past_name[(x[1], x[2])] for x in trace.inputs]
    try:
        model = translate_aten(trace.gm, names, outputs, opset)
    except Exception as e:
        raise ExportError(f"the model could not be translated to ONNX: {e}") from e
    return finish_model(model, opset, check=False), outputs
