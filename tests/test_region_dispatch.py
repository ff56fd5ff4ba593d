"""Guarded dispatch (compiler/regions/dispatch.py): a compiled block runs Dynamo's cached
code after Dynamo's own guards pass, without Dynamo's per-call frame entry - and goes
through Dynamo wherever that entry would do something else (hooks, stances, a changed
attribute or code, a skipped code object, a graph break)."""

from __future__ import annotations

import re
from contextlib import nullcontext

import pytest
import torch
import torch.nn as nn
from region_models import PROMPTS, Scaled, Stack, engine, llama
from torch.utils._python_dispatch import TorchDispatchMode

import qaic_dynamo
from qaic_dynamo import compilation_counter
from qaic_dynamo.config import ConfigError
from qaic_dynamo.runtime import PieceRunner


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
