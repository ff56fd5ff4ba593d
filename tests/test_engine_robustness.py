"""The engine stays usable and leaves its inputs alone: a step that raises frees every KV
block, ``LLM(model)`` does not change the caller's model (transformers or reference), and
models whose attention the qaic ops cannot run are refused when the engine is built."""

from __future__ import annotations

import pytest
import torch
from transformers import Gemma2Config, LlamaConfig

from qaic_dynamo import FROM_FORWARD_CONTEXT, LLM
from qaic_dynamo.engine import Request
from qaic_dynamo.models import QaicLlamaConfig, QaicLlamaForCausalLM, hf_model_from_config

PROMPTS = [[5, 6, 7, 8], [9], [10, 11, 12, 13, 14, 15, 16, 17, 18], [19, 20]]
SMALL = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2)


def llama_reference(layers=2):
    torch.manual_seed(0)
    return QaicLlamaForCausalLM(QaicLlamaConfig(num_hidden_layers=layers))


def llama_hf(layers=2):
    return hf_model_from_config(LlamaConfig(num_hidden_layers=layers, **SMALL))


def fail_on_call(module, n):
    """Make ``module``'s n-th forward (from now) raise."""
    calls = [0]

    def hook(mod, args):
        calls[0] += 1
        if calls[0] == n:
            raise RuntimeError("injected step failure")

    return module.register_forward_pre_hook(hook)


# -- 1. a failing step ----------------------------------------------------------------------
@pytest.mark.parametrize("failing_step", [1, 2, 5])
def test_a_failing_step_frees_every_block_and_the_engine_recovers(failing_step):
    model = llama_reference()
    want = LLM(model, backend="eager").generate(PROMPTS, 6)
    # Room for two requests at a time, so some wait while others run when the step fails.
    llm = LLM(model, backend="eager", max_num_seqs=4, max_model_len=32, block_size=4, num_blocks=8)
    handle = fail_on_call(llm.model, failing_step)
    with pytest.raises(RuntimeError, match="injected step failure"):
        llm.generate(PROMPTS, 6)
    handle.remove()
    assert llm.num_free_blocks == llm.num_blocks, "blocks of running and admitted requests are released"
    assert llm.generate(PROMPTS, 6) == want
    assert llm.num_free_blocks == llm.num_blocks


def test_an_interrupt_inside_a_step_also_frees_the_blocks():
    llm = LLM(llama_reference(), backend="eager", max_num_seqs=4, max_model_len=32, block_size=4)

    def interrupt(mod, args):
        raise KeyboardInterrupt

    handle = llm.model.register_forward_pre_hook(interrupt)
    with pytest.raises(KeyboardInterrupt):
        llm.generate(PROMPTS, 3)
    handle.remove()
    assert llm.num_free_blocks == llm.num_blocks


# -- 5. the public step API -------------------------------------------------------------------
def test_execute_model_runs_one_step_over_prepared_requests():
    """A prefill then a decode step by hand give generate's tokens; blocks go back."""
    llm = LLM(llama_reference(), backend="eager", max_num_seqs=4, max_model_len=32, block_size=4)
    want = llm.generate(PROMPTS[:2], 2)
    requests = [Request(i, p, max_new_tokens=2) for i, p in enumerate(PROMPTS[:2])]
    assert all(llm.reserve_blocks(r) for r in requests)
    assert llm.num_free_blocks == llm.num_blocks - 3  # 6 and 3 tokens: 2 + 1 blocks of 4
    for _ in range(2):
        logits = llm.execute_model(requests)
        assert logits.shape == (2, 512)
        for r, row in zip(requests, logits):
            r.num_computed_tokens = r.num_tokens
            r.output_token_ids.append(int(row.argmax()))
    assert [r.output_token_ids for r in requests] == want
    for r in requests:
        llm.release_blocks(r)
    assert llm.num_free_blocks == llm.num_blocks


def test_execute_model_rejects_a_request_with_nothing_to_feed():
    llm = LLM(llama_reference(), backend="eager", max_model_len=32, block_size=4)
    done = Request(0, [1, 2], max_new_tokens=1, num_computed_tokens=2, block_ids=[0])
    with pytest.raises(ValueError, match="request 0 has no token to feed"):
        llm.execute_model([done])
    with pytest.raises(ValueError, match=r"block ids outside \[0, 64\): \[99\]"):
        llm.execute_model([Request(1, [1, 2], max_new_tokens=1, block_ids=[99])])


# -- 2. the caller's model is not changed ---------------------------------------------------
def hf_generate(model, prompt, n):
    out = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, min_new_tokens=n)
    return out[0, len(prompt) :].tolist()


def plain_run(model):
    ids = torch.tensor([PROMPTS[2]])
    with torch.no_grad():
        return model(ids).logits, hf_generate(model, PROMPTS[2], 4)


def test_transformers_model_runs_as_before_after_an_engine_is_built():
    model = llama_hf()
    logits, tokens = plain_run(model)
    attn_impl = model.config._attn_implementation
    params = {n: p.data_ptr() for n, p in model.named_parameters()}

    llm = LLM(model, backend="eager")
    engine_tokens = llm.generate(PROMPTS, 4)
    LLM(model, backend="eager", layer_agnostic_kv_update=False)  # a second engine, other options

    assert model.config._attn_implementation == attn_impl == "sdpa"
    assert llm.model.hf.config._attn_implementation == "qaic"
    assert not any(hasattr(m, "qaic_layer_name") for m in model.modules())
    after_logits, after_tokens = plain_run(model)
    torch.testing.assert_close(after_logits, logits, atol=0, rtol=0)
    assert after_tokens == tokens
    # The engine shares the weights rather than copying them.
    assert {n: p.data_ptr() for n, p in llm.model.hf.named_parameters()} == params
    assert llm.model.hf.lm_head.weight is model.lm_head.weight
    assert engine_tokens == LLM(llama_hf(), backend="eager").generate(PROMPTS, 4)


def test_dtype_casts_a_copy_of_the_weights_not_the_callers_model():
    model = llama_hf()
    logits, _ = plain_run(model)
    llm = LLM(model, backend="eager", dtype=torch.float16)
    assert llm.dtype == torch.float16
    assert {p.dtype for p in llm.model.parameters()} == {torch.float16}
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    torch.testing.assert_close(plain_run(model)[0], logits, atol=0, rtol=0)
    out = llm.generate(PROMPTS, 2)  # runs in float16
    assert len(out) == len(PROMPTS) and all(1 <= len(t) <= 2 for t in out)
    assert {p.dtype for p in model.parameters()} == {torch.float32}  # still the caller's float32


def test_reference_model_state_is_unchanged():
    model = llama_reference(3)
    first = model.layers[0].self_attn
    before = (model.config.layer_agnostic_kv_update, first.op_layer_name)
    assert before == (True, FROM_FORWARD_CONTEXT)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    per_layer = LLM(model, backend="eager", layer_agnostic_kv_update=False)
    half = LLM(model, backend="eager", dtype=torch.float16)

    assert (model.config.layer_agnostic_kv_update, first.op_layer_name) == before
    assert per_layer.model.layers[0].self_attn.op_layer_name == first.layer_name
    assert per_layer.model.config is not model.config
    assert per_layer.model.layers[0].self_attn.qkv_proj.weight is first.qkv_proj.weight
    assert half.model.embed_tokens.weight.dtype == torch.float16
    assert {p.dtype for p in model.parameters()} | {model.inv_freq.dtype} == {torch.float32}
    for k, v in model.state_dict().items():
        torch.testing.assert_close(v, state[k], atol=0, rtol=0)
    assert per_layer.generate(PROMPTS, 3) == LLM(llama_reference(3), backend="eager").generate(PROMPTS, 3)


# -- 3. Gemma2 final-logit soft-capping (attention soft-capping: tests/test_new_families.py) --
def gemma2(**kw):
    return hf_model_from_config(Gemma2Config(num_hidden_layers=2, head_dim=16, **SMALL, **kw))


def test_final_logit_soft_capping_alone_is_supported():
    """Gemma2's final soft-capping is plain torch in the LM head: it runs and matches."""
    model = gemma2(attn_logit_softcapping=None, final_logit_softcapping=5.0)
    out = LLM(model, backend="eager").generate_outputs([PROMPTS[2]], 4, return_logits=True)[0]
    assert out.token_ids == hf_generate(model, PROMPTS[2], 4)
    with torch.no_grad():
        want = model(torch.tensor([PROMPTS[2]])).logits[0, -1]
    torch.testing.assert_close(out.logits[0], want, atol=1e-4, rtol=0)
