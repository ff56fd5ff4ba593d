"""The ``qaic`` torch.compile backend: the entry of the pipeline.

    torch.compile(model, backend="qaic", options={"fallback": "error"})

``setup.py`` registers :func:`qaic_backend` in the ``torch_dynamo_backends`` entry-point
group, so this works in an interpreter that never imported qaic_dynamo.

The backend only orchestrates; each stage is a module of its own and data flows one way:

    partition (split at splitting ops) -> fingerprint (structural key)
    -> cache (memory, then disk; get-or-compile) -> lowering (FX piece -> ONNX)
    -> artifact (on-disk format, load) -> runtime (ONNX Runtime with IOBinding)

It returns the split graph's ``forward``, each compilable piece replaced by a runner (the
graph stays reachable from its report), followed by an eager epilogue when outputs are
views of inputs or of other outputs (so they stay views, as in eager). Results stay
inspectable: :func:`last_compile_report` lists every piece with its kind, why the split
put it there, its fingerprint, where its artifact came from (lowered, memory, disk or
failed), the seconds it took and any fallback reason; the same table is logged to
``logging.getLogger("qaic_dynamo")``.
"""

from __future__ import annotations

import contextlib
import gc
import hashlib
import json
import logging
import threading
import time
import uuid
import weakref
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.fx as fx
from torch._guards import detect_fake_mode
from torch._subclasses.fake_tensor import FakeTensor

from qaic_dynamo.artifact import ONNX_FILE
from qaic_dynamo.cache import DiskCache, Source, artifact_cache
from qaic_dynamo.config import CompilationConfig, ConfigError, qaic_compiler_path
from qaic_dynamo.counter import compilation_counter
from qaic_dynamo.fingerprint import fingerprint
from qaic_dynamo.lowering import LoweringError, ProcessWide, grad_mode_refusal, lower_piece, unmet_size_assumptions
from qaic_dynamo.partition import Piece, PieceKind, SplitReason, peel_view_outputs, split_graph
from qaic_dynamo.runtime import PieceRunner, qaic_compile, qaic_sdk_available, warn_fallback

__all__ = [
    "GraphReport", "PerFloatValue", "PieceReport", "QaicBackend", "collector_paused", "compile_reports", "last_compile_report", "qaic_backend",
]

logger = logging.getLogger("qaic_dynamo")


@dataclass
class PieceReport:
    index: int
    name: str
    kind: PieceKind
    reason: SplitReason
    detail: str = ""  # the splitting op(s) and node(s) behind the reason
    key: str | None = None  # fingerprint prefix (compilable pieces)
    source: Source | None = None  # where the artifact came from (compilable pieces)
    seconds: float = 0.0  # fingerprint + get-or-compile + runner, this piece
    fingerprint_seconds: float = 0.0
    compile_seconds: float = 0.0  # lowering + checks (+ qaic-compile), when lowered here
    load_seconds: float = 0.0  # ONNX Runtime session creation, when a session was made
    fallback: str | None = None  # why it runs eagerly
    exporter_fallback: str | None = None  # why torch.onnx's exporter lowered it (the op), if it did
    artifact: str | None = None  # artifact directory (readable path)

    @property
    def why(self) -> str:
        return f"{self.reason.value} {self.detail}".strip()

    @property
    def reused(self) -> bool | None:
        """True when an artifact already in memory served it; None for splitting pieces."""
        return None if self.source is None else self.source is Source.MEMORY

    @property
    def runs_eagerly(self) -> bool:
        return self.kind is PieceKind.SPLITTING or self.fallback is not None


@dataclass
class GraphReport:
    graph_index: int
    config_hash: str
    pieces: list[PieceReport] = field(default_factory=list)
    seconds: dict[str, float] = field(default_factory=dict)
    # Inputs carrying a Python float Dynamo left dynamic, compiled at these values
    # (:class:`PerFloatValue`): input name -> value.
    specialized_floats: dict[str, float] = field(default_factory=dict)
    # Outputs rebuilt eagerly after the compiled graph, so that they stay views as in
    # eager (:func:`~qaic_dynamo.partition.peel_view_outputs`): position -> base.
    view_outputs: dict[int, str] = field(default_factory=dict)
    # The split graph this report describes (weak: a report must not keep sessions alive).
    _module: Any = field(default=None, repr=False, compare=False)

    def split_module(self) -> fx.GraphModule | None:
        """The split GraphModule (runners in place of compiled pieces), while it is alive."""
        return self._module() if self._module is not None else None

    def runners(self) -> list[PieceRunner]:
        """The split graph's runners in piece order (empty once it is gone)."""
        gm = self.split_module()
        return [m for m in gm.children() if isinstance(m, PieceRunner)] if gm is not None else []

    def _count(self, source: Source) -> int:
        return sum(1 for p in self.pieces if p.source is source)

    @property
    def unique_compiled(self) -> int:
        """Pieces lowered in this compile (new fingerprints)."""
        return self._count(Source.LOWERED)

    @property
    def reused(self) -> int:
        return self._count(Source.MEMORY)

    @property
    def disk_hits(self) -> int:
        return self._count(Source.DISK)

    @property
    def failed(self) -> int:
        return self._count(Source.FAILED)

    def table(self) -> str:
        lines = [
            f"qaic graph {self.graph_index}: {len(self.pieces)} pieces, {self.unique_compiled} compiled, "
            f"{self.reused} reused, {self.disk_hits} from disk, {self.failed} failed; "
            + ", ".join(f"{k} {v:.3f}s" for k, v in self.seconds.items())
            + (f"; compiled for the values of {len(self.specialized_floats)} dynamic float input(s)"
               if self.specialized_floats else "")
            + ("; outputs rebuilt as views after it: " + ", ".join(f"{i} of {base}" for i, base in self.view_outputs.items())
               if self.view_outputs else ""),
            f"{'#':>3} {'piece':<10} {'kind':<10} {'key':<12} {'source':<7} {'seconds':>8}  why",
        ]
        for p in self.pieces:
            why = p.why + (f"; FALLBACK: {p.fallback}" if p.fallback else "")
            why += f"; lowered by the exporter: {p.exporter_fallback}" if p.exporter_fallback else ""
            source = "-" if p.source is None else p.source.value
            lines.append(f"{p.index:>3} {p.name:<10} {p.kind.value:<10} {p.key or '-':<12} {source:<7} {p.seconds:>8.3f}  {why}")
        return "\n".join(lines)

    def to_json(self) -> dict[str, Any]:
        pieces = [dict(asdict(p), reused=p.reused, why=p.why) for p in self.pieces]
        return {"graph_index": self.graph_index, "config_hash": self.config_hash, "pieces": pieces, "seconds": self.seconds,
                "specialized_floats": self.specialized_floats, "view_outputs": self.view_outputs}


_reports: list[GraphReport] = []
_reports_lock = threading.Lock()


def compile_reports() -> list[GraphReport]:
    """Reports of every graph this process compiled with the qaic backend, oldest first."""
    with _reports_lock:
        return list(_reports)


def last_compile_report() -> GraphReport:
    with _reports_lock:
        if not _reports:
            raise RuntimeError("no graph has been compiled with backend='qaic' in this process yet")
        return _reports[-1]


def _new_report(config_hash: str) -> GraphReport:
    with _reports_lock:
        report = GraphReport(len(_reports), config_hash[:12])
        _reports.append(report)
        return report


def _fake_mode(example_values: Sequence[Any]) -> Any:
    """The fake mode of Dynamo's example values (their symbols are the graph's).

    Not TracingContext's: torch 2.13 gives the backend a fresh mode there, and mixing it
    with the example values' mode fails.
    """
    mode = next((v.fake_mode for v in example_values if isinstance(v, FakeTensor)), None)
    if mode is None:
        mode = detect_fake_mode(example_values)
    if mode is None:
        from torch._subclasses.fake_tensor import FakeTensorMode
        from torch.fx.experimental.symbolic_shapes import ShapeEnv

        mode = FakeTensorMode(shape_env=ShapeEnv())
    return mode


def _pause_collector() -> bool:
    was_enabled = gc.isenabled()
    gc.disable()
    return was_enabled


def _resume_collector(was_enabled: bool) -> None:
    if was_enabled:
        gc.enable()


_collector = ProcessWide(_pause_collector, _resume_collector)


def collector_paused() -> Any:
    """Python's cyclic garbage collector off while a graph compiles (restored after).

    The backend allocates hundreds of thousands of short-lived objects (split graphs,
    fake tensors, sympy expressions, ONNX IR), and each allocation burst triggers
    collections whose oldest generation re-scans every object alive in the process - at
    32 layers, Dynamo's whole traced graph and its fake tensors (where a collection landed
    moved the cost between pieces: the middle piece's aten trace took 0.49-0.81 s). Side
    by side at 32 layers on the demo model, medians of 3 fresh processes: the whole-model
    backend 2.54 -> 2.32 s, a restart of the regional compile from the disk cache 2.19 ->
    1.75 s (regions pause it for Dynamo's trace too). Cycles made meanwhile are collected
    once the collector runs again. Not ``gc.freeze``: a server that froze its start-up
    heap (vLLM does) would have it unfrozen after. Process-wide, like the collector;
    nested and concurrent compiles restore it once, at the last exit.
    """
    return _collector.held()


def _piece_example_args(
    gm: fx.GraphModule, split_gm: fx.GraphModule, example_values: Sequence[Any], fake_mode: Any
) -> dict[str, tuple]:
    """Each piece's arguments as fake values.

    split_module names a piece's inputs after the nodes of the original graph, and Dynamo
    left a fake ``example_value`` on every one of those, so they are read directly; only if
    a name is missing is the split graph run on fakes (slower: it re-runs every op).
    """
    known = {n.name: n.meta["example_value"] for n in gm.graph.nodes if "example_value" in n.meta}
    direct: dict[str, tuple] = {}
    for node in split_gm.graph.nodes:
        if node.op != "call_module":
            continue
        sub = getattr(split_gm, node.target)
        names = [p.name for p in sub.graph.nodes if p.op == "placeholder"]
        if not all(n in known for n in names):
            break
        direct[node.target] = tuple(known[n] for n in names)
    else:
        return direct

    recorded: dict[str, tuple] = {}

    class Recorder(fx.Interpreter):
        def call_module(self, target, args, kwargs):
            recorded[target] = args
            return super().call_module(target, args, kwargs)

    with fake_mode:
        Recorder(split_gm).run(*example_values)
    return recorded


class QaicBackend:
    """Compile one Dynamo graph; holds the config. Instances are cheap."""

    def __init__(self, config: CompilationConfig) -> None:
        if config.runtime == "qaic" and not qaic_sdk_available():
            raise ConfigError(
                f"runtime='qaic' needs the Qualcomm Cloud AI SDK, but {qaic_compiler_path()} is not installed; "
                "install the SDK, or use runtime='onnxruntime' (the default)"
            )
        self.config = config
        self.config_hash = config.compute_hash()
        self.num_threads = config.num_threads or torch.get_num_threads()
        self.disk = DiskCache.get(config.resolved_cache_dir(), config.cache_size_limit) if config.cache else None

    def __call__(self, gm: fx.GraphModule, example_inputs: Sequence[Any]) -> Callable[..., Any]:
        # The grad mode the graph runs in (Dynamo guards it), read before any lowering:
        # tracing a piece runs its grad-mode switches, and lowering keeps to this mode.
        grad_mode = torch.is_grad_enabled()
        compilation_counter.bump(num_graphs_seen=1)
        with collector_paused():
            floats = dynamic_float_inputs(gm, example_inputs)
            if floats:
                return PerFloatValue(self, gm, example_inputs, floats, grad_mode)
            return self._compile_graph(gm, example_inputs, grad_mode)

    def _compile_graph(self, gm: fx.GraphModule, example_inputs: Sequence[Any], grad_mode: bool,
                       floats: dict[str, float] | None = None) -> Callable[..., Any]:
        t_start = time.perf_counter()
        report = _new_report(self.config_hash)
        report.specialized_floats = dict(floats or {})
        views = peel_view_outputs(gm)
        if views is not None:
            gm = views.inner
            report.view_outputs = views.views

        placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        example_values = [
            n.meta.get("example_value", n.meta.get("val", ex)) for n, ex in zip(placeholders, example_inputs)
        ]
        fake_mode = _fake_mode(example_values)

        t0 = time.perf_counter()
        split = split_graph(gm, self.config.splitting_ops)
        report.seconds["split"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        piece_args = _piece_example_args(gm, split.graph_module, example_values, fake_mode)
        report.seconds["propagate"] = time.perf_counter() - t0

        t0 = time.perf_counter()
        pieces = split.pieces
        graph_nonce = uuid.uuid4().hex  # what keeps unkeyed pieces' reuse inside this graph
        graph_keys: list[str] = []  # the keys only this graph looks up
        if self.config.progress:
            from tqdm import tqdm

            pieces = tqdm(pieces, desc=f"qaic: compiling graph {report.graph_index}", unit="piece", leave=False)
        for piece in pieces:
            compilation_counter.bump(num_piecewise_graphs_seen=1)
            if piece.is_splitting:
                report.pieces.append(PieceReport(piece.index, piece.name, piece.kind, piece.reason, piece.detail))
                continue
            compilation_counter.bump(num_piecewise_compilable_graphs_seen=1)
            with torch.set_grad_enabled(grad_mode):  # lowering runs a piece's switches: none leaks to the next
                report.pieces.append(self._compile_piece(piece, piece_args[piece.name], fake_mode, split.graph_module,
                                                         grad_mode, graph_nonce, graph_keys))
        compilable = [p for p in report.pieces if p.source is not None]
        report.seconds["fingerprint"] = sum(p.fingerprint_seconds for p in compilable)
        report.seconds["lower+load"] = sum(p.compile_seconds + p.load_seconds for p in compilable)
        report.seconds["pieces"] = time.perf_counter() - t0
        report.seconds["total"] = time.perf_counter() - t_start
        report._module = weakref.ref(split.graph_module)
        if graph_keys:  # their artifacts and scratch directories go with the graph
            weakref.finalize(split.graph_module, artifact_cache.forget, tuple(graph_keys))
        logger.info("%s", report.table())
        if self.config.dump_dir:
            self._dump(report, split.pieces)
        # The bound forward, not the module: Dynamo wraps what a backend returns in
        # ``torch._dynamo.disable``, and a module gets an OptimizedModule around it (a
        # context manager and nn.Module's call path) on every call - once per layer and
        # step with regional compilation. A lazily generated forward is generated by
        # Dynamo right away, as for a returned lazy module.
        return split.graph_module.forward if views is None else views.around(split.graph_module.forward)

    def _compile_piece(self, piece: Piece, args: tuple, fake_mode: Any, split_gm: fx.GraphModule,
                       grad_mode: bool, graph_nonce: str, graph_keys: list[str]) -> PieceReport:
        """Key the piece, get its artifact from the cache stage, and put a runner in its place.

        A piece calling code the key cannot cover (another library's op, whose kernel may
        read state; a user function, whose defaults, globals and callees are not hashed) is
        reused only inside this graph, where every call site calls the same objects: it
        is kept off the disk, its memory key includes ``graph_nonce``, and that key goes
        into ``graph_keys`` (forgotten when the graph is)."""
        t0 = time.perf_counter()
        fp = fingerprint(piece.graph_module, args, self.config_hash)
        entry = PieceReport(piece.index, piece.name, piece.kind, piece.reason, piece.detail, key=fp.prefix,
                            fingerprint_seconds=time.perf_counter() - t0)
        label = f"piece {piece.name} ({fp.prefix})"
        refusal = grad_mode_refusal(piece.graph_module, grad_mode)  # before any cache: per call site
        if refusal is not None:
            if self.config.fallback == "error":
                raise LoweringError(f"{label}: {refusal} (options={{'fallback': 'eager'}} runs it eagerly instead)")
            entry.fallback = refusal
            warn_fallback(label, refusal)
            entry.seconds = time.perf_counter() - t0
            return entry

        def compile_into(out_dir: Path) -> None:
            lower_piece(piece.graph_module, args, fake_mode, self.config, out_dir)
            if self.config.runtime == "qaic":
                qaic_compile(out_dir, out_dir / "qpc")

        key = fp.key
        if fp.unkeyed_ops:
            logger.info("%s: reused only within this graph: the kernels of %s are not in its key", label,
                        ", ".join(fp.unkeyed_ops))
            key = hashlib.sha256(f"{fp.key}|graph:{graph_nonce}".encode()).hexdigest()
        result = artifact_cache.get_or_compile(
            key, compile_into, disk=None if fp.unkeyed_ops else self.disk, num_threads=self.num_threads,
            describe=fp.inputs, unmet=lambda artifact: unmet_size_assumptions(artifact.layout.size_assumptions, args),
        )
        if fp.unkeyed_ops:
            graph_keys += [key, result.key]
        entry.key = result.key[:len(fp.prefix)]
        entry.source = result.source
        entry.compile_seconds, entry.load_seconds = result.compile_seconds, result.load_seconds
        if result.source is Source.MEMORY:
            compilation_counter.bump(num_piece_reuses=1)
        if result.artifact is None:
            # The policy is this config's, whoever failed first: a failure remembered under
            # fallback="eager" still raises under fallback="error".
            if self.config.fallback == "error":
                earlier = " (remembered from an identical piece compiled earlier)" if result.failure_cached else ""
                raise LoweringError(
                    f"{label}: {result.failure}{earlier} (options={{'fallback': 'eager'}} runs it eagerly instead)"
                ) from result.error
            entry.fallback = result.failure
            warn_fallback(label, result.failure)
        else:
            entry.artifact = str(result.artifact.path)
            entry.exporter_fallback = result.artifact.layout.stats.get("exporter_fallback")
            runner = PieceRunner(result.artifact, piece.graph_module, self.config, label)
            # Grad mode itself is checked by the runner per call (cheap, and whatever
            # switched it before the call counts).
            runner.differentiable = any(isinstance(a, torch.Tensor) and a.requires_grad for a in args)
            setattr(split_gm, piece.name, runner)
        entry.seconds = time.perf_counter() - t0
        return entry

    def _dump(self, report: GraphReport, pieces: list[Piece]) -> None:
        out = Path(self.config.dump_dir) / f"graph{report.graph_index}"
        out.mkdir(parents=True, exist_ok=True)
        by_name = {p.name: p for p in pieces}
        for entry in report.pieces:
            piece = by_name[entry.name]
            stem = f"piece{entry.index:03d}_{entry.kind.value}" + (f"_{entry.key}" if entry.key else "")
            (out / f"{stem}.py").write_text(piece.graph_module.print_readable(print_output=False))
            model = Path(entry.artifact) / ONNX_FILE if entry.artifact else None
            if model is not None and model.exists() and entry.source is not Source.MEMORY:
                (out / f"{stem}.onnx").write_bytes(model.read_bytes())
        (out / "summary.json").write_text(json.dumps(report.to_json(), indent=1))
        (out / "report.txt").write_text(report.table() + "\n")


# --- Python floats Dynamo left dynamic ------------------------------------------------------

MAX_FLOAT_VARIANTS = 8  # values compiled per graph before the rest run eagerly (Dynamo's own limit)


def _dynamo_compile_lock() -> Any:
    """Dynamo's lock around every frame compile (torch 2.13, private; a re-entrant lock). A
    compile at call time holds it too: the compile session flag below is one process-wide
    value that each session saves and restores, so sessions on two threads must not
    overlap (a Dynamo compile ending while ours traced reset it under us)."""
    from torch._dynamo import convert_frame

    return getattr(convert_frame, "compile_lock", None) or _OWN_COMPILE_LOCK


_OWN_COMPILE_LOCK = threading.RLock()
# What Dynamo holds while it compiles a frame (torch 2.13, private): is_compiling() is True
# process-wide, so make_fx in a backend is not taken for FX tracing a compiled function.
_compile_session = getattr(torch.compiler, "_compile_session_context", contextlib.nullcontext)


def dynamic_float_inputs(gm: fx.GraphModule, example_inputs: Sequence[Any]) -> dict[int, float]:
    """Graph inputs that carry a Python float Dynamo did not specialise, by position, with
    the example's value.

    Under ``dynamic=True`` (or once a float changed between two compiles of one code
    object, e.g. two models of one class with different ``eps``) Dynamo passes the float as
    a 0-d tensor and reads it back with ``item()``. ONNX has no symbolic floats, so a piece
    that uses the number (an attention ``scale``, ``x.add(eps)``) could not be lowered and
    ran eagerly. Only inputs read solely through ``item()`` with a real example value count,
    and only where the number is used as it is or through Python arithmetic on numbers alone
    (``s * 2``, ``math.sqrt(2 / math.pi)`` in GPT-2's and Phi's GELU: :func:`scalar_arithmetic`,
    computed once the values are in). A size computed from one, or arithmetic that mixes it
    with a dynamic size, keeps its symbol in Dynamo's values of later nodes, which the split
    and the lowering read, so such a graph is left as it was (its pieces run eagerly, with a
    warning)."""
    from torch.fx.experimental.symbolic_shapes import free_symbols

    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    found: dict[int, tuple[float, set[Any]]] = {}
    for i, (node, example) in enumerate(zip(placeholders, example_inputs)):
        if (isinstance(example, torch.Tensor) and not isinstance(example, FakeTensor) and example.dim() == 0
                and example.is_floating_point() and node.users
                and all(u.op == "call_method" and u.target == "item" for u in node.users)):
            found[i] = (example.item(), {s for u in node.users for s in free_symbols(u.meta.get("example_value"))})
    # Until nothing changes: arithmetic counts as computed only if every float it reads is
    # kept (``a * b`` with ``b`` mixed with a size keeps ``a``'s symbol too).
    while found:
        reads = {u for i in found for u in placeholders[i].users}
        computed = scalar_arithmetic(gm, reads)
        elsewhere = {s for n in gm.graph.nodes if n.op != "placeholder" and n not in reads and n not in computed
                     for s in free_symbols(n.meta.get("example_value"))}
        kept = {i: v for i, v in found.items() if not v[1] & elsewhere}
        if len(kept) == len(found):
            break
        found = kept
    return {i: value for i, (value, _) in found.items()}


#: torch's functions on Python numbers that Dynamo records for math on a symbolic float or
#: int (``math.sqrt`` -> ``torch._sym_sqrt``); with ``operator``'s and ``math``'s, what
#: :func:`scalar_arithmetic` may compute itself.
_SYM_FUNCTIONS = frozenset(f for name, f in vars(torch).items()
                           if callable(f) and (name.startswith("_sym_") or name in (
                               "sym_float", "sym_int", "sym_max", "sym_min", "sym_not", "sym_ite", "sym_sum")))


def _is_number_function(target: Any) -> bool:
    return target in _SYM_FUNCTIONS or getattr(target, "__module__", None) in ("_operator", "math")


def scalar_arithmetic(gm: fx.GraphModule, reads: set[fx.Node]) -> set[fx.Node]:
    """The nodes computing a Python number from ``reads`` (the float inputs' ``item()``)
    and constants alone, through ``operator``, ``math`` or torch's ``sym_*`` functions:
    once the floats are constants, :func:`specialize_floats` computes them in Python, in
    double precision as eager does, so no symbolic float is left for the split."""
    number = (torch.SymFloat, torch.SymInt, torch.SymBool, float, int, bool)
    computed: set[fx.Node] = set()
    for n in gm.graph.nodes:
        if (n.op == "call_function" and _is_number_function(n.target)
                and isinstance(n.meta.get("example_value"), number) and n.all_input_nodes
                and all(d in reads or d in computed for d in n.all_input_nodes)):
            computed.add(n)
    return computed


def specialize_floats(gm: fx.GraphModule, values: dict[int, float]) -> None:
    """Put each value in place of its input's ``item()`` reads (the input stays, unused),
    then compute the Python arithmetic on them (:func:`scalar_arithmetic`)."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    reads = {u for position in values for u in placeholders[position].users}
    computed = scalar_arithmetic(gm, reads)
    constants: dict[fx.Node, Any] = {}
    for position, value in values.items():
        for item in placeholders[position].users:
            constants[item] = value
    for n in gm.graph.nodes:  # in order: a computed node's inputs are constants by now
        if n in computed:
            args = fx.node.map_arg(n.args, lambda a: constants[a])
            kwargs = fx.node.map_arg(n.kwargs, lambda a: constants[a])
            constants[n] = n.target(*args, **kwargs)
    for node in reversed(list(constants)):
        for user in list(node.users):
            user.args = fx.node.map_arg(user.args, lambda a, node=node: constants[node] if a is node else a)
            user.kwargs = fx.node.map_arg(user.kwargs, lambda a, node=node: constants[node] if a is node else a)
        gm.graph.erase_node(node)
    gm.recompile()


def _copy_graph_module(gm: fx.GraphModule) -> fx.GraphModule:
    """A new GraphModule over a copy of ``gm``'s graph (node meta copied shallowly, so
    Dynamo's fake values are shared, not cloned)."""
    graph = fx.Graph()
    graph.output(graph.graph_copy(gm.graph, {}))
    return fx.GraphModule(gm, graph)


def _float_key(value: float) -> str:
    return value.hex()  # exact, and NaN and -0.0 are keys of their own


class PerFloatValue:
    """A graph with dynamic float inputs, compiled once per value those floats take.

    Each compile puts the values in as constants, and every call reads the floats (one
    ``item()`` each) to pick the variant compiled for them - a value not seen yet compiles
    its own, from a pristine copy of the graph - so no call is served an artifact built for
    another value. Past
    :data:`MAX_FLOAT_VARIANTS` values the graph runs eagerly for the new ones, with a
    warning."""

    def __init__(self, backend: QaicBackend, gm: fx.GraphModule, example_inputs: Sequence[Any],
                 floats: dict[int, float], grad_mode: bool) -> None:
        self.backend = backend
        self.grad_mode = grad_mode
        self.positions = tuple(floats)
        self.pristine = _copy_graph_module(gm)  # before the first variant rewrites gm
        self._names = [n.name for n in gm.graph.nodes if n.op == "placeholder"]
        self._lock = threading.Lock()
        self._warned = False
        self.variants: dict[tuple[str, ...], Callable[..., Any]] = {}
        self.variants[tuple(_float_key(v) for v in floats.values())] = self._compile(gm, example_inputs, floats)

    def _compile(self, gm: fx.GraphModule, example_inputs: Sequence[Any], floats: dict[int, float]) -> Callable[..., Any]:
        try:
            specialize_floats(gm, floats)
        except (ArithmeticError, ValueError):
            # The graph's own arithmetic fails at these values (``math.sqrt(-s)``, ``1 / s``
            # at 0): nothing was changed, and run as it is the graph raises eager's error.
            return gm.forward
        return self.backend._compile_graph(gm, example_inputs, self.grad_mode,
                                           {self._names[i]: v for i, v in floats.items()})

    def __call__(self, *args: Any) -> Any:
        key = tuple(_float_key(float(args[i])) for i in self.positions)
        compiled = self.variants.get(key)
        if compiled is None:
            compiled = self._new_variant(key, args)
        return compiled(*args)

    def _new_variant(self, key: tuple[str, ...], args: Sequence[Any]) -> Callable[..., Any]:
        # Lowering traces with make_fx, which raises torch.fx's process-wide tracing flag;
        # outside a compile session, a call of any compiled function on another thread
        # then raises (Dynamo takes it for FX tracing a compiled function). A compile at
        # call time is a compile session as Dynamo's own are, under Dynamo's lock (taken
        # first, as Dynamo's compiles do, so the two locks are always taken in one order).
        with _dynamo_compile_lock(), self._lock:
            if key in self.variants:
                return self.variants[key]
            if len(self.variants) >= MAX_FLOAT_VARIANTS:
                if not self._warned:  # counted and warned once per graph
                    self._warned = True
                    warn_fallback(f"a graph with dynamic float inputs {[self._names[i] for i in self.positions]}",
                                  f"they took more than {MAX_FLOAT_VARIANTS} values; calls with a new value run "
                                  "eagerly (for Python floats, torch._dynamo.config.specialize_float = True makes "
                                  "Dynamo guard and recompile per value instead)")
                return self.pristine.forward
            with _compile_session(), collector_paused(), torch.set_grad_enabled(self.grad_mode):
                compiled = self._compile(_copy_graph_module(self.pristine), args,
                                         {i: float(args[i]) for i in self.positions})
            self.variants[key] = compiled
            return compiled


def qaic_backend(
    gm: fx.GraphModule, example_inputs: Sequence[Any], options: dict[str, Any] | None = None, mode: str | None = None
) -> Any:
    """``torch.compile(backend="qaic", options=...)`` lands here (entry point)."""
    if mode is not None:
        raise ConfigError(f"backend 'qaic' has no modes (got mode={mode!r}); pass options={{...}} instead")
    return QaicBackend(CompilationConfig.from_options(options))(gm, example_inputs)
