"""qaic_dynamo.compile: every repeated decoder block is traced once, whatever the depth,
and gives what the whole-model compile and eager give."""

from __future__ import annotations

import re
from contextlib import nullcontext

import pytest
import torch
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode

import qaic_dynamo
from qaic_dynamo import LLM, compilation_counter
from qaic_dynamo.compiler.regions import CompiledRegion, find_repeated_blocks, plan_regions
from qaic_dynamo.config import ConfigError
from qaic_dynamo.models import QaicLlamaConfig, QaicLlamaForCausalLM, QaicMLAConfig, QaicMLAForCausalLM
from qaic_dynamo.runtime import PieceRunner

PROMPTS = [[3, 14, 15, 92, 65], [35, 89], [79, 32, 38, 46, 26, 43, 38]]


def llama(layers, **kw):
    torch.manual_seed(0)
    cfg = dict(
        num_hidden_layers=layers, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2
    )
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
def test_a_block_runner_keeps_every_layers_weights_bound(L):
    """One runner serves every layer of the block; it keeps one binding per layer (the
    forward context's layer index), so a step re-binds activations, never a layer's weights,
    and no layer's binding holds another layer's weights."""
    from qaic_dynamo.compiler import compile_reports

    model = llama(L)
    llm = engine(model)
    before = len(compile_reports())
    llm.generate(PROMPTS, 3)
    block = next(r for rep in compile_reports()[before:] for r in rep.runners() if r.artifact.layout.kv_updates)
    bound = block.bound_inputs()
    assert sorted(bound) == list(range(L))  # one binding per layer
    ((_, blocks),) = find_repeated_blocks(llm.model)  # the CompiledRegion wrappers
    layers = [dict(m.named_parameters()) for m in blocks]
    owner = {p.data_ptr(): i for i, params in enumerate(layers) for p in params.values()}
    for slot, inputs in bound.items():
        weights = {owner[ptr] for ptr in inputs.values() if ptr in owner}
        assert weights == {slot}, (slot, weights)


# --- guarded dispatch: Dynamo's cache, Dynamo's guards, without Dynamo's per-call entry ---


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


class Scaled(nn.Module):
    """A block whose forward branches on a plain attribute: Dynamo guards on its value."""

    def __init__(self, width):
        super().__init__()
        self.proj = nn.Linear(width, width)
        self.act = True

    def forward(self, x):
        y = self.proj(x)
        return torch.relu(y) if self.act else torch.tanh(y)


class Stack(nn.Module):
    def __init__(self, layers=3, width=8):
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(width, width)
        self.layers = nn.ModuleList(Scaled(width) for _ in range(layers))

    def forward(self, x):
        x = self.inp(x)
        for layer in self.layers:
            x = layer(x)
        return x


def compiled_stack(layers=2, **options):
    """(the stack compiled region by region, an uncompiled copy, an input)."""
    import copy

    model = Stack(layers)
    ref = copy.deepcopy(model)
    # These tests pin down how regions use Dynamo's own entries; saved traces, which a
    # region runs before those, have tests of their own (test_precompile.py).
    qaic_dynamo.compile(model, **{"precompile": False, **options})
    x = torch.randn(4, 8)
    return model, ref, x


def test_more_models_of_one_block_class_than_dynamos_recompile_limit_all_compile(monkeypatch):
    # Models of one block class share its forward's code object (transformers: every decoder
    # class shares forward_with_checkpointing); past Dynamo's limit of 8 entries the next
    # model's layers ran eagerly with no qaic warning and no fallback counted (found by review).
    from torch.utils._python_dispatch import TorchDispatchMode

    class PassThrough(TorchDispatchMode):  # Dynamo skips frames under a dispatch mode
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    with torch.no_grad():
        for width in range(8, 8 + 2 * 10, 2):  # ten shapes: ten entries for Scaled.forward
            model = Stack(2, width)
            x = torch.randn(3, width)
            want = model(x)
            qaic_dynamo.compile(model, cache=False)
            with compilation_counter.expect(num_eager_fallbacks=0, num_graphs_seen=2):  # inp and the block
                torch.testing.assert_close(model(x), want)
        # A miss Dynamo skips is no limit reached (the check read Dynamo's 8 outside the region's config).
        with compilation_counter.expect(num_eager_fallbacks=0), PassThrough():
            model(torch.randn(5, width))
        # Past the region limit it is said, and counted.
        from qaic_dynamo.compiler.regions import settings

        monkeypatch.setattr(settings, "REGION_RECOMPILE_LIMIT", 2)
        torch._dynamo.reset()
        with torch._dynamo.config.patch(recompile_limit=2):
            for width in (8, 10, 12):
                model = Stack(2, width)
                x = torch.randn(3, width)
                want = model(x)
                qaic_dynamo.compile(model, cache=False)
                with pytest.warns(RuntimeWarning, match="Dynamo's recompile limit") if width == 12 else nullcontext():
                    torch.testing.assert_close(model(x), want)


def test_blocks_run_dynamos_code_after_its_guards_pass():
    """After the first call compiles the block, every later layer call runs the cached
    code through the block's own guard check; so does the region beside the blocks (its
    entry function's frame) once it is compiled."""
    L = 3
    model, ref, x = compiled_stack(L)
    with torch.no_grad():
        with compilation_counter.expect(
            num_guarded_region_calls=L - 1,  # layer 0 compiled the block; layers 1, 2 reuse it
            num_dynamo_region_calls=1 + 1,  # inp, and the block's first call
            num_graphs_seen=2,  # the block, inp
        ):
            got = model(x)
        with compilation_counter.expect(
            num_guarded_region_calls=L + 1,  # every layer, and inp
            num_dynamo_region_calls=0,
            num_graphs_seen=0,
        ):
            again = model(x)
        want = ref(x)
    torch.testing.assert_close(got, want)
    assert torch.equal(again, got)


def test_a_block_runs_only_entries_of_its_own_backend():
    """Two models of one block class share the block's code object, so Dynamo's cache
    holds both compiles' entries. A block compiled with other options (another backend,
    by ``torch.compile``'s equality) never runs the other model's entry; blocks compiled
    with equal options do (each block has a wrapper of its own: matched by equality)."""
    a, ref, x = compiled_stack(3)
    b, _, _ = compiled_stack(3, num_threads=1)
    with torch.no_grad():
        a(x)
        with compilation_counter.expect(
            num_guarded_region_calls=2,  # b's layers 1 and 2 run b's new entry
            num_dynamo_region_calls=1 + 1,  # b's inp, and b's layer 0: a's entry is not b's backend
            num_graphs_seen=2,  # the block again for b's backend, b's inp
        ):
            got = b(x)
        with compilation_counter.expect(
            num_guarded_region_calls=2 * (3 + 1),  # every layer and inp, of a and of b
            num_dynamo_region_calls=0,
            num_graphs_seen=0,
        ):
            a(x)
            again = b(x)
    blocks = [blk.dispatch for blk in list(a.layers) + list(b.layers)]
    assert blocks[1].backend is not blocks[0].backend and blocks[1].backend == blocks[0].backend
    assert blocks[3].backend != blocks[0].backend
    for _ in range(2):  # the second time from what _same_backend kept
        assert [d._same_backend(blocks[0].backend) for d in blocks] == [True] * 3 + [False] * 3
    torch.testing.assert_close(got, ref(x))
    assert torch.equal(again, got)


def test_a_changed_attribute_fails_the_guard_and_recompiles_not_silently_wrong():
    """The guards that protect Dynamo's own dispatch protect this one: a block whose
    ``act`` changed no longer passes, goes through Dynamo, and is recompiled."""
    model, ref, x = compiled_stack()
    with torch.no_grad():
        model(x)
        model.layers[1].act = False
        ref.layers[1].act = False
        with compilation_counter.expect(
            num_guarded_region_calls=1 + 1,  # inp, and layer 0: act still True
            num_dynamo_region_calls=1,  # layer 1: its guard on act fails
            num_graphs_seen=1,  # the block recompiled for act=False
        ):
            got = model(x)
        torch.testing.assert_close(got, ref(x))


def test_grad_mode_and_dtype_are_guarded():
    model, ref, x = compiled_stack()
    with torch.no_grad():
        model(x)
    with compilation_counter.expect(num_guarded_region_calls=1, num_dynamo_region_calls=1 + 1):
        got = model(x)  # grad enabled: the block's global-state guard fails once, then passes
    torch.testing.assert_close(got, ref(x))
    with (
        torch.no_grad(),
        compilation_counter.expect(
            num_guarded_region_calls=1,  # layer 1 passes the fp64 entry layer 0 compiled
            num_dynamo_region_calls=1 + 1,  # inp; layer 0: no fp32 entry passes, Dynamo recompiles
            num_graphs_seen=2,  # inp and the block, for fp64
        ),
    ):
        got = model.double()(x.double())
    torch.testing.assert_close(got, ref.double()(x.double()))
    assert model.layers[0].proj.weight.dtype == torch.float64


def test_hooks_and_stances_go_through_dynamo():
    model, _, x = compiled_stack()
    with torch.no_grad():
        model(x)
        seen = []
        handle = model.layers[1].module.register_forward_hook(lambda m, a, out: seen.append(out.shape))
        with compilation_counter.expect(num_guarded_region_calls=1 + 1, num_dynamo_region_calls=1):
            model(x)  # inp and layer 0 pass; layer 1 has a hook: Dynamo's path runs it
        handle.remove()
        assert seen == [torch.Size([4, 8])]
        with (
            torch.compiler.set_stance("force_eager"),
            compilation_counter.expect(num_guarded_region_calls=0, num_dynamo_region_calls=1 + 2, num_graphs_seen=0),
        ):
            model(x)


class ScaledCall(Scaled):
    """A block class whose own ``__call__`` changes the argument before ``forward``
    (Dynamo runs it; it is kept out of the trace, so ``forward`` is the compiled frame)."""

    @torch.compiler.disable(recursive=False)
    def __call__(self, x):
        return super().__call__(x * 10.0)


def test_a_block_class_with_its_own_call_goes_through_dynamo():
    model = Stack(3)
    model.layers = nn.ModuleList(ScaledCall(8) for _ in range(3))
    import copy

    ref = copy.deepcopy(model)
    qaic_dynamo.compile(model)
    x = torch.randn(4, 8)
    with torch.no_grad():
        want = ref(x)
        model(x)
        with compilation_counter.expect(num_guarded_region_calls=1, num_dynamo_region_calls=3):  # inp; the 3 layers
            got = model(x)
    torch.testing.assert_close(got, want)  # forward's entries alone would skip the x10


class _PassThrough(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


@pytest.fixture
def piece_runs(monkeypatch):
    """A list whose length is the number of ONNX Runtime piece runs since it was cleared."""
    runs = []
    forward = PieceRunner.forward

    def counting(self, *args):
        runs.append(self.label)
        return forward(self, *args)

    monkeypatch.setattr(PieceRunner, "forward", counting)
    return runs


def _skipping(trigger):
    if trigger == "disabled":
        return torch._dynamo.config.patch(disable=True)
    if trigger == "flop_counter":  # a TorchDispatchMode that also sets global module hooks
        from torch.utils.flop_counter import FlopCounterMode

        return FlopCounterMode(display=False)
    return _PassThrough()


@pytest.mark.parametrize("trigger", ["disabled", "dispatch_mode", "flop_counter"])
@pytest.mark.parametrize("dispatch", ["guarded", "dynamo"])
def test_a_code_object_dynamo_skipped_runs_eagerly_in_both_dispatches(dispatch, trigger, piece_runs):
    """A miss Dynamo does not compile (Dynamo disabled, a TorchDispatchMode active) marks
    the code object skipped: Dynamo then runs it eagerly, hits included, until a reset.
    Guarded dispatch cannot read the mark; it sees the miss that added no cache entry and
    leaves the region to Dynamo - so both dispatches run the same pieces at every call."""
    model, ref, x = compiled_stack(region_dispatch=dispatch)
    wide = torch.randn(5, 8)  # no entry passes: size 4 was specialised
    with torch.no_grad():
        model(x)
        with torch._dynamo.config.patch(disable=True):
            piece_runs.clear()
            torch.testing.assert_close(model(x), ref(x))  # a hit still runs Dynamo's entry
            assert len(piece_runs) == 1 + 2  # inp, two layers
        with _skipping(trigger):
            with compilation_counter.expect(
                num_guarded_region_calls=0, num_dynamo_region_calls=1 + 2, num_graphs_seen=0
            ):  # nothing compiled: eager
                torch.testing.assert_close(model(wide), ref(wide))
        piece_runs.clear()
        with compilation_counter.expect(num_guarded_region_calls=0, num_dynamo_region_calls=1 + 2, num_graphs_seen=0):
            torch.testing.assert_close(model(x), ref(x))  # enabled again, guards pass: still eager
        assert piece_runs == []
        torch._dynamo.reset()  # clears the mark with the entries
        guarded = 1 if dispatch == "guarded" else 0  # layer 1 reuses what layer 0 compiled
        with compilation_counter.expect(
            num_dynamo_region_calls=1 + 2 - guarded, num_guarded_region_calls=guarded, num_graphs_seen=2
        ):  # inp, the block
            model(x)
        piece_runs.clear()
        torch.testing.assert_close(model(x), ref(x))
        assert len(piece_runs) == 1 + 2


def test_one_call_with_a_forward_pre_hook_does_not_leave_the_blocks_on_dynamos_path():
    # A pre-hooked call was counted a miss; Dynamo then hit its entry, added none, and the
    # block's code was marked skipped: every layer went through Dynamo for good (~12x slower).
    model, ref, x = compiled_stack(layers=3)
    with torch.no_grad():
        model(x)
        handle = model.layers[1].module.register_forward_pre_hook(lambda m, a: None)
        with compilation_counter.expect(num_guarded_region_calls=1 + 2, num_dynamo_region_calls=1):  # the hooked one
            model(x)
        handle.remove()
        with compilation_counter.expect(num_guarded_region_calls=1 + 3, num_dynamo_region_calls=0):  # inp, 3 layers
            torch.testing.assert_close(model(x), ref(x))


def test_a_skip_mark_belongs_to_its_code_object_not_to_an_equal_one(piece_runs):
    # Two models' region entry functions for one path have equal code objects; the mark
    # Dynamo set on A's must not be cleared by B's first lookup.
    a, ref, x = compiled_stack()
    b, _, _ = compiled_stack()
    assert a.inp.dispatch.code == b.inp.dispatch.code and a.inp.dispatch.code is not b.inp.dispatch.code
    with torch.no_grad():
        a(x)
        with torch._dynamo.config.patch(disable=True):
            a(torch.randn(5, 8))  # a miss Dynamo does not compile: A's code objects marked skipped
        b(x)
        piece_runs.clear()
        torch.testing.assert_close(a(x), ref(x))
        assert piece_runs == []  # as Dynamo: A's code runs eagerly until a reset


class BreaksInSub(nn.Module):
    def __init__(self, width=8):
        super().__init__()
        self.lin = nn.Linear(width, width)

    def forward(self, x):
        torch._dynamo.graph_break()
        return self.lin(x)


class PlainSub(nn.Module):
    def __init__(self, width=8):
        super().__init__()
        self.lin = nn.Linear(width, width)

    def forward(self, x):
        return torch.relu(self.lin(x))


class TailCallBlock(nn.Module):
    """A block whose graph breaks at the call it returns, or at an instruction Dynamo cannot
    trace just before it: Dynamo's entry for ``forward`` has no resume function and runs
    the rest of the frame, ``sub``'s call included, itself."""

    def __init__(self, width=8, step_break=False):
        super().__init__()
        self.proj = nn.Linear(width, width)
        self.sub = PlainSub(width) if step_break else BreaksInSub(width)
        self.step_break = step_break

    def forward(self, x):
        h = self.proj(x) * 2
        if self.step_break:
            torch._dynamo.step_unsupported()
        return self.sub(h)


@pytest.mark.parametrize("step_break", [False, True], ids=["at-call", "at-instruction"])
@pytest.mark.parametrize("dispatch", ["guarded", "dynamo"])
def test_a_block_whose_graph_breaks_at_its_return_call_compiles_the_callee_in_both_dispatches(
    dispatch, step_break, piece_runs
):
    model = Stack(3)
    model.layers = nn.ModuleList(TailCallBlock(step_break=step_break) for _ in range(3))
    import copy

    ref = copy.deepcopy(model)
    qaic_dynamo.compile(model, region_dispatch=dispatch)
    x = torch.randn(4, 8)
    with torch.no_grad():
        model(x)
        model(x)
        piece_runs.clear()
        with compilation_counter.expect(num_graphs_seen=0):
            torch.testing.assert_close(model(x), ref(x))
    # inp, then per layer the graph up to the break and sub's own (its resume function's
    # graph, or its whole forward): run with the callback set, as Dynamo does, not eagerly
    assert len(piece_runs) == 1 + 3 * 2


def test_forward_defaults_changed_in_place_and_a_replaced_code_are_seen():
    """The frame binds the function's current defaults and runs its current code: a
    keyword default changed in place fails the old guards (Dynamo recompiles), and a
    replaced ``__code__`` is compiled anew - never the old entry."""

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = nn.Linear(8, 8)

        def forward(self, x, *, scale=2.0):
            return self.proj(x) * scale

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.inp = nn.Linear(8, 8)
            self.layers = nn.ModuleList(Block() for _ in range(2))

        def forward(self, x):
            x = self.inp(x)
            for layer in self.layers:
                x = layer(x)
            return x

    import copy

    model = Net()
    ref = copy.deepcopy(model)
    qaic_dynamo.compile(model, cache=False)
    x = torch.randn(4, 8)
    with torch.no_grad():
        model(x)
        Block.forward.__kwdefaults__["scale"] = 3.0
        with compilation_counter.expect(num_graphs_seen=1, num_guarded_region_calls=1 + 1):  # recompiled once
            torch.testing.assert_close(model(x), ref(x))

        def forward(self, x, *, scale=2.0):
            return self.proj(x) * scale + 1.0

        Block.forward.__code__ = forward.__code__
        with compilation_counter.expect(num_graphs_seen=1, num_guarded_region_calls=1):  # only inp
            torch.testing.assert_close(model(x), ref(x))


@torch._dynamo.config.patch(skip_nnmodule_hook_guards=False)
def test_a_hook_on_a_region_beside_the_blocks_goes_through_dynamo():
    """The module of a region beside the blocks is called inside the region's compiled
    function: a hook added later is Dynamo's to see, and it does when told to guard on
    hooks (by default it ignores them, as for any ``torch.compile``d model)."""
    model, _, x = compiled_stack()
    with torch.no_grad():
        model(x)
        seen = []
        model.inp.module.register_forward_pre_hook(lambda m, args: seen.append(args[0].shape))
        with compilation_counter.expect(
            num_guarded_region_calls=2,  # the 2 layers
            num_dynamo_region_calls=1,  # inp has a hook
            num_graphs_seen=1,  # inp, recompiled with its hook
        ):
            model(x)
        assert seen == [torch.Size([4, 8])]


class Forwarding(nn.Module):
    """A block whose frame is ``forward(self, *args, **kwargs)``, as transformers' layers'
    ``forward_with_checkpointing``: its locals are bound without inspect."""

    def __init__(self, width):
        super().__init__()
        self.inner = Scaled(width)

    def forward(self, *args, **kwargs):
        return self.inner(*args) * kwargs.get("scale", 1.0)


class ForwardingStack(Stack):
    def __init__(self, layers=3, width=8):
        super().__init__(layers, width)
        self.layers = nn.ModuleList(Forwarding(width) for _ in range(layers))

    def forward(self, x, scale=1.0):
        x = self.inp(x)
        for layer in self.layers:
            x = layer(x, scale=scale)
        return x


def test_varargs_blocks_are_guarded_on_their_bound_kwargs():
    import copy

    model = ForwardingStack(3)
    ref = copy.deepcopy(model)
    qaic_dynamo.compile(model)
    x = torch.randn(4, 8)
    with torch.no_grad():
        model(x)
        with compilation_counter.expect(num_guarded_region_calls=3 + 1, num_dynamo_region_calls=0):
            torch.testing.assert_close(model(x), ref(x))
        with compilation_counter.expect(
            num_guarded_region_calls=1 + 2,  # inp; layers 1, 2 pass the entry layer 0 compiled for scale=2
            num_dynamo_region_calls=1,  # layer 0: the guard on kwargs['scale'] fails, Dynamo recompiles
        ):
            torch.testing.assert_close(model(x, scale=2.0), ref(x, scale=2.0))


def test_region_dispatch_dynamo_enters_through_torch_compile_every_time():
    model = Stack(3)
    qaic_dynamo.compile(model, region_dispatch="dynamo")
    assert all(m.dispatch is None for m in model.layers)
    with torch.no_grad(), compilation_counter.expect(num_guarded_region_calls=0, num_dynamo_region_calls=1 + 3):
        model(torch.randn(4, 8))


@pytest.mark.parametrize("L", [2, 4])
def test_guarded_and_dynamo_dispatch_give_the_same_tokens_and_logits(L):
    model = llama(L)
    outs = {
        d: engine(model, compile_options={"region_dispatch": d}).generate_outputs(PROMPTS, 4, return_logits=True)
        for d in ("guarded", "dynamo")
    }
    for a, b in zip(outs["guarded"], outs["dynamo"]):
        assert a.token_ids == b.token_ids
        assert all(torch.equal(x, y) for x, y in zip(a.logits, b.logits))


def test_an_engine_step_runs_every_layer_through_the_guarded_path():
    L = 4
    llm = engine(llama(L))
    llm.generate(PROMPTS, 2)  # compiles prefill and decode
    with compilation_counter.expect(
        num_guarded_region_calls=L + 3,  # every layer, embed_tokens, norm, lm_head
        num_dynamo_region_calls=0,
        num_graphs_seen=0,
    ):
        llm.generate([PROMPTS[0]], 1)  # one prefill step


def test_on_an_untested_torch_blocks_enter_through_dynamo_with_one_warning(monkeypatch):
    from qaic_dynamo._compat import torch_2_13

    monkeypatch.setattr(torch_2_13, "TESTED_TORCH", "0.0.0")
    torch_2_13.dynamo_internals.cache_clear()
    try:
        model = Stack(2)
        pattern = r"region_dispatch='guarded' unavailable\): torch .* is not the tested 0.0.0"
        with pytest.warns(RuntimeWarning, match=pattern) as record:
            qaic_dynamo.compile(model)
        assert len([w for w in record if re.search(pattern, str(w.message))]) == 1  # not one per region
        assert all(m.dispatch is None for m in model.layers)
    finally:
        torch_2_13.dynamo_internals.cache_clear()


def test_bad_region_dispatch_is_refused():
    with pytest.raises(ConfigError, match=r"'region_dispatch' must be one of \['guarded', 'dynamo'\], got 'fast'"):
        qaic_dynamo.compile(Stack(2), region_dispatch="fast")
