"""Families that need more than plain attention (issue 13): Gemma2 (attention logit
soft-capping, alternating sliding/global layers), GPT-OSS (attention sinks, mixture of
experts), Qwen2-MoE. Greedy tokens equal transformers' ``generate`` and eager, and the
unique compilations stay what structural reuse promises."""

from __future__ import annotations

import pytest
import torch

from qaic_dynamo import LLM, compilation_counter
from qaic_dynamo.models import hf_config, hf_model_from_config

PROMPTS = [[11, 22, 33], [44, 55, 66, 77, 88, 99, 12], [101, 202]]
SMALL = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2)


def hf_generate(model, prompt, n):
    out = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, min_new_tokens=n)
    return out[0, len(prompt) :].tolist()


GEMMA4 = dict(
    model_type="gemma4_text",
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    head_dim=16,
    global_head_dim=16,
    num_attention_heads=4,
    num_key_value_heads=2,
    sliding_window=4,
    max_position_embeddings=64,
    layer_types=["sliding_attention", "full_attention"],
    hidden_size_per_layer_input=0,
    vocab_size_per_layer_input=512,
)


def test_gemma4_with_one_head_size_runs():
    # Its config's head_dim is per layer (transformers refuses the global read): the
    # attention modules give it. The reference is transformers' forward over the whole
    # sequence without a cache: its generate() with a sliding-window cache picks another
    # 6th token for the first prompt here (the no-cache forward agrees with the engine).
    model = hf_model_from_config(hf_config(GEMMA4))
    eager = LLM(model, backend="eager").generate(PROMPTS, 6)
    with compilation_counter.expect(num_eager_fallbacks=0):
        assert LLM(model, backend="qaic").generate(PROMPTS, 6) == eager
    for prompt, tokens in zip(PROMPTS, eager):
        with torch.no_grad():
            logits = model(torch.tensor([prompt + tokens]), use_cache=False).logits[0]
        assert logits[len(prompt) - 1 : -1].argmax(-1).tolist() == tokens


def gemma2(layers):
    from transformers import Gemma2Config

    # sliding_window 4 < the prompts: the local layers really differ from the global ones.
    return hf_model_from_config(Gemma2Config(num_hidden_layers=layers, head_dim=16, sliding_window=4, **SMALL))


def gpt_oss(layers):
    from transformers import GptOssConfig

    return hf_model_from_config(
        GptOssConfig(
            num_hidden_layers=layers, head_dim=16, num_local_experts=4, num_experts_per_tok=2, sliding_window=4, **SMALL
        )
    )


def qwen2_moe(layers):
    from transformers import Qwen2MoeConfig

    return hf_model_from_config(
        Qwen2MoeConfig(
            num_hidden_layers=layers,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=64,
            shared_expert_intermediate_size=64,
            **SMALL,
        )
    )


def check_parity(model, regional=True, counts=None, prompts=PROMPTS):
    want = [hf_generate(model, p, 6) for p in prompts]
    eager = LLM(model, backend="eager").generate(prompts, 6)
    llm = LLM(model, backend="qaic", regional=regional)
    with compilation_counter.expect(num_eager_fallbacks=0, **(counts or {})):
        got = llm.generate(prompts, 6)
    assert got == eager == want


@pytest.mark.parametrize("layers", [2, 6])
def test_gemma2_soft_capping_and_alternating_windows(layers):
    model = gemma2(layers)
    assert model.config.attn_logit_softcapping is not None
    assert set(model.config.layer_types) == {"sliding_attention", "full_attention"}
    check_parity(
        model,
        counts=dict(
            # the block traced twice (a sliding and a global kind: the window is a per-layer
            # value Dynamo guards on); embed_tokens, rotary embedding, norm, lm_head once each
            num_graphs_seen=2 + 4,
            # Both kinds split at attention into the same two pieces (the window and the cap
            # are attention arguments, outside every piece), so those lower once; plus one
            # piece per other region - whatever the depth
            num_backend_compilations=2 + 4,
        ),
    )


def test_gemma2_whole_model_compile_shares_pieces_by_kind():
    model = gemma2(6)
    check_parity(model, regional=False, counts=dict(num_graphs_seen=1))


@pytest.mark.parametrize("layers", [2, 4])
def test_gpt_oss_attention_sinks_and_experts(layers):
    model = gpt_oss(layers)
    assert all(hasattr(layer.self_attn, "sinks") for layer in model.model.layers)
    check_parity(model)


@pytest.mark.parametrize("layers", [2, 8])
def test_qwen2_moe_middle_layers_share_one_artifact(layers):
    check_parity(
        qwen2_moe(layers),
        regional=False,
        counts=dict(
            num_graphs_seen=1,
            num_backend_compilations=3,  # first, middle, last: the routing adds no per-layer constant
        ),
    )


def phimoe(layers):
    from transformers import PhimoeConfig

    return hf_model_from_config(
        PhimoeConfig(num_hidden_layers=layers, num_local_experts=4, num_experts_per_tok=2, sliding_window=4, **SMALL)
    )


@pytest.mark.parametrize("regional", [True, False], ids=["regional", "whole"])
@pytest.mark.parametrize("family", ["qwen2_moe", "phimoe"])
def test_a_window_applied_only_through_the_mask_reaches_the_op(family, regional):
    """Qwen2-MoE (use_sliding_window) and PhiMoE keep their window only in transformers'
    mask, never as the attention's sliding_window argument: they ran as full attention
    (tokens differed from transformers once a prompt passed the window)."""
    if family == "qwen2_moe":
        from transformers import Qwen2MoeConfig

        model = hf_model_from_config(
            Qwen2MoeConfig(
                num_hidden_layers=2,
                num_experts=4,
                num_experts_per_tok=2,
                moe_intermediate_size=64,
                shared_expert_intermediate_size=64,
                use_sliding_window=True,
                sliding_window=4,
                max_window_layers=2,
                **SMALL,
            )
        )
    else:
        model = phimoe(2)
    check_parity(model, regional=regional, prompts=[[11, 22, 33, 5, 6, 7, 8, 9, 10, 12, 13, 14], [44, 55, 66, 77, 88]])


@pytest.mark.parametrize(
    "config, message",
    [
        # a Mamba layer beside attention layers: would run without its recurrent state
        (
            dict(
                model_type="granitemoehybrid",
                vocab_size=256,
                hidden_size=64,
                intermediate_size=128,
                shared_intermediate_size=128,
                num_hidden_layers=2,
                num_attention_heads=4,
                num_key_value_heads=2,
                num_local_experts=0,
                num_experts_per_tok=0,
                layer_types=["mamba", "attention"],
                position_embedding_type="rope",
                mamba_n_heads=4,
                mamba_d_state=16,
                mamba_d_head=32,
                pad_token_id=0,
            ),
            "keeps recurrent state",
        ),
        # Falcon-H1: Mamba beside attention in every layer, and attention outside the interface
        # (it ran without the recurrent state: wrong tokens)
        (
            dict(
                model_type="falcon_h1",
                vocab_size=256,
                hidden_size=64,
                intermediate_size=128,
                num_hidden_layers=2,
                num_attention_heads=4,
                num_key_value_heads=2,
                head_dim=16,
                mamba_d_ssm=64,
                mamba_n_heads=4,
                mamba_d_head=16,
                mamba_d_state=16,
                mamba_n_groups=1,
                mamba_chunk_size=16,
                pad_token_id=0,
            ),
            "does not go through transformers' attention interface",
        ),
        # chunked attention lives only in the mask: ran as full causal attention
        (
            dict(
                model_type="llama4_text",
                vocab_size=256,
                hidden_size=64,
                intermediate_size=128,
                intermediate_size_mlp=128,
                num_hidden_layers=2,
                num_attention_heads=4,
                num_key_value_heads=2,
                head_dim=16,
                attention_chunk_size=4,
                num_local_experts=2,
            ),
            "chunked attention",
        ),
        # transformers' latent attention: keys 24 wide, values 16, head_dim 8 (failed in the cache kernel)
        (
            dict(
                model_type="deepseek_v3",
                vocab_size=256,
                hidden_size=64,
                intermediate_size=128,
                moe_intermediate_size=32,
                num_hidden_layers=2,
                num_attention_heads=4,
                num_key_value_heads=4,
                kv_lora_rank=16,
                q_lora_rank=None,
                qk_rope_head_dim=8,
                qk_nope_head_dim=16,
                v_head_dim=16,
                n_routed_experts=4,
                num_experts_per_tok=2,
                first_k_dense_replace=1,
            ),
            "multi-head latent attention",
        ),
        # Gemma 4: full-attention layers with their own head size (one cache shape for all layers:
        # failed at the first step with "key has head_size 32 but key_cache has head_size 16")
        (dict(GEMMA4, global_head_dim=32), r"different head sizes \(layer 0: 16, layer 1: 32\)"),
    ],
)
def test_attention_the_op_cannot_run_is_refused_when_the_model_is_built(config, message):
    with pytest.raises(NotImplementedError, match=message):
        LLM(hf_model_from_config(hf_config(config)), backend="eager")


@pytest.mark.parametrize(
    "model_type, extra",
    [
        ("gpt2", dict(n_embd=64, n_layer=2, n_head=4, n_positions=128)),
        ("gpt_neox", dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4)),
        ("opt", dict(hidden_size=64, ffn_dim=128, num_hidden_layers=2, num_attention_heads=4, word_embed_proj_dim=64)),
    ],
)
def test_multi_head_attention_configs_without_kv_heads_run(model_type, extra):
    """GPT-2, GPT-NeoX and OPT configs have no num_key_value_heads: AttributeError before."""
    model = hf_model_from_config(hf_config(dict(model_type=model_type, vocab_size=512, **extra)))
    check_parity(model)


@pytest.mark.parametrize(
    "config",
    [
        # GPT-J's and Falcon's attention have layer_idx and is_causal but never call transformers'
        # attention interface: GPT-J's tokens were silently wrong, Falcon failed with a TypeError
        dict(model_type="gptj", vocab_size=256, n_embd=64, n_layer=2, n_head=4, rotary_dim=8),
        dict(
            model_type="falcon",
            vocab_size=256,
            hidden_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            new_decoder_architecture=True,
            num_kv_heads=2,
        ),
    ],
)
def test_attention_that_bypasses_the_interface_is_refused_when_built(config):
    with pytest.raises(
        NotImplementedError,
        match=r"does not go through transformers' attention interface.*"
        r"torch.compile\(model, backend='qaic'\) still compiles it",
    ):
        LLM(hf_model_from_config(hf_config(config)), backend="eager")


def test_a_layer_that_skips_its_kv_update_fails_the_step():
    """The engine's per-step check, for any model (here a reference Llama whose second
    layer's attention is replaced by one that never writes its cache)."""
    from qaic_dynamo.models import QaicLlamaConfig, QaicLlamaForCausalLM

    model = QaicLlamaForCausalLM(
        QaicLlamaConfig(
            num_hidden_layers=2,
            hidden_size=64,
            intermediate_size=128,
            num_attention_heads=4,
            num_key_value_heads=2,
            vocab_size=256,
        )
    ).eval()
    llm = LLM(model, backend="eager")
    attn = llm.model.layers[1].self_attn
    attn.forward = lambda x, cos, sin: torch.zeros_like(x)
    with pytest.raises(RuntimeError, match="wrote the KV cache of 1 of its 2 attention layers"):
        llm.generate(PROMPTS, 2)


def test_a_stateful_class_built_with_attention_layers_only_runs():
    """GraniteMoeHybrid is flagged stateful as a class; built with attention layers only
    (Granite 4.0 micro's shape) it has no recurrent mixer and runs - a class-flag check
    refused it."""
    model = hf_model_from_config(
        hf_config(
            dict(
                model_type="granitemoehybrid",
                vocab_size=512,
                hidden_size=64,
                intermediate_size=128,
                shared_intermediate_size=128,
                num_hidden_layers=2,
                num_attention_heads=4,
                num_key_value_heads=2,
                num_local_experts=0,
                num_experts_per_tok=0,
                layer_types=["attention", "attention"],
                position_embedding_type="rope",
                mamba_n_heads=4,
                mamba_d_state=16,
                pad_token_id=0,
            )
        )
    )
    check_parity(model)


def smollm3(layers):
    from transformers import SmolLM3Config

    # Every 4th layer has no RoPE (no_rope_layers[i] == 0), as in SmolLM3.
    return hf_model_from_config(
        SmolLM3Config(
            num_hidden_layers=layers, no_rope_layer_interval=4, pad_token_id=0, bos_token_id=1, eos_token_id=2, **SMALL
        )
    )


@pytest.mark.parametrize("layers", [4, 8])
def test_layers_without_rope_get_their_own_pieces_and_never_a_wrong_share(layers):
    model = smollm3(layers)
    assert 0 in model.config.no_rope_layers and 1 in model.config.no_rope_layers
    check_parity(
        model,
        counts=dict(
            num_graphs_seen=2 + 4,  # the block per kind (with and without RoPE); embed, rotary, norm, head
            # each kind lowers its own two pieces: RoPE is in the pre-attention piece, and the
            # no-RoPE block's graph takes no cos/sin, so its post-attention piece's inputs differ
            # too (never a share across kinds); 2 x 2 block pieces + 4 regions, whatever the depth
            num_backend_compilations=2 * 2 + 4,
        ),
    )


def onnx_of_every_piece(out_dir):
    """The ONNX bytes of every piece of the families and the MLA model (regional, as LLM
    compiles them), lowered afresh into ``out_dir``; keyed by model and fingerprint (the
    graph numbers in the paths count on across runs)."""
    from qaic_dynamo.cache import artifact_cache
    from qaic_dynamo.models import QaicMLAConfig, QaicMLAForCausalLM

    torch._dynamo.reset()
    artifact_cache.clear_memory()
    for name, make in {
        "gemma2": lambda: gemma2(2),
        "gpt_oss": lambda: gpt_oss(2),
        "qwen2_moe": lambda: qwen2_moe(2),
        "mla": lambda: QaicMLAForCausalLM(QaicMLAConfig(num_hidden_layers=2)).eval(),
    }.items():
        torch.manual_seed(0)
        llm = LLM(make(), backend="qaic", compile_options={"cache": False, "dump_dir": str(out_dir / name)})
        with compilation_counter.expect(num_exporter_fallbacks=0, num_eager_fallbacks=0):  # the path compared
            llm.generate(PROMPTS, 2)
    return {
        (p.relative_to(out_dir).parts[0], p.stem.rsplit("_", 1)[-1]): p.read_bytes()
        for p in sorted(out_dir.rglob("*.onnx"))
    }


@pytest.mark.slow  # ~1 min: every family compiled twice; `make test-all` runs it
def test_every_piece_lowers_to_the_same_onnx_with_torch_onnxs_full_decomposition_table(tmp_path, monkeypatch):
    """lowering.decompositions leaves out the CompositeImplicitAutograd entries of
    torch.onnx's table (make_fx runs those kernels itself): the ONNX of every piece must
    be byte-identical to what the full table gives."""
    from qaic_dynamo._compat import torch_onnx_internals
    from qaic_dynamo.lowering import aten_trace, registry

    ours = onnx_of_every_piece(tmp_path / "ours")
    onnx_decomp = torch_onnx_internals().decomp
    full = onnx_decomp.create_onnx_friendly_decomposition_table(
        set(onnx_decomp.get_onnx_implemented_overloads(registry.onnx_registry(18)))
    )
    monkeypatch.setattr(aten_trace, "decompositions", lambda opset: full)
    theirs = onnx_of_every_piece(tmp_path / "full")
    assert len(ours) >= 15 and ours.keys() == theirs.keys()  # 19 here: identical regions are lowered once
    assert [str(k) for k in ours if ours[k] != theirs[k]] == []


@pytest.mark.slow  # ~1 min: every family compiled twice; `make test-all` runs it
def test_every_piece_lowers_to_the_same_onnx_with_the_fake_tensor_cache_on(tmp_path, monkeypatch):
    """lowering.fake_inputs turns the fake-tensor dispatch cache off (it costs more than it
    saves in a single trace): a pure speed setting, so the ONNX of every piece must be
    byte-identical to what a trace with the cache gives."""
    from qaic_dynamo.lowering import aten_trace

    ours = onnx_of_every_piece(tmp_path / "uncached")
    uncached = aten_trace.fake_inputs

    def cached(*args, **kwargs):
        fakes = uncached(*args, **kwargs)
        assert fakes and not fakes[0].fake_mode.cache_enabled
        fakes[0].fake_mode.cache_enabled = True
        return fakes

    monkeypatch.setattr(aten_trace, "fake_inputs", cached)
    theirs = onnx_of_every_piece(tmp_path / "cached")
    assert len(ours) >= 15 and ours.keys() == theirs.keys()
    # Where a decomposition's dead intermediates are numbered differently (Gemma2's gelu
    # piece: mul_17 against mul_19), only the names of values inside the graph differ.
    differ = [k for k in ours if ours[k] != theirs[k]]
    assert [str(k) for k in differ if with_canonical_names(ours[k]) != with_canonical_names(theirs[k])] == []


def with_canonical_names(model_bytes):
    """The model with every node, and every value the graph computes, renamed by its
    position, and without the nodes' debug metadata (which quotes the FX nodes): two
    graphs equal but for those names serialise to the same bytes."""
    import onnx

    model = onnx.load_from_string(model_bytes)
    graph = model.graph
    names = {}
    for i, node in enumerate(graph.node):
        node.name = f"n{i}"
        del node.metadata_props[:]
        for j, out in enumerate(node.output):
            if out and out not in {o.name for o in graph.output}:
                names[out] = f"v{i}_{j}"
    for node in graph.node:
        node.input[:] = [names.get(x, x) for x in node.input]
        node.output[:] = [names.get(x, x) for x in node.output]
    for info in graph.value_info:
        info.name = names.get(info.name, info.name)
    return model.SerializeToString()


def phi3_longrope():
    from transformers import Phi3Config

    return hf_model_from_config(
        Phi3Config(
            vocab_size=512,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=128,
            original_max_position_embeddings=32,
            pad_token_id=0,
            rope_parameters={
                "rope_type": "longrope",
                "rope_theta": 10000.0,
                "short_factor": [1.0] * 8,
                "long_factor": [8.0] * 8,
                "original_max_position_embeddings": 32,
            },
        )
    )


def llama_dynamic_rope():
    return hf_model_from_config(
        hf_config(
            dict(
                model_type="llama",
                max_position_embeddings=32,
                **SMALL,
                num_hidden_layers=2,
                rope_parameters={"rope_type": "dynamic", "factor": 4.0, "rope_theta": 10000.0},
            )
        )
    )


def gemma3_multimodal_dynamic_rope():
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    torch.manual_seed(0)
    rope = {
        "full_attention": {"rope_type": "dynamic", "rope_theta": 1e6, "factor": 4.0},
        "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
    }
    return Gemma3ForConditionalGeneration(
        Gemma3Config(
            text_config=dict(
                vocab_size=300,
                hidden_size=64,
                intermediate_size=128,
                num_hidden_layers=2,
                num_attention_heads=4,
                num_key_value_heads=2,
                head_dim=16,
                max_position_embeddings=32,
                rope_parameters=rope,
                sliding_window=512,
                layer_types=["sliding_attention", "full_attention"],
            ),
            vision_config=dict(
                hidden_size=32,
                intermediate_size=64,
                num_hidden_layers=1,
                num_attention_heads=2,
                image_size=28,
                patch_size=14,
            ),
            mm_tokens_per_image=4,
            image_token_index=299,
            boi_token_index=297,
            eoi_token_index=298,
        )
    ).eval()


BATCH_ROPE_REFUSED = (
    "takes its frequencies from the longest sequence in a forward once it passes 32 tokens.*"
    "max_model_len <= 32, or max_num_seqs=1"
)


@pytest.mark.parametrize("build, kind", [(phi3_longrope, "longrope"), (llama_dynamic_rope, "dynamic")])
def test_rope_that_depends_on_the_longest_sequence_is_batched_only_within_the_trained_length(build, kind):
    # transformers picks these frequencies from max(position_ids) + 1 of the forward once
    # it passes 32 here: a 60-token request batched with a 5-token one changed the short
    # one's tokens.
    model = build()
    with pytest.raises(ValueError, match=f"rope_type '{kind}' {BATCH_ROPE_REFUSED}"):
        LLM(model, backend="eager", max_num_seqs=2, max_model_len=128)
    prompts = [list(range(1, 61)), [5, 6, 7, 8, 9]]  # past and within the original 32 positions
    llm = LLM(model, backend="qaic", max_num_seqs=1, max_model_len=128)
    assert [llm.generate([p], 4)[0] for p in prompts] == [hf_generate(model, p, 4) for p in prompts]
    short = [[5, 6, 7, 8, 9], [11, 12, 13]]  # batched within the trained length: as transformers
    assert LLM(model, backend="qaic", max_num_seqs=2, max_model_len=32).generate(short, 4) == [
        hf_generate(model, p, 4) for p in short
    ]


def test_a_multimodal_models_rope_is_read_from_its_text_config():
    # Gemma3ForConditionalGeneration keeps positions and RoPE in its text config: the
    # check read the top-level config and let the batch change a short request's logits.
    from qaic_dynamo.models import load_model, model_config

    model = gemma3_multimodal_dynamic_rope()
    with pytest.raises(ValueError, match=f"rope_type 'dynamic' {BATCH_ROPE_REFUSED}"):
        LLM(model, backend="eager", max_num_seqs=2, max_model_len=128)
    engine_model = load_model(model)
    assert model_config(engine_model).max_position_embeddings == 32
    assert model_config(engine_model, text=False).image_token_index == 299  # the export hashes all of it
