"""``LLM``: a small paged-KV inference engine over the qaic ops.

    from qaic_dynamo import LLM, SamplingParams
    llm = LLM(model, backend="qaic", max_num_seqs=8, max_model_len=512, block_size=16)
    out = llm.generate([[1, 2, 3], [4, 5, 6, 7, 8]], 16)       # greedy token ids, 16 each
    outs = llm.generate(["a prompt"], SamplingParams(max_tokens=32, temperature=0.8, seed=0))
    outs[0].text, outs[0].token_ids                             # with a tokenizer (model dir)

``generate(prompts, n)`` with an int is greedy and returns exactly ``n`` new token ids per
prompt; with ``SamplingParams`` (one, or one per prompt) it returns ``RequestOutput``s
(token ids, text when there is a tokenizer, finish reason) and stops at EOS and stop
tokens (see :mod:`qaic_dynamo.engine.sampling`). Prompts are token-id lists or, with a
tokenizer, strings.

What it does, per step: schedules the waiting and running requests into one flat batch
(new prompts are prefilled whole, running ones decode one token, mixed freely), builds
the slot mapping and block tables, sets the forward context, runs the (compiled) model
(:meth:`LLM.execute_model`) and picks the next token of every request. Blocks are
reserved for a request's whole length when it is admitted and released when it finishes,
or when ``generate`` stops on an exception, so the engine is usable again afterwards
(``LLM.num_free_blocks`` is back to ``num_blocks`` after every ``generate``); a
request that does not fit in the free blocks waits in the queue until enough are freed
(it never preempts and never truncates). Requests that could never fit, or are
malformed, are rejected up front.

The engine never changes the model it is given: it runs its own copy of the module tree,
which shares the weight tensors (see :mod:`qaic_dynamo.models`), so the same model can
back several engines and still run on its own.

The cache of every layer is ``[num_blocks, num_kv_heads, block_size, head_size]``, the op
layer's layout; the model's layers are registered in model order, so
``unified_kv_cache_update(..., "from_forward_context")`` resolves each one.

With ``backend="qaic"`` the model is compiled region by region (``qaic_dynamo.compile``):
the decoder block is traced and lowered once whatever the depth, and the embedding,
final norm and head are regions of their own. ``regional=False`` compiles the whole model
in one ``torch.compile`` instead.

The token dimension is marked dynamic, so the model compiles once for every batch size
and mix of prefill and decode. Batches are padded to at least two tokens and two logits
rows with padding slots (-1), because Dynamo specialises sizes 0 and 1.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Sequence
from typing import Any

import torch

from qaic_dynamo._compat import maybe_mark_dynamic
from qaic_dynamo.engine.request import Request, RequestOutput, prompt_list
from qaic_dynamo.engine.sampling import SEED_RANGE, Sampler, SamplingParams, is_seed, is_token_id
from qaic_dynamo.forward_context import build_attention_metadata, set_forward_context

__all__ = ["BACKENDS", "DEFAULT_MAX_MODEL_LEN", "LLM"]

BACKENDS = ("qaic", "eager", "inductor")
#: ``max_model_len`` when none is given (or the model's max_position_embeddings if smaller).
DEFAULT_MAX_MODEL_LEN = 512


class LLM:
    """Greedy generation with paged KV caches through the qaic ops.

    Args:
        model: a ``transformers`` causal-LM instance, a path to a local model directory
            (config, plus safetensors weights if present), a package reference model
            instance (``qaic_dynamo.models``), or a reference model name
            (``"llama"``, ``"mla"``) built with random weights. A model instance is left
            unchanged: the engine runs a copy of its module tree that shares its weights.
        backend: ``"qaic"`` (the default), ``"eager"`` (no compile) or ``"inductor"``.
        max_num_seqs: sequences per ``generate`` call and per batch.
        max_model_len: longest sequence (prompt + generated tokens); default 512, or the
            model's ``max_position_embeddings`` if smaller. More than that is refused.
        block_size: tokens per KV block.
        num_blocks: KV blocks per layer; default fits ``max_num_seqs`` sequences of
            ``max_model_len`` tokens.
        layer_agnostic_kv_update: every layer calls the cache update with
            ``"from_forward_context"`` (default) so middle layers compile once; ``False``
            passes each layer's real name (the per-layer baseline).
        compile_options: ``options`` for ``torch.compile`` (qaic backend).
        regional: with ``backend="qaic"``, compile region by region
            (:func:`qaic_dynamo.compile`: each repeated decoder block is traced once,
            whatever the depth) - the default; ``False`` compiles the whole model with
            ``torch.compile(model, backend="qaic")`` (Dynamo traces every layer).
        dtype: run the model and the caches in this dtype; a model of another dtype is
            cast into the engine's own copy of its weights (the given model is unchanged).
        tokenizer: a tokenizer (anything with ``encode``/``decode``, e.g. transformers'),
            or a path to load one from with ``AutoTokenizer``; by default it is loaded from
            the model directory when the model is one and has tokenizer files.
        seed: seed of the generator shared by requests sampled without a seed of their own.

    Raises NotImplementedError, before anything is traced, for a model the qaic ops do not
    implement (e.g. chunked attention, transformers' latent attention, attention that
    bypasses transformers' attention interface, recurrent layers).
    """

    def __init__(
        self,
        model: Any,
        backend: str = "qaic",
        *,
        max_num_seqs: int = 8,
        max_model_len: int | None = None,
        block_size: int = 16,
        num_blocks: int | None = None,
        layer_agnostic_kv_update: bool = True,
        compile_options: dict[str, Any] | None = None,
        dtype: torch.dtype | None = None,
        regional: bool = True,
        tokenizer: Any = None,
        seed: int = 0,
    ) -> None:
        from qaic_dynamo.models import batch_dependent_rope, load_model, max_positions, max_positions_text

        if backend not in BACKENDS:
            raise ValueError(f"LLM: backend must be one of {list(BACKENDS)}, got {backend!r}")
        for name, value in (
            ("max_num_seqs", max_num_seqs),
            ("max_model_len", max_model_len),
            ("block_size", block_size),
            ("num_blocks", num_blocks),
        ):
            if value is None and name in ("max_model_len", "num_blocks"):
                continue
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"LLM: {name} must be a positive int, got {value!r}")
        if not is_seed(seed):  # checked before the model loads, not by torch at the end
            raise ValueError(f"LLM: seed must be {SEED_RANGE}, got {seed!r}")
        self.model = load_model(model, layer_agnostic_kv_update=layer_agnostic_kv_update, dtype=dtype)
        self.model.eval()
        # As vLLM: positions past the model's trained range are refused, not run.
        positions = max_positions(self.model)
        if max_model_len is None:
            max_model_len = min(DEFAULT_MAX_MODEL_LEN, positions or DEFAULT_MAX_MODEL_LEN)
        elif positions is not None and max_model_len > positions:
            raise ValueError(
                f"LLM: max_model_len={max_model_len} exceeds the model's {max_positions_text(self.model)}; "
                f"pass max_model_len <= {positions}"
            )
        rope = batch_dependent_rope(self.model)
        if rope is not None and max_num_seqs > 1 and max_model_len > rope[1]:
            # The engine runs a step's requests as one sequence of tokens, so one request
            # past that length would change the RoPE frequencies - and the tokens - of all.
            raise ValueError(
                f"LLM: the model's rope_type {rope[0]!r} takes its frequencies from the longest sequence in a forward "
                f"once it passes {rope[1]} tokens (transformers), so requests batched together would change each "
                f"other's outputs; pass max_model_len <= {rope[1]}, or max_num_seqs=1 to serve one request at a time"
            )
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
        # With "from_forward_context" every layer's update advances the context's layer
        # index, so after a forward it must have reached the last layer (checked per step).
        self._counts_kv_writes = layer_agnostic_kv_update
        self._free_blocks = collections.deque(range(self.num_blocks))
        if backend == "eager":
            self._fn = self.model
        elif backend == "qaic":
            from qaic_dynamo.compiler import compile as compile_regions
            from qaic_dynamo.compiler import specialized_floats

            if regional:
                self._fn = compile_regions(self.model, **(compile_options or {}))
            else:
                self._fn = specialized_floats()(torch.compile(self.model, backend="qaic", options=compile_options))
        else:
            self._fn = torch.compile(self.model, backend="inductor")
        self.stats: dict[str, float] = {}
        self.tokenizer = _load_tokenizer(model, tokenizer)
        self.sampler = Sampler(self._eos_token_ids(), int(seed))

    def _eos_token_ids(self) -> list[int]:
        """The model's EOS token(s), from its generation or model config, and the
        tokenizer's: any of them ends a request (checkpoints whose config and tokenizer
        name different end-of-turn tokens stop at either, as in vLLM)."""
        from qaic_dynamo.models import model_config

        ids: list[int] = []
        gen = getattr(getattr(self.model, "hf", None), "generation_config", None)
        for source in (gen, model_config(self.model)):
            eos = getattr(source, "eos_token_id", None)
            if eos is not None:
                ids = [eos] if isinstance(eos, int) else list(eos)
                break
        tok_eos = getattr(self.tokenizer, "eos_token_id", None) if self.tokenizer is not None else None
        if isinstance(tok_eos, int) and tok_eos not in ids:
            ids.append(tok_eos)
        return ids

    # -- KV blocks ------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        """KV blocks not reserved by any request (``num_blocks`` when the engine is idle)."""
        return len(self._free_blocks)

    def blocks_needed(self, num_tokens: int) -> int:
        """KV blocks that hold ``num_tokens`` tokens."""
        return -(-num_tokens // self.block_size)

    def reserve_blocks(self, request: Request) -> bool:
        """Give ``request`` blocks for its whole length (``max_num_tokens``) if that many
        are free; returns whether it did. Release them with :meth:`release_blocks`."""
        if request.block_ids:
            raise ValueError(f"reserve_blocks: request {request.request_id} already holds blocks")
        need = self.blocks_needed(request.max_num_tokens)
        if need > len(self._free_blocks):
            return False
        request.block_ids = [self._free_blocks.popleft() for _ in range(need)]
        return True

    def release_blocks(self, request: Request) -> None:
        """Return ``request``'s blocks to the free pool (a no-op if it holds none)."""
        self._free_blocks.extend(request.block_ids)
        request.block_ids = []

    # -- validation -----------------------------------------------------------------------
    def _validate(self, prompts: Sequence[Sequence[int]], max_tokens: Sequence[int]) -> None:
        if len(prompts) == 0:
            raise ValueError("generate: no prompts given")
        if len(prompts) > self.max_num_seqs:
            raise ValueError(
                f"generate: got {len(prompts)} prompts but max_num_seqs={self.max_num_seqs}; pass at most "
                f"{self.max_num_seqs} per call or create the LLM with a larger max_num_seqs"
            )
        vocab = self.model.vocab_size
        for i, (p, max_new_tokens) in enumerate(zip(prompts, max_tokens)):
            if len(p) == 0:
                raise ValueError(f"generate: prompt {i} is empty; every prompt needs at least one token")
            bad = [t for t in p if not 0 <= t < vocab]
            if bad:
                raise ValueError(f"generate: prompt {i} has token ids outside the vocabulary [0, {vocab}): {bad[:5]}")
            if len(p) > self.max_model_len:
                raise ValueError(f"generate: prompt {i} has {len(p)} tokens but max_model_len={self.max_model_len}")
            if len(p) + max_new_tokens > self.max_model_len:
                raise ValueError(
                    f"generate: prompt {i} ({len(p)} tokens) + max_new_tokens={max_new_tokens} exceeds "
                    f"max_model_len={self.max_model_len}; shorten it, lower max_new_tokens or raise max_model_len"
                )
            need = self.blocks_needed(len(p) + max_new_tokens)
            if need > self.num_blocks:
                raise ValueError(
                    f"generate: prompt {i} needs {need} KV blocks of {self.block_size} tokens but the cache has "
                    f"only {self.num_blocks}; raise num_blocks"
                )

    # -- generation -----------------------------------------------------------------------
    def generate(self, prompts: Sequence[Any], params: Any = 16) -> Any:
        """Generate for every prompt (token-id lists, or strings with a tokenizer); one
        prompt alone (a string, or a flat list of token ids) is a batch of one.

        ``params`` an int ``n``: greedy, exactly ``n`` new tokens each, returned as token-id
        lists (no EOS stop). ``params`` a ``SamplingParams`` (or one per prompt): returns
        ``RequestOutput``s with token ids, text (with a tokenizer) and finish reason.
        """
        prompts = prompt_list(prompts)
        if isinstance(params, int) and not isinstance(params, bool):
            return [o.token_ids for o in self.generate_outputs(prompts, params)]
        per = list(params) if isinstance(params, (list, tuple)) else [params] * len(prompts)
        if len(per) != len(prompts) or not all(isinstance(p, SamplingParams) for p in per):
            raise TypeError(
                "generate: params must be an int (greedy max_new_tokens), a SamplingParams, or one "
                f"SamplingParams per prompt ({len(prompts)}); got {params!r}"
            )
        return self._generate(prompts, per, return_logits=False)

    @torch.no_grad()
    def generate_outputs(
        self, prompts: Sequence[Any], max_new_tokens: int = 16, return_logits: bool = False
    ) -> list[RequestOutput]:
        """Greedy, exactly ``max_new_tokens`` tokens each, as ``RequestOutput``s, with the
        logits of every generated token when ``return_logits``."""
        if not isinstance(max_new_tokens, int) or isinstance(max_new_tokens, bool) or max_new_tokens < 1:
            raise ValueError(f"generate: max_new_tokens must be a positive int, got {max_new_tokens!r}")
        greedy = SamplingParams(max_tokens=max_new_tokens, temperature=0, ignore_eos=True)
        prompts = prompt_list(prompts)
        return self._generate(prompts, [greedy] * len(prompts), return_logits)

    def _token_ids(self, prompts: Sequence[Any]) -> list[list[int]]:
        out = []
        for i, p in enumerate(prompts):
            if isinstance(p, str):
                if self.tokenizer is None:
                    raise ValueError(
                        f"generate: prompt {i} is text but this LLM has no tokenizer; pass token ids, or "
                        "LLM(model, tokenizer=...) (a tokenizer or a path to one), or a model directory that "
                        "holds tokenizer files"
                    )
                out.append(list(self.tokenizer.encode(p)))
            elif isinstance(p, (list, tuple)):
                bad = [t for t in p if not is_token_id(t)]
                if bad:
                    raise TypeError(f"generate: prompt {i} has token ids that are not integers: {bad[:5]}")
                out.append([int(t) for t in p])
            else:
                raise TypeError(
                    f"generate: prompt {i} is a {type(p).__name__}; a prompt is a list of token ids or a string"
                )
        return out

    @torch.no_grad()
    def _generate(self, prompts: Sequence[Any], params: list[Any], return_logits: bool) -> list[RequestOutput]:
        """Every generation path: continuous batching, one sampler per request. If a step
        raises, every block is released before the exception propagates, and the engine
        can be used again."""
        ids = self._token_ids(prompts)
        self._validate(ids, [p.max_tokens for p in params])
        requests = [
            Request(i, p, sp.max_tokens, logits=[] if return_logits else None, params=sp)
            for i, (p, sp) in enumerate(zip(ids, params))
        ]
        generators = [self.sampler.generator(sp) for sp in params]
        waiting = collections.deque(requests)
        running: list[Request] = []
        t0 = time.perf_counter()
        steps = tokens = 0
        try:
            while waiting or running:
                self._admit(waiting, running)
                if not running:
                    raise RuntimeError("LLM: no sequence could be scheduled")  # unreachable: validated
                logits = self.execute_model(running)
                steps += 1
                for req, row in zip(running, logits):
                    tokens += req.num_tokens - req.num_computed_tokens
                    req.num_computed_tokens = req.num_tokens
                    tok = self.sampler.pick(row, req.params, generators[req.request_id])
                    req.output_token_ids.append(tok)
                    req.stopped = self.sampler.is_stop_token(tok, req.params)
                    if req.logits is not None:
                        req.logits.append(row.clone())
                for req in [r for r in running if r.is_finished]:
                    running.remove(req)
                    self.release_blocks(req)
        finally:  # on success only finished requests remain, holding no blocks
            for req in requests:
                self.release_blocks(req)
        self.stats = {"steps": steps, "tokens": tokens, "seconds": time.perf_counter() - t0}
        return [
            RequestOutput(
                r.prompt_token_ids,
                r.output_token_ids,
                r.logits,
                text=self._decode(r.output_token_ids) if self.tokenizer else None,
                prompt=prompts[r.request_id] if isinstance(prompts[r.request_id], str) else None,
                finish_reason="stop" if r.stopped else "length",
            )
            for r in requests
        ]

    def _decode(self, token_ids: list[int]) -> str:
        """Text of ``token_ids``; a tokenizer with a plain ``decode(ids)`` (no
        ``skip_special_tokens``) is accepted too, as documented."""
        try:
            return self.tokenizer.decode(token_ids, skip_special_tokens=True)
        except TypeError as e:
            if "skip_special_tokens" not in str(e):
                raise
            return self.tokenizer.decode(token_ids)

    def _admit(self, waiting: collections.deque[Request], running: list[Request]) -> None:
        """Move waiting requests in while there are slots and free blocks (FIFO)."""
        while waiting and len(running) < self.max_num_seqs:
            if not self.reserve_blocks(waiting[0]):
                break  # queued until running requests finish and release their blocks
            running.append(waiting.popleft())

    def execute_model(self, requests: Sequence[Request]) -> torch.Tensor:
        """One forward pass over a batch: every request's tokens not yet in the cache
        (``all_token_ids[num_computed_tokens:]``: the prompt when prefilling, the last
        output token when decoding), written to the slots of its ``block_ids``.

        Returns the logits of each request's last token, ``[len(requests), vocab]``. The
        requests are not changed (the caller picks the next token and advances
        ``num_computed_tokens``), so the same batch can be run again, e.g. to time it.
        """
        if not requests:
            raise ValueError("execute_model: the batch is empty")
        for r in requests:
            if r.num_computed_tokens >= r.num_tokens:
                raise ValueError(
                    f"execute_model: request {r.request_id} has no token to feed: all {r.num_tokens} are "
                    "computed; append the next token (or leave it out of the batch)"
                )
            if any(not 0 <= b < self.num_blocks for b in r.block_ids):
                raise ValueError(
                    f"execute_model: request {r.request_id} has block ids outside [0, {self.num_blocks}): "
                    f"{[b for b in r.block_ids if not 0 <= b < self.num_blocks][:5]}"
                )
        new_tokens = [r.all_token_ids[r.num_computed_tokens :] for r in requests]
        q_lens = [len(t) for t in new_tokens]
        seq_lens = [r.num_tokens for r in requests]  # tokens in the cache after this step
        ids = [t for toks in new_tokens for t in toks]
        positions = [p for r in requests for p in range(r.num_computed_tokens, r.num_tokens)]
        num_tokens = max(2, len(ids))  # sizes 0/1 are specialised by Dynamo: keep >= 2
        ids += [0] * (num_tokens - len(ids))
        positions += [0] * (num_tokens - len(positions))
        last = (torch.tensor(q_lens).cumsum(0) - 1).tolist()
        logits_indices = torch.tensor(last + last[-1:] * max(0, 2 - len(last)))
        input_ids, pos = torch.tensor(ids), torch.tensor(positions)
        for t in (input_ids, pos, logits_indices):
            maybe_mark_dynamic(t, 0)
        md = build_attention_metadata(
            seq_lens, q_lens, [r.block_ids for r in requests], self.block_size, num_tokens=num_tokens
        )
        with torch.no_grad(), set_forward_context(md, self.kv_caches, self.kv_cache_layers) as ctx:
            logits = self._fn(input_ids, pos, logits_indices)
            written = ctx.kv_cache_layer_index
        if self._counts_kv_writes and written != len(self.kv_cache_layers):
            # A layer whose attention bypasses the qaic ops computed without its cache, and
            # the next step would read a cache it never wrote: never return such logits.
            raise RuntimeError(
                f"execute_model: the model wrote the KV cache of {written} of its {len(self.kv_cache_layers)} "
                "attention layers in this forward; its attention does not go through the qaic ops for every layer "
                "(for a transformers model: it does not call the attention interface), so the engine cannot run it"
            )
        return logits[: len(requests)]


def _load_tokenizer(model: Any, tokenizer: Any) -> Any:
    """The tokenizer given, loaded from the path given, or the model directory's own."""
    import os
    from pathlib import Path

    if tokenizer is None:
        if (
            isinstance(model, (str, os.PathLike))
            and Path(model).is_dir()
            and any((Path(model) / f).exists() for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model"))
        ):
            tokenizer = model
        else:
            return None
    if isinstance(tokenizer, (str, os.PathLike)):
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(str(tokenizer), local_files_only=True)
    if not (hasattr(tokenizer, "encode") and hasattr(tokenizer, "decode")):
        raise TypeError(f"LLM: tokenizer must have encode/decode or be a path, got {type(tokenizer).__name__}")
    return tokenizer
