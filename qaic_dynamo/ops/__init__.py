"""The ``qaic`` op layer's Python face: thin wrappers over ``torch.ops.qaic``, the op
registry and the fake kernels.

Each op has three layers: its schema and CPU kernel in C++ (``csrc/ops.cpp``, with
``TORCH_CHECK`` on every argument), the wrapper below, and a fake kernel (:mod:`.fake`,
registered on import) so that Dynamo, FakeTensor and AOT tracing can propagate shapes
without running a kernel or touching a forward context. The wrappers exist for readable
call sites and docstrings; ``torch.ops.qaic.<name>`` is the same thing.
:mod:`.registry` says what each op is to the compiler; :mod:`.onnx_functions` holds the
ONNX translations (imported only when something is lowered).

Op contracts (shapes use T = tokens, H = heads, D = head size):

* ``reshape_and_cache(key[T,Hkv,D], value[T,Hkv,Dv], key_cache!, value_cache!, slot_mapping[T'])``
  writes row t to slot ``slot_mapping[t]`` for ``t < T'`` (``T' <= T``; extra key rows are
  padding). Slot -1 writes nothing.
* ``kv_cache_scatter(key, value, key_cache, value_cache, slot_mapping) -> (key_cache',
  value_cache')``: the functional ``reshape_and_cache`` (updated copies). Lowering only;
  in ONNX it is ``com.qualcomm.cloud::KVCacheScatter``.
* ``ctx_scatter(data[B,H,C,D], position_ids[B,S], updates[B,H,S,D]) -> data'``: QEfficient's
  retained-state KV write for the deployment export (``updates[b,h,s]`` to
  ``data[b,h,position_ids[b,s]]``; position -1 is padding and writes nothing). In ONNX
  ``com.qualcomm.cloud::CtxScatter``.
* ``ctx_gather(data[B,H,C,D], ctx_indices[B,H,N]) -> [B,H,N,D]``: the matching read
  (``GatherND`` with ``batch_dims=2``); in ONNX ``com.qualcomm.cloud::CtxGather``.
* ``ctx_scatter_cb(data[F,H,C,D], batch_index[B,1], position_ids[B,S], updates[B,H,S,D])``
  and ``ctx_gather_cb(data[F,H,C,D], batch_index[B,1], ctx_indices[B,H,N]) -> [B,H,N,D]``:
  the same for continuous batching, where the cache holds ``full_batch_size`` rows and a
  call names the rows it works on (each once); ``CtxScatterCB`` / ``CtxGatherCB`` in ONNX.
* ``unified_kv_cache_update(key, value, layer_name) -> dep`` resolves the layer in the
  forward context, writes its caches with the context's slot mapping and returns an empty
  dependency tensor that attention takes, so the graph orders the read after the write.
* ``unified_mla_kv_cache_update(kv_c_normed[T,R], k_pe[T,P] | [T,1,P], layer_name) -> dep``:
  the same for MLA latent caches ``(compressed_kv[N,1,B,R], k_pe[N,1,B,P])``.
* ``unified_attention(query[T,Hq,D], key, value, layer_name, scale=None,
  sliding_window=None, kv_cache_dependency=None, softcap=None, sinks=None) -> [T,Hq,Dv]``:
  causal attention of each sequence's new tokens over its cached tokens (GQA when Hq >
  Hkv), with optional logit soft-capping (``tanh(s / softcap) * softcap``) and attention
  sinks (``sinks[Hq]``, a per-head logit in the softmax denominator). A splitting op.
* ``unified_mla_attention(q_latent[T,H,R], q_pe[T,H,P], layer_name, scale,
  kv_cache_dependency=None) -> [T,H,R]``: absorbed MLA attention. A splitting op.
"""

from __future__ import annotations

import torch

import qaic_dynamo.native  # noqa: F401  (loading the library registers the schemas)
from qaic_dynamo.forward_context import FROM_FORWARD_CONTEXT
from qaic_dynamo.ops import fake  # noqa: F401  (registers the fake kernels)
from qaic_dynamo.ops.registry import (
    QAIC_DOMAIN,
    QAIC_OPS,
    OpRole,
    QaicOp,
    kv_cache_update_op,
    op_name,
    qaic_op,
    splitting_ops,
)

__all__ = [
    "QAIC_DOMAIN",
    "QAIC_OPS",
    "OpRole",
    "QaicOp",
    "ctx_gather",
    "ctx_gather_cb",
    "ctx_scatter",
    "ctx_scatter_cb",
    "kv_cache_scatter",
    "kv_cache_update_op",
    "op_name",
    "qaic_op",
    "reshape_and_cache",
    "splitting_ops",
    "unified_attention",
    "unified_kv_cache_update",
    "unified_mla_attention",
    "unified_mla_kv_cache_update",
]


def reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Scatter ``key``/``value`` rows into the caches at ``slot_mapping`` (in place)."""
    torch.ops.qaic.reshape_and_cache(key, value, key_cache, value_cache, slot_mapping)


def kv_cache_scatter(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``reshape_and_cache`` without side effects: returns updated copies of the caches."""
    return torch.ops.qaic.kv_cache_scatter(key, value, key_cache, value_cache, slot_mapping)


def ctx_scatter(data: torch.Tensor, position_ids: torch.Tensor, updates: torch.Tensor) -> torch.Tensor:
    """Retained-state KV write (QEfficient's CtxScatter): an updated copy of ``data``."""
    return torch.ops.qaic.ctx_scatter(data, position_ids, updates)


def ctx_gather(data: torch.Tensor, ctx_indices: torch.Tensor) -> torch.Tensor:
    """Retained-state KV read (QEfficient's CtxGather): ``data[b, h, ctx_indices[b, h, n]]``."""
    return torch.ops.qaic.ctx_gather(data, ctx_indices)


def ctx_scatter_cb(
    data: torch.Tensor, batch_index: torch.Tensor, position_ids: torch.Tensor, updates: torch.Tensor
) -> torch.Tensor:
    """Continuous-batching retained-state write (QEfficient's CtxScatterCB): updates[b, h, s]
    -> data[batch_index[b], h, position_ids[b, s]]; only the rows named change."""
    return torch.ops.qaic.ctx_scatter_cb(data, batch_index, position_ids, updates)


def ctx_gather_cb(data: torch.Tensor, batch_index: torch.Tensor, ctx_indices: torch.Tensor) -> torch.Tensor:
    """Continuous-batching retained-state read (QEfficient's CtxGatherCB):
    ``data[batch_index[b], h, ctx_indices[b, h, n]]`` -> [B, H, N, D]."""
    return torch.ops.qaic.ctx_gather_cb(data, batch_index, ctx_indices)


def unified_kv_cache_update(
    key: torch.Tensor, value: torch.Tensor, layer_name: str = FROM_FORWARD_CONTEXT
) -> torch.Tensor:
    """Write this step's K/V into the layer's cache; returns the dependency token."""
    return torch.ops.qaic.unified_kv_cache_update(key, value, layer_name)


def unified_mla_kv_cache_update(
    kv_c_normed: torch.Tensor, k_pe: torch.Tensor, layer_name: str = FROM_FORWARD_CONTEXT
) -> torch.Tensor:
    """Write this step's MLA latent and rope key into the layer's caches."""
    return torch.ops.qaic.unified_mla_kv_cache_update(kv_c_normed, k_pe, layer_name)


def unified_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    layer_name: str,
    scale: float | None = None,
    sliding_window: int | None = None,
    kv_cache_dependency: torch.Tensor | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Paged causal attention of the batch's new tokens over the layer's cache; logits
    soft-capped as ``tanh(s / softcap) * softcap`` when given, and ``sinks[h]`` (one
    learned logit per head) joining each softmax denominator when given."""
    return torch.ops.qaic.unified_attention(
        query, key, value, layer_name, scale, sliding_window, kv_cache_dependency, softcap, sinks
    )


def unified_mla_attention(
    q_latent: torch.Tensor,
    q_pe: torch.Tensor,
    layer_name: str,
    scale: float,
    kv_cache_dependency: torch.Tensor | None = None,
) -> torch.Tensor:
    """Absorbed MLA attention over the layer's latent cache."""
    return torch.ops.qaic.unified_mla_attention(q_latent, q_pe, layer_name, scale, kv_cache_dependency)
