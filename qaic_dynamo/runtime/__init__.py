"""The runtime stage: run lowered pieces on ONNX Runtime, and compile them with qaic-compile.

The last stage of the pipeline, and the only one that talks to ONNX Runtime: sessions
(:mod:`.session`), what can be bound (:mod:`.binding`), the runner of one call site
(:mod:`.runner`), the OpenMP hand-over between PyTorch and ONNX Runtime (:mod:`.openmp`),
eager fallbacks (:mod:`.fallback`) and the Qualcomm SDK's compiler (:mod:`.qaic_sdk`).
It imports no stage above it: a runner takes any loaded artifact with the attributes of
:class:`RunnableArtifact`.

With ``runtime="qaic"`` each new artifact is also compiled with ``qaic-compile`` into
``<artifact>/qpc`` (QEfficient's flags). Running a QPC on a card needs the QAIC runtime,
which this package does not drive yet, so pieces still execute on ONNX Runtime on the
host; without the SDK, ``runtime="qaic"`` is refused up front with a clear error.
"""

from qaic_dynamo.runtime.autograd import no_backward
from qaic_dynamo.runtime.binding import (
    BINDABLE,
    MAX_SIZE_CARRIER,
    ONNX_ELEMENT_TYPES,
    SIZE_CARRIER_DTYPE,
    dtype_name,
)
from qaic_dynamo.runtime.fallback import warn_fallback
from qaic_dynamo.runtime.openmp import release_openmp_workers
from qaic_dynamo.runtime.qaic_sdk import (
    QAIC_COMPILE_OWN_FLAGS,
    extra_flag_problem,
    qaic_compile,
    qaic_compile_command,
    qaic_sdk_available,
)
from qaic_dynamo.runtime.runner import PieceRunner, RunnableArtifact
from qaic_dynamo.runtime.session import create_session, session_options

__all__ = [
    "MAX_SIZE_CARRIER",
    "ONNX_ELEMENT_TYPES",
    "BINDABLE",
    "QAIC_COMPILE_OWN_FLAGS",
    "SIZE_CARRIER_DTYPE",
    "PieceRunner",
    "RunnableArtifact",
    "create_session",
    "dtype_name",
    "extra_flag_problem",
    "no_backward",
    "qaic_compile",
    "qaic_compile_command",
    "qaic_sdk_available",
    "release_openmp_workers",
    "session_options",
    "warn_fallback",
]
