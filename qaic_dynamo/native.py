"""The native op library, ``qaic_dynamo._C``: loaded here, and only here.

Loading it registers the ``qaic`` ops' schemas and CPU kernels with torch
(``csrc/ops.cpp``) and provides the thread-local forward context they read
(``csrc/forward_context.cpp``). libtorch must be loaded first, hence ``import torch``.
"""

import torch  # noqa: F401  (libtorch must be loaded before the extension)

from qaic_dynamo import _C

__all__ = ["_C"]
