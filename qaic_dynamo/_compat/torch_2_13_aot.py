"""The torch 2.13 adapter's part for Dynamo's precompile (``aot_compile``): trace a
frame whole so that it can be saved, save it, load it in another process.

Re-exported by :mod:`qaic_dynamo._compat.torch_2_13`, which holds the rest of the
adapter; it is a module of its own because making the saved trace cheap in the first
call (the inlined sources and the saved guards are recorded at the save, not in the
trace) takes more of Dynamo's internals than anything else the adapter wraps.
"""

from __future__ import annotations

import contextlib
import gc
import threading
import types
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["AotFrame", "aot_compile_frame", "dropped_guard_types", "load_aot_frame"]


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
        self.build_saved_guards()
        if not self._compiled._artifacts.guards_state:
            raise RuntimeError("the frame's guards were not built for saving (serialize is called once)")
        return type(self._compiled).serialize(self._compiled, closure).serialized_data

    def build_saved_guards(self) -> None:
        """Build and pickle the guards a save keeps, if the trace left them for later (at
        most once; :meth:`serialize` does it otherwise). Dynamo parses guard expressions
        with ``ast``, which CPython 3.11 does not allow on two threads at once: call it
        on the thread that runs the model, not a worker. Raises as :meth:`serialize`."""
        deferred, self._deferred = self._deferred, None  # built once; its scope is let go either way
        if deferred is not None:
            self._compiled._artifacts.guards_state = deferred.build(self.guard_manager)

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
        # Dynamo's own compile collects the young generations after every frame it
        # compiles (convert_frame, run_gc_after_compile); aot_compile does not, and the
        # trace's garbage then reached the oldest generation through later collections.
        if torch._dynamo.config.run_gc_after_compile:
            gc.collect(1)
    return AotFrame(compiled, codes, trace.builds[-1] if trace.builds else None), dropped


def load_aot_frame(data: bytes, closure: dict[str, Any]) -> AotFrame:
    """A frame :meth:`AotFrame.serialize` saved, loaded in this process."""
    from torch._dynamo.aot_compile import AOTCompiledFunction

    return AotFrame(AOTCompiledFunction.deserialize(data, external_closure_data=closure))
