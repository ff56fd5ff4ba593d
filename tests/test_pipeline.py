"""The pipeline's seams (issue 9): compile and load apart, one op registry, a cache key
that covers the code, and the correctness bugs a review found, each pinned by a test."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import textwrap
import threading
import warnings
from pathlib import Path

import pytest
import torch
import torch.fx as fx
import torch.nn as nn
from harness import Driver
from torch._dynamo.exc import BackendCompilerFailed
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.symbolic_shapes import ShapeEnv

import qaic_dynamo
from qaic_dynamo import build_attention_metadata, compilation_counter, ops, set_forward_context
from qaic_dynamo.artifact import LAYOUT_FILE, LAYOUT_FORMAT, PieceLayout
from qaic_dynamo.cache import Source, artifact_cache
from qaic_dynamo.compiler import QaicBackend, last_compile_report
from qaic_dynamo.compiler import fingerprint as fingerprint_stage
from qaic_dynamo.config import DEFAULT_SPLITTING_OPS, CompilationConfig
from qaic_dynamo.counter import CompilationCounter
from qaic_dynamo.errors import ArtifactError, CacheLayoutError
from qaic_dynamo.models import QaicLlamaConfig, QaicLlamaForCausalLM
from qaic_dynamo.ops import QAIC_OPS, OpRole, kv_cache_update_op, splitting_ops
from qaic_dynamo.runtime import PieceRunner

PROMPTS = [[3, 14, 15, 92, 65], [35, 89], [79, 32, 38, 46, 26, 43, 38]]


def llama(layers=2, seed=0):
    torch.manual_seed(seed)
    return QaicLlamaForCausalLM(QaicLlamaConfig(num_hidden_layers=layers)).eval()


def run_steps(model, fn, steps=2, **driver_kw):
    with torch.no_grad():
        return Driver(model, PROMPTS, **driver_kw).generate(fn, steps)


# --- structure ------------------------------------------------------------------------------


def test_loading_artifacts_imports_no_exporter():
    """The load half never pulls in torch.onnx or onnxscript; neither does the backend
    until a piece is actually lowered."""
    code = textwrap.dedent("""
        import sys
        import qaic_dynamo.artifact, qaic_dynamo.runtime, qaic_dynamo.cache, qaic_dynamo.compiler.backend
        bad = sorted(m for m in sys.modules if m.startswith(("torch.onnx", "onnxscript")))
        print(bad)
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip().splitlines()[-1] == "[]"


def test_op_registry_is_the_one_source():
    assert DEFAULT_SPLITTING_OPS == splitting_ops() == ("qaic::unified_attention", "qaic::unified_mla_attention")
    updates = {name: op.retained_state for name, op in QAIC_OPS.items() if op.role is OpRole.KV_CACHE_UPDATE}
    assert updates == {
        "qaic::unified_kv_cache_update": ("past_key", "past_value"),
        "qaic::unified_mla_kv_cache_update": ("compressed_kv", "k_pe"),
    }
    scatter = QAIC_OPS["qaic::kv_cache_scatter"]
    assert scatter.role is OpRole.RETAINED_STATE_SCATTER and scatter.onnx_function == "KVCacheScatter"
    assert all(QAIC_OPS[op.lowers_to] is scatter for op in QAIC_OPS.values() if op.role is OpRole.KV_CACHE_UPDATE)
    assert kv_cache_update_op(torch.ops.qaic.unified_kv_cache_update.default).name == "qaic::unified_kv_cache_update"
    assert kv_cache_update_op(torch.ops.qaic.unified_attention) is None
    for name in ("KV_CACHE_UPDATE_OPS", "ATTENTION_OPS"):  # the dead duplicates are gone
        assert not hasattr(qaic_dynamo.ops, name)


def kv_scatter_samples():
    g = torch.Generator().manual_seed(0)
    for heads, block, tokens, dtype in [(2, 4, 3, torch.float32), (1, 8, 5, torch.float16), (4, 2, 6, torch.bfloat16)]:
        key = torch.randn(tokens + 1, heads, 8, generator=g).to(dtype)  # one padding row
        cache = torch.randn(4, heads, block, 8, generator=g).to(dtype)
        slots = torch.randperm(4 * block, generator=g)[:tokens]
        slots[-1] = -1
        yield (key, key * 2, cache, cache.clone(), slots)


@pytest.mark.parametrize("sample", list(kv_scatter_samples()), ids=["f32", "f16", "bf16"])
def test_kv_cache_scatter_op(sample):
    torch.library.opcheck(torch.ops.qaic.kv_cache_scatter.default, sample)
    key, value, kc, vc, slots = sample
    before = kc.clone()
    new_k, new_v = qaic_dynamo.ops.kv_cache_scatter(key, value, kc, vc, slots)
    assert torch.equal(kc, before), "the functional op leaves its inputs alone"
    want_k, want_v = kc.clone(), vc.clone()
    qaic_dynamo.ops.reshape_and_cache(key, value, want_k, want_v, slots)
    assert torch.equal(new_k, want_k) and torch.equal(new_v, want_v)


@pytest.mark.parametrize(
    "text, ok",
    [
        ("S0**2 + 3*S1", True),
        ("Max(S0, 2)", True),
        ("S0 <= 10", False),  # a relation only where one is wanted
        ("(S0 + 1)**2", True),
        ("S0**999", False),
        ("9**9**9**9", False),
        ("S0**2**9", False),
        ("S0**S1", False),
        ("1" * 21, False),
        ("__import__('os')", False),
    ],
)
def test_size_expressions_are_small_arithmetic(text, ok):
    # sympy evaluates while it parses: 9**9**9**9 from a writable cache dir hung the compile.
    from qaic_dynamo.artifact import check_size_expression

    if ok:
        check_size_expression(text, ["S0", "S1"], "a size")
    else:
        with pytest.raises(ArtifactError, match="is not a size expression"):
            check_size_expression(text, ["S0", "S1"], "a size")
    check_size_expression("Eq(Mod(S0, 4), 0) & (S0 <= 10)", ["S0"], "a size assumption", relation=True)


def test_layout_rejects_other_formats():
    layout = PieceLayout(inputs=[], outputs=[], leaves=[], out_spec="", symbols={}, kv_updates=[], num_args=0)
    assert PieceLayout.from_json(layout.to_json()) == layout
    data = json.loads(layout.to_json())
    with pytest.raises(
        ArtifactError, match=f"layout format 1; this version of qaic_dynamo reads format {LAYOUT_FORMAT}"
    ):
        PieceLayout.from_json(json.dumps({k: v for k, v in data.items() if k != "format"}))
    with pytest.raises(ArtifactError, match=r"unknown keys \['surprise'\]"):
        PieceLayout.from_json(json.dumps(dict(data, surprise=1)))
    with pytest.raises(ArtifactError, match="not JSON"):
        PieceLayout.from_json("{")


# --- bug 1: stale artifacts after an edit -------------------------------------------------------


def test_code_digest_covers_every_source_file(tmp_path):
    pkg = tmp_path / "pkg"
    shutil.copytree(Path(qaic_dynamo.__file__).parent, pkg, ignore=shutil.ignore_patterns("__pycache__"))
    before = fingerprint_stage.code_digest(pkg)
    assert before == fingerprint_stage.code_digest(pkg)
    lowering = pkg / "lowering" / "piece.py"
    lowering.write_text(lowering.read_text() + "\n# an edit\n")
    edited = fingerprint_stage.code_digest(pkg)
    assert edited != before
    native = next(pkg.glob("_C*.so"))
    native.write_bytes(native.read_bytes() + b"\0")
    assert fingerprint_stage.code_digest(pkg) != edited


def test_an_edit_to_the_package_misses_the_disk_cache(monkeypatch):
    model = llama()
    with compilation_counter.expect(num_backend_compilations=3, num_disk_cache_writes=3):
        run_steps(model, torch.compile(model, backend="qaic"), steps=0)
    # A restart with unchanged code loads every piece from disk ...
    torch._dynamo.reset()
    artifact_cache.clear_memory()
    with compilation_counter.expect(num_backend_compilations=0, num_disk_cache_hits=3):
        run_steps(model, torch.compile(model, backend="qaic"), steps=0)
    # ... and one after an edit (same version string) compiles again.
    torch._dynamo.reset()
    artifact_cache.clear_memory()
    monkeypatch.setattr(fingerprint_stage, "package_code_digest", lambda: "edited-" + "0" * 57)
    with compilation_counter.expect(num_backend_compilations=3, num_disk_cache_hits=0):
        run_steps(model, torch.compile(model, backend="qaic"), steps=0)


def _rewrite_entry_file(entry: Path, name: str, text: str) -> None:
    """Change a file of a committed entry and its checksum, so only its content is wrong."""
    (entry / name).write_text(text)
    meta = json.loads((entry / "meta.json").read_text())
    data = (entry / name).read_bytes()
    meta["files"][name] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (entry / "meta.json").write_text(json.dumps(meta))


def _code_in_a_size(layout: dict) -> dict:
    outputs = [dict(o) for o in layout["outputs"]]
    outputs[0]["shape"] = ["__import__('os').getpid()", *outputs[0]["shape"][1:]]
    return dict(layout, outputs=outputs)


def _swapped_inputs(layout: dict) -> dict:
    inputs = [dict(i) for i in layout["inputs"]]
    inputs[0]["name"], inputs[1]["name"] = inputs[1]["name"], inputs[0]["name"]
    return dict(layout, inputs=inputs)


@pytest.mark.parametrize(
    "damage", ["older_format", "unknown_key", "not_json", "code_in_a_size", "code_in_an_assumption", "swapped_inputs"]
)
def test_an_unreadable_layout_is_recompiled_with_a_warning(damage, caplog):
    """A layout that cannot be read, or that does not describe its model (inputs it would
    bind by the wrong names), is a miss; a size that is not an expression is never parsed
    (sympy parses with eval)."""
    model = llama()
    run_steps(model, torch.compile(model, backend="qaic"), steps=0)
    report = last_compile_report()
    entry = Path(report.pieces[0].artifact)
    layout = json.loads((entry / LAYOUT_FILE).read_text())
    text = {
        "older_format": lambda: json.dumps({k: v for k, v in layout.items() if k != "format"}),
        "unknown_key": lambda: json.dumps(dict(layout, added_later=True)),
        "not_json": lambda: "{",
        "code_in_a_size": lambda: json.dumps(_code_in_a_size(layout)),
        "code_in_an_assumption": lambda: json.dumps(dict(layout, size_assumptions=["__import__('os').getpid() > 0"])),
        "swapped_inputs": lambda: json.dumps(_swapped_inputs(layout)),
    }[damage]()
    _rewrite_entry_file(entry, LAYOUT_FILE, text)
    torch._dynamo.reset()
    artifact_cache.clear_memory()
    with compilation_counter.expect(num_backend_compilations=1, num_disk_cache_hits=2):
        out = run_steps(model, torch.compile(model, backend="qaic"), steps=1)
    assert "does not load" in caplog.text and "recompiling it" in caplog.text
    reason = {
        "older_format": f"layout format 1; this version of qaic_dynamo reads format {LAYOUT_FORMAT}",
        "unknown_key": "unknown keys ['added_later']",
        "not_json": "not JSON",
        "code_in_a_size": "is not a size expression (at '__import__')",
        "code_in_an_assumption": "a size assumption \"__import__('os').getpid() > 0\" is not a size expression",
        "swapped_inputs": "names the inputs",
    }[damage]
    assert reason in caplog.text
    ref = run_steps(model, model, steps=1)
    assert [o.argmax(-1).tolist() for o in out] == [r.argmax(-1).tolist() for r in ref]


# --- bug 2: the fallback policy is the config's, not the first caller's --------------------------


class Unbindable(nn.Module):
    """A piece the runtime cannot run (a complex32 output), refused while lowering. Its ops
    are all torch's, so the refusal is remembered under its key (a piece with another
    library's op is lowered again in every graph)."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 8)

    def forward(self, x):
        return (self.a(x) * 3).to(torch.complex32)


def test_fallback_error_after_an_eager_fallback_still_raises():
    torch.manual_seed(0)
    model, x = Unbindable().eval(), torch.randn(3, 8)
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")  # the fallback warns once per process and reason
        torch.compile(model, backend="qaic")(x)
    assert last_compile_report().pieces[0].source is Source.FAILED
    torch._dynamo.reset()  # the failure stays remembered in the artifact cache
    with (
        pytest.raises(BackendCompilerFailed, match="remembered from an identical piece compiled earlier") as e,
        torch.no_grad(),
    ):
        torch.compile(model, backend="qaic", options={"fallback": "error"})(x)
    assert "cannot bind out0 (complex32)" in str(e.value)


def test_a_remembered_failure_is_not_reported_as_reused():
    torch.manual_seed(0)
    model, x = Unbindable().eval(), torch.randn(3, 8)
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")  # the fallback warns once per process and reason
        torch.compile(model, backend="qaic")(x)
    torch._dynamo.reset()
    with torch.no_grad():
        torch.compile(model, backend="qaic")(x)
    report = last_compile_report()
    assert report.pieces[0].source is Source.FAILED and report.pieces[0].reused is False
    assert (report.reused, report.failed) == (0, 1)


# --- bug 3: sessions follow the config's num_threads -------------------------------------------


def test_a_second_config_gets_its_own_session_threads():
    model = llama()
    run_steps(model, torch.compile(model, backend="qaic", options={"num_threads": 1}), steps=0)
    first = last_compile_report().runners()
    assert {r.artifact.session.get_session_options().intra_op_num_threads for r in first} == {1}
    torch._dynamo.reset()
    with compilation_counter.expect(num_backend_compilations=0, num_onnx_exports=0, num_runtime_sessions=3):
        run_steps(model, torch.compile(model, backend="qaic", options={"num_threads": 2}), steps=0)
    second = last_compile_report().runners()
    assert {r.artifact.session.get_session_options().intra_op_num_threads for r in second} == {2}


# --- bug 4: strided KV caches are refused, never misread ------------------------------------------


def test_a_strided_kv_cache_is_a_clear_error():
    model = llama()
    driver = Driver(model, PROMPTS)
    for name, (k, v) in list(driver.caches.items()):
        wide = torch.zeros(k.shape[0], k.shape[1], 2 * k.shape[2], k.shape[3])
        driver.caches[name] = (wide[:, :, ::2], v)  # right shape, wrong strides
    compiled = torch.compile(model, backend="qaic")  # the default fallback must not hide it
    with (
        pytest.raises(
            CacheLayoutError, match=r"KV cache of layer 'model.layers.0.self_attn' is not contiguous.*\.contiguous\(\)"
        ),
        torch.no_grad(),
    ):
        driver.step(compiled, PROMPTS)


def _caches(n_layers: int = 1, shared: bool = False) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    out = {}
    for i in range(n_layers):
        k = torch.zeros(2, 1, 4, 8)
        out[f"l{i}"] = (k, k if shared else torch.zeros(2, 1, 4, 8))
    return out


def _run_updates(fn, caches, compiled, *args, **options):
    md = build_attention_metadata([3], [3], [[0]], 4)
    with torch.no_grad(), set_forward_context(md, caches, list(caches)):
        return (torch.compile(fn, backend="qaic", options=options) if compiled else fn)(*args)


def test_two_cache_updates_in_one_piece_are_lowered():
    # The second update's cache inputs were FX placeholders named "past_key.1": a
    # SyntaxError in the generated code, and the piece ran eagerly (found by review).
    def g(k, v):
        ops.unified_kv_cache_update(k * 1, v * 2, "from_forward_context")
        ops.unified_kv_cache_update(k * 3, v * 4, "from_forward_context")
        return k + 1

    k, v = torch.randn(3, 1, 8, generator=torch.Generator().manual_seed(0)), torch.ones(3, 1, 8)
    want, got = _caches(2), _caches(2)
    expected = _run_updates(g, want, False, k, v)
    with compilation_counter.expect(num_backend_compilations=1, num_eager_fallbacks=0):
        out = _run_updates(g, got, True, k, v, fallback="error")
    assert torch.equal(out, expected)
    assert all(torch.equal(a, b) for n in want for a, b in zip(want[n], got[n]))


def test_a_piece_reading_a_cache_it_updates_runs_eagerly():
    # The cache was both a plain input and the in-place output: ONNX Runtime wrote it
    # before the read, so the piece saw the new contents (eager: the old). Silent.
    def f(k, key_cache):
        before = key_cache.sum() * 1.0
        ops.unified_kv_cache_update(k, k, "from_forward_context")
        return before

    want, got = _caches(), _caches()
    expected = _run_updates(f, want, False, torch.ones(3, 1, 8), want["l0"][0])
    with compilation_counter.expect(num_backend_compilations=1, num_eager_fallbacks=1):
        out = _run_updates(f, got, True, torch.ones(3, 1, 8), got["l0"][0])
    assert out.item() == expected.item() == 0.0
    assert torch.equal(want["l0"][0], got["l0"][0])
    (runner,) = last_compile_report().runners()  # the warning says it once per process
    assert runner.use_eager


def test_one_tensor_as_key_and_value_cache_is_a_clear_error():
    # Both written in place in one run: the value cache held the key (found by review).
    def f(k, v):
        ops.unified_kv_cache_update(k, v, "from_forward_context")
        return k + 1

    with pytest.raises(CacheLayoutError, match="the caches of layer 'l0' share memory .* a tensor of its own"):
        _run_updates(f, _caches(shared=True), True, torch.ones(3, 1, 8), torch.full((3, 1, 8), 10.0))


def test_two_layers_sharing_a_cache_in_one_piece_is_a_clear_error():
    # Two updates in one piece lower now; layers whose caches share memory were written in
    # ONNX Runtime's order (the first write stayed), silently (found by review).
    def g(k, v):
        ops.unified_kv_cache_update(k * 1, v * 2, "from_forward_context")
        ops.unified_kv_cache_update(k * 3, v * 4, "from_forward_context")
        return k + 1

    caches = _caches(2)
    caches["l1"] = (caches["l1"][0], caches["l0"][0])  # layer 1's value cache is layer 0's key cache
    with pytest.raises(CacheLayoutError, match="the caches of layers 'l0' and 'l1' share memory"):
        _run_updates(g, caches, True, torch.ones(3, 1, 8), torch.ones(3, 1, 8))
    halves = torch.zeros(2, 2, 2, 1, 4, 8)  # caches that are parts of one tensor, apart: fine
    want, got = ({"l0": (h[0, 0], h[0, 1]), "l1": (h[1, 0], h[1, 1])} for h in (halves, halves.clone()))
    k = torch.randn(3, 1, 8, generator=torch.Generator().manual_seed(1))
    _run_updates(g, want, False, k, k)
    with compilation_counter.expect(num_eager_fallbacks=0):
        _run_updates(g, got, True, k, k, fallback="error")
    assert all(torch.equal(a, b) for n in want for a, b in zip(want[n], got[n]))


# --- bug 5: threads ----------------------------------------------------------------------------------


def test_one_compiled_model_runs_from_three_threads():
    """Each thread has its own forward context (caches, slot mapping); every one must get
    exactly what eager gives it, step after step, with the steps interleaved. (Before
    runners kept a binding per thread this crashed ONNX Runtime or mixed up caches.)"""
    torch.manual_seed(0)
    model = QaicLlamaForCausalLM(QaicLlamaConfig(num_hidden_layers=3, hidden_size=256, intermediate_size=512)).eval()
    compiled = torch.compile(model, backend="qaic")
    prompts = [PROMPTS, [[7, 7, 7], [1, 2, 3, 4, 5, 6], [9]], [[11, 12], [13], [14, 15, 16, 17]]]
    steps = 12
    with torch.no_grad():
        want = [Driver(model, p).generate(model, steps) for p in prompts]
        Driver(model, prompts[0]).generate(compiled, 0)  # compile before the threads start
    got: dict[int, list] = {}
    errors: list[BaseException] = []
    barrier = threading.Barrier(len(prompts))

    def work(i):
        try:
            barrier.wait()
            with torch.no_grad():
                got[i] = Driver(model, prompts[i]).generate(compiled, steps)
        except BaseException as e:  # reported below
            errors.append(e)

    with compilation_counter.expect(num_backend_compilations=0, num_eager_fallbacks=0):
        threads = [threading.Thread(target=work, args=(i,)) for i in range(len(prompts))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert not errors, errors
    for i in range(len(prompts)):
        assert [o.argmax(-1).tolist() for o in got[i]] == [w.argmax(-1).tolist() for w in want[i]]
        assert max((a - b).abs().max().item() for a, b in zip(got[i], want[i])) < 1e-4


def test_two_engines_run_from_two_threads():
    from qaic_dynamo import LLM

    model = llama()
    prompts = [[[5, 6, 7], [8, 9]], [[1, 2, 3, 4], [10]]]
    want = [LLM(model, backend="eager", max_num_seqs=2, max_model_len=64).generate(p, 6) for p in prompts]
    engines = [LLM(model, backend="qaic", max_num_seqs=2, max_model_len=64) for _ in prompts]
    engines[0].generate(prompts[0], 1)  # compile once up front; the second engine reuses
    got, errors = {}, []

    def work(i):
        try:
            got[i] = engines[i].generate(prompts[i], 6)
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert [got[0], got[1]] == want


def test_counters_lose_no_updates_under_threads():
    counter = CompilationCounter()

    def work():
        for _ in range(20000):
            counter.bump(num_graphs_seen=1)

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert counter.num_graphs_seen == 80000


# --- bug 8: degenerate pieces lower (or run directly), with no warning ----------------------------


class DeadCodeOnly(nn.Module):
    def forward(self, x):
        torch.cumsum(x, 0)  # computed, never used: Dynamo hands such graphs over at breaks
        return ()


class PassThrough(nn.Module):
    def forward(self, x, y):
        torch.cumsum(x, 0)  # dead: the piece exists, but only passes its inputs on
        return (y, x)


class ConstantsOnly(nn.Module):
    def forward(self, x):
        # A tensor that depends on no input value: the exported graph can fold to an
        # initializer with no node at all.
        return (3, 1.5, x.new_ones(2, 3))


class SizeOnly(nn.Module):
    def forward(self, x):
        return (x.size(0) * 2,)


def _fake_graph(module, *shapes, dynamic=False):
    """A traced graph with fake example values, as Dynamo hands it to a backend."""
    gm = fx.symbolic_trace(module)
    mode = FakeTensorMode(shape_env=ShapeEnv())
    with mode:
        fakes = []
        for shape in shapes:
            t = torch.empty(shape)
            if dynamic:
                t = mode.from_tensor(torch.empty(shape), symbolic_context=None)
            fakes.append(t)
    for node, fake in zip([n for n in gm.graph.nodes if n.op == "placeholder"], fakes):
        node.meta["example_value"] = fake
    return gm, fakes


@pytest.mark.parametrize(
    "module, shapes, want",
    [
        (DeadCodeOnly(), [(4, 3)], lambda x: ()),
        (PassThrough(), [(2,), (3,)], lambda x, y: (y, x)),
        (ConstantsOnly(), [(2,)], lambda x: (3, 1.5, x.new_ones(2, 3))),
        (SizeOnly(), [(5, 2)], lambda x: (10,)),
    ],
    ids=["dead-code", "pass-through", "constants", "size"],
)
def test_degenerate_pieces_lower_without_warnings(module, shapes, want):
    gm, fakes = _fake_graph(module, *shapes)
    config = CompilationConfig(fallback="error", cache=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with compilation_counter.expect(num_eager_fallbacks=0, num_backend_compilations=1):
            compiled = QaicBackend(config)(gm, fakes)
    report = last_compile_report()
    assert [p.source for p in report.pieces] == [Source.LOWERED]
    real = [torch.randn(s) for s in shapes]
    got, expected = compiled(*real), want(*real)
    assert len(got) == len(expected)
    for a, b in zip(got, expected):
        if isinstance(b, torch.Tensor):
            torch.testing.assert_close(a, b)
        else:
            assert a == b
    runner = next(iter(report.runners()), None)
    assert isinstance(runner, PieceRunner)
    if not any(isinstance(b, torch.Tensor) and not any(b is r for r in real) for b in expected):
        assert runner.artifact.session is None, "a piece with no compute needs no session"


# --- quiet by default ----------------------------------------------------------------------------


def test_a_compile_prints_no_warnings(capfd):
    model = llama()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # any Python warning fails the test
        out = run_steps(model, torch.compile(model, backend="qaic", options={"fallback": "error"}), steps=1)
    assert len(out) == 2
    captured = capfd.readouterr()
    assert "Removing initializer" not in captured.err and "Warning" not in captured.err, captured.err[-2000:]


# --- lowering: the direct path, and the exporter as a counted fallback --------------------------


def test_every_piece_is_lowered_directly():
    model = llama(3)
    with compilation_counter.expect(num_backend_compilations=3, num_onnx_exports=3, num_exporter_fallbacks=0):
        run_steps(model, torch.compile(model, backend="qaic", options={"fallback": "error"}), steps=1)
    lowered = [p for p in last_compile_report().pieces if p.source is Source.LOWERED]
    for p in lowered:
        stats = json.loads((Path(p.artifact) / LAYOUT_FILE).read_text())["stats"]
        assert stats["lowered_with"] == "direct" and p.exporter_fallback is None
        assert set(stats["seconds"]) == {"prepare", "aten_trace", "translate", "checks", "save"}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_a_tensor_constant_is_lowered_directly(dtype):
    # A tensor made in the compiled code is a get_attr constant of the piece. The direct
    # path's fake mode refused the real tensor, so every such piece went to the exporter
    # (transformers' DynamicCache starts each layer from torch.tensor([]): every whole-model
    # HF compile with use_cache=True did).
    def fn(x):
        return x * torch.tensor([1.5, -2.25], dtype=dtype) + torch.cat([torch.tensor([], dtype=dtype), x[0]])

    x = torch.randn(3, 2, dtype=dtype)
    with compilation_counter.expect(
        num_backend_compilations=1, num_onnx_exports=1, num_exporter_fallbacks=0, num_eager_fallbacks=0
    ):
        out = torch.compile(fn, backend="qaic", options={"fallback": "error"})(x)
    if dtype == torch.float16:
        # ONNX Runtime's CPU runs float16 Mul/Add in float32 and drops the casts between
        # them, so the chain is rounded once (docs/usage.md); eager rounds each op.
        want = (x.float() * torch.tensor([1.5, -2.25]) + x[0].float()).half()
    else:
        want = fn(x)
    torch.testing.assert_close(out, want, rtol=0, atol=0)
    assert last_compile_report().pieces[0].exporter_fallback is None


def test_pieces_take_dynamos_fake_values_which_equal_fake_tensor_propagation(monkeypatch):
    # prepare() reads every node's value from Dynamo's meta["example_value"] instead of
    # re-running the piece on fakes; both must give the same value for every node.
    from torch.fx.passes.fake_tensor_prop import FakeTensorProp

    from qaic_dynamo.lowering import prepare

    seen, original = [], prepare.fake_values

    def checked(gm, example_args, fake_mode):
        propagated = FakeTensorProp.propagate_dont_convert_inputs
        calls = []
        monkeypatch.setattr(FakeTensorProp, "propagate_dont_convert_inputs", lambda *a: calls.append(a))
        original(gm, example_args, fake_mode)
        monkeypatch.setattr(FakeTensorProp, "propagate_dont_convert_inputs", propagated)
        assert calls == [], "a backend piece must not be propagated again"
        taken = {n: n.meta.pop("val") for n in gm.graph.nodes if "val" in n.meta}
        FakeTensorProp(gm, mode=fake_mode).propagate_dont_convert_inputs(*example_args)
        for node, val in taken.items():
            want = node.meta["val"]
            if isinstance(want, torch.Tensor):
                assert (str(val.shape), val.dtype, str(val.stride())) == (
                    str(want.shape),
                    want.dtype,
                    str(want.stride()),
                ), node
            else:
                assert str(val) == str(want), node
        seen.append(len(taken))

    monkeypatch.setattr(prepare, "fake_values", checked)
    model = llama(2)
    run_steps(model, torch.compile(model, backend="qaic", options={"fallback": "error"}), steps=1)
    assert len(seen) == 3 and all(n > 5 for n in seen), seen  # first, middle, last piece


def test_fake_values_propagate_a_graph_without_dynamos_values():
    from qaic_dynamo.lowering.prepare import fake_values

    gm = fx.symbolic_trace(nn.Sequential(nn.Linear(4, 3), nn.ReLU()))
    mode = FakeTensorMode(shape_env=ShapeEnv(), allow_non_fake_inputs=True)  # the weights are real
    x = mode.from_tensor(torch.randn(2, 4))
    fake_values(gm, [x], mode)
    out = next(n for n in gm.graph.nodes if n.op == "output").args[0]
    assert out.meta["val"].shape == (2, 3)


@pytest.mark.parametrize("path", ["direct", "exporter"])
def test_a_recompile_with_the_eps_as_an_input_is_compiled_per_value(path, request):
    # A second model of the same class with another rms_norm eps makes Dynamo recompile the
    # forward with the float as a graph input. Those pieces went to the exporter (which
    # once crashed Dynamo there: a strict re-export inside the compile dropped the frame's
    # cache entries), then ran eagerly with a warning. Now the graph is compiled at the
    # value each call carries; the exporter, forced, lowers the recompile too.
    if path == "exporter":
        request.getfixturevalue("exporter_path")
    outs, caught = [], []
    for eps in (1e-5, 1e-6):
        torch.manual_seed(0)
        model = QaicLlamaForCausalLM(QaicLlamaConfig(num_hidden_layers=2, rms_norm_eps=eps)).eval()
        exported = 3 if path == "exporter" else 0  # first, middle, last: each compile lowers its own
        with (
            warnings.catch_warnings(record=True) as record,
            compilation_counter.expect(num_eager_fallbacks=0, num_exporter_fallbacks=exported),
        ):
            warnings.simplefilter("always")
            got = run_steps(model, torch.compile(model, backend="qaic"), steps=1)
        caught.append([str(w.message) for w in record])
        want = run_steps(model, model, steps=1)
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
        outs.append(got)
    assert not torch.equal(outs[0][0], outs[1][0]), "the two models differ"
    assert not any("runs eagerly" in m for m in caught[0] + caught[1]), caught
    assert last_compile_report().specialized_floats  # the recompile's, with the eps as input


def test_an_output_that_is_an_input_keeps_the_input_named():
    # A piece passing a tensor through (transformers' sliding-window cache layers return
    # their key tensor unchanged) had one ONNX value as input and output; naming the output
    # renamed the input, and the piece failed its input check and ran eagerly.
    import onnx
    import onnxruntime as ort

    from qaic_dynamo.lowering import aten_graph, translate_aten

    def fn(x, y):
        return x, y + 1, y + 1

    example = [torch.randn(3, 4), torch.randn(3, 4)]
    gm = aten_graph(fn, example, [None, None], 18)
    model = translate_aten(gm, ["x", "y"], ["a", "b", "c"], 18)
    onnx.checker.check_model(model, full_check=True)
    assert [i.name for i in model.graph.input] == ["x", "y"]
    assert [o.name for o in model.graph.output] == ["a", "b", "c"]
    a, b, c = ort.InferenceSession(model.SerializeToString()).run(
        None, {"x": example[0].numpy(), "y": example[1].numpy()}
    )
    torch.testing.assert_close(torch.from_numpy(a), example[0])
    torch.testing.assert_close(torch.from_numpy(b), example[1] + 1)
    torch.testing.assert_close(torch.from_numpy(c), example[1] + 1)


def test_a_size_no_tensor_carries_reaches_the_onnx_through_a_carrier():
    # A Python int Dynamo made dynamic (transformers' sliding-window cache length) is a
    # SymInt piece input that no tensor input has as a dimension; a piece's ONNX takes only
    # tensors, so such pieces ran eagerly. Now the runtime binds a bool tensor of that length.
    def f(x, n):
        return torch.ones(n) * x.sum() + torch.arange(n)

    fn = torch.compile(f, backend="qaic", dynamic=True, options={"fallback": "error"})
    with compilation_counter.expect(num_backend_compilations=1, num_eager_fallbacks=0, num_exporter_fallbacks=0):
        for n in (5, 7, 2, 3, 9):
            x = torch.arange(4.0) * n
            torch.testing.assert_close(fn(x, n), f(x, n), rtol=0, atol=0)
    layout = json.loads((Path(last_compile_report().pieces[0].artifact) / LAYOUT_FILE).read_text())
    assert ["size", 0] in [i["source"] for i in layout["inputs"]]
    # The bound carrier outlives the run: the runner's shared buffer may be replaced (grown
    # by another thread) meanwhile, and the binding must not point at freed memory.
    (runner,) = last_compile_report().runners()
    runner._size_carrier(50)  # what another thread's call does after the last call (n=9) bound
    bound = runner.bound_inputs()
    carrier = next(name for name, src in runner._inputs if src[0] == "size")
    assert bound[carrier] in [t.data_ptr() for t in runner._this_thread().keep]


@pytest.mark.parametrize("fallback", ["eager", "error"])
def test_unbindable_calls_run_eagerly_for_that_call_only(fallback):
    # A size carrier is as long as its int (an int used only as a scalar gets one too: a
    # seed of 3e11 failed to allocate), and an empty output has a null data pointer
    # ONNX Runtime refuses: either failure made the piece eager for good, and under
    # fallback="error" raised (found by review). Now eager serves that call only.
    def f(x, n):
        return x[:, n:] * n

    fn = torch.compile(f, backend="qaic", dynamic=True, options={"fallback": fallback})
    x = torch.arange(16.0).reshape(2, 8)
    # Two graphs: Dynamo guards 0 <= n <= 8 on the first and recompiles past it.
    with compilation_counter.expect(num_backend_compilations=2, num_eager_fallbacks=0):
        for n in (3, 300_000_000_000, 9, 5):  # compiled, huge int, empty output, compiled
            torch.testing.assert_close(fn(x, n), f(x, n), rtol=0, atol=0)
    runners = [r for report in qaic_dynamo.compile_reports()[-2:] for r in report.runners()]
    assert len(runners) == 2 and not any(r.use_eager for r in runners)


def test_registry_matches_from_torchlib():
    # onnx_registry builds torch.onnx's registry without from_torchlib's slow listing; it
    # must hold the same functions for every op, or the direct path would translate
    # differently from the exporter.
    from torch.onnx._internal.exporter._registration import ONNXRegistry

    from qaic_dynamo.lowering.registry import onnx_registry

    ours, reference = onnx_registry(18), ONNXRegistry.from_torchlib(opset_version=18)

    def table(registry):
        return {
            target: [(m.onnx_function, m.is_complex, m.is_custom) for m in metas]
            for target, metas in registry.functions.items()
        }

    theirs, mine = table(reference), table(ours)
    qaic = {t for t in mine if str(t).startswith("qaic::")}
    assert len(theirs) > 300 and {t: v for t, v in mine.items() if t not in qaic} == theirs
    assert qaic == {str(op.overload.name()) for op in QAIC_OPS.values() if op.onnx_function}


def test_deferred_script_functions_equal_onnxscripts_own():
    # onnx_registry imports onnxscript's torch library with its functions' conversion
    # (script mode) and signature inference (trace-only) deferred to first use. Each must
    # answer everything the exporter reads as the function onnxscript builds from the
    # same source does, and stay of onnxscript's class (dispatch tells script from traced
    # functions by isinstance).
    import inspect

    import onnxscript

    from qaic_dynamo.lowering.deferred import deferred_script_function_class, deferred_signature_traced_function_class
    from qaic_dynamo.lowering.registry import onnx_registry

    onnx_registry(18)  # it imports the library, unless something in this process did first
    from onnxscript.function_libs.torch_lib import registration
    from onnxscript.function_libs.torch_lib.ops import common

    if not any(isinstance(f, deferred_script_function_class()) for f in vars(common).values()):
        # Imported the eager way before the registry (e.g. by a torch.onnx.export in an
        # earlier test): check in a fresh process, where the registry imports it - and
        # where this must not happen again.
        assert not os.environ.get("QAIC_TEST_DEFERRAL_CHILD"), "the fresh process imported the library eagerly"
        test = f"{__file__}::test_deferred_script_functions_equal_onnxscripts_own"
        child = subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", test],
            capture_output=True,
            text=True,
            timeout=300,
            env={**os.environ, "QAIC_TEST_DEFERRAL_CHILD": "1"},
        )
        assert child.returncode == 0 and "1 passed" in child.stdout, child.stdout[-3000:]
        return
    # The wrappers are onnxscript's own again once the library is imported.
    assert onnxscript.values.TracedOnnxFunction is not deferred_signature_traced_function_class()
    assert onnxscript.script.__module__ == "onnxscript._internal.main"
    functions = {
        id(f): f
        for overloads in registration.default_registry.values()
        for f in overloads.overloads + overloads.complex
    }
    functions.update((id(f), f) for f in vars(common).values() if isinstance(f, onnxscript.OnnxFunction))
    scripted = [f for f in functions.values() if isinstance(f, deferred_script_function_class())]
    traced = [f for f in functions.values() if isinstance(f, deferred_signature_traced_function_class())]
    assert len(scripted) >= 40 and len(traced) >= 400  # 45 and 448 in onnxscript 0.7.2
    assert len(scripted) + len(traced) == len(functions)  # nothing built the eager way
    for f in scripted:
        assert isinstance(f, onnxscript.OnnxFunction)
        own = onnxscript.script(onnxscript.values.Opset(f.opset.domain, f.opset.version))(f.function)
        assert (f.name, f.domain, f.opset.version, f.source) == (own.name, own.domain, own.opset.version, own.source)
        assert f.to_function_proto() == own.to_function_proto(), f.name
        assert f.op_signature == own.op_signature, f.name
        assert inspect.signature(f) == inspect.signature(own), f.name
    for f in traced:
        assert isinstance(f, onnxscript.values.TracedOnnxFunction)
        own = onnxscript.values.TracedOnnxFunction(onnxscript.values.Opset(f.opset.domain, f.opset.version), f.func)
        assert (f.name, f.domain, f.opset.version) == (own.name, own.domain, own.opset.version)
        assert f.op_signature == own.op_signature, f.name
        assert inspect.signature(f) == inspect.signature(own), f.name


DEFERRAL_CHECK = """
import sys
import onnxscript
from onnxscript import opset18 as op
from qaic_dynamo.lowering.deferred import (deferred_script_conversion, deferred_script_function_class,
                                           deferred_signature_traced_function_class)

assert "onnxscript.function_libs.torch_lib.ops" not in sys.modules
script, traced = onnxscript.script, onnxscript.values.TracedOnnxFunction


def relu(x):
    return op.Relu(x)


first, second = deferred_script_conversion(), deferred_script_conversion()
first.__enter__()
second.__enter__()  # e.g. another thread building the registry meanwhile
# A function outside the torch library is onnxscript's own business, converted at once.
assert type(onnxscript.script()(relu)) is onnxscript.OnnxFunction
assert type(onnxscript.values.TracedOnnxFunction(op, relu)) is traced
made = {"op": op}
exec("def made(x):\\n    return op.Relu(x)\\n", made)  # no __name__ global: __module__ is None
assert made["made"].__module__ is None
assert type(onnxscript.values.TracedOnnxFunction(op, made["made"])) is traced
relu.__module__ = "onnxscript.function_libs.torch_lib.ops.example"
assert isinstance(onnxscript.script()(relu), deferred_script_function_class())
assert isinstance(onnxscript.values.TracedOnnxFunction(op, relu), deferred_signature_traced_function_class())
first.__exit__(None, None, None)  # the first to enter leaves first: the second is still active
assert onnxscript.script is not script
second.__exit__(None, None, None)
assert (onnxscript.script, onnxscript.values.TracedOnnxFunction) == (script, traced)
try:
    with deferred_script_conversion():
        raise KeyError("an import failed")
except KeyError:
    pass
assert (onnxscript.script, onnxscript.values.TracedOnnxFunction) == (script, traced)

# Two threads lowering in a cold process: one registry, the library deferred, the
# wrappers onnxscript's own afterwards.
import threading
from qaic_dynamo.lowering.registry import onnx_registry

got = []
threads = [threading.Thread(target=lambda: got.append(onnx_registry(18))) for _ in range(2)]
for t in threads:
    t.start()
for t in threads:
    t.join()
assert len(got) == 2 and got[0] is got[1]
from onnxscript.function_libs.torch_lib.ops import common  # imported by the registry, deferred

assert any(isinstance(f, deferred_script_function_class()) for f in vars(common).values())
assert (onnxscript.script, onnxscript.values.TracedOnnxFunction) == (script, traced)
print("ok")
"""


def test_deferred_conversion_is_counted_and_only_for_the_torch_library(tmp_path):
    # In a fresh process: once onnxscript's torch library is imported the context has
    # nothing to defer and does nothing. onnxscript reads a scripted function's source
    # file, so the check is a file, not `python -c`.
    check = tmp_path / "deferral_check.py"
    check.write_text(DEFERRAL_CHECK)
    child = subprocess.run([sys.executable, str(check)], capture_output=True, text=True, timeout=300)
    assert child.returncode == 0 and child.stdout.strip().endswith("ok"), child.stdout[-2000:] + child.stderr[-3000:]


def test_decompositions_are_the_exporters_without_its_composite_implicit_entries():
    # The direct path's table is torch.onnx's create_onnx_friendly_decomposition_table
    # minus the entries that only run an op's CompositeImplicitAutograd kernel (make_fx
    # runs that kernel itself for an op without an entry): the same function for every op
    # it keeps, and every op it leaves out is such an op.
    from torch._export.utils import _is_cia_op

    from qaic_dynamo._compat import torch_onnx_internals
    from qaic_dynamo.lowering.registry import decompositions, onnx_registry

    onnx_decomp = torch_onnx_internals().decomp
    full = onnx_decomp.create_onnx_friendly_decomposition_table(
        set(onnx_decomp.get_onnx_implemented_overloads(onnx_registry(18)))
    )
    from qaic_dynamo.lowering import TORCH_SEMANTICS

    # Beside them, a few of our own where the translation differs from eager (tested in
    # test_backend's arithmetic and attention tests; where one declines a dtype, torch's
    # own entry, if any, runs after it).
    ours = {op: fn for op, fn in decompositions(18).items() if op not in TORCH_SEMANTICS}
    assert ours.keys() <= full.keys()
    assert [op for op in ours if ours[op] is not full[op]] == []
    left_out = [op for op in full if op not in ours and op not in TORCH_SEMANTICS]
    assert len(ours) > 500 and len(left_out) > 100
    assert [op for op in left_out if not _is_cia_op(op)] == []


def test_op_signatures_are_inferred_for_the_ops_a_graph_uses_and_equal_the_eager_inference():
    # onnx_registry leaves onnxscript functions' signatures uninferred (0.3-0.5 s for all);
    # infer_op_signatures fills in exactly those a graph's ops may dispatch to, with what
    # OnnxDecompMeta would have inferred at construction.
    import torch.fx as fx
    from torch.onnx._internal.exporter._registration import OnnxDecompMeta

    from qaic_dynamo.lowering.registry import build_onnx_registry
    from qaic_dynamo.lowering.signatures import infer_op_signatures

    registry = build_onnx_registry(18)  # a fresh one: another test may have inferred all of the cached one's
    graph = fx.Graph()
    x = graph.placeholder("x")
    graph.output(
        graph.call_function(torch.ops.aten.gelu.default, (graph.call_function(torch.ops.aten.mul.Tensor, (x, x)),))
    )
    used = [m for t in (torch.ops.aten.mul.Tensor, torch.ops.aten.gelu.default) for m in registry.get_decomps(t)]
    untouched = [m for m in registry.get_decomps(torch.ops.aten.bitwise_xor.Tensor) if m.signature is None]
    assert used and untouched
    infer_op_signatures(registry, [graph])
    for meta in used:
        eager = OnnxDecompMeta(
            onnx_function=meta.onnx_function, fx_target=meta.fx_target, signature=None, is_complex=meta.is_complex
        )
        assert meta.signature is not None and meta.signature == eager.signature, meta.onnx_function
    assert all(m.signature is None and m.skip_signature_inference for m in untouched)


def test_without_the_direct_path_the_exporter_lowers_every_piece_with_one_warning(monkeypatch):
    from qaic_dynamo._compat import torch_2_13

    monkeypatch.setattr(torch_2_13, "TESTED_TORCH", "0.0.0")
    torch_2_13.torch_onnx_internals.cache_clear()
    try:
        model = llama()
        with (
            pytest.warns(
                RuntimeWarning, match=r"public torch.onnx exporter \(slower\): torch .* is not the tested 0.0.0"
            ),
            compilation_counter.expect(num_backend_compilations=3, num_exporter_fallbacks=3),
        ):
            out = run_steps(model, torch.compile(model, backend="qaic", options={"fallback": "error"}), steps=1)
        lowered = [p for p in last_compile_report().pieces if p.source is Source.LOWERED]
        assert len(lowered) == 3 and all("no direct path on torch" in p.exporter_fallback for p in lowered)
        assert "lowered by the exporter: no direct path" in last_compile_report().table()
    finally:
        torch_2_13.torch_onnx_internals.cache_clear()
    ref = run_steps(model, model, steps=1)
    assert max((a - b).abs().max().item() for a, b in zip(out, ref)) < 1e-4


def test_a_symbolic_size_output_is_evaluated_per_call():
    """A piece whose output is an expression in a dynamic size must evaluate it for every
    call's sizes (it was parsed with symbols that never matched the substituted ones)."""

    def f(x):
        return x * 2, x.size(0) * 3 + 1

    compiled = torch.compile(f, backend="qaic", dynamic=True, options={"fallback": "error"})
    with compilation_counter.expect(num_graphs_seen=1, num_eager_fallbacks=0):
        for n in (5, 9, 4):
            out, size = compiled(torch.ones(n, 2))
            assert size == 3 * n + 1 and torch.equal(out, torch.full((n, 2), 2.0))
    layout = json.loads((Path(last_compile_report().pieces[0].artifact) / LAYOUT_FILE).read_text())
    assert any(leaf[0] == "sym" for leaf in layout["leaves"]), layout["leaves"]


@torch.library.custom_op("qaic_test::size_branch", mutates_args=())
def size_branch(x: torch.Tensor) -> torch.Tensor:
    return x.clone()


@size_branch.register_fake
def _(x):
    # Branching on a dynamic size makes a tracer specialise it.
    return torch.empty_like(x) if x.shape[0] == 17 else torch.empty_like(x)


def test_the_direct_path_refuses_a_trace_that_specialises_a_dynamic_size():
    """Such a trace would give an ONNX model that serves one token count only; it must
    never be used (the exporter, or an eager fallback, takes the piece instead)."""
    from qaic_dynamo import lowering
    from qaic_dynamo.lowering.prepare import prepare

    def f(x):
        return size_branch(x * 2) + 1

    graphs = []
    torch.compile(f, backend=lambda gm, ex: graphs.append((gm, ex)) or gm.forward, dynamic=True)(torch.ones(5, 3))
    gm, example = graphs[0]
    args = [n.meta["example_value"] for n in gm.graph.nodes if n.op == "placeholder"]
    prepared = prepare(gm, args, args[-1].fake_mode)
    with pytest.raises(Exception, match=r"specialised dynamic size\(s\) \['s\d+'\] to constants"):
        lowering.aten_graph(prepared.gm, prepared.example, prepared.dynamic_shapes, 18)


def test_a_size_expression_input_is_computed_from_tensor_dims():
    """A piece may receive a size that is an expression of a tensor's dims (an MoE layer's
    tokens x top-k): it is computed from those dims in the ONNX, not an eager fallback."""

    def f(x):
        x = x + 1
        n = x.shape[0] * 2 + 1  # computed before the split, used after it
        z = torch.relu(x)
        return torch.ones(n) * z.sum()

    with compilation_counter.expect(num_backend_compilations=2, num_eager_fallbacks=0):
        c = torch.compile(
            f, backend="qaic", options={"splitting_ops": ["aten::relu"], "fallback": "error"}, dynamic=True
        )
        for n in (5, 7):
            x = torch.randn(n, 3)
            out = c(x)
            assert out.shape == (2 * n + 1,)
            torch.testing.assert_close(out, f(x))


def _promotion_cases():
    def mixed(x, i, h):
        # float + long, a python float into a half tensor, cumsum of bool, where with a scalar
        y = x + i.unsqueeze(-1) + (i > 2).cumsum(-1).unsqueeze(-1)
        return torch.where(y > 0, h * 0.5, 0).float() + y, (h + x.half()).sum(-1)

    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    llama = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=64,
            hidden_size=32,
            intermediate_size=48,
            num_hidden_layers=1,
            num_attention_heads=4,
            num_key_value_heads=2,
        )
    ).eval()

    state = {**dict(llama.named_parameters()), **dict(llama.named_buffers())}
    names = list(state)

    def hf_llama(x, i, h, *params):  # weights are inputs, as the export's trace has them
        return torch.func.functional_call(
            llama, dict(zip(names, params)), (), {"input_ids": i, "use_cache": False}
        ).logits

    example = [torch.randn(3, 5, 4), torch.randint(0, 5, (3, 5)), torch.randn(3, 5, 4).half()]
    dims = [{0: "b", 1: "s"}] * 3
    params = [p.detach() for p in state.values()]
    return [(mixed, example, dims), (hf_llama, example + params, dims + [None] * len(params))]


@pytest.mark.parametrize("case", range(2), ids=["mixed-dtypes", "hf-llama"])
def test_selective_type_promotion_gives_the_exporters_graph(monkeypatch, case):
    # insert_type_promotion re-runs only the nodes it casts; the graph must be exactly the
    # one the exporter's full pass (which re-runs every node) produces.
    from qaic_dynamo._compat import torch_onnx_internals
    from qaic_dynamo.lowering import aten_trace

    fn, example, dims = _promotion_cases()[case]
    with torch.no_grad():
        selective = aten_trace.aten_graph(fn, example, dims, 18)
        monkeypatch.setattr(
            aten_trace, "insert_type_promotion", torch_onnx_internals().fx_passes.insert_type_promotion_nodes
        )
        full = aten_trace.aten_graph(fn, example, dims, 18)
    casts = [n for n in full.graph.nodes if n.target is torch.ops.prims.convert_element_type.default]
    assert casts, "the case must need promotion, or it tests nothing"
    assert selective.code == full.code
    assert [str(n.meta["val"]) for n in selective.graph.nodes if "val" in n.meta] == [
        str(n.meta["val"]) for n in full.graph.nodes if "val" in n.meta
    ]


def test_op_signatures_are_memoized_only_while_translating():
    import onnx
    from onnx_ir.schemas import OpSignature

    from qaic_dynamo.lowering.signatures import memoized_op_signatures

    original = OpSignature.__dict__["from_op_schema"]
    with memoized_op_signatures():
        with memoized_op_signatures():  # overlapping translations (threads)
            a = OpSignature.from_op_schema(onnx.defs.get_schema("Add", 18))
            b = OpSignature.from_op_schema(onnx.defs.get_schema("Add", 18))
        assert a is b and OpSignature.__dict__["from_op_schema"] is not original
    assert OpSignature.__dict__["from_op_schema"] is original
    assert OpSignature.from_op_schema(onnx.defs.get_schema("Add", 18)) == a


# --- PyTorch's OpenMP workers and ONNX Runtime share the cores -----------------------------------------


@pytest.mark.skipif(not torch.backends.openmp.is_available(), reason="PyTorch built without OpenMP")
def test_openmp_workers_are_released_and_pytorch_still_runs_in_parallel():
    """After a parallel region PyTorch's OpenMP workers spin for milliseconds; releasing
    them (omp_pause_resource_all) must succeed, and PyTorch's next parallel region must
    compute the same result."""
    from qaic_dynamo.runtime import release_openmp_workers

    assert release_openmp_workers() is True  # the runtime PyTorch loaded was found
    x = torch.randn(256, 512)
    want = x @ x.T  # a parallel region: the workers now spin
    assert release_openmp_workers() is True
    assert torch.equal(x @ x.T, want)


@pytest.mark.parametrize("release", [True, False])
def test_every_onnx_runtime_run_first_releases_the_openmp_workers(monkeypatch, release):
    from qaic_dynamo.runtime import openmp as runtime

    model = llama()
    compiled = torch.compile(model, backend="qaic", options={"release_openmp_workers": release})
    run_steps(model, compiled, steps=0)  # compile
    events = []
    monkeypatch.setattr(runtime, "_omp_pause", lambda kind: events.append("release") or 0)
    for r in last_compile_report().runners():
        run = r._run_c
        monkeypatch.setattr(r, "_run_c", lambda *a, run=run: (events.append("run"), run(*a))[1])
    run_steps(model, compiled, steps=1)
    assert events.count("run") == 3 * 2  # first, middle, last piece; prefill + 1 decode step
    if release:
        assert all(events[i - 1] == "release" for i, e in enumerate(events) if e == "run")
    else:
        assert "release" not in events


def test_a_size_guard_holds_over_a_range_only_if_it_holds_at_every_size():
    # The second try at the real sizes keeps a trace only if its size guards follow from
    # Dynamo's: sympy cannot simplify Eq(s, Min(10, s)) under s <= 10, so the (small,
    # finite) range is checked value by value; an unbounded one proves nothing.
    import sympy
    from torch.utils._sympy.numbers import int_oo
    from torch.utils._sympy.value_ranges import ValueRanges

    from qaic_dynamo.lowering import holds_over_range

    s = sympy.Symbol("s", integer=True, positive=True)
    clamp = sympy.Eq(s, sympy.Min(10, s))
    assert holds_over_range(clamp, {s: ValueRanges(2, 10)})
    assert not holds_over_range(clamp, {s: ValueRanges(2, 11)})
    assert not holds_over_range(s >= 2, {s: ValueRanges(2, int_oo)})
    assert not holds_over_range(clamp, {})
