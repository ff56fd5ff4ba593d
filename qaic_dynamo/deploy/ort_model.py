"""An exported model on ONNX Runtime: what it takes, and one retained-state step.

A stand-in for the card's runtime (``QAICInferenceSession``), as QEfficient's own ONNX
Runtime path works: the caller feeds ``input_ids`` and ``position_ids`` (``[batch,
seq_len]``, padding at position -1), ``batch_index`` with continuous batching,
``comp_ctx_lengths`` with compute-context lengths (only its length counts), and every KV
buffer; the ``*_RetainedState`` outputs are the buffers after the step.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import onnx

from qaic_dynamo.deploy.exported import specialization_ccls
from qaic_dynamo.deploy.naming import RETAINED_STATE_SUFFIX, is_kv_retained_state
from qaic_dynamo.errors import ExportError

__all__ = ["OrtModel", "has_bfloat16_inputs"]

_NP_DTYPES = {"tensor(float)": np.float32, "tensor(float16)": np.float16, "tensor(double)": np.float64}


def has_bfloat16_inputs(onnx_path: str | os.PathLike) -> bool:
    """Whether an exported model takes bfloat16 inputs (which ONNX Runtime's CPU kernels do
    not run); reads the graph only, not the weights."""
    graph = onnx.load(str(onnx_path), load_external_data=False).graph
    return any(i.type.tensor_type.elem_type == onnx.TensorProto.BFLOAT16 for i in graph.input)


@dataclass
class _Past:
    name: str
    heads: int
    head_dim: int
    dtype: Any


class OrtModel:
    """One exported model in an ONNX Runtime session."""

    def __init__(
        self, onnx_path: str | os.PathLike, num_threads: int | None = None, export_dir: str | os.PathLike | None = None
    ) -> None:
        """``export_dir``: where its ``specializations.json`` is (default: beside the model;
        each half of a prefill/decode pair has its own)."""
        import onnxruntime as ort

        self.path = Path(onnx_path)
        opts = ort.SessionOptions()
        opts.log_severity_level = 3
        if num_threads:
            opts.intra_op_num_threads = num_threads
        try:
            self.session = ort.InferenceSession(str(onnx_path), opts, providers=["CPUExecutionProvider"])
        except Exception as e:  # onnxruntime's own exception classes
            hint = ""
            if Path(onnx_path).is_file() and has_bfloat16_inputs(onnx_path):
                hint = (
                    " (its CPU kernels lack bfloat16: export a bfloat16 model for hw_version='ai100', which "
                    "exports it in float32, to run it here)"
                )
            raise ExportError(
                f"ONNX Runtime cannot load {onnx_path} on the CPU: {str(e).splitlines()[0] if str(e) else e!r}{hint}"
            ) from e
        names = {i.name for i in self.session.get_inputs()}
        self.continuous_batching = "batch_index" in names
        self.compute_context_lengths = "comp_ctx_lengths" in names
        special = {"input_ids", "position_ids", "batch_index", "comp_ctx_lengths"}
        past_inputs = [i for i in self.session.get_inputs() if i.name not in special]
        others = [i.name for i in past_inputs if not is_kv_retained_state(i.name + RETAINED_STATE_SUFFIX)]
        if others:
            raise ExportError(
                f"this runner feeds KV caches only; {onnx_path} also takes {others} (retained buffers): run it with "
                "onnxruntime directly, feeding their initial values"
            )
        unknown = {i.name: i.type for i in past_inputs if i.type not in _NP_DTYPES}
        if unknown:
            raise ExportError(
                f"cannot make KV caches of {unknown}; ONNX Runtime's CPU kernels take float32 or float16 models "
                "(export a bfloat16 model for hw_version='ai100' to run it here)"
            )
        self.past = [_Past(i.name, i.shape[1], i.shape[3], _NP_DTYPES[i.type]) for i in past_inputs]
        self.outputs = [o.name for o in self.session.get_outputs()]
        vocab = self.session.get_outputs()[0].shape[-1]
        self.vocab = vocab if isinstance(vocab, int) else None
        self.export_dir = Path(export_dir) if export_dir is not None else self.path.parent
        self.prefill_ccls, self.decode_ccls = specialization_ccls(self.export_dir)

    def empty_cache(self, rows: int, ctx_len: int) -> dict[str, np.ndarray]:
        """Zeroed KV buffers for ``rows`` sequences of ``ctx_len`` positions."""
        return {p.name: np.zeros([rows, p.heads, ctx_len, p.head_dim], dtype=p.dtype) for p in self.past}

    def check_tokens(self, prompts: list[list[int]]) -> None:
        """ONNX Gather reads a negative id from the end of the table: refuse it, as LLM does."""
        for i, prompt in enumerate(prompts):
            bad = [
                t
                for t in prompt
                if not isinstance(t, (int, np.integer))
                or isinstance(t, bool)
                or not 0 <= t < (self.vocab if self.vocab is not None else t + 1)
            ]
            if bad:
                raise ExportError(f"prompt {i} has token ids outside the vocabulary [0, {self.vocab}): {bad[:8]}")

    def ccl(self, lengths: list[int] | None, needed: int, ctx_len: int, what: str) -> int | None:
        """The compute-context length of a step whose highest position is ``needed - 1``: the
        smallest of ``lengths`` that holds it (None: the model takes no CCL)."""
        if not self.compute_context_lengths:
            return None
        lengths = lengths or [ctx_len]
        fits = [n for n in lengths if n >= needed]
        if not fits:
            raise ExportError(
                f"a {what} step reaches position {needed - 1}, past the longest {what} compute-context length "
                f"{max(lengths)} of {self.export_dir / 'specializations.json'}; export with longer "
                f"comp_ctx_lengths_{what}"
            )
        return min(fits)

    def step(
        self,
        ids: np.ndarray,
        pos: np.ndarray,
        past: dict[str, np.ndarray],
        batch_index: np.ndarray | None = None,
        ccl: int | None = None,
    ) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        """One call: logits [batch, vocab] and the KV buffers after it."""
        feeds = {"input_ids": ids, "position_ids": pos, **past}
        if self.continuous_batching:
            if batch_index is None:
                raise ExportError(f"{self.path} is a continuous-batching export: every call needs a batch_index")
            feeds["batch_index"] = batch_index
        if self.compute_context_lengths:
            feeds["comp_ctx_lengths"] = np.zeros(ccl, dtype=np.int64)
        res = self.session.run(self.outputs, feeds)
        new = {name[: -len(RETAINED_STATE_SUFFIX)]: v for name, v in zip(self.outputs[1:], res[1:])}
        return res[0][:, 0], new
