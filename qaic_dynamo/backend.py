"""The ``qaic`` torch.compile backend: the entry of the pipeline.

    torch.compile(model, backend="qaic", options={"fallback": "error"})

``setup.py`` registers :func:`qaic_backend` in the ``torch_dynamo_backends`` entry-point
group, so this works in an interpreter that never imported qaic_dynamo.

For each Dynamo graph the backend runs, in one direction:

    partition (split at attention) -> fingerprint (structural key) -> cache (memory)
    -> lowering (FX piece -> ONNX) -> runtime (ONNX Runtime with IOBinding)

and returns the split graph with each compilable piece replaced by a runner. Results stay
inspectable: :func:`last_compile_report` lists every piece with its fingerprint, whether
it was reused, the seconds its lowering took, why the split happened there and any
fallback reason; the same table is logged to ``logging.getLogger("qaic_dynamo")``.
"""

from __future__ import annotations

import contextlib
import json
import logging
import shutil
import time
import weakref
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.fx as fx
from torch._guards import detect_fake_mode
from torch._subclasses.fake_tensor import FakeTensor

from qaic_dynamo.cache import DiskCache, artifact_cache
from qaic_dynamo.config import CompilationConfig, ConfigError
from qaic_dynamo.counter import compilation_counter
from qaic_dynamo.fingerprint import fingerprint
from qaic_dynamo.lowering import ONNX_FILE, LoweringError, lower_piece
from qaic_dynamo.partition import Piece, split_graph
from qaic_dynamo.runtime import QAIC_COMPILE, PieceRunner, load, qaic_compile, qaic_sdk_available, warn_fallback

__all__ = ["GraphReport", "PieceReport", "QaicBackend", "compile_reports", "last_compile_report", "qaic_backend"]

logger = logging.getLogger("qaic_dynamo")


@dataclass
class PieceReport:
    index: int
    name: str
    kind: str  # "compiled", "splitting" or "eager"
    reason: str  # why the split put this piece here
    key: str | None = None  # fingerprint prefix
    reused: bool | None = None
    seconds: float = 0.0  # fingerprint + lowering + session, this piece
    export_seconds: float = 0.0  # ONNX export + checks (0 when reused)
    load_seconds: float = 0.0  # ONNX Runtime session creation (0 when reused)
    disk_hit: bool = False  # loaded from the persistent cache (no export)
    fallback: str | None = None
    artifact: str | None = None  # artifact directory (readable path)


@dataclass
class GraphReport:
    graph_index: int
    config_hash: str
    pieces: list[PieceReport] = field(default_factory=list)
    seconds: dict[str, float] = field(default_factory=dict)
    # The split graph this report describes (weak: a report must not keep sessions alive).
    _module: Any = field(default=None, repr=False, compare=False)

    def split_module(self) -> fx.GraphModule | None:
        """The split GraphModule (runners in place of compiled pieces), while it is alive."""
        return self._module() if self._module is not None else None

    @property
    def unique_compiled(self) -> int:
        """Pieces lowered in this compile (not reused, not loaded from disk)."""
        return sum(1 for p in self.pieces if p.kind == "compiled" and not p.reused and not p.disk_hit)

    @property
    def reused(self) -> int:
        return sum(1 for p in self.pieces if p.reused)

    @property
    def disk_hits(self) -> int:
        return sum(1 for p in self.pieces if p.disk_hit)

    def table(self) -> str:
        lines = [
            f"qaic graph {self.graph_index}: {len(self.pieces)} pieces, {self.unique_compiled} compiled, "
            f"{self.reused} reused, {self.disk_hits} from disk; " + ", ".join(f"{k} {v:.3f}s" for k, v in self.seconds.items()),
            f"{'#':>3} {'piece':<10} {'kind':<9} {'key':<12} {'reused':<6} {'seconds':>8}  why",
        ]
        for p in self.pieces:
            why = p.reason + (f"; FALLBACK: {p.fallback}" if p.fallback else "")
            lines.append(
                f"{p.index:>3} {p.name:<10} {p.kind:<9} {p.key or '-':<12} "
                f"{'-' if p.reused is None else ('yes' if p.reused else ('disk' if p.disk_hit else 'no')):<6} "
                f"{p.seconds:>8.3f}  {why}"
            )
        return "\n".join(lines)

    def to_json(self) -> dict[str, Any]:
        return {k: v for k, v in asdict(self).items() if not k.startswith("_")}


_reports: list[GraphReport] = []


def compile_reports() -> list[GraphReport]:
    """Reports of every graph this process compiled with the qaic backend, oldest first."""
    return list(_reports)


def last_compile_report() -> GraphReport:
    if not _reports:
        raise RuntimeError("no graph has been compiled with backend='qaic' in this process yet")
    return _reports[-1]


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
                f"runtime='qaic' needs the Qualcomm Cloud AI SDK, but {QAIC_COMPILE} is not installed; "
                "install the SDK, or use runtime='onnxruntime' (the default)"
            )
        self.config = config
        self.config_hash = config.compute_hash()
        self.disk = DiskCache.get(config.resolved_cache_dir(), config.cache_size_limit) if config.cache else None

    def __call__(self, gm: fx.GraphModule, example_inputs: Sequence[Any]) -> fx.GraphModule:
        t_start = time.perf_counter()
        compilation_counter.num_graphs_seen += 1
        report = GraphReport(len(_reports), self.config_hash[:12])
        _reports.append(report)

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

        fingerprint_s = lowering_s = 0.0
        pieces = split.pieces
        if self.config.progress:
            from tqdm import tqdm

            pieces = tqdm(pieces, desc=f"qaic: compiling graph {report.graph_index}", unit="piece", leave=False)
        for piece in pieces:
            compilation_counter.num_piecewise_graphs_seen += 1
            if piece.is_splitting:
                report.pieces.append(PieceReport(piece.index, piece.name, "splitting", piece.reason))
                continue
            compilation_counter.num_piecewise_compilable_graphs_seen += 1
            t0 = time.perf_counter()
            entry, fp_s = self._compile_piece(piece, piece_args[piece.name], fake_mode, report, split.graph_module)
            fingerprint_s += fp_s
            lowering_s += time.perf_counter() - t0 - fp_s
        report.seconds["fingerprint"] = fingerprint_s
        report.seconds["lower+load"] = lowering_s
        report.seconds["total"] = time.perf_counter() - t_start
        report._module = weakref.ref(split.graph_module)
        logger.info("%s", report.table())
        if self.config.dump_dir:
            self._dump(report, split.pieces)
        return split.graph_module

    def _compile_piece(
        self, piece: Piece, args: tuple, fake_mode: Any, report: GraphReport, split_gm: fx.GraphModule
    ) -> tuple[PieceReport, float]:
        t0 = time.perf_counter()
        fp = fingerprint(piece.graph_module, args, self.config_hash)
        fp_s = time.perf_counter() - t0
        entry = PieceReport(piece.index, piece.name, "compiled", piece.reason, key=fp.prefix)
        report.pieces.append(entry)
        label = f"piece {piece.name} ({fp.prefix})"

        artifact = artifact_cache.lookup(fp.key)
        failure = artifact_cache.failure(fp.key)
        if artifact is not None:
            entry.reused = True
            compilation_counter.num_piece_reuses += 1
        elif failure is not None:
            entry.reused = True  # the same failure as an identical piece before
        else:
            entry.reused = False
            try:
                artifact = self._load_or_lower(piece, args, fake_mode, fp, entry)
                artifact_cache.store(fp.key, artifact)
            except LoweringError as e:
                if self.config.fallback == "error":
                    raise LoweringError(f"{label}: {e} (options={{'fallback': 'eager'}} runs it eagerly instead)") from e
                failure = str(e)
                artifact_cache.store_failure(fp.key, failure)
        if artifact is None:
            entry.kind = "eager"
            entry.fallback = failure
            warn_fallback(label, failure)
        else:
            entry.artifact = str(artifact.path)
            setattr(split_gm, piece.name, PieceRunner(artifact, piece.graph_module, self.config, label))
        entry.seconds = time.perf_counter() - t0
        return entry, fp_s

    def _load_or_lower(self, piece: Piece, args: tuple, fake_mode: Any, fp: Any, entry: PieceReport) -> Any:
        """The artifact for a piece new to this process: from disk, else lowered (and stored)."""
        disk = self.disk
        if disk is not None:
            artifact = self._from_disk(disk, fp.key, entry)
            if artifact is not None:
                return artifact
        # One process lowers a key at a time; the others wait, then load its entry.
        with disk.lock(fp.key) if disk is not None else contextlib.nullcontext():
            if disk is not None:
                artifact = self._from_disk(disk, fp.key, entry)
                if artifact is not None:
                    return artifact
                disk.misses += 1
            tmp = disk.new_tmp_dir(fp.key) if disk is not None else None
            out_dir = tmp if tmp is not None else artifact_cache.new_artifact_dir(fp.key)
            try:
                (out_dir / "fingerprint.json").write_text(json.dumps(fp.inputs, indent=1, sort_keys=True))
                t1 = time.perf_counter()
                lower_piece(piece.graph_module, args, fake_mode, self.config, out_dir)
                if self.config.runtime == "qaic":
                    qaic_compile(out_dir, out_dir / "qpc")
                entry.export_seconds = time.perf_counter() - t1
            except BaseException:
                shutil.rmtree(out_dir, ignore_errors=True)
                raise
            if tmp is not None:
                writes = disk.writes
                out_dir = disk.commit(fp.key, tmp)
                compilation_counter.num_disk_cache_writes += disk.writes - writes
            t2 = time.perf_counter()
            artifact = load(out_dir, self.config)  # the session holds the model from here on
            entry.load_seconds = time.perf_counter() - t2
            compilation_counter.num_backend_compilations += 1
            if disk is not None:
                disk.evict(keep=fp.key)
            return artifact

    def _from_disk(self, disk: DiskCache, key: str, entry: PieceReport) -> Any | None:
        path = disk.lookup(key)
        if path is None:
            return None
        t0 = time.perf_counter()
        try:
            artifact = load(path, self.config)
        except (LoweringError, OSError, ValueError) as e:  # verified bytes that do not load
            disk._warn_once(f"qaic: cache entry {key[:12]} does not load ({e}); recompiling it")
            disk.discard(key)
            disk.repairs += 1
            return None
        entry.load_seconds = time.perf_counter() - t0
        entry.disk_hit = True
        disk.hits += 1
        compilation_counter.num_disk_cache_hits += 1
        return artifact

    def _dump(self, report: GraphReport, pieces: list[Piece]) -> None:
        out = Path(self.config.dump_dir) / f"graph{report.graph_index}"
        out.mkdir(parents=True, exist_ok=True)
        by_name = {p.name: p for p in pieces}
        for entry in report.pieces:
            piece = by_name[entry.name]
            stem = f"piece{entry.index:03d}_{entry.kind}" + (f"_{entry.key}" if entry.key else "")
            (out / f"{stem}.py").write_text(piece.graph_module.print_readable(print_output=False))
            if entry.artifact and not entry.reused:
                (out / f"{stem}.onnx").write_bytes((Path(entry.artifact) / ONNX_FILE).read_bytes())
        (out / "summary.json").write_text(json.dumps(report.to_json(), indent=1))
        (out / "report.txt").write_text(report.table() + "\n")


def qaic_backend(
    gm: fx.GraphModule, example_inputs: Sequence[Any], options: dict[str, Any] | None = None, mode: str | None = None
) -> Any:
    """``torch.compile(backend="qaic", options=...)`` lands here (entry point)."""
    if mode is not None:
        raise ConfigError(f"backend 'qaic' has no modes (got mode={mode!r}); pass options={{...}} instead")
    return QaicBackend(CompilationConfig.from_options(options))(gm, example_inputs)
