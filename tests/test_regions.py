"""qaic_dynamo.compile: every repeated decoder block is traced once, whatever the depth,
and gives what the whole-model compile and eager give."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import qaic_dynamo
from qaic_dynamo import LLM, compilation_counter
from qaic_dynamo.config import ConfigError
from qaic_dynamo.models import QaicLlamaConfig, QaicLlamaForCausalLM, QaicMLAConfig, QaicMLAForCausalLM
from qaic_dynamo.regions import CompiledRegion, find_repeated_blocks, plan_regions

PROMPTS = [[3, 14, 15, 92, 65], [35, 89], [79, 32, 38, 46, 26, 43, 38]]


def llama(layers, **kw):
    torch.manual_seed(0)
    cfg = dict(num_hidden_layers=layers, hidden_size=64, intermediate_size=128, num_attention_heads=4,
               num_key_value_heads=2)
    cfg.update(kw)
    return QaicLlamaForCausalLM(QaicLlamaConfig(**cfg)).eval()


def engine(model, **kw):
    return LLM(model, max_num_seqs=3, max_model_len=64, **kw)


@pytest.mark.parametrize("L", [2, 8, 32])
def test_the_block_is_traced_once_at_any_depth(L):
    """One Dynamo frame compile for the block at every depth, and no recompiles: the
    number of graphs is the same at 2, 8 and 32 layers."""
    model = llama(L)
    llm = engine(model)  # backend="qaic", regional by default
    breaks = sum(torch._dynamo.utils.counters["graph_break"].values())
    with compilation_counter.expect(
        num_graphs_seen=4,  # the decoder block once, embed_tokens, norm, lm_head
        num_piecewise_graphs_seen=3 + 3,  # block: pre-attention, attention, post-attention; 3 one-piece regions
        num_backend_compilations=5,  # the block's 2 compilable pieces + 3 regions
        num_exporter_fallbacks=0,
        num_eager_fallbacks=0,
    ):
        out = llm.generate(PROMPTS, 6)  # prefill, then decode steps of another token count
    assert out == engine(model, backend="eager").generate(PROMPTS, 6)
    assert sum(torch._dynamo.utils.counters["graph_break"].values()) == breaks, "no graph breaks"


def test_regional_matches_whole_model_and_eager_logits():
    model = llama(4)
    outs = {}
    for name, kw in {"eager": dict(backend="eager"), "whole": dict(regional=False), "regional": {}}.items():
        outs[name] = engine(model, **kw).generate_outputs(PROMPTS, 5, return_logits=True)
    for name in ("whole", "regional"):
        assert [o.token_ids for o in outs[name]] == [o.token_ids for o in outs["eager"]]
        diff = max((a - b).abs().max().item() for o, r in zip(outs[name], outs["eager"])
                   for a, b in zip(o.logits, r.logits))
        assert diff < 1e-4, (name, diff)


def test_mla_regional_matches_eager():
    torch.manual_seed(0)
    model = QaicMLAForCausalLM(QaicMLAConfig(num_hidden_layers=4)).eval()
    with compilation_counter.expect(num_graphs_seen=4, num_eager_fallbacks=0, num_exporter_fallbacks=0):
        got = engine(model).generate(PROMPTS, 5)
    assert got == engine(model, backend="eager").generate(PROMPTS, 5)


def test_per_layer_names_in_a_block_are_refused_by_dynamo_not_silently_wrong():
    """With real layer names (the baseline) a traced block reads a per-layer constant:
    Dynamo re-traces it per layer. It stays correct; the point of the magic name is that
    this does not happen."""
    model = llama(3)
    with compilation_counter.expect(num_graphs_seen=3 + 3):  # one block graph per layer + 3 regions
        got = engine(model, layer_agnostic_kv_update=False).generate(PROMPTS, 3)
    assert got == engine(model, backend="eager").generate(PROMPTS, 3)


def test_plan_finds_blocks_and_the_rest():
    model = llama(3)
    plan = plan_regions(model)
    assert [path for path, _ in plan.blocks] == ["layers"]
    assert [path for _, _, path in plan.rest] == ["embed_tokens", "norm", "lm_head"]


def test_nested_lists_belong_to_their_block():
    class Inner(nn.Module):
        def __init__(self):
            super().__init__()
            self.experts = nn.ModuleList(nn.Linear(4, 4) for _ in range(3))

        def forward(self, x):
            return sum(e(x) for e in self.experts)

    class Outer(nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = nn.ModuleList(Inner() for _ in range(2))
            self.head = nn.Linear(4, 2)

        def forward(self, x):
            for b in self.blocks:
                x = b(x)
            return self.head(x)

    assert [p for p, _ in find_repeated_blocks(Outer())] == ["blocks"]


def test_a_model_without_repeated_blocks_is_a_clear_error():
    with pytest.raises(ValueError, match="has no repeated blocks.*torch.compile\\(model, backend='qaic'\\)"):
        qaic_dynamo.compile(nn.Sequential(nn.Linear(2, 2), nn.ReLU()))


def test_bad_options_are_refused_before_anything_compiles():
    with pytest.raises(ConfigError, match=r"unknown qaic option\(s\) \['fallbak'\]"):
        qaic_dynamo.compile(llama(2), fallbak="error")


def test_compiled_region_reads_through_to_the_block():
    model = qaic_dynamo.compile(llama(2))
    region = model.layers[0]
    assert isinstance(region, CompiledRegion)
    assert region.self_attn is region.module.self_attn  # the model's Python may read block attributes
    assert model.kv_cache_layers == ["model.layers.0.self_attn", "model.layers.1.self_attn"]


def test_compiling_twice_is_a_clear_error():
    model = qaic_dynamo.compile(llama(2))
    with pytest.raises(ValueError, match="already compiled region by region"):
        qaic_dynamo.compile(model)


def test_state_dict_keys_survive_regional_compile():
    model = llama(2)
    before = model.state_dict()
    qaic_dynamo.compile(model)
    after = model.state_dict()
    assert list(after) == list(before) and all(after[k] is not None and after[k].equal(before[k]) for k in before)
    # A checkpoint of the uncompiled model loads into the compiled one (and into every layer).
    other = llama(2)
    with torch.no_grad():
        for p in other.parameters():
            p.add_(1.0)
    model.load_state_dict(other.state_dict())
    assert model.layers[1].module.down_proj.weight.equal(other.layers[1].down_proj.weight)
    assert model.lm_head.module.weight.equal(other.lm_head.weight)


@pytest.mark.parametrize("L", [2, 4])
def test_a_block_runner_keeps_every_layers_weights_bound(L):
    """One runner serves every layer of the block; it keeps one binding per layer (the
    forward context's layer index), so a step re-binds activations, never a layer's weights,
    and no layer's binding holds another layer's weights."""
    from qaic_dynamo.backend import compile_reports

    model = llama(L)
    llm = engine(model)
    before = len(compile_reports())
    llm.generate(PROMPTS, 3)
    block = next(r for rep in compile_reports()[before:] for r in rep.runners() if r.artifact.layout.kv_updates)
    bound = block.bound_inputs()
    assert sorted(bound) == list(range(L))  # one binding per layer
    (_, blocks), = find_repeated_blocks(llm.model)  # the CompiledRegion wrappers
    layers = [dict(m.named_parameters()) for m in blocks]
    owner = {p.data_ptr(): i for i, params in enumerate(layers) for p in params.values()}
    for slot, inputs in bound.items():
        weights = {owner[ptr] for ptr in inputs.values() if ptr in owner}
        assert weights == {slot}, (slot, weights)
