"""The compiled-piece artifact: its on-disk format, and :func:`load`.

An artifact is a readable directory, written once by ``lowering`` and read by everyone
after it (the in-process cache, the persistent cache, the runtime, a curious user)::

    model.onnx        the piece in accelerator ONNX (absent for a piece with no compute)
    layout.json       how to call it: :class:`PieceLayout`, with its format version
    fingerprint.json  the structural key's inputs (written by the cache, for humans)
    qpc/              qaic-compile's output, with runtime="qaic"

Compile and load are separate stages: this package knows the format (:mod:`.files`,
:mod:`.layout`, the size expressions of :mod:`.expressions` in the canonical symbols of
:mod:`.symbols`) and loads it (:mod:`.load`, which asks the runtime for the session), and
imports neither ``torch.onnx`` nor onnxscript, so a process that only loads cached
artifacts never pays for the exporter. A directory that does not hold a loadable artifact
of this format raises ``ArtifactError``; the cache treats that as a miss and recompiles.
"""

from qaic_dynamo.artifact.expressions import check_size_expression, parse_size_assumption, shape_function
from qaic_dynamo.artifact.files import LAYOUT_FILE, LAYOUT_FORMAT, ONNX_FILE
from qaic_dynamo.artifact.layout import PieceLayout
from qaic_dynamo.artifact.load import Artifact, load
from qaic_dynamo.artifact.symbols import SymbolNames, canonical_names

__all__ = [
    "LAYOUT_FILE",
    "LAYOUT_FORMAT",
    "ONNX_FILE",
    "Artifact",
    "PieceLayout",
    "SymbolNames",
    "canonical_names",
    "check_size_expression",
    "load",
    "parse_size_assumption",
    "shape_function",
]
