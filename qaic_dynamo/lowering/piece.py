"""Lower one graph piece to accelerator ONNX: the compile half of compile-and-load.

Input: a compilable piece and fake example arguments. Output: an artifact directory
(``artifact`` defines the format) holding ``model.onnx`` and ``layout.json``. Lowering
never runs the model. The piece is prepared (:mod:`.prepare`), then lowered by the
direct path - traced to aten (:mod:`.aten_trace`) and translated (:mod:`.translate`) -
or, where that cannot translate it, by torch.onnx's exporter (:mod:`.exporter`), and
finished (:mod:`.finish`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import onnx
import torch
import torch.fx as fx

from qaic_dynamo._compat import TESTED_TORCH, torch_onnx_internals
from qaic_dynamo.artifact import LAYOUT_FILE, ONNX_FILE, PieceLayout, canonical_names
from qaic_dynamo.config import CompilationConfig
from qaic_dynamo.counter import compilation_counter
from qaic_dynamo.errors import DirectPathError, LoweringError, SizeBranchError
from qaic_dynamo.lowering.aten_trace import aten_graph
from qaic_dynamo.lowering.checks import checks_to_outputs
from qaic_dynamo.lowering.common import failing_op, first_line
from qaic_dynamo.lowering.exporter import lower_with_exporter
from qaic_dynamo.lowering.finish import finish_piece_model
from qaic_dynamo.lowering.prepare import PreparedPiece, prepare
from qaic_dynamo.lowering.translate import translate_aten
from qaic_dynamo.runtime import BINDABLE, dtype_name

__all__ = ["grad_mode_refusal", "lower_piece"]

logger = logging.getLogger("qaic_dynamo")


def lower_piece(
    gm: fx.GraphModule,
    example_args: Sequence[Any],
    fake_mode: Any,
    config: CompilationConfig,
    out_dir: Path,
) -> PieceLayout:
    """Lower ``gm`` into ``out_dir`` (``model.onnx`` + ``layout.json``) and return its layout.

    ``layout.stats`` records how: ``lowered_with`` ("direct" or "exporter"),
    ``exporter_fallback`` (why the exporter was needed, naming the op) and the seconds of
    each step (``prepare``, ``aten_trace``, ``translate`` - or the whole exporter -,
    ``checks``, ``save``).
    """
    t0 = time.perf_counter()
    try:
        prepared = prepare(gm, example_args, fake_mode)
    except LoweringError:
        raise
    except Exception as e:  # a rewrite we did not foresee: say where, fall back upstream
        raise LoweringError(f"could not prepare the piece for export: {type(e).__name__}: {e}") from e
    seconds = {"prepare": time.perf_counter() - t0}

    layout = prepared.layout
    _check_bindable(layout, example_args)
    out_dir.mkdir(parents=True, exist_ok=True)
    if layout.has_model:
        t0 = time.perf_counter()
        model, fallback = _export(prepared, config.opset, seconds)
        seconds["translate"] = time.perf_counter() - t0 - seconds.get("aten_trace", 0.0)
        t0 = time.perf_counter()
        model = finish_piece_model(model, layout, config.opset)
        seconds["checks"] = time.perf_counter() - t0
        layout.export_seconds = seconds.get("aten_trace", 0.0) + seconds["translate"] + seconds["checks"]
        layout.stats = {
            "nodes": len(model.graph.node),
            "functions": sorted(f"{f.domain}::{f.name}" for f in model.functions),
            "opset": config.opset,
            "lowered_with": "direct" if fallback is None else "exporter",
            "exporter_fallback": fallback,
        }
        canon = canonical_names(example_args)  # the fingerprint's names, which every reuse maps back
        layout.size_assumptions = sorted({canon.expr(e) for e in prepared.size_assumptions})
        compilation_counter.bump(num_onnx_exports=1, num_exporter_fallbacks=int(fallback is not None))
        t0 = time.perf_counter()
        onnx.save(model, str(out_dir / ONNX_FILE))
        seconds["save"] = time.perf_counter() - t0
    layout.stats["seconds"] = seconds
    (out_dir / LAYOUT_FILE).write_text(layout.to_json())
    return layout


def grad_mode_refusal(gm: fx.GraphModule, graph_grad_mode: bool) -> str | None:
    """Why a piece must run eagerly, if it switches grad mode away from the mode its graph
    runs in (Dynamo guards that mode): a ``torch.no_grad()`` or ``enable_grad()`` block in
    the piece, or carried into it across a split (``split_module`` starts every later piece
    of such a block with the switch). A lowered piece's switches do nothing at run time, so
    compiled it would leave the caller's grad mode as it was where eager changes it, and
    return outputs without the autograd history eager gives them. Switches to the graph's
    own mode (transformers' rotary embedding ends its ``no_grad`` block that way, and the
    pieces after it start with that switch) change nothing and are compiled."""
    for node in gm.graph.nodes:
        if (
            node.op == "call_function"
            and node.target is torch._C._set_grad_enabled
            and bool(node.args[0]) != graph_grad_mode
        ):
            return (
                f"the piece switches grad mode {'on' if node.args[0] else 'off'} (torch.enable_grad() / "
                "torch.no_grad() inside the compiled code), which a lowered piece cannot do; it runs eagerly"
            )
    return None


def _check_bindable(layout: PieceLayout, example_args: Sequence[Any]) -> None:
    """Refuse, before any export, a piece whose ONNX inputs or outputs have a dtype the
    runtime cannot bind (uint16+, complex32, ...): its artifact could never load."""
    bad = [
        (o["name"], o.get("dtype")) for o in layout.outputs if getattr(torch, str(o.get("dtype")), None) not in BINDABLE
    ]
    for i in layout.inputs:
        src = i["source"]
        if src[0] == "arg" and isinstance(example_args[src[1]], torch.Tensor):
            dtype = example_args[src[1]].dtype
            if dtype not in BINDABLE:
                bad.append((i["name"], dtype_name(dtype)))
    if bad:
        raise LoweringError(
            f"the runtime cannot bind {', '.join(f'{n} ({d})' for n, d in bad)}; it binds "
            f"{sorted(dtype_name(d) for d in BINDABLE)}. Cast to a supported dtype inside the model, "
            "or leave this part to eager PyTorch"
        )


def _lower_direct(prepared: PreparedPiece, opset: int, seconds: dict[str, float]) -> onnx.ModelProto:
    """Translate the piece's aten graph node by node through the exporter's registry."""
    t0 = time.perf_counter()
    try:
        # At the example sizes, a branch a decomposition takes on a size (a split's
        # remainder at 17) must hold at every size Dynamo sends this graph.
        gm = aten_graph(
            prepared.gm, prepared.example, prepared.dynamic_shapes, opset, guards_follow_from=prepared.dynamo_sizes
        )
    except LoweringError:
        raise
    except Exception as at_primes:
        if prepared.real_example is None:
            raise
        try:  # the sizes Dynamo saw satisfy its guards (see export_inputs)
            gm = aten_graph(
                prepared.gm,
                prepared.real_example,
                prepared.dynamic_shapes,
                opset,
                keep_symbols_apart=True,
                guards_follow_from=prepared.dynamo_sizes,
            )
        except SizeBranchError:
            raise  # never hand such a piece to the exporter (see SizeBranchError)
        except Exception:
            raise at_primes from None
    seconds["aten_trace"] = time.perf_counter() - t0
    prepared.size_assumptions = list(gm.meta.get("size_assumptions", ()))
    layout = prepared.layout
    extra = [*_written_back(prepared, gm.meta.get("written_back", ()))]
    extra += checks_to_outputs(gm, first=len(layout.outputs) + len(extra), updates_caches=bool(layout.kv_updates))
    model = translate_aten(gm, prepared.input_names, [*prepared.output_names, *(c["name"] for c in extra)], opset)
    # Only now: the exporter, should the translation fail, lowers the piece as prepared.
    layout.outputs = [*layout.outputs, *extra]
    prepared.output_names = [*prepared.output_names, *(c["name"] for c in extra)]
    return model


def _written_back(prepared: PreparedPiece, inputs: Sequence[int]) -> list[dict[str, Any]]:
    """Layout outputs for the inputs the aten graph writes back (by ONNX input index)."""
    outputs = []
    for k in inputs:
        source = prepared.layout.inputs[k]["source"]
        arg = source[1]
        if source[0] != "arg" or arg in prepared.unwritable:
            why = prepared.unwritable.get(arg, "is not an argument")
            raise LoweringError(f"the piece writes its input {arg} in place, which {why}; it runs eagerly")
        outputs.append({"name": f"written{arg}", "target": ["write", arg], **prepared.input_meta[arg]})
    return outputs


def _export(prepared: PreparedPiece, opset: int, seconds: dict[str, float]) -> tuple[onnx.ModelProto, str | None]:
    """The piece's ONNX model, and why the exporter had to be used (None: direct path).
    Records ``aten_trace`` (direct path) in ``seconds``."""
    if torch_onnx_internals() is None:
        reason = f"no direct path on torch {torch.__version__} (tested: {TESTED_TORCH})"
    else:
        try:
            return _lower_direct(prepared, opset, seconds), None
        except LoweringError:
            raise
        except SizeBranchError as e:
            raise LoweringError(
                f"its lowering branches on a dynamic size ({e}); compiled, it would serve sizes the branch is wrong for"
            ) from e
        except DirectPathError as e:
            reason = str(e)
        except Exception as e:  # the trace or a pass failed: the exporter may still manage
            reason = f"{failing_op(e)}: {first_line(e)}"
    logger.info("qaic: direct lowering failed (%s); using the exporter", reason)
    return lower_with_exporter(prepared, opset), reason
