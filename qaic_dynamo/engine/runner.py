"""The model runner: one forward pass over a flat batch of requests' new tokens.

It holds the (compiled) model and the KV caches, one ``[num_blocks, num_kv_heads,
block_size, head_size]`` tensor per layer and role (the op layer's layout). A step
feeds every scheduled request's next tokens as one flat sequence, builds the slot mapping
and block tables, sets the forward context and runs the model; the model's layers are
registered in model order, so ``unified_kv_cache_update(..., "from_forward_context")``
resolves each one.

The token dimension is marked dynamic, so the model compiles once for every batch size
and mix of prefill and decode, whatever the schedule. Batches are padded to at least two
tokens and two logits rows with padding slots (-1), because Dynamo specialises sizes 0
and 1.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from qaic_dynamo._compat import maybe_mark_dynamic
from qaic_dynamo.engine.request import Request
from qaic_dynamo.forward_context import build_attention_metadata, set_forward_context

__all__ = ["ModelRunner"]


class ModelRunner:
    """A loaded model, compiled for ``backend``, over KV caches of ``num_blocks`` blocks."""

    def __init__(
        self,
        model: Any,
        backend: str,
        *,
        block_size: int,
        num_blocks: int,
        counts_kv_writes: bool,
        compile_options: dict[str, Any] | None,
        regional: bool,
    ) -> None:
        self.model = model
        self.backend = backend
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.dtype = next(model.parameters()).dtype
        self.kv_caches = {
            name: tuple(torch.zeros(shape, dtype=self.dtype) for shape in shapes)
            for name, shapes in model.kv_cache_shapes(num_blocks, block_size).items()
        }
        self.kv_cache_layers = model.kv_cache_layers
        # With "from_forward_context" every layer's update advances the context's layer
        # index, so after a forward it must have reached the last layer (checked per step).
        self.counts_kv_writes = counts_kv_writes
        self.marks_inputs = True  # the token dimension of the step's inputs marked dynamic
        if backend == "eager":
            self.fn = model
        elif backend == "qaic":
            from qaic_dynamo.compiler import compile as compile_regions
            from qaic_dynamo.compiler import specialized_floats
            from qaic_dynamo.config import CompilationConfig

            CompilationConfig.from_options(compile_options)  # bad options now, not at the first step

            if regional:
                self.fn = compile_regions(model, **(compile_options or {}))
                # The regions mark their own inputs when they trace. A mark made here too
                # would reach a region whose input is input_ids itself (an MLA model's
                # embedding) and fail its saved trace's guards at every restart: Dynamo
                # does not save a tensor's marks, so a loaded guard expects none.
                self.marks_inputs = False
            else:
                self.fn = specialized_floats()(torch.compile(model, backend="qaic", options=compile_options))
        else:
            self.fn = torch.compile(model, backend="inductor")

    def check(self, requests: Sequence[Request], counts: Sequence[int]) -> None:
        if not requests:
            raise ValueError("execute_model: the batch is empty")
        for r, n in zip(requests, counts):
            if r.num_computed_tokens >= r.num_tokens or n < 1 or r.num_computed_tokens + n > r.num_tokens:
                raise ValueError(
                    f"execute_model: request {r.request_id} has no token to feed: all {r.num_tokens} are "
                    "computed; append the next token (or leave it out of the batch)"
                    if r.num_computed_tokens >= r.num_tokens
                    else f"execute_model: request {r.request_id} cannot feed {n} tokens: {r.num_computed_tokens} "
                    f"of its {r.num_tokens} are computed"
                )
            if any(not 0 <= b < self.num_blocks for b in r.block_ids):
                raise ValueError(
                    f"execute_model: request {r.request_id} has block ids outside [0, {self.num_blocks}): "
                    f"{[b for b in r.block_ids if not 0 <= b < self.num_blocks][:5]}"
                )
            if len(r.block_ids) * self.block_size < r.num_computed_tokens + n:
                raise ValueError(
                    f"execute_model: request {r.request_id} holds {len(r.block_ids)} blocks of {self.block_size} "
                    f"tokens, too few for {r.num_computed_tokens + n} tokens"
                )

    def forward(
        self, requests: Sequence[Request], counts: Sequence[int], all_rows: Sequence[bool] = ()
    ) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """Feed ``counts[i]`` new tokens of ``requests[i]`` (from ``num_computed_tokens``)
        into its blocks. Returns the logits of each request's last fed token
        ``[len(requests), vocab]``, and for every ``i`` with ``all_rows[i]`` the logits of
        all its fed tokens ``[counts[i], vocab]``. The requests are not changed."""
        self.check(requests, counts)
        all_rows = list(all_rows) or [False] * len(requests)
        new_tokens = [
            r.all_token_ids[r.num_computed_tokens : r.num_computed_tokens + n] for r, n in zip(requests, counts)
        ]
        q_lens = list(counts)
        seq_lens = [r.num_computed_tokens + n for r, n in zip(requests, counts)]  # in the cache after this step
        ids = [t for toks in new_tokens for t in toks]
        positions = [
            p for r, n in zip(requests, counts) for p in range(r.num_computed_tokens, r.num_computed_tokens + n)
        ]
        num_tokens = max(2, len(ids))  # sizes 0/1 are specialised by Dynamo: keep >= 2
        ids += [0] * (num_tokens - len(ids))
        positions += [0] * (num_tokens - len(positions))
        ends = torch.tensor(q_lens).cumsum(0).tolist()
        last = [e - 1 for e in ends]
        rows = list(last)
        spans: dict[int, tuple[int, int]] = {}
        for i, want in enumerate(all_rows):
            if want:
                spans[i] = (len(rows), len(rows) + q_lens[i])
                rows += range(ends[i] - q_lens[i], ends[i])
        logits_indices = torch.tensor(rows + rows[-1:] * max(0, 2 - len(rows)))
        input_ids, pos = torch.tensor(ids), torch.tensor(positions)
        if self.marks_inputs:
            for t in (input_ids, pos, logits_indices):
                maybe_mark_dynamic(t, 0)
        md = build_attention_metadata(
            seq_lens, q_lens, [r.block_ids for r in requests], self.block_size, num_tokens=num_tokens
        )
        with torch.no_grad(), set_forward_context(md, self.kv_caches, self.kv_cache_layers) as ctx:
            logits = self.fn(input_ids, pos, logits_indices)
            written = ctx.kv_cache_layer_index
        if self.counts_kv_writes and written != len(self.kv_cache_layers):
            # A layer whose attention bypasses the qaic ops computed without its cache, and
            # the next step would read a cache it never wrote: never return such logits.
            raise RuntimeError(
                f"execute_model: the model wrote the KV cache of {written} of its {len(self.kv_cache_layers)} "
                "attention layers in this forward; its attention does not go through the qaic ops for every layer "
                "(for a transformers model: it does not call the attention interface), so the engine cannot run it"
            )
        return logits[: len(requests)], {i: logits[a:b] for i, (a, b) in spans.items()}
