"""The op registry: the one place that says what each ``qaic`` op *is* to the compiler.

Each entry (:class:`QaicOp`) gives an op's :class:`OpRole` - a splitting op, a KV-cache
update, the functional scatter that lowering puts in an update's place, or a plain
kernel -, the retained-state stems of the caches an update writes, and the ONNX function
that translates it. ``config`` takes its default splitting ops from it, ``partition``
splits where it says, and ``lowering`` rewrites updates and translates ops through it;
nothing else keeps a list of qaic ops.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch

__all__ = ["QAIC_DOMAIN", "QAIC_OPS", "OpRole", "QaicOp", "kv_cache_update_op", "op_name", "qaic_op", "splitting_ops"]


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
        QaicOp(
            "qaic::unified_kv_cache_update",
            OpRole.KV_CACHE_UPDATE,
            retained_state=("past_key", "past_value"),
            lowers_to="qaic::kv_cache_scatter",
        ),
        QaicOp(
            "qaic::unified_mla_kv_cache_update",
            OpRole.KV_CACHE_UPDATE,
            retained_state=("compressed_kv", "k_pe"),
            lowers_to="qaic::kv_cache_scatter",
        ),
        QaicOp("qaic::unified_attention", OpRole.SPLITTING),
        QaicOp("qaic::ctx_scatter", OpRole.KERNEL, onnx_function="CtxScatter"),
        QaicOp("qaic::ctx_gather", OpRole.KERNEL, onnx_function="CtxGather"),
        QaicOp("qaic::ctx_scatter_cb", OpRole.KERNEL, onnx_function="CtxScatterCB"),
        QaicOp("qaic::ctx_gather_cb", OpRole.KERNEL, onnx_function="CtxGatherCB"),
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
