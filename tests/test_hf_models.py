"""Hugging Face decoders through the qaic ops: same greedy tokens as eager and as plain
transformers, logits within 1e-4, and compilations that do not grow with depth - for the
regional compile (LLM's default) and the whole-model compile alike."""

from __future__ import annotations

import pytest
import torch
from transformers import Gemma2Config, LlamaConfig, MistralConfig, Qwen2Config

from qaic_dynamo import LLM, compilation_counter
from qaic_dynamo.models import hf_model_from_config

PROMPTS = [[11, 22, 33], [44, 55, 66, 77, 88, 99, 12], [101, 202]]
SMALL = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2)
FAMILIES = {
    "llama": lambda L: LlamaConfig(num_hidden_layers=L, **SMALL),
    "qwen2": lambda L: Qwen2Config(num_hidden_layers=L, **SMALL),
    "mistral": lambda L: MistralConfig(num_hidden_layers=L, sliding_window=4096, **SMALL),
}


def hf_generate(model, prompt, n):
    out = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, min_new_tokens=n)
    return out[0, len(prompt) :].tolist()


def expected_counts(regional: bool, layers: int) -> dict[str, int]:
    if regional:
        return dict(
            num_graphs_seen=5,  # the decoder block once; embed_tokens, rotary_emb, norm, lm_head
            num_piecewise_graphs_seen=3 + 4,  # block: before / at / after attention; 4 one-piece regions
            num_backend_compilations=2 + 4,  # whatever the depth
        )
    return dict(
        num_graphs_seen=1,
        num_piecewise_graphs_seen=2 * layers + 1,
        num_backend_compilations=3,  # first, middle, last: whatever the depth
    )


@pytest.mark.parametrize("regional", [True, False], ids=["regional", "whole"])
@pytest.mark.parametrize("layers", [2, 6])
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_family_matches_eager_and_transformers(family, layers, regional):
    hf = hf_model_from_config(FAMILIES[family](layers))
    # One model serves plain transformers (sdpa) and both engines: LLM leaves it unchanged.
    eager = LLM(hf, backend="eager").generate_outputs(PROMPTS, 8, return_logits=True)
    compiled_llm = LLM(hf, backend="qaic", regional=regional)
    want = [hf_generate(hf, p, 8) for p in PROMPTS]
    with torch.no_grad():
        want_logits = [hf(torch.tensor([p])).logits[0, -1] for p in PROMPTS]

    with compilation_counter.expect(
        num_eager_fallbacks=0, num_exporter_fallbacks=0, **expected_counts(regional, layers)
    ):
        compiled = compiled_llm.generate_outputs(PROMPTS, 8, return_logits=True)

    assert [o.token_ids for o in compiled] == [o.token_ids for o in eager] == want
    for c, e, w in zip(compiled, eager, want_logits):
        torch.testing.assert_close(c.logits[0], w, atol=1e-4, rtol=0)  # prefill vs transformers
        for lc, le in zip(c.logits, e.logits):  # every step vs eager
            torch.testing.assert_close(lc, le, atol=1e-4, rtol=0)

    # Another batch composition (sizes, mix) after warm-up compiles nothing new.
    with compilation_counter.expect(num_graphs_seen=0, num_backend_compilations=0):
        again = compiled_llm.generate([[7], [8, 9, 10, 11], [12, 13], [14, 15, 16, 17, 18, 19]], 3)
    assert again == LLM(hf, backend="eager").generate([[7], [8, 9, 10, 11], [12, 13], [14, 15, 16, 17, 18, 19]], 3)


PLAIN_COMPILE = [("llama", 2), ("llama", 4), ("mistral", 2), ("gemma2", 2)]


@pytest.mark.parametrize("dynamic", [None, True], ids=["default", "dynamic"])
@pytest.mark.parametrize("family,layers", PLAIN_COMPILE, ids=[f"{f}-{n}" for f, n in PLAIN_COMPILE])
def test_hf_generate_with_a_compiled_forward(family, layers, dynamic):
    """How transformers users compile: ``torch.compile`` on the model's forward, then
    ``generate`` with its own DynamicCache (use_cache=True). Every graph is lowered
    directly: the cache's ``torch.tensor([])`` seeds are constants of the pieces, and
    under ``dynamic=True`` the config's floats (eps, attention scaling) Dynamo passes as
    inputs are compiled at their values. Mistral and Gemma2's sliding-window cache layers
    pass a tensor through and keep their length as a Python int (a size no tensor carries)."""
    if family == "gemma2":  # soft-capping needs transformers' eager attention
        hf = hf_model_from_config(
            Gemma2Config(
                num_hidden_layers=layers,
                head_dim=16,
                attn_logit_softcapping=50.0,
                final_logit_softcapping=30.0,
                query_pre_attn_scalar=16,
                sliding_window=4096,
                **SMALL,
            )
        )
        hf.config._attn_implementation = "eager"
    else:
        hf = hf_model_from_config(FAMILIES[family](layers))
    prompt = torch.tensor([PROMPTS[1]])
    with torch.no_grad():
        want = hf.generate(prompt, max_new_tokens=5, min_new_tokens=5, do_sample=False)
        want_step = hf(prompt)
        hf.forward = torch.compile(hf.forward, backend="qaic", dynamic=dynamic, options={"fallback": "error"})
        try:
            with compilation_counter.expect(num_exporter_fallbacks=0, num_eager_fallbacks=0):
                step = hf(prompt)
                got = hf.generate(prompt, max_new_tokens=5, min_new_tokens=5, do_sample=False)
        finally:
            del hf.forward
    assert got.tolist() == want.tolist()
    torch.testing.assert_close(step.logits, want_step.logits, atol=1e-4, rtol=0)
    for c, e in zip(step.past_key_values.layers, want_step.past_key_values.layers):
        torch.testing.assert_close(c.keys, e.keys, atol=1e-5, rtol=0)
        torch.testing.assert_close(c.values, e.values, atol=1e-5, rtol=0)


def test_transformers_grouped_mm_experts_fall_back_with_the_fix_named():
    # transformers' default MoE experts call an opaque custom op looping over
    # data-dependent group sizes: no ONNX translation. The warning says what to do.
    import transformers.integrations.moe  # noqa: F401  (registers the op)

    def experts(x, w, offs):
        return torch.ops.transformers.grouped_mm_fallback(x, w, offs=offs) * 2

    g = torch.Generator().manual_seed(0)
    x, w, offs = torch.randn(6, 8, generator=g), torch.randn(3, 8, 4, generator=g), torch.tensor([2, 2, 6])
    with (
        compilation_counter.expect(num_eager_fallbacks=1, num_backend_compilations=0),
        pytest.warns(RuntimeWarning, match=r"set_experts_implementation\('batched_mm'\)"),
    ):
        out = torch.compile(experts, backend="qaic")(x, w, offs)
    torch.testing.assert_close(out, experts(x, w, offs))


def test_per_layer_names_compile_every_layer():
    hf = hf_model_from_config(FAMILIES["llama"](3))
    with compilation_counter.expect(num_backend_compilations=4):  # L + 1 pieces, all distinct
        LLM(hf, backend="qaic", regional=False, layer_agnostic_kv_update=False).generate(PROMPTS, 2)


def test_unsupported_architecture_is_a_clear_error():
    from qaic_dynamo.models.hf import HFCausalLM

    class NotAnLLM(torch.nn.Module):
        config = LlamaConfig(num_hidden_layers=2, **SMALL)

    with pytest.raises(NotImplementedError, match="found 0 attention modules"):
        HFCausalLM(NotAnLLM())


# More decoder families through LLM's default (regional) compile, each with a mechanism of
# its own: QK norms (Qwen3, OLMo2, Gemma3), mixture of experts (Mixtral, Qwen3-MoE),
# partial rotary and a parallel attention/MLP block with biases (Phi), a parallel block
# with logit scaling (Cohere), LayerNorm + GELU + biases (StarCoder2), sliding and global
# layers (Gemma3), embedding / residual / logit multipliers (Granite), squared-ReLU MLP and
# LayerNorm1P (Nemotron). Extra config keys are each family's required sizes.
MORE_FAMILIES = {
    "qwen3": {},
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2),
    "phi": {},
    "cohere": {},
    "starcoder2": {},
    "gemma3_text": dict(head_dim=16, sliding_window=4),
}
MORE_FAMILIES_SLOW = {
    "qwen3_moe": dict(moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2),
    "olmo": {},
    "olmo2": {},
    "gemma": dict(head_dim=16),
    "granite": {},
    "helium": dict(head_dim=16),
    "exaone4": {},
    "ernie4_5": {},
    "seed_oss": {},
    "apertus": {},
    "nemotron": {},
    "arcee": {},
}


def greedy_reference(model, prompt, n):
    """Plain transformers, no cache, no logits processors: argmax of a full forward per token
    (``generate``'s ``min_new_tokens`` would suppress an EOS the engine emits)."""
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt) :]


@pytest.mark.parametrize(
    "family", [*MORE_FAMILIES, *(pytest.param(f, marks=pytest.mark.slow) for f in MORE_FAMILIES_SLOW)]
)
def test_more_families_match_eager_and_transformers(family):
    from qaic_dynamo.models import hf_config

    extra = {**MORE_FAMILIES, **MORE_FAMILIES_SLOW}[family]
    torch.manual_seed(0)
    hf = hf_model_from_config(hf_config(dict(model_type=family, num_hidden_layers=2, **SMALL, **extra)))
    eager = LLM(hf, backend="eager").generate_outputs(PROMPTS, 6, return_logits=True)
    before = compilation_counter.snapshot()
    with compilation_counter.expect(num_eager_fallbacks=0, num_exporter_fallbacks=0):
        compiled = LLM(hf, backend="qaic").generate_outputs(PROMPTS, 6, return_logits=True)
    # compiled for real: the block's two pieces at least (ends and MoE vary by family)
    assert compilation_counter.num_backend_compilations - before.num_backend_compilations >= 2
    want = [greedy_reference(hf, p, 6) for p in PROMPTS]
    assert [o.token_ids for o in compiled] == [o.token_ids for o in eager] == want
    for c, e in zip(compiled, eager):
        for lc, le in zip(c.logits, e.logits):
            torch.testing.assert_close(lc, le, atol=1e-4, rtol=0)
