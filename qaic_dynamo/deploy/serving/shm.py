"""Named tensors in POSIX shared memory: the decode KV buffers both workers map.

Python's resource tracker (one per server, shared by the workers it spawns) keeps a *set*
of segment names: a REGISTER of a name already there does nothing and one UNREGISTER
removes it, and any name left at its shutdown is reported as leaked. Before Python 3.13,
``SharedMemory(name, create=False)`` registers too: when a SIGKILLed server's two workers
both opened a segment to unlink it, the second one's REGISTER could land after the
first one's UNREGISTER, and its own unlink then failed before unregistering - the tracker
reported a segment that was gone as leaked. So only the creator registers
(``SharedMemory(create=True)``); other processes map the segment's file under ``/dev/shm``
directly, and whichever process's unlink succeeds - exactly one - sends the one
UNREGISTER.
"""

from __future__ import annotations

import math
import mmap
import os
import secrets
from multiprocessing import resource_tracker, shared_memory
from pathlib import Path
from typing import Any

import torch

__all__ = ["SHM_PREFIX", "SharedKVBuffers"]

SHM_PREFIX = "qaic_kv_"
#: Where Linux keeps POSIX shared-memory objects, as files.
SHM_DIR = Path("/dev/shm")


class _Attached:
    """A segment another process created, mapped from its file under ``/dev/shm`` without
    telling the resource tracker (see the module docstring)."""

    def __init__(self, name: str, nbytes: int) -> None:
        if not SHM_DIR.is_dir():
            raise OSError(
                f"attaching shared memory needs Linux's {SHM_DIR} (not found): run the disaggregated server on Linux"
            )
        self.name = name
        with open(SHM_DIR / name, "r+b") as f:  # FileNotFoundError: the creator has unlinked it
            self._mmap = mmap.mmap(f.fileno(), nbytes)
        self.buf: memoryview | None = memoryview(self._mmap)

    def close(self) -> None:
        if self.buf is not None:
            self.buf.release()  # BufferError while a tensor still views it
            self.buf = None
        self._mmap.close()


class SharedKVBuffers:
    """Named tensors in POSIX shared memory (one segment each), attachable by another
    process from :attr:`descriptor`. The creator unlinks them (:meth:`unlink`)."""

    def __init__(self, shapes: dict[str, tuple[int, ...]], dtype: torch.dtype, *, _attach: dict | None = None) -> None:
        self.dtype = dtype
        self._segments: dict[str, shared_memory.SharedMemory | _Attached] = {}
        self.tensors: dict[str, torch.Tensor] = {}
        self.owner = _attach is None
        tag = secrets.token_hex(4)
        try:
            for k, (name, shape) in enumerate(shapes.items()):
                nbytes = max(1, math.prod(shape) * torch.empty((), dtype=dtype).element_size())
                if _attach is None:
                    seg = shared_memory.SharedMemory(
                        create=True, size=nbytes, name=f"{SHM_PREFIX}{os.getpid()}_{tag}_{k}"
                    )
                else:
                    seg = _Attached(_attach[name], nbytes)
                self._segments[name] = seg
                t = torch.frombuffer(seg.buf, dtype=dtype, count=math.prod(shape)).view(shape)
                if _attach is None:
                    t.zero_()
                self.tensors[name] = t
        except BaseException:
            self.close()
            if self.owner:
                self.unlink()
            raise

    @property
    def descriptor(self) -> dict[str, Any]:
        """What another process needs to attach (picklable)."""
        return {
            "shapes": {n: tuple(t.shape) for n, t in self.tensors.items()},
            "dtype": str(self.dtype).split(".")[-1],
            "segments": {n: s.name for n, s in self._segments.items()},
        }

    @classmethod
    def attach(cls, descriptor: dict[str, Any]) -> SharedKVBuffers:
        return cls(descriptor["shapes"], getattr(torch, descriptor["dtype"]), _attach=descriptor["segments"])

    @property
    def segment_names(self) -> list[str]:
        return [s.name for s in self._segments.values()]

    def close(self) -> None:
        self.tensors.clear()  # the tensors hold the mapping open
        for seg in self._segments.values():
            try:
                seg.close()
            except BufferError:  # a view still alive elsewhere: the OS unmaps at exit
                pass

    @staticmethod
    def unlink_names(descriptor: dict[str, Any]) -> None:
        """Unlink the segments of ``descriptor`` (a worker whose server died does it); each
        one this call unlinks is unregistered from the tracker, one already gone is not."""
        for name in descriptor["segments"].values():
            _unlink(name)

    def unlink(self) -> None:
        if self.owner:
            for seg in self._segments.values():
                _unlink(seg.name)


def _unlink(name: str) -> None:
    try:
        os.unlink(SHM_DIR / name)
    except FileNotFoundError:  # another process unlinked it, and unregistered it
        return
    # The tracker knows a segment by SharedMemory's name for it, with the leading slash.
    resource_tracker.unregister(f"/{name}", "shared_memory")
