"""qaic_dynamo: a torch.compile backend and KV-cache op layer for Qualcomm Cloud AI 100
style accelerators.

Importing the package loads the native op library (``torch.ops.qaic.*``), registers the
ops' fake kernels, and exposes the forward context that the ops read at run time.
"""

import qaic_dynamo.native  # noqa: F401  (the op library, before anything that uses it)
from qaic_dynamo import ops
from qaic_dynamo.counter import CompilationCounter, compilation_counter
from qaic_dynamo.errors import QaicError
from qaic_dynamo.forward_context import (
    FROM_FORWARD_CONTEXT,
    AttentionMetadata,
    ForwardContext,
    build_attention_metadata,
    get_forward_context,
    has_forward_context,
    set_forward_context,
)

__version__ = "0.1.0"

# The backend pulls in onnx, onnxscript and onnxruntime; load it only when asked for.
_LAZY = {
    "LLM": "qaic_dynamo.engine",
    "Request": "qaic_dynamo.engine",
    "RequestOutput": "qaic_dynamo.engine",
    "CompletionOutput": "qaic_dynamo.engine",
    "SamplingParams": "qaic_dynamo.engine",
    "CompilationConfig": "qaic_dynamo.config",
    "compile": "qaic_dynamo.compiler",
    "compile_reports": "qaic_dynamo.compiler",
    "last_compile_report": "qaic_dynamo.compiler",
    "qaic_backend": "qaic_dynamo.compiler",
    "export_for_qaic": "qaic_dynamo.deploy.export",
    "DisaggregatedServer": "qaic_dynamo.deploy.serving",
}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'qaic_dynamo' has no attribute {name!r}")


__all__ = [
    "DisaggregatedServer",
    "LLM",
    "QaicError",
    "Request",
    "RequestOutput",
    "CompletionOutput",
    "SamplingParams",
    "CompilationConfig",
    "CompilationCounter",
    "FROM_FORWARD_CONTEXT",
    "compilation_counter",
    "compile",
    "compile_reports",
    "export_for_qaic",
    "last_compile_report",
    "qaic_backend",
    "AttentionMetadata",
    "ForwardContext",
    "build_attention_metadata",
    "get_forward_context",
    "has_forward_context",
    "ops",
    "set_forward_context",
]
