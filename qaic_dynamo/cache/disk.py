"""The persistent half of the cache stage: artifacts on disk, across processes.

A service restarts far more often than its model changes, so every new artifact is also
stored under the cache root and a later process loads it instead of exporting:

    <root>/v1/<key[:2]>/<key>/   model.onnx, layout.json, fingerprint.json (the readable
                                 hash inputs), meta.json (sizes + sha256 of every file),
                                 and later the qaic-compile output (qpc/)
    <root>/v1/tmp/               entries being written
    <root>/v1/locks/<key>.lock   one compiler per key at a time (removed once free)
    <root>/v1/last_run.json      hit / miss counts of the last process that used the cache

Keys are structural fingerprints, which cover the config hash (every field that changes
an artifact), the library versions, the artifact format and a digest of this package's
code, so a changed config, library or source file simply misses. An entry that is
intact but does not load (e.g. written by an older layout format) is recompiled with a
warning.

No state of the directory may make results wrong:
  * an entry is written into ``tmp/`` and renamed into place in one step; if another
    process got there first, its entry is kept and ours discarded, so concurrent writers
    leave exactly one valid entry and no temporary files;
  * every hit is verified against ``meta.json``; a truncated or corrupted entry is logged
    once, removed and recompiled;
  * per-key locks are ``flock`` locks (filelock), which the kernel drops when a process
    dies, so a killed compiler never blocks the others; they only save duplicate work,
    correctness comes from the atomic rename;
  * a read-only or full cache directory degrades to compiling without the disk cache,
    with one warning, never an exception;
  * the cache is bounded: past ``cache_size_limit`` bytes the least recently used entries
    are evicted (a hit refreshes an entry's use time).
"""

from __future__ import annotations

import atexit
import contextlib
import errno
import fcntl
import hashlib
import json
import logging
import os
import re
import shutil
import threading
import time
import uuid
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["DISK_FULL", "FORMAT", "META", "STALE_TMP_SECONDS", "DiskCache", "EntryInfo", "warn_removed"]

logger = logging.getLogger("qaic_dynamo")

FORMAT = "v1"
META = "meta.json"
#: Temporary entries older than this that no writer lock covers (a trash directory, an
#: older name) are debris of a killed process (see ``DiskCache._sweep_tmp``).
STALE_TMP_SECONDS = 3600
#: A temporary entry's name: ``{key[:12]}-w{writer}-{uuid}``, ``writer`` naming the lock
#: ``locks/writer-{writer}.lock`` its process holds for as long as it lives.
_TMP_NAME = re.compile(r"[0-9a-f]{12}-w(?P<writer>[0-9a-f]{16})-[0-9a-f]{8}")


def _at_exit_of_this_process(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> None:
    """``atexit.register``, but a child forked later and exiting normally does not run it
    (it would remove its parent's lock file or private copy)."""
    pid = os.getpid()
    atexit.register(lambda: os.getpid() == pid and fn(*args, **kwargs))


def _try_flock(path: Path) -> int | None:
    """An open descriptor holding an exclusive flock on ``path``, or None if another
    open file holds one (flock, not a pid: it works across PID namespaces - containers
    sharing a hostname and a cache volume - and a pid can be reused; over NFS it relies on
    the client's lock support, untested here)."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    except BaseException:
        os.close(fd)
        raise
    return fd


@dataclass
class EntryInfo:
    key: str
    path: Path
    size: int
    created: float
    last_used: float


def _read_meta(meta_path: Path) -> dict[str, Any]:
    """An entry's META, checked to have the shape commit() writes; ValueError otherwise."""
    meta = json.loads(meta_path.read_text())
    files = meta.get("files") if isinstance(meta, dict) else None
    if not isinstance(files, dict) or not all(
        isinstance(v, dict) and type(v.get("size")) is int and isinstance(v.get("sha256"), str) for v in files.values()
    ):
        raise ValueError('not {"files": {name: {"size": int, "sha256": str}}, ...}')
    return meta


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


#: errno values of a filesystem that cannot take more data.
DISK_FULL = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS})


def _entry_files(path: Path) -> list[Path]:
    return sorted(p for p in path.rglob("*") if p.is_file() and p.name != META)


def warn_removed(disk: DiskCache, key: str) -> None:
    disk.warn_once(
        f"qaic: cache entry {key[:12]} was removed while it compiled; compiling it again without the persistent cache"
    )


class DiskCache:
    """One cache root. Every failure to write degrades to "no disk cache" with a warning."""

    _warned: set[str] = set()
    _instances: dict[str, DiskCache] = {}
    _instances_lock = threading.Lock()

    def __init__(self, root: str | os.PathLike, size_limit: int) -> None:
        self.root = Path(root).expanduser()
        self.base = self.root / FORMAT
        self.size_limit = size_limit
        self.usable = True
        self.hits = self.misses = self.writes = self.evictions = self.repairs = 0
        self._lock = threading.Lock()
        self._writer: str | None = None  # this process's writer token (see _writer_token)
        self._writer_fd: int | None = None  # the open file holding its lock

    @classmethod
    def get(cls, root: str | os.PathLike, size_limit: int) -> DiskCache:
        """The process-wide handle for a root (counts accumulate per root)."""
        key = str(Path(root).expanduser().resolve())
        with cls._instances_lock:
            cache = cls._instances.get(key)
            if cache is None:
                cache = cls._instances[key] = DiskCache(root, size_limit)
                atexit.register(cache.write_last_run)
            cache.size_limit = size_limit
            return cache

    # -- degradation ------------------------------------------------------------------
    def degrade(self, what: str, error: BaseException) -> None:
        self.usable = False
        msg = (
            f"qaic: the compile cache at {self.root} is not usable ({what}: {error}); "
            "compiling without the persistent cache"
        )
        if msg not in self._warned:
            self._warned.add(msg)
            logger.warning(msg)
            warnings.warn(msg, RuntimeWarning, stacklevel=4)

    def warn_once(self, msg: str) -> None:
        """Log ``msg`` once per process (problems with entries repeat on every lookup)."""
        if msg not in self._warned:
            self._warned.add(msg)
            logger.warning(msg)

    # -- paths ------------------------------------------------------------------------
    def entry_dir(self, key: str) -> Path:
        return self.base / key[:2] / key

    # -- read ------------------------------------------------------------------------
    def lookup(self, key: str) -> Path | None:
        """The verified entry for ``key``, or None. A damaged entry is removed."""
        path = self.entry_dir(key)
        meta_path = path / META
        if not meta_path.exists():
            # commit() writes META before the atomic rename, so an entry directory without
            # it is never a write in progress but a damaged entry (a partial copy, a deleted
            # file); left in place it would block every later commit of this key.
            if not path.exists():
                return None
            problem = f"no {META}"
        else:
            problem = self._verify(path, meta_path)
        if problem is not None:
            self.warn_once(f"qaic: cache entry {key[:12]} is damaged ({problem}); recompiling it")
            self.discard(key)
            self.repairs += 1
            return None
        try:
            os.utime(meta_path)  # last use, for LRU eviction
        except OSError:
            pass  # a read-only cache still serves hits
        return path

    def _verify(self, path: Path, meta_path: Path) -> str | None:
        try:
            meta = _read_meta(meta_path)
        except (OSError, ValueError) as e:
            return f"unreadable {META}: {e}"
        if meta.get("key") != path.name:
            return f"{META} is for key {str(meta.get('key'))[:12]}"
        for name, want in meta["files"].items():
            f = path / name
            try:
                if f.stat().st_size != want["size"]:
                    return f"{name} has {f.stat().st_size} bytes, expected {want['size']}"
                if _sha256(f) != want["sha256"]:
                    return f"{name} fails its checksum"
            except OSError as e:
                return f"{name}: {e}"
        return None

    def discard(self, key: str) -> None:
        """Remove an entry (renamed aside first, so readers never see half of it)."""
        path = self.entry_dir(key)
        try:
            trash = self.base / "tmp" / f"trash-{key[:12]}-{uuid.uuid4().hex[:8]}"
            trash.parent.mkdir(parents=True, exist_ok=True)
            os.rename(path, trash)
            shutil.rmtree(trash, ignore_errors=True)
        except FileNotFoundError:
            pass
        except OSError as e:
            self.degrade("could not remove a damaged entry", e)

    # -- write -----------------------------------------------------------------------
    def new_tmp_dir(self, key: str) -> Path | None:
        """A private directory to lower into, or None if the cache cannot be written."""
        if not self.usable:
            return None
        try:
            tmp = self.base / "tmp"
            tmp.mkdir(parents=True, exist_ok=True)
            self._sweep_tmp(tmp)
            path = tmp / f"{key[:12]}-w{self._writer_token()}-{uuid.uuid4().hex[:8]}"
            path.mkdir()
            return path
        except OSError as e:
            self.degrade("cannot write", e)
            return None

    def commit(self, key: str, tmp: Path) -> tuple[Path, bool]:
        """Move a finished entry into place. Returns the entry that is in place and whether
        it is ours (False: another process's valid entry was kept, or the cache could not
        be written and ``tmp`` stays this process's private copy)."""
        final = self.entry_dir(key)
        try:
            files = {
                str(p.relative_to(tmp)): {"size": p.stat().st_size, "sha256": _sha256(p)} for p in _entry_files(tmp)
            }
            meta = {"key": key, "created": time.time(), "files": files, "format": FORMAT}
            (tmp / META).write_text(json.dumps(meta, indent=1, sort_keys=True))
            with open(tmp / META, "rb+") as f:
                os.fsync(f.fileno())
            final.parent.mkdir(parents=True, exist_ok=True)
            try:
                os.rename(tmp, final)  # atomic; fails if another process got there first
            except OSError:
                if self.lookup(key) is not None:
                    shutil.rmtree(tmp, ignore_errors=True)  # theirs is valid: keep it
                    return final, False
                os.rename(tmp, final)  # theirs was damaged and has been removed

            self.writes += 1
            return final, True
        except OSError as e:
            if not tmp.is_dir():  # removed under us (a cache clear): the caller compiles again
                return tmp, False
            self.degrade("cannot write", e)
            # Still a complete artifact for this process, until it exits (then, or if it is
            # killed, the next sweep, it goes: it kept a full disk full).
            _at_exit_of_this_process(shutil.rmtree, tmp, ignore_errors=True)
            return tmp, False

    @contextlib.contextmanager
    def lock(self, key: str, timeout: float = 600.0) -> Iterator[None]:
        """Hold the compile lock for ``key`` (kernel-released if the holder dies)."""
        from filelock import FileLock, Timeout

        if not self.usable:
            yield
            return
        try:
            lock_dir = self.base / "locks"
            lock_dir.mkdir(parents=True, exist_ok=True)
            lock = FileLock(str(lock_dir / f"{key}.lock"), timeout=timeout)
            lock.acquire()
        except Timeout as e:  # a live holder for too long: compile anyway, the rename is safe
            self.warn_once(f"qaic: waited {timeout:.0f}s for another process compiling {key[:12]}; compiling too")
            logger.debug("lock timeout: %s", e)
            yield
            return
        except OSError as e:
            self.degrade("cannot create locks", e)
            yield
            return
        try:
            yield
        finally:
            lock.release()
            self._remove_lock_file(lock_dir / f"{key}.lock")

    @staticmethod
    def _remove_lock_file(path: Path) -> None:
        """Remove a key's lock file once nobody holds it, so that the cache's file count
        stays bounded with its size. A process that opened the file just before it goes
        then locks an orphan and may compile the key at the same time as another: the
        lock only saves duplicate work (the commit's atomic rename keeps one entry)."""
        try:
            fd = _try_flock(path)
        except OSError:
            return
        if fd is None:  # another process holds it (or waits on it): it will remove it
            return
        try:
            path.unlink()
        except OSError:
            pass
        finally:
            os.close(fd)

    def _writer_token(self) -> str:
        """This process's writer token, whose lock it holds until it exits. Made again if
        its lock file is gone (``qaic-dynamo cache clear``): a lock held on a deleted file
        protects nothing, and another writer's sweep would take the path."""
        with self._lock:
            if self._writer is not None:
                lock = self.base / "locks" / f"writer-{self._writer}.lock"
                try:
                    mine, there = os.fstat(self._writer_fd), os.stat(lock)
                    if (mine.st_dev, mine.st_ino) == (there.st_dev, there.st_ino):
                        return self._writer
                except FileNotFoundError:
                    pass
                os.close(self._writer_fd)
                self._writer = self._writer_fd = None
            token = uuid.uuid4().hex[:16]
            lock = self.base / "locks" / f"writer-{token}.lock"
            lock.parent.mkdir(parents=True, exist_ok=True)
            fd = _try_flock(lock)  # a fresh name: nobody else holds it
            if fd is None:
                raise OSError(f"cannot lock {lock}")
            self._writer, self._writer_fd = token, fd  # held open: released by the kernel at exit
            _at_exit_of_this_process(lock.unlink, missing_ok=True)  # after the private copies' removal
            return self._writer

    def _sweep_tmp(self, tmp: Path) -> None:
        """Remove what writers that are gone left in ``tmp``: an entry whose writer lock
        nobody holds (its process exited or was killed) at once, never one whose writer
        lives (a qaic-compile can run for hours without touching the directory's own
        mtime, and a degraded commit's private copy serves its process until exit);
        anything else (a trash directory, an older name) once ``STALE_TMP_SECONDS`` old."""
        now = time.time()
        self._sweep_writer_locks(tmp, now)
        for p in tmp.iterdir():
            try:
                m = _TMP_NAME.fullmatch(p.name)
                if m is None:
                    if now - p.stat().st_mtime > STALE_TMP_SECONDS:
                        shutil.rmtree(p, ignore_errors=True)
                    continue
                lock = self.base / "locks" / f"writer-{m['writer']}.lock"
                fd = _try_flock(lock)
                if fd is None:  # its writer lives
                    continue
                try:
                    shutil.rmtree(p, ignore_errors=True)
                    lock.unlink(missing_ok=True)
                finally:
                    os.close(fd)
            except OSError:
                pass

    def _sweep_writer_locks(self, tmp: Path, now: float) -> None:
        """Remove the lock files of writers that are gone and left no entry (a process
        killed or stopped by a signal runs no exit handler). Only once ``STALE_TMP_SECONDS``
        old: a new writer creates its file a moment before it locks it."""
        locks = self.base / "locks"
        if not locks.is_dir():
            return
        with_entries = {m["writer"] for p in tmp.iterdir() if (m := _TMP_NAME.fullmatch(p.name))}
        for lock in locks.glob("writer-*.lock"):
            try:
                if (
                    lock.name[len("writer-") : -len(".lock")] in with_entries
                    or now - lock.stat().st_mtime <= STALE_TMP_SECONDS
                ):
                    continue
                fd = _try_flock(lock)
                if fd is not None:
                    try:
                        lock.unlink(missing_ok=True)
                    finally:
                        os.close(fd)
            except OSError:
                pass

    # -- inventory, eviction ------------------------------------------------------------
    def entries(self) -> list[EntryInfo]:
        out = []
        if not self.base.exists():
            return out
        for meta_path in self.base.glob(f"??/*/{META}"):
            path = meta_path.parent
            try:
                meta = _read_meta(meta_path)
                size = sum(v["size"] for v in meta["files"].values()) + meta_path.stat().st_size
                out.append(EntryInfo(path.name, path, size, float(meta.get("created", 0)), meta_path.stat().st_mtime))
            except (OSError, ValueError, TypeError):
                out.append(EntryInfo(path.name, path, 0, 0.0, 0.0))
        return out

    def size(self) -> int:
        return sum(e.size for e in self.entries())

    def evict(self, keep: str | None = None) -> int:
        """Remove least recently used entries until the cache fits its size limit
        (never ``keep``, the entry just written)."""
        entries = sorted(self.entries(), key=lambda e: e.last_used)
        total = sum(e.size for e in entries)
        removed = 0
        for e in entries:
            if total <= self.size_limit:
                break
            if e.key == keep:
                continue
            self.discard(e.key)
            total -= e.size
            removed += 1
        self.evictions += removed
        return removed

    def clear(self) -> int:
        n = len(self.entries())
        shutil.rmtree(self.base, ignore_errors=True)
        return n

    # -- the last run's counts -----------------------------------------------------------
    def write_last_run(self) -> None:
        if not (self.hits or self.misses or self.writes) or not self.usable:
            return
        tmp = self.base / f".last_run.{os.getpid()}.json"
        try:
            self.base.mkdir(parents=True, exist_ok=True)
            data = {
                "pid": os.getpid(),
                "time": time.time(),
                "hits": self.hits,
                "misses": self.misses,
                "writes": self.writes,
                "evictions": self.evictions,
                "repairs": self.repairs,
            }
            tmp.write_text(json.dumps(data, indent=1))
            os.replace(tmp, self.base / "last_run.json")
        except OSError:
            with contextlib.suppress(OSError):  # a partial file on a full disk: one per process
                tmp.unlink(missing_ok=True)

    def last_run(self) -> dict[str, Any] | None:
        try:
            return json.loads((self.base / "last_run.json").read_text())
        except (OSError, ValueError):
            return None
