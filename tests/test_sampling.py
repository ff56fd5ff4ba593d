"""Text in and out, tokenizers from local model directories, and SamplingParams
(issue 13): validation, greedy equivalence, stopping, and seeded reproducibility that
does not depend on the batch."""

from __future__ import annotations

import pytest
import torch

from qaic_dynamo import LLM, SamplingParams
from qaic_dynamo.engine.sampling import Sampler
from qaic_dynamo.errors import SamplingParamsError
from qaic_dynamo.models import hf_model_from_config

WORDS = [f"w{i}" for i in range(200)]


def tiny_tokenizer():
    """A word-level tokenizer built with the ``tokenizers`` library (nothing downloaded)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{w: i + 3 for i, w in enumerate(WORDS)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")


def hf_llama(layers: int = 2, eos: int = 2):
    from transformers import LlamaConfig

    return hf_model_from_config(
        LlamaConfig(
            num_hidden_layers=layers,
            vocab_size=256,
            hidden_size=64,
            intermediate_size=128,
            num_attention_heads=4,
            num_key_value_heads=2,
            eos_token_id=eos,
            bos_token_id=1,
        )
    )


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny-llama")
    hf_llama().save_pretrained(d)
    tiny_tokenizer().save_pretrained(d)
    return d


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(max_tokens=0), r"max_tokens must be an int >= 1, or None \(up to max_model_len\), got 0"),
        (dict(temperature=-0.5), r"temperature must be a finite number >= 0 \(0 = greedy\)"),
        # a uniform draw over the whole vocabulary, past top_k
        (dict(temperature=float("inf"), top_k=2), r"temperature must be a finite number >= 0 \(0 = greedy\), got inf"),
        (dict(top_k=-2), r"top_k must be an int >= 1, or 0 / -1 for all tokens"),
        (dict(top_p=0.0), r"top_p must be a number in \(0, 1\]"),
        (dict(top_p=1.5), r"top_p must be a number in \(0, 1\]"),
        (dict(seed="7"), r"seed must be an int in \[-2\*\*63, 2\*\*64\) \(torch.Generator's range\) or None"),
        (dict(seed=2**64), r"seed must be an int in \[-2\*\*63, 2\*\*64\)"),  # generate() overflowed
        (dict(stop_token_ids=[1, -3]), r"stop_token_ids must be a sequence of token ids"),
        (dict(stop_token_ids=5), r"stop_token_ids must be a sequence of token ids \(ints >= 0\) or None, got 5"),
        (dict(ignore_eos="no"), r"ignore_eos must be a bool"),
    ],
)
def test_invalid_sampling_params_are_refused_with_the_valid_range(kwargs, message):
    with pytest.raises(SamplingParamsError, match=message):
        SamplingParams(**kwargs)


def test_sampling_params_take_what_vllm_callers_pass():
    """A generator of stop ids was used up by validation and stored empty (the stop was
    lost); None (vLLM's default) raised a bare TypeError; numpy ints were refused."""
    import numpy as np

    assert SamplingParams(stop_token_ids=(t for t in [3, 4])).stop_token_ids == (3, 4)
    assert SamplingParams(stop_token_ids=None).stop_token_ids == ()
    p = SamplingParams(stop_token_ids=[np.int64(5)], seed=np.int64(7))
    assert p.stop_token_ids == (5,) and p.seed == 7 and type(p.seed) is int


def test_a_tiny_temperature_is_greedy():
    """Dividing by 1e-40 overflowed the logits and multinomial raised; below 1e-5 vLLM
    samples greedily."""
    logits = torch.tensor([0.5, 3.0, -1.0])
    assert Sampler().pick(logits, SamplingParams(temperature=1e-40), torch.Generator().manual_seed(0)) == 1


def test_top_k_and_top_p_keep_only_the_likely_tokens():
    logits = torch.tensor([4.0, 3.0, 2.0, -1.0, -2.0])
    g = torch.Generator().manual_seed(0)
    assert {Sampler().pick(logits, SamplingParams(top_k=2), g) for _ in range(200)} == {0, 1}
    # softmax: 0.66, 0.24, 0.09, ...: top_p=0.8 keeps the first two
    assert {Sampler().pick(logits, SamplingParams(top_p=0.8), g) for _ in range(200)} == {0, 1}
    assert {Sampler().pick(logits, SamplingParams(top_p=0.5), g) for _ in range(50)} == {0}
    assert Sampler().pick(logits, SamplingParams(temperature=0), g) == 0


def test_text_in_text_out_with_a_local_tokenizer(model_dir):
    llm = LLM(str(model_dir), backend="eager", max_model_len=64)
    assert llm.tokenizer is not None
    out = llm.generate(["w1 w2 w3", "w7"], SamplingParams(max_tokens=5, temperature=0, ignore_eos=True))
    ids = [llm.tokenizer.encode("w1 w2 w3"), llm.tokenizer.encode("w7")]
    assert [o.prompt_token_ids for o in out] == ids and [o.prompt for o in out] == ["w1 w2 w3", "w7"]
    assert [o.outputs[0].token_ids for o in out] == llm.generate(ids, 5)  # greedy, as token-id prompts
    for o in out:
        c = o.outputs[0]
        assert c.text == llm.tokenizer.decode(c.token_ids, skip_special_tokens=True) and isinstance(c.text, str)
        assert c.finish_reason == "length"
    # One string alone is one prompt (as vLLM takes it), not one prompt per character.
    (alone,) = llm.generate("w1 w2 w3", SamplingParams(max_tokens=5, temperature=0, ignore_eos=True))
    assert alone.prompt_token_ids == ids[0] and alone.outputs[0].token_ids == out[0].outputs[0].token_ids


def test_a_text_prompt_without_a_tokenizer_says_how_to_fix_it():
    llm = LLM(hf_llama(), backend="eager", max_model_len=64)
    with pytest.raises(
        ValueError,
        match=r"prompt 0 is text but this LLM has no tokenizer; pass token ids, or "
        r"LLM\(model, tokenizer=\.\.\.\)",
    ):
        llm.generate(["hello"], SamplingParams(max_tokens=2))


def test_generation_stops_at_eos_unless_ignore_eos_and_at_stop_tokens():
    model = hf_llama()
    llm = LLM(model, backend="eager", max_model_len=64)
    prompt = [5, 6, 7]
    free = llm.generate([prompt], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))[0].outputs[0].token_ids
    stop = free[3]
    cut = llm.generate([prompt], SamplingParams(max_tokens=12, temperature=0, stop_token_ids=[stop]))[0].outputs[0]
    assert cut.token_ids == free[: free.index(stop) + 1] and cut.finish_reason == "stop" and cut.stop_reason == stop
    # EOS: make the model's EOS the token it would generate, and generation stops there.
    llm_eos = LLM(hf_llama(eos=free[2]), backend="eager", max_model_len=64)
    out = llm_eos.generate([prompt], SamplingParams(max_tokens=12, temperature=0))[0].outputs[0]
    assert out.token_ids == free[: free.index(free[2]) + 1] and out.finish_reason == "stop" and out.stop_reason is None
    ignoring = llm_eos.generate([prompt], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    assert ignoring[0].outputs[0].token_ids == free


def test_the_tokenizers_eos_stops_too():
    """A checkpoint whose config and tokenizer name different EOS ids: the tokenizer's
    was only a fallback, so generation ran past it to max_tokens (vLLM stops at both)."""
    llm = LLM(hf_llama(eos=7), backend="eager", max_model_len=64, tokenizer=tiny_tokenizer())  # tokenizer EOS: 2
    assert llm.sampler.is_stop_token(2, SamplingParams()) and llm.sampler.is_stop_token(7, SamplingParams())
    assert not llm.sampler.is_stop_token(2, SamplingParams(ignore_eos=True))


class PlainTokenizer:
    """Only encode/decode, as the LLM docstring allows: no skip_special_tokens."""

    def encode(self, text):
        return [ord(c) % 256 for c in text]

    def decode(self, ids):
        return "".join(chr(i) for i in ids)


def test_a_tokenizer_with_a_plain_decode_works():
    llm = LLM(hf_llama(), backend="eager", max_model_len=64, tokenizer=PlainTokenizer())
    (out,) = llm.generate(["hi"], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
    assert out.prompt_token_ids == [104, 105]
    assert out.outputs[0].text == "".join(chr(i) for i in out.outputs[0].token_ids)


def test_max_model_len_is_bounded_by_the_models_positions():
    """vLLM refuses a max_model_len past max_position_embeddings; the engine generated up
    to any position without a word."""
    from transformers import LlamaConfig

    model = hf_model_from_config(
        LlamaConfig(
            num_hidden_layers=1,
            vocab_size=256,
            hidden_size=64,
            intermediate_size=128,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=16,
        )
    )
    with pytest.raises(
        ValueError,
        match=r"max_model_len=64 exceeds the model's max_position_embeddings=16; "
        r"pass max_model_len <= 16",
    ):
        LLM(model, backend="eager", max_model_len=64)
    assert LLM(model, backend="eager").max_model_len == 16  # the default (512) is capped
    assert LLM(hf_llama(), backend="eager").max_model_len == 512


@pytest.mark.parametrize("backend", ["eager", "qaic"])
def test_seeded_sampling_is_reproducible_and_independent_of_the_batch(backend):
    llm = LLM(hf_llama(), backend=backend, max_model_len=64, max_num_seqs=4)
    params = SamplingParams(max_tokens=10, temperature=1.3, top_k=50, top_p=0.95, seed=1234, ignore_eos=True)
    alone = llm.generate([[9, 8, 7]], params)[0].outputs[0].token_ids
    others = SamplingParams(max_tokens=4, temperature=0.7, ignore_eos=True)
    batch = llm.generate([[1, 2], [9, 8, 7], [3, 4, 5, 6, 7]], [others, params, others])
    assert batch[1].outputs[0].token_ids == alone
    assert llm.generate([[9, 8, 7]], params)[0].outputs[0].token_ids == alone
    different = llm.generate([[9, 8, 7]], SamplingParams(max_tokens=10, temperature=1.3, seed=99, ignore_eos=True))
    assert different[0].outputs[0].token_ids != alone  # the seed matters (10 tokens from a 256-token vocabulary)
