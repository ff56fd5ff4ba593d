"""Python's cyclic garbage collector paused while a graph compiles.

The backend allocates hundreds of thousands of short-lived objects (split graphs, fake
tensors, sympy expressions, ONNX IR), and each allocation burst triggers collections
whose oldest generation re-scans every object alive in the process - at depth, Dynamo's
whole traced graph and its fake tensors. Paused, the compile pays for none of them;
cycles made meanwhile are collected once the collector runs again (docs/benchmarks.md
has the measurements).
"""

from __future__ import annotations

import gc
from typing import Any

from qaic_dynamo.process_wide import ProcessWide

__all__ = ["collector_paused"]


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

    Not ``gc.freeze``: a server that froze its start-up heap (vLLM does) would have it
    unfrozen after. Process-wide, like the collector; nested and concurrent compiles
    restore it once, at the last exit. Regions pause it for Dynamo's trace too.
    """
    return _collector.held()
