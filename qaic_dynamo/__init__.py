"""qaic_dynamo: a torch.compile backend and KV-cache op layer for Qualcomm Cloud AI 100
style accelerators.

Importing the package loads the native op library (``torch.ops.qaic.*``), registers the
ops' fake kernels, and exposes the forward context that the ops read at run time.
"""

import torch  # noqa: F401  (libtorch must be loaded before the extension)

from qaic_dynamo import _C  # noqa: F401
from qaic_dynamo import ops
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

__all__ = [
    "FROM_FORWARD_CONTEXT",
    "AttentionMetadata",
    "ForwardContext",
    "build_attention_metadata",
    "get_forward_context",
    "has_forward_context",
    "ops",
    "set_forward_context",
]
