"""The adapter for torch 2.13: every private torch, Dynamo and torch.onnx name qaic_dynamo
uses, and nothing else.

Three groups, each a set of small functions or re-exported classes:

* fake tensors and tracing - what the backend and the lowering need to trace a piece in a
  shape environment of their own (``FakeTensorMode``, ``ShapeEnv``, ``make_fx``, ...);
* Dynamo - its config, its compile lock and session, and :class:`DynamoInternals`, what
  the regions' guarded dispatch reads of Dynamo's cache entries and stance; and its
  precompile (``aot_compile``, :func:`aot_compile_frame`), in
  :mod:`~qaic_dynamo._compat.torch_2_13_aot` and re-exported here;
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

from qaic_dynamo._compat.torch_2_13_aot import AotFrame, aot_compile_frame, dropped_guard_types, load_aot_frame

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
