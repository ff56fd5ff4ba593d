"""torch.onnx's op registry and decomposition table, built once per process and opset.

The registry maps each aten op to the onnxscript function that translates it, with every
qaic op that has an ONNX function (``ops.onnx_functions``) as a custom translation. The
decomposition table covers every op the registry cannot translate directly, with the
project's own semantics (:data:`~qaic_dynamo.lowering.semantics.TORCH_SEMANTICS`) first.
Both are built faster than torch.onnx builds them (see each function), with the same
result.
"""

from __future__ import annotations

import functools
import itertools
import threading
from collections.abc import Callable
from typing import Any

import torch

from qaic_dynamo._compat import torch_onnx_internals
from qaic_dynamo.lowering.deferred import deferred_script_conversion
from qaic_dynamo.lowering.semantics import TORCH_SEMANTICS
from qaic_dynamo.lowering.signatures import leave_uninferred, memoized_op_signatures
from qaic_dynamo.ops import QAIC_OPS

__all__ = ["build_onnx_registry", "decompositions", "functional_semantics", "onnx_registry", "qaic_translations"]


def qaic_translations() -> dict[Any, Any]:
    """torch.onnx custom translations: every registry op that has an ONNX function."""
    # onnxscript is imported only when something is lowered: loading cached artifacts
    # never needs it.
    from qaic_dynamo.ops.onnx_functions import TRANSLATIONS

    return {op.overload: TRANSLATIONS[op.onnx_function] for op in QAIC_OPS.values() if op.onnx_function}


_registry_lock = threading.Lock()
_registries: dict[int, Any] = {}


def onnx_registry(opset: int) -> Any:
    """:func:`build_onnx_registry`, once per opset and process (under a lock: two threads
    lowering in a cold process build it once)."""
    with _registry_lock:
        if opset not in _registries:
            _registries[opset] = build_onnx_registry(opset)
        return _registries[opset]


def build_onnx_registry(opset: int) -> Any:
    """A new torch.onnx op registry with our translations (use :func:`onnx_registry`).

    The same registry as ``ONNXRegistry.from_torchlib``, built without its one slow step:
    that lists onnxscript's torch library through ``get_torchlib_ops()``, which parses the
    source of every one of ~540 functions (``function_ir``) only to read a domain the
    registry never uses - half of its time, paid by every cold process that lowers.
    ``test_registry_matches_from_torchlib`` checks that both give the same functions.

    The ONNX signature of each onnxscript function (what dispatch matches a node's
    arguments against) is inferred when a graph first uses its op
    (:func:`infer_op_signatures`), not here: inferring all ~560 up front costs every cold
    process, for the dozen ops a transformer uses.
    """
    reg = torch_onnx_internals().registration
    # Importing the ops registers them in onnxscript's default registry.
    with deferred_script_conversion():
        from onnxscript.function_libs.torch_lib import ops, registration  # noqa: F401

    registry = reg.ONNXRegistry()
    registry._opset_version = opset
    for meta in reg._torchlib_registry.get_torchlib_ops():
        registry._register(meta.fx_target, meta)
    for qualified_name, funcs in registration.default_registry.items():
        if qualified_name.startswith("internal::"):
            continue
        target = reg._get_overload(qualified_name)
        if target is None:
            continue
        for fn, is_complex in [(f, False) for f in funcs.overloads] + [(f, True) for f in funcs.complex]:
            meta = reg.OnnxDecompMeta(
                onnx_function=fn,
                fx_target=target,
                signature=None,
                is_custom=False,
                is_complex=is_complex,
                skip_signature_inference=True,
            )
            leave_uninferred(meta)
            registry._register(target, meta)
    registry._cleanup_registry_based_on_opset_version()
    with memoized_op_signatures():  # converting our functions builds a signature per op call
        translations = qaic_translations()
    for target, fn in translations.items():
        registry.register_op(target, fn, is_complex=False)
    return registry


@functools.cache
def decompositions(opset: int) -> dict[Any, Any]:
    """Decompositions for every op the registry cannot translate directly (once per opset).

    torch.onnx's ``create_onnx_friendly_decomposition_table`` without the entries it takes
    from ``torch.export.default_decompositions()`` for CompositeImplicitAutograd ops: those
    run the op's CompositeImplicitAutograd kernel, which ``make_fx`` runs anyway for an op
    autograd would have decomposed - and finding them walks every operator of the
    dispatcher, most of the table's time in every cold process. The core ATen
    decompositions and torch._decomp's table are kept, first-found wins, as there.
    Every piece of the reference models and six transformers families, whole and
    regional, lowers to byte-identical ONNX with either table (a slow test checks it);
    ``test_decompositions_are_the_exporters_without_its_composite_implicit_entries``
    checks the tables.
    """
    internals = torch_onnx_internals()
    translated = set(internals.decomp.get_onnx_implemented_overloads(onnx_registry(opset)))
    core_aten = internals.torch_decomp._core_aten_decompositions_post_autograd()
    table: dict[Any, Any] = {}
    for op, fn in itertools.chain(core_aten.items(), internals.torch_decomp.decomposition_table.items()):
        if op in translated or not hasattr(op, "_schema") or op in table:
            continue
        # Where torch.onnx's table holds the CompositeImplicitAutograd entry (first found),
        # leave the op out: make_fx then runs that same kernel.
        if (
            op not in core_aten
            and internals.export_utils._is_preservable_cia_op(op)
            and op not in internals.preserved_cia
        ):
            continue
        table[op] = fn
    for op, ours in TORCH_SEMANTICS.items():
        # Where ours declines (NotImplemented: a dtype it leaves alone), the op's own
        # decomposition, if the table had one, must still run: without it an op the
        # registry cannot translate (index_add) sends the piece to the exporter.
        table[op] = ours if op not in table else _or_else(ours, table[op])
    return table


@functools.cache
def functional_semantics() -> dict[Any, Any]:
    """The semantics of ops that only functionalising produces (the functional form of a
    mutable op): the table for the trace that removes mutations."""
    return {op: fn for op, fn in TORCH_SEMANTICS.items() if op in _FUNCTIONAL_FORMS}


_FUNCTIONAL_FORMS = frozenset({torch.ops.aten._native_batch_norm_legit_functional.default})


def _or_else(first: Callable[..., Any], then: Callable[..., Any]) -> Callable[..., Any]:
    """``first``, or ``then`` where ``first`` returns NotImplemented."""

    def decomposition(*args: Any, **kwargs: Any) -> Any:
        out = first(*args, **kwargs)
        return then(*args, **kwargs) if out is NotImplemented else out

    return decomposition
