"""ONNX op signatures: inferred when first needed, and memoized while translating.

Every onnxscript function in the registry carries the ONNX signature dispatch matches a
node's arguments against. Inferring all ~560 of them up front costs every cold process
that lowers, for the dozen ops a transformer uses, so the registry leaves them uninferred
(:func:`leave_uninferred`) and :func:`infer_op_signatures` infers those of a graph's ops
before it is translated.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from typing import Any

import torch.fx as fx

from qaic_dynamo.process_wide import ProcessWide

__all__ = ["infer_op_signatures", "leave_uninferred", "memoized_op_signatures"]

_signature_lock = threading.Lock()
#: The registry's metas whose signature :func:`infer_op_signatures` has yet to infer, by
#: id (torch's own torchlib metas may skip inference on purpose; those are never touched).
#: Held here, so that no later object can take a freed meta's id.
_UNINFERRED: dict[int, Any] = {}


def infer_op_signatures(registry: Any, graphs: Iterable[fx.Graph] | None) -> None:
    """Infer the ONNX signature of every registry function an op of ``graphs`` may
    dispatch to (every function, for None), as ``OnnxDecompMeta`` does at construction.

    :func:`~qaic_dynamo.lowering.registry.onnx_registry` leaves them uninferred; dispatch must never see one that way, as
    it would then pick that function whatever the node's argument types."""
    if graphs is None:
        metas = [m for ms in registry.functions.values() for m in ms]
    else:
        targets = {n.target for g in graphs for n in g.nodes if n.op == "call_function"}
        metas = [m for t in targets for m in registry.get_decomps(t)]
    with _signature_lock:
        for meta in metas:
            if _UNINFERRED.get(id(meta)) is meta:
                meta.skip_signature_inference = False
                meta.__post_init__()  # the inference OnnxDecompMeta would have run
                del _UNINFERRED[id(meta)]


def leave_uninferred(meta: Any) -> None:
    """Mark a registry meta built with ``skip_signature_inference=True`` as ours to infer."""
    with _signature_lock:
        _UNINFERRED[id(meta)] = meta  # held here, so the id stays its own


_OP_SIGNATURES: dict[tuple[str, str, int], Any] = {}


def _memoize_op_signatures() -> Any:
    from onnx_ir.schemas import OpSignature

    original = OpSignature.__dict__["from_op_schema"]
    build = original.__func__

    def from_op_schema(cls: type, schema: Any) -> Any:
        key = (schema.domain, schema.name, schema.since_version)
        sig = _OP_SIGNATURES.get(key)
        if sig is None:
            sig = _OP_SIGNATURES[key] = build(cls, schema)
        return sig

    OpSignature.from_op_schema = classmethod(from_op_schema)
    return original


def _unmemoize_op_signatures(original: Any) -> None:
    from onnx_ir.schemas import OpSignature

    OpSignature.from_op_schema = original


#: While translating, ``onnx_ir``'s ``OpSignature.from_op_schema`` answers from a
#: process-wide memo keyed by (domain, op, since_version). The exporter's op recorder
#: rebuilds the signature of an ONNX op's schema on every node it emits (and each build
#: hashes every allowed type of every constraint): about a third of a piece's translation
#: time, for a value that depends only on the schema. The signature is read, never
#: changed, by the recorder. The patch is undone when the last translation in progress
#: (threads may overlap) ends, so nothing outside our own translations sees it.
memoized_op_signatures = ProcessWide(_memoize_op_signatures, _unmemoize_op_signatures).held
