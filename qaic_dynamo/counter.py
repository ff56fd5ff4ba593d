"""Process-wide compilation counters, for tests that read like specs.

    with compilation_counter.expect(
        num_graphs_seen=1,
        num_piecewise_graphs_seen=2 * L + 1,         # L attention splits
        num_piecewise_compilable_graphs_seen=L + 1,
        num_backend_compilations=3,                  # first, middle, last
    ):
        compiled(x)

``expect`` checks the *change* of each named counter over the block; counters it does not
name may change freely.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass

__all__ = ["CompilationCounter", "compilation_counter"]


@dataclass
class CompilationCounter:
    #: Dynamo graphs handed to the backend.
    num_graphs_seen: int = 0
    #: Pieces after splitting, splitting pieces included.
    num_piecewise_graphs_seen: int = 0
    #: Pieces that are compiled (not splitting ops).
    num_piecewise_compilable_graphs_seen: int = 0
    #: Unique pieces lowered and compiled (a fingerprint seen for the first time).
    num_backend_compilations: int = 0
    #: Pieces served by an artifact compiled earlier in this process.
    num_piece_reuses: int = 0
    #: Calls to the ONNX exporter.
    num_onnx_exports: int = 0
    #: ONNX Runtime sessions created.
    num_runtime_sessions: int = 0
    #: Pieces that run eagerly because they could not be lowered or run.
    num_eager_fallbacks: int = 0
    #: Unique pieces loaded from the persistent cache instead of being lowered.
    num_disk_cache_hits: int = 0
    #: Unique pieces written to the persistent cache.
    num_disk_cache_writes: int = 0

    def snapshot(self) -> CompilationCounter:
        return dataclasses.replace(self)

    def reset(self) -> None:
        for f in dataclasses.fields(self):
            setattr(self, f.name, 0)

    @contextlib.contextmanager
    def expect(self, **deltas: int) -> Iterator[None]:
        unknown = sorted(set(deltas) - {f.name for f in dataclasses.fields(self)})
        if unknown:
            raise TypeError(
                f"expect(): unknown counter(s) {unknown}; counters are "
                f"{[f.name for f in dataclasses.fields(self)]}"
            )
        before = self.snapshot()
        yield
        wrong = {
            name: (getattr(self, name) - getattr(before, name), want)
            for name, want in deltas.items()
            if getattr(self, name) - getattr(before, name) != want
        }
        if wrong:
            lines = [f"  {name}: changed by {got}, expected {want}" for name, (got, want) in wrong.items()]
            raise AssertionError("compilation counters differ:\n" + "\n".join(lines))


compilation_counter = CompilationCounter()
