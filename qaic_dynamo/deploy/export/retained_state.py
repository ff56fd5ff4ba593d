"""The qaic ops with retained-state meaning, and an engine model in retained-state form.

:class:`RetainedStateKV` (a TorchFunctionMode) gives the qaic ops retained-state meaning
while the export traces the model: the KV update becomes ``qaic::ctx_scatter`` into the
layer's ``past`` input at ``position_ids``, attention reads the updated cache with
``qaic::ctx_gather`` under a causal mask built from ``position_ids`` (a padded position,
-1, sees nothing and writes nothing).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn as nn
from torch.overrides import TorchFunctionMode

from qaic_dynamo.errors import ExportError
from qaic_dynamo.forward_context import FROM_FORWARD_CONTEXT
from qaic_dynamo.ops import QAIC_OPS, OpRole, op_name

__all__ = ["RetainedStateKV", "RetainedStateModel"]


class RetainedStateKV(TorchFunctionMode):
    """While active, the qaic KV-update and attention ops act on retained-state caches.

    ``past`` holds each layer's caches ``[batch, heads, ctx_len, dim]`` in
    ``layer_names`` order; ``position_ids`` is ``[batch, seq_len]`` and the ops see the
    tokens flattened to ``batch * seq_len`` rows. Updates resolve their layer by name, or
    by call order for ``"from_forward_context"``; attention reads the layer updated last
    (or the one it names). ``updated`` and ``stems`` are filled in per layer.

    Continuous batching (``batch_index`` [batch, 1]): the caches hold ``full_batch_size``
    rows and the call's sequence ``b`` is row ``batch_index[b]`` (``ctx_scatter_cb`` /
    ``ctx_gather_cb``). Compute-context length (``comp_ctx_lengths``, a 1-d tensor whose
    length L is all that counts): attention reads only the first L positions of each
    cache, the updates still write the full cache.
    """

    def __init__(
        self,
        layer_names: Sequence[str],
        past: Sequence[Sequence[torch.Tensor]],
        position_ids: torch.Tensor,
        batch_index: torch.Tensor | None = None,
        comp_ctx_lengths: torch.Tensor | None = None,
    ) -> None:
        super().__init__()
        self.layer_names = list(layer_names)
        self.past = [list(p) for p in past]
        self.position_ids = position_ids
        self.batch_index = batch_index
        self.updated: dict[int, list[torch.Tensor]] = {}
        self.stems: dict[int, tuple[str, ...]] = {}
        self._next = 0
        self._last: int | None = None
        # Built once here, before the model runs and so outside every decoder block: the
        # key positions, the causal mask and the gather index serve all layers (one set of
        # nodes, not one per layer), and in a layerwise trace they are values every block
        # shares rather than one block's outputs that the next block reads.
        caches = [c for p in self.past for c in p]
        ctx = caches[0].shape[2] if caches else 0
        if comp_ctx_lengths is not None:
            ctx = comp_ctx_lengths.shape[0]
        self._key_pos = torch.arange(ctx, device=position_ids.device)
        self._pos = position_ids.unsqueeze(-1)  # [B, S, 1]
        self._causal = self._key_pos <= self._pos  # [B, S, C]
        self._gather_index: dict[Any, torch.Tensor] = {}
        batch = position_ids.shape[0]  # the call's sequences (the caches may hold more rows)
        for c in caches:
            h = c.shape[1]
            if h not in self._gather_index:
                self._gather_index[h] = torch.arange(ctx, device=c.device).expand(batch, h, ctx)

    def _layer(self, name: str, what: str) -> int:
        if name == FROM_FORWARD_CONTEXT:
            if what == "update":
                i, self._next = self._next, self._next + 1
            elif self._last is None:
                raise ExportError(
                    "attention ran before any KV-cache update: the export needs update-then-attend layers"
                )
            else:
                i = self._last
        elif name in self.layer_names:
            i = self.layer_names.index(name)
        else:
            raise ExportError(f"the model's op names layer {name!r}, which is not one of its KV-cache layers")
        if i >= len(self.past):
            raise ExportError(f"the model updated more KV caches ({i + 1}) than it declares ({len(self.past)})")
        return i

    def _to_bhsd(self, t: torch.Tensor) -> torch.Tensor:
        """[B*S, H, D] (or [B*S, D]: one head) -> [B, H, S, D]."""
        b, s = self.position_ids.shape
        if t.dim() == 2:
            t = t.unsqueeze(1)
        return t.reshape(b, s, t.shape[-2], t.shape[-1]).transpose(1, 2)

    def _from_bhsd(self, t: torch.Tensor) -> torch.Tensor:
        b, h, s, d = t.shape
        return t.transpose(1, 2).reshape(b * s, h, d)

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        name = op_name(func) or ""
        entry = QAIC_OPS.get(name)
        if entry is None or not (entry.role is OpRole.KV_CACHE_UPDATE or entry.role is OpRole.SPLITTING):
            return func(*args, **kwargs)
        if entry.role is OpRole.KV_CACHE_UPDATE:
            first, second, layer_name = args[:3]
            i = self._layer(layer_name, "update")
            self.stems[i] = entry.retained_state
            self.updated[i] = [
                self._write(cache, self._to_bhsd(new).to(cache.dtype))
                for cache, new in zip(self.past[i], (first, second))
            ]
            self._last = i
            return first.new_empty(0)
        if name == "qaic::unified_attention":
            return self._attention(*args, **kwargs)
        if name == "qaic::unified_mla_attention":
            return self._mla_attention(*args, **kwargs)
        raise ExportError(f"the deployment export has no retained-state form of {name}")

    def _read(self, i: int) -> list[torch.Tensor]:
        if i not in self.updated:
            raise ExportError(f"layer {self.layer_names[i]!r} attends before its KV cache was updated")
        index = self._gather_index
        if self.batch_index is None:
            return [torch.ops.qaic.ctx_gather(cache, index[cache.shape[1]]) for cache in self.updated[i]]
        return [
            torch.ops.qaic.ctx_gather_cb(cache, self.batch_index, index[cache.shape[1]]) for cache in self.updated[i]
        ]

    def _write(self, cache: torch.Tensor, updates: torch.Tensor) -> torch.Tensor:
        if self.batch_index is None:
            return torch.ops.qaic.ctx_scatter(cache, self.position_ids, updates)
        return torch.ops.qaic.ctx_scatter_cb(cache, self.batch_index, self.position_ids, updates)

    def _mask(self, sliding_window: int | None) -> torch.Tensor:
        """[B, 1, S, C]: key slot c is visible to the token at position p iff c <= p (and
        c > p - window); a padded token (p = -1) sees nothing."""
        allowed = self._causal
        if sliding_window is not None:
            allowed = allowed & (self._key_pos > self._pos - sliding_window)
        return allowed.unsqueeze(1)

    def _softmax_attend(
        self,
        scores: torch.Tensor,
        allowed: torch.Tensor,
        value: torch.Tensor,
        softcap: float | None = None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        scores = scores.float()
        if softcap is not None:
            scores = torch.tanh(scores / softcap) * softcap
        # A finite minimum, not -inf: a padded row (nothing visible) gets a uniform, finite
        # softmax instead of NaN; its output is never read.
        scores = scores.masked_fill(~allowed, torch.finfo(torch.float32).min)
        if sinks is not None:  # one more logit per head in the denominator, with no value
            sink = sinks.float().view(1, -1, 1, 1).expand(scores.shape[0], -1, scores.shape[2], 1)
            probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
        else:
            probs = torch.softmax(scores, dim=-1)
        return probs.to(value.dtype) @ value

    def _attention(
        self,
        query,
        key,
        value,
        layer_name,
        scale=None,
        sliding_window=None,
        kv_cache_dependency=None,
        softcap=None,
        sinks=None,
    ):
        i = self._layer(layer_name, "attention")
        k, v = self._read(i)
        q = self._to_bhsd(query)  # [B, Hq, S, D]
        group = q.shape[1] // k.shape[1]
        if group > 1:  # GQA: each kv head serves `group` query heads (expand, not repeat_interleave:
            # with symbolic batch and ctx_len its decomposition costs the trace ~0.2 s a layer)
            k, v = (
                t.unsqueeze(2)
                .expand(t.shape[0], t.shape[1], group, t.shape[2], t.shape[3])
                .reshape(t.shape[0], t.shape[1] * group, t.shape[2], t.shape[3])
                for t in (k, v)
            )
        scale = scale if scale is not None else q.shape[-1] ** -0.5
        scores = (q @ k.transpose(-1, -2)) * scale
        return self._from_bhsd(self._softmax_attend(scores, self._mask(sliding_window), v, softcap, sinks))

    def _mla_attention(self, q_latent, q_pe, layer_name, scale, kv_cache_dependency=None):
        i = self._layer(layer_name, "attention")
        c_kv, k_pe = self._read(i)  # [B, 1, C, R], [B, 1, C, P]
        ql, qp = self._to_bhsd(q_latent), self._to_bhsd(q_pe)
        scores = (ql @ c_kv.transpose(-1, -2) + qp @ k_pe.transpose(-1, -2)) * scale
        return self._from_bhsd(self._softmax_attend(scores, self._mask(None), c_kv))


# --- the model in retained-state form -------------------------------------------------------


class RetainedStateModel(nn.Module):
    """An engine model in QAIC's retained-state form, a plain ``nn.Module``:
    ``forward(input_ids [B, S], position_ids [B, S], [batch_index [B, 1]],
    [comp_ctx_lengths [L]], *past) -> (logits [B, 1, V] float32, *past')`` with ``past`` each
    layer's caches ``[B, heads, ctx_len, dim]`` (``[full_batch_size, ...]`` with continuous
    batching) in layer order. Any tracer that runs Python (make_fx, ``torch.export``
    non-strict) sees ``ctx_scatter`` / ``ctx_gather`` and plain attention math instead of the
    paged ops; the export traces it, and ``benchmarks/export.py`` hands it to
    ``torch.onnx.export`` for comparison."""

    def __init__(
        self,
        model: nn.Module,
        caches_per_layer: Sequence[int],
        continuous_batching: bool = False,
        compute_context_lengths: bool = False,
    ) -> None:
        super().__init__()
        self.model = model
        self.caches_per_layer = list(caches_per_layer)
        self.continuous_batching = continuous_batching
        self.compute_context_lengths = compute_context_lengths
        #: The stems each layer's update op declared in the last forward.
        self.stems: dict[int, tuple[str, ...]] = {}

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, *rest: torch.Tensor) -> tuple:
        batch_index = rest[0] if self.continuous_batching else None
        rest = rest[1:] if self.continuous_batching else rest
        comp_ctx_lengths = rest[0] if self.compute_context_lengths else None
        flat_past = rest[1:] if self.compute_context_lengths else rest
        past, k = [], 0
        for n in self.caches_per_layer:
            past.append(list(flat_past[k : k + n]))
            k += n
        b, s = input_ids.shape
        # The logits row of each sequence: its last real token (the highest position).
        last = position_ids.argmax(dim=1) + torch.arange(b, device=input_ids.device) * s
        layers = list(self.model.kv_cache_layers)[: len(past)]
        with RetainedStateKV(layers, past, position_ids, batch_index, comp_ctx_lengths) as mode:
            logits = self.model(input_ids.reshape(-1), position_ids.reshape(-1), last)
        self.stems = mode.stems
        if len(mode.updated) != len(past):
            raise ExportError(f"the model updated {len(mode.updated)} of its {len(past)} KV caches in one forward")
        # float32 logits whatever the model's dtype, as QEfficient's models return them: the
        # card's runtime reads them into a float32 buffer.
        return (logits.float().unsqueeze(1), *[t for i in range(len(past)) for t in mode.updated[i]])
