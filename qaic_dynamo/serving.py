"""Disaggregated serving: prefill and decode in separate processes, with a zero-copy KV
hand-off through slicing.

Prefill and decode are separate sessions, as on Cloud AI 100 cards. Without slicing the
decode session takes every batch slot's KV as input on each step, so freeing one slot of
32 re-sends all 32 slots' KV. Here, as in QEfficient's disaggregated flow:

* The decode KV buffers live in host shared memory, one per retained-state name
  (``past_key.{i}``, ...; with ``kv_cache_prefix`` P, ``past_key.{i}_P``), in the retained
  layout ``[decode_slots, kv_heads, ctx_len, head_dim]``.
* A :class:`KVSliceSpec` names the buffers by pattern and the dims that are indexed per
  request: ``batch_index`` (dim 0, the decode slot) and ``ctx_start`` (dim 2, where the
  request's tokens start).
* :meth:`Session.set_data_with_slices` binds views of those buffers into a session: a
  prefill run then writes the request's KV straight into decode slot ``b``, so nothing is
  copied when the request moves to decode, and a freed decode slot is refilled without
  touching any other slot's KV.

A :class:`Session` wraps an :class:`~qaic_dynamo.engine.LLM` (``backend="qaic"`` by
default) whose paged cache is laid out as the retained state (one block per slot,
``block_size == ctx_len``), with a pool of execution slots: ``role="prefill"`` has
``stages + 1`` (chunks of several requests in flight), ``role="decode"`` exactly one.

:class:`DisaggregatedServer` runs one prefill and one decode worker process and moves
KV between them through a :class:`KVTransport`:

* ``"shm"``: slicing over shared memory, zero bytes copied (one host);
* ``"copy"``: the baseline without slicing - prefill writes its own buffers and the
  slot's retained state is copied into the decode buffers (bytes counted);
* ``"gloo"``: ``torch.distributed`` point-to-point over gloo, for prefill and decode in
  different processes or hosts: the prefilled slot is sent and received straight into the
  decode buffer's slot (bytes sent counted).

Failures: a request that would not fit in ``ctx_len`` is rejected before any write; if
the prefill worker dies, the requests it held fail with an error naming it while decode
keeps serving the running ones (with ``"shm"``/``"copy"`` a new prefill worker takes the
queued requests); stopping the server, cleanly or by an exception, unlinks every
shared-memory segment.
"""

from __future__ import annotations

import fnmatch
import itertools
import math
import multiprocessing as mp
import os
import queue
import secrets
import socket
import statistics
import time
import traceback
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from multiprocessing import shared_memory
from typing import Any

import torch

__all__ = [
    "DisaggregatedServer",
    "KVSliceError",
    "KVSliceSpec",
    "KVTransport",
    "RequestResult",
    "Session",
    "SharedKVBuffers",
    "kv_buffer_names",
]

SHM_PREFIX = "qaic_kv_"
TRANSPORTS = ("shm", "copy", "gloo")


class KVSliceError(ValueError):
    """A slicing spec does not fit the buffers it is applied to."""


# --- names and the slicing spec ------------------------------------------------------------


def kv_buffer_names(model: Any, kv_cache_prefix: str | None = None) -> list[list[str]]:
    """Each layer's KV buffer names, in layer order: the retained-state input names of the
    deployment export (``qaic_dynamo.export``'s naming functions), e.g.
    ``[["past_key.0", "past_value.0"], ...]``."""
    from qaic_dynamo.export import align_inputs_to_outputs, apply_kv_cache_prefix, retained_state_names
    from qaic_dynamo.ops import QAIC_OPS

    stems = QAIC_OPS[model.kv_cache_update].retained_state
    out = []
    for i in range(len(model.kv_cache_layers)):
        outputs = apply_kv_cache_prefix(retained_state_names(stems, i), kv_cache_prefix)
        inputs = align_inputs_to_outputs(outputs)
        out.append([inputs[o] for o in outputs])
    return out


@dataclass(frozen=True)
class KVSliceSpec:
    """Which buffers a hand-off slices, and along which dims.

    ``patterns`` are ``fnmatch`` patterns over buffer names (``past_key.*``); ``dims`` maps
    each slicing index to the buffer dim it indexes: ``batch_index`` selects one slot
    (dim 0), ``ctx_start`` the first cache position written (dim 2)."""

    patterns: tuple[str, ...] = ("past_key.*", "past_value.*")
    dims: tuple[tuple[str, int], ...] = (("batch_index", 0), ("ctx_start", 2))

    @classmethod
    def for_model(cls, model: Any, kv_cache_prefix: str | None = None) -> KVSliceSpec:
        """The spec of a model's KV buffers: its stems, in the prefixed form when a
        ``kv_cache_prefix`` is set (``past_key.*_P``)."""
        from qaic_dynamo.export import validate_kv_cache_prefix
        from qaic_dynamo.ops import QAIC_OPS

        prefix = validate_kv_cache_prefix(kv_cache_prefix)
        stems = QAIC_OPS[model.kv_cache_update].retained_state
        return cls(tuple(f"{s}.*_{prefix}" if prefix else f"{s}.*" for s in stems))

    def select(self, buffers: dict[str, torch.Tensor]) -> list[str]:
        """The names of ``buffers`` the spec covers, checked: every pattern must match a
        buffer and every sliced dim must exist in each of them."""
        names: list[str] = []
        for pattern in self.patterns:
            hits = [n for n in buffers if fnmatch.fnmatchcase(n, pattern)]
            if not hits:
                raise KVSliceError(f"slicing pattern {pattern!r} matches no buffer; buffers: {sorted(buffers)[:8]}"
                                   f"{' ...' if len(buffers) > 8 else ''}")
            names += [n for n in hits if n not in names]
        for name in names:
            rank = buffers[name].dim()
            for key, dim in self.dims:
                if not 0 <= dim < rank:
                    raise KVSliceError(f"slicing dim {key}={dim} is out of range for {name} of rank {rank}")
        return names

    def views(self, buffers: dict[str, torch.Tensor], index: dict[str, int]) -> dict[str, torch.Tensor]:
        """Views of the covered buffers at ``index`` (``batch_index`` keeps one slot,
        ``ctx_start`` starts the cache dim there); they share the buffers' memory."""
        unknown = set(index) - {k for k, _ in self.dims}
        if unknown:
            raise KVSliceError(f"unknown slicing index {sorted(unknown)}; this spec slices {[k for k, _ in self.dims]}")
        out = {}
        for name in self.select(buffers):
            v = buffers[name]
            for key, dim in self.dims:
                if key not in index:
                    continue
                i = index[key]
                if not 0 <= i < v.shape[dim]:
                    raise KVSliceError(f"{key}={i} is out of range for {name} (dim {dim} has {v.shape[dim]})")
                v = v.narrow(dim, i, 1 if key == "batch_index" else v.shape[dim] - i)
            out[name] = v
        return out


# --- shared-memory buffers -----------------------------------------------------------------------


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
                    seg = shared_memory.SharedMemory(create=True, size=nbytes, name=f"{SHM_PREFIX}{os.getpid()}_{tag}_{k}")
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
        return {"shapes": {n: tuple(t.shape) for n, t in self.tensors.items()}, "dtype": str(self.dtype).split(".")[-1],
                "segments": {n: s.name for n, s in self._segments.items()}}

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

    def unlink(self) -> None:
        for seg in self._segments.values():
            try:
                seg.unlink()
            except FileNotFoundError:
                pass


# --- sessions ---------------------------------------------------------------------------------


@dataclass
class ExecutionSlot:
    """One execution object of a session; holds a request while it is in flight."""

    index: int
    request: Any = None
    #: (batch_index, ctx_start) bound by set_data_with_slices for this slot's next run.
    binding: tuple[int, int] | None = None


class Session:
    """One compiled model (an ``LLM``) in prefill or decode role over retained-layout KV.

    The engine's paged cache becomes the retained layout: ``num_slots`` blocks of
    ``ctx_len`` tokens, block ``b`` holding the request in slot ``b``. ``role="prefill"``
    has ``stages + 1`` execution slots, ``role="decode"`` one.
    """

    def __init__(self, model: Any, role: str, *, num_slots: int, ctx_len: int, stages: int = 1,
                 backend: str = "qaic", kv_cache_prefix: str | None = None, **llm_options: Any) -> None:
        from qaic_dynamo.engine import LLM

        if role not in ("prefill", "decode"):
            raise ValueError(f"Session: role must be 'prefill' or 'decode', got {role!r}")
        if not isinstance(stages, int) or stages < 1:
            raise ValueError(f"Session: stages must be a positive int, got {stages!r}")
        self.role = role
        self.ctx_len = ctx_len
        self.llm = LLM(model, backend, max_num_seqs=max(num_slots, 2), max_model_len=ctx_len, block_size=ctx_len,
                       num_blocks=num_slots, **llm_options)
        self.execution_slots = [ExecutionSlot(i) for i in range(stages + 1 if role == "prefill" else 1)]
        self.layer_buffers = kv_buffer_names(self.llm.model, kv_cache_prefix)
        self.spec = KVSliceSpec.for_model(self.llm.model, kv_cache_prefix)

    @property
    def buffer_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every KV buffer's name and shape ([num_slots, heads, ctx_len, dim])."""
        out = {}
        for layer, names in zip(self.llm.kv_cache_layers, self.layer_buffers):
            for name, t in zip(names, self.llm.kv_caches[layer]):
                out[name] = tuple(t.shape)
        return out

    @property
    def buffers(self) -> dict[str, torch.Tensor]:
        """The KV tensors the session runs on, by buffer name."""
        return {name: t for layer, names in zip(self.llm.kv_cache_layers, self.layer_buffers)
                for name, t in zip(names, self.llm.kv_caches[layer])}

    def set_data_with_slices(self, buffers: dict[str, torch.Tensor], slices: dict[str, int],
                             execution_slot: int = 0) -> dict[str, torch.Tensor]:
        """Bind ``buffers`` (e.g. shared memory) as this session's KV and ``slices`` for the
        next run of ``execution_slot``: it writes at slot ``batch_index`` from position
        ``ctx_start`` in those very buffers (no copy). Returns the bound views. A prefill
        session must be told its ``batch_index``: defaulting to slot 0 would overwrite the
        request decoding there."""
        n = len(self.execution_slots)
        if not isinstance(execution_slot, int) or isinstance(execution_slot, bool) or not 0 <= execution_slot < n:
            raise KVSliceError(f"execution_slot must be an int in [0, {n}) for this {self.role} session, "
                               f"got {execution_slot!r}")
        if self.role == "prefill" and "batch_index" not in slices:
            raise KVSliceError("a prefill session writes the slot slices['batch_index']; pass it (the decode slot "
                               "the request's KV goes to)")
        names = self.spec.select(buffers)
        missing = [n for layer in self.layer_buffers for n in layer if n not in names]
        if missing:
            raise KVSliceError(f"the slicing spec does not cover this model's buffers {missing[:4]}")
        slots = {buffers[n].shape[0] for layer in self.layer_buffers for n in layer}
        for name, shape in self.buffer_shapes.items():  # any number of slots, one per dim 0 row
            t = buffers[name]
            if tuple(t.shape[1:]) != shape[1:] or t.dtype != self.llm.dtype or not t.is_contiguous() or len(slots) != 1:
                raise KVSliceError(f"buffer {name} is {tuple(t.shape)} {t.dtype}; this session needs contiguous "
                                   f"[slots, {', '.join(map(str, shape[1:]))}] {self.llm.dtype} buffers, all with the "
                                   "same number of slots")
        views = self.spec.views(buffers, slices)
        self.llm.kv_caches = {layer: tuple(buffers[n] for n in names)
                              for layer, names in zip(self.llm.kv_cache_layers, self.layer_buffers)}
        self.llm.num_blocks = slots.pop()
        self.execution_slots[execution_slot].binding = (slices.get("batch_index", 0), slices.get("ctx_start", 0))
        return views

    def run_prefill_chunks(self, chunk_size: int) -> list[tuple[ExecutionSlot, int]]:
        """One step of chunked prefill over every busy execution slot (one batch); returns
        (slot, first token) for every request whose prompt is now complete."""
        from qaic_dynamo.engine import Request

        busy = [s for s in self.execution_slots if s.request is not None]
        if not busy:
            return []
        batch = []
        for s in busy:
            job = s.request
            b, start = s.binding
            end = min(len(job.prompt), start + chunk_size)
            # The chunk as an engine request: the prompt up to the chunk's end, the part
            # before it already in the cache (slot b, from ctx_start).
            batch.append(Request(job.request_id, job.prompt[:end], 1, block_ids=[b], num_computed_tokens=start))
        logits = self.llm.execute_model(batch)
        done = []
        for s, r, row in zip(busy, batch, logits):
            b, _ = s.binding
            if r.num_tokens >= len(s.request.prompt):
                done.append((s, int(row.argmax())))
            else:
                s.binding = (b, r.num_tokens)
        return done


# --- transports -------------------------------------------------------------------------------


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

    def __init__(self, decode: SharedKVBuffers | None, shapes: dict[str, tuple[int, ...]], dtype: torch.dtype,
                 staging_slots: int) -> None:
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

    def __init__(self, decode: SharedKVBuffers | None, shapes: dict[str, tuple[int, ...]], dtype: torch.dtype,
                 rank: int, init_method: str, staging_slots: int) -> None:
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


# --- workers ----------------------------------------------------------------------------------


@dataclass
class _Job:
    request_id: int
    prompt: list[int]
    max_tokens: int
    stop_token_ids: tuple[int, ...]
    decode_slot: int


def _make_transport(kind: str, decode: SharedKVBuffers | None, shapes: dict, dtype: torch.dtype, rank: int,
                    init_method: str | None, staging_slots: int) -> KVTransport:
    if kind == "shm":
        return SlicingTransport(decode)
    if kind == "copy":
        return CopyTransport(decode, shapes, dtype, staging_slots)
    return GlooTransport(decode, shapes, dtype, rank, init_method, staging_slots)


def _prefill_worker(model: Any, cfg: dict, descriptor: dict, jobs: Any, handoffs: Any, events: Any) -> None:
    decode = transport = None
    try:  # everything inside: an error anywhere is posted, not left for the server to time out on
        torch.set_num_threads(cfg["threads"])
        decode = SharedKVBuffers.attach(descriptor) if cfg["transport"] != "gloo" else None
        session = Session(model, "prefill", num_slots=cfg["slots"], ctx_len=cfg["ctx_len"], stages=cfg["stages"],
                          backend=cfg["backend"], kv_cache_prefix=cfg["kv_cache_prefix"])
        staging_slots = len(session.execution_slots)
        transport = _make_transport(cfg["transport"], decode, session.buffer_shapes, session.llm.dtype, 0,
                                    cfg.get("init_method"), staging_slots)
        events.put(("ready", "prefill", None))
        while True:
            free = [s for s in session.execution_slots if s.request is None]
            while free:
                try:
                    job = jobs.get(timeout=0.05) if len(free) == len(session.execution_slots) else jobs.get_nowait()
                except queue.Empty:
                    break
                if job is None:
                    return
                s = free.pop(0)
                s.request = job
                session.set_data_with_slices(transport.prefill_buffers(), {
                    "batch_index": transport.prefill_target(job.decode_slot, s.index), "ctx_start": 0}, s.index)
            for s, first in session.run_prefill_chunks(cfg["chunk_size"]):
                job, t_first = s.request, time.perf_counter()
                if transport.receiver_waits:  # gloo: decode must be told before it can receive
                    handoffs.put(("job", job, first, t_first, transport.slot_bytes()))
                    transport.send(s.index, job.decode_slot, job.request_id)
                else:  # the KV is in the decode slot before decode hears of it
                    moved = transport.send(s.index, job.decode_slot, job.request_id)
                    handoffs.put(("job", job, first, t_first, moved))
                s.request, s.binding = None, None
            if cfg.get("chunk_delay"):
                time.sleep(cfg["chunk_delay"])
    except Exception:
        events.put(("worker_error", "prefill", traceback.format_exc()))
    finally:
        if transport is not None:
            transport.close()
        if decode is not None:
            decode.close()


def _decode_worker(model: Any, cfg: dict, descriptor: dict, handoff_queues: list, control: Any, events: Any) -> None:
    from qaic_dynamo.engine import Request

    decode = transport = None
    try:  # everything inside: an error anywhere is posted, not left for the server to time out on
        torch.set_num_threads(cfg["threads"])
        decode = SharedKVBuffers.attach(descriptor)
        session = Session(model, "decode", num_slots=cfg["slots"], ctx_len=cfg["ctx_len"], backend=cfg["backend"],
                          kv_cache_prefix=cfg["kv_cache_prefix"])
        session.set_data_with_slices(decode.tensors, {})  # decode runs every slot of the shared buffers
        transport = _make_transport(cfg["transport"], decode, session.buffer_shapes, session.llm.dtype, 1,
                                    cfg.get("init_method"), 0)
        events.put(("ready", "decode", None))
        running: list[tuple[Request, _Job]] = []
        handoffs = handoff_queues[0]  # the first prefill worker's; each replacement has its own

        def finish(req: Request, job: _Job) -> None:
            events.put(("finished", job.request_id, (job.decode_slot, list(req.output_token_ids))))

        def admit(item: tuple) -> None:
            _, job, first, t_first, moved = item
            try:
                transport.receive(job.decode_slot, job.request_id)
            except Exception as e:
                # gloo: the prefill worker died with this hand-off posted and its KV not (all)
                # sent. Only this request is lost; the running ones need no transport. Its
                # slot holds a partial KV that nothing reads: the server frees it.
                events.put(("lost", job.request_id, (job.decode_slot, f"{type(e).__name__}: {e}".splitlines()[0])))
                return
            events.put(("admitted", job.request_id, (first, t_first, moved)))
            req = Request(job.request_id, job.prompt, job.max_tokens, output_token_ids=[first],
                          block_ids=[job.decode_slot], num_computed_tokens=len(job.prompt))
            if _finished(req, job):
                finish(req, job)
            else:
                running.append((req, job))

        while True:
            try:  # the server's messages: stop, or a sync after the prefill worker died
                message = control.get_nowait()
            except queue.Empty:
                message = False
            if message is None:
                return
            if message:
                # The prefill worker is dead, so nothing more is coming: admit everything it
                # handed off, then say so (the server fails only what was not handed off),
                # and read its replacement's queue from now on.
                while True:
                    try:
                        admit(handoffs.get_nowait())
                    except queue.Empty:
                        break
                _, marker, generation = message
                handoffs = handoff_queues[generation]
                events.put(("synced", marker, None))
            while True:  # admit every prefilled request that arrived
                try:
                    item = handoffs.get(timeout=0.05) if not running else handoffs.get_nowait()
                except queue.Empty:
                    break
                admit(item)
            if not running:
                continue
            logits = session.llm.execute_model([r for r, _ in running])
            still = []
            for (req, job), row in zip(running, logits):
                req.num_computed_tokens = req.num_tokens
                req.output_token_ids.append(int(row.argmax()))
                if _finished(req, job):
                    finish(req, job)
                else:
                    still.append((req, job))
            running = still
    except Exception:
        events.put(("worker_error", "decode", traceback.format_exc()))
    finally:
        if transport is not None:
            transport.close()
        if decode is not None:
            decode.close()


def _finished(req: Any, job: _Job) -> bool:
    return len(req.output_token_ids) >= job.max_tokens or req.output_token_ids[-1] in job.stop_token_ids


# --- the server ---------------------------------------------------------------------------------


@dataclass
class RequestResult:
    request_id: int
    prompt: list[int]
    token_ids: list[int] = field(default_factory=list)
    #: Seconds from submission to the first token (None if it never came).
    ttft: float | None = None
    #: KV bytes moved at this request's hand-off (0 with slicing).
    kv_bytes_moved: int = 0
    error: str | None = None
    submitted: float = 0.0
    finished: float | None = None


def _free_local_port() -> int:
    """A TCP port on 127.0.0.1 that is free now (the OS picks it; it could be taken again
    before it is bound, as with any such probe)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


#: The most prefill restarts a server can be given (see ``max_prefill_restarts``).
MAX_PREFILL_RESTARTS = 64


class DisaggregatedServer:
    """A prefill worker and a decode worker sharing KV through ``transport``.

    ``decode_slots`` sequences decode together; more requests wait until a slot is free,
    then are prefilled into it while decode keeps stepping the others. Use as a context
    manager (or call :meth:`stop`): that always ends the workers and unlinks the shared
    memory. ``chunk_delay`` (seconds after each prefill chunk) slows prefill down for
    fault tests and demos. ``gloo_init_method`` (transport ``"gloo"``) is where the two
    workers meet, by default a port on 127.0.0.1 that is free at start-up. A prefill worker
    that dies is replaced up to ``max_prefill_restarts`` times (never with gloo, whose
    process group dies with it); after that, requests fail with an error until the
    server is restarted.
    """

    def __init__(self, model: Any, *, decode_slots: int = 4, ctx_len: int = 256, prefill_stages: int = 1,
                 chunk_size: int = 64, transport: str = "shm", backend: str = "qaic",
                 kv_cache_prefix: str | None = None, threads_per_worker: int = 1,
                 gloo_init_method: str | None = None, startup_timeout: float = 600,
                 chunk_delay: float = 0.0, max_prefill_restarts: int = 3) -> None:
        if transport not in TRANSPORTS:
            raise ValueError(f"DisaggregatedServer: transport must be one of {list(TRANSPORTS)}, got {transport!r}")
        for name, v in (("decode_slots", decode_slots), ("ctx_len", ctx_len), ("chunk_size", chunk_size),
                        ("prefill_stages", prefill_stages)):
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"DisaggregatedServer: {name} must be a positive int, got {v!r}")
        from qaic_dynamo.engine import BACKENDS

        # Each restart's hand-off queue is made at start() and held open by the server and
        # decode (two file descriptors each), so the count is bounded.
        if (not isinstance(max_prefill_restarts, int) or isinstance(max_prefill_restarts, bool)
                or not 0 <= max_prefill_restarts <= MAX_PREFILL_RESTARTS):
            raise ValueError(f"DisaggregatedServer: max_prefill_restarts must be an int in [0, {MAX_PREFILL_RESTARTS}], "
                             f"got {max_prefill_restarts!r}")

        if not isinstance(threads_per_worker, int) or isinstance(threads_per_worker, bool) or threads_per_worker < 1:
            raise ValueError(f"DisaggregatedServer: threads_per_worker must be a positive int, got {threads_per_worker!r}")
        if backend not in BACKENDS:
            raise ValueError(f"DisaggregatedServer: backend must be one of {list(BACKENDS)}, got {backend!r}")
        if gloo_init_method is not None and transport != "gloo":
            raise ValueError(f"DisaggregatedServer: gloo_init_method is the gloo transport's rendezvous, but the "
                             f"transport is {transport!r}; pass transport='gloo' or drop gloo_init_method")
        self.model = model
        self.transport = transport
        self.ctx_len = ctx_len
        if transport == "gloo" and gloo_init_method is None:
            gloo_init_method = f"tcp://127.0.0.1:{_free_local_port()}"
        self.cfg = dict(slots=decode_slots, ctx_len=ctx_len, stages=prefill_stages, chunk_size=chunk_size,
                        transport=transport, backend=backend, kv_cache_prefix=kv_cache_prefix,
                        threads=threads_per_worker, init_method=gloo_init_method, chunk_delay=chunk_delay)
        self.startup_timeout = startup_timeout
        self.max_prefill_restarts = max_prefill_restarts
        self._no_prefill: str | None = None
        self._ctx = mp.get_context("spawn")
        self.buffers: SharedKVBuffers | None = None
        self._prefill = self._decode = None
        self._ids = itertools.count()
        self._syncs = itertools.count()
        self.results: dict[int, RequestResult] = {}  # the running generate() call's requests
        self.restarts = 0
        # Why the workers may still hold requests no generate() call tracks (a call that
        # ended by an exception): slots would then be reused under them. None: clean.
        self._unusable: str | None = None

    # -- lifecycle ------------------------------------------------------------------------
    def __enter__(self) -> DisaggregatedServer:
        self.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def start(self) -> None:
        from qaic_dynamo.models import load_model

        if self.buffers is not None:
            raise RuntimeError("DisaggregatedServer: already started; stop() it before starting it again")
        self._unusable = None
        try:
            probe = load_model(self.model)
            shapes = probe.kv_cache_shapes(self.cfg["slots"], self.ctx_len)
            names = kv_buffer_names(probe, self.cfg["kv_cache_prefix"])
            dtype = next(probe.parameters()).dtype
            self.vocab = probe.vocab_size
            flat = {n: s for layer, ns in zip(probe.kv_cache_layers, names) for n, s in zip(ns, shapes[layer])}
            self.buffers = SharedKVBuffers(flat, dtype)
            # One writing process per queue: a worker killed while writing holds that queue's
            # write lock for good, and then only its own queues are stuck - jobs and its
            # events queue are replaced with it; its hand-offs are drained after its death,
            # and its replacement writes the next of the hand-off queues. Those must exist
            # before decode starts (a queue reaches a process only when it is created).
            self._jobs = self._ctx.Queue()  # server -> prefill
            self._handoff_queues = [self._ctx.Queue() for _ in range(self.max_prefill_restarts + 1)]  # prefill -> decode
            self._generation = 0  # which prefill worker, and which hand-off queue, is running
            self._no_prefill = None  # why the prefill worker could not be replaced
            self._control, self._events = self._ctx.Queue(), self._ctx.Queue()  # server -> decode -> server
            self._prefill_events = self._ctx.Queue()  # prefill -> server
            self._decode = self._ctx.Process(target=_decode_worker, daemon=True, name="qaic-decode", args=(
                self.model, self.cfg, self.buffers.descriptor, self._handoff_queues, self._control, self._events))
            self._decode.start()
            self._start_prefill()
            self._wait_for(lambda kind, who, payload: kind == "ready", {"prefill", "decode"}, "start")
        except BaseException:
            self.stop()
            raise

    def _start_prefill(self) -> None:
        self._prefill = self._ctx.Process(target=_prefill_worker, daemon=True, name="qaic-prefill", args=(
            self.model, self.cfg, self.buffers.descriptor, self._jobs, self._handoff_queues[self._generation],
            self._prefill_events))
        self._prefill.start()

    def _wait_for(self, match: Any, keys: set, what: str, on_other: Any = None) -> None:
        """Consume events until ``match`` has been true for every key (the event's second
        field); other events go to ``on_other``."""
        deadline = time.monotonic() + self.startup_timeout
        while keys:
            try:
                kind, who, payload = self._next_event(timeout=min(0.5, max(0.01, deadline - time.monotonic())))
            except queue.Empty:
                # A worker killed (out of memory, a signal) or crashed before it could post
                # an event says nothing: look, rather than wait out the timeout.
                for name, proc in (("prefill", self._prefill), ("decode", self._decode)):
                    if proc is not None and proc.exitcode is not None:
                        raise RuntimeError(f"DisaggregatedServer: the {name} worker exited (exit code {proc.exitcode}) "
                                           f"while waiting for its {what}") from None
                if time.monotonic() >= deadline:
                    raise RuntimeError(f"DisaggregatedServer: no {what} from {sorted(keys)} in "
                                       f"{self.startup_timeout:.0f} s") from None
                continue
            if kind == "worker_error":
                raise RuntimeError(f"DisaggregatedServer: the {who} worker failed:\n{payload}")
            if match(kind, who, payload):
                keys.discard(who)
            elif on_other is not None:
                on_other(kind, who, payload)

    def _next_event(self, timeout: float) -> tuple[str, Any, Any]:
        """The next event of either worker (the prefill worker's first); queue.Empty if
        none came within ``timeout``."""
        try:
            return self._prefill_events.get_nowait()
        except queue.Empty:
            return self._events.get(timeout=timeout)

    def stop(self) -> None:
        """End both workers and unlink the shared memory (idempotent)."""
        for q in ("_jobs", "_control"):
            if hasattr(self, q):
                try:
                    getattr(self, q).put(None)
                except Exception:
                    pass
        for p in (self._prefill, self._decode):
            if p is not None and p.is_alive():
                p.join(timeout=5)
                if p.is_alive():
                    p.kill()
                    p.join(timeout=5)
        self._prefill = self._decode = None
        if self.buffers is not None:
            self.buffers.close()
            self.buffers.unlink()
            self.buffers = None

    @property
    def prefill_pid(self) -> int | None:
        return self._prefill.pid if self._prefill is not None else None

    # -- serving --------------------------------------------------------------------------
    def validate(self, prompt: Sequence[int], max_tokens: int) -> None:
        """Reject, before anything is written, a request that cannot be served. A prompt
        is a sequence of token ids (a list, a 1-d tensor or array)."""
        from qaic_dynamo.sampling import is_token_id

        if isinstance(prompt, (str, bytes)) or not hasattr(prompt, "__len__"):
            raise TypeError(f"DisaggregatedServer: a prompt must be a sequence of token ids, got {type(prompt).__name__}")
        if len(prompt) == 0:
            raise ValueError("DisaggregatedServer: empty prompt")
        if not is_token_id(max_tokens) or max_tokens < 1:
            raise ValueError(f"DisaggregatedServer: max_tokens must be a positive int, got {max_tokens!r}")
        if len(prompt) + max_tokens > self.ctx_len:
            raise ValueError(f"DisaggregatedServer: prompt ({len(prompt)} tokens) + max_tokens={max_tokens} would not fit "
                             f"in a slot's ctx_len={self.ctx_len}; shorten it or start the server with a larger ctx_len")
        not_ids = [t for t in prompt if not is_token_id(t)]
        if not_ids:
            raise TypeError(f"DisaggregatedServer: token ids that are not integers: {not_ids[:5]}")
        bad = [t for t in prompt if not 0 <= t < self.vocab]
        if bad:
            raise ValueError(f"DisaggregatedServer: token ids outside the vocabulary [0, {self.vocab}): {bad[:5]}")

    def generate(self, prompts: Sequence[Sequence[int]], max_tokens: int | Sequence[int] = 16,
                 stop_token_ids: Sequence[int] = (), progress: Any = None, timeout: float = 600) -> list[RequestResult]:
        """Serve ``prompts`` (greedy) and return one result per prompt, in order. Every
        request is validated before any is started. A request held by a prefill worker
        that died comes back with ``error`` set; the others are served."""
        from qaic_dynamo.sampling import SamplingParams, is_token_id

        if self.buffers is None:
            raise RuntimeError("DisaggregatedServer: not started (use it as a context manager or call start())")
        if self._unusable is not None:
            raise RuntimeError(f"DisaggregatedServer: {self._unusable}; stop() and start() the server again")
        if self._no_prefill is not None:  # _prefill_died could not replace it
            raise RuntimeError(f"DisaggregatedServer: {self._no_prefill}; stop() and start() the server again")
        # One count (an int, numpy's too) for every prompt, or one per prompt; anything else
        # (a bool) goes to validate, which names it.
        one = is_token_id(max_tokens) or not isinstance(max_tokens, Iterable)
        counts = [max_tokens] * len(prompts) if one else list(max_tokens)
        if len(counts) != len(prompts):
            raise ValueError("DisaggregatedServer: one max_tokens per prompt")
        for p, n in zip(prompts, counts):
            self.validate(p, n)
        stops = SamplingParams(stop_token_ids=stop_token_ids).stop_token_ids  # the engine's check and form
        waiting = []
        self.results = {}  # this call's requests only: results do not pile up across calls
        for p, n in zip(prompts, counts):
            rid = next(self._ids)
            ids = [int(t) for t in p]  # numpy or 0-d tensor ids become plain ints here
            self.results[rid] = RequestResult(rid, ids, submitted=time.perf_counter())
            waiting.append(_Job(rid, ids, int(n), stops, -1))
        order = [j.request_id for j in waiting]
        free = list(range(self.cfg["slots"]))
        capacity = self.cfg["stages"] + 1  # prefill holds at most its execution slots
        at_prefill: dict[int, _Job] = {}  # sent to prefill, not yet admitted by decode
        active: dict[int, _Job] = {}  # admitted by decode
        deadline = time.monotonic() + timeout

        def on_event(kind: str, rid: Any, payload: Any) -> None:
            if kind == "admitted":
                first, t_first, moved = payload
                r = self.results[rid]
                r.ttft, r.kv_bytes_moved = t_first - r.submitted, moved
                active[rid] = at_prefill.pop(rid)
            elif kind == "lost":  # its KV never arrived (see _decode_worker's admit)
                slot, reason = payload
                self.results[rid].error = (f"the KV hand-off of request {rid} failed ({reason}); it was not served "
                                           "(decode kept serving the running requests)")
                at_prefill.pop(rid)
                free.append(slot)
            elif kind == "finished":
                slot, tokens = payload
                r = self.results[rid]
                r.token_ids, r.finished = tokens, time.perf_counter()
                active.pop(rid)
                free.append(slot)  # decode is done with it: the next prefill may overwrite it
                if progress is not None:
                    progress(r)

        try:
            self._serve(waiting, at_prefill, active, free, capacity, on_event, deadline, timeout)
        except BaseException as e:
            if at_prefill or active:
                # The workers still hold these requests and their slots; a later call
                # must not hand the slots out again.
                self._unusable = (f"an earlier generate() ended ({type(e).__name__}) with {len(at_prefill) + len(active)}"
                                  " request(s) still in the workers")
            raise
        return [self.results[rid] for rid in order]

    def _serve(self, waiting: list[_Job], at_prefill: dict[int, _Job], active: dict[int, _Job], free: list[int],
               capacity: int, on_event: Any, deadline: float, timeout: float) -> None:
        while waiting or at_prefill or active:
            while waiting and free and len(at_prefill) < capacity:
                job = waiting.pop(0)
                job.decode_slot = free.pop(0)
                at_prefill[job.request_id] = job
                self._jobs.put(job)
            try:
                kind, rid, payload = self._next_event(timeout=0.1)
                if kind == "worker_error":
                    raise RuntimeError(f"DisaggregatedServer: the {rid} worker failed:\n{payload}")
                on_event(kind, rid, payload)
            except queue.Empty:
                pass
            if self._prefill is not None and not self._prefill.is_alive():
                self._prefill_died(at_prefill, free, waiting, on_event)
            if self._decode is not None and not self._decode.is_alive():
                raise RuntimeError(f"DisaggregatedServer: the decode worker died (exit code {self._decode.exitcode})")
            if time.monotonic() > deadline:
                raise TimeoutError(f"DisaggregatedServer: requests not finished after {timeout:.0f} s")

    def _prefill_died(self, at_prefill: dict[int, _Job], free: list[int], waiting: list[_Job], on_event: Any) -> None:
        """Fail the requests the dead prefill worker held, never a slot decode still uses:
        a marker sent after everything the worker handed off tells which ones decode took."""
        code = self._prefill.exitcode
        self._prefill = None
        marker = next(self._syncs)
        if self.transport == "gloo":  # its process group died with it: nothing can prefill
            self._no_prefill = f"the prefill worker died (exit code {code}) and the gloo transport cannot replace it"
        elif self._generation == self.max_prefill_restarts:
            self._no_prefill = (f"the prefill worker died (exit code {code}) after {self._generation} restart(s), the "
                                f"most this server makes (max_prefill_restarts={self.max_prefill_restarts})")
        else:
            self._generation += 1
        self._control.put(("sync", marker, self._generation))
        self._wait_for(lambda kind, who, payload: kind == "synced" and who == marker, {marker}, "sync",
                       on_other=on_event)
        for rid, job in list(at_prefill.items()):
            self.results[rid].error = (f"the prefill worker died (exit code {code}) while prefilling request {rid}; "
                                       "it was not served (decode kept serving the running requests)")
            free.append(job.decode_slot)
            del at_prefill[rid]
        if self._no_prefill is not None:
            for job in waiting:
                self.results[job.request_id].error = self._no_prefill
            waiting.clear()
            return
        # The dead worker's queues may hold a half-read job, or a write lock it never released
        # (its hand-off queue too: the replacement writes the next one).
        self._jobs, self._prefill_events = self._ctx.Queue(), self._ctx.Queue()
        self._start_prefill()
        self.restarts += 1
        self._wait_for(lambda kind, who, payload: kind == "ready", {"prefill"}, "restart", on_other=on_event)


def summarize(results: Sequence[RequestResult]) -> dict[str, float | None]:
    """Request and failure counts, TTFT median / p90 (s), decode tokens/s and KV bytes moved
    per hand-off (None when no request was served)."""
    ok = [r for r in results if r.error is None and r.ttft is not None]
    ttfts = sorted(r.ttft for r in ok)
    if not ok:  # nothing was served: counts only, every figure None
        return {"requests": len(results), "failed": len(results), "ttft_median_s": None, "ttft_p90_s": None,
                "decode_tokens_per_s": None, "kv_bytes_per_handoff": None, "wall_s": None}
    start = min(r.submitted for r in ok)
    end = max(r.finished or 0 for r in ok)
    decode_tokens = sum(max(0, len(r.token_ids) - 1) for r in ok)
    return {
        "requests": len(results), "failed": len(results) - len(ok),
        "ttft_median_s": statistics.median(ttfts),
        "ttft_p90_s": ttfts[min(len(ttfts) - 1, math.ceil(0.9 * len(ttfts)) - 1)],
        "decode_tokens_per_s": decode_tokens / max(1e-9, end - start),
        "kv_bytes_per_handoff": statistics.mean(r.kv_bytes_moved for r in ok),
        "wall_s": end - start,
    }

