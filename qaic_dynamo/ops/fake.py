"""Fake kernels of the qaic ops: shapes only, no forward context.

Registered when ``qaic_dynamo.ops`` is imported, so that Dynamo, FakeTensor and AOT
tracing can propagate shapes through the ops without running a kernel.
"""

from __future__ import annotations

import torch

from qaic_dynamo.ops.registry import QAIC_OPS, OpRole


@torch.library.register_fake("qaic::reshape_and_cache")
def _reshape_and_cache_fake(key, value, key_cache, value_cache, slot_mapping) -> None:
    # Mixed devices dispatch here (the meta key wins), so the device rule is checked here too.
    for name, t in (("key", key), ("value", value), ("slot_mapping", slot_mapping)):
        cache = value_cache if name == "value" else key_cache
        if t.device != cache.device:
            raise RuntimeError(
                f"reshape_and_cache: {name} is on {t.device} but "
                f"{'value_cache' if name == 'value' else 'key_cache'} is on {cache.device}; "
                "move them to the same device"
            )
    return None


@torch.library.register_fake("qaic::kv_cache_scatter")
def _kv_cache_scatter_fake(key, value, key_cache, value_cache, slot_mapping):
    return torch.empty_like(key_cache, memory_format=torch.contiguous_format), torch.empty_like(
        value_cache, memory_format=torch.contiguous_format
    )


@torch.library.register_fake("qaic::ctx_scatter")
def _ctx_scatter_fake(data, position_ids, updates):
    torch._check(
        data.dim() == 4 and updates.dim() == 4 and position_ids.dim() == 2,
        lambda: "ctx_scatter: data and updates must be 4-d, position_ids 2-d",
    )
    return torch.empty_like(data, memory_format=torch.contiguous_format)


@torch.library.register_fake("qaic::ctx_gather")
def _ctx_gather_fake(data, ctx_indices):
    torch._check(data.dim() == 4 and ctx_indices.dim() == 3, lambda: "ctx_gather: data must be 4-d and ctx_indices 3-d")
    return data.new_empty((ctx_indices.shape[0], ctx_indices.shape[1], ctx_indices.shape[2], data.shape[3]))


@torch.library.register_fake("qaic::ctx_scatter_cb")
def _ctx_scatter_cb_fake(data, batch_index, position_ids, updates):
    torch._check(
        data.dim() == 4 and batch_index.dim() == 2 and position_ids.dim() == 2 and updates.dim() == 4,
        lambda: "ctx_scatter_cb: data and updates must be 4-d, batch_index and position_ids 2-d",
    )
    return torch.empty_like(data, memory_format=torch.contiguous_format)


@torch.library.register_fake("qaic::ctx_gather_cb")
def _ctx_gather_cb_fake(data, batch_index, ctx_indices):
    torch._check(
        data.dim() == 4 and batch_index.dim() == 2 and ctx_indices.dim() == 3,
        lambda: "ctx_gather_cb: data must be 4-d, batch_index 2-d and ctx_indices 3-d",
    )
    return data.new_empty((ctx_indices.shape[0], ctx_indices.shape[1], ctx_indices.shape[2], data.shape[3]))


@torch.library.register_fake("qaic::unified_kv_cache_update")
def _unified_kv_cache_update_fake(key, value, layer_name):
    return key.new_empty(0)


@torch.library.register_fake("qaic::unified_mla_kv_cache_update")
def _unified_mla_kv_cache_update_fake(kv_c_normed, k_pe, layer_name):
    return kv_c_normed.new_empty(0)


@torch.library.register_fake("qaic::unified_attention")
def _unified_attention_fake(
    query, key, value, layer_name, scale=None, sliding_window=None, kv_cache_dependency=None, softcap=None, sinks=None
):
    return query.new_empty((query.shape[0], query.shape[1], value.shape[-1]))


@torch.library.register_fake("qaic::unified_mla_attention")
def _unified_mla_attention_fake(q_latent, q_pe, layer_name, scale, kv_cache_dependency=None):
    return q_latent.new_empty(q_latent.shape)


# The KV-cache updates write caches their schema cannot name (the layer comes from the
# forward context), so to FX they look pure: a graph that drops the dependency token
# (attention called without ``kv_cache_dependency``) would lose the write to dead-code
# elimination under AOTAutograd backends (aot_eager, inductor). Marked side-effectful,
# FX keeps them whatever reads their result.
for _op in QAIC_OPS.values():
    if _op.role is OpRole.KV_CACHE_UPDATE:
        torch.fx.node.has_side_effect(_op.overload)
