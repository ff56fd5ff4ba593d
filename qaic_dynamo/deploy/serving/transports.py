"""How KV moves from prefill to decode: slicing over shared memory (zero copies), a copy
baseline, or torch.distributed over gloo."""

from __future__ import annotations

import torch

from qaic_dynamo.deploy.serving.shm import SharedKVBuffers

__all__ = ["TRANSPORTS", "CopyTransport", "GlooTransport", "KVTransport", "SlicingTransport", "make_transport"]

TRANSPORTS = ("shm", "copy", "gloo")


class KVTransport:
    """How a prefilled slot's KV reaches the decode buffers. ``prefill_buffers`` is where
    prefill writes; ``send`` runs in the prefill worker after a prefill, ``receive`` in
    the decode worker before the request joins the batch. Both return bytes moved."""

    name = "base"
    #: The receiver must be told before the sender can finish (gloo's send blocks).
    receiver_waits = False

    def __init__(self, decode: SharedKVBuffers) -> None:
        self.decode = decode

    def slot_bytes(self) -> int:
        """Bytes of one slot of every buffer."""
        return sum(t[0].numel() * t.element_size() for t in self.prefill_buffers().values())

    def prefill_target(self, decode_slot: int, staging_slot: int) -> int:
        """The slot of ``prefill_buffers`` a prefill of ``decode_slot`` writes."""
        return decode_slot

    def prefill_buffers(self) -> dict[str, torch.Tensor]:
        return self.decode.tensors

    def send(self, staging_slot: int, decode_slot: int, request_id: int) -> int:
        return 0

    def receive(self, decode_slot: int, request_id: int) -> int:
        return 0

    def close(self) -> None:
        pass


class SlicingTransport(KVTransport):
    """Prefill writes the decode buffers' slot itself (slicing): nothing moves."""

    name = "shm"


class _StagingTransport(KVTransport):
    """Prefill writes buffers of its own (one slot per execution slot); ``send`` moves a
    prefilled slot of each of them with :meth:`move`."""

    def __init__(
        self, decode: SharedKVBuffers | None, shapes: dict[str, tuple[int, ...]], dtype: torch.dtype, staging_slots: int
    ) -> None:
        super().__init__(decode)
        self.staging = {n: torch.zeros((staging_slots, *s[1:]), dtype=dtype) for n, s in shapes.items()}

    def prefill_target(self, decode_slot: int, staging_slot: int) -> int:
        return staging_slot

    def prefill_buffers(self) -> dict[str, torch.Tensor]:
        return self.staging

    def send(self, staging_slot: int, decode_slot: int, request_id: int) -> int:
        n = 0
        for name in sorted(self.staging):
            t = self.staging[name][staging_slot]
            self.move(name, t, decode_slot, request_id)
            n += t.numel() * t.element_size()
        return n

    def move(self, name: str, slot: torch.Tensor, decode_slot: int, request_id: int) -> None:
        raise NotImplementedError


class CopyTransport(_StagingTransport):
    """The baseline without slicing: the slot's whole retained state is copied into the
    decode buffers at the hand-off."""

    name = "copy"

    def move(self, name: str, slot: torch.Tensor, decode_slot: int, request_id: int) -> None:
        self.decode.tensors[name][decode_slot].copy_(slot)


class GlooTransport(_StagingTransport):
    """``torch.distributed`` point-to-point over gloo: prefill (rank 0) sends the
    prefilled slot, decode (rank 1) receives it straight into its buffer's slot. Each
    side keeps its own buffers, so it works across hosts (``init_method`` a TCP address)."""

    name = "gloo"
    receiver_waits = True

    def __init__(
        self,
        decode: SharedKVBuffers | None,
        shapes: dict[str, tuple[int, ...]],
        dtype: torch.dtype,
        rank: int,
        init_method: str,
        staging_slots: int,
    ) -> None:
        import torch.distributed as dist

        super().__init__(decode, shapes if rank == 0 else {}, dtype, staging_slots)
        self.dist = dist
        dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=2)

    def move(self, name: str, slot: torch.Tensor, decode_slot: int, request_id: int) -> None:
        self.dist.send(slot, dst=1, tag=request_id)

    def receive(self, decode_slot: int, request_id: int) -> int:
        n = 0
        for name in sorted(self.decode.tensors):
            t = self.decode.tensors[name][decode_slot]  # a contiguous slot: received in place
            self.dist.recv(t, src=0, tag=request_id)
            n += t.numel() * t.element_size()
        return n

    def close(self) -> None:
        if self.dist.is_initialized():
            self.dist.destroy_process_group()


def make_transport(
    kind: str,
    decode: SharedKVBuffers | None,
    shapes: dict,
    dtype: torch.dtype,
    rank: int,
    init_method: str | None,
    staging_slots: int,
) -> KVTransport:
    if kind == "shm":
        return SlicingTransport(decode)
    if kind == "copy":
        return CopyTransport(decode, shapes, dtype, staging_slots)
    return GlooTransport(decode, shapes, dtype, rank, init_method, staging_slots)
