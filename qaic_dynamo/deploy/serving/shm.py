"""Named tensors in POSIX shared memory: the decode KV buffers both workers map."""

from __future__ import annotations

import math
import os
import secrets
from multiprocessing import shared_memory
from typing import Any

import torch

__all__ = ["SHM_PREFIX", "SharedKVBuffers"]

SHM_PREFIX = "qaic_kv_"


class SharedKVBuffers:
    """Named tensors in POSIX shared memory (one segment each), attachable by another
    process from :attr:`descriptor`. The creator unlinks them (:meth:`unlink`)."""

    def __init__(self, shapes: dict[str, tuple[int, ...]], dtype: torch.dtype, *, _attach: dict | None = None) -> None:
        self.dtype = dtype
        self._segments: dict[str, shared_memory.SharedMemory] = {}
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
                    # Workers are spawned by the server and share its resource tracker,
                    # so attaching adds nothing the server's unlink does not remove.
                    seg = shared_memory.SharedMemory(name=_attach[name], create=False)
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
        """Unlink the segments of ``descriptor`` (a worker whose server died does it)."""
        for name in descriptor["segments"].values():
            try:
                seg = shared_memory.SharedMemory(name=name, create=False)
            except FileNotFoundError:
                continue
            seg.close()
            try:
                seg.unlink()
            except FileNotFoundError:
                pass

    def unlink(self) -> None:
        for seg in self._segments.values():
            try:
                seg.unlink()
            except FileNotFoundError:
                pass
