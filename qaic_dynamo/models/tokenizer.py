"""A byte-level tokenizer for the built-in models, which come without one.

Built with the ``tokenizers`` library (nothing is downloaded): ids 0, 1 and 2 are
``<unk>``, ``<s>`` and ``</s>`` (transformers' Llama defaults for BOS and EOS), the next
256 are the bytes, so any text round-trips, and every id above that decodes to a
placeholder ``<wN>``, so every id a model of ``vocab_size`` tokens can produce has a text.
A one-line chat template makes ``/v1/chat/completions`` work.
"""

from __future__ import annotations

from typing import Any

__all__ = ["CHAT_TEMPLATE", "byte_tokenizer"]

CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
_SPECIALS = ("<unk>", "<s>", "</s>")


def byte_tokenizer(vocab_size: int) -> Any:
    """A ``PreTrainedTokenizerFast`` over ``vocab_size`` ids (at least 259)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    if vocab_size < len(_SPECIALS) + len(alphabet):
        raise ValueError(f"byte_tokenizer: vocab_size must be at least {len(_SPECIALS) + len(alphabet)}")
    vocab = {tok: i for i, tok in enumerate(_SPECIALS)}
    vocab.update({ch: len(_SPECIALS) + i for i, ch in enumerate(alphabet)})
    # Placeholders of byte-level characters only (printable ASCII maps to itself), so the
    # byte-level decoder turns each back into its own text.
    vocab.update({f"<w{i}>": i for i in range(len(vocab), vocab_size)})
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    fast.chat_template = CHAT_TEMPLATE
    return fast
