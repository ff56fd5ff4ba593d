"""Precompiled regions (compiler/regions/precompile.py): a restart loads each region's
saved Dynamo trace instead of tracing, gives the traced path's outputs bit for bit, and
re-traces - never runs stale code - when a guard Dynamo could not save, or a source
file the trace read, has changed.

Each scenario is a fresh process (tests/precompile_child.py) against a copy of one cache
that a first process filled.
"""

from __future__ import annotations

import gc
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn as nn

import qaic_dynamo
from qaic_dynamo import compilation_counter
from qaic_dynamo.compiler.regions.precompile import DroppedGuards, describe, wait_for_saves
from qaic_dynamo.errors import PrecompileError

CHILD = Path(__file__).parent / "precompile_child.py"
REGIONS = 5  # the decoder block, embeddings, rotary embedding, final norm, head


def child(cache: Path, model: str, patch: str = "none") -> dict:
    proc = subprocess.run(
        [sys.executable, str(CHILD), str(cache), model, patch], capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def cold(tmp_path_factory) -> tuple[Path, dict]:
    cache = tmp_path_factory.mktemp("precompile") / "cache"
    return cache, child(cache, "llama")


@pytest.fixture
def warm_cache(cold, tmp_path) -> Path:
    cache = tmp_path / "cache"
    shutil.copytree(cold[0], cache)
    return cache


def test_cold_start_traces_each_region_once_and_saves_it(cold):
    counts = cold[1]["counts"]
    assert counts["num_precompiled_traces"] == counts["num_precompiled_saves"] == REGIONS
    assert counts["num_graphs_seen"] == REGIONS  # the saved trace is the only trace
    assert "num_dynamo_region_calls" not in counts
    assert cold[1]["max_diff"] < 1e-5


def test_restart_loads_every_region_without_dynamo_and_matches_bit_for_bit(cold, warm_cache):
    warm = child(warm_cache, "llama")
    assert warm["counts"]["num_precompiled_loads"] == REGIONS
    for traced in ("num_graphs_seen", "num_precompiled_traces", "num_dynamo_region_calls", "num_onnx_exports"):
        assert traced not in warm["counts"]
    assert warm["sha256"] == cold[1]["sha256"]


@pytest.mark.parametrize("patch", ["rotary", "attention"])
def test_a_replaced_global_retraces_the_block(cold, warm_cache, patch):
    """transformers' apply_rotary_pos_emb replaced, or another function registered as the
    "qaic" attention: guards Dynamo drops from a saved trace."""
    warm = child(warm_cache, "llama", patch)
    counts = warm["counts"]
    assert counts["num_precompiled_discards"] == 1 and counts["num_precompiled_traces"] == 1
    assert counts["num_precompiled_loads"] == REGIONS - 1
    assert warm["max_diff"] < 1e-5  # against eager with the same patch
    assert warm["sha256"] != cold[1]["sha256"]


def test_a_change_in_this_process_retraces_at_the_next_step(warm_cache):
    warm = child(warm_cache, "llama", "rotary-later")
    assert warm["counts"]["num_precompiled_loads"] == REGIONS
    assert warm["counts"]["num_precompiled_discards"] == 1
    assert warm["counts"]["num_dynamo_region_calls"] >= 1
    assert warm["first_diff"] < 1e-5 and warm["max_diff"] < 1e-5


def test_two_processes_warm_start_at_once(cold, warm_cache):
    procs = [
        subprocess.Popen([sys.executable, str(CHILD), str(warm_cache), "llama"], stdout=subprocess.PIPE, text=True)
        for _ in range(2)
    ]
    results = []
    for p in procs:
        out, _ = p.communicate(timeout=600)
        assert p.returncode == 0
        results.append(json.loads(out.strip().splitlines()[-1]))
    for r in results:
        assert r["counts"]["num_precompiled_loads"] == REGIONS
        assert r["sha256"] == cold[1]["sha256"]


USER_MODEL = """
import torch
import torch.nn as nn

SCALE = 2.0


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(16, 16)

    def forward(self, x):
        return x + torch.relu(self.lin(x)) * SCALE


class Net(nn.Module):
    def __init__(self, n):
        super().__init__()
        self.layers = nn.ModuleList(Block() for _ in range(n))
        self.head = nn.Linear(16, 8)

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return self.head(x)
"""


@pytest.mark.parametrize(
    "edit",
    [
        ("torch.relu", "torch.sigmoid"),
        ("SCALE = 2.0", "SCALE = 3.0"),
        ("        super", "        # a comment\n        super"),
    ],
    ids=["code", "global-constant", "comment"],
)
def test_a_change_to_a_traced_source_file_retraces(tmp_path, edit):
    src = tmp_path / "src"
    src.mkdir()
    (src / "userblocks.py").write_text(USER_MODEL)
    cache = tmp_path / "cache"
    first = child(cache, f"user:{src}")
    assert first["counts"]["num_precompiled_saves"] == 2
    assert child(cache, f"user:{src}")["counts"]["num_precompiled_loads"] == 2
    (src / "userblocks.py").write_text(USER_MODEL.replace(*edit))
    edited = child(cache, f"user:{src}")
    # The block traces again (its stale entry is discarded, or - an edit that moves its
    # forward - under a key of its own); the head is torch's Linear, whose trace loads.
    assert edited["counts"]["num_precompiled_traces"] == 1
    assert edited["counts"]["num_precompiled_loads"] == 1
    assert edited["max_diff"] < 1e-5


def test_a_file_edited_after_import_is_not_saved_under_its_new_digest(tmp_path):
    # The first process traces the code it imported (relu), while the file on disk already
    # says sigmoid: a trace saved beside the new file's digest would run relu in the next
    # process, which imports sigmoid. It must not be saved; the next process traces.
    src = tmp_path / "src"
    src.mkdir()
    (src / "userblocks.py").write_text(USER_MODEL)
    cache = tmp_path / "cache"
    first = child(cache, f"user:{src}", "edit-after-import")
    assert first["max_diff"] < 1e-5  # this process runs what it imported, as eager does
    assert first["counts"]["num_precompiled_saves"] == 1  # the head; not the edited block
    second = child(cache, f"user:{src}")
    assert second["counts"]["num_precompiled_traces"] == 1
    assert second["max_diff"] < 1e-5


def test_source_digests_compile_a_file_once_per_content_and_still_catch_an_edit(tmp_path, monkeypatch):
    import builtins
    import importlib.util

    from qaic_dynamo.compiler.regions import precompile

    path = tmp_path / "digested.py"
    path.write_text("def f(x):\n    return x + 1\n")
    spec = importlib.util.spec_from_file_location("digested", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    compiled = []

    def counting(*args, **kwargs):
        compiled.append(args[1])
        return builtins.compile(*args, **kwargs)

    monkeypatch.setattr(precompile, "compile", counting, raising=False)
    first = precompile.source_digests([mod.f.__code__])
    assert precompile.source_digests([mod.f.__code__]) == first  # a second region reading the same file
    assert compiled == [str(path)]
    path.write_text("def f(x):\n    return x + 2\n")  # edited after import: new bytes, compiled again
    with pytest.raises(PrecompileError, match="changed since f was imported"):
        precompile.source_digests([mod.f.__code__])
    assert compiled == [str(path)] * 2


def test_an_mla_model_restarts_through_llm_without_any_dynamo_trace(tmp_path):
    # The engine marked input_ids dynamic, and the MLA model hands input_ids straight to its
    # embedding region: Dynamo does not save a tensor's marks, so the loaded embedding's
    # guards (expecting none) failed at every restart and Dynamo traced it again.
    cache = tmp_path / "cache"
    cold = child(cache, "mla-llm")
    assert cold["counts"]["num_precompiled_saves"] == 4  # block, embeddings, norm, head
    warm = child(cache, "mla-llm")
    assert warm["counts"]["num_precompiled_loads"] == 4
    assert warm["counts"].get("num_graphs_seen", 0) == 0
    assert warm["counts"].get("num_dynamo_region_calls", 0) == 0
    assert warm["sha256"] == cold["sha256"] and warm["max_diff"] == cold["max_diff"] == 0


# --- in this process --------------------------------------------------------------------------


class Breaking(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        torch._dynamo.graph_break()
        return torch.relu(self.lin(x))


class Plain(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        return torch.relu(self.lin(x))


def test_a_region_with_a_graph_break_is_traced_by_dynamo(tmp_path):
    torch._dynamo.reset()
    model = nn.Sequential(nn.ModuleList([Breaking(), Breaking()]))
    model.forward = lambda x: model[0][1](model[0][0](x))
    x = torch.randn(2, 8)
    with torch.no_grad():
        eager = model(x)
        qaic_dynamo.compile(model, cache_dir=str(tmp_path))
        with compilation_counter.expect(num_precompiled_traces=0, num_precompiled_saves=0):
            out = model(x)
    wait_for_saves()
    torch.testing.assert_close(out, eager)


def test_precompile_off_traces_with_dynamo(tmp_path):
    torch._dynamo.reset()
    model = nn.Sequential(nn.ModuleList([nn.Linear(8, 8), nn.Linear(8, 8)]))
    model.forward = lambda x: model[0][1](model[0][0](x))
    x = torch.randn(2, 8)
    with torch.no_grad():
        eager = model(x)
        qaic_dynamo.compile(model, cache_dir=str(tmp_path), precompile=False)
        with compilation_counter.expect(num_precompiled_traces=0, num_precompiled_loads=0):
            out = model(x)
    torch.testing.assert_close(out, eager)


def test_rebinding_an_engines_kv_caches_frees_the_old_ones():
    """A precompiled region re-checks its dropped guards once per forward context; it
    remembers the last context weakly, or that context - and the KV caches it holds -
    would outlive the engine's rebinding of its caches (a serving session's buffers)."""
    import gc
    import weakref

    from qaic_dynamo import LLM
    from qaic_dynamo.models import QaicLlamaConfig, QaicLlamaForCausalLM

    torch._dynamo.reset()
    torch.manual_seed(0)
    llm = LLM(QaicLlamaForCausalLM(QaicLlamaConfig(num_hidden_layers=2)), backend="qaic", max_model_len=32)
    with compilation_counter.expect(num_precompiled_traces=4):  # block, embeddings, norm, head
        want = llm.generate([[1, 2, 3]], 3)
    wait_for_saves()  # a pending save holds its region until written
    old = [weakref.ref(t) for caches in llm.kv_caches.values() for t in caches]
    llm.kv_caches = {name: tuple(torch.zeros_like(t) for t in caches) for name, caches in llm.kv_caches.items()}
    gc.collect()
    assert [r() is None for r in old] == [True] * len(old)
    assert llm.generate([[1, 2, 3]], 3) == want  # the new caches serve, from scratch


def scaled(x):
    return x * 2


def test_dropped_guards_compare_what_an_object_is_not_where_it_lives():
    g = {"f": scaled, "n": 3}
    guards = DroppedGuards.record([_Entry("G['f']"), _Entry("G['n']"), _Entry("x.shape")], {"x": torch.ones(2)}, g)
    assert guards.mismatch({"x": torch.ones(2)}) is None
    g["f"] = lambda x: x * 2  # same behaviour, another function
    assert "G['f'] changed" in guards.mismatch({"x": torch.ones(2)})
    g["f"] = scaled
    g["n"] = 4
    assert "G['n'] changed" in guards.mismatch({"x": torch.ones(2)})
    assert describe(torch.ops.qaic) == describe(torch.ops.qaic)


class _Entry:
    def __init__(self, name: str) -> None:
        self.name = name


def test_a_saved_graph_round_trips_and_its_runners_keep_their_eager_graph(tmp_path):
    from qaic_dynamo.compiler import QaicBackend
    from qaic_dynamo.compiler.saved_graph import SavedGraph, loading_config
    from qaic_dynamo.config import CompilationConfig
    from qaic_dynamo.runtime import PieceRunner

    torch._dynamo.reset()
    config = CompilationConfig.from_options({"cache_dir": str(tmp_path)})
    saved = []

    def backend(gm, example_inputs):
        saved.append(SavedGraph(QaicBackend(config)(gm, example_inputs), config))
        return saved[-1]

    def fn(x, y):
        return torch.relu(x @ y) + 1, x.sum(0)

    x, y = torch.randn(4, 8), torch.randn(8, 3)
    want = torch.compile(fn, backend=backend)(x, y)
    data = SavedGraph.serialize_compile_artifacts(saved[0])
    with loading_config(config), compilation_counter.expect(num_onnx_exports=0):
        loaded = SavedGraph.deserialize_compile_artifacts(data)
    got = loaded(x, y)
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    runners = [m for m in loaded.compiled.__self__.children() if isinstance(m, PieceRunner)]
    assert runners
    for a, b in zip(runners[0].eager(x, y), fn(x, y)):  # the fallback graph, unpickled on first use
        torch.testing.assert_close(a, b)


def test_a_saved_graph_whose_artifact_is_gone_does_not_load(tmp_path):
    from qaic_dynamo.cache import artifact_cache
    from qaic_dynamo.compiler import QaicBackend
    from qaic_dynamo.compiler.saved_graph import SavedGraph, loading_config
    from qaic_dynamo.config import CompilationConfig

    torch._dynamo.reset()
    config = CompilationConfig.from_options({"cache_dir": str(tmp_path / "a")})
    saved = []

    def backend(gm, example_inputs):
        saved.append(SavedGraph(QaicBackend(config)(gm, example_inputs), config))
        return saved[-1]

    torch.compile(lambda x: torch.tanh(x) * 3, backend=backend)(torch.randn(5))
    data = SavedGraph.serialize_compile_artifacts(saved[0])
    artifact_cache.clear_memory()
    elsewhere = CompilationConfig.from_options({"cache_dir": str(tmp_path / "b")})  # an empty cache
    with loading_config(elsewhere), pytest.raises(PrecompileError, match="no longer in the cache"):
        SavedGraph.deserialize_compile_artifacts(data)


def test_a_saved_trace_that_fails_to_load_for_any_reason_is_traced_again(tmp_path, monkeypatch):
    import qaic_dynamo.compiler.regions.precompile as precompile

    def stack():
        torch.manual_seed(0)
        model = nn.Sequential(nn.ModuleList([Plain(), Plain()]))
        model.forward = lambda x: model[0][1](model[0][0](x))
        return model

    x = torch.randn(2, 8)
    torch._dynamo.reset()
    first = stack()
    with torch.no_grad():
        qaic_dynamo.compile(first, cache_dir=str(tmp_path))
        first(x)
    wait_for_saves()
    torch._dynamo.reset()

    def moved(*args, **kwargs):  # e.g. a class the saved trace names by path has moved
        raise AttributeError("module 'x' has no attribute 'Y'")

    monkeypatch.setattr(precompile, "load_aot_frame", moved)
    second = stack()
    with torch.no_grad():
        eager = second(x)
        qaic_dynamo.compile(second, cache_dir=str(tmp_path))
        with compilation_counter.expect(num_precompiled_loads=0, num_precompiled_discards=1, num_precompiled_traces=1):
            out = second(x)
    wait_for_saves()
    torch.testing.assert_close(out, eager)


def test_the_deferred_source_and_guard_records_install_once_and_pass_through_outside_a_trace():
    # aot_compile_frame collects traced code objects instead of letting Dynamo read and hash
    # their modules in the first call. Installed from several threads at once, the patch
    # must not take itself for the original (every later call would recurse), and outside
    # a trace Dynamo's own record works as before.
    import threading

    from torch._dynamo.convert_frame import GraphCaptureOutput
    from torch._dynamo.package import SourceInfo

    from qaic_dynamo._compat import torch_2_13_aot

    barrier = threading.Barrier(4)

    def install():
        barrier.wait()
        torch_2_13_aot._defer_source_info()

    threads = [threading.Thread(target=install) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert SourceInfo.add_code.qaic_defers and not getattr(torch_2_13_aot._original_add_code, "qaic_defers", False)
    assert GraphCaptureOutput.build_guards.qaic_defers
    assert not getattr(torch_2_13_aot._original_build_guards, "qaic_defers", False)
    info = SourceInfo(inlined_sources=set())
    info.add_code(describe.__code__)
    assert [s.module for s in info.inlined_sources] == ["qaic_dynamo.compiler.regions.precompile"]


def test_a_block_changed_before_its_save_is_not_saved_as_if_traced_that_way(tmp_path):
    """The saved guards are built at the save, off the first call, from the objects as
    they are then. A block changed in between (its branch attribute flipped) would be
    saved under guards that describe it as changed, over the trace of the old branch."""
    from region_models import Stack

    x = torch.randn(2, 8)
    torch._dynamo.reset()
    model = Stack()
    with torch.no_grad():
        qaic_dynamo.compile(model, cache_dir=str(tmp_path))
        with compilation_counter.expect(num_precompiled_traces=2):  # the input projection and the block
            model(x)
        for layer in model.layers:
            layer.act = False  # tanh now: the relu trace must not be saved as if for this
        with compilation_counter.expect(num_precompiled_saves=1):  # only the input projection's
            wait_for_saves()

        torch._dynamo.reset()  # a restart against the same cache, with the changed blocks
        restarted = Stack()
        for layer in restarted.layers:
            layer.act = False
        eager = restarted(x)
        qaic_dynamo.compile(restarted, cache_dir=str(tmp_path))
        with compilation_counter.expect(num_precompiled_loads=1, num_precompiled_traces=1):
            out = restarted(x)
    wait_for_saves()
    torch.testing.assert_close(out, eager)


@pytest.mark.filterwarnings("ignore:qaic. piece .* runs eagerly:RuntimeWarning")  # bf16 Gemm, under autocast
@pytest.mark.parametrize("mode", ["grad", "no_grad", "inference_mode", "autocast"])
def test_a_trace_is_saved_whatever_grad_mode_it_ran_under(tmp_path, mode):
    """The saver builds the saved guards under the trace's thread state (grad and
    inference mode are per thread; Dynamo's guards check them), or none would hold; a
    state it cannot set again (autocast) has them built and saved at the trace."""
    from region_models import Stack

    context = {
        "grad": torch.enable_grad,
        "no_grad": torch.no_grad,
        "inference_mode": torch.inference_mode,
        "autocast": lambda: torch.autocast("cpu", dtype=torch.bfloat16),
    }[mode]
    x = torch.randn(2, 8)
    torch._dynamo.reset()
    model = Stack().requires_grad_(False)
    with context():
        eager = model(x)
        qaic_dynamo.compile(model, cache_dir=str(tmp_path))
        with compilation_counter.expect(num_precompiled_traces=2):
            model(x)
    with compilation_counter.expect(num_precompiled_saves=2):
        wait_for_saves()

    torch._dynamo.reset()
    restarted = Stack().requires_grad_(False)
    qaic_dynamo.compile(restarted, cache_dir=str(tmp_path))
    with (
        context(),
        compilation_counter.expect(num_precompiled_loads=2, num_precompiled_traces=0, num_dynamo_region_calls=0),
    ):
        out = restarted(x)
    torch.testing.assert_close(out, eager)


def test_a_precompiled_trace_hands_the_backend_lazy_graph_modules_as_dynamo_does():
    # aot_compile leaves lazy graph modules off, so every graph module the backend splits
    # and rewrites was compiled to Python at each rewrite (a few tens of ms per model).
    from torch.fx._lazy_graph_module import _LazyGraphModule
    from torch.fx.passes.split_module import split_module

    from qaic_dynamo._compat import aot_compile_frame
    from qaic_dynamo.compiler.saved_graph import SavedGraph
    from qaic_dynamo.config import CompilationConfig

    seen = []

    def backend(gm, example_inputs):
        split = split_module(gm, None, lambda node: 0)  # as the backend splits at attention
        seen.append((isinstance(gm, _LazyGraphModule), isinstance(split, _LazyGraphModule)))
        return SavedGraph(gm.forward, CompilationConfig())

    torch._dynamo.reset()
    frame, _ = aot_compile_frame(scaled, ((torch.ones(3),), {}), backend)
    assert seen == [(True, True)]
    torch.testing.assert_close(frame.fn(torch.ones(3)), torch.full((3,), 2.0))


@pytest.mark.parametrize("run_gc", [True, False])
def test_a_precompiled_trace_collects_the_young_generations_as_dynamos_compile_does(run_gc):
    # Dynamo's compile collects generations 0 and 1 after every frame (run_gc_after_compile);
    # aot_compile did not, and the trace's garbage reached the oldest generation through
    # later automatic collections, inside the first call.
    from qaic_dynamo._compat import aot_compile_frame
    from qaic_dynamo.compiler.saved_graph import SavedGraph
    from qaic_dynamo.config import CompilationConfig

    def backend(gm, example_inputs):
        return SavedGraph(gm.forward, CompilationConfig())

    collections = []

    def on_gc(phase, info):
        if phase == "start":
            collections.append(info["generation"])

    torch._dynamo.reset()
    gc.disable()  # no automatic collection: only explicit ones are counted
    gc.callbacks.append(on_gc)
    try:
        with torch._dynamo.config.patch(run_gc_after_compile=run_gc):
            aot_compile_frame(scaled, ((torch.ones(3),), {}), backend)
    finally:
        gc.callbacks.remove(on_gc)
        gc.enable()
    assert collections == ([1] if run_gc else [])


def _frame_of_scaled_block(layer, x):
    from qaic_dynamo._compat import aot_compile_frame
    from qaic_dynamo.compiler.saved_graph import SavedGraph
    from qaic_dynamo.config import CompilationConfig

    def backend(gm, example_inputs):
        return SavedGraph(gm.forward, CompilationConfig())

    torch._dynamo.reset()
    with torch.no_grad():
        frame, _ = aot_compile_frame(type(layer).forward, ((layer, x), {}), backend)
    return frame


def test_a_block_changed_during_its_save_is_not_saved():
    """The saved guards are built from the block as it is at the save. Changed by another
    thread after the saver checked it against the trace's guards (while the saver waited
    for Dynamo's compile lock, say), the new guards would describe the change: both sets
    must hold on the same objects after the build."""
    from region_models import Scaled

    layer, x = Scaled(8), torch.randn(2, 8)
    frame = _frame_of_scaled_block(layer, x)
    trace_guards, checks = frame.guard_manager, []

    class ChangedAfterFirstCheck:
        def check(self, scope):
            checks.append(trace_guards.check(scope))
            if len(checks) == 1:
                layer.act = False  # tanh from now on; the trace ran relu
            return checks[-1]

    frame.guard_manager = ChangedAfterFirstCheck()
    with pytest.raises(RuntimeError, match="has changed since"):
        frame.serialize({})
    assert checks == [True, False]


def test_a_trace_not_saved_lets_go_of_its_first_calls_inputs(tmp_path, monkeypatch):
    """A traced region keeps its first call's locals for the saved guards' build; a save
    that fails before that build (here: its source digests) must still let them go."""
    import gc
    import weakref

    from region_models import Stack

    from qaic_dynamo.compiler.regions import precompile

    def no_digests(codes):
        raise PrecompileError("a source file changed since it was imported")

    monkeypatch.setattr(precompile, "source_digests", no_digests)
    torch._dynamo.reset()
    model, x = Stack(), torch.randn(2, 8)
    qaic_dynamo.compile(model, cache_dir=str(tmp_path))
    with torch.no_grad(), compilation_counter.expect(num_precompiled_traces=2):
        model(x)
    with compilation_counter.expect(num_precompiled_saves=0):
        wait_for_saves()
    gone = weakref.ref(x)
    del x
    gc.collect()
    assert gone() is None


def test_an_aot_compile_inside_the_backend_builds_and_keeps_its_own_guards():
    """Only the trace's own aot_compile defers its saved guards; another library's
    aot_compile inside the backend gets them built, as Dynamo builds them."""
    from torch._dynamo.aot_compile_types import SerializableCallable

    from qaic_dynamo._compat import aot_compile_frame
    from qaic_dynamo.compiler.saved_graph import SavedGraph
    from qaic_dynamo.config import CompilationConfig

    SerializableCallable.register(SavedGraph)
    inner = {}

    def helper(y):
        return y + 1

    def backend(gm, example_inputs):
        inner["compiled"] = torch.compile(
            helper,
            fullgraph=True,
            backend=lambda g, e: SavedGraph(g.forward, CompilationConfig()),
            options={"guard_filter_fn": lambda entries: [True] * len(entries)},
        ).aot_compile(((torch.ones(2),), {}))
        return SavedGraph(gm.forward, CompilationConfig())

    torch._dynamo.reset()
    frame, _ = aot_compile_frame(scaled, ((torch.ones(3),), {}), backend)
    assert len(inner["compiled"]._artifacts.guards_state) > 100
    assert len(frame.serialize({})) > 100


def test_the_builder_hook_is_installed_again_if_replaced_and_chains_the_one_before():
    """The trace takes Dynamo's guard builder through its testing hook; a hook set by a
    test or a tool stays called, and one put back over ours does not cost the trace its
    single build (it is installed again)."""
    from unittest import mock

    from torch._dynamo import guards

    from qaic_dynamo._compat import aot_compile_frame
    from qaic_dynamo.compiler.saved_graph import SavedGraph
    from qaic_dynamo.config import CompilationConfig

    def backend(gm, example_inputs):
        return SavedGraph(gm.forward, CompilationConfig())

    seen = []
    with mock.patch.object(guards, "guard_manager_testing_hook_fn", lambda *a: seen.append(len(a))):
        torch._dynamo.reset()
        builds = []
        original = guards.CheckFunctionManager.build_guards
        with mock.patch.object(
            guards.CheckFunctionManager, "build_guards", lambda *a, **k: builds.append(1) or original(*a, **k)
        ):
            frame, _ = aot_compile_frame(scaled, ((torch.ones(3),), {}), backend)
        assert builds == [1] and seen == [3]  # one whole build; the earlier hook was called
        assert len(frame.serialize({})) > 100
    torch._dynamo.reset()
    assert torch.compile(scaled, backend="eager")(torch.ones(2)).tolist() == [2.0, 2.0]  # outside a trace


def test_the_saved_guards_are_built_by_the_thread_running_the_model_not_the_saver(tmp_path, monkeypatch):
    """Dynamo parses guard expressions with ``ast``, which CPython 3.11 does not allow on
    two threads at once: built on the saver thread, they broke the program's own
    ``ast.parse`` with "SystemError: AST constructor recursion depth mismatch" (seen in
    CI). The region's first call after the delay builds them; the saver only writes."""
    import threading

    from region_models import Stack

    from qaic_dynamo._compat import torch_2_13_aot
    from qaic_dynamo.compiler.regions import precompile

    built_on = []
    original = torch_2_13_aot._DeferredGuards.build

    def spy(self, trace_guards):
        built_on.append(threading.current_thread().name)
        return original(self, trace_guards)

    monkeypatch.setattr(torch_2_13_aot._DeferredGuards, "build", spy)
    monkeypatch.setattr(precompile, "SAVE_DELAY_S", 0.3)
    torch._dynamo.reset()
    model, x = Stack(), torch.randn(2, 8)
    qaic_dynamo.compile(model, cache_dir=str(tmp_path))
    with torch.no_grad():
        with compilation_counter.expect(num_precompiled_traces=2):
            model(x)
        threading.Event().wait(0.6)  # past the delay: a saver thread building them would have
        assert built_on == []
        with compilation_counter.expect(num_precompiled_saves=2):
            model(x)  # the next call hands each trace over; the saver writes them
            wait_for_saves()
    assert built_on == [threading.current_thread().name] * 2
