"""``LLM``: a paged-KV inference engine over the qaic ops, used as vLLM's ``LLM`` is.

    from qaic_dynamo import LLM, SamplingParams
    llm = LLM(model, backend="qaic", max_num_seqs=8, max_model_len=512, block_size=16)
    outs = llm.generate(["a prompt", "another"], SamplingParams(max_tokens=32, temperature=0.8, n=2))
    outs[0].outputs[0].text, outs[0].outputs[1].token_ids      # text with a tokenizer (model dir)
    for delta in llm.stream(["a prompt"], SamplingParams(max_tokens=32)):
        print(delta.outputs[0].text, end="")
    llm.generate([[1, 2, 3], [4, 5, 6, 7, 8]], 16)             # shorthand: greedy token-id lists

``generate`` takes any number of prompts (token-id lists or, with a tokenizer, strings)
and returns vLLM's ``RequestOutput``s (:mod:`.outputs`); an int in place of the
``SamplingParams`` is a shorthand of another type: greedy, exactly that many tokens,
returning plain token-id lists. ``stream`` yields each request's progress as deltas.

Under it (:mod:`.core`): a scheduler with continuous batching and chunked prefill under
a token budget, which preempts (and later recomputes) the newest request when KV blocks
run out (:mod:`.scheduler`); a model runner that feeds one flat batch per step
(:mod:`.runner`); the sampler with vLLM's penalties and logprobs (:mod:`.sampling`); and
incremental detokenization with stop strings (:mod:`.detokenizer`). Several threads may
share one ``LLM``: their requests join the same scheduler, and whichever thread steps
advances them all.

If a step raises, the requests in it fail and release their blocks before the exception
propagates, so the engine stays usable (``LLM.num_free_blocks`` is back to
``num_blocks`` once every request is done). Requests that could never fit, or are
malformed, are refused before anything runs.

The engine never changes the model it is given: it runs its own copy of the module tree,
which shares the weight tensors (see :mod:`qaic_dynamo.models`), so the same model can
back several engines and still run on its own. With ``backend="qaic"`` the model is
compiled region by region (``qaic_dynamo.compile``): the decoder block is traced and
lowered once whatever the depth. ``regional=False`` compiles the whole model in one
``torch.compile`` instead.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from qaic_dynamo.engine.core import EngineCore
from qaic_dynamo.engine.heap import freeze_startup_heap
from qaic_dynamo.engine.outputs import GreedyOutput, RequestOutput
from qaic_dynamo.engine.request import Request, prompt_list
from qaic_dynamo.engine.runner import ModelRunner
from qaic_dynamo.engine.sampling import SEED_RANGE, Sampler, SamplingParams, is_seed, is_token_id
from qaic_dynamo.engine.scheduler import BlockPool, Scheduler

__all__ = ["BACKENDS", "DEFAULT_MAX_MODEL_LEN", "LLM"]

BACKENDS = ("qaic", "eager", "inductor")
#: ``max_model_len`` when none is given (or the model's max_position_embeddings if smaller).
DEFAULT_MAX_MODEL_LEN = 512
#: The least default token budget of a step (``max_num_batched_tokens``): at least
#: ``max_model_len``, so that a prompt alone is prefilled in one step.
DEFAULT_MAX_NUM_BATCHED_TOKENS = 512


class LLM:
    """Greedy generation with paged KV caches through the qaic ops.

    Args:
        model: a ``transformers`` causal-LM instance, a path to a local model directory
            (config, plus safetensors weights if present), a package reference model
            instance (``qaic_dynamo.models``), or a reference model name
            (``"llama"``, ``"mla"``) built with random weights. A model instance is left
            unchanged: the engine runs a copy of its module tree that shares its weights.
        backend: ``"qaic"`` (the default), ``"eager"`` (no compile) or ``"inductor"``.
        max_num_seqs: sequences running at once (more wait in the queue).
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
        max_num_batched_tokens: tokens fed per step at most (prompts are prefilled in
            chunks within it); default the larger of ``max_model_len`` and 512.
        freeze_gc_heap: collect, then freeze the process's start-up heap out of Python's
            cyclic garbage collector (once per process, as vLLM does after start-up): the
            full collections that compiling and serving trigger then skip the hundreds of
            thousands of objects imports made (:mod:`.heap`). Objects alive at that point
            are never collected as cyclic garbage; ``False`` leaves the collector alone.

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
        max_num_batched_tokens: int | None = None,
        freeze_gc_heap: bool = True,
    ) -> None:
        from qaic_dynamo.models import batch_dependent_rope, load_model, max_positions, max_positions_text

        if backend not in BACKENDS:
            raise ValueError(f"LLM: backend must be one of {list(BACKENDS)}, got {backend!r}")
        for name, value in (
            ("max_num_seqs", max_num_seqs),
            ("max_model_len", max_model_len),
            ("block_size", block_size),
            ("num_blocks", num_blocks),
            ("max_num_batched_tokens", max_num_batched_tokens),
        ):
            if value is None and name in ("max_model_len", "num_blocks", "max_num_batched_tokens"):
                continue
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"LLM: {name} must be a positive int, got {value!r}")
        if not isinstance(freeze_gc_heap, bool):
            raise ValueError(f"LLM: freeze_gc_heap must be True or False, got {freeze_gc_heap!r}")
        if not is_seed(seed):  # checked before the model loads, not by torch at the end
            raise ValueError(f"LLM: seed must be {SEED_RANGE}, got {seed!r}")
        dtype = _dtype(dtype)
        if compile_options is not None and not isinstance(compile_options, dict):
            raise ValueError(
                f"LLM: compile_options must be a dict of qaic option name -> value (e.g. {{'fallback': 'error'}}), "
                f"got {type(compile_options).__name__} {compile_options!r}"
            )
        # Before the engine's own objects: a KV cache or module copy frozen now and later
        # dropped in a reference cycle would never be freed.
        #: Seconds this engine spent collecting and freezing the start-up heap (None: not
        #: this one - another engine did, or ``freeze_gc_heap=False``).
        self.gc_freeze_seconds = freeze_startup_heap() if freeze_gc_heap else None
        source, model = model, load_model(model, layer_agnostic_kv_update=layer_agnostic_kv_update, dtype=dtype)
        model.eval()
        # As vLLM: positions past the model's trained range are refused, not run.
        positions = max_positions(model)
        if max_model_len is None:
            max_model_len = min(DEFAULT_MAX_MODEL_LEN, positions or DEFAULT_MAX_MODEL_LEN)
        elif positions is not None and max_model_len > positions:
            raise ValueError(
                f"LLM: max_model_len={max_model_len} exceeds the model's {max_positions_text(model)}; "
                f"pass max_model_len <= {positions}"
            )
        rope = batch_dependent_rope(model)
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
        num_blocks = num_blocks if num_blocks is not None else max_num_seqs * blocks_per_seq
        if max_num_batched_tokens is None:
            max_num_batched_tokens = max(max_model_len, DEFAULT_MAX_NUM_BATCHED_TOKENS)
        self.max_num_batched_tokens = max_num_batched_tokens
        self.runner = ModelRunner(
            model,
            backend,
            block_size=block_size,
            num_blocks=num_blocks,
            counts_kv_writes=layer_agnostic_kv_update,
            compile_options=compile_options,
            regional=regional,
        )
        self.pool = BlockPool(num_blocks)
        self.scheduler = Scheduler(self.pool, block_size, max_num_seqs, max_num_batched_tokens)
        self.stats: dict[str, float] = {}
        self.tokenizer = _load_tokenizer(source, tokenizer)
        self.sampler = Sampler(self._eos_token_ids(), int(seed))
        self.core = EngineCore(
            self.runner, self.scheduler, self.sampler, self.tokenizer, max_model_len, self.model.vocab_size
        )
        self._request_ids = itertools.count()

    # -- the runner's state, as the serving sessions and benchmarks use it ------------------
    @property
    def model(self) -> Any:
        return self.runner.model

    @property
    def dtype(self) -> torch.dtype:
        return self.runner.dtype

    @property
    def kv_cache_layers(self) -> list[str]:
        return self.runner.kv_cache_layers

    @property
    def kv_caches(self) -> dict[str, tuple[torch.Tensor, ...]]:
        return self.runner.kv_caches

    @kv_caches.setter
    def kv_caches(self, caches: dict[str, tuple[torch.Tensor, ...]]) -> None:
        self.runner.kv_caches = caches

    @property
    def num_blocks(self) -> int:
        return self.runner.num_blocks

    @num_blocks.setter
    def num_blocks(self, n: int) -> None:
        # Rebinding the caches (a serving session's shared buffers) changes how many
        # blocks execute_model accepts; the scheduler's pool stays as it was made.
        self.runner.num_blocks = n

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

    # -- KV blocks, for callers that run execute_model themselves ---------------------------
    @property
    def num_free_blocks(self) -> int:
        """KV blocks no request holds (``num_blocks`` when the engine is idle)."""
        return self.pool.num_free

    def blocks_needed(self, num_tokens: int) -> int:
        """KV blocks that hold ``num_tokens`` tokens."""
        return -(-num_tokens // self.block_size)

    def reserve_blocks(self, request: Request) -> bool:
        """Give ``request`` blocks for its whole length (``max_num_tokens``) if that many
        are free; returns whether it did. Release them with :meth:`release_blocks`."""
        if request.block_ids:
            raise ValueError(f"reserve_blocks: request {request.request_id} already holds blocks")
        with self.core.lock:
            blocks = self.pool.take(self.blocks_needed(request.max_num_tokens))
        if blocks is None:
            return False
        request.block_ids = blocks
        return True

    def release_blocks(self, request: Request) -> None:
        """Return ``request``'s blocks to the free pool (a no-op if it holds none)."""
        with self.core.lock:
            self.pool.give_back(request.block_ids)
        request.block_ids = []

    # -- generation -----------------------------------------------------------------------
    def generate(self, prompts: Any, params: Any = None) -> Any:
        """Generate for every prompt (token-id lists, or strings with a tokenizer); one
        prompt alone (a string, or a flat list of token ids) is a batch of one. Any number
        of prompts: the scheduler queues what does not fit.

        ``params`` a ``SamplingParams`` (or one per prompt; None: the defaults) returns one
        ``RequestOutput`` per prompt, in order, each with ``n`` ``CompletionOutput``s
        (``outputs[0].text``, ``.token_ids``, ``.finish_reason``, ...).

        ``params`` an int ``k`` is a shorthand of another type: greedy, exactly ``k`` new
        tokens each (no stop at EOS), returning plain token-id lists.
        """
        prompts = prompt_list(prompts)
        if is_token_id(params) and not isinstance(params, torch.Tensor):
            return [o.token_ids for o in self.generate_outputs(prompts, int(params))]
        per = self._params(prompts, params)
        ids = self._run(prompts, per)
        try:
            return [self.core.output(rid) for rid in ids]
        finally:
            for rid in ids:
                self.core.release(rid)

    def stream(self, prompts: Any, params: Any = None) -> Iterator[RequestOutput]:
        """Generate as :meth:`generate` with ``SamplingParams``, yielding each request's
        progress as it is made: a ``RequestOutput`` per request and step holding only the
        new tokens, text and logprobs (vLLM's delta outputs), ``finished`` on its last.
        Closing the iterator early aborts the requests it still runs."""
        prompts = prompt_list(prompts)
        per = self._params(prompts, params)
        ids = self._add(prompts, per, return_logits=False)
        try:
            pending = set(ids)
            while pending:
                with self.core.lock:
                    self._step_for(pending)
                    ready = [rid for rid in ids if rid in pending and rid in self.core.dirty]
                    outs = [self.core.output(rid, delta=True) for rid in ready]
                    errors = [(rid, self.core.error(rid)) for rid in ready if self.core.error(rid) is not None]
                if errors:
                    raise RuntimeError(f"stream: request {errors[0][0]} failed: {errors[0][1]}")
                for out in outs:
                    if out.finished:
                        pending.discard(out.request_id)
                    yield out
        finally:
            for rid in ids:
                self.core.release(rid)

    @torch.no_grad()
    def generate_outputs(
        self, prompts: Sequence[Any], max_new_tokens: int = 16, return_logits: bool = False
    ) -> list[GreedyOutput]:
        """Greedy, exactly ``max_new_tokens`` tokens each, with the logits row of every
        generated token when ``return_logits``."""
        if not isinstance(max_new_tokens, int) or isinstance(max_new_tokens, bool) or max_new_tokens < 1:
            raise ValueError(f"generate: max_new_tokens must be a positive int, got {max_new_tokens!r}")
        greedy = SamplingParams(max_tokens=max_new_tokens, temperature=0, ignore_eos=True)
        prompts = prompt_list(prompts)
        ids = self._run(prompts, [greedy] * len(prompts), return_logits=return_logits)
        try:
            outs = []
            for rid in ids:
                o = self.core.output(rid)
                outs.append(GreedyOutput(o.prompt_token_ids, o.outputs[0].token_ids, self.core.logits(rid)[0]))
            return outs
        finally:
            for rid in ids:
                self.core.release(rid)

    def _params(self, prompts: list[Any], params: Any) -> list[SamplingParams]:
        if params is None:
            params = SamplingParams()
        per = list(params) if isinstance(params, (list, tuple)) else [params] * len(prompts)
        if len(per) != len(prompts) or not all(isinstance(p, SamplingParams) for p in per):
            raise TypeError(
                "generate: params must be a SamplingParams, one SamplingParams per prompt "
                f"({len(prompts)}), or an int (greedy max_tokens, returning token-id lists); got {params!r}"
            )
        return per

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

    def _add(self, prompts: list[Any], params: list[SamplingParams], return_logits: bool) -> list[str]:
        """Add every prompt as a request (all validated first, none added if one is bad)."""
        if len(prompts) == 0:
            raise ValueError("generate: no prompts given")
        ids = self._token_ids(prompts)
        for i, (p, sp) in enumerate(zip(ids, params)):
            self.core.check_request(p, sp, f"prompt {i}")
        with self.core.lock:
            rids = [str(next(self._request_ids)) for _ in prompts]
            for rid, prompt, p, sp in zip(rids, prompts, ids, params):
                self.core.add_request(rid, prompt if isinstance(prompt, str) else None, p, sp, return_logits)
        return rids

    @torch.no_grad()
    def _run(self, prompts: list[Any], params: list[SamplingParams], return_logits: bool = False) -> list[str]:
        """Add the requests and step until all are finished. If a step raises, the
        requests are released before the exception propagates: the engine stays usable."""
        ids = self._add(prompts, params, return_logits)
        steps, tokens, t0 = self.core.num_steps, self.core.num_tokens, time.perf_counter()
        try:
            pending = set(ids)
            while pending:
                with self.core.lock:
                    self._step_for(pending)
                    pending = {rid for rid in pending if not self.core.is_finished(rid)}
        except BaseException:
            for rid in ids:
                self.core.release(rid)
            raise
        failed = [(rid, self.core.error(rid)) for rid in ids if self.core.error(rid) is not None]
        if failed:
            for rid in ids:
                self.core.release(rid)
            rid, error = failed[0]
            raise RuntimeError(f"generate: request {rid} failed: {error}")
        self.stats = {
            "steps": self.core.num_steps - steps,
            "tokens": self.core.num_tokens - tokens,
            "seconds": time.perf_counter() - t0,
        }
        return ids

    def _step_for(self, pending: set[str]) -> None:
        """One step, unless every request of ``pending`` is already finished (another
        thread may have stepped for them); under the core's lock. A request another
        thread's failing step aborted raises here, naming the error."""
        if all(self.core.is_finished(rid) for rid in pending):
            return
        if self.core.step() == 0:
            raise RuntimeError("LLM: requests are pending but the scheduler has nothing to run")

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
        return self.runner.forward(requests, [r.num_tokens - r.num_computed_tokens for r in requests])[0]


_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16, "float64": torch.float64}


def _dtype(dtype: Any) -> torch.dtype | None:
    """``dtype`` as a torch dtype: one, or its name ("float16", "torch.bfloat16", as vLLM
    takes it); anything else is refused naming the valid ones."""
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    if isinstance(dtype, str) and dtype.removeprefix("torch.") in _DTYPES:
        return _DTYPES[dtype.removeprefix("torch.")]
    raise ValueError(f"LLM: dtype must be a torch dtype or one of {sorted(_DTYPES)}, got {dtype!r}")


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

        if not Path(tokenizer).is_dir():
            # transformers would read it as a hub repo id ("Repo id must be ..."): nothing
            # is downloaded here, so a tokenizer is a local directory.
            raise ValueError(
                f"LLM: tokenizer {str(tokenizer)!r} is not a directory; pass a local directory with tokenizer files "
                "(tokenizer.json or tokenizer_config.json), or a tokenizer object"
            )
        return AutoTokenizer.from_pretrained(str(tokenizer), local_files_only=True)
    if not (hasattr(tokenizer, "encode") and hasattr(tokenizer, "decode")):
        raise TypeError(f"LLM: tokenizer must have encode/decode or be a path, got {type(tokenizer).__name__}")
    return tokenizer
