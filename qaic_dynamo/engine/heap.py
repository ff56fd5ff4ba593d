"""The start-up heap frozen out of Python's cyclic garbage collector, once per process.

A process that has imported torch, Dynamo, transformers and onnxscript holds hundreds of
thousands of objects the collector tracks, and every full collection re-scans all of
them. Compiling a model creates enough long-lived objects to trigger such collections,
and a server's steps trigger one now and then: each is a pause of a large share of a
first call, or of many decode steps (docs/benchmarks.md, cold start). Those objects live
as long as the process, so scanning them finds nothing. vLLM freezes its start-up heap
(``gc.freeze``) for the same reason; the engine does it when the first ``LLM`` is made,
before it builds anything of its own: an engine's caches frozen with the rest and later
dropped in a reference cycle would never be freed.

Unlike vLLM it does not run a full collection first: that costs as much as the pause it
saves. It collects the young generations (cheap), and whatever garbage already sits in
the oldest one stays uncollected for the life of the process (docs/usage.md says how
much that was in the demo). ``LLM(..., freeze_gc_heap=False)`` leaves the collector alone.
"""

from __future__ import annotations

import gc
import threading

__all__ = ["freeze_startup_heap", "startup_heap_frozen"]

_lock = threading.Lock()
_frozen = False


def freeze_startup_heap() -> bool:
    """Freeze every object the collector tracks now (once per process); True if this
    call did. Objects made afterwards are collected as before."""
    global _frozen
    with _lock:
        if _frozen:
            return False
        # Young garbage is collected first, so it is not made permanent with the rest.
        gc.collect(1)
        gc.freeze()
        _frozen = True
        return True


def startup_heap_frozen() -> bool:
    """Whether :func:`freeze_startup_heap` has frozen this process's heap."""
    return _frozen
