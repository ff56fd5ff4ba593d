"""The LLM engine: paged KV, batching, reference models, local directories, bad input."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import LlamaConfig

from qaic_dynamo import LLM, compilation_counter
from qaic_dynamo.models import (
    QaicLlamaConfig,
    QaicLlamaForCausalLM,
    QaicMLAConfig,
    QaicMLAForCausalLM,
    hf_model_from_config,
)

PROMPTS = [[5, 6, 7, 8], [9], [10, 11, 12, 13, 14, 15, 16, 17, 18], [19, 20]]


def reference(kind, layers):
    torch.manual_seed(0)
    if kind == "llama":
        return QaicLlamaForCausalLM(QaicLlamaConfig(num_hidden_layers=layers))
    return QaicMLAForCausalLM(QaicMLAConfig(num_hidden_layers=layers))


@pytest.mark.parametrize("layers", [2, 6])
@pytest.mark.parametrize("kind", ["llama", "mla"])
def test_reference_models_qaic_matches_eager(kind, layers):
    model = reference(kind, layers)
    eager = LLM(model, backend="eager").generate_outputs(PROMPTS, 6, return_logits=True)
    with compilation_counter.expect(
        num_graphs_seen=4,  # regional: the decoder block once, embed_tokens, norm, lm_head
        num_backend_compilations=5,  # the block's 2 pieces + 3 regions, whatever the depth
        num_eager_fallbacks=0,
        num_exporter_fallbacks=0,
    ):
        compiled = LLM(model, backend="qaic").generate_outputs(PROMPTS, 6, return_logits=True)
    assert [o.token_ids for o in compiled] == [o.token_ids for o in eager]
    for c, e in zip(compiled, eager):
        for lc, le in zip(c.logits, e.logits):
            torch.testing.assert_close(lc, le, atol=1e-4, rtol=0)


def test_reference_configs_share_one_keyword_only_base():
    from qaic_dynamo.models import QaicModelConfig

    llama, mla = QaicLlamaConfig(hidden_size=64, rope_theta=5e5), QaicMLAConfig(hidden_size=64, rope_theta=5e5)
    assert isinstance(llama, QaicModelConfig) and isinstance(mla, QaicModelConfig)
    assert (llama.hidden_size, llama.rope_theta, llama.head_dim) == (64, 5e5, 16)
    assert (mla.hidden_size, mla.rope_theta, mla.rms_norm_eps) == (64, 5e5, 1e-6)
    with pytest.raises(TypeError):
        QaicLlamaConfig(512)  # keyword-only: field order is not an interface


def test_mla_absorbed_attention_matches_the_naive_model():
    model = reference("mla", 3).eval()
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    out = LLM(model, backend="eager").generate_outputs([prompt], 1, return_logits=True)[0]
    torch.testing.assert_close(out.logits[0], model.reference_logits(torch.tensor(prompt))[-1], atol=1e-4, rtol=0)


def test_blocks_are_paged_and_freed():
    llm = LLM(reference("llama", 2), backend="eager", max_num_seqs=4, max_model_len=64, block_size=4)
    assert llm.num_free_blocks == llm.num_blocks == 4 * 16
    llm.generate(PROMPTS, 5)
    assert llm.num_free_blocks == llm.num_blocks, "every block is returned"


def test_requests_wait_for_blocks_instead_of_truncating():
    model = reference("llama", 2)
    want = LLM(model, backend="eager").generate(PROMPTS, 8)
    # Room for two sequences at a time: the others queue until blocks are freed.
    tight = LLM(model, backend="eager", max_num_seqs=4, max_model_len=32, block_size=4, num_blocks=8)
    assert tight.generate(PROMPTS, 8) == want
    assert tight.stats["steps"] > 9, "the batch ran in more than one wave"


def test_varying_batches_compile_once():
    llm = LLM(reference("llama", 3), backend="qaic")
    llm.generate(PROMPTS, 2)
    with compilation_counter.expect(num_graphs_seen=0, num_backend_compilations=0):
        llm.generate([[1]], 3)  # one sequence: one token per decode step
        llm.generate([[1, 2, 3]] * 8, 2)
        llm.generate([list(range(1, 40))], 1)


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda llm: llm.generate([[1, 2], []]), "prompt 1 is empty"),
        (lambda llm: llm.generate([[1] * 70]), "prompt 0 has 70 tokens but max_model_len=64"),
        (lambda llm: llm.generate([[1] * 60], 10), "exceeds max_model_len=64"),
        (lambda llm: llm.generate([[1, 512, -3]]), "token ids outside the vocabulary [0, 512): [512, -3]"),
        (lambda llm: llm.generate([[1]], 0), "max_new_tokens must be a positive int"),
        (lambda llm: llm.generate([]), "no prompts given"),
    ],
)
def test_bad_input_is_rejected(call, message):
    llm = LLM(reference("llama", 2), backend="eager", max_num_seqs=4, max_model_len=64)
    with pytest.raises(ValueError) as e:
        call(llm)
    assert message in str(e.value)


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda llm: llm.generate([[1, True, 2]]), "prompt 0 has token ids that are not integers: [True]"),
        (lambda llm: llm.generate([[1, 2.5]]), "prompt 0 has token ids that are not integers: [2.5]"),
        # 0-d numpy arrays have __index__ whatever their dtype: 3.7 became 3, True 1.
        (lambda llm: llm.generate([[__import__("numpy").array(3.7), 2]]), "not integers: [array(3.7)]"),
        (lambda llm: llm.generate([[__import__("numpy").array(True), 2]]), "not integers: [array(True)]"),
        (lambda llm: llm.generate([[1], 7]), "prompt 1 is a int; a prompt is a list of token ids or a string"),
        # one flat prompt: the bool or float is named, not "prompt 0 is a int" (found by review)
        (lambda llm: llm.generate([1, True]), "prompt 0 has token ids that are not integers: [True]"),
        (lambda llm: llm.generate([1, 2.0]), "prompt 0 has token ids that are not integers: [2.0]"),
        (lambda llm: llm.generate({1: 2}), "prompts must be a list of prompts"),
    ],
)
def test_prompts_that_are_not_token_ids_are_a_type_error(call, message):
    llm = LLM(reference("llama", 2), backend="eager", max_num_seqs=4, max_model_len=64)
    with pytest.raises(TypeError) as e:
        call(llm)
    assert message in str(e.value)


def test_one_prompt_may_be_given_alone_and_ids_may_be_numpy_or_torch():
    import numpy as np

    llm = LLM(reference("llama", 2), backend="eager", max_num_seqs=4, max_model_len=64)
    want = llm.generate([[1, 2, 3]], 2)
    assert len(want) == 1
    assert llm.generate([1, 2, 3], 2) == want  # a flat list is one prompt (as vLLM takes it), not three
    assert llm.generate(torch.tensor([1, 2, 3]), 2) == want
    assert llm.generate([np.array([1, 2, 3])], 2) == want
    assert llm.generate([[np.int64(1), torch.tensor(2), 3]], 2) == want


def test_a_request_larger_than_the_cache_is_rejected():
    llm = LLM(reference("llama", 2), backend="eager", max_model_len=64, block_size=4, num_blocks=3)
    with pytest.raises(ValueError, match="needs 4 KV blocks of 4 tokens but the cache has only 3"):
        llm.generate([[1] * 10], 4)


def test_bad_constructor_arguments():
    with pytest.raises(ValueError, match=r"backend must be one of \['qaic', 'eager', 'inductor'\]"):
        LLM(reference("llama", 2), backend="tvm")
    with pytest.raises(FileNotFoundError, match="neither a local model directory nor a reference model"):
        LLM("meta-llama/Llama-3-8B")
    with pytest.raises(TypeError, match="cannot run a Linear"):
        LLM(torch.nn.Linear(2, 2))
    base = hf_model_from_config(
        LlamaConfig(
            vocab_size=512,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=1,
            num_attention_heads=4,
            num_key_value_heads=2,
        )
    ).model
    with pytest.raises(
        TypeError, match=r"LlamaModel has no language-model head.*torch.compile\(model, backend='qaic'\)"
    ):  # failed at the first step
        LLM(base, backend="eager")


@pytest.mark.parametrize(
    "kw, message",
    [
        (dict(num_blocks=2.5), "num_blocks must be a positive int, got 2.5"),
        (dict(num_blocks=True), "num_blocks must be a positive int, got True"),
        (dict(num_blocks="8"), "num_blocks must be a positive int, got '8'"),
        (dict(num_blocks=0), "num_blocks must be a positive int, got 0"),
        (dict(seed=2**64), r"seed must be an int in \[-2\*\*63, 2\*\*64\).*got 18446744073709551616"),
        (dict(seed=None), "seed must be an int.*got None"),
        (dict(seed=1.5), "seed must be an int.*got 1.5"),
    ],
)
def test_bad_counts_and_seeds_are_named(kw, message):
    with pytest.raises(ValueError, match=message):
        LLM(reference("llama", 2), backend="eager", **kw)


def test_a_numpy_seed_is_taken():
    import numpy as np

    llm = LLM(reference("llama", 2), backend="eager", seed=np.int64(3), num_blocks=64)
    assert llm.num_blocks == 64 and len(llm.generate([[1, 2]], 2)[0]) == 2


def test_local_model_directory(tmp_path):
    cfg = LlamaConfig(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    hf = hf_model_from_config(cfg, seed=3)
    hf.save_pretrained(tmp_path / "weights")
    want = LLM(hf, backend="eager").generate(PROMPTS, 4)
    assert LLM(str(tmp_path / "weights"), backend="eager").generate(PROMPTS, 4) == want

    cfg.save_pretrained(tmp_path / "bin")  # a PyTorch pickle checkpoint: it got random weights
    torch.save(hf.state_dict(), tmp_path / "bin" / "pytorch_model.bin")
    assert LLM(str(tmp_path / "bin"), backend="eager").generate(PROMPTS, 4) == want

    cfg.save_pretrained(tmp_path / "config-only")  # no weights: random from seed 0
    a = LLM(str(tmp_path / "config-only"), backend="eager").generate(PROMPTS, 4)
    b = LLM(hf_model_from_config(cfg, seed=0), backend="eager").generate(PROMPTS, 4)
    assert a == b


def test_reference_model_by_name_and_json_config(tmp_path):
    assert LLM("llama", backend="eager").generate([[1, 2, 3]], 2) == LLM(
        reference("llama", 4), backend="eager"
    ).generate([[1, 2, 3]], 2)
    from qaic_dynamo.models import hf_config

    path = tmp_path / "config.json"
    path.write_text(
        json.dumps(
            {
                "model_type": "qwen2",
                "vocab_size": 300,
                "hidden_size": 32,
                "num_hidden_layers": 1,
                "num_attention_heads": 2,
                "num_key_value_heads": 1,
                "intermediate_size": 64,
            }
        )
    )
    cfg = hf_config(path)
    assert type(cfg).__name__ == "Qwen2Config" and cfg.vocab_size == 300


@pytest.mark.slow
def test_inductor_backend_matches_eager():
    model = reference("llama", 2)
    assert LLM(model, backend="inductor").generate(PROMPTS, 4) == LLM(model, backend="eager").generate(PROMPTS, 4)


FREEZE_CHILD = """
import gc, json, sys, weakref
import torch
from qaic_dynamo import LLM
from qaic_dynamo.compiler.regions.precompile import wait_for_saves
from qaic_dynamo.engine.heap import startup_heap_frozen
from qaic_dynamo.models import QaicLlamaConfig, QaicLlamaForCausalLM


def tracked(obj):  # frozen objects are not in the collector's generations
    return any(o is obj for o in gc.get_objects())


class Cycle:
    pass


freeze = sys.argv[1] == "1"
old = Cycle()
old.self, old.tensor = old, torch.zeros(1 << 18)
old_ref = weakref.ref(old)
gc.collect()  # old garbage: in the oldest generation when the engine is made
del old
tracked_before = len(gc.get_objects())
model = QaicLlamaForCausalLM(QaicLlamaConfig(num_hidden_layers=2))
llm = LLM(model, backend="qaic", max_model_len=32, freeze_gc_heap=freeze)
frozen_once, old_freed = gc.get_freeze_count(), old_ref() is None
tokens = llm.generate([[1, 2, 3]], 3)
engine_model_tracked, user_model_tracked = tracked(llm.model), tracked(model)
cache = weakref.ref(next(iter(llm.kv_caches.values()))[0])
wait_for_saves()  # a pending save holds its region until written
del llm
second = LLM(model, backend="eager", max_model_len=32, freeze_gc_heap=freeze)
a, b = Cycle(), Cycle()
a.other, b.other = b, a
cycle = weakref.ref(a)
del a, b
gc.collect()
print(json.dumps(dict(
    tracked_before=tracked_before, frozen=frozen_once, frozen_after_second=gc.get_freeze_count(),
    flag=startup_heap_frozen(), tokens=tokens, old_freed=old_freed, second_seconds=second.gc_freeze_seconds,
    engine_model_tracked=engine_model_tracked, user_model_tracked=user_model_tracked,
    cycle_freed=cycle() is None, cache_freed=cache() is None, enabled=gc.isenabled(),
)))
"""


@pytest.mark.parametrize("freeze", [True, False])
def test_the_first_engine_collects_then_freezes_the_start_up_heap_once_and_not_its_own_objects(freeze):
    """vLLM's start-up heap freeze: full collections (a compile triggers them) no longer
    re-scan the objects imports made. Garbage waiting in the oldest generation is freed
    first, not frozen; the engine's own objects are not frozen (its module copy stays in
    the collector's generations, its caches go with it), nor is what comes after."""
    import subprocess
    import sys

    proc = subprocess.run(
        [sys.executable, "-c", FREEZE_CHILD, "1" if freeze else "0"], capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    assert r["enabled"] and r["cycle_freed"] and r["cache_freed"] and len(r["tokens"][0]) == 3
    assert r["engine_model_tracked"] and r["second_seconds"] is None
    assert r["flag"] is freeze
    if freeze:
        assert r["old_freed"]  # collected when the first engine was made, not frozen
        assert r["frozen"] > 0.9 * r["tracked_before"] > 50_000  # the import-time heap
        assert not r["user_model_tracked"]  # the caller's model was alive then: frozen
        # not frozen again (frozen objects freed by reference counting leave the count)
        assert r["frozen_after_second"] <= r["frozen"]
    else:
        assert r["frozen"] == r["frozen_after_second"] == 0 and r["user_model_tracked"]


def test_freeze_gc_heap_must_be_a_bool():
    with pytest.raises(ValueError, match="freeze_gc_heap must be True or False, got 'no'"):
        LLM(reference("llama", 2), backend="eager", freeze_gc_heap="no")
