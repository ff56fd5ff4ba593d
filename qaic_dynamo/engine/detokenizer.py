"""Incremental detokenization and stop strings.

Each step the request's output is decoded again (outputs are short next to the cost of a
step), and a stop string is looked for only where the new text could complete one. A
match ends the request: the text is cut before the string (or after it with
``include_stop_str_in_output``), and the token ids stay as generated, up to the token
that completed it, as vLLM does.

Streaming sends only text that cannot change. Text is decoded without transformers'
clean-up of spaces, which rewrites earlier text as later tokens arrive. A trailing U+FFFD
(a character whose bytes are not all generated yet) is held back, and so are the last
``len(longest stop) - 1`` characters while a stop string could still start there and be
cut away. A non-streaming response takes the final text, not the sum of the deltas.
"""

from __future__ import annotations

from typing import Any

from qaic_dynamo.engine.sampling import SamplingParams

__all__ = ["Detokenizer", "decode"]


def decode(tokenizer: Any, token_ids: list[int], skip_special_tokens: bool = True) -> str:
    """Text of ``token_ids``, without transformers' clean-up of spaces (which rewrites
    earlier text as later tokens arrive, e.g. "Hello ." -> "Hello."); a tokenizer with a
    plain ``decode(ids)`` is accepted too."""
    try:
        return tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens, clean_up_tokenization_spaces=False)
    except TypeError as e:
        if "skip_special_tokens" not in str(e) and "clean_up_tokenization_spaces" not in str(e):
            raise
        return tokenizer.decode(token_ids)


class Detokenizer:
    """One sample's text as its tokens arrive."""

    def __init__(self, tokenizer: Any, params: SamplingParams) -> None:
        self.tokenizer = tokenizer
        self.params = params
        self.text = ""
        self.sent = 0  # characters of ``text`` already streamed
        self.longest_stop = max((len(s) for s in params.stop), default=0)

    def update(self, token_ids: list[int], check_stop: bool) -> str | None:
        """Decode ``token_ids`` (the whole output so far); returns the stop string it
        completed, if ``check_stop`` and one did (the text is cut accordingly)."""
        if self.tokenizer is None:
            return None
        before = len(self.text)
        self.text = decode(self.tokenizer, token_ids, self.params.skip_special_tokens)
        if not check_stop or not self.params.stop:
            return None
        # Each string only where the new text could have completed it.
        before = min(before, len(self.text))
        hits = [(i, s) for s in self.params.stop if (i := self.text.find(s, max(0, before - len(s) + 1))) >= 0]
        if not hits:
            return None
        i, s = min(hits)
        self.text = self.text[: i + len(s)] if self.params.include_stop_str_in_output else self.text[:i]
        return s

    def delta(self, finished: bool) -> str:
        """The text not yet streamed that can no longer change."""
        end = len(self.text)
        if not finished:
            while end > self.sent and self.text[end - 1] == "\ufffd":
                end -= 1
            if self.params.stop and not self.params.include_stop_str_in_output:
                end = max(self.sent, min(end, len(self.text) - self.longest_stop + 1))
        out = self.text[self.sent : end] if end > self.sent else ""
        self.sent = max(self.sent, end)
        return out
