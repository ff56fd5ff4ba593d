"""The engine as vLLM's (issue 38): any number of prompts, continuous batching, chunked
prefill under a token budget, preemption when KV blocks run out, vLLM's output types,
streaming, and threads sharing one LLM."""

from __future__ import annotations

import threading

import pytest
import torch
import torch._dynamo
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_serving import llama

from qaic_dynamo import LLM, SamplingParams, compilation_counter
from qaic_dynamo.engine import Request, RequestOutput
from qaic_dynamo.engine.scheduler import BlockPool, Scheduler

MODEL = llama()
_ALONE: dict[tuple[tuple[int, ...], int], list[int]] = {}


def alone(prompt: list[int], n: int) -> list[int]:
    """Greedy tokens of one request run by itself (memoised: the reference never changes)."""
    key = (tuple(prompt), n)
    if key not in _ALONE:
        _ALONE[key] = LLM(MODEL, "eager", max_num_seqs=1, max_model_len=128).generate([prompt], n)[0]
    return _ALONE[key]


def prompts_of(lengths: list[int], seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (k,), generator=g).tolist() for k in lengths]


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


# --- the scheduler on its own ------------------------------------------------------------


def test_a_step_mixes_decodes_with_a_prefill_chunk_under_the_token_budget():
    s = Scheduler(BlockPool(64), block_size=4, max_num_seqs=4, max_num_batched_tokens=10)
    short, long = Request(0, [1] * 3, 4), Request(1, [2] * 25, 4)
    s.add(short)
    s.add(long)
    step = s.schedule()
    assert [(r.request.request_id, r.num_new_tokens) for r in step] == [(0, 3), (1, 7)]  # budget 10
    short.num_computed_tokens, long.num_computed_tokens = 3, 7
    short.output_token_ids.append(9)
    step = s.schedule()  # the decode first, then the next chunk of the prompt
    assert [(r.request.request_id, r.num_new_tokens) for r in step] == [(0, 1), (1, 9)]
    assert len(long.block_ids) == 4  # blocks for 16 tokens, taken as its chunks need them


def test_out_of_blocks_preempts_the_newest_and_admits_nobody_that_step():
    s = Scheduler(BlockPool(4), block_size=4, max_num_seqs=4, max_num_batched_tokens=64)
    old, new, waiting = Request(0, [1] * 8, 8), Request(1, [2] * 8, 8), Request(2, [3] * 2, 2)
    for r in (old, new):
        s.add(r)
    s.schedule()
    old.num_computed_tokens = new.num_computed_tokens = 8  # both full: 2 blocks each, 0 free
    old.output_token_ids.append(5)
    new.output_token_ids.append(6)
    s.add(waiting)
    step = s.schedule()  # old needs a third block: new is preempted, waiting does not join
    assert [r.request.request_id for r in step] == [0]
    assert s.num_preemptions == 1 and new.num_computed_tokens == 0 and new.block_ids == []
    assert list(s.waiting) == [new, waiting]  # the preempted request goes first


# --- LLM ---------------------------------------------------------------------------------


def test_twelve_prompts_with_max_num_seqs_4_each_get_their_tokens_alone():
    prompts = prompts_of([3, 17, 9, 1, 30, 5, 12, 8, 2, 21, 6, 11])
    budgets = [5, 3, 8, 2, 4, 7, 1, 6, 5, 3, 8, 2]
    llm = LLM(MODEL, "eager", max_num_seqs=4, max_model_len=128)
    outs = llm.generate(prompts, [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in budgets])
    assert [o.outputs[0].token_ids for o in outs] == [alone(p, n) for p, n in zip(prompts, budgets)]
    assert llm.num_free_blocks == llm.num_blocks


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    lengths=st.lists(st.integers(1, 40), min_size=1, max_size=8),
    budgets=st.lists(st.integers(1, 10), min_size=8, max_size=8),
    max_num_seqs=st.integers(1, 5),
    block_size=st.sampled_from([4, 8]),
    spare_blocks=st.integers(0, 12),
    max_num_batched_tokens=st.integers(2, 64),
    seed=st.integers(0, 3),
)
def test_any_schedule_gives_every_request_its_tokens_alone(
    lengths, budgets, max_num_seqs, block_size, spare_blocks, max_num_batched_tokens, seed
):
    """Any arrival order, sequence limit, cache size (down to one request's worth, which
    forces preemption) and token budget (which chunks prefills)."""
    prompts = prompts_of(lengths, seed)
    budgets = budgets[: len(prompts)]
    biggest = max(-(-(len(p) + n) // block_size) for p, n in zip(prompts, budgets))
    llm = LLM(
        MODEL,
        "eager",
        max_num_seqs=max_num_seqs,
        max_model_len=128,
        block_size=block_size,
        num_blocks=biggest + spare_blocks,
        max_num_batched_tokens=max_num_batched_tokens,
    )
    got = llm.generate(prompts, [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in budgets])
    assert [o.outputs[0].token_ids for o in got] == [alone(p, n) for p, n in zip(prompts, budgets)]
    assert llm.num_free_blocks == llm.num_blocks


def test_preemption_recomputes_and_loses_no_token():
    prompts = prompts_of([20, 20, 20, 20], seed=5)
    llm = LLM(MODEL, "eager", max_num_seqs=4, max_model_len=64, block_size=4, num_blocks=10)  # one at a time fits
    outs = llm.generate(prompts, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    assert llm.scheduler.num_preemptions > 0
    assert [o.outputs[0].token_ids for o in outs] == [alone(p, 12) for p in prompts]


def test_the_compiled_graphs_do_not_change_with_the_schedule():
    llm = LLM(MODEL, "qaic", max_num_seqs=3, max_model_len=64, block_size=4, num_blocks=12, max_num_batched_tokens=16)
    warm = prompts_of([5, 9], seed=1)
    llm.generate(warm, SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
    prompts, budgets = prompts_of([3, 25, 11, 1, 19, 7], seed=2), [6, 2, 9, 4, 3, 8]
    with compilation_counter.expect(num_graphs_seen=0, num_backend_compilations=0):
        outs = llm.generate(prompts, [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in budgets])
    assert llm.scheduler.num_preemptions > 0  # the schedule did preempt and chunk
    assert [o.outputs[0].token_ids for o in outs] == [alone(p, n) for p, n in zip(prompts, budgets)]


def test_request_outputs_are_vllms():
    llm = LLM(MODEL, "eager", max_model_len=64)
    (out,) = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=4, n=2, temperature=1.0, seed=3))
    assert isinstance(out, RequestOutput) and out.finished and out.prompt_token_ids == [5, 6, 7]
    assert [o.index for o in out.outputs] == [0, 1] and all(len(o.token_ids) == 4 for o in out.outputs)
    assert all(o.finish_reason == "length" and o.text == "" for o in out.outputs)  # no tokenizer: no text
    # Sample i draws from seed + i: sample 1 is what seed 4 gives as sample 0.
    (other,) = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=4, temperature=1.0, seed=4))
    assert other.outputs[0].token_ids == out.outputs[1].token_ids
    assert llm.generate([[5, 6, 7]], 4) == [alone([5, 6, 7], 4)]  # the int shorthand: token-id lists


def test_max_tokens_none_runs_to_max_model_len():
    llm = LLM(MODEL, "eager", max_model_len=24)
    (out,) = llm.generate([[1, 2, 3, 4]], SamplingParams(max_tokens=None, temperature=0, ignore_eos=True))
    assert len(out.outputs[0].token_ids) == 20 and out.outputs[0].finish_reason == "length"
    with pytest.raises(ValueError, match="max_model_len=24 leaves no room for a generated token"):
        llm.generate([[1] * 24], SamplingParams(max_tokens=None))


def test_streaming_yields_deltas_that_add_up_to_the_whole():
    llm = LLM(MODEL, "eager", max_num_seqs=2, max_model_len=64)
    prompts = prompts_of([4, 13, 7], seed=3)
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    tokens: dict[str, list[int]] = {}
    finished = []
    for delta in llm.stream(prompts, params):
        assert len(delta.outputs[0].token_ids) <= 1  # one step, one token at most
        tokens.setdefault(delta.request_id, []).extend(delta.outputs[0].token_ids)
        if delta.finished:
            finished.append(delta.request_id)
    assert sorted(finished) == sorted(tokens) and len(finished) == 3
    assert [tokens[rid] for rid in sorted(tokens, key=int)] == [alone(p, 6) for p in prompts]


def test_closing_a_stream_early_aborts_its_requests_and_frees_their_blocks():
    llm = LLM(MODEL, "eager", max_num_seqs=2, max_model_len=64)
    it = llm.stream(prompts_of([10, 10]), SamplingParams(max_tokens=30, temperature=0, ignore_eos=True))
    next(it)
    it.close()
    assert llm.num_free_blocks == llm.num_blocks and not llm.scheduler.has_unfinished()


def test_four_threads_share_one_llm():
    llm = LLM(MODEL, "eager", max_num_seqs=3, max_model_len=64)
    work = [prompts_of([3 + t, 8, 1 + 2 * t], seed=t) for t in range(4)]
    results: dict[int, list] = {}
    errors = []

    def run(t: int) -> None:
        try:
            outs = llm.generate(work[t], SamplingParams(max_tokens=5 + t, temperature=0, ignore_eos=True))
            results[t] = [o.outputs[0].token_ids for o in outs]
        except Exception as e:  # reported below with the thread's number
            errors.append((t, e))

    threads = [threading.Thread(target=run, args=(t,)) for t in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout=300)
    assert not errors, errors
    for t in range(4):
        assert results[t] == [alone(p, 5 + t) for p in work[t]], t
    assert llm.num_free_blocks == llm.num_blocks


def test_a_request_whose_token_cannot_be_picked_fails_alone_and_frees_its_blocks():
    """A failure after the forward (NaN logits, a tokenizer refusing an id) advanced the
    request without a token; the next step then failed every request batched with it."""
    llm = LLM(MODEL, "eager", max_num_seqs=4, max_model_len=64)
    good, bad = [5, 6, 7], [9, 9, 9, 9]
    real = llm.sampler.pick

    def pick(logits, params, generator, prompt_ids=(), output_ids=()):
        if list(prompt_ids) == bad and len(output_ids) == 2:
            raise FloatingPointError("logits are NaN")
        return real(logits, params, generator, prompt_ids, output_ids)

    llm.sampler.pick = pick
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    with pytest.raises(RuntimeError, match=r"request \d+ failed: FloatingPointError: logits are NaN"):
        llm.generate([good, bad], params)
    assert llm.num_free_blocks == llm.num_blocks and not llm.scheduler.has_unfinished()
    # In another thread's call, the good request is served while the bad one fails.
    results = {}

    def run_good() -> None:
        results["good"] = llm.generate([good], params)[0].outputs[0].token_ids

    t = threading.Thread(target=run_good)
    with pytest.raises(RuntimeError, match="logits are NaN"):
        t.start()
        llm.generate([bad], params)
    t.join(timeout=120)
    assert results["good"] == alone(good, 6)


def test_a_finished_sample_is_not_streamed_again():
    llm = LLM(MODEL, "eager", max_model_len=64)
    sampled = SamplingParams(max_tokens=8, n=2, temperature=1.0, seed=11, ignore_eos=True)
    (free,) = llm.generate([[4, 5, 6]], sampled)
    first, second = free.outputs[0].token_ids, free.outputs[1].token_ids
    stop = next(t for t in first[:3] if t not in second)  # ends sample 0 early, not sample 1
    params = SamplingParams(max_tokens=8, n=2, temperature=1.0, seed=11, ignore_eos=True, stop_token_ids=[stop])
    ends: dict[int, int] = {}
    for delta in llm.stream([[4, 5, 6]], params):
        for o in delta.outputs:
            ends[o.index] = ends.get(o.index, 0) + (o.finish_reason is not None)
    assert ends == {0: 1, 1: 1}
