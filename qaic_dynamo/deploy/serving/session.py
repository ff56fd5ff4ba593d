"""A model in prefill or decode role over retained-layout KV buffers.

:class:`SlicedSession` is what the workers drive: execution slots, ``set_data_with_slices``
(bind buffers, e.g. shared memory, and the slot a run writes), chunked prefill and decode
steps. :class:`Session` runs a compiled ``LLM``; ``.exported.OrtSession`` runs an
exported artifact on ONNX Runtime.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from qaic_dynamo.deploy.serving.kv_slices import KVSliceSpec, kv_buffer_names
from qaic_dynamo.engine import LLM, Request
from qaic_dynamo.errors import KVSliceError

__all__ = ["ExecutionSlot", "Session", "SlicedSession"]


@dataclass
class ExecutionSlot:
    """One execution object of a session; holds a request while it is in flight."""

    index: int
    request: Any = None
    #: (batch_index, ctx_start) bound by set_data_with_slices for this slot's next run.
    binding: tuple[int, int] | None = None


class SlicedSession:
    """A prefill or decode session over KV buffers bound by :meth:`set_data_with_slices`.

    Subclasses set ``role``, ``ctx_len``, ``execution_slots``, ``layer_buffers`` (each
    layer's buffer names) and ``spec`` (the :class:`KVSliceSpec` of those names), and
    provide ``buffer_shapes``, ``dtype``, ``_bind``, ``run_prefill_chunks`` and ``decode``.
    """

    role: str
    ctx_len: int
    execution_slots: list[ExecutionSlot]
    layer_buffers: list[list[str]]
    spec: KVSliceSpec

    @property
    def buffer_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every KV buffer's name and shape ([slots, heads, ctx_len, dim])."""
        raise NotImplementedError

    @property
    def dtype(self) -> torch.dtype:
        """The KV buffers' dtype."""
        raise NotImplementedError

    def _bind(self, buffers: dict[str, torch.Tensor], num_slots: int) -> None:
        """Run on ``buffers`` (checked: every name, ``num_slots`` rows each) from now on."""
        raise NotImplementedError

    def run_prefill_chunks(self, chunk_size: int) -> list[tuple[ExecutionSlot, int]]:
        """One step of chunked prefill over every busy execution slot; returns (slot,
        first token) for every request whose prompt is now complete."""
        raise NotImplementedError

    def decode(self, requests: list[Request]) -> torch.Tensor:
        """One decode step of ``requests`` (each in the slot ``block_ids[0]``, its last
        token not yet in the cache): their logits rows, in order."""
        raise NotImplementedError

    def set_data_with_slices(
        self, buffers: dict[str, torch.Tensor], slices: dict[str, int], execution_slot: int = 0
    ) -> dict[str, torch.Tensor]:
        """Bind ``buffers`` (e.g. shared memory) as this session's KV and ``slices`` for the
        next run of ``execution_slot``: it writes at slot ``batch_index`` from position
        ``ctx_start`` in those very buffers (no copy). Returns the bound views. A prefill
        session must be told its ``batch_index``: defaulting to slot 0 would overwrite the
        request decoding there."""
        n = len(self.execution_slots)
        if not isinstance(execution_slot, int) or isinstance(execution_slot, bool) or not 0 <= execution_slot < n:
            raise KVSliceError(
                f"execution_slot must be an int in [0, {n}) for this {self.role} session, got {execution_slot!r}"
            )
        if self.role == "prefill" and "batch_index" not in slices:
            raise KVSliceError(
                "a prefill session writes the slot slices['batch_index']; pass it (the decode slot "
                "the request's KV goes to)"
            )
        names = self.spec.select(buffers)
        missing = [n for layer in self.layer_buffers for n in layer if n not in names]
        if missing:
            raise KVSliceError(f"the slicing spec does not cover this model's buffers {missing[:4]}")
        slots = {buffers[n].shape[0] for layer in self.layer_buffers for n in layer}
        for name, shape in self.buffer_shapes.items():  # any number of slots, one per dim 0 row
            t = buffers[name]
            if tuple(t.shape[1:]) != shape[1:] or t.dtype != self.dtype or not t.is_contiguous() or len(slots) != 1:
                raise KVSliceError(
                    f"buffer {name} is {tuple(t.shape)} {t.dtype}; this session needs contiguous "
                    f"[slots, {', '.join(map(str, shape[1:]))}] {self.dtype} buffers, all with the "
                    "same number of slots"
                )
        views = self.spec.views(buffers, slices)
        self._bind(buffers, slots.pop())
        self.execution_slots[execution_slot].binding = (slices.get("batch_index", 0), slices.get("ctx_start", 0))
        return views


class Session(SlicedSession):
    """One compiled model (an ``LLM``) in prefill or decode role over retained-layout KV.

    The engine's paged cache becomes the retained layout: ``num_slots`` blocks of
    ``ctx_len`` tokens, block ``b`` holding the request in slot ``b``. ``role="prefill"``
    has ``stages + 1`` execution slots, ``role="decode"`` one.
    """

    def __init__(
        self,
        model: Any,
        role: str,
        *,
        num_slots: int,
        ctx_len: int,
        stages: int = 1,
        backend: str = "qaic",
        kv_cache_prefix: str | None = None,
        **llm_options: Any,
    ) -> None:
        if role not in ("prefill", "decode"):
            raise ValueError(f"Session: role must be 'prefill' or 'decode', got {role!r}")
        if not isinstance(stages, int) or stages < 1:
            raise ValueError(f"Session: stages must be a positive int, got {stages!r}")
        self.role = role
        self.ctx_len = ctx_len
        self.llm = LLM(
            model,
            backend,
            max_num_seqs=max(num_slots, 2),
            max_model_len=ctx_len,
            block_size=ctx_len,
            num_blocks=num_slots,
            **llm_options,
        )
        self.execution_slots = [ExecutionSlot(i) for i in range(stages + 1 if role == "prefill" else 1)]
        self.layer_buffers = kv_buffer_names(self.llm.model, kv_cache_prefix)
        self.spec = KVSliceSpec.for_model(self.llm.model, kv_cache_prefix)

    @property
    def buffer_shapes(self) -> dict[str, tuple[int, ...]]:
        out = {}
        for layer, names in zip(self.llm.kv_cache_layers, self.layer_buffers):
            for name, t in zip(names, self.llm.kv_caches[layer]):
                out[name] = tuple(t.shape)
        return out

    @property
    def dtype(self) -> torch.dtype:
        return self.llm.dtype

    @property
    def buffers(self) -> dict[str, torch.Tensor]:
        """The KV tensors the session runs on, by buffer name."""
        return {
            name: t
            for layer, names in zip(self.llm.kv_cache_layers, self.layer_buffers)
            for name, t in zip(names, self.llm.kv_caches[layer])
        }

    def _bind(self, buffers: dict[str, torch.Tensor], num_slots: int) -> None:
        self.llm.kv_caches = {
            layer: tuple(buffers[n] for n in names)
            for layer, names in zip(self.llm.kv_cache_layers, self.layer_buffers)
        }
        self.llm.num_blocks = num_slots

    def decode(self, requests: list[Request]) -> torch.Tensor:
        return self.llm.execute_model(requests)

    def run_prefill_chunks(self, chunk_size: int) -> list[tuple[ExecutionSlot, int]]:
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
