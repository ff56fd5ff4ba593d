"""Run an exported model on ONNX Runtime the way a card runs it (validation).

:func:`ort_generate` serves static batches: each prompt prefilled alone in chunks of
``prefill_seq_len``, then all prompts decoding together. :func:`continuous_batching_generate`
serves a continuous-batching export as QEfficient's continuous-batching loop does: a few
decode slots, each request prefilled alone into a free slot while the others keep
decoding, and a slot reused as soon as its request finishes. Both pick each step's
compute-context length from the export's specializations when it has them.
"""

from __future__ import annotations

import os
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from qaic_dynamo.deploy.ort_model import OrtModel, has_bfloat16_inputs
from qaic_dynamo.errors import ExportError

__all__ = ["ContinuousBatchingRun", "continuous_batching_generate", "has_bfloat16_inputs", "ort_generate"]


def _check(prompts: Any, max_new_tokens: Any, prefill_seq_len: Any, who: str) -> list[list[int]]:
    for name, value in (("max_new_tokens", max_new_tokens), ("prefill_seq_len", prefill_seq_len)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ExportError(f"{who}: {name} must be a positive int, got {value!r}")
    try:
        if isinstance(prompts, (str, bytes)) or any(isinstance(p, (str, bytes)) for p in prompts):
            raise TypeError
        prompts = [list(p) for p in prompts]
    except TypeError:
        raise ExportError(f"{who}: prompts must be a list of token-id lists, e.g. [[1, 2, 3]] for one prompt") from None
    if not prompts or any(not p for p in prompts):
        raise ExportError(f"{who}: pass at least one prompt, each with at least one token id")
    return prompts


def _prefill(model: OrtModel, prompt: list[int], p: int, past: dict, ctx: int, row: int | None) -> tuple[int, dict]:
    """Prefill one prompt in chunks of ``p`` (padding at position -1) into ``past`` (row
    ``row`` of a continuous-batching cache); returns its first token and the cache after."""
    logits = None
    for start in range(0, len(prompt), p):
        chunk = list(prompt[start : start + p])
        pad = p - len(chunk)
        ids = np.array([chunk + [0] * pad], dtype=np.int64)
        pos = np.array([list(range(start, start + len(chunk))) + [-1] * pad], dtype=np.int64)
        ccl = model.ccl(model.prefill_ccls, start + len(chunk), ctx, "prefill")
        bi = np.array([[row]], dtype=np.int64) if row is not None else None
        logits, past = model.step(ids, pos, past, bi, ccl)
    return int(logits[0].argmax()), past


def _cache_len(model: OrtModel, needed: int) -> int:
    """KV positions to allocate: what the run needs, and every CCL it may read."""
    lengths = [*(model.prefill_ccls or []), *(model.decode_ccls or [])] if model.compute_context_lengths else []
    return max([needed, *lengths])


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
    ``*_RetainedState`` outputs are fed back as the next call's inputs. A
    continuous-batching export keeps every prompt in a row of one cache (``batch_index``).
    Returns the new tokens per prompt and the logits [batch, vocab] of every decode step
    (numpy)."""
    prompts = _check(prompts, max_new_tokens, prefill_seq_len, "ort_generate")
    model = OrtModel(onnx_path, num_threads)
    model.check_tokens(prompts)
    # ctx_len is a dynamic axis: the caches are sized for the longest sequence here.
    ctx = _cache_len(model, max(len(p) for p in prompts) + max_new_tokens)
    cb = model.continuous_batching
    firsts = []
    if cb:
        past = model.empty_cache(len(prompts), ctx)
        for i, prompt in enumerate(prompts):
            token, past = _prefill(model, prompt, prefill_seq_len, past, ctx, i)
            firsts.append(token)
    else:
        rows = []
        for prompt in prompts:
            token, row = _prefill(model, prompt, prefill_seq_len, model.empty_cache(1, ctx), ctx, None)
            rows.append(row)
            firsts.append(token)
        past = {name: np.concatenate([r[name] for r in rows]) for name in rows[0]}
    tokens = [[t] for t in firsts]
    all_logits = []
    lengths = [len(p) for p in prompts]
    batch_index = np.arange(len(prompts), dtype=np.int64).reshape(-1, 1) if cb else None
    for k in range(1, max_new_tokens):
        ids = np.array([[t[-1]] for t in tokens], dtype=np.int64)
        pos = np.array([[n + k - 1] for n in lengths], dtype=np.int64)
        ccl = model.ccl(model.decode_ccls, int(pos.max()) + 1, ctx, "decode")
        logits, past = model.step(ids, pos, past, batch_index, ccl)
        all_logits.append(logits)
        for t, row in zip(tokens, logits):
            t.append(int(row.argmax()))
    return tokens, all_logits


@dataclass
class ContinuousBatchingRun:
    """What :func:`continuous_batching_generate` did."""

    #: New tokens per request, in request order.
    tokens: list[list[int]]
    #: The decode slot each request ran in.
    slots: list[int]
    #: Decode steps run (each over every slot).
    decode_steps: int = 0
    #: ("prefill", request, slot) and ("finish", request, slot), in order.
    events: list[tuple[str, int, int]] = field(default_factory=list)


def continuous_batching_generate(
    onnx_path: str | os.PathLike,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int | Sequence[int],
    prefill_seq_len: int,
    slots: int,
    ctx_len: int | None = None,
    num_threads: int | None = None,
) -> ContinuousBatchingRun:
    """Serve ``prompts`` with a continuous-batching export (``full_batch_size=slots``) as
    QEfficient's continuous-batching loop does, greedily: while a slot is free and a request
    waits, the request is prefilled alone into that slot (``batch_index = [[slot]]``);
    then one decode step runs every slot (``batch_index = arange(slots)``; a free slot at
    position -1, which reads and writes nothing), and a request that has its
    ``max_new_tokens`` (one per request, or one for all) frees its slot for the next.
    ``ctx_len``: KV positions per slot (default: the longest request's)."""
    prompts = _check(prompts, 1, prefill_seq_len, "continuous_batching_generate")
    budgets = [max_new_tokens] * len(prompts) if isinstance(max_new_tokens, int) else list(max_new_tokens)
    if len(budgets) != len(prompts) or not all(isinstance(n, int) and n >= 1 for n in budgets):
        raise ExportError("continuous_batching_generate: max_new_tokens must be a positive int, or one per prompt")
    if not isinstance(slots, int) or slots < 1:
        raise ExportError(f"continuous_batching_generate: slots must be a positive int, got {slots!r}")
    model = OrtModel(onnx_path, num_threads)
    if not model.continuous_batching:
        raise ExportError(
            f"{onnx_path} is not a continuous-batching export (no batch_index input); export it with full_batch_size"
        )
    model.check_tokens(prompts)
    needed = max(len(p) + n for p, n in zip(prompts, budgets))
    ctx = _cache_len(model, ctx_len or needed)
    if ctx < needed:
        raise ExportError(
            f"continuous_batching_generate: ctx_len {ctx} holds fewer than the {needed} positions the "
            "longest request needs"
        )
    past = model.empty_cache(slots, ctx)
    run = ContinuousBatchingRun([[] for _ in prompts], [-1] * len(prompts))
    waiting = deque(range(len(prompts)))
    active: dict[int, int] = {}  # slot -> request
    free = list(range(slots))
    batch_index = np.arange(slots, dtype=np.int64).reshape(-1, 1)

    def finish_done() -> None:
        for slot, r in list(active.items()):
            if len(run.tokens[r]) >= budgets[r]:
                del active[slot]
                free.append(slot)
                run.events.append(("finish", r, slot))

    while waiting or active:
        while waiting and free:
            r, slot = waiting.popleft(), free.pop(0)
            token, past = _prefill(model, prompts[r], prefill_seq_len, past, ctx, slot)
            run.tokens[r].append(token)
            run.slots[r] = slot
            active[slot] = r
            run.events.append(("prefill", r, slot))
            finish_done()
        if not active:
            continue
        ids = np.zeros((slots, 1), dtype=np.int64)
        pos = np.full((slots, 1), -1, dtype=np.int64)
        for slot, r in active.items():
            ids[slot, 0] = run.tokens[r][-1]
            pos[slot, 0] = len(prompts[r]) + len(run.tokens[r]) - 1
        ccl = model.ccl(model.decode_ccls, int(pos.max()) + 1, ctx, "decode")
        logits, past = model.step(ids, pos, past, batch_index, ccl)
        run.decode_steps += 1
        for slot, r in active.items():
            run.tokens[r].append(int(logits[slot].argmax()))
        finish_done()
    return run
