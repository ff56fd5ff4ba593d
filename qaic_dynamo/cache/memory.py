"""The in-process half of the cache stage, and the get-or-compile of a piece.

:class:`CompileCache` owns the whole get-or-compile of a piece: memory, then disk
(:mod:`.disk`), then compiling under the key's lock, then commit and eviction, with its
statistics; the backend only asks it for a key and says how to compile one. It never
imports the lowering: whatever it is given raises a ``CompileError`` when a piece cannot
be compiled.

A memory hit returns the loaded artifact (its ONNX Runtime session included): no export,
no new session. Sessions are keyed by their options too (``num_threads``), so a second
config gets a session of its own from the same artifact. Pieces that failed to compile
are remembered too, so 32 identical failing pieces try the exporter once.
"""

from __future__ import annotations

import atexit
import contextlib
import enum
import hashlib
import json
import logging
import shutil
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from qaic_dynamo.artifact import Artifact, load
from qaic_dynamo.cache.disk import DISK_FULL, DiskCache, warn_removed
from qaic_dynamo.counter import compilation_counter
from qaic_dynamo.errors import ArtifactError, CompileError

__all__ = ["MAX_ASSUMPTION_CHAIN", "CacheResult", "CompileCache", "Source", "artifact_cache"]

logger = logging.getLogger("qaic_dynamo")

#: How many artifacts of one piece, lowered under different size guards, a call site
#: tries before it runs eagerly (each compile whose guards differ can add one).
MAX_ASSUMPTION_CHAIN = 8


class Source(enum.StrEnum):
    """Where a compilable piece's artifact came from."""

    #: Lowered (and compiled) by this call: a fingerprint new to this process and disk.
    LOWERED = "lowered"
    #: An artifact this process already holds (reused; no lowering).
    MEMORY = "memory"
    #: Loaded from the persistent cache (no lowering).
    DISK = "disk"
    #: It cannot be lowered: just now, or an identical piece failed before (``cached``).
    FAILED = "failed"


@dataclass
class CacheResult:
    """What :meth:`CompileCache.get_or_compile` found or made for one piece."""

    source: Source
    artifact: Artifact | None = None
    #: FAILED: why the piece cannot be lowered, and whether that was known before this call.
    failure: str | None = None
    failure_cached: bool = False
    #: FAILED just now: the exception, for ``fallback="error"`` to chain.
    error: BaseException | None = None
    #: Lowering (export, checks, qaic-compile) and session creation, in this call.
    compile_seconds: float = 0.0
    load_seconds: float = 0.0
    #: The key the artifact is stored under: the one asked for, or a later key of its
    #: chain when an artifact's size assumptions did not hold (see ``get_or_compile``).
    key: str = ""


class CompileCache:
    """The cache stage: get an artifact by key, compiling it only when no layer has it.

    Lookup order: a session already loaded with these session options; an artifact
    directory this process already holds (new session); the persistent cache; and only
    then lowering, under the key's lock (another process may be lowering the same key,
    and we take its entry when it commits). A lowered entry is committed atomically and
    the disk cache is then trimmed to its size limit. Failures are remembered per key, so
    32 identical failing pieces try the exporter once; whether a failure is an error or
    an eager fallback is the caller's policy, not the cache's.

    A key names a piece's structure, not the size guards of the compile it came from, and
    an artifact whose lowering branched on a dynamic size is right only under guards that
    imply that branch (``PieceLayout.size_assumptions``). The caller says which of an
    artifact's assumptions its call site breaks (``unmet``); such an artifact is passed
    over for the next key of its chain - the key and those assumptions hashed - where an
    artifact lowered under guards like the caller's is found or compiled. Inductor's FX
    graph cache does the same with the guards it stores beside each graph.
    """

    def __init__(self) -> None:
        self._sessions: dict[tuple[str, int], Artifact] = {}
        self._paths: dict[str, Path] = {}
        self._failed: dict[str, str] = {}
        self._lock = threading.Lock()
        self._scratch: Path | None = None

    def get_or_compile(
        self,
        key: str,
        compile_into: Callable[[Path], None],
        *,
        disk: DiskCache | None,
        num_threads: int,
        describe: dict[str, Any] | None = None,
        unmet: Callable[[Artifact], list[str]] | None = None,
    ) -> CacheResult:
        """The artifact for ``key``.

        ``compile_into(dir)`` writes a new artifact into ``dir``; it raises a CompileError
        (LoweringError, QaicCompileError) when the piece cannot be compiled.
        ``describe`` (the fingerprint's inputs) is written beside the artifact.
        ``unmet(artifact)``: the artifact's size assumptions the caller's call site does
        not imply; an artifact with any is passed over for the next key of its chain.
        """
        chain: list[str] = []
        for _ in range(MAX_ASSUMPTION_CHAIN):
            if chain:
                describe = {**(describe or {}), "assumption_chain": list(chain)}
            result = self._get_or_compile_key(key, compile_into, disk=disk, num_threads=num_threads, describe=describe)
            result.key = key
            broken = unmet(result.artifact) if result.artifact is not None and unmet is not None else []
            if not broken:
                return result
            logger.info(
                "qaic: artifact %s assumes %s, which this call site's guards do not imply; looking further",
                key[:12],
                broken,
            )
            chain.append(key)
            key = hashlib.sha256(json.dumps([key, result.artifact.layout.size_assumptions]).encode()).hexdigest()
        failure = (
            f"{MAX_ASSUMPTION_CHAIN} artifacts of this piece each assume sizes this call site's guards do not "
            f"imply (keys {[k[:12] for k in chain]})"
        )
        return CacheResult(Source.FAILED, failure=failure, key=key)

    def lookup(self, key: str, *, disk: DiskCache | None, num_threads: int) -> Artifact | None:
        """The artifact for ``key`` if this process or the disk has it, else None; never
        compiles (a saved graph rebuilt on load knows its pieces' keys, not how to lower them)."""
        with self._lock:
            artifact = self._sessions.get((key, num_threads))
            known = self._paths.get(key)
        if artifact is not None:
            return artifact
        if known is not None:
            try:
                artifact = load(known, num_threads)
            except ArtifactError:
                with self._lock:
                    self._paths.pop(key, None)
            else:
                self._remember(key, artifact)
                return artifact
        result = self._from_disk(disk, key, num_threads) if disk is not None else None
        return result.artifact if result is not None else None

    def _get_or_compile_key(
        self,
        key: str,
        compile_into: Callable[[Path], None],
        *,
        disk: DiskCache | None,
        num_threads: int,
        describe: dict[str, Any] | None,
    ) -> CacheResult:
        with self._lock:
            artifact = self._sessions.get((key, num_threads))
            known = self._paths.get(key)
            failure = self._failed.get(key)
        if artifact is not None:
            return CacheResult(Source.MEMORY, artifact)
        if failure is not None:
            return CacheResult(Source.FAILED, failure=failure, failure_cached=True)
        if known is not None:  # compiled here with other session options: a new session
            t0 = time.perf_counter()
            try:
                artifact = load(known, num_threads)
            except ArtifactError:  # evicted or swept since: find it on disk or compile again
                with self._lock:
                    self._paths.pop(key, None)
            else:
                self._remember(key, artifact)
                return CacheResult(Source.MEMORY, artifact, load_seconds=time.perf_counter() - t0)
        if disk is not None:
            result = self._from_disk(disk, key, num_threads)
            if result is not None:
                return result
        # One process lowers a key at a time; the others wait, then load its entry.
        with disk.lock(key) if disk is not None else contextlib.nullcontext():
            if disk is not None:
                result = self._from_disk(disk, key, num_threads)
                if result is not None:
                    return result
                disk.misses += 1
            return self._compile(key, compile_into, disk, num_threads, describe)

    def _compile(
        self,
        key: str,
        compile_into: Callable[[Path], None],
        disk: DiskCache | None,
        num_threads: int,
        describe: dict[str, Any] | None,
    ) -> CacheResult:
        t0 = time.perf_counter()
        tmp = disk.new_tmp_dir(key) if disk is not None else None
        try:
            out_dir = tmp if tmp is not None else self._new_scratch_dir(key)
        except OSError as e:
            if e.errno not in DISK_FULL:
                raise
            return self._no_room(e, t0)

        def drop() -> None:
            # A committed entry may already serve another process: rename it aside like
            # any damaged entry instead of deleting files under a reader.
            if tmp is not None and out_dir != tmp:
                disk.discard(key)
            else:
                shutil.rmtree(out_dir, ignore_errors=True)

        try:
            if describe is not None:
                (out_dir / "fingerprint.json").write_text(json.dumps(describe, indent=1, sort_keys=True))
            compile_into(out_dir)
            compile_s = time.perf_counter() - t0
            if tmp is not None:
                out_dir, written = disk.commit(key, tmp)
                if written:
                    compilation_counter.bump(num_disk_cache_writes=1)
            t1 = time.perf_counter()
            artifact = load(out_dir, num_threads)  # the session holds the model from here on
            load_s = time.perf_counter() - t1
        except (CompileError, ArtifactError) as e:
            if isinstance(e, ArtifactError) and tmp is not None and not out_dir.is_dir():
                # The entry vanished between writing and loading it (``qaic-dynamo cache
                # clear``, another process's eviction or tmp/ sweep): nothing is wrong with
                # the piece, so compile it again into this process's scratch space.
                warn_removed(disk, key)
                return self._compile(key, compile_into, None, num_threads, describe)
            drop()
            with self._lock:
                self._failed[key] = str(e)
            return CacheResult(Source.FAILED, failure=str(e), error=e, compile_seconds=time.perf_counter() - t0)
        except OSError as e:
            vanished = tmp is not None and not tmp.is_dir()  # removed under the lowering (a cache clear)
            drop()
            # Writing the entry into the cache's tmp/ failed (a full disk reports ENOSPC
            # from write(), with no file name): compile again without the disk cache.
            # Any other OSError (a compiler subprocess's, say) is the compile's own.
            in_tmp = e.filename is not None and str(e.filename).startswith(str(tmp))
            if tmp is None and e.errno in DISK_FULL:
                # Not even the process's scratch space takes the artifact (it is on the
                # same full disk, as a rule): the piece cannot be lowered here at all.
                return self._no_room(e, t0)
            if tmp is None or not (in_tmp or (e.filename is None and e.errno in DISK_FULL)):
                raise
            if vanished:  # nothing wrong with the disk: only this piece skips it
                warn_removed(disk, key)
            else:
                disk.degrade("cannot write", e)
            return self._compile(key, compile_into, None, num_threads, describe)
        except BaseException:
            drop()
            raise
        compilation_counter.bump(num_backend_compilations=1)
        self._remember(key, artifact)
        if disk is not None:
            disk.evict(keep=key)
        return CacheResult(Source.LOWERED, artifact, compile_seconds=compile_s, load_seconds=load_s)

    @staticmethod
    def _no_room(e: OSError, t0: float) -> CacheResult:
        """A piece whose artifact no directory can hold: failed, with the reason (the
        backend then runs it eagerly, or raises under ``fallback='error'``). Not
        remembered as a failure: the next identical piece tries again, space may be free
        by then."""
        failure = (
            f"no room to write its artifact, in the disk cache or in scratch space ({e}); "
            "free some disk space, or set TMPDIR to a disk that has some"
        )
        return CacheResult(Source.FAILED, failure=failure, error=e, compile_seconds=time.perf_counter() - t0)

    def _from_disk(self, disk: DiskCache, key: str, num_threads: int) -> CacheResult | None:
        path = disk.lookup(key)
        if path is None:
            return None
        t0 = time.perf_counter()
        try:
            artifact = load(path, num_threads)
        except ArtifactError as e:  # verified bytes that do not load (e.g. an older format)
            disk.warn_once(f"qaic: cache entry {key[:12]} does not load ({e}); recompiling it")
            disk.discard(key)
            disk.repairs += 1
            return None
        disk.hits += 1
        compilation_counter.bump(num_disk_cache_hits=1)
        self._remember(key, artifact)
        return CacheResult(Source.DISK, artifact, load_seconds=time.perf_counter() - t0)

    def _remember(self, key: str, artifact: Artifact) -> None:
        with self._lock:
            self._sessions[(key, artifact.num_threads)] = artifact
            self._paths[key] = artifact.path

    def failure(self, key: str) -> str | None:
        with self._lock:
            return self._failed.get(key)

    def forget(self, keys: Iterable[str]) -> None:
        """Drop the artifacts and failures of ``keys`` from memory, and the scratch
        directories of those not in the persistent cache: keys only one graph can ever
        look up (the backend's for code the key cannot cover, never on disk), once that
        graph is gone."""
        keys = set(keys)
        with self._lock:
            for k in [k for k in self._sessions if k[0] in keys]:
                del self._sessions[k]
            paths = [self._paths.pop(k) for k in keys if k in self._paths]
            for k in keys:
                self._failed.pop(k, None)
            scratch = self._scratch
        for path in paths:
            if scratch is not None and path.parent == scratch:
                shutil.rmtree(path, ignore_errors=True)

    def clear_memory(self) -> None:
        """Forget every loaded artifact and failure (the persistent cache is kept)."""
        with self._lock:
            self._sessions.clear()
            self._paths.clear()
            self._failed.clear()

    def __len__(self) -> int:
        with self._lock:
            return len(self._paths)

    def _new_scratch_dir(self, key: str) -> Path:
        """Process scratch space for an artifact when the disk cache is off."""
        with self._lock:
            if self._scratch is None:
                self._scratch = Path(tempfile.mkdtemp(prefix="qaic_dynamo-"))
                atexit.register(shutil.rmtree, self._scratch, ignore_errors=True)
            path = self._scratch / f"{key}-{uuid.uuid4().hex[:8]}"
        path.mkdir(parents=True)
        return path


artifact_cache = CompileCache()
"""The process's cache stage (one per process: artifacts are shared by every compile)."""
