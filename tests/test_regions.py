"""qaic_dynamo.compile: every repeated decoder block is traced once, whatever the depth,
and gives what the whole-model compile and eager give. Guarded dispatch - how a compiled
block is entered at each call - is in test_region_dispatch.py."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from region_models import PROMPTS, Stack, engine, llama

import qaic_dynamo
from qaic_dynamo import LLM, compilation_counter
from qaic_dynamo.compiler.regions import CompiledRegion, find_repeated_blocks, plan_regions
from qaic_dynamo.config import ConfigError
from qaic_dynamo.models import QaicMLAConfig, QaicMLAForCausalLM


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


def test_a_model_dimension_that_equals_the_batch_is_not_made_dynamic():
    """Every tensor dimension equal to the token or sequence count was marked dynamic:
    GPT-NeoX's rotary width (4 of its 16 head dims) at a first batch of 4 sequences became
    a symbol, and the block's piece failed to lower (it ran eagerly)."""
    from qaic_dynamo.models import hf_config, hf_model_from_config

    model = hf_model_from_config(
        hf_config(
            dict(
                model_type="gpt_neox",
                vocab_size=256,
                num_hidden_layers=2,
                hidden_size=64,
                num_attention_heads=4,
                intermediate_size=128,
                max_position_embeddings=256,
            )
        )
    )
    prompts = [[5, 6, 7], [6, 6, 7], [7, 6, 7], [8, 6, 7]]
    llm = LLM(model, max_num_seqs=4, max_model_len=64)
    with compilation_counter.expect(
        num_graphs_seen=5,  # the block once (for prefill and decode), embeddings, rotary embedding, norm, head
        num_eager_fallbacks=0,
        num_exporter_fallbacks=0,
    ):
        out = llm.generate(prompts, 3)
    assert out == LLM(model, backend="eager", max_num_seqs=4, max_model_len=64).generate(prompts, 3)


def test_regional_matches_whole_model_and_eager_logits():
    model = llama(4)
    outs = {}
    for name, kw in {"eager": dict(backend="eager"), "whole": dict(regional=False), "regional": {}}.items():
        outs[name] = engine(model, **kw).generate_outputs(PROMPTS, 5, return_logits=True)
    for name in ("whole", "regional"):
        assert [o.token_ids for o in outs[name]] == [o.token_ids for o in outs["eager"]]
        diff = max(
            (a - b).abs().max().item() for o, r in zip(outs[name], outs["eager"]) for a, b in zip(o.logits, r.logits)
        )
        assert diff < 1e-4, (name, diff)


def test_mla_regional_matches_eager():
    torch.manual_seed(0)
    model = QaicMLAForCausalLM(QaicMLAConfig(num_hidden_layers=4)).eval()
    with compilation_counter.expect(num_graphs_seen=4, num_eager_fallbacks=0, num_exporter_fallbacks=0):
        got = engine(model).generate(PROMPTS, 5)
    assert got == engine(model, backend="eager").generate(PROMPTS, 5)


@pytest.mark.parametrize("regional", [True, False], ids=["regional", "whole"])
def test_a_second_model_of_the_same_class_with_another_float_is_compiled_too(regional):
    """Two models sharing the block class, rms_norm eps 1e-5 and 1e-6: the second one's
    recompile keeps the eps a constant (LLM compiles with floats specialised), so it is
    lowered like the first, not run eagerly."""
    for eps in (1e-5, 1e-6):
        model = llama(2, rms_norm_eps=eps)
        with compilation_counter.expect(num_eager_fallbacks=0, num_exporter_fallbacks=0):
            got = engine(model, regional=regional).generate(PROMPTS, 3)
        assert got == engine(model, backend="eager").generate(PROMPTS, 3)


@pytest.mark.parametrize("regional", [True, False], ids=["regional", "whole"])
def test_dynamo_traces_regions_without_its_fake_tensor_cache_and_whole_models_with_it(regional, monkeypatch):
    """A region's graph holds each op about once: Dynamo traces it with its fake-tensor
    cache off (regions.region_config). A whole model's layers repeat: cache on."""
    from qaic_dynamo.lowering import piece

    seen, prepare = [], piece.prepare

    def recording(gm, example_args, fake_mode):  # fake_mode: the one Dynamo traced in
        seen.append(fake_mode.cache_enabled)
        return prepare(gm, example_args, fake_mode)

    monkeypatch.setattr(piece, "prepare", recording)
    model = llama(2)
    before = (torch._dynamo.config.fake_tensor_cache_enabled, torch._dynamo.config.specialize_float)
    got = engine(model, regional=regional, compile_options={"cache": False}).generate(PROMPTS, 3)
    assert seen and set(seen) == {not regional}
    # The compile's config was a patch: the caller's is untouched afterwards.
    assert (torch._dynamo.config.fake_tensor_cache_enabled, torch._dynamo.config.specialize_float) == before
    assert got == engine(model, backend="eager").generate(PROMPTS, 3)


def test_regions_compile_with_the_collector_paused():
    """Dynamo's trace of a region, not only the backend, runs with Python's cyclic collector
    off (backend.collector_paused); it is on again afterwards."""
    import gc

    from torch._dynamo.callback import callback_handler

    seen = []

    def on_start(*args):
        seen.append(gc.isenabled())

    plan = plan_regions(llama(2))
    callback_handler.register_start_callback(on_start)
    try:
        got = engine(llama(2), compile_options={"cache": False}).generate(PROMPTS, 2)
    finally:
        callback_handler.remove_start_callback(on_start)
    assert len(seen) == len(plan.blocks) + len(plan.rest) and not any(seen)  # one frame compile per region
    assert gc.isenabled()
    assert got == engine(llama(2), backend="eager").generate(PROMPTS, 2)


@pytest.mark.parametrize("precompile", [True, False])
def test_regions_trace_without_dynamos_guard_latency_profile_unless_a_guards_log_shows_it(precompile, monkeypatch):
    """Dynamo times one guard evaluation of every frame it compiles after flushing the CPU
    caches (~16 ms a region, for a log line and a metric). Regions skip it - both the
    traced and the saved-trace path - and put Dynamo's function back; a plain
    torch.compile keeps it, and so do regions while Dynamo's guards log is on."""
    from torch._dynamo import guards

    profiled = []
    original = guards.profile_guard_manager

    def profile(*args):
        profiled.append(args)
        return original(*args)

    monkeypatch.setattr(guards, "profile_guard_manager", profile)
    torch._dynamo.reset()
    opts = {"cache": False} if not precompile else {}
    got = engine(llama(2), compile_options=opts).generate(PROMPTS, 2)
    assert profiled == [] and guards.profile_guard_manager is profile
    assert got == engine(llama(2), backend="eager").generate(PROMPTS, 2)

    torch.compile(lambda x: x + 1, backend="eager")(torch.ones(2))
    assert len(profiled) == 1

    torch._dynamo.reset()
    torch._logging.set_logs(guards=True)
    try:
        engine(llama(2), compile_options=opts).generate(PROMPTS, 2)
    finally:
        torch._logging.set_logs()
    assert len(profiled) > 1


def test_a_structured_trace_keeps_dynamos_guard_latency_profile(tmp_path):
    from torch._dynamo import guards
    from torch._logging._internal import LazyTraceHandler, trace_log

    from qaic_dynamo._compat import guard_latency_profile_off, guard_latency_profile_restore

    original = guards.profile_guard_manager
    handler = LazyTraceHandler(str(tmp_path))  # what TORCH_TRACE=<dir> installs
    trace_log.addHandler(handler)
    try:
        assert guard_latency_profile_off() is None and guards.profile_guard_manager is original
    finally:
        trace_log.removeHandler(handler)
    token = guard_latency_profile_off()
    assert token is original and guards.profile_guard_manager is not original
    assert guard_latency_profile_off() is None  # already off: nothing to put back twice
    guard_latency_profile_restore(token)
    assert guards.profile_guard_manager is original


def test_a_guard_latency_profile_replaced_meanwhile_is_not_overwritten(monkeypatch):
    from torch._dynamo import guards

    from qaic_dynamo._compat import guard_latency_profile_off, guard_latency_profile_restore

    original = guards.profile_guard_manager
    token = guard_latency_profile_off()

    def theirs(*args):  # a profiler's, installed while a region held the no-op
        return original(*args)

    monkeypatch.setattr(guards, "profile_guard_manager", theirs)
    guard_latency_profile_restore(token)
    assert guards.profile_guard_manager is theirs


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


def test_attributes_set_on_a_compiled_layer_reach_the_layer():
    model = Stack(2)
    qaic_dynamo.compile(model)
    layer = model.layers[1]
    layer.act = False
    assert layer.module.act is False and "act" not in layer.__dict__
    layer.extra = 3
    assert layer.module.extra == 3 and layer.extra == 3
    del layer.extra
    assert not hasattr(layer.module, "extra")
    model.eval()  # nn.Module's own fields stay the wrapper's (and train/eval reach the layer)
    assert layer.training is False and layer.module.training is False


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


def test_copying_or_pickling_a_compiled_model_says_what_works(tmp_path):
    # It failed deep inside pickle ("cannot pickle 'module' object"; found by review).
    import copy

    model = llama(2)
    qaic_dynamo.compile(model)
    for copier in (copy.deepcopy, lambda m: torch.save(m, tmp_path / "m.pt")):
        with pytest.raises(TypeError, match="deepcopy or torch.save the model before compiling it"):
            copier(model)
    torch.save(model.state_dict(), tmp_path / "sd.pt")  # what works instead
    model.load_state_dict(torch.load(tmp_path / "sd.pt"))


@pytest.mark.parametrize("L", [2, 4])
def test_a_block_runner_serves_every_layer_from_one_binding_per_thread(L, monkeypatch):
    """One runner serves every layer of the block through one ONNX Runtime binding per
    thread, which each call re-binds to its own layer's weights. A binding per layer,
    made in each layer's first call, split the memory the previous layer's outputs freed,
    so every output of a first forward took fresh pages (docs/benchmarks.md)."""
    from collections import Counter

    from qaic_dynamo.compiler import compile_reports
    from qaic_dynamo.runtime import runner as runner_module

    made = Counter()
    original = runner_module._ThreadBinding

    class Counted(original):
        def __init__(self, session):
            made[id(session)] += 1
            super().__init__(session)

    monkeypatch.setattr(runner_module, "_ThreadBinding", Counted)
    model = llama(L)
    llm = engine(model)
    before = len(compile_reports())
    llm.generate(PROMPTS, 3)
    runners = [r for rep in compile_reports()[before:] for r in rep.runners() if r.artifact.session is not None]
    assert made and set(made.values()) == {1}, made  # one binding per runner on this thread
    assert {id(r.artifact.session) for r in runners} >= set(made)
    block = next(r for r in runners if r.artifact.layout.kv_updates)
    ((_, blocks),) = find_repeated_blocks(llm.model)  # the CompiledRegion wrappers
    layers = [dict(m.named_parameters()) for m in blocks]
    owner = {p.data_ptr(): i for i, params in enumerate(layers) for p in params.values()}
    weights = {owner[ptr] for ptr in block.bound_inputs().values() if ptr in owner}
    assert weights == {L - 1}  # bound to the last layer called, and to no other layer's weights


class Wraps(nn.Module):
    def __init__(self):
        super().__init__()
        self.module = nn.Linear(8, 8)  # the wrapper's own attribute name

    def forward(self, x):
        return self.module(x)


class WrapsStack(nn.Module):
    def __init__(self, seed):
        super().__init__()
        torch.manual_seed(seed)
        self.layers = nn.ModuleList(Wraps() for _ in range(2))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def test_a_block_with_a_submodule_named_module_loads_its_checkpoint():
    src, dst = WrapsStack(0), WrapsStack(1)
    qaic_dynamo.compile(dst)
    assert list(dst.state_dict()) == list(src.state_dict())
    dst.load_state_dict(src.state_dict())  # strict: every key found (was missing/unexpected)
    assert dst.layers[1].module.module.weight.equal(src.layers[1].module.weight)
    src.load_state_dict(dst.state_dict())


def test_a_state_dict_keyed_like_the_compiled_models_parameters_loads_too():
    src, dst = Stack(), Stack()
    with torch.no_grad():
        for p in src.parameters():
            p.add_(1.0)
    qaic_dynamo.compile(src)
    qaic_dynamo.compile(dst)
    named = {k: v.detach().clone() for k, v in src.named_parameters()}  # layers.0.module.proj.weight, ...
    assert any(".module." in k for k in named)
    dst.load_state_dict(named)  # strict
    assert dst.layers[1].module.proj.weight.equal(src.layers[1].module.proj.weight)
