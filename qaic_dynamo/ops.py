"""The ``qaic`` op layer's Python face: the op registry, thin wrappers and fake kernels.

The schemas and CPU kernels are C++ (``csrc/ops.cpp``); importing this module registers a
fake implementation for each op so that Dynamo, FakeTensor and AOT tracing can propagate
shapes without running a kernel or touching a forward context. The wrappers exist for
readable call sites and docstrings; ``torch.ops.qaic.<name>`` is the same thing.

**The registry** (:data:`QAIC_OPS`) is the one place that says what each op *is* to the
compiler: its :class:`OpRole` (a splitting op, a KV-cache update, the functional scatter
that lowering puts in an update's place, or a plain kernel), the retained-state stems of
the caches an update writes, and the ONNX function that translates it. ``config`` takes
its default splitting ops from it, ``partition`` splits where it says, and ``lowering``
rewrites updates and translates ops through it; nothing else keeps a list of qaic ops.

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

import enum
from dataclasses import dataclass

import torch

from qaic_dynamo import _C  # noqa: F401  (loading the library registers the schemas)
from qaic_dynamo.forward_context import FROM_FORWARD_CONTEXT

__all__ = [
    "QAIC_DOMAIN",
    "QAIC_OPS",
    "OpRole",
    "QaicOp",
    "ctx_gather",
    "ctx_scatter",
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

#: The ONNX domain of the qaic functions (``onnx_functions``), the QAIC compiler's own.
QAIC_DOMAIN = "com.qualcomm.cloud"


class OpRole(enum.Enum):
    """What an op is to the compiler."""

    #: Reads a layer's cache through the forward context: the graph is split here and the
    #: op runs eagerly between compiled pieces.
    SPLITTING = "splitting"
    #: Writes a layer's cache: lowered to retained state (``stem`` in, ``stem_RetainedState``
    #: out) through its ``lowers_to`` op.
    KV_CACHE_UPDATE = "kv_cache_update"
    #: The pure stand-in lowering puts in a cache update's place; has an ONNX function.
    RETAINED_STATE_SCATTER = "retained_state_scatter"
    #: A plain kernel, nothing special in a graph.
    KERNEL = "kernel"


@dataclass(frozen=True)
class QaicOp:
    """One entry of the op registry."""

    #: ``namespace::name``, the form ``splitting_ops`` and op_name() use.
    name: str
    role: OpRole
    #: KV-cache updates: retained-state stems of the two caches, in argument order.
    retained_state: tuple[str, ...] = ()
    #: KV-cache updates: the registry name of the op lowering replaces them with.
    lowers_to: str | None = None
    #: Ops with an ONNX translation: the function's name in ``QAIC_DOMAIN``.
    onnx_function: str | None = None

    @property
    def overload(self) -> torch._ops.OpOverload:
        ns, name = self.name.split("::")
        return getattr(getattr(torch.ops, ns), name).default


#: Every qaic op, by ``namespace::name``.
QAIC_OPS: dict[str, QaicOp] = {
    op.name: op
    for op in (
        QaicOp("qaic::reshape_and_cache", OpRole.KERNEL),
        QaicOp("qaic::kv_cache_scatter", OpRole.RETAINED_STATE_SCATTER, onnx_function="KVCacheScatter"),
        QaicOp("qaic::unified_kv_cache_update", OpRole.KV_CACHE_UPDATE,
               retained_state=("past_key", "past_value"), lowers_to="qaic::kv_cache_scatter"),
        QaicOp("qaic::unified_mla_kv_cache_update", OpRole.KV_CACHE_UPDATE,
               retained_state=("compressed_kv", "k_pe"), lowers_to="qaic::kv_cache_scatter"),
        QaicOp("qaic::unified_attention", OpRole.SPLITTING),
        QaicOp("qaic::ctx_scatter", OpRole.KERNEL, onnx_function="CtxScatter"),
        QaicOp("qaic::ctx_gather", OpRole.KERNEL, onnx_function="CtxGather"),
        QaicOp("qaic::unified_mla_attention", OpRole.SPLITTING),
    )
}


def op_name(target: object) -> str | None:
    """Canonical 'namespace::name' of an FX call_function target, or None.

    Dynamo graphs hold OpOverloadPackets (``torch.ops.qaic.unified_attention``) for custom
    ops and Python builtins for aten ops (``torch._C._nn.scaled_dot_product_attention``);
    both map to one name so ``splitting_ops`` can be written the same way.
    """
    if isinstance(target, torch._ops.OpOverload):
        return target._schema.name
    if isinstance(target, torch._ops.OpOverloadPacket):
        return target._qualified_op_name
    name = getattr(target, "__name__", None)
    module = getattr(target, "__module__", None) or ""
    if name and module.startswith("torch") and hasattr(torch.ops.aten, name):
        return f"aten::{name}"
    return None


def qaic_op(target: object) -> QaicOp | None:
    """The registry entry of an FX target (an op overload, packet or name), or None."""
    return QAIC_OPS.get(target if isinstance(target, str) else op_name(target) or "")


def kv_cache_update_op(target: object) -> QaicOp | None:
    """The registry entry if ``target`` is a KV-cache update op, else None."""
    op = qaic_op(target)
    return op if op is not None and op.role is OpRole.KV_CACHE_UPDATE else None


def splitting_ops() -> tuple[str, ...]:
    """The registry's splitting ops: the backend's default ``splitting_ops``."""
    return tuple(name for name, op in QAIC_OPS.items() if op.role is OpRole.SPLITTING)


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


@torch.library.register_fake("qaic::kv_cache_scatter")
def _kv_cache_scatter_fake(key, value, key_cache, value_cache, slot_mapping):
    return torch.empty_like(key_cache, memory_format=torch.contiguous_format), torch.empty_like(
        value_cache, memory_format=torch.contiguous_format
    )


@torch.library.register_fake("qaic::ctx_scatter")
def _ctx_scatter_fake(data, position_ids, updates):
    torch._check(data.dim() == 4 and updates.dim() == 4 and position_ids.dim() == 2,
                 lambda: "ctx_scatter: data and updates must be 4-d, position_ids 2-d")
    return torch.empty_like(data, memory_format=torch.contiguous_format)


@torch.library.register_fake("qaic::ctx_gather")
def _ctx_gather_fake(data, ctx_indices):
    torch._check(data.dim() == 4 and ctx_indices.dim() == 3,
                 lambda: "ctx_gather: data must be 4-d and ctx_indices 3-d")
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
