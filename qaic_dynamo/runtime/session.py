"""ONNX Runtime sessions: the one place their options are set.

Every compiled piece runs in a session of its own, created here from its ONNX file with
the same options, so that all pieces of a model share one threading policy and one log
level.
"""

from __future__ import annotations

from pathlib import Path

import onnxruntime as ort

from qaic_dynamo.counter import compilation_counter

__all__ = ["create_session", "session_options"]


def session_options(num_threads: int) -> ort.SessionOptions:
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = num_threads
    opts.inter_op_num_threads = 1
    opts.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    # Spinning worker threads would steal the cores from PyTorch's eager attention that
    # runs between pieces.
    opts.add_session_config_entry("session.intra_op.allow_spinning", "0")
    # ONNX Runtime's own graph optimizations fold constants at load and then log every
    # initializer the folding left unused, for every session. The models we write have
    # none (lowering removes them); this is the one place ORT's log level is set.
    opts.log_severity_level = 3  # errors only
    return opts


def create_session(model: Path, num_threads: int) -> ort.InferenceSession:
    """A CPU session for the ONNX file ``model`` (counted in ``num_runtime_sessions``).

    EliminateDropout removes every Dropout whose mask is unused, training_mode or not: a
    training-mode piece from the exporter lost its dropout. EliminateIdentity would remove
    the Identity nodes that keep float16 roundings (``lowering.finish``)."""
    session = ort.InferenceSession(
        str(model),
        sess_options=session_options(num_threads),
        providers=["CPUExecutionProvider"],
        disabled_optimizers=["EliminateDropout", "EliminateIdentity"],
    )
    compilation_counter.bump(num_runtime_sessions=1)
    return session
