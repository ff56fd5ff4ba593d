"""Trace an engine model in retained-state form into one aten graph, and identify it.

The trace is the lowering's direct path (``lowering.aten_graph``): no torch.export.
:func:`model_identity` is what distinguishes one model from another in the export's hash.
"""

from __future__ import annotations

import dataclasses
import hashlib
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx
import torch.nn as nn

from qaic_dynamo.deploy.export.retained_state import RetainedStateModel
from qaic_dynamo.errors import ExportError
from qaic_dynamo.lowering import aten_graph
from qaic_dynamo.models import load_model, model_config

__all__ = [
    "INDEX_ATTRS",
    "Trace",
    "block_signature",
    "engine_model_of",
    "model_identity",
    "model_weights",
    "trace_model",
]

#: Attributes that hold a block's own index or name (normalised before comparing blocks).
INDEX_ATTRS = ("layer_idx", "layer_id", "layer_index", "layer_number", "idx")


def engine_model_of(model: Any, dtype: torch.dtype | None = None) -> nn.Module:
    """The engine form of ``model`` (what ``LLM`` runs), in ``dtype`` if given (a copy of its
    weights; the model given is left alone)."""
    try:
        m = load_model(model, dtype=dtype)
    except (TypeError, FileNotFoundError, NotImplementedError) as e:  # not a model, or one the qaic ops cannot run
        raise ExportError(str(e).replace("LLM:", "export_for_qaic:")) from e
    return m.eval()


def model_identity(engine_model: nn.Module) -> dict[str, Any]:
    """What distinguishes one model from another in the export hash: its class, its
    config, the plain settings of every module (e.g. an attention's ``scaling`` set after
    loading) and a digest of every byte of every parameter and buffer.

    All of it, not a sample: the hash names the directory an export writes, so two models
    that hashed alike would overwrite each other's artifact (hashing the weights costs
    less than writing them)."""
    cfg = model_config(engine_model, text=False)  # all of it: a multimodal model's top-level settings too
    cfg_dict = (
        cfg.to_dict()
        if hasattr(cfg, "to_dict")
        else (dataclasses.asdict(cfg) if dataclasses.is_dataclass(cfg) else repr(cfg))
    )
    h = hashlib.sha256(repr(block_signature(engine_model, None)).encode())
    for name, t in model_weights(engine_model).items():  # non-persistent buffers too (rotary inv_freq)
        h.update(f"{name}:{tuple(t.shape)}:{t.dtype}".encode())
        h.update(t.contiguous().reshape(-1).view(torch.uint8).numpy())
    return {"class": type(engine_model).__name__, "config": cfg_dict, "weights": h.hexdigest()[:16]}


def model_weights(model: nn.Module, exclude: Sequence[str] = ()) -> dict[str, torch.Tensor]:
    """Parameters and buffers by qualified name (tied weights once), but ``exclude``."""
    out = {name: p.detach() for name, p in model.named_parameters()}
    out.update({name: b.detach() for name, b in model.named_buffers()})
    return {k: v for k, v in out.items() if k not in exclude}


@dataclass
class Trace:
    """One traced export: the aten graph and what each of its inputs is."""

    gm: fx.GraphModule
    #: ("input", name) | ("past", layer, j) | ("weight", qualified name), per placeholder.
    inputs: list[tuple]
    stems: dict[int, tuple[str, ...]]
    num_layers: int
    #: Non-KV retained-state buffers (I/O named after them, never prefixed).
    retained: list[str] = field(default_factory=list)


def trace_model(
    model: nn.Module,
    layer_names: list[str],
    past_shapes: list[tuple[tuple[int, ...], ...]],
    dtype: torch.dtype,
    opset: int,
    retained: Sequence[str] = (),
    continuous_batching: bool = False,
    compute_context_lengths: bool = False,
) -> Trace:
    """Trace ``model`` (the engine form) as input_ids, position_ids, [batch_index],
    [comp_ctx_lengths], past..., retained buffers..., weights -> logits [B, 1, V], updated
    past..., retained buffers... through the lowering's direct path."""
    weights = model_weights(model, exclude=retained)
    buffers = dict(model.named_buffers())
    weight_names = list(weights)
    past_spec = [(i, j) for i, shapes in enumerate(past_shapes) for j in range(len(shapes))]
    wrapper = RetainedStateModel(
        model, [len(shapes) for shapes in past_shapes], continuous_batching, compute_context_lengths
    )
    extra_inputs = ["batch_index"] * continuous_batching + ["comp_ctx_lengths"] * compute_context_lengths

    def forward(input_ids: torch.Tensor, position_ids: torch.Tensor, *rest: torch.Tensor):
        extra, rest = rest[: len(extra_inputs)], rest[len(extra_inputs) :]
        n_past = len(past_spec)
        flat_past, kept, params = rest[:n_past], rest[n_past : n_past + len(retained)], rest[n_past + len(retained) :]
        tensors = {f"model.{k}": v for k, v in zip(weight_names, params)}
        tensors.update((f"model.{k}", v) for k, v in zip(retained, kept))
        out = torch.func.functional_call(wrapper, tensors, (input_ids, position_ids, *extra, *flat_past))
        # A retained buffer leaves as its value after the step (a copy: an ONNX output
        # must be a value of its own, not the input).
        return (*out, *[tensors[f"model.{name}"].clone() for name in retained])

    # Distinct and not 0/1, so that every one stays a symbol of its own.
    batch, seq, ctx, full_batch, ccl = 3, 5, 17, 7, 11
    rows = full_batch if continuous_batching else batch
    ex_ids = torch.zeros(batch, seq, dtype=torch.long)
    ex_pos = torch.arange(seq).repeat(batch, 1)
    ex_extra = {
        "batch_index": torch.arange(batch).reshape(batch, 1),
        "comp_ctx_lengths": torch.zeros(ccl, dtype=torch.long),
    }
    dims_extra = {"batch_index": {0: "batch_size"}, "comp_ctx_lengths": {0: "comp_ctx_lengths"}}
    ex_past = [
        torch.zeros((rows, *shape[1:2], ctx, *shape[3:]), dtype=dtype) for shapes in past_shapes for shape in shapes
    ]
    example = [
        ex_ids,
        ex_pos,
        *(ex_extra[n] for n in extra_inputs),
        *ex_past,
        *[buffers[n].detach() for n in retained],
        *weights.values(),
    ]
    dynamic = (
        [{0: "batch_size", 1: "seq_len"}] * 2
        + [dims_extra[n] for n in extra_inputs]
        + [{0: "full_batch_size" if continuous_batching else "batch_size", 2: "ctx_len"}] * len(ex_past)
        + [None] * (len(retained) + len(weights))
    )
    try:
        with torch.no_grad(), torch.fx.traceback.preserve_node_meta():
            gm = aten_graph(forward, example, dynamic, opset)
    except ExportError:
        raise
    except Exception as e:  # torch's own trace errors name its internals, not the model's problem
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise ExportError(f"the model could not be traced for export: {type(e).__name__}: {first}") from e
    inputs = (
        [("input", "input_ids"), ("input", "position_ids")]
        + [("input", n) for n in extra_inputs]
        + [("past", i, j) for i, j in past_spec]
        + [("retained", n) for n in retained]
        + [("weight", n) for n in weight_names]
    )
    return Trace(gm, inputs, dict(wrapper.stems), len(past_shapes), list(retained))


def block_signature(block: nn.Module, index: int | None) -> list[tuple]:
    """What makes a block's graph: its module tree, its parameter and buffer shapes, and
    the plain settings of each module (window sizes, flags, types), with the block's own
    index and name taken out (``index`` None: nothing taken out)."""

    def setting(key: str, v: Any) -> Any:
        if index is None:
            return v
        if key in INDEX_ATTRS and v == index:
            return "<index>"
        if isinstance(v, str):
            return re.sub(rf"(^|\.){index}(\.|$)", r"\1<index>\2", v)
        return v

    plain = (bool, int, float, str, type(None))
    sig = []
    for name, mod in block.named_modules():
        settings = tuple(
            sorted(
                (k, setting(k, v))
                for k, v in vars(mod).items()
                if not k.startswith("_")
                and (isinstance(v, plain) or (isinstance(v, tuple) and all(isinstance(x, plain) for x in v)))
            )
        )
        tensors = tuple(
            (k, tuple(t.shape), t.dtype)
            for k, t in [*mod.named_parameters(recurse=False), *mod.named_buffers(recurse=False)]
        )
        sig.append((name, type(mod).__qualname__, settings, tensors))
    return sig
