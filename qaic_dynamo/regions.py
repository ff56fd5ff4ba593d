"""Regional compilation: trace each repeated decoder block once, whatever the depth.

``torch.compile(model, backend="qaic")`` hands the backend one graph for the whole model,
and Dynamo has traced every decoder layer again to build it: its own trace time grows
linearly with depth (measured here, 512-wide Llama: 2.4 s at 2 layers, 14.4 s at 32),
even though the backend then compiles only three unique pieces. :func:`compile` removes
that cost instead of amortising it:

* it finds the repeated blocks - every ``nn.ModuleList`` whose modules are all of one
  class (transformers' ``model.layers``, the reference models' ``layers``);
* it compiles each block with ``backend="qaic"``. All blocks of a list share their
  class's ``forward`` code object, and Dynamo caches compiled code per code object with
  guards that hold for every instance (parameters are graph inputs), so the block is
  traced and lowered once and every other layer runs that same compiled code;
* it compiles the rest - the modules beside those lists on the way from the root
  (embeddings, final norm, rotary embedding, head) - each as a region of its own;
* the Python between regions (the model's own ``forward``) runs eagerly.

This works only if nothing per-layer reaches a traced block: Dynamo guards on every
value a frame reads, so a layer-name string or a layer index read inside the block would
re-trace it per layer until the recompile limit. The qaic ops therefore take their layer
from the forward context (``"from_forward_context"``) for the cache update *and* the
attention.

The token and sequence dimensions of every tensor a region receives are marked dynamic
from the forward context, so one trace serves prefill, decode and every batch size
(Dynamo would otherwise specialise the first call's sizes and recompile on the second).

Once a block is compiled, calling it through ``torch.compile``'s wrapper costs 0.2-0.4 ms
per layer and step here (the wrapper's context set-up, Dynamo's frame evaluation, marking
dynamic dims) - as much as a small block's ONNX Runtime run. With ``region_dispatch=
"guarded"`` (the default) a block looks up Dynamo's cache itself: the same entries, the
same backend match and the same guards, evaluated by Dynamo's own guard manager on the
frame's locals; only when one passes does it run that entry's compiled code directly.
Anything else - no entry, a failed guard, a stance other than the default, hooks on the
block, code that resumes after a graph break - goes through Dynamo as before, which then
recompiles or falls back exactly as it would have (:class:`GuardedDispatch`).

Like ``nn.Module.compile``, this compiles in place and returns the model.
"""

from __future__ import annotations

import functools
import inspect
import threading
import types
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn as nn

from qaic_dynamo.backend import collector_paused
from qaic_dynamo.counter import compilation_counter
from qaic_dynamo.forward_context import get_forward_context, has_forward_context

__all__ = [
    "CompiledRegion", "DYNAMO_SKIPPED", "DynamoInternals", "GuardedDispatch", "RegionPlan", "compile", "dynamo_internals",
    "find_repeated_blocks", "plan_regions", "region_config", "specialized_floats",
]


def find_repeated_blocks(model: nn.Module) -> list[tuple[str, nn.ModuleList]]:
    """Every non-empty ``nn.ModuleList`` whose modules are all of one class, outermost first
    (a list inside a found block belongs to that block's region)."""
    found: list[tuple[str, nn.ModuleList]] = []

    def visit(prefix: str, module: nn.Module) -> None:
        for name, child in module.named_children():
            path = f"{prefix}.{name}" if prefix else name
            if isinstance(child, nn.ModuleList) and len(child) >= 1 and len({type(m) for m in child}) == 1:
                found.append((path, child))
            else:
                visit(path, child)

    visit("", model)
    return found


@dataclass
class RegionPlan:
    """What :func:`compile` compiles: the repeated block lists and the modules beside them."""

    blocks: list[tuple[str, nn.ModuleList]]
    #: (parent, attribute name, dotted path) of every module compiled on its own.
    rest: list[tuple[nn.Module, str, str]] = field(default_factory=list)

    def describe(self) -> str:
        lines = [f"block list {path}: {len(lst)} x {type(lst[0]).__name__}" for path, lst in self.blocks]
        lines += [f"region {path}: {type(getattr(parent, name)).__name__}" for parent, name, path in self.rest]
        return "\n".join(lines)


def plan_regions(model: nn.Module) -> RegionPlan:
    """The regions of ``model``: its repeated block lists, and every module beside the path
    from the root to them (a module that contains no block list is one region)."""
    blocks = find_repeated_blocks(model)
    if not blocks:
        raise ValueError(
            f"qaic_dynamo.compile: {type(model).__name__} has no repeated blocks (an nn.ModuleList of modules "
            "of one class); compile it whole with torch.compile(model, backend='qaic')"
        )
    on_path = {""}
    for path, _ in blocks:
        parts = path.split(".")
        on_path |= {".".join(parts[:i]) for i in range(1, len(parts) + 1)}
    plan = RegionPlan(blocks)

    def visit(prefix: str, module: nn.Module) -> None:
        for name, child in module.named_children():
            path = f"{prefix}.{name}" if prefix else name
            if path in on_path:
                if not isinstance(child, nn.ModuleList):
                    visit(path, child)
            elif any(True for _ in child.parameters()) or any(True for _ in child.buffers()):
                plan.rest.append((module, name, path))

    visit("", model)
    return plan


def specialized_floats() -> Any:
    """Dynamo's config for a qaic compile: floats specialised (a context manager, or a
    decorator).

    By default (``specialize_float=False``) Dynamo turns a float that changed between two
    compiles of one code object - Llama's ``rms_norm_eps`` on a second model of the same
    class, 1e-5 then 1e-6 - into a 0-d tensor input of the recompiled graph, read back with
    ``item()``. The qaic backend cannot carry that scalar across a piece boundary, so those
    pieces ran eagerly (with a warning). Specialised, the float is a constant guarded by
    value: the second model gets an entry of its own, lowered like the first's.
    """
    return torch._dynamo.config.patch(specialize_float=True)


def region_config() -> Any:
    """Dynamo's config for compiling a region: :func:`specialized_floats`, and Dynamo's
    fake tensors without their dispatch cache.

    A region's graph holds each op about once, so a cache entry is almost never hit again,
    and building one with symbolic sizes costs more than running the op's meta kernel
    (lowering traces without it too, see ``lowering.fake_inputs``). Measured on the demo
    model: Dynamo's fake-value propagation 0.72 -> 0.36 s and the first call 2.95 -> 2.57 s
    at 2 layers. Not for a whole-model compile, whose repeated layers do hit the cache:
    at 32 layers its first call took 16.9 s without against 15.3 s with it.

    And a recompile limit of :data:`REGION_RECOMPILE_LIMIT` entries per code object, not
    Dynamo's 8: transformers wraps every decoder layer class's ``forward`` in one function
    (``forward_with_checkpointing``), so the blocks of every model a process compiles share
    that code object's cache - the ninth model's layers (another size, another eps) ran
    eagerly, with nothing but Dynamo's log line to say so.
    """
    return torch._dynamo.config.patch(specialize_float=True, fake_tensor_cache_enabled=False,
                                      recompile_limit=region_recompile_limit())


#: Compiled entries one region code object may hold (see :func:`region_config`); past it
#: a region runs eagerly, with a warning.
REGION_RECOMPILE_LIMIT = 64


def region_recompile_limit() -> int:
    """The recompile limit a region compiles under: ours, or Dynamo's if that is higher."""
    return max(REGION_RECOMPILE_LIMIT, torch._dynamo.config.recompile_limit)


def _tensors(values: Any) -> Iterator[torch.Tensor]:
    for v in values:
        if isinstance(v, torch.Tensor):
            yield v
        elif isinstance(v, (tuple, list)):
            yield from _tensors(v)


def mark_dynamic_dims(args: tuple, kwargs: dict[str, Any]) -> None:
    """Mark the dimension that changes between forward passes dynamic, so a region is
    traced once for every batch: the forward context's (padded) token count, or its
    sequence count padded to two as the engine pads logits rows (the final norm and head
    see one row per sequence). Dynamo specialises sizes 0 and 1 whatever we do.
    Outside a forward context nothing is marked.

    Only a tensor's leading non-unit dimension is a candidate: the engine runs one flat
    batch (``[1, tokens, ...]`` or ``[tokens, ...]``). A model dimension that merely
    equals the count (GPT-NeoX's 4 rotary dims at 4 sequences, a head size of 16 at 16
    tokens) made symbolic fails the piece's lowering (it ran eagerly)."""
    if not has_forward_context():
        return
    md = get_forward_context().attn_metadata
    sizes = {md.num_tokens, max(2, md.num_seqs)} - {0, 1}
    for t in _tensors((*args, *kwargs.values())):
        d = next((d for d, size in enumerate(t.shape) if size != 1), None)
        if d is not None and t.shape[d] in sizes:
            torch._dynamo.maybe_mark_dynamic(t, d)


class CompiledRegion(nn.Module):
    """A module run through its compiled form; attributes the model's own Python reads
    (e.g. transformers' ``decoder_layer.attention_type``) are the wrapped module's."""

    def __init__(self, module: nn.Module, compiled: Any, dispatch: GuardedDispatch | None = None) -> None:
        super().__init__()
        self.module = module
        object.__setattr__(self, "_compiled", compiled)  # not a submodule: no duplicate parameters
        object.__setattr__(self, "dispatch", dispatch)
        # The wrapper is invisible in checkpoints: the model's state_dict keys stay those of
        # the uncompiled model (``layers.0.mlp...``, not ``layers.0.module.mlp...``), so a
        # checkpoint saved before compiling loads after it and vice versa.
        self._register_state_dict_hook(_drop_wrapper_prefix)
        self._register_load_state_dict_pre_hook(_add_wrapper_prefix, with_module=True)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self.dispatch is not None:
            compiled_code = self.dispatch.lookup(args, kwargs)
            if compiled_code is not None:
                compilation_counter.bump(num_guarded_region_calls=1)
                return compiled_code(*args, **kwargs)
        compilation_counter.bump(num_dynamo_region_calls=1)
        breaks = self.dispatch.graph_breaks() if self.dispatch is not None else 0
        mark_dynamic_dims(args, kwargs)
        # The collector paused for Dynamo's trace too, not only for the backend: a region
        # compiles here (a warm restart at 32 layers 2.19 -> 1.75 s, docs/benchmarks.md),
        # and a call through Dynamo that only runs cached code pays ~5 us for it (timed).
        with region_config(), collector_paused():
            out = self._compiled(*args, **kwargs)
        if self.dispatch is not None:
            self.dispatch.after_dynamo(breaks)
        return out

    def __getstate__(self) -> Any:
        # copy.deepcopy and pickle reach the torch.compile wrapper and Dynamo's modules
        # ("cannot pickle 'module' object"); say what works instead.
        raise TypeError(
            "a model compiled with qaic_dynamo.compile holds compiled code, which cannot be copied or pickled; "
            "deepcopy or torch.save the model before compiling it and compile the copy, or save its state_dict "
            "(it loads into the compiled model and back)"
        )

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self._modules["module"], name)

    def __setattr__(self, name: str, value: Any) -> None:
        # Writes go to the wrapped module, as reads come from it: ``layer.flag = x`` on a
        # compiled layer must change what the layer computes (Dynamo guards on the wrapped
        # module's attributes), not shadow it with a wrapper attribute nothing reads.
        # The wrapper's own state (nn.Module's fields, ``module``, ``dispatch``) stays here.
        if name in self.__dict__ or name == "module" or "module" not in self.__dict__.get("_modules", {}):
            super().__setattr__(name, value)
        else:
            setattr(self._modules["module"], name, value)

    def __delattr__(self, name: str) -> None:
        if name in self.__dict__ or name == "module":
            super().__delattr__(name)
        else:
            delattr(self._modules["module"], name)


# --- Dynamo's private pieces: the one place regions name them -----------------------------


@dataclass(frozen=True)
class DynamoInternals:
    """What guarded dispatch reads of Dynamo and torch.nn (torch 2.13), all private:

    * ``torch._C._dynamo.eval_frame._get_cache_entries_for_region(code, -1)`` - a code
      object's compiled entries in Dynamo's lookup order, each with ``backend``,
      ``guard_manager`` (``check(f_locals)``, the C++ guard tree Dynamo's frame evaluation
      runs) and ``code`` (the transformed bytecode);
    * ``torch._dynamo.eval_frame._stance`` (what ``torch.compiler.set_stance`` set) and
      ``innermost_backend`` (the backend a compiled module's callback carries, as Dynamo
      matches it against an entry's);
    * ``torch._dynamo.utils.graph_break_reasons`` (one entry per graph break Dynamo made,
      a break at a call or at an instruction it cannot trace; ``reset()`` clears it);
    * torch.nn's global module hooks (``_global_forward_hooks`` and the like): with any
      hook set the block goes through Dynamo, which runs them;
    * the ``_TorchDynamoContext`` behind what ``torch.compile`` returned
      (:meth:`context_of`): an ``OptimizedModule``'s ``dynamo_ctx``, or for a function the
      ``self`` its ``compile_wrapper`` closes over - whose ``callback`` carries the backend.
    """

    cache_entries: Callable[[types.CodeType, int], list]
    eval_frame: Any
    innermost_backend: Callable[[Any], Any]
    global_hooks: tuple[dict, ...]
    graph_break_reasons: list

    @staticmethod
    def context_of(compiled: Any) -> Any:
        ctx = getattr(compiled, "dynamo_ctx", None)
        if ctx is None:
            cells = dict(zip(getattr(compiled, "__code__", None).co_freevars, compiled.__closure__ or ()))
            ctx = cells["self"].cell_contents if "self" in cells else None
        if ctx is None or not hasattr(ctx, "callback"):
            raise TypeError(f"{compiled!r} is not what torch.compile returns for a module or a function")
        return ctx


@functools.cache
def dynamo_internals() -> DynamoInternals | None:
    """The private pieces, or None (warned once) when this torch is not the tested one or
    lacks one of them; every region then enters through Dynamo."""
    from qaic_dynamo.lowering import check_private_api

    found: dict[str, Any] = {}

    def probe() -> str | None:
        import torch._dynamo.eval_frame as eval_frame
        import torch._dynamo.utils as dynamo_utils
        import torch.nn.modules.module as nn_module
        from torch._C._dynamo.eval_frame import _get_cache_entries_for_region

        found.update(cache_entries=_get_cache_entries_for_region, eval_frame=eval_frame,
                     innermost_backend=eval_frame.innermost_backend,
                     graph_break_reasons=dynamo_utils.graph_break_reasons,
                     global_hooks=tuple(getattr(nn_module, name) for name in (
                         "_global_forward_hooks", "_global_forward_pre_hooks", "_global_backward_hooks",
                         "_global_backward_pre_hooks", "_global_forward_hooks_always_called")))
        if not isinstance(getattr(dynamo_utils, "graph_break_reasons", None), list):
            return "torch._dynamo.utils.graph_break_reasons is not a list"
        if not all(hasattr(eval_frame._stance, a) for a in ("stance", "backend", "skip_guard_eval_unsafe")):
            return "torch._dynamo's stance lacks stance/backend/skip_guard_eval_unsafe"
        try:  # nothing is traced until the compiled function is called
            DynamoInternals.context_of(torch.compile(_entry(nn.Identity(), "probe"), backend="eager"))
        except (TypeError, AttributeError, KeyError) as e:
            return f"a function compiled by torch.compile no longer closes over its Dynamo context ({e})"
        return None

    if not check_private_api(probe, "regions enter through Dynamo on every call (region_dispatch='guarded' unavailable)"):
        return None
    return DynamoInternals(**found)


#: Code objects whose calls all go through Dynamo, as :meth:`GuardedDispatch.after_dynamo`
#: infers: ones Dynamo has marked skipped (the mark is the code object's, Dynamo's frame
#: state, shared by every region running it), and ones whose compile broke the graph.
class _CodeSet:
    """A set of code objects by identity, holding them weakly. Not a ``WeakSet``: that
    compares by equality, and two code objects with the same bytecode, names and constants
    are equal - two models' region entry functions for one path are - while Dynamo's
    skip mark belongs to one of them."""

    def __init__(self) -> None:
        self._refs: dict[int, weakref.ref] = {}

    def add(self, code: types.CodeType) -> None:
        key = id(code)
        self._refs[key] = weakref.ref(code, lambda _, key=key: self._refs.pop(key, None))

    def discard(self, code: types.CodeType) -> None:
        ref = self._refs.get(id(code))
        if ref is not None and ref() is code:
            del self._refs[id(code)]

    def __contains__(self, code: object) -> bool:
        ref = self._refs.get(id(code))
        return ref is not None and ref() is code

    def __bool__(self) -> bool:
        return bool(self._refs)

    def __len__(self) -> int:
        return len(self._refs)


DYNAMO_SKIPPED = _CodeSet()


class GuardedDispatch:
    """Runs a compiled region's code after Dynamo's own guards pass, without Dynamo's entry.

    A call through ``torch.compile``'s wrapper sets and restores the frame-evaluation
    callback, stance, dispatch-key and functorch state, then Dynamo's C frame evaluation
    builds the frame's locals, finds the code object's cache entries and checks each one's
    backend and guards, and runs the first that passes. :meth:`lookup` does the same
    lookup - the same entries in the same order, the same backend match, the same
    ``guard_manager`` on the same locals (the bound arguments, defaults applied, and the
    function's free variables) - and returns a function running that entry's compiled code,
    or None for anything it does not handle the same way, so the caller goes through
    Dynamo instead:

    * a stance other than the default, or a trace in progress
      (``torch.compiler.is_compiling``, ``torch.jit.is_tracing``);
    * hooks on the region's module or global module hooks (``nn.Module.__call__`` runs them);
    * for a block, a ``forward`` replaced on the instance or the class since compiling, or
      a class with a ``__call__`` of its own (it may change the arguments before ``forward``);
    * no entry, or no entry of this backend whose guards pass (Dynamo then recompiles,
      or falls back, as it would have);
    * an entry whose code resumes after a graph break: its resume functions are compiled
      only when Dynamo's callback is set; and any code whose compile broke a graph
      (:meth:`after_dynamo`).

    A miss that Dynamo skips - Dynamo disabled, a ``TorchDispatchMode`` active (both
    tested) - marks the code object skipped: Dynamo runs it eagerly from then on, hits
    included, until ``torch._dynamo.reset()``. That mark cannot be read, so
    :meth:`after_dynamo` infers it from a miss sent to Dynamo that added no cache entry,
    and the region then leaves every call to Dynamo until its entries are gone (a reset).
    A miss that adds no entry without marking the code (past the recompile limit, Dynamo
    runs that call eagerly and keeps running its entries' hits) is treated the same:
    every call through Dynamo, slower but never different.

    The code object, the defaults (``__defaults__``, and ``__kwdefaults__`` even when changed
    in place) and the closure are read from the function at every call, as the frame would;
    a replaced ``__code__`` sends the call to Dynamo. One difference stays: Dynamo moves an
    entry that passes to the front of its list and this lookup does not, so where two
    entries' guards both pass, the two may pick different ones - each compiled for these
    inputs.

    The compiled frame is either a block's ``forward`` (:meth:`for_block`: the module is
    its ``self``) or a region's entry function (:meth:`for_function`: the embeddings, norm
    and head, each called through a function of its own, see ``_entry``).
    """

    def __init__(self, func: types.FunctionType, compiled: Any, internals: DynamoInternals, module: nn.Module,
                 method: bool) -> None:
        self.module = module  # the module whose hooks send a call through Dynamo
        self.func = func
        self.method = method  # func is type(module).forward, its frame's self is the module
        self.code = func.__code__
        ctx = internals.context_of(compiled)
        self.backend = internals.innermost_backend(ctx.callback)
        self.isolate_recompiles_id = getattr(ctx, "_isolate_recompiles_id", -1)
        self._internals = internals
        self._defaults: tuple = ()
        self._bind: Callable[[tuple, dict[str, Any]], dict[str, Any] | None] | None = None
        self._functions: dict[int, tuple[types.CodeType, Callable | None]] = {}
        self._backend_matches: dict[int, tuple[Any, bool]] = {}  # id -> (entry backend, equal to ours)
        self._kwdefaults: tuple = ()  # (name, value) pairs the binder was built with
        self._thread = threading.local()  # .miss: cache entries at this thread's last miss

    @classmethod
    def for_block(cls, block: nn.Module, compiled: Any, internals: DynamoInternals) -> GuardedDispatch:
        return cls(type(block).forward, compiled, internals, block, method=True)

    @classmethod
    def for_function(cls, func: types.FunctionType, module: nn.Module, compiled: Any,
                     internals: DynamoInternals) -> GuardedDispatch:
        return cls(func, compiled, internals, module, method=False)

    def lookup(self, args: tuple, kwargs: dict[str, Any]) -> Callable | None:
        """The compiled code Dynamo would run for this call (the module already bound
        for a block, so it takes ``*args, **kwargs``), or None."""
        internals, module, func = self._internals, self.module, self.func
        self._thread.miss = None
        # Emptiness first: membership hashes the code object (its bytecode and constants).
        if DYNAMO_SKIPPED and self.code in DYNAMO_SKIPPED:
            if internals.cache_entries(self.code, self.isolate_recompiles_id):
                return None
            DYNAMO_SKIPPED.discard(self.code)  # its entries are gone: reset() cleared the mark too
        stance = internals.eval_frame._stance
        # Not ``config.disable``: Dynamo reads it only on a miss (a hit still runs its entry),
        # and a miss while disabled is one that after_dynamo sees.
        if (stance.stance != "default" or stance.backend is not None or stance.skip_guard_eval_unsafe
                or torch.compiler.is_compiling() or torch.jit.is_tracing()):
            return None
        # nn.Module.__call__ runs hooks, so a hooked call goes to Dynamo; the scan below still
        # runs, so after_dynamo can tell a miss that Dynamo skipped (a TorchDispatchMode
        # such as FlopCounterMode also sets global hooks).
        hooked = bool(module._forward_hooks or module._forward_pre_hooks or module._backward_hooks
                      or module._backward_pre_hooks or any(internals.global_hooks))
        if self.method and (type(module).forward is not func or "forward" in module.__dict__
                            or not _calls_forward_plainly(module)):
            return None
        if func.__code__ is not self.code:  # Dynamo compiles the new code; its entries are not these
            return None
        entries = internals.cache_entries(self.code, self.isolate_recompiles_id)
        if hooked and self.method and (module._forward_pre_hooks or internals.global_hooks[1]):
            # A forward pre-hook may change the arguments forward's frame gets, so the scan
            # cannot say whether Dynamo hits. Count the call a miss only when Dynamo would
            # skip the code on one (a TorchDispatchMode active - FlopCounterMode sets such
            # hooks - or Dynamo disabled): a hit counted as a miss would send every block
            # of the class through Dynamo for good.
            if torch._C._len_torch_dispatch_stack() > 0 or torch._dynamo.config.disable:
                self._thread.miss = len(entries)
            return None
        f_locals = self._frame_locals(args, kwargs)
        if f_locals is None:
            return None
        for entry in entries:
            # An entry Dynamo invalidated keeps a guard manager that passes, and no backend.
            if entry.backend is None or not self._same_backend(entry.backend):
                continue
            if entry.guard_manager.check(f_locals):
                return None if hooked else self._function(entry.code)
        self._thread.miss = len(entries)
        return None

    def _same_backend(self, backend: Any) -> bool:
        """Dynamo's backend match: the same object, or an equal one. Every block but the
        first carries a ``torch.compile`` wrapper of its own while the entries hold the
        first block's, and the wrapper's ``__eq__`` compares its options dict - ~10 us a
        call inside a decode step, per layer. The answer is kept per backend object (held,
        so its id is not reused); a wrapper's options are not changed after compiling."""
        if backend is self.backend:
            return True
        known = self._backend_matches.get(id(backend))
        if known is not None and known[0] is backend:
            return known[1]
        same = bool(backend == self.backend)
        self._backend_matches[id(backend)] = (backend, same)
        return same

    def graph_breaks(self) -> int:
        """How many graph breaks Dynamo has made so far (all frames, all kinds)."""
        return len(self._internals.graph_break_reasons)

    def after_dynamo(self, graph_breaks_before: int = -1) -> None:
        """Called after a call that :meth:`lookup` sent to Dynamo, with
        :meth:`graph_breaks` from before it. From then on every call of the code - every
        block of the class - goes to Dynamo, until the entries are cleared, if

        * it went there on a miss and Dynamo added no cache entry: Dynamo did not compile
          the frame and has marked the code object skipped (every later call eager, hits
          included);
        * Dynamo broke a graph meanwhile: an entry that breaks the graph at a call before
          ``return``, or at an instruction it cannot trace, may have no resume function; its
          code then runs the rest of the frame itself, and only with Dynamo's callback set
          (Dynamo's path) are the calls in it compiled. Any graph break
          counts, a nested frame's or another thread's too: such a region is slower, never
          different."""
        missed, self._thread.miss = getattr(self._thread, "miss", None), None
        if missed is not None and len(self._internals.cache_entries(self.code, self.isolate_recompiles_id)) <= missed:
            DYNAMO_SKIPPED.add(self.code)
            if missed >= region_recompile_limit():  # not a skip (a dispatch mode, Dynamo disabled)
                from qaic_dynamo.runtime import warn_fallback

                warn_fallback(f"region code {self.code.co_name}",
                              f"Dynamo's recompile limit ({missed} compiled entries for this code object, "
                              "shared by every model of this block class in the process) was reached; "
                              "torch._dynamo.reset() clears them")
        elif graph_breaks_before >= 0 and self.graph_breaks() > graph_breaks_before:
            DYNAMO_SKIPPED.add(self.code)

    def _frame_locals(self, args: tuple, kwargs: dict[str, Any]) -> dict[str, Any] | None:
        """The locals Dynamo's frame evaluation guards on: arguments bound as the frame binds
        them, and the free variables' current values."""
        func = self.func
        kwdefaults = func.__kwdefaults__
        if (self._bind is None or self._defaults[0] is not func.__defaults__ or self._defaults[1] is not kwdefaults
                or (kwdefaults is not None and not _same_items(kwdefaults, self._kwdefaults))):
            # The binder applies the defaults it was built with: rebuild it when they change,
            # also in place (``forward.__kwdefaults__["x"] = ...``), which the frame would see.
            self._bind = _binder(func)
            self._defaults = (func.__defaults__, kwdefaults)
            self._kwdefaults = tuple(kwdefaults.items()) if kwdefaults is not None else ()
            self._functions.clear()
        f_locals = self._bind((self.module, *args) if self.method else args, kwargs)
        if f_locals is None:
            return None  # Dynamo's path raises the real error
        for name, cell in zip(self.code.co_freevars, func.__closure__ or ()):
            try:
                f_locals[name] = cell.cell_contents
            except ValueError:  # an empty cell
                return None
        return f_locals

    def _function(self, code: types.CodeType) -> Callable | None:
        # Keyed by id: hashing a code object hashes its bytecode and constants on every
        # call. The stored code keeps its id from being reused while it is stored.
        known = self._functions.get(id(code))
        if known is not None and known[0] is code:
            return known[1]
        func, fn = self.func, None
        if code.co_freevars == self.code.co_freevars and not any(n.startswith("__resume_at_") for n in code.co_names):
            fn = types.FunctionType(code, func.__globals__, func.__name__, func.__defaults__, func.__closure__)
            fn.__kwdefaults__ = func.__kwdefaults__
            if self.method:
                fn = types.MethodType(fn, self.module)
        self._functions[id(code)] = (code, fn)
        return fn


def _calls_forward_plainly(module: nn.Module) -> bool:
    """Whether calling ``module`` runs nn.Module's own call path into ``forward``: a class
    with its own ``__call__`` (or ``_call_impl``) may change the arguments first, and
    Dynamo runs that; looking up ``forward``'s entries would skip it."""
    cls = type(module)
    return (cls.__call__ is _MODULE_CALL and cls._call_impl is _MODULE_CALL_IMPL
            and "_call_impl" not in module.__dict__ and "_wrapped_call_impl" not in module.__dict__)


_MODULE_CALL = nn.Module.__call__
_MODULE_CALL_IMPL = nn.Module._call_impl


def _same_items(d: dict, items: tuple) -> bool:
    """``d`` holds exactly ``items``, each the same object (not ``==``: a default may be a tensor)."""
    return len(d) == len(items) and all(d.get(k, _MISSING) is v for k, v in items)


_MISSING = object()


def _binder(func: types.FunctionType) -> Callable[[tuple, dict[str, Any]], dict[str, Any] | None]:
    """``bind(args, kwargs)``: ``func``'s frame locals for a call, or None where the call
    would raise. A signature of plain parameters without defaults then ``*args, **kwargs``
    (transformers' ``forward_with_checkpointing(self, *args, **kwargs)``, our region
    entries) is bound directly; every other goes through ``inspect.Signature.bind``, which
    costs ~12 us a call here (40 us inside a decode step, with the caches cold)."""
    # Not follow_wrapped: the frame binds the function's own parameters, not those of the
    # function it wraps.
    signature = inspect.signature(func, follow_wrapped=False)
    params = list(signature.parameters.values())
    P = inspect.Parameter
    plain = [p.name for p in params[:-2] if p.kind is P.POSITIONAL_OR_KEYWORD and p.default is P.empty]
    if (len(params) >= 2 and len(plain) == len(params) - 2
            and params[-2].kind is P.VAR_POSITIONAL and params[-1].kind is P.VAR_KEYWORD):
        n, var_args, var_kwargs = len(plain), params[-2].name, params[-1].name

        def bind(args: tuple, kwargs: dict[str, Any]) -> dict[str, Any] | None:
            if len(args) < n or any(k in kwargs for k in plain):
                return None
            f_locals = dict(zip(plain, args))
            f_locals[var_args] = args[n:]
            f_locals[var_kwargs] = dict(kwargs)
            return f_locals

        return bind

    def bind_any(args: tuple, kwargs: dict[str, Any]) -> dict[str, Any] | None:
        try:
            bound = signature.bind(*args, **kwargs)
        except TypeError:
            return None
        bound.apply_defaults()
        return bound.arguments

    return bind_any


def _drop_wrapper_prefix(module: nn.Module, state: dict[str, Any], prefix: str, local_metadata: Any) -> None:
    inner = prefix + "module."
    for key in [k for k in state if k.startswith(inner)]:
        state[prefix + key[len(inner):]] = state.pop(key)


def _add_wrapper_prefix(region: nn.Module, state: dict[str, Any], prefix: str, *args: Any) -> None:
    # Keys in the uncompiled model's form (``state_dict()``'s) get the wrapper's ``module.``.
    # A key already in the wrapper's form (``named_parameters()`` of the compiled model)
    # stays; which form a key is in is told by the wrapped module's own keys - by prefix
    # alone a block's own submodule named ``module`` looks wrapped.
    own = set(region._modules["module"].state_dict(keep_vars=True))
    for key in [k for k in state if k.startswith(prefix)]:
        rest = key[len(prefix):]
        if rest not in own and rest.startswith("module.") and rest[len("module."):] in own:
            continue
        state[prefix + "module." + rest] = state.pop(key)


def compile(model: nn.Module, **options: Any) -> nn.Module:  # noqa: A001  (mirrors torch.compile)
    """Compile ``model`` region by region with ``backend="qaic"`` (in place; returns it).

    ``options`` are the qaic backend's options (``CompilationConfig``), shared by every
    region. Raises ValueError if the model has no repeated blocks.
    """
    from qaic_dynamo.config import CompilationConfig

    config = CompilationConfig.from_options(options)  # reject bad options now, not at the first call
    if any(isinstance(m, CompiledRegion) for m in model.modules()):
        raise ValueError(
            f"qaic_dynamo.compile: {type(model).__name__} is already compiled region by region (it holds "
            "CompiledRegion modules); compile the original model once, or pass a fresh copy"
        )
    plan = plan_regions(model)

    for _, blocks in plan.blocks:
        for i, block in enumerate(blocks):
            compiled = torch.compile(block, backend="qaic", options=dict(options))
            internals = dynamo_internals() if config.region_dispatch == "guarded" else None
            dispatch = GuardedDispatch.for_block(block, compiled, internals) if internals is not None else None
            blocks[i] = CompiledRegion(block, compiled, dispatch)
    for parent, name, path in plan.rest:
        module = getattr(parent, name)
        entry = _entry(module, path)
        compiled = torch.compile(entry, backend="qaic", options=dict(options))
        internals = dynamo_internals() if config.region_dispatch == "guarded" else None
        dispatch = GuardedDispatch.for_function(entry, module, compiled, internals) if internals is not None else None
        setattr(parent, name, CompiledRegion(module, compiled, dispatch))
    return model


def _entry(module: nn.Module, path: str) -> Any:
    """A function that calls ``module``, with a code object of its own.

    Dynamo caches compiled code per code object, and ``torch.compile`` of a module of
    torch.nn's own classes (Embedding, Linear, RMSNorm), or of a bound method, goes
    through one shared wrapper function: every such region would stack its entries on
    that one code object and meet Dynamo's recompile limit (then run eagerly). A fresh
    code object per region keeps each region's cache its own.
    """

    def entry(*args: Any, **kwargs: Any) -> Any:
        return module(*args, **kwargs)

    entry.__code__ = entry.__code__.replace(co_name=f"qaic_region_{path.replace('.', '_')}")
    return entry
