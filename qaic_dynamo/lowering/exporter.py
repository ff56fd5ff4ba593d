"""The fallback for a piece the direct path cannot translate: torch.onnx's exporter.

torch.export, ``run_decompositions`` (with the project's semantics first) and
translation - through the exporter core with the cached registry when the private
pieces are available, else the public ``torch.onnx.export``. Its size guards are checked
as the direct path's are. Slower than the direct path; counted
(``num_exporter_fallbacks``) and reported with the op that forced it.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator, Sequence
from typing import Any

import onnx
import sympy
import torch

from qaic_dynamo._compat import no_tracing_context, torch_onnx_internals
from qaic_dynamo.errors import LoweringError, SizeBranchError
from qaic_dynamo.lowering.common import first_line
from qaic_dynamo.lowering.prepare import PreparedPiece
from qaic_dynamo.lowering.registry import onnx_registry, qaic_translations
from qaic_dynamo.lowering.semantics import TORCH_SEMANTICS, open_sdpa
from qaic_dynamo.lowering.signatures import infer_op_signatures
from qaic_dynamo.lowering.size_guards import guards_not_implied

__all__ = ["UNTRANSLATABLE_OP_FIXES", "lower_with_exporter"]

_aten = torch.ops.aten


@contextlib.contextmanager
def _exporter_noise_suppressed() -> Iterator[None]:
    """Silence the one warning torch's exporter emits on every export that no caller can
    act on: ``run_decompositions`` deep-copies its module call graph, and unpickling a
    ``LeafSpec`` there raises pytree's deprecation FutureWarning (torch 2.13)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r".*isinstance\(treespec, LeafSpec\).*", category=FutureWarning)
        yield


def lower_with_exporter(prepared: PreparedPiece, opset: int) -> onnx.ModelProto:
    """The fallback: torch.export, run_decompositions and translation (the exporter core
    with our cached registry when available, else the public ``torch.onnx.export``). An
    export whose size guards do not follow from Dynamo's is tried again at the sizes
    Dynamo saw, as the direct path's trace is."""
    try:
        try:
            return _exported_model(prepared, prepared.example, opset)
        except SizeBranchError:
            if prepared.real_example is None:
                raise
            return _exported_model(prepared, prepared.real_example, opset)
    except SizeBranchError as e:
        raise LoweringError(
            f"its export branches on a dynamic size ({e}); compiled, it would serve sizes the branch is wrong for"
        ) from e
    except Exception as e:
        raise LoweringError(f"the ONNX exporter failed: {first_line(e)}{_fix_hint(e)}") from e


#: Other libraries' ops with no ONNX translation, and what a user does instead.
UNTRANSLATABLE_OP_FIXES = {
    "transformers.grouped_mm_fallback": (
        "transformers' default 'grouped_mm' experts run an opaque loop over data-dependent group sizes; call "
        "model.set_experts_implementation('batched_mm') before compiling (qaic_dynamo.LLM does)"
    ),
}


def _fix_hint(e: BaseException) -> str:
    text = str(e)
    return next(
        (f" ({fix})" for op, fix in UNTRANSLATABLE_OP_FIXES.items() if f"'{op}'" in text or f"{op}." in text), ""
    )


def _exported_model(prepared: PreparedPiece, example: Sequence[torch.Tensor], opset: int) -> onnx.ModelProto:
    common = dict(
        dynamic_shapes=tuple(prepared.dynamic_shapes),
        input_names=prepared.input_names,
        output_names=prepared.output_names,
        # The exporter's optimizer would inline KVCacheScatter; ONNX Runtime optimises the
        # graph itself when it loads it, and the QAIC compiler wants the function intact.
        optimize=False,
        verbose=False,
    )
    # The exporter traces with torch.export. Run it outside Dynamo's tracing context,
    # or the guards it records on its own inputs leak into the frame being compiled.
    with no_tracing_context(), _exporter_noise_suppressed():
        # Non-strict only, and here: given a module, the exporter retries a failed
        # non-strict export with strict=True, i.e. with Dynamo - inside the Dynamo
        # compile that called this backend. Dynamo's export then drops the cache entries
        # of the code it was handed (or, for a callable it cannot key, all of them),
        # and the outer compile crashed building its guards on the freed entries
        # (InternalTorchDynamoError or a segfault; seen on a recompile of a model whose
        # float attribute had become a graph input).
        exported = torch.export.export(
            prepared.gm, tuple(example), dynamic_shapes=tuple(prepared.dynamic_shapes), strict=False
        )
        # Eager's arithmetic on this path too (the exporter's own decompositions follow);
        # torch.export keeps sdpa whole, so it is opened to reach the CPU kernel's op.
        exported = exported.run_decompositions(
            {**TORCH_SEMANTICS, _aten.scaled_dot_product_attention.default: open_sdpa}
        )
        internals = torch_onnx_internals()
        if internals is not None:
            # opset_version=None: the registry already targets the opset, so no version
            # conversion (which would also inline every function) is needed.
            registry = onnx_registry(opset)
            # The exporter's own decompositions, run here (its own run then finds
            # nothing left): a branch they take on a size is a guard to check too.
            exported = internals.fx_passes.decompose_with_registry(exported, registry)
            _check_export_guards(exported, prepared)
            infer_op_signatures(registry, None)  # the exporter's graph is not known before it runs
            program = internals.core.export(exported, registry=registry, opset_version=None, **common)
        else:
            # Only torch.export's guards can be checked: the public exporter's own
            # decompositions happen inside it (docs/usage.md).
            _check_export_guards(exported, prepared)
            program = torch.onnx.export(
                exported,
                dynamo=True,
                opset_version=opset,
                custom_translation_table=qaic_translations(),
                **common,
            )
        return program.model_proto


def _check_export_guards(exported: Any, prepared: PreparedPiece) -> None:
    """Refuse an export whose size guards (torch.export traced at the example sizes, and
    the decompositions after it, may branch on a size: a split's remainder, a pooling
    window) do not follow from Dynamo's guards; record the implied ones as the
    artifact's assumptions, as the direct path does."""
    if not prepared.dynamo_sizes:
        return
    placeholders = {n.name: n for n in exported.graph.nodes if n.op == "placeholder"}
    values = [placeholders[name].meta.get("val") for name in exported.graph_signature.user_inputs]
    shape_env = next(
        (
            d.node.shape_env
            for v in values
            if isinstance(v, torch.Tensor)
            for d in v.shape
            if isinstance(d, torch.SymInt)
        ),
        None,
    )
    if shape_env is None:
        return
    implied: list[sympy.Basic] = []
    unproven = guards_not_implied(values, shape_env, prepared.dynamo_sizes, strict=False, implied=implied)
    if unproven:
        raise SizeBranchError("(export)", f"size guards {unproven} do not follow from Dynamo's")
    prepared.size_assumptions = implied
