"""What qaic-compile reads beside the model: ``custom_io.yaml``, the MDP partition config
and its command line (``specializations.json``: :mod:`.specializations`)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import onnx

from qaic_dynamo.deploy.export.options import KV_PRECISIONS, ExportOptions
from qaic_dynamo.deploy.export.precision import Precision
from qaic_dynamo.deploy.naming import align_inputs_to_outputs, is_kv_retained_state
from qaic_dynamo.errors import ExportError
from qaic_dynamo.runtime import qaic_compile_command

__all__ = ["compile_command", "custom_io_yaml", "mdp_partition_config"]


def custom_io_yaml(
    output_names: Sequence[str], precision: str = "float16", dtypes: Mapping[str, int] | None = None
) -> str:
    """``custom_io.yaml``: every retained-state output paired with its input.

    KV buffers are at ``precision`` (float16, bfloat16 for a bfloat16 export on ai200, or
    mxint8). Other retained buffers (``retained_buffers``, e.g. ``vision_embeds``) keep their
    own precision, from ``dtypes`` (output name -> ONNX element type): float16 for a float
    buffer (bfloat16 for a bfloat16 one), and no entry for an integer or bool one, whose
    type the compiler keeps."""
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
            p = _FLOAT_ELEM_TYPES[dtypes[out]]
        else:
            continue
        lines += [f"- IOName: {inp}", f"  Precision: {p}", "", f"- IOName: {out}", f"  Precision: {p}", ""]
    return "\n".join(lines)


# ONNX float element types -> their precision on the card (-convert-to-fp16 makes float32
# and float64 float16; bfloat16 stays bfloat16).
_FLOAT_ELEM_TYPES = {
    onnx.TensorProto.FLOAT: "float16",
    onnx.TensorProto.FLOAT16: "float16",
    onnx.TensorProto.DOUBLE: "float16",
    onnx.TensorProto.BFLOAT16: "bfloat16",
}


def mdp_partition_config(num_devices: int, num_cores: int) -> dict[str, Any]:
    """QEfficient's tensor-slicing MDP partition config: every device in one partition
    (``Partition0``), connected peer to peer."""
    return {
        "connections": [{"devices": list(range(num_devices)), "type": "p2p"}],
        "partitions": [
            {"name": "Partition0", "devices": [{"deviceId": d, "numCores": num_cores} for d in range(num_devices)]}
        ],
    }


def compile_command(
    onnx_path: Path,
    qpc_dir: Path,
    custom_io: Path | None,
    specs: Path,
    options: ExportOptions,
    precision: Precision,
    compiler: Path | None = None,
    mdp_config: Path | None = None,
) -> list[str]:
    """The ``qaic-compile`` command line, as a list: the runtime's (one builder for both).
    ``custom_io`` None: not passed (a bfloat16 model with bfloat16 KV, as QEfficient)."""
    return qaic_compile_command(
        onnx_path,
        qpc_dir,
        num_cores=options.num_cores,
        custom_io=custom_io,
        specializations=specs,
        extra=dict(options.compiler_options),
        compiler=compiler,
        hw_version=options.hw_version,
        convert_to_fp16=precision.convert_to_fp16,
        mdp_partition_config=mdp_config,
    )
