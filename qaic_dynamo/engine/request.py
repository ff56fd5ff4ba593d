"""What the engine tracks per request between steps, and how prompts are given."""

from __future__ import annotations

import numbers
from dataclasses import dataclass, field
from typing import Any

import torch

from qaic_dynamo.engine.sampling import is_token_id

__all__ = ["Request", "prompt_list"]


@dataclass
class Request:
    """One sequence as the engine tracks it between steps.

    ``num_computed_tokens`` of its tokens (prompt, then output) have their K/V in the cache,
    in the slots of ``block_ids``; the next :meth:`LLM.execute_model` feeds the rest. A new
    request has none computed (its prefill feeds the whole prompt); after each step the
    caller appends the chosen token and sets ``num_computed_tokens`` to the number of
    tokens fed so far, so a decode step feeds that one token.
    """

    request_id: int
    prompt_token_ids: list[int]
    max_new_tokens: int
    output_token_ids: list[int] = field(default_factory=list)
    block_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    #: The logits row of every generated token, when the caller keeps them.
    logits: list[torch.Tensor] | None = None
    #: How to pick its tokens (None: greedy, exactly max_new_tokens).
    params: Any = None
    #: Set when a stop token (or EOS) ended it before max_new_tokens.
    stopped: bool = False
    #: Times the scheduler preempted it (each recomputes its KV from all its tokens).
    num_preemptions: int = 0

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def max_num_tokens(self) -> int:
        """Its length when finished: what its blocks are reserved for."""
        return len(self.prompt_token_ids) + self.max_new_tokens

    @property
    def is_finished(self) -> bool:
        return self.stopped or len(self.output_token_ids) >= self.max_new_tokens


def prompt_list(prompts: Any) -> list[Any]:
    """``generate``'s prompts as a list: a single prompt - one string, or one flat list of
    token ids (as vLLM takes them) - becomes a list of one; tensors and arrays become lists."""
    if hasattr(prompts, "tolist") and not isinstance(prompts, (str, list, tuple)):
        prompts = prompts.tolist()
    if isinstance(prompts, str):
        return [prompts]
    if not isinstance(prompts, (list, tuple)):
        raise TypeError(
            f"generate: prompts must be a list of prompts (token-id lists or strings), got {type(prompts).__name__}"
        )
    prompts = [p.tolist() if hasattr(p, "tolist") and not isinstance(p, (str, list, tuple)) else p for p in prompts]
    # Scalars of any kind make one flat prompt, so that a bool or float among its ids is
    # refused by name (as in a nested prompt), not as "prompt 0 is an int".
    if prompts and all(is_token_id(t) or isinstance(t, numbers.Number) or type(t).__name__ == "bool_" for t in prompts):
        return [list(prompts)]
    return prompts
