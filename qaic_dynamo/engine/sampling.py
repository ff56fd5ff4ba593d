"""Sampling: ``SamplingParams`` (vLLM's names and meanings) and the per-request sampler.

    from qaic_dynamo import LLM, SamplingParams
    llm.generate(["a prompt"], SamplingParams(max_tokens=32, temperature=0.8, top_p=0.9, seed=7))

``temperature=0`` is greedy. A request with a ``seed`` draws from a generator of its own,
seeded once, so its tokens do not depend on what else is in the batch or on the order
requests finish; requests without one share the engine's generator. Generation stops at
``max_tokens``, at any of ``stop_token_ids``, and at the model's EOS token unless
``ignore_eos``; the stop token is the last of ``token_ids``.
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


@dataclass(frozen=True)
class SamplingParams:
    """How to pick each next token (vLLM's ``SamplingParams`` names, same meanings)."""

    #: Tokens to generate at most (>= 1).
    max_tokens: int = 16
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

    def __post_init__(self) -> None:
        def bad(name: str, valid: str) -> SamplingParamsError:
            return SamplingParamsError(f"SamplingParams: {name} must be {valid}, got {getattr(self, name)!r}")

        if not isinstance(self.max_tokens, int) or isinstance(self.max_tokens, bool) or self.max_tokens < 1:
            raise bad("max_tokens", "an int >= 1")
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
    """Picks next tokens for one request at a time, from its logits row."""

    def __init__(self, eos_token_ids: Sequence[int] = (), seed: int = 0) -> None:
        self.eos = frozenset(eos_token_ids)
        self.shared = torch.Generator().manual_seed(seed)

    def generator(self, params: SamplingParams) -> torch.Generator:
        """The generator a request draws from: its own when it has a seed."""
        return torch.Generator().manual_seed(params.seed) if params.seed is not None else self.shared

    @staticmethod
    def pick(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator) -> int:
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

    def is_stop_token(self, token: int, params: SamplingParams) -> bool:
        """Whether ``token`` ends its request (a stop token, or EOS unless ``ignore_eos``)."""
        return token in params.stop_token_ids or (not params.ignore_eos and token in self.eos)
