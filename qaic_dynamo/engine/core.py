"""The engine core: requests in, one step at a time, outputs out.

:class:`EngineCore` owns the scheduler, the model runner and every request's state. A
request (one prompt, ``SamplingParams.n`` samples) is added with :meth:`add_request`;
each :meth:`step` schedules, runs one forward pass, picks a token for every sample whose
tokens are all in the cache, detokenizes it and checks the stop conditions.
:meth:`output` builds a request's ``RequestOutput``: cumulative, or only what is new since
the last delta (streaming). It is safe to call from several threads. Every public method
takes :attr:`lock`, so whichever thread steps advances every request, its own and the
others'.

Each sample is an engine :class:`Request` of its own, scheduled alone. Samples of one
prompt share nothing but the prompt; the KV of the prompt is computed once per sample.
"""

from __future__ import annotations

import itertools
import threading
from dataclasses import dataclass, field
from typing import Any

import torch

from qaic_dynamo.engine.detokenizer import Detokenizer, decode
from qaic_dynamo.engine.outputs import CompletionOutput, Logprob, RequestOutput
from qaic_dynamo.engine.request import Request
from qaic_dynamo.engine.runner import ModelRunner
from qaic_dynamo.engine.sampling import Sampler, SamplingParams
from qaic_dynamo.engine.scheduler import Scheduler

__all__ = ["EngineCore"]


@dataclass
class _Sample:
    request: Request
    index: int
    generator: torch.Generator
    detokenizer: Detokenizer
    logprobs: list[dict[int, Logprob]] | None
    cumulative_logprob: float | None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    #: Tokens (and logprobs) already sent as deltas.
    sent: int = 0
    #: Its finish has been sent as a delta: later deltas leave it out.
    final_sent: bool = False


@dataclass
class _Group:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    samples: list[_Sample] = field(default_factory=list)
    #: Position -> logprobs of that prompt token (prompt_logprobs), filled as prefill runs.
    prompt_logprobs: dict[int, dict[int, Logprob]] | None = None
    prompt_logprobs_sent: bool = False
    #: Why a step that ran it failed (its samples are then finished as "abort").
    error: str | None = None

    @property
    def finished(self) -> bool:
        return all(s.finish_reason is not None for s in self.samples)


class EngineCore:
    """See the module docstring."""

    def __init__(
        self,
        runner: ModelRunner,
        scheduler: Scheduler,
        sampler: Sampler,
        tokenizer: Any,
        max_model_len: int,
        vocab_size: int,
    ) -> None:
        self.runner = runner
        self.scheduler = scheduler
        self.sampler = sampler
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.lock = threading.RLock()
        self._groups: dict[str, _Group] = {}
        self._owner: dict[int, tuple[_Group, _Sample]] = {}
        self._ids = itertools.count()
        #: Groups with something not yet sent as a delta.
        self.dirty: set[str] = set()
        #: Steps run and tokens fed, since the engine was made.
        self.num_steps = 0
        self.num_tokens = 0

    # -- requests -------------------------------------------------------------------------
    def max_new_tokens(self, prompt_len: int, params: SamplingParams) -> int:
        return params.max_tokens if params.max_tokens is not None else self.max_model_len - prompt_len

    def check_request(self, prompt_ids: list[int], params: SamplingParams, what: str = "prompt") -> None:
        """Refuse, before anything runs, a request that can never be served."""
        if len(prompt_ids) == 0:
            raise ValueError(f"generate: {what} is empty; every prompt needs at least one token")
        bad = [t for t in prompt_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"generate: {what} has token ids outside the vocabulary [0, {self.vocab_size}): {bad[:5]}")
        if len(prompt_ids) >= self.max_model_len and params.max_tokens is None:
            raise ValueError(
                f"generate: {what} has {len(prompt_ids)} tokens but max_model_len={self.max_model_len} leaves no room "
                "for a generated token"
            )
        if len(prompt_ids) > self.max_model_len:
            raise ValueError(f"generate: {what} has {len(prompt_ids)} tokens but max_model_len={self.max_model_len}")
        n = self.max_new_tokens(len(prompt_ids), params)
        if len(prompt_ids) + n > self.max_model_len:
            raise ValueError(
                f"generate: {what} ({len(prompt_ids)} tokens) + max_new_tokens={n} exceeds "
                f"max_model_len={self.max_model_len}; shorten it, lower max_new_tokens or raise max_model_len"
            )
        need = -(-(len(prompt_ids) + n) // self.runner.block_size)
        if need > self.runner.num_blocks:
            raise ValueError(
                f"generate: {what} needs {need} KV blocks of {self.runner.block_size} tokens but the cache has "
                f"only {self.runner.num_blocks}; raise num_blocks"
            )
        outside = [t for t in params.stop_token_ids if t >= self.vocab_size]
        if outside:
            raise ValueError(
                f"generate: stop_token_ids {outside[:5]} are outside the vocabulary [0, {self.vocab_size}): the model "
                "can never generate them"
            )
        if params.stop and self.tokenizer is None:
            raise ValueError(
                f"generate: stop strings {list(params.stop)} are matched on text, and this LLM has no tokenizer; "
                "pass stop_token_ids, or a tokenizer"
            )

    def add_request(
        self,
        request_id: str,
        prompt: str | None,
        prompt_ids: list[int],
        params: SamplingParams,
        return_logits: bool = False,
    ) -> None:
        with self.lock:
            if request_id in self._groups:
                raise ValueError(f"generate: request id {request_id!r} is already in use")
            self.check_request(prompt_ids, params)
            group = _Group(request_id, prompt, list(prompt_ids), params)
            if params.prompt_logprobs is not None:
                group.prompt_logprobs = {}
            n_new = self.max_new_tokens(len(prompt_ids), params)
            for i in range(params.n):
                rid = next(self._ids)
                req = Request(rid, list(prompt_ids), n_new, logits=[] if return_logits else None, params=params)
                seed = params.seed + i if params.seed is not None else None
                generator = self.sampler.generator(params if seed is None else _with_seed(params, seed))
                sample = _Sample(
                    req,
                    i,
                    generator,
                    Detokenizer(self.tokenizer, params),
                    [] if params.logprobs is not None else None,
                    0.0 if params.logprobs is not None else None,
                )
                group.samples.append(sample)
                self._owner[rid] = (group, sample)
            self._groups[request_id] = group
            for s in group.samples:
                self.scheduler.add(s.request)

    def abort_request(self, request_id: str) -> None:
        """Stop a request now (a client that went away); its blocks are freed. Unknown or
        finished ids are ignored."""
        with self.lock:
            group = self._groups.get(request_id)
            if group is None:
                return
            for s in group.samples:
                if s.finish_reason is None:
                    s.finish_reason = "abort"
                    self._finish(s)
            self.dirty.add(request_id)

    def release(self, request_id: str) -> None:
        """Forget a request (after its last output was taken); aborts it if still running."""
        with self.lock:
            self.abort_request(request_id)
            group = self._groups.pop(request_id, None)
            self.dirty.discard(request_id)
            for s in group.samples if group else ():
                self._owner.pop(s.request.request_id, None)

    def error(self, request_id: str) -> str | None:
        """Why the request failed in a step (None: it did not)."""
        with self.lock:
            group = self._groups.get(request_id)
            return group.error if group is not None else None

    def is_finished(self, request_id: str) -> bool:
        with self.lock:
            return self._groups[request_id].finished

    def has_unfinished(self) -> bool:
        with self.lock:
            return self.scheduler.has_unfinished()

    def _finish(self, sample: _Sample) -> None:
        self.scheduler.finish(sample.request)

    # -- a step ---------------------------------------------------------------------------
    def step(self) -> int:
        """Run one step (nothing when no request is waiting or running); returns the
        number of requests it scheduled."""
        with self.lock:
            scheduled = self.scheduler.schedule()
            if not scheduled:
                return 0
            requests = [s.request for s in scheduled]
            counts = [s.num_new_tokens for s in scheduled]
            want_rows = []
            for r, n in zip(requests, counts):
                group, sample = self._owner[r.request_id]
                want_rows.append(
                    group.prompt_logprobs is not None
                    and sample.index == 0
                    and r.num_computed_tokens < len(group.prompt_token_ids) - 1
                    and any(
                        p not in group.prompt_logprobs
                        for p in range(r.num_computed_tokens + 1, r.num_computed_tokens + n + 1)
                    )
                )
            try:
                last, rows = self.runner.forward(requests, counts, want_rows)
            except BaseException as e:
                # Nothing is known to be in the cache from this step: fail every request in
                # it rather than continue from a cache this step may have half written.
                for r in requests:
                    self._fail(self._owner[r.request_id][0], e)
                raise
            self.num_steps += 1
            self.num_tokens += sum(counts)
            for i, (r, n) in enumerate(zip(requests, counts)):
                group, sample = self._owner[r.request_id]
                if group.error is not None:
                    continue  # a sample of its group failed earlier in this loop
                try:
                    if i in rows:
                        self._prompt_logprobs(group, r.num_computed_tokens, rows[i])
                    r.num_computed_tokens += n
                    if r.num_computed_tokens == r.num_tokens:
                        self._next_token(group, sample, last[i])
                except Exception as e:
                    # Picking or decoding its token failed (e.g. NaN logits, a tokenizer
                    # refusing an id): only this request fails, named; the others go on.
                    self._fail(group, e)
            return len(scheduled)

    def _fail(self, group: _Group, error: BaseException) -> None:
        """End every sample of ``group`` as "abort", freeing its blocks, with the reason."""
        group.error = group.error or f"{type(error).__name__}: {error}".splitlines()[0]
        for s in group.samples:
            if s.finish_reason is None:
                s.finish_reason = "abort"
                self._finish(s)
        self.dirty.add(group.request_id)

    def _prompt_logprobs(self, group: _Group, start: int, rows: torch.Tensor) -> None:
        """Row j predicts the prompt token at position start + j + 1."""
        prompt, k = group.prompt_token_ids, group.params.prompt_logprobs
        for j in range(rows.shape[0]):
            p = start + j + 1
            if p < len(prompt) and p not in group.prompt_logprobs:
                group.prompt_logprobs[p] = self._logprob_dict(rows[j], prompt[p], k)

    def _logprob_dict(self, row: torch.Tensor, token: int, k: int) -> dict[int, Logprob]:
        return {
            t: Logprob(lp, rank, decode(self.tokenizer, [t], False) if self.tokenizer is not None else None)
            for t, (lp, rank) in self.sampler.logprobs(row, token, k).items()
        }

    def _next_token(self, group: _Group, sample: _Sample, row: torch.Tensor) -> None:
        r, params = sample.request, group.params
        token = self.sampler.pick(row, params, sample.generator, r.prompt_token_ids, r.output_token_ids)
        r.output_token_ids.append(token)
        if r.logits is not None:
            r.logits.append(row.clone())
        if sample.logprobs is not None:
            entry = self._logprob_dict(row, token, params.logprobs)
            sample.logprobs.append(entry)
            sample.cumulative_logprob += entry[token].logprob
        out = r.output_token_ids
        reason = stop = None
        if self.sampler.is_stop_token(token, params):
            reason, stop = "stop", token if token in params.stop_token_ids else None
            r.stopped = True
        matched = sample.detokenizer.update(out, check_stop=reason is None and len(out) >= params.min_tokens)
        if matched is not None:
            reason, stop = "stop", matched
            r.stopped = True
        if reason is None and len(out) >= r.max_new_tokens:
            reason = "length"
        if reason is not None:
            sample.finish_reason, sample.stop_reason = reason, stop
            self._finish(sample)
        self.dirty.add(group.request_id)

    # -- outputs --------------------------------------------------------------------------
    def output(self, request_id: str, delta: bool = False) -> RequestOutput:
        """The request's output: everything so far, or (``delta``) only what is new since
        the last delta, with ``finished`` set on the last."""
        with self.lock:
            group = self._groups[request_id]
            self.dirty.discard(request_id)
            outputs = []
            for s in group.samples:
                done = s.finish_reason is not None
                if delta and s.final_sent:
                    continue
                if delta and done:
                    s.final_sent = True
                text = s.detokenizer.text if not delta else s.detokenizer.delta(done)
                start = s.sent if delta else 0
                tokens = s.request.output_token_ids[start:]
                logprobs = s.logprobs[start:] if s.logprobs is not None else None
                if delta:
                    s.sent = len(s.request.output_token_ids)
                outputs.append(
                    CompletionOutput(
                        s.index, text, list(tokens), s.cumulative_logprob, logprobs, s.finish_reason, s.stop_reason
                    )
                )
            prompt_logprobs = None
            if group.prompt_logprobs is not None and not (delta and group.prompt_logprobs_sent):
                n = len(group.prompt_token_ids)
                if len(group.prompt_logprobs) == n - 1:  # complete
                    prompt_logprobs = [None] + [group.prompt_logprobs[p] for p in range(1, n)]
                    group.prompt_logprobs_sent = group.prompt_logprobs_sent or delta
            return RequestOutput(
                group.request_id, group.prompt, list(group.prompt_token_ids), prompt_logprobs, outputs, group.finished
            )

    def logits(self, request_id: str) -> list[list[torch.Tensor] | None]:
        """Per sample, the logits row of every generated token (``return_logits``)."""
        with self.lock:
            return [s.request.logits for s in self._groups[request_id].samples]


def _with_seed(params: SamplingParams, seed: int) -> SamplingParams:
    import dataclasses

    return dataclasses.replace(params, seed=seed - 2**64 if seed >= 2**64 else seed)
