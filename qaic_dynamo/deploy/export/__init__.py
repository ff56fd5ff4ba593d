"""Deployment export: one self-contained ONNX model per LLM, in QAIC's conventions.

:func:`export_for_qaic` (:mod:`.api`) traces the engine's model in retained-state form
(:mod:`.retained_state`, :mod:`.trace`) in the dtype its card takes (:mod:`.precision`),
translates it with the lowering's direct path - one decoder block stitched L times
(:mod:`.layerwise`), or the whole model (:mod:`.assemble`), built in :mod:`.build` - and
writes what qaic-compile reads beside it (:mod:`.specializations`, :mod:`.compiler_inputs`).
:func:`export_prefill_decode` writes the prefill-only / decode-only pair from one build.
:mod:`.validate` runs the result on ONNX Runtime. Names come from ``deploy.naming``.
"""

from qaic_dynamo.deploy.export.api import ExportPair, ExportResult, export_for_qaic, export_prefill_decode
from qaic_dynamo.deploy.export.compiler_inputs import compile_command, custom_io_yaml
from qaic_dynamo.deploy.export.options import ExportOptions
from qaic_dynamo.deploy.export.retained_state import RetainedStateKV, RetainedStateModel
from qaic_dynamo.deploy.export.specializations import specializations
from qaic_dynamo.deploy.export.validate import (
    ContinuousBatchingRun,
    continuous_batching_generate,
    has_bfloat16_inputs,
    ort_generate,
)
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
    "ContinuousBatchingRun",
    "ExportError",
    "ExportOptions",
    "ExportPair",
    "ExportResult",
    "RetainedStateKV",
    "RetainedStateModel",
    "align_inputs_to_outputs",
    "apply_kv_cache_prefix",
    "compile_command",
    "continuous_batching_generate",
    "custom_io_yaml",
    "export_for_qaic",
    "export_prefill_decode",
    "has_bfloat16_inputs",
    "is_kv_retained_state",
    "ort_generate",
    "retained_state_names",
    "specializations",
    "validate_kv_cache_prefix",
]
