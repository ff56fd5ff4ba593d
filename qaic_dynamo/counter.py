"""Process-wide compilation counters, for tests that read like specs.

    with compilation_counter.expect(
        num_graphs_seen=1,
        num_piecewise_graphs_seen=2 * L + 1,         # L attention splits
        num_piecewise_compilable_graphs_seen=L + 1,
        num_backend_compilations=3,                  # first, middle, last
    ):
        compiled(x)

``expect`` checks the *change* of each named counter over the block; counters it does not
name may change freely. The pipeline changes counters only through :meth:`bump`, which
holds a lock, so two threads compiling or running at once lose no update.

Words, used the same way everywhere: a *piece* is any submodule of a split graph; a
*splitting* piece holds splitting ops and runs eagerly; every other piece is
*compilable*; a compilable piece is *compiled* when this process lowers it (a new
fingerprint), *reused* when an artifact already loaded serves it, and *loaded from disk*
when the persistent cache does.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field

__all__ = ["CompilationCounter", "compilation_counter"]


@dataclass
class CompilationCounter:
    #: Dynamo graphs handed to the backend.
    num_graphs_seen: int = 0
    #: Pieces after splitting, splitting pieces included.
    num_piecewise_graphs_seen: int = 0
    #: Compilable pieces (everything but splitting pieces).
    num_piecewise_compilable_graphs_seen: int = 0
    #: Compilable pieces lowered by this process (a fingerprint seen for the first time).
    num_backend_compilations: int = 0
    #: Compilable pieces served by an artifact already loaded in this process.
    num_piece_reuses: int = 0
    #: Pieces lowered to ONNX (by either path).
    num_onnx_exports: int = 0
    #: Pieces the direct lowering could not translate, lowered by torch.onnx's exporter.
    num_exporter_fallbacks: int = 0
    #: ONNX Runtime sessions created.
    num_runtime_sessions: int = 0
    #: Compilable pieces that run eagerly because they could not be lowered or run.
    num_eager_fallbacks: int = 0
    #: Compilable pieces loaded from the persistent cache instead of being lowered.
    num_disk_cache_hits: int = 0
    #: Artifacts written to the persistent cache.
    num_disk_cache_writes: int = 0
    #: Calls of a regional block that ran Dynamo's compiled code after its guards passed,
    #: without entering through torch.compile's wrapper (region_dispatch="guarded").
    num_guarded_region_calls: int = 0
    #: Calls of a region that entered through torch.compile's wrapper.
    num_dynamo_region_calls: int = 0
    #: Regions whose saved Dynamo trace was loaded instead of traced (precompile).
    num_precompiled_loads: int = 0
    #: Regions traced with Dynamo's aot_compile so their trace can be saved.
    num_precompiled_traces: int = 0
    #: Saved traces written to the persistent cache (on a worker thread).
    num_precompiled_saves: int = 0
    #: Saved traces found stale (a source file, a dropped guard changed) and discarded.
    num_precompiled_discards: int = 0
    #: Calls of a piece that ran eagerly because its inputs fell outside the domain its
    #: translation is exact on (an ``eager_unless`` output was False), that call only.
    num_eager_unless_calls: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def counts(self) -> dict[str, int]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if not f.name.startswith("_")}

    def bump(self, **deltas: int) -> None:
        """Add ``deltas`` to the named counters, atomically."""
        with self._lock:
            for name, n in deltas.items():
                setattr(self, name, getattr(self, name) + n)

    def snapshot(self) -> CompilationCounter:
        with self._lock:
            return CompilationCounter(**self.counts())

    def reset(self) -> None:
        with self._lock:
            for name in self.counts():
                setattr(self, name, 0)

    @contextlib.contextmanager
    def expect(self, **deltas: int) -> Iterator[None]:
        unknown = sorted(set(deltas) - set(self.counts()))
        if unknown:
            raise TypeError(f"expect(): unknown counter(s) {unknown}; counters are {list(self.counts())}")
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
