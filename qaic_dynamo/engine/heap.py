"""The start-up heap frozen out of Python's cyclic garbage collector, once per process.

A process that has imported torch, Dynamo, transformers and onnxscript holds hundreds of
thousands of objects the collector tracks, and every full collection re-scans all of
them. Compiling a model creates enough long-lived objects to trigger such collections,
and a server's steps trigger one now and then: each is a pause of a large share of a
first call, or of many decode steps (docs/benchmarks.md, cold start). Those objects live
as long as the process, so scanning them finds nothing. vLLM freezes its start-up heap
(``gc.freeze``) for the same reason, after a full collection, and so does the engine when
the first ``LLM`` is made.

The full collection comes first so that garbage already waiting - a dropped model in a
reference cycle, say - is freed rather than frozen for the life of the process. The
freeze comes before the engine builds anything of its own: an engine's caches frozen
with the rest and later dropped in a reference cycle would never be freed.
``LLM(..., freeze_gc_heap=False)`` leaves the collector alone.
"""

from __future__ import annotations

import gc
import threading
import time

__all__ = ["freeze_startup_heap", "startup_heap_frozen"]

_lock = threading.Lock()
_frozen = False


def freeze_startup_heap() -> float | None:
    """Collect, then freeze every object the collector tracks (once per process); the
    seconds this took, or None if the heap was frozen already. Objects made afterwards
    are collected as before."""
    global _frozen
    with _lock:
        if _frozen:
            return None
        start = time.perf_counter()
        gc.collect()
        gc.freeze()
        _frozen = True
        return time.perf_counter() - start


def startup_heap_frozen() -> bool:
    """Whether :func:`freeze_startup_heap` has frozen this process's heap."""
    return _frozen
