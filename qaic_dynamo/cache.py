"""Artifacts by fingerprint: compile each unique piece once per process.

A lookup that hits returns the loaded artifact (the ONNX Runtime session included): no
export, no new session. A miss hands the caller a fresh artifact directory to lower into.
Keys are structural fingerprints, which already cover the config hash and library
versions, so an entry can never be served to a piece that computes something else.

Pieces that failed to lower are remembered too, so a model with 32 identical failing
pieces tries the exporter once, not 32 times.
"""

from __future__ import annotations

import atexit
import shutil
import tempfile
import threading
from pathlib import Path
from typing import Any

__all__ = ["ArtifactCache", "artifact_cache"]


class ArtifactCache:
    def __init__(self) -> None:
        self._loaded: dict[str, Any] = {}
        self._failed: dict[str, str] = {}
        self._lock = threading.Lock()
        self._scratch: Path | None = None

    # -- memory ----------------------------------------------------------------------
    def lookup(self, key: str) -> Any | None:
        with self._lock:
            return self._loaded.get(key)

    def failure(self, key: str) -> str | None:
        with self._lock:
            return self._failed.get(key)

    def store(self, key: str, artifact: Any) -> None:
        with self._lock:
            self._loaded[key] = artifact

    def store_failure(self, key: str, reason: str) -> None:
        with self._lock:
            self._failed[key] = reason

    def clear_memory(self) -> None:
        with self._lock:
            self._loaded.clear()
            self._failed.clear()

    def __len__(self) -> int:
        return len(self._loaded)

    # -- where new artifacts are written -----------------------------------------------
    def new_artifact_dir(self, key: str) -> Path:
        """A directory for the artifact of ``key`` (process scratch space for now)."""
        with self._lock:
            if self._scratch is None:
                self._scratch = Path(tempfile.mkdtemp(prefix="qaic_dynamo-"))
                atexit.register(shutil.rmtree, self._scratch, ignore_errors=True)
            path = self._scratch / key
        path.mkdir(parents=True, exist_ok=True)
        return path


artifact_cache = ArtifactCache()
