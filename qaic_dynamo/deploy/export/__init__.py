"""Deployment export: one self-contained ONNX model per LLM, in QAIC's conventions.

:func:`export_for_qaic` (:mod:`.api`) traces the engine's model in retained-state form
(:mod:`.retained_state`, :mod:`.trace`), translates it with the lowering's direct path -
one decoder block stitched L times (:mod:`.layerwise`), or the whole model
(:mod:`.assemble`) - and writes what qaic-compile reads beside it (:mod:`.compiler_inputs`).
:mod:`.validate` runs the result on ONNX Runtime. Names come from ``deploy.naming``.
"""

from qaic_dynamo.deploy.export.api import ExportResult, export_for_qaic
from qaic_dynamo.deploy.export.compiler_inputs import compile_command, custom_io_yaml, specializations
from qaic_dynamo.deploy.export.options import ExportOptions
from qaic_dynamo.deploy.export.retained_state import RetainedStateKV, RetainedStateModel
from qaic_dynamo.deploy.export.validate import has_bfloat16_inputs, ort_generate
from qaic_dynamo.deploy.naming import (
    RETAINED_STATE_SUFFIX,
    align_inputs_to_outputs,
    apply_kv_cache_prefix,
    is_kv_retained_state,
    retained_state_names,
    validate_kv_cache_prefix,
)
from qaic_dynamo.errors import ExportError

__all__ = [
    "RETAINED_STATE_SUFFIX",
    "ExportError",
    "ExportOptions",
    "ExportResult",
    "RetainedStateKV",
    "RetainedStateModel",
    "align_inputs_to_outputs",
    "apply_kv_cache_prefix",
    "compile_command",
    "custom_io_yaml",
    "export_for_qaic",
    "has_bfloat16_inputs",
    "is_kv_retained_state",
    "ort_generate",
    "retained_state_names",
    "specializations",
    "validate_kv_cache_prefix",
]
