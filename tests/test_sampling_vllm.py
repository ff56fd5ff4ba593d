"""vLLM's sampling options (issue 38): penalties, min_tokens, stop strings, logprobs and
prompt logprobs, each against a plain PyTorch loop over transformers' own forward."""

from __future__ import annotations

import pytest
import torch
from test_sampling import hf_llama, tiny_tokenizer

from qaic_dynamo import LLM, SamplingParams
from qaic_dynamo.errors import SamplingParamsError

PROMPT = [5, 6, 7, 5, 9]
#: A prompt this model answers with a few tokens over and over: what the penalties act on.
REPEATING = [1, 2, 3]


@pytest.fixture(scope="module")
def hf():
    return hf_llama()


def reference(hf, prompt: list[int], params: SamplingParams, eos: tuple[int, ...] = ()) -> list[int]:
    """Greedy decoding by hand: the whole sequence through transformers each step, then
    vLLM's penalties (repetition on prompt and output, frequency and presence on the
    output) and min_tokens, then argmax."""
    out: list[int] = []
    while len(out) < params.max_tokens:
        with torch.no_grad():
            logits = hf(torch.tensor([prompt + out])).logits[0, -1].float()
        seen = set(prompt) | set(out)
        for t in seen:
            logits[t] = (
                logits[t] / params.repetition_penalty if logits[t] > 0 else logits[t] * params.repetition_penalty
            )
        for t in set(out):
            logits[t] -= params.frequency_penalty * out.count(t) + params.presence_penalty
        stops = set(params.stop_token_ids) | (set() if params.ignore_eos else set(eos))
        if len(out) < params.min_tokens:
            for t in stops:
                logits[t] = float("-inf")
        out.append(int(logits.argmax()))
        if out[-1] in stops:
            break
    return out


@pytest.mark.parametrize(
    "penalties",
    [
        dict(repetition_penalty=1.8),
        dict(repetition_penalty=0.6),
        dict(frequency_penalty=1.5),
        dict(presence_penalty=2.0),
        dict(presence_penalty=-1.0, frequency_penalty=0.5, repetition_penalty=1.3),
    ],
)
def test_penalties_match_a_plain_pytorch_loop(hf, penalties):
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, **penalties)
    got = LLM(hf, "eager", max_model_len=64).generate([REPEATING], params)[0].outputs[0].token_ids
    assert got == reference(hf, REPEATING, params)
    plain = LLM(hf, "eager", max_model_len=64).generate([REPEATING], 12)[0]
    assert got != plain, "the penalty changed nothing: the test would not see it applied"


def test_min_tokens_holds_back_eos_and_stop_tokens(hf):
    free = LLM(hf, "eager", max_model_len=64).generate([PROMPT], 12)[0]
    model = hf_llama(eos=free[1])  # EOS is what it would pick second
    llm = LLM(model, "eager", max_model_len=64)
    early = llm.generate([PROMPT], SamplingParams(max_tokens=12, temperature=0))[0].outputs[0]
    assert early.token_ids == free[:2] and early.finish_reason == "stop"
    params = SamplingParams(max_tokens=12, temperature=0, min_tokens=5, stop_token_ids=[free[3]])
    held = llm.generate([PROMPT], params)[0].outputs[0]
    assert held.token_ids == reference(model, PROMPT, params, eos=(free[1],))
    assert len(held.token_ids) >= 5 and free[1] not in held.token_ids[:5]


@pytest.fixture(scope="module")
def word_llm():
    return LLM(hf_llama(), "eager", max_model_len=64, tokenizer=tiny_tokenizer())


def test_a_stop_string_ends_the_text_and_keeps_the_tokens_that_made_it(word_llm):
    greedy = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    free = word_llm.generate(["w1 w2 w3"], greedy)[0].outputs[0]
    words = free.text.split(" ")
    stop = words[3]
    cut = word_llm.generate(
        ["w1 w2 w3"], SamplingParams(max_tokens=10, temperature=0, ignore_eos=True, stop=[stop, "nowhere"])
    )[0].outputs[0]
    at = free.text.index(stop)
    assert cut.text == free.text[:at] and cut.finish_reason == "stop" and cut.stop_reason == stop
    # The token ids run up to the one that completed the string, no further.
    tok = word_llm.tokenizer
    assert cut.token_ids == free.token_ids[: len(cut.token_ids)]
    assert stop in tok.decode(cut.token_ids) and stop not in tok.decode(cut.token_ids[:-1])
    kept = word_llm.generate(
        ["w1 w2 w3"],
        SamplingParams(max_tokens=10, temperature=0, ignore_eos=True, stop=stop, include_stop_str_in_output=True),
    )[0].outputs[0]
    assert kept.text == free.text[: at + len(stop)]
    # Not before min_tokens: the stop string is only looked for once they are generated.
    late = word_llm.generate(
        ["w1 w2 w3"], SamplingParams(max_tokens=10, temperature=0, ignore_eos=True, stop=words[0], min_tokens=3)
    )[0].outputs[0]
    assert len(late.token_ids) >= 3


def test_streamed_text_never_shows_a_stop_string_it_then_cuts(word_llm):
    free = word_llm.generate(["w1 w2"], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))[0].outputs[0]
    words = free.text.split()
    assert len(words) >= 3, free
    stop = words[2]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, stop=stop)
    pieces = [d.outputs[0].text for d in word_llm.stream(["w1 w2"], params)]
    whole = word_llm.generate(["w1 w2"], params)[0].outputs[0].text
    assert "".join(pieces) == whole and stop not in "".join(pieces)


def test_logprobs_and_prompt_logprobs_are_the_models(hf, word_llm):
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, logprobs=3, prompt_logprobs=2)
    out = LLM(hf, "eager", max_model_len=64).generate([PROMPT], params)[0]
    c = out.outputs[0]
    seq = PROMPT + c.token_ids
    with torch.no_grad():
        lp = torch.log_softmax(hf(torch.tensor([seq])).logits[0].float(), -1)
    total = 0.0
    for k, (token, entry) in enumerate(zip(c.token_ids, c.logprobs)):
        row = lp[len(PROMPT) - 1 + k]
        top = torch.topk(row, 3).indices.tolist()
        assert set(entry) == set(top) | {token} and entry[token].rank == 1  # greedy: the sampled is the best
        for t, v in entry.items():
            assert v.logprob == pytest.approx(float(row[t]), abs=1e-4) and v.rank == int((row > row[t]).sum()) + 1
        total += entry[token].logprob
    assert c.cumulative_logprob == pytest.approx(total)
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(PROMPT)
    for p in range(1, len(PROMPT)):
        entry = out.prompt_logprobs[p]
        assert entry[PROMPT[p]].logprob == pytest.approx(float(lp[p - 1, PROMPT[p]]), abs=1e-4)
        assert set(torch.topk(lp[p - 1], 2).indices.tolist()) <= set(entry)
    texts = word_llm.generate(["w1 w2"], SamplingParams(max_tokens=2, temperature=0, logprobs=1))[0].outputs[0]
    for e in texts.logprobs:  # with a tokenizer, each token's text
        assert all(v.decoded_token == word_llm.tokenizer.decode([t]) for t, v in e.items())
    assert all(v.decoded_token is None for e in c.logprobs for v in e.values())  # without one, none


def test_without_logprobs_there_are_none(hf):
    c = LLM(hf, "eager", max_model_len=64).generate([PROMPT], SamplingParams(max_tokens=2))[0].outputs[0]
    assert c.logprobs is None and c.cumulative_logprob is None


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(n=0), r"n must be an int >= 1, got 0"),
        (dict(max_tokens=-1), r"max_tokens must be an int >= 1, or None \(up to max_model_len\), got -1"),
        (dict(min_tokens=-1), r"min_tokens must be an int >= 0, got -1"),
        (dict(min_tokens=5, max_tokens=3), r"min_tokens \(5\) must be at most max_tokens \(3\)"),
        (dict(presence_penalty=2.5), r"presence_penalty must be a number in \[-2, 2\], got 2.5"),
        (dict(frequency_penalty=float("nan")), r"frequency_penalty must be a number in \[-2, 2\], got nan"),
        (dict(repetition_penalty=0), r"repetition_penalty must be a number > 0 \(1 = no penalty\), got 0"),
        (dict(logprobs=21), r"logprobs must be None or an int in \[0, 20\], got 21"),
        (dict(prompt_logprobs=-1), r"prompt_logprobs must be None or an int in \[0, 20\], got -1"),
        (dict(stop=[""]), r"stop must be a string, a list of non-empty strings or None"),
        (dict(stop=5), r"stop must be a string, a list of strings or None, got 5"),
        (dict(include_stop_str_in_output=1), r"include_stop_str_in_output must be a bool, got 1"),
    ],
)
def test_bad_sampling_params_are_refused_by_name(kwargs, message):
    with pytest.raises(SamplingParamsError, match=message):
        SamplingParams(**kwargs)


def test_stop_strings_without_a_tokenizer_are_refused(hf):
    with pytest.raises(ValueError, match="stop strings \\['x'\\] are matched on text, and this LLM has no tokenizer"):
        LLM(hf, "eager", max_model_len=64).generate([PROMPT], SamplingParams(stop="x"))
