"""Eager fallbacks: counted, and warned once per distinct reason.

Every stage that gives a piece up to eager PyTorch (the backend for a piece that cannot be
lowered, the runner for one that fails at run time, the regions for a block past Dynamo's
recompile limit) reports it here, so ``compilation_counter.num_eager_fallbacks`` counts
them all and a user sees each reason once.
"""

from __future__ import annotations

import logging
import threading
import warnings

from qaic_dynamo.counter import compilation_counter

__all__ = ["warn_fallback"]

logger = logging.getLogger("qaic_dynamo")

_warned: set[str] = set()
_warned_lock = threading.Lock()


def warn_fallback(what: str, reason: str) -> None:
    """Count an eager fallback and warn once per distinct reason."""
    compilation_counter.bump(num_eager_fallbacks=1)
    with _warned_lock:
        if reason in _warned:
            return
        _warned.add(reason)
    msg = f"qaic: {what} runs eagerly: {reason}"
    logger.warning(msg)
    warnings.warn(msg, RuntimeWarning, stacklevel=3)
