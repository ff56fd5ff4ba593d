"""Build an export's ONNX model: the engine model in the exported dtype, traced once and
translated - one decoder block stitched L times, or the whole model.

:func:`prepare` loads the model and decides what it is exported in (its dtype policy,
identity and cache shapes); :func:`build` traces and translates it. A pair export
(prefill-only and decode-only) builds once and writes the model twice.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import onnx
import torch
import torch.nn as nn

from qaic_dynamo.compiler.regions import find_repeated_blocks
from qaic_dynamo.deploy.export.assemble import name_dims, whole_model
from qaic_dynamo.deploy.export.layerwise import BLOCK_ANNOTATION, layerwise_model
from qaic_dynamo.deploy.export.options import SPECIALIZED_DISAGG_SERVING_MODEL_ARCH, ExportOptions
from qaic_dynamo.deploy.export.precision import Precision, resolve_precision
from qaic_dynamo.deploy.export.rewrites import outputs_without_identities, splits_without_sequences
from qaic_dynamo.deploy.export.trace import (
    Trace,
    block_signature,
    engine_model_of,
    model_identity,
    model_weights,
    trace_model,
)
from qaic_dynamo.errors import BlocksDiffer, ExportError
from qaic_dynamo.models import batch_dependent_rope, max_positions, max_positions_text, model_config

__all__ = ["Built", "Prepared", "build", "check_uniform_blocks", "first_blocks", "prepare"]


@dataclass
class Prepared:
    """A model ready to trace: its engine form in the exported dtype, and what the export
    hash and the compiler inputs need to know of it."""

    engine_model: nn.Module
    precision: Precision
    identity: dict[str, Any]
    layer_names: list[str]
    past_shapes: list[tuple[tuple[int, ...], ...]]
    retained: list[str]
    weights: dict[str, torch.Tensor]
    model_type: str | None
    #: Warnings for the summary (an option that changes nothing for this model).
    notes: list[str] = field(default_factory=list)
    seconds: dict[str, float] = field(default_factory=dict)


@dataclass
class Built:
    """A translated model: the ONNX (weights not yet attached) and its output names."""

    model: onnx.ModelProto
    outputs: list[str]
    traced_layers: int
    seconds: dict[str, float] = field(default_factory=dict)


def _source_dtype(model: Any) -> torch.dtype | None:
    """The dtype a model instance's weights are in (None: a path or name, loaded as stored)."""
    if isinstance(model, nn.Module):
        p = next(model.parameters(), None)
        return p.dtype if p is not None else None
    return None


def prepare(model: Any, opts: ExportOptions) -> Prepared:
    """Load ``model`` in its exported dtype and check it can be exported with ``opts``."""
    t0 = time.perf_counter()
    engine_model = engine_model_of(model)
    source = next(engine_model.parameters()).dtype
    precision = resolve_precision(source, opts.hw_version, opts.kv_precision)
    if precision.exported != source:
        engine_model = engine_model_of(model, dtype=precision.exported)
    cfg = model_config(engine_model)
    model_type = getattr(cfg, "model_type", None)
    if opts.prefill_only and opts.continuous_batching and model_type in SPECIALIZED_DISAGG_SERVING_MODEL_ARCH:
        raise ExportError(
            f"prefill_only=True with continuous batching (full_batch_size) is refused for {model_type!r}, as "
            "QEfficient refuses it for its specialized disaggregated-serving architectures without chunked prefill "
            f"({sorted(SPECIALIZED_DISAGG_SERVING_MODEL_ARCH)}); export the prefill artifact without full_batch_size"
        )
    notes = [precision.note] if precision.note else []
    if opts.retain_full_kv and getattr(cfg, "sliding_window", None) is None:
        notes.append(
            "retain_full_kv changes nothing for this model: it has no sliding-window layers, and every "
            "layer's KV holds ctx_len positions"
        )
    positions = max_positions(engine_model)
    if positions is not None and opts.ctx_len > positions:  # as LLM's max_model_len
        raise ExportError(
            f"ctx_len={opts.ctx_len} exceeds the model's {max_positions_text(engine_model)}; "
            f"pass ctx_len <= {positions}"
        )
    rope = batch_dependent_rope(engine_model)
    if rope is not None:
        # transformers picks these frequencies in Python from the longest position in the
        # forward (and longrope's from a tensor attribute it swaps): a traced graph would
        # keep one choice for every sequence.
        raise ExportError(
            f"the model's rope_type {rope[0]!r} chooses its RoPE frequencies from the sequence length "
            "at run time, which an exported graph cannot; export a model with a fixed rope_type "
            "(default, linear, llama3, yarn), or serve this one with LLM(...)"
        )
    layer_names = list(engine_model.kv_cache_layers)
    shapes = engine_model.kv_cache_shapes(opts.batch_size, opts.ctx_len)
    buffers = dict(engine_model.named_buffers())
    unknown = [n for n in opts.retained_buffers if n not in buffers]
    if unknown:
        raise ExportError(f"retained_buffers {unknown} are not buffers of the model; its buffers: {sorted(buffers)}")
    retained = list(opts.retained_buffers)
    t1 = time.perf_counter()
    identity = model_identity(engine_model)  # hashes every weight: once
    seconds = {"load": t1 - t0, "identity": time.perf_counter() - t1}
    return Prepared(
        engine_model,
        precision,
        identity,
        layer_names,
        [shapes[n] for n in layer_names],
        retained,
        model_weights(engine_model, exclude=retained),
        model_type,
        notes,
        seconds,
    )


def build(prepared: Prepared, opts: ExportOptions, say: Callable[[str, int, int], None]) -> Built:
    """Trace and translate the prepared model: layerwise (one block stitched L times) or whole."""
    engine_model, layer_names, past_shapes = prepared.engine_model, prepared.layer_names, prepared.past_shapes
    dtype = prepared.precision.exported
    seconds: dict[str, float] = {}
    t0 = time.perf_counter()

    def trace(names: list[str], shapes: list) -> Trace:
        t = time.perf_counter()
        out = trace_model(
            engine_model,
            names,
            shapes,
            dtype,
            opts.opset,
            prepared.retained,
            opts.continuous_batching,
            opts.compute_context_lengths,
        )
        seconds["trace"] = seconds.get("trace", 0.0) + time.perf_counter() - t
        return out

    if opts.layerwise:
        blocks = [(p, lst) for p, lst in find_repeated_blocks(engine_model) if len(lst) == len(layer_names)]
        if not blocks:
            raise ExportError(
                f"{type(engine_model).__name__} has no list of {len(layer_names)} decoder blocks; "
                "export with layerwise=False"
            )
        path, block_list = blocks[0]
        check_uniform_blocks(path, block_list)
        say("trace", 0, 1)

        def trace_first(n: int) -> Trace:
            with first_blocks(engine_model, path, n):
                return trace(layer_names[:n], past_shapes[:n])

        # Two blocks, which must be one graph once shared sizes are hoisted; if they are
        # not (a first layer that differs), three, of which the last two must be. Up to
        # that many layers, the trace is the whole model.
        L = len(layer_names)
        traced = trace_first(min(2, L))
        model_proto = None
        if L > 2:
            try:
                model_proto, outputs = layerwise_model(
                    traced, path, L, opts.kv_cache_prefix, opts.opset, lambda i: say("layers", i + 1, L)
                )
            except BlocksDiffer:
                traced = trace_first(3)
        say("trace", 1, 1)
        if model_proto is None and traced.num_layers == L:
            model_proto, outputs = whole_model(traced, opts.kv_cache_prefix, opts.opset)
            say("layers", L, L)
        elif model_proto is None:
            model_proto, outputs = layerwise_model(
                traced, path, L, opts.kv_cache_prefix, opts.opset, lambda i: say("layers", i + 1, L)
            )
        traced_layers = traced.num_layers
    else:
        say("trace", 0, 1)
        traced = trace(layer_names, past_shapes)
        say("trace", 1, 1)
        model_proto, outputs = whole_model(traced, opts.kv_cache_prefix, opts.opset)
        say("layers", len(layer_names), len(layer_names))
        traced_layers = len(layer_names)
    name_dims(model_proto)
    splits_without_sequences(model_proto)
    outputs_without_identities(model_proto)
    # Translation and stitching: everything since t0 but the trace(s).
    seconds["translate"] = time.perf_counter() - t0 - seconds["trace"]
    return Built(model_proto, outputs, traced_layers, seconds)


def check_uniform_blocks(path: str, blocks: nn.ModuleList) -> None:
    """Layerwise export stitches every layer after the first from one traced block, so
    they must all build the same graph. A model whose later layers differ (alternating
    sliding windows, a dense layer every k MoE ones, no-RoPE layers) is refused here,
    naming the first difference, rather than exported with the wrong layers."""
    if len(blocks) < 3:
        return
    ref = block_signature(blocks[1], 1)
    for i in range(2, len(blocks)):
        sig = block_signature(blocks[i], i)
        if sig == ref:
            continue
        a, b = next(((a, b) for a, b in zip(ref, sig) if a != b), (ref[-1], sig[-1]))
        if a[:2] != b[:2]:
            what = f"module {a[0] or '(block)'} is {a[1]} in layer 1, {b[0] or '(block)'} {b[1]} in layer {i}"
        elif a[2] != b[2]:
            d1, d2 = dict(a[2]), dict(b[2])
            keys = sorted(k for k in d1.keys() | d2.keys() if d1.get(k) != d2.get(k))
            what = f"{a[0] or 'the block'}: " + ", ".join(
                f"{k}={d1.get(k)!r} in layer 1, {d2.get(k)!r} in layer {i}" for k in keys
            )
        else:
            what = f"{a[0] or 'the block'}: weights {a[3]} in layer 1, {b[3]} in layer {i}"
        raise ExportError(
            f"decoder layer {i} of {path} differs from layer 1 ({what}), so one traced layer "
            "cannot stand for all of them; export with layerwise=False"
        )


@contextlib.contextmanager
def first_blocks(model: nn.Module, path: str, n: int) -> Iterator[nn.ModuleList]:
    """Temporarily leave only the first ``n`` blocks of the list at ``path``, annotated
    so that the trace marks every node a block creates with its index."""
    parent_path, _, attr = path.rpartition(".")
    parent = model.get_submodule(parent_path) if parent_path else model
    full = getattr(parent, attr)
    short = nn.ModuleList(list(full)[:n])
    stacks: dict[int, contextlib.ExitStack] = {}
    handles = []
    for i, block in enumerate(short):

        def pre(mod: nn.Module, args: Any, i: int = i) -> None:
            stacks[i] = contextlib.ExitStack()
            stacks[i].enter_context(torch.fx.traceback.annotate({BLOCK_ANNOTATION: i}))

        def post(mod: nn.Module, args: Any, out: Any, i: int = i) -> None:
            stacks.pop(i).close()

        handles += [block.register_forward_pre_hook(pre), block.register_forward_hook(post)]
    setattr(parent, attr, short)
    try:
        yield full
    finally:
        setattr(parent, attr, full)
        for h in handles:
            h.remove()
        # A trace that failed inside a block left its annotation open, and the exporter has
        # already reset the metadata it was in: closed now, it finds nothing to remove (left
        # to the garbage collector it printed "Exception ignored ... KeyError: 'custom'").
        for i in sorted(stacks, reverse=True):
            with contextlib.suppress(KeyError):
                stacks.pop(i).close()
