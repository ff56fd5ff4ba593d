"""The backend's compile report: per graph, every piece with its kind, why the split put
it there, its key, where its artifact came from and the seconds it took.

``qaic_dynamo.last_compile_report().table()`` prints it; the same table is logged to
``logging.getLogger("qaic_dynamo")`` for every graph, and ``dump_dir`` writes it beside
each piece's code and ONNX.
"""

from __future__ import annotations

import threading
from dataclasses import asdict, dataclass, field
from typing import Any

import torch.fx as fx

from qaic_dynamo.cache import Source
from qaic_dynamo.compiler.partition import PieceKind, SplitReason
from qaic_dynamo.runtime import PieceRunner

__all__ = ["GraphReport", "PieceReport", "compile_reports", "last_compile_report", "new_report"]


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
    # eager (:func:`~qaic_dynamo.compiler.views.peel_view_outputs`): position -> base.
    view_outputs: dict[int, str] = field(default_factory=dict)
    # Why the whole graph runs eagerly instead of being compiled (None: it is compiled).
    eager: str | None = None
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
            + (
                f"; compiled for the values of {len(self.specialized_floats)} dynamic float input(s)"
                if self.specialized_floats
                else ""
            )
            + (f"; RUNS EAGERLY: {self.eager}" if self.eager else "")
            + (
                "; outputs rebuilt as views after it: "
                + ", ".join(f"{i} of {base}" for i, base in self.view_outputs.items())
                if self.view_outputs
                else ""
            ),
            f"{'#':>3} {'piece':<10} {'kind':<10} {'key':<12} {'source':<7} {'seconds':>8}  why",
        ]
        for p in self.pieces:
            why = p.why + (f"; FALLBACK: {p.fallback}" if p.fallback else "")
            why += f"; lowered by the exporter: {p.exporter_fallback}" if p.exporter_fallback else ""
            source = "-" if p.source is None else p.source.value
            lines.append(
                f"{p.index:>3} {p.name:<10} {p.kind.value:<10} {p.key or '-':<12} {source:<7} {p.seconds:>8.3f}  {why}"
            )
        return "\n".join(lines)

    def to_json(self) -> dict[str, Any]:
        pieces = [dict(asdict(p), reused=p.reused, why=p.why) for p in self.pieces]
        return {
            "graph_index": self.graph_index,
            "config_hash": self.config_hash,
            "pieces": pieces,
            "seconds": self.seconds,
            "specialized_floats": self.specialized_floats,
            "view_outputs": self.view_outputs,
            "eager": self.eager,
        }


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


def new_report(config_hash: str) -> GraphReport:
    with _reports_lock:
        report = GraphReport(len(_reports), config_hash[:12])
        _reports.append(report)
        return report
