"""Python face of the ``qaic`` op library: thin wrappers and fake kernels.

The schemas and CPU kernels are C++ (``csrc/ops.cpp``); importing this module registers a
fake implementation for each op so that Dynamo, FakeTensor and AOT tracing can propagate
shapes without running a kernel or touching a forward context. The wrappers exist for
readable call sites and docstrings; ``torch.ops.qaic.<name>`` is the same thing.

Op contracts (shapes use T = tokens, H = heads, D = head size):

* ``reshape_and_cache(key[T,Hkv,D], value[T,Hkv,Dv], key_cache!, value_cache!, slot_mapping[T'])``
  writes row t to slot ``slot_mapping[t]`` for ``t < T'`` (``T' <= T``; extra key rows are
  padding). Slot -1 writes nothing.
* ``unified_kv_cache_update(key, value, layer_name) -> dep`` resolves the layer in the
  forward context, writes its caches with the context's slot mapping and returns an empty
  dependency tensor that attention takes, so the graph orders the read after the write.
* ``unified_mla_kv_cache_update(kv_c_normed[T,R], k_pe[T,P] | [T,1,P], layer_name) -> dep``:
  the same for MLA latent caches ``(compressed_kv[N,1,B,R], k_pe[N,1,B,P])``.
* ``unified_attention(query[T,Hq,D], key, value, layer_name, scale=None,
  sliding_window=None, kv_cache_dependency=None) -> [T,Hq,Dv]``: causal attention of each
  sequence's new tokens over its cached tokens (GQA when Hq > Hkv). A splitting op.
* ``unified_mla_attention(q_latent[T,H,R], q_pe[T,H,P], layer_name, scale,
  kv_cache_dependency=None) -> [T,H,R]``: absorbed MLA attention. A splitting op.
"""

from __future__ import annotations

import torch

from qaic_dynamo import _C  # noqa: F401  (loading the library registers the schemas)
from qaic_dynamo.forward_context import FROM_FORWARD_CONTEXT

__all__ = [
    "reshape_and_cache",
    "unified_attention",
    "unified_kv_cache_update",
    "unified_mla_attention",
    "unified_mla_kv_cache_update",
    "KV_CACHE_UPDATE_OPS",
    "ATTENTION_OPS",
]

#: The ops that write a layer's cache; they can sit inside a compiled piece.
KV_CACHE_UPDATE_OPS = (
    torch.ops.qaic.unified_kv_cache_update.default,
    torch.ops.qaic.unified_mla_kv_cache_update.default,
)
#: The ops that read a layer's cache; the default splitting ops.
ATTENTION_OPS = (
    torch.ops.qaic.unified_attention.default,
    torch.ops.qaic.unified_mla_attention.default,
)


def reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Scatter ``key``/``value`` rows into the caches at ``slot_mapping`` (in place)."""
    torch.ops.qaic.reshape_and_cache(key, value, key_cache, value_cache, slot_mapping)


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
) -> torch.Tensor:
    """Paged causal attention of the batch's new tokens over the layer's cache."""
    return torch.ops.qaic.unified_attention(
        query, key, value, layer_name, scale, sliding_window, kv_cache_dependency
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


# --- fake kernels: shapes only, no forward context -------------------------------------


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


@torch.library.register_fake("qaic::unified_kv_cache_update")
def _unified_kv_cache_update_fake(key, value, layer_name):
    return key.new_empty(0)


@torch.library.register_fake("qaic::unified_mla_kv_cache_update")
def _unified_mla_kv_cache_update_fake(kv_c_normed, k_pe, layer_name):
    return kv_c_normed.new_empty(0)


@torch.library.register_fake("qaic::unified_attention")
def _unified_attention_fake(
    query, key, value, layer_name, scale=None, sliding_window=None, kv_cache_dependency=None
):
    return query.new_empty((query.shape[0], query.shape[1], value.shape[-1]))


@torch.library.register_fake("qaic::unified_mla_attention")
def _unified_mla_attention_fake(q_latent, q_pe, layer_name, scale, kv_cache_dependency=None):
    return q_latent.new_empty(q_latent.shape)
