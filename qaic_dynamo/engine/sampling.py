"""Sampling: ``SamplingParams`` (vLLM's names and meanings) and the per-request sampler.

    from qaic_dynamo import LLM, SamplingParams
    llm.generate(["a prompt"], SamplingParams(max_tokens=32, temperature=0.8, top_p=0.9, seed=7))

``temperature=0`` is greedy. A request with a ``seed`` draws from a generator of its own,
seeded once, so its tokens do not depend on what else is in the batch or on the order
requests finish; requests without one share the engine's generator. Generation stops at
``max_tokens``, at any of ``stop_token_ids``, and at the model's EOS token unless
``ignore_eos``; the stop token is the last of ``token_ids``. Stop strings are matched on
the detokenized text (:mod:`.detokenizer`).

Before a token is picked, as vLLM does: ``repetition_penalty`` divides the positive
logits (multiplies the negative ones) of every token in the prompt or the output;
``frequency_penalty`` subtracts ``count * penalty`` and ``presence_penalty`` subtracts the
penalty from every token in the output; until ``min_tokens`` are generated, EOS and the
stop tokens cannot be picked. Logprobs are those of the model's raw logits (vLLM's
default ``raw_logprobs``).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from qaic_dynamo.errors import SamplingParamsError

__all__ = ["SamplingParams", "Sampler", "is_seed", "is_token_id"]

#: Largest ``logprobs`` / ``prompt_logprobs`` (vLLM's default ``max_logprobs``).
MAX_LOGPROBS = 20


@dataclass(frozen=True)
class SamplingParams:
    """How to pick each next token (vLLM's ``SamplingParams`` names, same meanings)."""

    #: Samples to generate for the prompt (each a ``CompletionOutput``; with a ``seed``,
    #: sample i draws from ``seed + i``).
    n: int = 1
    #: Tokens to generate at most (>= 1); None: until the sequence reaches ``max_model_len``.
    max_tokens: int | None = 16
    #: Tokens to generate before EOS, a stop token or a stop string may end the request.
    min_tokens: int = 0
    #: Softmax temperature (>= 0); 0 (or below 1e-5, as in vLLM) picks the most likely token (greedy).
    temperature: float = 1.0
    #: Keep only the k most likely tokens (>= 1); 0 or -1 keeps all.
    top_k: int = 0
    #: Keep the smallest set of most likely tokens whose probability reaches top_p, in (0, 1].
    top_p: float = 1.0
    #: Seed of this request's own generator (reproducible whatever the batch); None: shared.
    seed: int | None = None
    #: Token ids that end generation (the stop token is kept as the last token); None: none.
    stop_token_ids: Sequence[int] = field(default_factory=tuple)
    #: Keep generating past the model's EOS token.
    ignore_eos: bool = False
    #: Strings that end generation when the text produces them; the text is cut before
    #: the string unless ``include_stop_str_in_output``. None: none.
    stop: str | Sequence[str] | None = None
    include_stop_str_in_output: bool = False
    #: Subtracted from the logit of every token already in the output, in [-2, 2].
    presence_penalty: float = 0.0
    #: Subtracted, times its count, from the logit of every token in the output, in [-2, 2].
    frequency_penalty: float = 0.0
    #: > 0; above 1 discourages every token of the prompt and the output (CTRL's penalty).
    repetition_penalty: float = 1.0
    #: Return the logprob of each generated token and the top ``logprobs`` (0: only the
    #: sampled one); None: none.
    logprobs: int | None = None
    #: The same for every prompt token; None: none.
    prompt_logprobs: int | None = None
    #: Leave special tokens (EOS, ...) out of the text.
    skip_special_tokens: bool = True

    def __post_init__(self) -> None:
        def bad(name: str, valid: str) -> SamplingParamsError:
            return SamplingParamsError(f"SamplingParams: {name} must be {valid}, got {getattr(self, name)!r}")

        def is_int(v: Any) -> bool:
            return isinstance(v, int) and not isinstance(v, bool)

        def is_number(v: Any) -> bool:
            return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)

        if not is_int(self.n) or self.n < 1:
            raise bad("n", "an int >= 1")
        if self.max_tokens is not None and (not is_int(self.max_tokens) or self.max_tokens < 1):
            raise bad("max_tokens", "an int >= 1, or None (up to max_model_len)")
        if not is_int(self.min_tokens) or self.min_tokens < 0:
            raise bad("min_tokens", "an int >= 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise SamplingParamsError(
                f"SamplingParams: min_tokens ({self.min_tokens}) must be at most max_tokens ({self.max_tokens})"
            )
        for name in ("presence_penalty", "frequency_penalty"):
            if not is_number(getattr(self, name)) or not -2 <= getattr(self, name) <= 2:
                raise bad(name, "a number in [-2, 2]")
        if not is_number(self.repetition_penalty) or self.repetition_penalty <= 0:
            raise bad("repetition_penalty", "a number > 0 (1 = no penalty)")
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            if v is not None and (not is_int(v) or not 0 <= v <= MAX_LOGPROBS):
                raise bad(name, f"None or an int in [0, {MAX_LOGPROBS}]")
        stop = () if self.stop is None else (self.stop,) if isinstance(self.stop, str) else self.stop
        if not isinstance(stop, Iterable) or isinstance(stop, bytes):
            raise bad("stop", "a string, a list of strings or None")
        stop = tuple(stop)
        if not all(isinstance(x, str) and x for x in stop):
            raise bad("stop", "a string, a list of non-empty strings or None")
        object.__setattr__(self, "stop", stop)
        for name in ("include_stop_str_in_output", "skip_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise bad(name, "a bool")
        # Not inf: every finite logit would divide to 0, a uniform draw past top_k / top_p.
        if (
            not isinstance(self.temperature, (int, float))
            or isinstance(self.temperature, bool)
            or not 0 <= self.temperature < math.inf
        ):
            raise bad("temperature", "a finite number >= 0 (0 = greedy)")
        if not isinstance(self.top_k, int) or isinstance(self.top_k, bool) or self.top_k < -1:
            raise bad("top_k", "an int >= 1, or 0 / -1 for all tokens")
        if not isinstance(self.top_p, (int, float)) or isinstance(self.top_p, bool) or not 0 < self.top_p <= 1:
            raise bad("top_p", "a number in (0, 1]")
        if self.seed is not None:
            if not is_seed(self.seed):
                raise bad("seed", f"{SEED_RANGE} or None")
            object.__setattr__(self, "seed", int(self.seed))
        # Materialised first: a generator would be used up by the check and stored empty.
        stops = () if self.stop_token_ids is None else self.stop_token_ids
        if isinstance(stops, (str, bytes)) or not isinstance(stops, Iterable):
            raise bad("stop_token_ids", "a sequence of token ids (ints >= 0) or None")
        stops = tuple(stops)
        if not all(is_token_id(t) and int(t) >= 0 for t in stops):
            raise bad("stop_token_ids", "a sequence of token ids (ints >= 0) or None")
        if not isinstance(self.ignore_eos, bool):
            raise bad("ignore_eos", "a bool")
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in stops))


SEED_RANGE = "an int in [-2**63, 2**64) (torch.Generator's range)"


def is_seed(v: Any) -> bool:
    """An int (Python or numpy, not a bool) that ``torch.Generator.manual_seed`` takes."""
    return is_token_id(v) and -(2**63) <= int(v) < 2**64


def is_token_id(t: Any) -> bool:
    """An integer (Python, numpy or a 0-d integer tensor), not a bool: a token id, a
    stop id or a seed."""
    if isinstance(t, torch.Tensor):
        return t.dim() == 0 and not t.dtype.is_floating_point and not t.dtype.is_complex and t.dtype != torch.bool
    if isinstance(t, np.ndarray):  # has __index__ whatever its dtype
        return t.ndim == 0 and t.dtype.kind in "iu"
    return hasattr(t, "__index__") and not isinstance(t, (bool, str, bytes)) and type(t).__name__ != "bool_"


#: Below this a temperature is greedy, as in vLLM (dividing by it overflows the logits).
MIN_TEMPERATURE = 1e-5


class Sampler:
    """Picks next tokens for one request at a time, from its logits row (see the module
    docstring for the order of penalties)."""

    def __init__(self, eos_token_ids: Sequence[int] = (), seed: int = 0) -> None:
        self.eos = frozenset(eos_token_ids)
        self.shared = torch.Generator().manual_seed(seed)

    def generator(self, params: SamplingParams) -> torch.Generator:
        """The generator a request draws from: its own when it has a seed."""
        return torch.Generator().manual_seed(params.seed) if params.seed is not None else self.shared

    def pick(
        self,
        logits: torch.Tensor,
        params: SamplingParams,
        generator: torch.Generator,
        prompt_ids: Sequence[int] = (),
        output_ids: Sequence[int] = (),
    ) -> int:
        """The next token of a request with ``prompt_ids`` and ``output_ids`` so far."""
        logits = self.processed(logits, params, prompt_ids, output_ids)
        if params.temperature < MIN_TEMPERATURE:
            return int(logits.argmax())
        scores = logits.float() / params.temperature
        if params.top_k > 0 and params.top_k < scores.numel():
            kth = torch.topk(scores, params.top_k).values[-1]
            scores = scores.masked_fill(scores < kth, float("-inf"))
        if params.top_p < 1:
            sorted_scores, order = torch.sort(scores, descending=True)
            probs = torch.softmax(sorted_scores, dim=-1)
            # Drop a token once the ones before it already reach top_p (the first always stays).
            drop = probs.cumsum(-1) - probs >= params.top_p
            scores = scores.scatter(0, order[drop], float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        return int(torch.multinomial(probs, 1, generator=generator))

    def processed(
        self, logits: torch.Tensor, params: SamplingParams, prompt_ids: Sequence[int], output_ids: Sequence[int]
    ) -> torch.Tensor:
        """``logits`` after the penalties and ``min_tokens`` (a new tensor when any applies)."""
        penalised = params.repetition_penalty != 1 or params.presence_penalty or params.frequency_penalty
        early = len(output_ids) < params.min_tokens
        if not penalised and not early:
            return logits
        logits = logits.float().clone()
        if params.repetition_penalty != 1 and (prompt_ids or output_ids):
            seen = torch.tensor(sorted(set(prompt_ids) | set(output_ids)), dtype=torch.long)
            v = logits[seen]
            logits[seen] = torch.where(v > 0, v / params.repetition_penalty, v * params.repetition_penalty)
        if (params.presence_penalty or params.frequency_penalty) and output_ids:
            counts = torch.bincount(torch.tensor(list(output_ids), dtype=torch.long), minlength=logits.numel())
            logits -= params.frequency_penalty * counts[: logits.numel()].float()
            logits -= params.presence_penalty * (counts[: logits.numel()] > 0).float()
        if early:
            banned = set(params.stop_token_ids) | (set() if params.ignore_eos else set(self.eos))
            banned = [t for t in banned if t < logits.numel()]
            if banned:
                logits[torch.tensor(banned, dtype=torch.long)] = float("-inf")
        return logits

    @staticmethod
    def logprobs(logits: torch.Tensor, token: int, top: int) -> dict[int, tuple[float, int]]:
        """The logprob and rank (1 = most likely) of ``token`` and of the ``top`` most likely
        tokens, from the raw ``logits`` row: token id -> (logprob, rank)."""
        lp = torch.log_softmax(logits.float(), dim=-1)
        out = {}
        if top:
            values, ids = torch.topk(lp, min(top, lp.numel()))
            out = {int(i): (float(v), k + 1) for k, (v, i) in enumerate(zip(values, ids))}
        if token not in out:
            out[token] = (float(lp[token]), int((lp > lp[token]).sum()) + 1)
        return out

    def is_stop_token(self, token: int, params: SamplingParams) -> bool:
        """Whether ``token`` ends its request (a stop token, or EOS unless ``ignore_eos``)."""
        return token in params.stop_token_ids or (not params.ignore_eos and token in self.eos)
