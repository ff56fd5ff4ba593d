"""Guarded dispatch: run a compiled region's code after Dynamo's own guards pass, without
entering through ``torch.compile``'s wrapper.

Once a block is compiled, calling it through ``torch.compile``'s wrapper costs a fraction
of a millisecond per layer and step (the wrapper's context set-up, Dynamo's frame
evaluation, marking dynamic dims) - as much as a small block's ONNX Runtime run. With
``region_dispatch="guarded"`` (the default) a block looks up Dynamo's cache itself: the
same entries, the same backend match and the same guards, evaluated by Dynamo's own guard
manager on the frame's locals; only when one passes does it run that entry's compiled
code directly. Anything else goes through Dynamo as before (:class:`GuardedDispatch`).
The Dynamo internals it reads come from ``qaic_dynamo._compat``.
"""

from __future__ import annotations

import inspect
import threading
import types
import weakref
from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn

from qaic_dynamo._compat import DynamoInternals, dynamo_disabled, len_torch_dispatch_stack
from qaic_dynamo.compiler.regions.settings import region_recompile_limit
from qaic_dynamo.runtime import warn_fallback

__all__ = ["DYNAMO_SKIPPED", "GuardedDispatch"]


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
    and head, each called through a function of its own, see ``compile.region_entry``).
    """

    def __init__(
        self, func: types.FunctionType, compiled: Any, internals: DynamoInternals, module: nn.Module, method: bool
    ) -> None:
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
        #: The region's saved trace (compiler.regions.precompile), checked before Dynamo's
        #: entries; shared by every module running this code.
        self.precompiled: Any = None
        self._precompiled_fn: tuple[Callable | None, Callable | None] = (None, None)

    @classmethod
    def for_block(cls, block: nn.Module, compiled: Any, internals: DynamoInternals) -> GuardedDispatch:
        return cls(type(block).forward, compiled, internals, block, method=True)

    @classmethod
    def for_function(
        cls, func: types.FunctionType, module: nn.Module, compiled: Any, internals: DynamoInternals
    ) -> GuardedDispatch:
        return cls(func, compiled, internals, module, method=False)

    def lookup(self, args: tuple, kwargs: dict[str, Any]) -> Callable | None:
        """The compiled code Dynamo would run for this call (the module already bound
        for a block, so it takes ``*args, **kwargs``), or None."""
        internals, module = self._internals, self.module
        self._thread.miss = None
        # Emptiness first: membership hashes the code object (its bytecode and constants).
        if DYNAMO_SKIPPED and self.code in DYNAMO_SKIPPED:
            if internals.cache_entries(self.code, self.isolate_recompiles_id):
                return None
            DYNAMO_SKIPPED.discard(self.code)  # its entries are gone: reset() cleared the mark too
        # Not ``config.disable``: Dynamo reads it only on a miss (a hit still runs its entry),
        # and a miss while disabled is one that after_dynamo sees.
        if not internals.stance_is_default() or torch.compiler.is_compiling() or torch.jit.is_tracing():
            return None
        # nn.Module.__call__ runs hooks, so a hooked call goes to Dynamo; the scan below still
        # runs, so after_dynamo can tell a miss that Dynamo skipped (a TorchDispatchMode
        # such as FlopCounterMode also sets global hooks).
        hooked = self._hooked()
        if self._forward_replaced():  # Dynamo compiles the new code; its entries are not these
            return None
        entries = internals.cache_entries(self.code, self.isolate_recompiles_id)
        if hooked and self.method and (module._forward_pre_hooks or internals.global_hooks[1]):
            # A forward pre-hook may change the arguments forward's frame gets, so the scan
            # cannot say whether Dynamo hits. Count the call a miss only when Dynamo would
            # skip the code on one (a TorchDispatchMode active - FlopCounterMode sets such
            # hooks - or Dynamo disabled): a hit counted as a miss would send every block
            # of the class through Dynamo for good.
            if len_torch_dispatch_stack() > 0 or dynamo_disabled():
                self._thread.miss = len(entries)
            return None
        f_locals = self._frame_locals(args, kwargs)
        if f_locals is None:
            return None
        precompiled = self.precompiled
        if precompiled is not None and precompiled.frame is not None:
            fn = precompiled.check(f_locals)
            if fn is not None:
                return None if hooked else self._precompiled_function(fn)
        for entry in entries:
            # An entry Dynamo invalidated keeps a guard manager that passes, and no backend.
            if entry.backend is None or not self._same_backend(entry.backend):
                continue
            if entry.guard_manager.check(f_locals):
                return None if hooked else self._function(entry.code)
        self._thread.miss = len(entries)
        return None

    def _precompiled_function(self, fn: Callable) -> Callable:
        known, bound = self._precompiled_fn
        if known is not fn:
            bound = types.MethodType(fn, self.module) if self.method else fn
            self._precompiled_fn = (fn, bound)
        return bound

    def direct_call_locals(self, args: tuple, kwargs: dict[str, Any]) -> dict[str, Any] | None:
        """The frame locals of this call if it could run compiled code directly (what
        :meth:`lookup` checks before the entries: default stance, no trace in progress, no
        hooks, ``forward`` as compiled), else None. A region's first call loads or traces
        its saved entry only then."""
        if not self._internals.stance_is_default() or torch.compiler.is_compiling() or torch.jit.is_tracing():
            return None
        if self._hooked() or self._forward_replaced():
            return None
        return self._frame_locals(args, kwargs)

    def _hooked(self) -> bool:
        """Hooks that ``nn.Module.__call__`` runs: on the module, or global ones."""
        module = self.module
        return bool(
            module._forward_hooks
            or module._forward_pre_hooks
            or module._backward_hooks
            or module._backward_pre_hooks
            or any(self._internals.global_hooks)
        )

    def _forward_replaced(self) -> bool:
        """``forward`` (or its code) is no longer what was compiled, or the class calls it
        through a ``__call__`` of its own."""
        module, func = self.module, self.func
        if self.method and (
            type(module).forward is not func or "forward" in module.__dict__ or not _calls_forward_plainly(module)
        ):
            return True
        return func.__code__ is not self.code

    def _same_backend(self, backend: Any) -> bool:
        """Dynamo's backend match: the same object, or an equal one. Every block but the
        first carries a ``torch.compile`` wrapper of its own while the entries hold the
        first block's, and the wrapper's ``__eq__`` compares its options dict - on every
        call of every layer in a decode step. The answer is kept per backend object (held,
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
                warn_fallback(
                    f"region code {self.code.co_name}",
                    f"Dynamo's recompile limit ({missed} compiled entries for this code object, "
                    "shared by every model of this block class in the process) was reached; "
                    "torch._dynamo.reset() clears them",
                )
        elif graph_breaks_before >= 0 and self.graph_breaks() > graph_breaks_before:
            DYNAMO_SKIPPED.add(self.code)

    def _frame_locals(self, args: tuple, kwargs: dict[str, Any]) -> dict[str, Any] | None:
        """The locals Dynamo's frame evaluation guards on: arguments bound as the frame binds
        them, and the free variables' current values."""
        func = self.func
        kwdefaults = func.__kwdefaults__
        if (
            self._bind is None
            or self._defaults[0] is not func.__defaults__
            or self._defaults[1] is not kwdefaults
            or (kwdefaults is not None and not _same_items(kwdefaults, self._kwdefaults))
        ):
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
    return (
        cls.__call__ is _MODULE_CALL
        and cls._call_impl is _MODULE_CALL_IMPL
        and "_call_impl" not in module.__dict__
        and "_wrapped_call_impl" not in module.__dict__
    )


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
    costs as much as the rest of the lookup."""
    # Not follow_wrapped: the frame binds the function's own parameters, not those of the
    # function it wraps.
    signature = inspect.signature(func, follow_wrapped=False)
    params = list(signature.parameters.values())
    P = inspect.Parameter
    plain = [p.name for p in params[:-2] if p.kind is P.POSITIONAL_OR_KEYWORD and p.default is P.empty]
    if (
        len(params) >= 2
        and len(plain) == len(params) - 2
        and params[-2].kind is P.VAR_POSITIONAL
        and params[-1].kind is P.VAR_KEYWORD
    ):
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
