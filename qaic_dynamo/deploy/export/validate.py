"""Run an exported model on ONNX Runtime, the retained-state way (validation)."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import onnx

from qaic_dynamo.deploy.naming import RETAINED_STATE_SUFFIX, is_kv_retained_state
from qaic_dynamo.errors import ExportError

__all__ = ["has_bfloat16_inputs", "ort_generate"]


def has_bfloat16_inputs(onnx_path: str | os.PathLike) -> bool:
    """Whether an exported model takes bfloat16 inputs (which ONNX Runtime's CPU kernels do
    not run); reads the graph only, not the weights."""
    graph = onnx.load(str(onnx_path), load_external_data=False).graph
    return any(i.type.tensor_type.elem_type == onnx.TensorProto.BFLOAT16 for i in graph.input)


def ort_generate(
    onnx_path: str | os.PathLike,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    prefill_seq_len: int,
    num_threads: int | None = None,
) -> tuple[list[list[int]], list[Any]]:
    """Greedy generation with an exported model on ONNX Runtime, the retained-state way:
    each prompt is prefilled alone in chunks of ``prefill_seq_len`` (padding has
    position -1), then all prompts decode together as one batch; every call's
    ``*_RetainedState`` outputs are fed back as the next call's inputs. Returns the new
    tokens per prompt and the logits [batch, vocab] of every decode step (numpy)."""
    import numpy as np
    import onnxruntime as ort

    for name, value in (("max_new_tokens", max_new_tokens), ("prefill_seq_len", prefill_seq_len)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ExportError(f"ort_generate: {name} must be a positive int, got {value!r}")
    try:
        if isinstance(prompts, (str, bytes)) or any(isinstance(p, (str, bytes)) for p in prompts):
            raise TypeError
        prompts = [list(p) for p in prompts]
    except TypeError:
        raise ExportError(
            "ort_generate: prompts must be a list of token-id lists, e.g. [[1, 2, 3]] for one prompt"
        ) from None
    if not prompts or any(not p for p in prompts):
        raise ExportError("ort_generate: pass at least one prompt, each with at least one token id")
    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    if num_threads:
        opts.intra_op_num_threads = num_threads
    try:
        sess = ort.InferenceSession(str(onnx_path), opts, providers=["CPUExecutionProvider"])
    except Exception as e:  # onnxruntime's own exception classes
        hint = ""
        if Path(onnx_path).is_file() and has_bfloat16_inputs(onnx_path):
            hint = " (its CPU kernels lack bfloat16: export a bfloat16 model in float16 to run it here)"
        raise ExportError(
            f"ONNX Runtime cannot load {onnx_path} on the CPU: {str(e).splitlines()[0] if str(e) else e!r}{hint}"
        ) from e
    past_inputs = [i for i in sess.get_inputs() if i.name not in ("input_ids", "position_ids")]
    others = [i.name for i in past_inputs if not is_kv_retained_state(i.name + RETAINED_STATE_SUFFIX)]
    if others:
        raise ExportError(
            f"ort_generate feeds KV caches only; {onnx_path} also takes {others} (retained buffers): "
            "run it with onnxruntime directly, feeding their initial values"
        )
    dtypes = {"tensor(float)": np.float32, "tensor(float16)": np.float16, "tensor(double)": np.float64}
    unknown = {i.name: i.type for i in past_inputs if i.type not in dtypes}
    if unknown:
        raise ExportError(
            f"ort_generate cannot make KV caches of {unknown}; ONNX Runtime's CPU kernels take "
            "float32 or float16 models (export a bfloat16 model in float16 to run it here)"
        )
    outputs = [o.name for o in sess.get_outputs()]
    vocab = sess.get_outputs()[0].shape[-1]
    for i, prompt in enumerate(prompts):
        # ONNX Gather reads a negative id from the end of the table: refuse it, as LLM does.
        bad = [
            t
            for t in prompt
            if not isinstance(t, (int, np.integer))
            or isinstance(t, bool)
            or not 0 <= t < (vocab if isinstance(vocab, int) else t + 1)
        ]
        if bad:
            raise ExportError(f"ort_generate: prompt {i} has token ids outside the vocabulary [0, {vocab}): {bad[:8]}")

    def empty(batch: int, ctx: int) -> dict[str, Any]:
        # Each cache in its input's element type: a float16 export takes float16 caches.
        return {i.name: np.zeros([batch, i.shape[1], ctx, i.shape[3]], dtype=dtypes[i.type]) for i in past_inputs}

    def step(ids: Any, pos: Any, past: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
        res = sess.run(outputs, {"input_ids": ids, "position_ids": pos, **past})
        new = {name[: -len(RETAINED_STATE_SUFFIX)]: v for name, v in zip(outputs[1:], res[1:])}
        return res[0][:, 0], new

    # ctx_len is a dynamic axis: the caches are sized for the longest sequence here.
    ctx = max(len(p) for p in prompts) + max_new_tokens
    rows, firsts = [], []
    for prompt in prompts:
        past = empty(1, ctx)
        for start in range(0, len(prompt), prefill_seq_len):
            chunk = list(prompt[start : start + prefill_seq_len])
            pad = prefill_seq_len - len(chunk)
            ids = np.array([chunk + [0] * pad], dtype=np.int64)
            pos = np.array([list(range(start, start + len(chunk))) + [-1] * pad], dtype=np.int64)
            logits, past = step(ids, pos, past)
        rows.append(past)
        firsts.append(int(logits[0].argmax()))
    past = {name: np.concatenate([r[name] for r in rows]) for name in rows[0]}
    tokens = [[t] for t in firsts]
    all_logits = []
    lengths = [len(p) for p in prompts]
    for k in range(1, max_new_tokens):
        ids = np.array([[t[-1]] for t in tokens], dtype=np.int64)
        pos = np.array([[n + k - 1] for n in lengths], dtype=np.int64)
        logits, past = step(ids, pos, past)
        all_logits.append(logits)
        for t, row in zip(tokens, logits):
            t.append(int(row.argmax()))
    return tokens, all_logits
