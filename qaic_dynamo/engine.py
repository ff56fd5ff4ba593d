"""``LLM``: a small paged-KV inference engine over the qaic ops.

    from qaic_dynamo import LLM
    llm = LLM(model, backend="qaic", max_num_seqs=8, max_model_len=512, block_size=16)
    out = llm.generate([[1, 2, 3], [4, 5, 6, 7, 8]], max_new_tokens=16)  # greedy

What it does, per step: schedules the waiting and running sequences into one flat batch
(new prompts are prefilled whole, running ones decode one token, mixed freely), builds
the slot mapping and block tables, sets the forward context, runs the (compiled) model
and picks the next token of every sequence. Blocks are reserved for a sequence's whole
length when it is admitted and freed when it finishes; a request that does not fit in
the free blocks waits in the queue until enough are freed (it never preempts and never
truncates). Requests that could never fit, or are malformed, are rejected up front.

The cache of every layer is ``[num_blocks, num_kv_heads, block_size, head_size]``, the op
layer's layout; the model's layers are registered in model order, so
``unified_kv_cache_update(..., "from_forward_context")`` resolves each one.

The token dimension is marked dynamic, so the model compiles once for every batch size
and mix of prefill and decode. Batches are padded to at least two tokens and two logits
rows with padding slots (-1), because Dynamo specialises sizes 0 and 1.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from qaic_dynamo.forward_context import build_attention_metadata, set_forward_context

__all__ = ["LLM", "RequestOutput"]

BACKENDS = ("qaic", "eager", "inductor")


@dataclass
class RequestOutput:
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    #: Logits each generated token was chosen from (only with ``generate(..., return_logits=True)``).
    logits: list[torch.Tensor] | None = None


@dataclass
class _Seq:
    index: int
    prompt: list[int]
    max_new_tokens: int
    blocks: list[int] = field(default_factory=list)
    output: list[int] = field(default_factory=list)
    logits: list[torch.Tensor] | None = None

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.output

    @property
    def done(self) -> bool:
        return len(self.output) >= self.max_new_tokens


class LLM:
    """Greedy generation with paged KV caches through the qaic ops.

    Args:
        model: a ``transformers`` causal-LM instance, a path to a local model directory
            (config, plus safetensors weights if present), a package reference model
            instance (``qaic_dynamo.models``), or a reference model name
            (``"llama"``, ``"mla"``) built with random weights.
        backend: ``"qaic"`` (the default), ``"eager"`` (no compile) or ``"inductor"``.
        max_num_seqs: sequences per ``generate`` call and per batch.
        max_model_len: longest sequence (prompt + generated tokens).
        block_size: tokens per KV block.
        num_blocks: KV blocks per layer; default fits ``max_num_seqs`` sequences of
            ``max_model_len`` tokens.
        layer_agnostic_kv_update: every layer calls the cache update with
            ``"from_forward_context"`` (default) so middle layers compile once; ``False``
            passes each layer's real name (the per-layer baseline).
        compile_options: ``options`` for ``torch.compile`` (qaic backend).
        dtype: cast the model (and caches) to this dtype.
    """

    def __init__(
        self,
        model: Any,
        backend: str = "qaic",
        *,
        max_num_seqs: int = 8,
        max_model_len: int = 512,
        block_size: int = 16,
        num_blocks: int | None = None,
        layer_agnostic_kv_update: bool = True,
        compile_options: dict[str, Any] | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        from qaic_dynamo.models import load_model

        if backend not in BACKENDS:
            raise ValueError(f"LLM: backend must be one of {list(BACKENDS)}, got {backend!r}")
        for name, value in (("max_num_seqs", max_num_seqs), ("max_model_len", max_model_len), ("block_size", block_size)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"LLM: {name} must be a positive int, got {value!r}")
        self.model = load_model(model, layer_agnostic_kv_update=layer_agnostic_kv_update)
        if dtype is not None:
            self.model = self.model.to(dtype)
        self.model.eval()
        self.backend = backend
        self.max_num_seqs, self.max_model_len, self.block_size = max_num_seqs, max_model_len, block_size
        blocks_per_seq = -(-max_model_len // block_size)
        self.num_blocks = num_blocks if num_blocks is not None else max_num_seqs * blocks_per_seq
        if self.num_blocks < 1:
            raise ValueError(f"LLM: num_blocks must be positive, got {self.num_blocks}")
        self.dtype = next(self.model.parameters()).dtype
        self.kv_caches = {
            name: tuple(torch.zeros(shape, dtype=self.dtype) for shape in shapes)
            for name, shapes in self.model.kv_cache_shapes(self.num_blocks, block_size).items()
        }
        self.kv_cache_layers = self.model.kv_cache_layers
        self._free_blocks = collections.deque(range(self.num_blocks))
        if backend == "eager":
            self._fn = self.model
        elif backend == "qaic":
            self._fn = torch.compile(self.model, backend="qaic", options=compile_options)
        else:
            self._fn = torch.compile(self.model, backend="inductor")
        self.stats: dict[str, float] = {}

    # -- validation -----------------------------------------------------------------------
    def _validate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int) -> None:
        if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise ValueError(f"generate: max_new_tokens must be a positive int, got {max_new_tokens!r}")
        if len(prompts) == 0:
            raise ValueError("generate: no prompts given")
        if len(prompts) > self.max_num_seqs:
            raise ValueError(
                f"generate: got {len(prompts)} prompts but max_num_seqs={self.max_num_seqs}; pass at most "
                f"{self.max_num_seqs} per call or create the LLM with a larger max_num_seqs"
            )
        vocab = self.model.vocab_size
        for i, p in enumerate(prompts):
            if len(p) == 0:
                raise ValueError(f"generate: prompt {i} is empty; every prompt needs at least one token")
            bad = [t for t in p if not isinstance(t, int) or not 0 <= t < vocab]
            if bad:
                raise ValueError(
                    f"generate: prompt {i} has token ids outside the vocabulary [0, {vocab}): {bad[:5]}"
                )
            if len(p) > self.max_model_len:
                raise ValueError(
                    f"generate: prompt {i} has {len(p)} tokens but max_model_len={self.max_model_len}"
                )
            if len(p) + max_new_tokens > self.max_model_len:
                raise ValueError(
                    f"generate: prompt {i} ({len(p)} tokens) + max_new_tokens={max_new_tokens} exceeds "
                    f"max_model_len={self.max_model_len}; shorten it, lower max_new_tokens or raise max_model_len"
                )
            need = -(-(len(p) + max_new_tokens) // self.block_size)
            if need > self.num_blocks:
                raise ValueError(
                    f"generate: prompt {i} needs {need} KV blocks of {self.block_size} tokens but the cache has "
                    f"only {self.num_blocks}; raise num_blocks"
                )

    # -- generation -----------------------------------------------------------------------
    def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int = 16) -> list[list[int]]:
        """Greedy-generate ``max_new_tokens`` tokens for each prompt; returns the new tokens."""
        return [o.token_ids for o in self.generate_outputs(prompts, max_new_tokens)]

    @torch.no_grad()
    def generate_outputs(
        self, prompts: Sequence[Sequence[int]], max_new_tokens: int = 16, return_logits: bool = False
    ) -> list[RequestOutput]:
        prompts = [list(p) for p in prompts]
        self._validate(prompts, max_new_tokens)
        waiting = collections.deque(
            _Seq(i, p, max_new_tokens, logits=[] if return_logits else None) for i, p in enumerate(prompts)
        )
        running: list[_Seq] = []
        finished: list[_Seq] = []
        t0 = time.perf_counter()
        steps = tokens = 0
        while waiting or running:
            new = self._admit(waiting, running)
            if not running:
                raise RuntimeError("LLM: no sequence could be scheduled")  # unreachable: validated
            batch = [(s, s.prompt if s in new else s.output[-1:]) for s in running]
            logits = self._step(batch)
            steps += 1
            tokens += sum(len(t) for _, t in batch)
            for (seq, _), row in zip(batch, logits):
                seq.output.append(int(row.argmax()))
                if seq.logits is not None:
                    seq.logits.append(row.clone())
            for seq in [s for s in running if s.done]:
                running.remove(seq)
                self._free_blocks.extend(seq.blocks)
                seq.blocks = []
                finished.append(seq)
        self.stats = {"steps": steps, "tokens": tokens, "seconds": time.perf_counter() - t0}
        finished.sort(key=lambda s: s.index)
        return [RequestOutput(s.prompt, s.output, s.logits) for s in finished]

    def _admit(self, waiting: collections.deque, running: list[_Seq]) -> list[_Seq]:
        """Move waiting sequences in while there are slots and free blocks (FIFO)."""
        admitted = []
        while waiting and len(running) < self.max_num_seqs:
            seq = waiting[0]
            need = -(-(len(seq.prompt) + seq.max_new_tokens) // self.block_size)
            if need > len(self._free_blocks):
                break  # queued until running sequences finish and free their blocks
            waiting.popleft()
            seq.blocks = [self._free_blocks.popleft() for _ in range(need)]
            running.append(seq)
            admitted.append(seq)
        return admitted

    def _step(self, batch: list[tuple[_Seq, list[int]]]) -> torch.Tensor:
        """One forward over every sequence's new tokens; returns their last-token logits."""
        q_lens = [len(toks) for _, toks in batch]
        # Tokens in the cache after this step: the prompt when prefilling, else everything
        # so far (the token fed now is the last output).
        seq_lens = [len(seq.prompt) if not seq.output else len(seq.tokens) for seq, _ in batch]
        ids = [t for _, toks in batch for t in toks]
        positions = [p for (seq, toks), n in zip(batch, seq_lens) for p in range(n - len(toks), n)]
        num_tokens = max(2, len(ids))  # sizes 0/1 are specialised by Dynamo: keep >= 2
        ids += [0] * (num_tokens - len(ids))
        positions += [0] * (num_tokens - len(positions))
        last = (torch.tensor(q_lens).cumsum(0) - 1).tolist()
        logits_indices = torch.tensor(last + last[-1:] * max(0, 2 - len(last)))
        input_ids, pos = torch.tensor(ids), torch.tensor(positions)
        for t in (input_ids, pos, logits_indices):
            torch._dynamo.maybe_mark_dynamic(t, 0)
        md = build_attention_metadata(seq_lens, q_lens, [seq.blocks for seq, _ in batch], self.block_size,
                                      num_tokens=num_tokens)
        with set_forward_context(md, self.kv_caches, self.kv_cache_layers):
            logits = self._fn(input_ids, pos, logits_indices)
        return logits[: len(batch)]
