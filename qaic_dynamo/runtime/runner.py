"""Run one compiled piece: an ONNX Runtime session whose inputs and outputs are torch memory.

A :class:`PieceRunner` is one call site of an artifact (``qaic_dynamo.artifact.Artifact``,
or anything with the attributes of :class:`RunnableArtifact`). With the whole-model
compile a call site is one layer, so bindings that do not change between calls (weights,
that layer's caches) are bound once. With regional compilation one block graph, and so
one runner, serves every layer, and each call re-binds what changed.

Zero copies: every input is bound to the torch tensor's memory (IOBinding with the data
pointer), and every output is written into a torch tensor allocated for it. A layer's KV
cache is bound as both the ``past_key`` input and the ``past_key_RetainedState`` output,
so the scatter updates it in place and a decode step costs the same whatever the cache
capacity.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import onnxruntime as ort
import torch
import torch.fx as fx

from qaic_dynamo._compat import pytree
from qaic_dynamo.config import CompilationConfig
from qaic_dynamo.counter import compilation_counter
from qaic_dynamo.errors import CacheLayoutError, EagerInstead, PieceRunError
from qaic_dynamo.native import _C
from qaic_dynamo.runtime.autograd import no_backward
from qaic_dynamo.runtime.binding import CPU_DEVICE, MAX_SIZE_CARRIER, ONNX_ELEMENT_TYPES, SIZE_CARRIER_DTYPE
from qaic_dynamo.runtime.fallback import warn_fallback
from qaic_dynamo.runtime.openmp import release_openmp_workers

__all__ = ["PieceRunner", "RunnableArtifact"]

#: What a ``["check", ...]`` output is passed to (see ``lowering.checks``).
_CHECK_ERRORS = torch.ops.aten._linalg_check_errors.default


class RunnableArtifact(Protocol):
    """What a runner needs of a loaded artifact (``qaic_dynamo.artifact.Artifact``)."""

    #: The session, or None for a piece with no compute (its leaves are made by the runner).
    session: ort.InferenceSession | None
    #: The calling convention: ``inputs``, ``outputs``, ``leaves``, ``out_spec``,
    #: ``symbols`` and ``kv_updates`` (``qaic_dynamo.artifact.PieceLayout``).
    layout: Any
    #: Per ONNX output: its shape as a function of the symbol values, and its dtype.
    output_shapes: list[Callable[[dict[str, int]], list[int]]]
    output_dtypes: list[torch.dtype]
    #: Per ``["sym", expr]`` leaf expression: its value as a function of the symbol values.
    symbol_leaves: dict[str, Callable[[dict[str, int]], int]]

    @property
    def needs_symbols(self) -> bool: ...


class _ThreadBinding:
    """One thread's IOBinding of a call site and what is bound in it."""

    def __init__(self, session: ort.InferenceSession) -> None:
        self.io = session.io_binding()
        # The wrapper's bind_* build a device object per call; this is the same binding.
        self.c_io = self.io._iobinding
        #: What is bound but not the caller's (contiguous copies, size carriers): it must
        #: outlive the run.
        self.keep: list[torch.Tensor] = []
        self.bound: dict[str, tuple[int, tuple[int, ...], torch.dtype, bool]] = {}


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
    compared with what is already bound and only changed ones are re-bound (a whole-model
    compile's runner serves one layer, whose weights and caches stay bound), and the
    C-level IOBinding is called directly.

    Threads: every thread gets its own IOBinding (ONNX Runtime sessions may run
    concurrently, a binding may not), and each resolves caches through its own forward
    context, so two threads running one compiled model never see each other's caches or
    slot mapping.
    """

    def __init__(
        self, artifact: RunnableArtifact, eager: fx.GraphModule, config: CompilationConfig, label: str
    ) -> None:
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
        #: (output index, api name, is_matrix) of each error check (lowering.checks)
        self._checks = [(i, t[1], t[2]) for i, (_, t, _, _) in enumerate(self._outputs) if t[0] == "check"]
        #: output index of each domain test (lowering.checks): False runs the call eagerly
        self._eager_unless = [i for i, (_, t, _, _) in enumerate(self._outputs) if t[0] == "eager_unless"]
        #: (output index, argument index) of each input written in place (lowering.prepare)
        self._writes = [(i, t[1]) for i, (_, t, _, _) in enumerate(self._outputs) if t[0] == "write"]
        self._after_run = bool(self._eager_unless or self._checks or self._writes)
        self._symbol_leaves = artifact.symbol_leaves
        spec = pytree.treespec_loads(layout.out_spec)
        self._spec = spec
        self._flat_tuple = spec.type is tuple and all(c.is_leaf() for c in spec.children())
        self._dep = {
            leaf[1]: torch.empty(0, dtype=getattr(torch, leaf[1])) for leaf in layout.leaves if leaf[0] == "dep"
        }
        self._carrier_buffer = torch.empty(0, dtype=SIZE_CARRIER_DTYPE)
        # Returned as they are on every call (dependency tokens, constant leaves).
        self._persistent = [
            *self._dep.values(),
            *(
                leaf[1]
                for leaf in layout.leaves
                if leaf[0] not in ("onnx", "arg", "dep", "sym") and isinstance(leaf[1], torch.Tensor)
            ),
        ]
        self._run_c = artifact.session._sess.run_with_iobinding if artifact.session is not None else None
        self._release_openmp = config.release_openmp_workers

    # -- binding ----------------------------------------------------------------------------
    def _this_thread(self) -> _ThreadBinding:
        """The calling thread's binding (made at its first call).

        One per thread, not one per layer: with regional compilation one runner serves
        every layer, and a binding per layer would keep that layer's weights bound across
        steps - but making it in a layer's first call (ONNX Runtime's small, long-lived
        objects for each bound input) splits the blocks the previous layer's outputs freed,
        so every output of a first forward takes fresh memory, for no measurable gain in
        later steps (docs/benchmarks.md, warm start)."""
        b = getattr(self._local, "binding", None)
        if b is None:
            b = self._local.binding = _ThreadBinding(self.artifact.session)
        return b

    def _attach(self, b: _ThreadBinding, name: str, t: torch.Tensor, output: bool = False) -> None:
        sig = (t.data_ptr(), t.shape, t.dtype, output)
        if b.bound.get(name) != sig:
            if t.is_complex():  # the artifact's value is the real pairs (REAL_PAIRS)
                t = torch.view_as_real(t)
            dtype = ONNX_ELEMENT_TYPES.get(t.dtype)
            if dtype is None:
                raise PieceRunError(f"{name} is {t.dtype}, which the runtime cannot bind")
            bind = b.c_io.bind_output if output else b.c_io.bind_input
            bind(name, CPU_DEVICE, dtype, list(t.shape), t.data_ptr())
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
        spans = sorted(
            (t.data_ptr(), t.data_ptr() + t.nbytes, real) for real, tensors in caches for t in tensors
        )  # contiguous
        for (_, end, a), (start, _, b) in zip(spans, spans[1:]):
            if start < end:
                which = f"layer '{a}'" if a == b else f"layers '{a}' and '{b}'"
                raise CacheLayoutError(
                    f"{self.label}: the caches of {which} share memory (e.g. one tensor given as both a key and a "
                    "value cache); give each cache a tensor of its own in the forward context"
                )
        return [tensors for _, tensors in caches]

    def bind(
        self,
        args: Sequence[Any],
        ctx: Any = None,
        caches: list[list[torch.Tensor]] | None = None,
    ) -> tuple[list[torch.Tensor | None], dict[str, int] | None]:
        """Bind this call's inputs and fresh output tensors on the calling thread's
        binding; returns (outputs, symbol values). Resolves the caches through ``ctx``
        (advancing its layer index) unless ``caches`` are given."""
        b = self._this_thread()
        if caches is None:
            caches = self._caches(ctx) if self._updates else []
        keep: list[torch.Tensor] = []  # what is bound but not the caller's must outlive the run
        # The caches' bounds, to tell cheaply (two compares an input) that an input does
        # not share their memory: a piece reading a cache it updates in place would read it
        # as ONNX Runtime orders the two, eager reads it before the update.
        lo, hi = (
            (
                min(c.data_ptr() for layer in caches for c in layer),
                max(c.data_ptr() + c.nbytes for layer in caches for c in layer),
            )
            if caches
            else (0, 0)
        )
        for name, src in self._inputs:
            kind = src[0]
            if kind == "arg":
                t = args[src[1]]
                contiguous = t.is_contiguous()
                if hi:
                    start = t.data_ptr()
                    end = start + t.nbytes if contiguous else _span(t)[1]
                    if (
                        start < hi
                        and lo < end
                        and start < end
                        and any(_overlap((start, end), _span(c)) for layer in caches for c in layer)
                    ):
                        raise PieceRunError(
                            f"input {name} shares memory with a KV cache this piece updates in place, "
                            "which ONNX Runtime may read after the update (eager reads it before)"
                        )
                if not contiguous:
                    t = t.contiguous()
                    keep.append(t)
                if t.is_conj():  # a lazy conjugate (complex only): its memory is not its value
                    t = t.resolve_conj()
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

    def bound_inputs(self) -> dict[str, int]:
        """The calling thread's bound inputs: ``{input name: data pointer}``."""
        b = getattr(self._local, "binding", None)
        return {name: sig[0] for name, sig in b.bound.items() if not sig[3]} if b is not None else {}

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
            except EagerInstead as e:  # outside the autograd function: eager keeps its history
                return self._eager_instead(args, e.error)
        return self._run(args)

    def _run(self, args: tuple, defer: bool = False) -> Any:
        """Run the artifact; on a failure, run eagerly (``defer``: raise EagerInstead so
        the caller does, outside an autograd function running with grad mode off)."""
        if self.artifact.session is None:  # no compute: every leaf is made here
            return self._assemble(args, [], self.symbol_values(args) if self._needs_symbols else None)
        ctx = _C.current_forward_context(self.label) if self._updates or _C.has_forward_context() else None
        start = ctx.kv_cache_layer_index if ctx is not None else 0
        try:
            caches = self._caches(ctx) if self._updates else []
            outs, sym = self.bind(args, ctx, caches)
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
                raise EagerInstead(error) from e
            return self._eager_instead(args, error)
        if self._after_run:  # only artifacts with such outputs pay for the checks
            for i in self._eager_unless:
                if not outs[i].item():  # outside the domain the translation is exact on
                    compilation_counter.bump(num_eager_unless_calls=1)
                    if defer:
                        raise EagerInstead(None)
                    return self.eager(*args)
            for i, api_name, is_matrix in self._checks:  # eager's error, if eager raises one
                _CHECK_ERRORS(outs[i], api_name, is_matrix=is_matrix)
            with torch.no_grad():  # an input written back never requires grad (see prepare)
                for i, arg in self._writes:
                    args[arg].copy_(outs[i])
        # Outside the fallback: an error here is a bug in the layout, and must surface.
        return self._assemble(args, outs, sym)

    def _eager_instead(self, args: tuple, error: Exception | None) -> Any:
        """The eager piece for this call (``error`` None: an empty batch), and from now on
        when ONNX Runtime failed. If eager fails too, the inputs were bad: that raises and
        the runner stays compiled."""
        out = self.eager(*args)
        if error is not None:
            self.use_eager = True
            warn_fallback(
                self.label,
                f"ONNX Runtime failed: {type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}",
            )
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
            return any(
                math.prod(shape_fn(sym)) == 0 for _, target, shape_fn, _ in self._outputs if target[0] != "cache"
            )
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
                leaves.append(self._symbol_leaves[leaf[1]](sym))
            else:
                leaves.append(leaf[1])
        return tuple(leaves) if self._flat_tuple else pytree.tree_unflatten(leaves, self._spec)
