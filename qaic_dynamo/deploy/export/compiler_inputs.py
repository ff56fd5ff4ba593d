"""What qaic-compile reads beside the model: ``custom_io.yaml``, ``specializations.json``
and its command line."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import onnx

from qaic_dynamo.deploy.export.options import KV_PRECISIONS, ExportOptions
from qaic_dynamo.deploy.naming import align_inputs_to_outputs, is_kv_retained_state
from qaic_dynamo.errors import ExportError
from qaic_dynamo.runtime import qaic_compile_command

__all__ = ["compile_command", "custom_io_yaml", "specializations"]


# ONNX element types the compiler's custom IO can hold at float16 (-convert-to-fp16 makes
# every float buffer float16 on the device, so fp32, bf16 and fp64 all map to it).
_FLOAT_ELEM_TYPES = frozenset(
    {onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16, onnx.TensorProto.BFLOAT16, onnx.TensorProto.DOUBLE}
)


def custom_io_yaml(
    output_names: Sequence[str], precision: str = "float16", dtypes: Mapping[str, int] | None = None
) -> str:
    """``custom_io.yaml``: every retained-state output paired with its input.

    KV buffers are at ``precision`` (float16 by default; mxint8 is for the KV only).
    Other retained buffers (``retained_buffers``, e.g. ``vision_embeds``) keep their own
    precision, from ``dtypes`` (output name -> ONNX element type): float16 for a float
    buffer, and no entry for an integer or bool one, whose type the compiler keeps."""
    if precision not in KV_PRECISIONS:
        raise ExportError(f"kv_precision must be one of {KV_PRECISIONS}, got {precision!r}")
    dtypes = dtypes or {}
    lines = []
    for out, inp in align_inputs_to_outputs(output_names).items():
        if is_kv_retained_state(out):
            p = precision
        elif out not in dtypes:
            raise ExportError(
                f"custom_io_yaml: {out!r} is not a KV buffer and its element type is unknown; "
                "pass dtypes={name: onnx element type} for every non-KV retained output"
            )
        elif dtypes[out] in _FLOAT_ELEM_TYPES:
            p = "float16"
        else:
            continue
        lines += [f"- IOName: {inp}", f"  Precision: {p}", "", f"- IOName: {out}", f"  Precision: {p}", ""]
    return "\n".join(lines)


def specializations(options: ExportOptions) -> dict[str, Any]:
    """``specializations.json``: a Prefill and a Decode entry, both at ``batch_size``.

    The KV buffers' first dimension is the ``batch_size`` symbol, and a retained-state
    buffer keeps one shape on the card across specializations: a batch-1 Prefill beside a
    batch-N Decode would give it two. QEfficient prefills at batch 1 only with continuous
    batching, where the KV has a ``full_batch_size`` dimension of its own and a
    ``batch_index`` input picks the row - which this export does not have."""

    def entry(name: str, seq: int) -> dict[str, Any]:
        return {
            "name": name,
            "symbols": {"batch_size": str(options.batch_size), "seq_len": str(seq), "ctx_len": str(options.ctx_len)},
        }

    return {"specializations": [entry("Prefill", options.prefill_seq_len), entry("Decode", 1)]}


def compile_command(
    onnx_path: Path, qpc_dir: Path, custom_io: Path, specs: Path, options: ExportOptions, compiler: Path | None = None
) -> list[str]:
    """The ``qaic-compile`` command line, as a list: the runtime's (one builder for both)."""
    return qaic_compile_command(
        onnx_path,
        qpc_dir,
        num_cores=options.num_cores,
        custom_io=custom_io,
        specializations=specs,
        extra=dict(options.compiler_options),
        compiler=compiler,
    )
