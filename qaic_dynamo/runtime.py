"""Run lowered pieces: ONNX Runtime sessions whose inputs and outputs are torch memory.

Compile and load are separate: lowering writes an artifact directory and
``artifact.load`` turns it into an :class:`~qaic_dynamo.artifact.Artifact` with one ONNX
Runtime session; this module runs it and never imports the exporter. One artifact serves
every layer whose piece has its fingerprint. Each call site of a split graph gets a
:class:`PieceRunner` with its own IOBinding per thread; with the whole-model compile a
call site is one layer, so bindings that do not change between calls (weights, that
layer's caches) are bound once. With regional compilation one block graph, and so one
runner, serves every layer, and each call re-binds what changed (the layer's weights and
caches).

Zero copies: every input is bound to the torch tensor's memory (IOBinding with the data
pointer), and every output is written into a torch tensor allocated for it. A layer's KV
cache is bound as both the ``past_key`` input and the ``past_key_RetainedState`` output,
so the scatter updates it in place and a decode step costs the same whatever the cache
capacity.

With ``runtime="qaic"`` each new artifact is also compiled with ``qaic-compile`` into
``<artifact>/qpc`` (QEfficient's flags). Running a QPC on a card needs the QAIC runtime,
which this package does not drive yet, so pieces still execute on ONNX Runtime on the
host; without the SDK, ``runtime="qaic"`` is refused up front with a clear error.
"""

from __future__ import annotations

import ctypes
import logging
import math
import os
import re
import shutil
import subprocess
import threading
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import onnxruntime as ort
import torch
import torch.fx as fx
from torch.utils import _pytree as pytree

from qaic_dynamo import _C
from qaic_dynamo.artifact import (
    MAX_SIZE_CARRIER, ONNX_ELEMENT_TYPES, ONNX_FILE, SIZE_CARRIER_DTYPE, Artifact, evaluate_symbol_expression,
)
from qaic_dynamo.config import CompilationConfig, qaic_compiler_path
from qaic_dynamo.counter import compilation_counter

__all__ = [
    "CacheLayoutError",
    "PieceRunError",
    "PieceRunner",
    "QaicCompileError",
    "qaic_compile",
    "QAIC_COMPILE_OWN_FLAGS",
    "extra_flag_problem",
    "qaic_compile_command",
    "qaic_sdk_available",
    "release_openmp_workers",
    "warn_fallback",
]

logger = logging.getLogger("qaic_dynamo")


_CPU = ort.OrtDevice.make("cpu", 0)._get_c_device()

_warned: set[str] = set()
_warned_lock = threading.Lock()


def _openmp_pause_function() -> Any:
    """``omp_pause_resource_all`` (OpenMP 5.0) of the OpenMP runtime PyTorch loaded, or None.

    Looked up in the library already mapped into this process (PyTorch's wheels ship
    their own ``libgomp``), so it is the runtime whose threads PyTorch uses.
    """
    paths: list[str | None] = []
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                name = line.rsplit("/", 1)[-1]
                if name.startswith(("libgomp", "libomp", "libiomp")) and ".so" in name:
                    paths.append(line.split(None, 5)[-1].strip())
    except OSError:  # not Linux: try the process's global symbols
        pass
    # Another package may have mapped its own OpenMP runtime too: PyTorch's comes first.
    torch_lib = str(Path(torch.__file__).parent / "lib")
    paths.sort(key=lambda p: not p.startswith(torch_lib))
    paths.append(None)
    for path in dict.fromkeys(paths):
        try:
            fn = ctypes.CDLL(path).omp_pause_resource_all
        except (OSError, AttributeError):
            continue
        fn.argtypes = [ctypes.c_int]
        fn.restype = ctypes.c_int
        return fn
    return None


_omp_pause = _openmp_pause_function()
_OMP_PAUSE_SOFT = 1


def release_openmp_workers() -> bool:
    """Release the calling thread's OpenMP worker threads before ONNX Runtime runs; True
    if the OpenMP runtime did.

    After a parallel region PyTorch's OpenMP workers keep spinning for milliseconds
    (libgomp's default wait policy), and ONNX Runtime's own threads then share the cores
    with them: measured on 2 cores, a 32000-wide head ran in 9.6 ms right after an eager
    ``aten::index`` against 5.7 ms otherwise, and prefill pieces after attention
    (SDPA is parallel) lost ~30%. ``omp_pause_resource_all`` (OpenMP 5.0) ends the
    spinning at once; PyTorch's next parallel region starts fresh threads. It touches
    only the calling thread's team, and is a no-op inside a parallel region or when no
    OpenMP runtime is found. ``OMP_WAIT_POLICY=PASSIVE`` has the same effect but must be
    set before PyTorch is imported.
    """
    return _omp_pause is not None and _omp_pause(_OMP_PAUSE_SOFT) == 0


class PieceRunError(RuntimeError):
    """A compiled piece could not run (a binding or ONNX Runtime failure)."""


class CacheLayoutError(ValueError):
    """A KV cache in the forward context cannot be bound as retained state (a user error:
    never hidden by an eager fallback)."""


class QaicCompileError(RuntimeError):
    """qaic-compile is missing or failed for an artifact."""


def warn_fallback(what: str, reason: str) -> None:
    """Count an eager fallback and warn once per distinct reason."""
    compilation_counter.bump(num_eager_fallbacks=1)
    with _warned_lock:
        if reason in _warned:
            return
        _warned.add(reason)
    msg = f"qaic: {what} runs eagerly: {reason}"
    logger.warning(msg)
    warnings.warn(msg, RuntimeWarning, stacklevel=3)


class _ThreadBinding:
    """One thread's IOBinding of a call site and what is bound in it."""

    def __init__(self, session: ort.InferenceSession) -> None:
        self.io = session.io_binding()
        # The wrapper's bind_* build a device object per call; this is the same binding.
        self.c_io = self.io._iobinding
        self.bound: dict[str, tuple[int, tuple[int, ...], torch.dtype, bool]] = {}


class _NoBackward(torch.autograd.Function):
    """Gives a piece's outputs the autograd edges an eager piece would have, with a backward
    that raises: ONNX Runtime computes no gradients, and an output without a ``grad_fn``
    would make ``backward()`` skip the piece's parameters silently whenever another term
    of the loss still reaches the graph.

    The piece runs inside ``forward``, so its outputs are new tensors of this function,
    not its inputs returned (autograd would make those views, and forbid writing into
    them in place, as ``logits.div_(t)`` does)."""

    @staticmethod
    def forward(ctx: Any, label: str, produce: Callable[[], list[torch.Tensor]], *needs: torch.Tensor) -> Any:
        ctx.label = label
        outs = produce()
        ctx.mark_non_differentiable(*(o for o in outs if not (o.is_floating_point() or o.is_complex())))
        return tuple(outs)

    @staticmethod
    def backward(ctx: Any, *grads: Any) -> Any:
        raise RuntimeError(
            f"qaic_dynamo: {ctx.label} ran on ONNX Runtime, which computes no gradients; backend='qaic' is for "
            "inference. Run the model under torch.no_grad() or torch.inference_mode(), or compile it with a "
            "training backend (e.g. backend='inductor') to differentiate through it"
        )


class _EagerInstead(Exception):
    """Raised out of a run inside :class:`_NoBackward` so the eager fallback runs outside it."""

    def __init__(self, error: Exception | None) -> None:
        super().__init__(str(error))
        self.error = error


def no_backward(label: str, run: Callable[[], Any], inputs: Sequence[Any], keep: Sequence[torch.Tensor] = ()) -> Any:
    """``run()`` (a piece's result: a tensor or a tuple/list of them), its new tensors
    connected through :class:`_NoBackward` to the ``inputs`` that require grad. An input
    the piece passes through unchanged keeps its own autograd history, and tensors in
    ``keep`` (the runner's own, returned on every call) are returned untouched: autograd
    would attach this call's history to the object itself."""
    needs = [a for a in inputs if isinstance(a, torch.Tensor) and a.requires_grad]
    if not needs:
        return run()
    given = {id(a) for a in inputs if isinstance(a, torch.Tensor)} | {id(t) for t in keep}
    made: dict[str, Any] = {}

    def produce() -> list[torch.Tensor]:
        out = made["out"] = run()
        flat = made["flat"] = [out] if isinstance(out, torch.Tensor) else list(out)
        made["where"] = [i for i, o in enumerate(flat) if isinstance(o, torch.Tensor) and id(o) not in given]
        return [flat[i] for i in made["where"]]

    tied = _NoBackward.apply(label, produce, *needs)
    out, flat = made["out"], made["flat"]
    for i, t in zip(made["where"], tied):
        flat[i] = t
    return flat[0] if isinstance(out, torch.Tensor) else type(out)(flat)


def _span(t: torch.Tensor) -> tuple[int, int]:
    """The bytes ``[start, end)`` a tensor's elements lie in (empty for no elements)."""
    if t.numel() == 0:
        return (0, 0)
    start = t.data_ptr()
    return start, start + (sum((n - 1) * st for n, st in zip(t.shape, t.stride())) + 1) * t.element_size()


def _overlap(a: tuple[int, int], b: tuple[int, int]) -> bool:
    return a[0] < b[1] and b[0] < a[1]


class PieceRunner(torch.nn.Module):
    """One call site of an artifact; falls back to the eager piece if a run fails.

    A piece with inputs that require grad (parameters) has ``differentiable`` set: called
    with grad mode on (a model called without ``torch.no_grad()``, or inside
    ``torch.enable_grad()``), its outputs carry autograd edges whose backward raises
    (:func:`no_backward`) instead of none at all.

    The per-call path is kept lean because it runs once per layer per step: bindings are
    compared with what is already bound and only changed ones are re-bound (weights and
    the layer's caches stay bound), and the C-level IOBinding is called directly.

    Threads: every thread gets its own IOBinding (ONNX Runtime sessions may run
    concurrently, a binding may not), and each resolves caches through its own forward
    context, so two threads running one compiled model never see each other's caches or
    slot mapping.
    """

    def __init__(self, artifact: Artifact, eager: fx.GraphModule, config: CompilationConfig, label: str) -> None:
        super().__init__()
        self.artifact = artifact
        self.eager = eager
        self.config = config
        self.label = label
        self.use_eager = False
        self.differentiable = False  # see the class docstring
        self._local = threading.local()
        layout = artifact.layout
        self._updates = [(u["layer_name"], u["op"]) for u in layout.kv_updates]
        self._needs_symbols = artifact.needs_symbols
        self._inputs = [(spec["name"], spec["source"]) for spec in layout.inputs]
        self._outputs = [
            (spec["name"], spec["target"], shape_fn, dtype)
            for spec, shape_fn, dtype in zip(layout.outputs, artifact.output_shapes, artifact.output_dtypes)
        ]
        self._leaves = layout.leaves
        spec = pytree.treespec_loads(layout.out_spec)
        self._spec = spec
        self._flat_tuple = spec.type is tuple and all(c.is_leaf() for c in spec.children())
        self._dep = {leaf[1]: torch.empty(0, dtype=getattr(torch, leaf[1])) for leaf in layout.leaves if leaf[0] == "dep"}
        self._carrier_buffer = torch.empty(0, dtype=SIZE_CARRIER_DTYPE)
        # Returned as they are on every call (dependency tokens, constant leaves).
        self._persistent = [*self._dep.values(), *(leaf[1] for leaf in layout.leaves
                                                   if leaf[0] not in ("onnx", "arg", "dep", "sym")
                                                   and isinstance(leaf[1], torch.Tensor))]
        self._run_c = artifact.session._sess.run_with_iobinding if artifact.session is not None else None
        self._release_openmp = config.release_openmp_workers

    # -- binding ----------------------------------------------------------------------------
    def _binding(self, slot: int) -> _ThreadBinding:
        """The calling thread's binding for ``slot`` (the forward context's layer index at
        the call), which becomes the thread's current binding.

        With regional compilation one runner serves every layer; a binding per layer keeps
        each layer's weights and caches bound across steps, so a call re-binds only its
        activations and outputs (as the whole-model compile's per-layer runners do)."""
        local = self._local
        bindings = getattr(local, "bindings", None)
        if bindings is None:
            bindings = local.bindings = {}
        b = bindings.get(slot)
        if b is None:
            b = bindings[slot] = _ThreadBinding(self.artifact.session)
        local.current = b
        return b

    def _this_thread(self) -> _ThreadBinding:
        """The binding of this thread's last :meth:`bind` (slot 0 before any)."""
        b = getattr(self._local, "current", None)
        return b if b is not None else self._binding(0)

    def _attach(self, b: _ThreadBinding, name: str, t: torch.Tensor, output: bool = False) -> None:
        sig = (t.data_ptr(), t.shape, t.dtype, output)
        if b.bound.get(name) != sig:
            dtype = ONNX_ELEMENT_TYPES.get(t.dtype)
            if dtype is None:
                raise PieceRunError(f"{name} is {t.dtype}, which the runtime cannot bind")
            bind = b.c_io.bind_output if output else b.c_io.bind_input
            bind(name, _CPU, dtype, list(t.shape), t.data_ptr())
            b.bound[name] = sig

    def symbol_values(self, args: Sequence[Any]) -> dict[str, int]:
        """The values of the artifact's canonical size symbols for these arguments."""
        sym = {}
        for name, src in self.artifact.layout.symbols.items():
            sym[name] = int(args[src[1]].shape[src[2]]) if src[0] == "dim" else int(args[src[1]])
        return sym

    def _caches(self, ctx: Any) -> list[list[torch.Tensor]]:
        caches = []
        for name, op in self._updates:
            real, tensors = ctx.resolve_for_update(name, op)
            for t in tensors:
                if not t.is_contiguous():
                    # Retained state is bound by address as a dense array: a strided view
                    # would be read and written as if it were contiguous.
                    raise CacheLayoutError(
                        f"{self.label}: the KV cache of layer '{real}' is not contiguous (shape {tuple(t.shape)}, "
                        f"stride {t.stride()}); pass contiguous caches in the forward context (e.g. .contiguous())"
                    )
            caches.append((real, tensors))
        # Every cache is written in place in one run: where two share memory (one tensor as
        # a layer's key and value cache, or two layers' caches), which write lands last is
        # up to ONNX Runtime, and attention reads the other.
        spans = sorted((t.data_ptr(), t.data_ptr() + t.nbytes, real) for real, tensors in caches for t in tensors)  # contiguous
        for (_, end, a), (start, _, b) in zip(spans, spans[1:]):
            if start < end:
                which = f"layer '{a}'" if a == b else f"layers '{a}' and '{b}'"
                raise CacheLayoutError(
                    f"{self.label}: the caches of {which} share memory (e.g. one tensor given as both a key and a "
                    "value cache); give each cache a tensor of its own in the forward context")
        return [tensors for _, tensors in caches]

    def bind(
        self, args: Sequence[Any], ctx: Any = None, caches: list[list[torch.Tensor]] | None = None, slot: int | None = None
    ) -> tuple[list[torch.Tensor | None], dict[str, int] | None]:
        """Bind this call's inputs and fresh output tensors on the calling thread's
        binding for ``slot`` (default: ``ctx``'s layer index, else 0); returns (outputs,
        symbol values). Resolves the caches through ``ctx`` (advancing its layer index)
        unless ``caches`` are given."""
        if slot is None:
            slot = ctx.kv_cache_layer_index if ctx is not None else 0
        b = self._binding(slot)
        if caches is None:
            caches = self._caches(ctx) if self._updates else []
        keep: list[torch.Tensor] = []  # what is bound but not the caller's must outlive the run
        # The caches' bounds, to tell cheaply (two compares an input) that an input does
        # not share their memory: a piece reading a cache it updates in place would read it
        # as ONNX Runtime orders the two, eager reads it before the update.
        lo, hi = ((min(c.data_ptr() for layer in caches for c in layer),
                   max(c.data_ptr() + c.nbytes for layer in caches for c in layer)) if caches else (0, 0))
        for name, src in self._inputs:
            kind = src[0]
            if kind == "arg":
                t = args[src[1]]
                contiguous = t.is_contiguous()
                if hi:
                    start = t.data_ptr()
                    end = start + t.nbytes if contiguous else _span(t)[1]
                    if start < hi and lo < end and start < end and any(
                            _overlap((start, end), _span(c)) for layer in caches for c in layer):
                        raise PieceRunError(f"input {name} shares memory with a KV cache this piece updates in place, "
                                            "which ONNX Runtime may read after the update (eager reads it before)")
                if not contiguous:
                    t = t.contiguous()
                    keep.append(t)
            elif kind == "cache":
                t = caches[src[1]][src[2]]
            elif kind == "size":
                # Kept too: another thread may grow the shared buffer during this run.
                t = self._size_carrier(int(args[src[1]]))
                keep.append(t)
            else:
                t = ctx.attn_metadata.slot_mapping_i64
            self._attach(b, name, t)
        b.keep = keep
        sym = self.symbol_values(args) if self._needs_symbols else None
        outs: list[torch.Tensor | None] = []
        for name, target, shape_fn, dtype in self._outputs:
            if target[0] == "cache":  # in place: the retained-state output is the cache
                self._attach(b, name, caches[target[1]][target[2]], output=True)
                outs.append(None)
            else:
                t = torch.empty(shape_fn(sym), dtype=dtype)
                self._attach(b, name, t, output=True)
                outs.append(t)
        return outs, sym

    def _size_carrier(self, n: int) -> torch.Tensor:
        """A tensor of length ``n`` for a ``["size", i]`` input: views of one buffer that
        grows to the longest length seen (ONNX Runtime reads only the shape)."""
        if not 1 <= n <= MAX_SIZE_CARRIER:  # see _binds_empty
            raise ValueError(f"a size input of {n}: size carriers take 1..{MAX_SIZE_CARRIER}")
        buffer = self._carrier_buffer
        if buffer.numel() < n:
            grown = min(max(n, 2 * buffer.numel()), MAX_SIZE_CARRIER)
            buffer = self._carrier_buffer = torch.empty(grown, dtype=SIZE_CARRIER_DTYPE)
        return buffer[:n]

    def bound_inputs(self) -> dict[int, dict[str, int]]:
        """The calling thread's bindings: ``{slot: {input name: data pointer}}``, one slot
        per forward-context layer index this runner was called at."""
        bindings = getattr(self._local, "bindings", {})
        return {slot: {name: sig[0] for name, sig in b.bound.items() if not sig[3]} for slot, b in bindings.items()}

    def bind_output(self, name: str, t: torch.Tensor) -> None:
        """Bind ``t`` as output ``name`` on the calling thread's binding (benchmarks bind
        outputs that stay alive, then time :meth:`run_bound` alone)."""
        self._attach(self._this_thread(), name, t, output=True)

    @property
    def output_specs(self) -> list[tuple[str, list[Any], Any, torch.dtype]]:
        """(name, target, shape function, dtype) of every ONNX output."""
        return list(self._outputs)

    def run_bound(self) -> None:
        """Run the session on what the calling thread has bound."""
        if self._release_openmp:
            release_openmp_workers()
        # The C-level run: the Python wrapper re-validates the binding on every call,
        # which costs more than a decode step's piece computes.
        self._run_c(self._this_thread().c_io, None)

    # -- calling ------------------------------------------------------------------------------
    def forward(self, *args: Any) -> Any:
        if self.use_eager:
            return self.eager(*args)
        if self.differentiable and torch.is_grad_enabled():
            try:
                return no_backward(self.label, lambda: self._run(args, defer=True), args, keep=self._persistent)
            except _EagerInstead as e:  # outside the autograd function: eager keeps its history
                return self._eager_instead(args, e.error)
        return self._run(args)

    def _run(self, args: tuple, defer: bool = False) -> Any:
        """Run the artifact; on a failure, run eagerly (``defer``: raise _EagerInstead so
        the caller does, outside an autograd function running with grad mode off)."""
        if self.artifact.session is None:  # no compute: every leaf is made here
            return self._assemble(args, [], self.symbol_values(args) if self._needs_symbols else None)
        ctx = _C.current_forward_context(self.label) if self._updates or _C.has_forward_context() else None
        start = ctx.kv_cache_layer_index if ctx is not None else 0
        try:
            caches = self._caches(ctx) if self._updates else []
            outs, sym = self.bind(args, ctx, caches, slot=start)
            self.run_bound()
        except CacheLayoutError:
            raise
        except Exception as e:
            if ctx is not None:  # nothing was written; let the eager ops resolve again
                ctx.rewind_kv_cache_layer_index(start)
            # An empty batch: ONNX Runtime refuses a zero-size tensor (its data pointer is
            # null), and there is nothing to compute. Eager serves this call only; it says
            # nothing about the artifact.
            error = None if self._binds_empty(args, ctx) else e
            if error is not None and self.config.fallback == "error":
                raise
            if defer:
                raise _EagerInstead(error) from e
            return self._eager_instead(args, error)
        # Outside the fallback: an error here is a bug in the layout, and must surface.
        return self._assemble(args, outs, sym)

    def _eager_instead(self, args: tuple, error: Exception | None) -> Any:
        """The eager piece for this call (``error`` None: an empty batch), and from now on
        when ONNX Runtime failed. If eager fails too, the inputs were bad: that raises and
        the runner stays compiled."""
        out = self.eager(*args)
        if error is not None:
            self.use_eager = True
            warn_fallback(self.label, f"ONNX Runtime failed: {type(error).__name__}: "
                                      f"{str(error).splitlines()[0] if str(error) else ''}")
        return out

    def _binds_empty(self, args: Sequence[Any], ctx: Any) -> bool:
        """Whether this call binds a zero-size tensor (an input or an output) or a size
        carrier out of range: asked only after a failed run, so the per-call path pays
        nothing for it."""
        for _, src in self._inputs:
            if src[0] == "arg" and isinstance(args[src[1]], torch.Tensor) and args[src[1]].numel() == 0:
                return True
            if src[0] == "size" and not 1 <= int(args[src[1]]) <= MAX_SIZE_CARRIER:
                return True
            if src[0] == "slot_mapping" and ctx is not None and ctx.attn_metadata.slot_mapping_i64.numel() == 0:
                return True
        try:
            sym = self.symbol_values(args) if self._needs_symbols else None
            return any(math.prod(shape_fn(sym)) == 0 for _, target, shape_fn, _ in self._outputs if target[0] != "cache")
        except Exception:  # noqa: BLE001  (not an empty call; the run's own error stands)
            return False

    def _assemble(self, args: Sequence[Any], outs: list[torch.Tensor | None], sym: dict[str, int] | None) -> Any:
        leaves = []
        for leaf in self._leaves:
            kind = leaf[0]
            if kind == "onnx":
                leaves.append(outs[leaf[1]])
            elif kind == "arg":
                leaves.append(args[leaf[1]])
            elif kind == "dep":
                leaves.append(self._dep[leaf[1]])
            elif kind == "sym":
                leaves.append(evaluate_symbol_expression(leaf[1], sym))
            else:
                leaves.append(leaf[1])
        return tuple(leaves) if self._flat_tuple else pytree.tree_unflatten(leaves, self._spec)


#: The qaic-compile flags :func:`qaic_compile_command` sets itself, and the argument of
#: its own that sets each (None: always set as shown).
QAIC_COMPILE_OWN_FLAGS: dict[str, str | None] = {
    "-aic-hw": None, "-aic-hw-version": None, "-m": None, "-retained-state": None, "-convert-to-fp16": None,
    "-aic-num-cores": "num_cores", "-custom-IO-list-file": "custom_io", "-network-specialization-config":
    "specializations", "-aic-binary-dir": "out_dir",
}


_OPTION_KEY = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]*")


def extra_flag_problem(extra: Any) -> str | None:
    """Why ``extra`` options cannot go on the command, or None: not a dict, a key that is
    not an option name (``-x``, ``a=b``: it would become ``--x``, slipping past the check
    for flags the command sets itself), or a flag the command sets itself."""
    if not isinstance(extra, dict):
        return (f"compiler options must be a dict of option names to values (e.g. {{'mxfp6_matmul': True}}), got "
                f"{type(extra).__name__} {extra!r}")
    bad = [k for k in extra if not isinstance(k, str) or not _OPTION_KEY.fullmatch(k)]
    if bad:
        return (f"compiler option names must be letters, digits, '_' and '-', without the leading dash (key_name=v "
                f"becomes -key-name=v), got {bad}")
    own = {flag.lower(): (flag, arg) for flag, arg in QAIC_COMPILE_OWN_FLAGS.items()}
    clashes = [own[("-" + k.replace("_", "-")).lower()] for k in extra if ("-" + k.replace("_", "-")).lower() in own]
    if not clashes:
        return None
    said = ", ".join(f"{flag} (set by {arg})" if arg else f"{flag} (always set)" for flag, arg in clashes)
    return (f"compiler options repeat flags the qaic-compile command sets itself: {said}; pass num_cores= for the "
            "cores, and leave the others to the command")


def qaic_compile_command(
    artifact_dir: Path,
    out_dir: Path,
    num_cores: int = 16,
    custom_io: Path | None = None,
    specializations: Path | None = None,
    extra: dict[str, Any] | None = None,
    compiler: Path | None = None,
) -> list[str]:
    """The ``qaic-compile`` command line for an artifact directory holding ``model.onnx``
    (QEfficient's conventions); the deployment export builds its command here too.

    ``extra`` maps ``key_name=value`` to ``-key-name=value``; ``True`` gives a bare flag.
    A flag this command sets itself (:data:`QAIC_COMPILE_OWN_FLAGS`) is refused there: a
    second ``-aic-num-cores`` or ``-aic-binary-dir`` would silently win or lose (see
    :func:`extra_flag_problem`).
    ``compiler``: default ``$QAIC_COMPILER`` or the SDK's path.
    """
    problem = extra_flag_problem(extra if extra is not None else {})
    if problem:
        raise ValueError(problem)
    cmd = [
        str(compiler or qaic_compiler_path()), "-aic-hw", "-aic-hw-version=2.0", f"-m={artifact_dir / ONNX_FILE}",
        "-retained-state", "-convert-to-fp16", f"-aic-num-cores={num_cores}",
    ]
    if custom_io is not None:
        cmd.append(f"-custom-IO-list-file={custom_io}")
    if specializations is not None:
        cmd.append(f"-network-specialization-config={specializations}")
    for key, value in (extra or {}).items():
        flag = "-" + key.replace("_", "-")
        if value is True:
            cmd.append(flag)
        elif value is not False and value is not None:
            cmd.append(f"{flag}={value}")
    cmd.append(f"-aic-binary-dir={out_dir}")
    return cmd


def qaic_sdk_available() -> bool:
    path = qaic_compiler_path()
    return (path.exists() and os.access(path, os.X_OK)) or shutil.which("qaic-compile") is not None


def qaic_compile(artifact_dir: Path, out_dir: Path, **kwargs: Any) -> Path:
    """Compile an artifact with the Qualcomm SDK into ``out_dir`` (a QPC directory)."""
    if not qaic_sdk_available():
        raise QaicCompileError(
            f"runtime='qaic' needs the Qualcomm Cloud AI SDK ({qaic_compiler_path()} not found); "
            "install it, or use runtime='onnxruntime'"
        )
    cmd = qaic_compile_command(artifact_dir, out_dir, **kwargs)
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise QaicCompileError(f"qaic-compile failed ({proc.returncode}): {proc.stderr.strip()[-2000:]}")
    return out_dir
