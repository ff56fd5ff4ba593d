"""The adapter for torch 2.13: every private torch, Dynamo and torch.onnx name qaic_dynamo
uses, and nothing else.

Three groups, each a set of small functions or re-exported classes:

* fake tensors and tracing - what the backend and the lowering need to trace a piece in a
  shape environment of their own (``FakeTensorMode``, ``ShapeEnv``, ``make_fx``, ...);
* Dynamo - its config, its compile lock and session, and :class:`DynamoInternals`, what
  the regions' guarded dispatch reads of Dynamo's cache entries and stance;
* torch.onnx's exporter internals - :class:`TorchOnnxInternals`, what the lowering's
  direct path translates with.

The last two groups are optional: :func:`dynamo_internals` and
:func:`torch_onnx_internals` return None (with one warning) on a torch other than
:data:`TESTED_TORCH` or when a name is missing, and the callers then take the public
path (regions enter through Dynamo; pieces are lowered by ``torch.onnx.export``).

Modules torch does not import by itself (``torch._dynamo`` takes a second to import) are
imported on first use, so importing qaic_dynamo stays as cheap as it was.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
import types
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch._guards import detect_fake_mode
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx

__all__ = [
    "AotFrame",
    "DynamoInternals",
    "FakeTensor",
    "FakeTensorMode",
    "TESTED_TORCH",
    "TorchOnnxInternals",
    "aot_compile_frame",
    "backed_size_oblivious",
    "check_private_api",
    "compile_session",
    "detect_fake_mode",
    "dynamo_compile_lock",
    "dynamo_config_patch",
    "dropped_guard_types",
    "dynamo_disabled",
    "dynamo_internals",
    "dynamo_recompile_limit",
    "guard_latency_profile_off",
    "guard_latency_profile_restore",
    "dynamo_reset",
    "load_aot_frame",
    "free_symbols",
    "int_oo",
    "len_torch_dispatch_stack",
    "make_fx",
    "maybe_mark_dynamic",
    "new_shape_env",
    "no_tracing_context",
    "outside_trace",
    "pytree",
    "python_dispatcher",
    "quiet_exporter_registration",
    "symbolic_context",
    "sympy_size_functions",
    "through_dynamo",
    "torch_onnx_internals",
]

logger = logging.getLogger("qaic_dynamo")

#: The torch release these names were read from. The optional groups are used only on it.
TESTED_TORCH = "2.13.0"


def check_private_api(probe: Callable[[], str | None], otherwise: str) -> bool:
    """Whether private torch pieces can be used: only on the tested torch, and only if
    ``probe`` (which imports and inspects them) returns None rather than what is missing.
    If not, warns once (per caller's cache) saying what happens ``otherwise`` and why."""
    if torch.__version__.split("+")[0] != TESTED_TORCH:
        why = f"torch {torch.__version__} is not the tested {TESTED_TORCH}"
    else:
        try:
            why = probe()
        except (ImportError, AttributeError) as e:
            why = f"they do not import ({e})"
    if why is None:
        return True
    msg = f"qaic: {otherwise}: {why}"
    logger.warning(msg)
    warnings.warn(msg, RuntimeWarning, stacklevel=3)
    return False


# --- fake tensors, shape environments and tracing -------------------------------------------


def new_shape_env(duck_shape: bool = True) -> Any:
    """A new ``ShapeEnv``; ``duck_shape=False`` keeps equal example sizes apart."""
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    return ShapeEnv(duck_shape=duck_shape)


def symbolic_context(dynamic: list[bool]) -> Any:
    """A ``StatelessSymbolicContext`` making exactly the dims flagged in ``dynamic`` symbols."""
    from torch.fx.experimental.symbolic_shapes import DimDynamic, StatelessSymbolicContext

    return StatelessSymbolicContext(dynamic_sizes=[DimDynamic.DYNAMIC if d else DimDynamic.STATIC for d in dynamic])


def free_symbols(value: Any) -> Any:
    """The sympy symbols in a (fake) value's sizes (a set-like collection)."""
    from torch.fx.experimental.symbolic_shapes import free_symbols as free

    return free(value)


def no_tracing_context() -> Any:
    """Leave the caller's tracing context for a trace of one's own (its guards must not
    reach the frame Dynamo is compiling); passes still find their fake mode through it."""
    return torch._guards.tracing(None)


def backed_size_oblivious() -> Any:
    """Trace so that size-like checks on backed sizes do not specialise them."""
    return torch.fx.experimental._config.patch(backed_size_oblivious=True)


@contextlib.contextmanager
def outside_trace() -> Any:
    """Compute real tensors inside a decomposition that ``make_fx`` is tracing (neither
    traced nor fake): what comes out enters the traced graph as a constant."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily
    from torch.fx.experimental.proxy_tensor import disable_proxy_modes_tracing

    with disable_proxy_modes_tracing(), unset_fake_temporarily():
        yield


def python_dispatcher() -> Any:
    return torch._dispatch.python.enable_python_dispatcher()


@functools.cache
def sympy_size_functions() -> dict[str, Any]:
    """torch's sympy functions (``FloorDiv``, ``CeilDiv``, ...) by name, as size expressions
    print them."""
    import torch.utils._sympy.functions as functions

    return {name: getattr(functions, name) for name in dir(functions) if not name.startswith("_")}


def int_oo() -> Any:
    """torch's integer infinity, the bound of an unbounded size range."""
    from torch.utils._sympy.numbers import int_oo as infinity

    return infinity


def len_torch_dispatch_stack() -> int:
    return torch._C._len_torch_dispatch_stack()


# --- Dynamo ---------------------------------------------------------------------------------


@functools.cache
def _dynamo() -> types.ModuleType:
    import torch._dynamo

    return torch._dynamo


def dynamo_config_patch(**changes: Any) -> Any:
    """``torch._dynamo.config.patch``: a context manager, or a decorator."""
    return _dynamo().config.patch(**changes)


def _no_guard_latency_profile(guard_manager: Any, f_locals: Any, n_iters: int) -> float:
    return 0.0


def guard_latency_profile_off() -> Any:
    """Turn off the guard-latency measurement Dynamo makes for every frame it compiles,
    unless its guards log or a structured trace (``TORCH_TRACE``) would report it; returns
    the token :func:`guard_latency_profile_restore` takes.

    ``CheckFunctionManager`` times one guard evaluation after flushing the CPU caches; the
    flush costs the same whatever the guards, a sizeable share of tracing a small region
    (docs/benchmarks.md), and the figure only goes to the guards log, the structured
    trace and a compile metric."""
    from torch._dynamo import guards
    from torch._logging._internal import LazyTraceHandler, trace_log

    # A structured trace (TORCH_TRACE, or TORCH_COMPILE_DEBUG) is the trace log's handler
    # with a directory; without one that handler removes itself at its first record, and
    # other handlers there are not a trace (pytest's log capture adds its own).
    tracing = any(isinstance(h, LazyTraceHandler) and h.root_dir is not None for h in trace_log.handlers)
    original = guards.profile_guard_manager
    if tracing or guards.guards_log.isEnabledFor(logging.DEBUG) or original is _no_guard_latency_profile:
        return None
    guards.profile_guard_manager = _no_guard_latency_profile
    return original


def guard_latency_profile_restore(token: Any) -> None:
    """Put back what :func:`guard_latency_profile_off` replaced - unless someone replaced
    it meanwhile (a profiler, a test's monkeypatch), whose function then stays."""
    from torch._dynamo import guards

    if token is not None and guards.profile_guard_manager is _no_guard_latency_profile:
        guards.profile_guard_manager = token


def dynamo_recompile_limit() -> int:
    return _dynamo().config.recompile_limit


def dynamo_disabled() -> bool:
    return bool(_dynamo().config.disable)


def dynamo_reset() -> None:
    _dynamo().reset()


def maybe_mark_dynamic(t: torch.Tensor, dim: int) -> None:
    _dynamo().maybe_mark_dynamic(t, dim)


def through_dynamo(error: Exception) -> Exception:
    """``error`` as an instance of a subclass that Dynamo re-raises from a backend as it
    is: any other exception comes out as ``BackendCompilerFailed``, whose message starts
    with Dynamo's boilerplate. The subclass mixes in Dynamo's ``ShortenTraceback`` (which
    its compile path passes through untouched), so ``except type(error)`` still catches
    it and the message is the error's own."""
    passing = _through_dynamo_type(type(error))
    out = passing(*error.args)
    out.__cause__ = error.__cause__
    return out


@functools.cache
def _through_dynamo_type(cls: type[Exception]) -> type[Exception]:
    shorten = _dynamo().exc.ShortenTraceback

    def __init__(self: Any, *args: Any) -> None:
        cls.__init__(self, *args)
        self.first_useful_frame = None  # nothing to cut: the traceback is the backend's

    return type(cls.__name__, (cls, shorten), {"__init__": __init__, "__module__": cls.__module__})


def dynamo_compile_lock() -> Any:
    """Dynamo's lock around every frame compile (a re-entrant lock). A compile at call time
    must hold it too: the compile session flag is one process-wide value that each session
    saves and restores, so sessions on two threads must not overlap."""
    from torch._dynamo import convert_frame

    return getattr(convert_frame, "compile_lock", None) or _own_compile_lock()


@functools.cache
def _own_compile_lock() -> Any:
    import threading

    return threading.RLock()


def compile_session() -> Any:
    """What Dynamo holds while it compiles a frame: ``is_compiling()`` is True process-wide,
    so ``make_fx`` in a backend is not taken for FX tracing a compiled function."""
    session = getattr(torch.compiler, "_compile_session_context", None)
    return session() if session is not None else contextlib.nullcontext()


@dataclass(frozen=True)
class DynamoInternals:
    """What guarded dispatch reads of Dynamo and torch.nn, all private:

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

    def stance_is_default(self) -> bool:
        """No ``torch.compiler.set_stance`` in effect (nor a forced backend or unsafe skip)."""
        stance = self.eval_frame._stance
        return stance.stance == "default" and stance.backend is None and not stance.skip_guard_eval_unsafe


@functools.cache
def dynamo_internals() -> DynamoInternals | None:
    """The private pieces, or None (warned once) when this torch is not the tested one or
    lacks one of them; every region then enters through Dynamo."""
    found: dict[str, Any] = {}

    def probe() -> str | None:
        import torch._dynamo.eval_frame as eval_frame
        import torch._dynamo.utils as dynamo_utils
        import torch.nn.modules.module as nn_module
        from torch._C._dynamo.eval_frame import _get_cache_entries_for_region

        found.update(
            cache_entries=_get_cache_entries_for_region,
            eval_frame=eval_frame,
            innermost_backend=eval_frame.innermost_backend,
            graph_break_reasons=dynamo_utils.graph_break_reasons,
            global_hooks=tuple(
                getattr(nn_module, name)
                for name in (
                    "_global_forward_hooks",
                    "_global_forward_pre_hooks",
                    "_global_backward_hooks",
                    "_global_backward_pre_hooks",
                    "_global_forward_hooks_always_called",
                )
            ),
        )
        if not isinstance(getattr(dynamo_utils, "graph_break_reasons", None), list):
            return "torch._dynamo.utils.graph_break_reasons is not a list"
        if not all(hasattr(eval_frame._stance, a) for a in ("stance", "backend", "skip_guard_eval_unsafe")):
            return "torch._dynamo's stance lacks stance/backend/skip_guard_eval_unsafe"

        def probe_entry(*args: Any, **kwargs: Any) -> Any:
            return args

        try:  # nothing is traced until the compiled function is called
            DynamoInternals.context_of(torch.compile(probe_entry, backend="eager"))
        except (TypeError, AttributeError, KeyError) as e:
            return f"a function compiled by torch.compile no longer closes over its Dynamo context ({e})"
        return None

    if not check_private_api(
        probe, "regions enter through Dynamo on every call (region_dispatch='guarded' unavailable)"
    ):
        return None
    return DynamoInternals(**found)


# --- Dynamo's precompile (aot_compile) -------------------------------------------------------


class AotFrame:
    """A frame traced by Dynamo's ``aot_compile``: ``fn`` (the transformed bytecode as a
    function, the backend's output installed in its globals), ``guard_manager`` (the guards
    this process checks; ``check(f_locals)``), ``traced_codes`` (every code object the
    trace read), :meth:`serialize` and :meth:`release`.

    Wraps ``torch._dynamo.aot_compile.AOTCompiledFunction``; its ``__call__`` is not used
    (it binds the signature with ``inspect`` and raises on a guard failure)."""

    def __init__(
        self, compiled: Any, traced_codes: list[types.CodeType] | None = None, deferred: _DeferredGuards | None = None
    ) -> None:
        self._compiled = compiled
        self.fn = compiled.fn
        self.guard_manager = compiled._artifacts.guard_manager
        self.traced_codes = traced_codes or []
        self._sources_pending = traced_codes is not None
        self._deferred = deferred

    def serialize(self, closure: dict[str, Any]) -> bytes:
        """The saved frame; ``closure`` maps ``cell<i>`` to the contents of the traced
        function's closure cells, which are saved by reference (modules, wrapped
        functions) and passed again to :func:`load_aot_frame`. Once only.

        Raises ``RuntimeError`` if an object the trace guarded on no longer passes its
        guards (the saved guards would describe it as it is now, not as it was traced)."""
        if self._sources_pending:  # the inlined sources aot_compile_frame left for now
            info = self._compiled.source_info()
            for code in self.traced_codes:
                _original_add_code(info, code)
            self._sources_pending = False
        deferred, self._deferred = self._deferred, None  # built once; its scope is let go either way
        if deferred is not None:
            self._compiled._artifacts.guards_state = deferred.build(self.guard_manager)
        if not self._compiled._artifacts.guards_state:
            raise RuntimeError("the frame's guards were not built for saving (serialize is called once)")
        return type(self._compiled).serialize(self._compiled, closure).serialized_data

    def release(self) -> None:
        """Let go of what only a save needs - the trace's locals (the first call's inputs),
        kept for the saved guards' build - when the frame will not be saved."""
        self._deferred = None


# Dynamo records each traced code's module source (``SourceInfo.add_code``: locate the
# module, read and hash its file) inside ``aot_compile``, on the first call's critical
# path, though only a save reads it. While ``aot_compile_frame`` traces, this thread's
# calls only collect the code objects; :meth:`AotFrame.serialize` adds them later.
#
# Likewise the guards: ``aot_compile`` builds them twice (once whole, to evaluate the
# filter on; again filtered) and pickles them, where Dynamo's own path builds them once.
# While ``aot_compile_frame`` traces, its own ``aot_compile``'s call of
# ``GraphCaptureOutput.build_guards`` builds them once, whole, for this process to check,
# evaluates the filter on that build (which tells the caller what it drops), and leaves
# the filtered build and its pickle to :meth:`AotFrame.serialize`.
_deferring = threading.local()
_original_add_code: Callable[[Any, types.CodeType], None] = lambda info, code: None  # noqa: E731
_original_build_guards: Callable[..., Any] = lambda *a, **k: None  # noqa: E731
_chained_testing_hook: Callable[[Any, Any, Any], Any] | None = None


_patching = threading.Lock()


@dataclass
class _Deferring:
    """One ``aot_compile_frame`` in progress on this thread: its filter (only the build
    asking for it is deferred) and the deferred builds."""

    keep: Callable[[list[Any]], list[bool]]
    builds: list[_DeferredGuards]


def _dispatch_sets() -> tuple[str, str]:
    return str(torch._C._dispatch_tls_local_include_set()), str(torch._C._dispatch_tls_local_exclude_set())


def _fresh_thread_state(grad: bool, inference: bool) -> tuple[tuple[str, str], str]:
    """The dispatch key sets and Dynamo's global state (as JSON) of a new thread in grad
    and inference mode as given: what :meth:`_ThreadState.entered` can set again. Not
    cached: the global state holds process-wide settings too (threads, default dtype)."""
    from torch._C._dynamo.guards import GlobalStateGuard

    seen: list[tuple[tuple[str, str], str]] = []

    def probe() -> None:
        with torch.inference_mode(inference), torch.set_grad_enabled(grad):
            seen.append((_dispatch_sets(), GlobalStateGuard().__getstate__()))

    t = threading.Thread(target=probe, name="qaic-thread-state-probe")
    t.start()
    t.join()
    return seen[0]


@dataclass(frozen=True)
class _ThreadState:
    """The thread-local state a guard check reads (grad and inference mode, the dispatch
    key sets, and what Dynamo's global-state guard compares), as the tracing thread had
    it, to be set again on the thread that saves."""

    grad: bool
    inference: bool
    dispatch: tuple[str, str]
    global_state: Any  # torch._C._dynamo.guards.GlobalStateGuard

    @classmethod
    def now(cls) -> _ThreadState | None:
        """This thread's state, or None if another thread cannot take it on by setting
        grad and inference mode (autocast, a disabled ``__torch_function__``, dispatch
        keys set by hand)."""
        from torch._C._dynamo.guards import GlobalStateGuard

        state = cls(torch.is_grad_enabled(), torch.is_inference_mode_enabled(), _dispatch_sets(), GlobalStateGuard())
        if (state.dispatch, state.global_state.__getstate__()) != _fresh_thread_state(state.grad, state.inference):
            return None
        return state

    @contextlib.contextmanager
    def entered(self) -> Any:
        with torch.inference_mode(self.inference), torch.set_grad_enabled(self.grad):
            if _dispatch_sets() != self.dispatch:
                raise RuntimeError(f"the trace's dispatch key sets cannot be set again here: {self.dispatch}")
            if not self.global_state.check():
                raise RuntimeError(f"the trace's global state cannot be set again here: {self.global_state.reason()}")
            yield


@dataclass
class _DeferredGuards:
    """What the filtered, saved build of a traced frame's guards needs, kept from the
    trace until the save (it holds the frame's locals until then)."""

    capture: Any  # GraphCaptureOutput
    code: types.CodeType
    keep: Callable[[list[Any]], list[bool]]
    state: _ThreadState

    def build(self, trace_guards: Any) -> bytes:
        from torch._dynamo.convert_frame import compile_lock
        from torch._dynamo.hooks import Hooks

        scope = self.capture.output_graph.local_scope
        changed = RuntimeError("an object the trace guarded on has changed since (the saved guards would not hold it)")
        # Dynamo's compiles through its frame hook hold the lock; aot_compile does not.
        with compile_lock, self.state.entered():
            # The guards are built from the objects as they are now. They describe what
            # the trace saw only if those objects pass the trace's own guards.
            if not trace_guards.check(scope):
                raise changed
            # That check stands in for Dynamo's own one after a build (and its latency
            # profile, which needs a compile's metrics context this thread is not in).
            self.capture.output_graph.skip_guards_check = True
            check_fn = _original_build_guards(
                self.capture, self.code, hooks=Hooks(guard_filter_fn=self.keep), save=True, strict_error=True
            )
            # Another thread may have changed them during the build: the new guards and the
            # trace's must hold on the same objects (each check runs holding the GIL), so
            # every value the new ones took equals what the trace's took.
            if not (check_fn.guard_manager.check(scope) and trace_guards.check(scope)):
                raise changed
            if not check_fn.guards_state:
                raise RuntimeError("Dynamo built no guards to save")
        return check_fn.guards_state


def _testing_hook(guard_manager: Any, scope: Any, builder: Any) -> None:
    """Dynamo's ``guard_manager_testing_hook_fn`` while ours: hands ``_build_once`` the
    guard builder, and calls the hook that was installed before."""
    if getattr(_deferring, "trace", None) is not None:
        _deferring.builder = builder
    if _chained_testing_hook is not None:
        _chained_testing_hook(guard_manager, scope, builder)


def _own_testing_hook() -> None:
    """Install :func:`_testing_hook`, chaining whatever is there (again if it was replaced)."""
    global _chained_testing_hook
    from torch._dynamo import guards

    with _patching:
        current = guards.guard_manager_testing_hook_fn
        if current is not _testing_hook:
            _chained_testing_hook = current
            guards.guard_manager_testing_hook_fn = _testing_hook


def _defer_source_info() -> None:
    """Install the collecting ``add_code`` and the once-building ``build_guards`` once
    (two threads' first traces at once must not take the patch itself for the original)."""
    global _original_add_code, _original_build_guards
    from torch._dynamo.convert_frame import GraphCaptureOutput
    from torch._dynamo.package import SourceInfo

    with _patching:
        if getattr(SourceInfo.add_code, "qaic_defers", False):
            return
        _original_add_code = SourceInfo.add_code
        _original_build_guards = GraphCaptureOutput.build_guards

        def add_code(self: Any, code: types.CodeType) -> None:
            codes = getattr(_deferring, "codes", None)
            if codes is None:
                _original_add_code(self, code)
            else:
                codes.append(code)

        def build_guards(self: Any, code: types.CodeType, hooks: Any = None, save: bool = False, **kw: Any) -> Any:
            trace = getattr(_deferring, "trace", None)
            # Only our own aot_compile's build (not another aot_compile inside a backend).
            if trace is None or not save or hooks is None or hooks.guard_filter_fn is not trace.keep:
                return _original_build_guards(self, code, hooks=hooks, save=save, **kw)
            return _build_once(self, code, hooks, trace, kw)

        add_code.qaic_defers = build_guards.qaic_defers = True  # type: ignore[attr-defined]
        SourceInfo.add_code = add_code
        GraphCaptureOutput.build_guards = build_guards


def _build_once(capture: Any, code: types.CodeType, hooks: Any, trace: _Deferring, kw: dict[str, Any]) -> Any:
    """``build_guards(save=True)`` inside ``aot_compile_frame``: the whole guards, built
    once, with the filter evaluated on them, and the saved build left for later. Builds
    as ``aot_compile`` does (now) where the saver could not build as the trace would."""
    from torch._dynamo.guards import make_guard_filter_entry
    from torch._guards import Guard

    state = _ThreadState.now()
    # A torch-function mode stack is thread-local too, and not set again by the saver.
    if state is None or capture.output_graph.torch_function_mode_stack or kw.get("cache_entries"):
        return _original_build_guards(capture, code, hooks=hooks, save=True, **kw)
    _own_testing_hook()
    _deferring.builder = None
    try:
        check_fn = _original_build_guards(capture, code, hooks=None, save=False, **kw)
        builder = _deferring.builder
    finally:
        _deferring.builder = None
    if builder is None:  # Dynamo skipped its own check (and the hook); build as aot_compile does
        return _original_build_guards(capture, code, hooks=hooks, save=True, **kw)
    guards = sorted(capture.output_graph.guards, key=Guard.sort_key)
    hooks.guard_filter_fn([make_guard_filter_entry(g, builder) for g in guards])
    trace.builds.append(_DeferredGuards(capture, code, hooks.guard_filter_fn, state))
    check_fn.guards_state = b""  # aot_compile asks for one; AotFrame.serialize builds it
    return check_fn


def dropped_guard_types() -> tuple[str, ...]:
    """The guard types Dynamo cannot serialize (every guard on a global is dropped too)."""
    from torch._dynamo.guards import CheckFunctionManager

    return tuple(CheckFunctionManager.UNSUPPORTED_SERIALIZATION_GUARD_TYPES)


def aot_compile_frame(
    func: Callable[..., Any], example: tuple[tuple, dict[str, Any]], backend: Callable[..., Any]
) -> tuple[AotFrame, list[Any]]:
    """Trace ``func`` on ``example`` (args, kwargs) whole with ``aot_compile``.

    Returns the frame (its ``traced_codes`` are the code objects the trace read) and the
    guard entries Dynamo dropped (each with ``name``, its source expression, and
    ``value``). ``backend``'s output must follow Dynamo's ``SerializableCallable``
    protocol; its class is registered as one here. Raises what Dynamo raises (a graph
    break is ``torch._dynamo.exc.Unsupported``)."""
    from torch._dynamo.aot_compile_types import SerializableCallable
    from torch.fx._lazy_graph_module import _use_lazy_graph_module

    unsupported = dropped_guard_types()
    dropped: list[Any] = []
    tracing = True

    def keep(entries: list[Any]) -> list[bool]:
        kept = [not (g.is_global or g.guard_type in unsupported) for g in entries]
        if tracing:  # the save's build filters again, and must not add to the trace's list
            dropped.extend(g for g, k in zip(entries, kept) if not k)
        return kept

    def registering_backend(gm: Any, example_inputs: Any) -> Any:
        out = backend(gm, example_inputs)
        SerializableCallable.register(type(out))
        return out

    _defer_source_info()
    codes: list[types.CodeType] = []
    trace = _Deferring(keep, [])
    # a trace inside a backend nests
    outer = getattr(_deferring, "codes", None), getattr(_deferring, "trace", None)
    _deferring.codes, _deferring.trace = codes, trace
    try:
        # Lazy graph modules, as Dynamo's own compile makes them: aot_compile leaves them
        # off, and every graph module the backend builds and rewrites is then compiled to
        # Python at each rewrite instead of once, when it first runs.
        with _use_lazy_graph_module(torch._dynamo.config.use_lazy_graph_module):
            compiled = torch.compile(
                func, fullgraph=True, backend=registering_backend, options={"guard_filter_fn": keep}
            ).aot_compile(example)
    finally:
        _deferring.codes, _deferring.trace = outer
        tracing = False
    return AotFrame(compiled, codes, trace.builds[-1] if trace.builds else None), dropped


def load_aot_frame(data: bytes, closure: dict[str, Any]) -> AotFrame:
    """A frame :meth:`AotFrame.serialize` saved, loaded in this process."""
    from torch._dynamo.aot_compile import AOTCompiledFunction

    return AotFrame(AOTCompiledFunction.deserialize(data, external_closure_data=closure))


# --- torch.onnx's exporter internals --------------------------------------------------------


def quiet_exporter_registration() -> None:
    """The exporter warns on every export that torchvision (whose ops we never use) is missing."""
    logging.getLogger("torch.onnx._internal.exporter._registration").setLevel(logging.ERROR)


@dataclass(frozen=True)
class TorchOnnxInternals:
    """Private torch.onnx modules the lowering's direct path uses:

    * ``_registration.ONNXRegistry`` (its ``_register`` and
      ``_cleanup_registry_based_on_opset_version``), ``OnnxDecompMeta``, ``_get_overload``
      and ``_torchlib._torchlib_registry.get_torchlib_ops`` - aten op -> onnxscript
      function, built the way ``ONNXRegistry.from_torchlib`` builds it (see
      ``lowering.registry.onnx_registry`` for why not through it);
    * ``_decomp.get_onnx_implemented_overloads`` - the ops the registry translates, and
      ``torch._decomp._core_aten_decompositions_post_autograd`` (the core ATen
      decompositions), ``torch._export.utils._is_preservable_cia_op`` and
      ``torch.export.decomp_utils.PRESERVED_ATEN_CIA_OPS``, from which the lowering builds
      the table for the ops it lacks;
    * ``_fx_passes.decompose_with_registry`` - the exporter's own decompositions, which
      the exporter fallback runs itself so that the size guards they take can be checked;
    * from ``fx.passes.type_promotion`` the exporter's type-promotion pass (``InsertTypePromotion``, its interpreter, rule table
      and ``get_type_promotion_rule``), run only on the nodes that need it;
    * ``_core._translate_fx_graph`` - one FX node at a time into an onnx_ir graph;
    * ``_ir_passes.add_opset_imports``.
    """

    core: Any
    decomp: Any
    torch_decomp: Any
    export_utils: Any
    preserved_cia: Any
    fx_passes: Any
    ir_passes: Any
    registration: Any
    type_promotion: Any


_NEEDED = {
    "core": ("_translate_fx_graph", "export"),
    "decomp": ("get_onnx_implemented_overloads",),
    "torch_decomp": ("_core_aten_decompositions_post_autograd", "decomposition_table"),
    "export_utils": ("_is_preservable_cia_op",),
    "fx_passes": ("decompose_with_registry", "insert_type_promotion_nodes"),
    "type_promotion": (
        "InsertTypePromotion",
        "_TypePromotionInterpreter",
        "TypePromotionTable",
        "get_type_promotion_rule",
        "fx_type_utils",
    ),
    "ir_passes": ("add_opset_imports",),
    "registration": ("ONNXRegistry", "OnnxDecompMeta", "_get_overload", "_torchlib_registry"),
}


@functools.cache
def torch_onnx_internals() -> TorchOnnxInternals | None:
    """The private pieces, or None (warned once) when this torch is not the tested one or
    lacks one of them; lowering then goes through the public exporter."""
    mods: dict[str, Any] = {}

    def probe() -> str | None:
        import torch._decomp as torch_decomp
        import torch._export.utils as export_utils
        from torch.export.decomp_utils import PRESERVED_ATEN_CIA_OPS
        from torch.onnx._internal.exporter import _core, _decomp, _fx_passes, _ir_passes, _registration
        from torch.onnx._internal.fx.passes import type_promotion

        mods.update(
            core=_core,
            decomp=_decomp,
            fx_passes=_fx_passes,
            ir_passes=_ir_passes,
            registration=_registration,
            type_promotion=type_promotion,
            torch_decomp=torch_decomp,
            export_utils=export_utils,
            preserved_cia=PRESERVED_ATEN_CIA_OPS,
        )
        missing = [f"{m}.{a}" for m, attrs in _NEEDED.items() for a in attrs if not hasattr(mods[m], a)]
        return f"torch lacks {missing}" if missing else None

    if not check_private_api(probe, "lowering through the public torch.onnx exporter (slower)"):
        return None
    return TorchOnnxInternals(**mods)
