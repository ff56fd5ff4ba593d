"""A process-wide change held while any user needs it, however threads and nesting overlap.

The backend pauses Python's garbage collector while a graph compiles, and the lowering
patches one onnx_ir function while it translates. Both changes are global, and compiles
may run on several threads and nest (a region compiling inside another's call): a change
made and undone per user would be undone under another user still inside.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import Any

__all__ = ["ProcessWide"]


class ProcessWide:
    """A process-wide change held while any user is inside :meth:`held`: ``apply()`` runs
    at the first entry and ``restore(token)`` - with what ``apply`` returned - at the last
    exit."""

    def __init__(self, apply: Callable[[], Any], restore: Callable[[Any], None]) -> None:
        self._apply, self._restore = apply, restore
        self._lock = threading.Lock()
        self._depth = 0
        self._token: Any = None

    @contextlib.contextmanager
    def held(self) -> Iterator[None]:
        with self._lock:
            if self._depth == 0:
                self._token = self._apply()
            self._depth += 1
        try:
            yield
        finally:
            with self._lock:
                self._depth -= 1
                if self._depth == 0:
                    self._restore(self._token)
                    self._token = None
