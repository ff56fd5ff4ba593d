"""What ``generate`` and ``stream`` return: vLLM's output types.

``RequestOutput`` holds one prompt and its ``outputs``, one ``CompletionOutput`` per
sample (``SamplingParams.n``), with vLLM's field names and meanings. While streaming, each
``RequestOutput`` carries only what is new since the last one (vLLM's ``DELTA`` output
kind): the new token ids, text and logprobs, and ``finished`` on the last.

``GreedyOutput`` is what ``LLM.generate_outputs`` returns: greedy token ids and, when
asked, the logits each was chosen from (for comparing backends).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

__all__ = ["CompletionOutput", "GreedyOutput", "Logprob", "RequestOutput"]


@dataclass
class Logprob:
    """One token's log-probability, its rank among the vocabulary (1 = most likely), and
    its text when the engine has a tokenizer."""

    logprob: float
    rank: int
    decoded_token: str | None = None


#: Per position, the sampled (or prompt) token and the top-k: token id -> Logprob.
SampleLogprobs = list[dict[int, Logprob]]
#: As ``SampleLogprobs``, with None for the first prompt token (nothing precedes it).
PromptLogprobs = list[dict[int, Logprob] | None]


@dataclass
class CompletionOutput:
    """One sample of a request."""

    #: Which of the request's ``n`` samples this is.
    index: int
    #: The generated text (special tokens skipped; a matched stop string cut off unless
    #: ``include_stop_str_in_output``); "" without a tokenizer.
    text: str
    token_ids: list[int] = field(default_factory=list)
    #: Sum of the sampled tokens' logprobs; None unless ``logprobs`` was requested.
    cumulative_logprob: float | None = None
    #: Per generated token, its logprob and the top ``logprobs``; None unless requested.
    logprobs: SampleLogprobs | None = None
    #: "length" (max_tokens or max_model_len reached), "stop" (EOS, a stop token or a
    #: stop string), "abort"; None while running.
    finish_reason: str | None = None
    #: The stop string or stop token id that ended it; None for EOS and "length".
    stop_reason: int | str | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """One request's prompt and samples (vLLM's ``RequestOutput``)."""

    request_id: str
    #: The prompt as given when it was text, else None.
    prompt: str | None
    prompt_token_ids: list[int]
    #: Per prompt token, its logprob given the tokens before it (None for the first);
    #: None unless ``prompt_logprobs`` was requested.
    prompt_logprobs: PromptLogprobs | None
    outputs: list[CompletionOutput]
    #: Every sample has finished.
    finished: bool


@dataclass
class GreedyOutput:
    """A greedy run of one prompt: its token ids and, with ``return_logits``, the logits
    row of every generated token."""

    prompt_token_ids: list[int]
    token_ids: list[int]
    logits: list[torch.Tensor] | None = None
