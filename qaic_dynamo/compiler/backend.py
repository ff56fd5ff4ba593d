"""The ``qaic`` torch.compile backend: the entry of the pipeline.

    torch.compile(model, backend="qaic", options={"fallback": "error"})

``setup.py`` registers :func:`qaic_backend` in the ``torch_dynamo_backends`` entry-point
group, so this works in an interpreter that never imported qaic_dynamo.

The backend only orchestrates; each stage is a module of its own and data flows one way:

    compiler.partition (split at splitting ops) -> compiler.fingerprint (structural key)
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

import hashlib
import json
import logging
import time
import uuid
import warnings
import weakref
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.fx as fx

from qaic_dynamo._compat import FakeTensor, FakeTensorMode, detect_fake_mode, new_shape_env, through_dynamo
from qaic_dynamo.artifact import ONNX_FILE
from qaic_dynamo.cache import DiskCache, Source, artifact_cache
from qaic_dynamo.compiler.collector import collector_paused
from qaic_dynamo.compiler.dynamic_floats import PerFloatValue, dynamic_float_inputs
from qaic_dynamo.compiler.fingerprint import fingerprint
from qaic_dynamo.compiler.partition import Piece, split_graph
from qaic_dynamo.compiler.report import GraphReport, PieceReport, new_report
from qaic_dynamo.compiler.views import aliased_outputs, peel_view_outputs
from qaic_dynamo.config import CompilationConfig, qaic_compiler_path
from qaic_dynamo.counter import compilation_counter
from qaic_dynamo.errors import ConfigError, LoweringError
from qaic_dynamo.lowering import grad_mode_refusal, lower_piece, unmet_size_assumptions
from qaic_dynamo.runtime import PieceRunner, qaic_compile, qaic_sdk_available, warn_fallback

__all__ = ["QaicBackend", "qaic_backend"]

logger = logging.getLogger("qaic_dynamo")


def _fake_mode(example_values: Sequence[Any]) -> Any:
    """The fake mode of Dynamo's example values (their symbols are the graph's).

    Not TracingContext's: torch 2.13 gives the backend a fresh mode there, and mixing it
    with the example values' mode fails.
    """
    mode = next((v.fake_mode for v in example_values if isinstance(v, FakeTensor)), None)
    if mode is None:
        mode = detect_fake_mode(example_values)
    if mode is None:
        mode = FakeTensorMode(shape_env=new_shape_env())
    return mode


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
            return self.compile_graph(gm, example_inputs, grad_mode)

    def compile_graph(
        self, gm: fx.GraphModule, example_inputs: Sequence[Any], grad_mode: bool, floats: dict[str, float] | None = None
    ) -> Callable[..., Any]:
        t_start = time.perf_counter()
        report = new_report(self.config_hash)
        report.specialized_floats = dict(floats or {})
        views = peel_view_outputs(gm)
        if views is not None:
            gm = views.inner
            report.view_outputs = views.views
        aliased = aliased_outputs(gm)
        if aliased is not None:  # keep eager's aliasing: the whole graph runs eagerly
            report.eager = aliased
            report.seconds["total"] = time.perf_counter() - t_start
            logger.warning("qaic: graph %d runs eagerly: %s", report.graph_index, aliased)
            return gm.forward if views is None else views.around(gm.forward)

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
                report.pieces.append(
                    self._compile_piece(
                        piece, piece_args[piece.name], fake_mode, split.graph_module, grad_mode, graph_nonce, graph_keys
                    )
                )
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
            try:
                self._dump(report, split.pieces)
            except OSError as e:  # a debugging aid: never the reason a compile fails (as cache_dir)
                warnings.warn(
                    f"qaic: could not write the dump of graph {report.graph_index} to dump_dir={self.config.dump_dir!r} "
                    f"({type(e).__name__}: {e}); the graph is compiled without it",
                    RuntimeWarning,
                    stacklevel=2,
                )
        # The bound forward, not the module: Dynamo wraps what a backend returns in
        # ``torch._dynamo.disable``, and a module gets an OptimizedModule around it (a
        # context manager and nn.Module's call path) on every call - once per layer and
        # step with regional compilation. A lazily generated forward is generated by
        # Dynamo right away, as for a returned lazy module.
        return split.graph_module.forward if views is None else views.around(split.graph_module.forward)

    def _compile_piece(
        self,
        piece: Piece,
        args: tuple,
        fake_mode: Any,
        split_gm: fx.GraphModule,
        grad_mode: bool,
        graph_nonce: str,
        graph_keys: list[str],
    ) -> PieceReport:
        """Key the piece, get its artifact from the cache stage, and put a runner in its place.

        A piece calling code the key cannot cover (another library's op, whose kernel may
        read state; a user function, whose defaults, globals and callees are not hashed) is
        reused only inside this graph, where every call site calls the same objects: it
        is kept off the disk, its memory key includes ``graph_nonce``, and that key goes
        into ``graph_keys`` (forgotten when the graph is)."""
        t0 = time.perf_counter()
        fp = fingerprint(piece.graph_module, args, self.config_hash)
        entry = PieceReport(
            piece.index,
            piece.name,
            piece.kind,
            piece.reason,
            piece.detail,
            key=fp.prefix,
            fingerprint_seconds=time.perf_counter() - t0,
        )
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
                qaic_compile(out_dir / ONNX_FILE, out_dir / "qpc")

        key = fp.key
        if fp.unkeyed_ops:
            logger.info(
                "%s: reused only within this graph: the kernels of %s are not in its key",
                label,
                ", ".join(fp.unkeyed_ops),
            )
            key = hashlib.sha256(f"{fp.key}|graph:{graph_nonce}".encode()).hexdigest()
        result = artifact_cache.get_or_compile(
            key,
            compile_into,
            disk=None if fp.unkeyed_ops else self.disk,
            num_threads=self.num_threads,
            describe=fp.inputs,
            unmet=lambda artifact: unmet_size_assumptions(artifact.layout.size_assumptions, args),
        )
        if fp.unkeyed_ops:
            graph_keys += [key, result.key]
        entry.key = result.key[: len(fp.prefix)]
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
            # What rebuilds the runner when a saved trace is loaded (compiler.saved_graph):
            # only a key the disk may hold.
            runner.cache_key = None if fp.unkeyed_ops or self.disk is None else result.key
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


def qaic_backend(
    gm: fx.GraphModule, example_inputs: Sequence[Any], options: dict[str, Any] | None = None, mode: str | None = None
) -> Any:
    """``torch.compile(backend="qaic", options=...)`` lands here (entry point).

    torch.compile hands its ``options`` to the backend only at the first compile, so they
    are validated here; a bad one raises the ConfigError itself (not wrapped in Dynamo's
    ``BackendCompilerFailed``), its message first."""
    try:
        if mode is not None:
            raise ConfigError(f"backend 'qaic' has no modes (got mode={mode!r}); pass options={{...}} instead")
        config = CompilationConfig.from_options(options)
    except ConfigError as e:
        raise through_dynamo(e) from None
    return QaicBackend(config)(gm, example_inputs)
