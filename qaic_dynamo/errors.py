"""Every exception qaic_dynamo raises of its own, in one place.

All of them derive from :class:`QaicError`, so ``except qaic_dynamo.QaicError`` catches
anything the package decided to raise (as opposed to a bug, or an error of torch, ONNX
Runtime or the operating system passing through). Each stage of the pipeline has its own
subclass, and a class that callers already catch as a builtin (``ValueError`` for bad
input, ``RuntimeError`` for a failure) derives from that builtin too::

    QaicError
    ├── ConfigError (ValueError)           a bad backend option or value
    ├── CompileError (RuntimeError)        a piece could not be compiled
    │   ├── LoweringError                  ... to ONNX (the backend falls back to eager)
    │   └── QaicCompileError               ... by qaic-compile
    ├── ArtifactError (RuntimeError)       a directory holds no loadable artifact
    ├── PieceRunError (RuntimeError)       a compiled piece could not run
    ├── CacheLayoutError (ValueError)      a KV cache that cannot be bound as retained state
    ├── SamplingParamsError (ValueError)   bad sampling parameters
    ├── ExportError (ValueError)           a model or option the deployment export refuses
    ├── KVSliceError (ValueError)          a KV hand-off that does not fit its slot
    └── InternalSignal                     control flow inside one stage; never escapes it
        ├── DirectPathError                the lowering's direct path gives up on a piece
        │   └── SizeBranchError            ... because it branched on a dynamic size
        ├── EagerInstead                   a run inside autograd wants the eager fallback
        └── BlocksDiffer                   a layerwise export's two blocks differ

The messages say what is wrong and what to do instead; the classes say where.
"""

from __future__ import annotations

__all__ = [
    "ArtifactError",
    "BlocksDiffer",
    "CacheLayoutError",
    "CompileError",
    "ConfigError",
    "DirectPathError",
    "EagerInstead",
    "ExportError",
    "InternalSignal",
    "KVSliceError",
    "LoweringError",
    "PieceRunError",
    "PrecompileError",
    "QaicCompileError",
    "QaicError",
    "SamplingParamsError",
    "SizeBranchError",
]


class QaicError(Exception):
    """Base of every exception qaic_dynamo defines."""


class ConfigError(QaicError, ValueError):
    """A bad backend ``options`` key or value; the message lists what is valid."""


class CompileError(QaicError, RuntimeError):
    """A piece could not be compiled. The cache remembers it per key; the backend turns it
    into an eager fallback or, with ``fallback="error"``, raises it."""


class LoweringError(CompileError):
    """A piece could not be lowered to ONNX; the message says why."""


class QaicCompileError(CompileError):
    """qaic-compile is missing or failed for an artifact."""


class ArtifactError(QaicError, RuntimeError):
    """A directory does not hold a loadable artifact of this format; the message says why.
    The cache treats it as a miss and compiles again."""


class PieceRunError(QaicError, RuntimeError):
    """A compiled piece could not run (a binding or ONNX Runtime failure)."""


class PrecompileError(QaicError, RuntimeError):
    """A region's saved trace cannot be saved or loaded (the message says why); the region
    is traced by Dynamo instead."""


class CacheLayoutError(QaicError, ValueError):
    """A KV cache in the forward context cannot be bound as retained state (a user error:
    never hidden by an eager fallback)."""


class SamplingParamsError(QaicError, ValueError):
    """A ``SamplingParams`` field has a bad value; the message names it and the valid range."""


class ExportError(QaicError, ValueError):
    """The model or the options cannot be exported; the message says why and what to do."""


class KVSliceError(QaicError, ValueError):
    """A disaggregated KV hand-off that does not fit the decode slot it is sent to."""


class EngineStepError(QaicError, RuntimeError):
    """A step of the engine failed; the requests in it are lost (the engine serves on)."""


class BadRequestError(QaicError, ValueError):
    """A request the OpenAI-compatible server refuses, with OpenAI's error fields: the
    parameter at fault, an error code and the HTTP status."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None, status: int = 400) -> None:
        super().__init__(message)
        self.param, self.code, self.status = param, code, status


class InternalSignal(QaicError):
    """Control flow between functions of one stage, caught inside it (the stage turns it
    into one of the errors above, or into a fallback)."""


class DirectPathError(InternalSignal):
    """The lowering's direct path cannot lower this piece; ``op`` is the op that forced the
    fallback to torch.onnx's exporter."""

    def __init__(self, op: str, reason: str) -> None:
        super().__init__(f"{op}: {reason}")
        self.op = op


class SizeBranchError(DirectPathError):
    """A trace took a branch on a dynamic size that Dynamo's guards do not fix. The exporter
    would take the same branch (its guards are checked the same way), so such a piece runs
    eagerly rather than serve sizes the branch is wrong for."""


class EagerInstead(InternalSignal):
    """Raised out of a piece's run inside an autograd function, so that the eager fallback
    runs outside it (with the caller's grad mode)."""

    def __init__(self, error: Exception | None) -> None:
        super().__init__(str(error))
        self.error = error


class BlocksDiffer(InternalSignal):
    """A layerwise export's two-block trace whose blocks are not one graph: the export
    traces three blocks instead."""
