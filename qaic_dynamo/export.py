"""Deployment export: one self-contained ONNX model per LLM, in QAIC's conventions.

The torch.compile path runs pieces on the host. A Cloud AI 100 card needs something else:
one model whose KV cache is *retained state* - input ``past_key.{i}``, output
``past_key.{i}_RetainedState`` in the layout ``[batch, kv_heads, ctx_len, head_dim]`` -
with the cache write and read as ``com.qualcomm.cloud`` functions (``CtxScatter``,
``CtxGather``), plus the compiler's ``custom_io.yaml`` and ``specializations.json``.
:func:`export_for_qaic` builds it for every model the engine runs (transformers families,
a local model directory, the reference Llama and MLA models).

How: the model runs in the engine's flat-token form, and :class:`RetainedStateKV` (a
TorchFunctionMode) gives the qaic ops retained-state meaning while the lowering stage
traces it - the KV update becomes ``qaic::ctx_scatter`` into the layer's ``past`` input
at ``position_ids``, attention reads the updated cache with ``qaic::ctx_gather`` under a
causal mask built from ``position_ids`` (a padded position, -1, sees nothing and writes
nothing). The trace and the ONNX translation are the backend's direct lowering
(``lowering.aten_graph`` / ``translate_aten``): no torch.export.

``layerwise=True`` (the default) uses the structural reuse the backend relies on: every
layer from 1 on is first checked to be built like layer 1 (module tree, weight shapes,
settings), the model is traced with only its first two decoder blocks (three if the
first differs), the aten graph is cut at the block boundaries (recorded as node
annotations), and the first block (which may differ, as the backend's first piece does)
and the next are translated once each; the second is stitched L - 1 times into the
merged model, each instance with its own weights and its own retained-state names.
Export time is then flat in depth apart from writing the weights. ``layerwise=False``
traces and translates the whole model (time linear in depth); both give the same model
numerically.

Names come from one place: :func:`retained_state_names` gives each layer's input and
output names from the registry's stems, and :func:`apply_kv_cache_prefix` is the one
function that inserts ``kv_cache_prefix`` into a list of names. Both export paths pass
their output names through it and derive every KV input from its output
(:func:`align_inputs_to_outputs`), so no path can drop the prefix or leave an input
unpaired (the three upstream bugs in QEfficient's layerwise export).

Weights are ONNX external data beside the model (real models exceed protobuf's 2 GB), so
the artifact loads from any working directory. The export directory is named by a hash of
everything that changes the artifact (:meth:`ExportOptions.compute_hash` and the model's
identity), and the hashed parameters are written beside it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import re
import shlex
import subprocess
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import onnx
import torch
import torch.fx as fx
import torch.nn as nn
from torch.overrides import TorchFunctionMode

from qaic_dynamo.forward_context import FROM_FORWARD_CONTEXT
from qaic_dynamo.ops import QAIC_OPS, OpRole, op_name

__all__ = [
    "ExportError",
    "ExportOptions",
    "ExportResult",
    "RETAINED_STATE_SUFFIX",
    "RetainedStateKV",
    "RetainedStateModel",
    "align_inputs_to_outputs",
    "apply_kv_cache_prefix",
    "compile_command",
    "custom_io_yaml",
    "export_for_qaic",
    "is_kv_retained_state",
    "ort_generate",
    "retained_state_names",
    "specializations",
    "validate_kv_cache_prefix",
]

RETAINED_STATE_SUFFIX = "_RetainedState"
ONNX_NAME = "model.onnx"
DATA_NAME = "model.onnx.data"
KV_PRECISIONS = ("float16", "mxint8")
_BLOCK = "qaic_export_block"


class ExportError(ValueError):
    """The model or the options cannot be exported; the message says why and what to do."""


# --- names -------------------------------------------------------------------------------


def validate_kv_cache_prefix(prefix: Any) -> str | None:
    """``prefix`` if it is a valid ``kv_cache_prefix`` (None: no prefix), else ExportError.

    ASCII letters and digits only, as QEfficient: the prefix sits between ``past_key.{i}`` and
    ``_RetainedState``, so a dot, underscore, dash or space would make names ambiguous."""
    if prefix is None:
        return None
    if not isinstance(prefix, str):
        raise ExportError(f"kv_cache_prefix must be a string, got {type(prefix).__name__} {prefix!r}")
    # ASCII: str.isalnum() also takes letters and digits of other scripts ('é', '²'), which
    # neither the compiler's names nor is_kv_retained_state would read as part of a KV name.
    if not (prefix.isascii() and prefix.isalnum()):
        raise ExportError(
            f"kv_cache_prefix must be a non-empty string of ASCII letters and digits (no dots, underscores, "
            f"dashes, spaces or other scripts), got {prefix!r}; e.g. 'vllm' or 'KV0'"
        )
    if prefix.lower() == RETAINED_STATE_SUFFIX[1:].lower():
        # The inputs would be past_key.{i}_RetainedState: named as the retained-state
        # outputs are, which the compiler and is_kv_retained_state tell apart by that suffix.
        raise ExportError(f"kv_cache_prefix {prefix!r} would name the KV inputs like retained-state outputs "
                          f"(past_key.0_{prefix}); choose another, e.g. 'vllm' or 'KV0'")
    return prefix


def kv_stems() -> tuple[str, ...]:
    """Every retained-state stem of the registry's KV-cache updates (past_key, ...)."""
    return tuple(dict.fromkeys(s for op in QAIC_OPS.values() if op.role is OpRole.KV_CACHE_UPDATE for s in op.retained_state))


def retained_state_names(stems: Sequence[str], layer: int) -> list[str]:
    """The plain retained-state *output* names of one layer's caches
    (``past_key.3_RetainedState``, ...); the prefix, if any, is applied to these by
    :func:`apply_kv_cache_prefix`, and inputs follow from them."""
    return [f"{stem}.{layer}{RETAINED_STATE_SUFFIX}" for stem in stems]


# A KV retained-state output, plain or with a kv_cache_prefix: past_key.3[_P]_RetainedState.
_KV_OUTPUT = re.compile(r"^(?P<stem>[A-Za-z_]+)\.(?P<layer>\d+)(?:_(?P<prefix>[A-Za-z0-9]+))?"
                        + RETAINED_STATE_SUFFIX + "$")


def apply_kv_cache_prefix(names: Sequence[str], prefix: str | None) -> list[str]:
    """``names`` with ``prefix`` inserted into each KV retained-state output:
    ``past_key.3_RetainedState`` -> ``past_key.3_P_RetainedState``. Other names (logits,
    ``vision_embeds_RetainedState``, ...) are returned unchanged; without a prefix the
    list is returned as is."""
    prefix = validate_kv_cache_prefix(prefix)
    if prefix is None:
        return list(names)
    stems = set(kv_stems())
    out = []
    for name in names:
        m = _KV_OUTPUT.match(name)
        if m and m["stem"] in stems and m["prefix"] is None:
            name = f"{m['stem']}.{m['layer']}_{prefix}{RETAINED_STATE_SUFFIX}"
        out.append(name)
    return out


def align_inputs_to_outputs(output_names: Sequence[str]) -> dict[str, str]:
    """Each retained-state output ``X_RetainedState`` -> its input ``X``: the compiler pairs
    them by name, so the input name is always derived from the output's."""
    return {o: o[: -len(RETAINED_STATE_SUFFIX)] for o in output_names if o.endswith(RETAINED_STATE_SUFFIX)}


# --- options -----------------------------------------------------------------------------


def _doc(text: str) -> dict[str, str]:
    return {"doc": text}


@dataclass(frozen=True)
class ExportOptions:
    """What :func:`export_for_qaic` builds. Every field changes the artifact and is hashed."""

    batch_size: int = field(default=1, metadata=_doc("Decode batch size (the Decode specialization)."))
    prefill_seq_len: int = field(default=32, metadata=_doc("Tokens per prefill call (the Prefill specialization)."))
    ctx_len: int = field(default=128, metadata=_doc("KV-cache capacity per sequence (retained layout dim 2)."))
    kv_cache_prefix: str | None = field(default=None, metadata=_doc("Alphanumeric infix for KV names; None: none."))
    layerwise: bool = field(default=True, metadata=_doc("Lower one decoder block and stitch it L times."))
    kv_precision: str = field(default="float16", metadata=_doc("custom_io precision of the KV buffers: float16 or mxint8."))
    num_cores: int = field(default=16, metadata=_doc("qaic-compile -aic-num-cores."))
    compiler_options: tuple[tuple[str, Any], ...] = field(
        default=(), metadata=_doc("Extra qaic-compile options, key_name=v -> -key-name=v; True -> bare flag."))
    retained_buffers: tuple[str, ...] = field(
        default=(), metadata=_doc("Model buffers kept as retained state (input X, output X_RetainedState; never prefixed)."))
    opset: int = field(default=18, metadata=_doc("ONNX opset of the model."))

    def __post_init__(self) -> None:
        for name in ("batch_size", "prefill_seq_len", "ctx_len", "num_cores"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ExportError(f"{name} must be a positive int, got {v!r}")
        if self.prefill_seq_len > self.ctx_len:
            raise ExportError(f"prefill_seq_len ({self.prefill_seq_len}) must not exceed ctx_len ({self.ctx_len})")
        validate_kv_cache_prefix(self.kv_cache_prefix)
        rb = self.retained_buffers
        if not isinstance(rb, (tuple, list)) or not all(isinstance(n, str) and n for n in rb):
            raise ExportError(f"retained_buffers must be buffer names (strings), got {rb!r}")
        repeated = sorted({n for n in rb if rb.count(n) > 1})
        if repeated:  # each would be a second graph input of the same name (caught only by onnx.checker)
            raise ExportError(f"retained_buffers names {repeated} more than once; name each buffer once")
        if self.kv_precision not in KV_PRECISIONS:
            raise ExportError(f"kv_precision must be one of {KV_PRECISIONS}, got {self.kv_precision!r}")
        if not isinstance(self.layerwise, bool):
            raise ExportError(f"layerwise must be a bool, got {self.layerwise!r}")
        from qaic_dynamo.runtime import extra_flag_problem

        extra = self.compiler_options  # from_options made a dict the sorted pairs hashed here
        if isinstance(extra, tuple) and all(isinstance(kv, tuple) and len(kv) == 2 for kv in extra):
            extra = dict(extra)
        problem = extra_flag_problem(extra)
        if problem:
            raise ExportError(problem)
        from qaic_dynamo.config import OPSETS

        if isinstance(self.opset, bool) or type(self.opset) is not int or self.opset not in OPSETS:
            raise ExportError(f"opset must be one of {list(OPSETS)} (the opset onnxscript's torch library emits), "
                              f"got {self.opset!r}")

    @classmethod
    def from_options(cls, **options: Any) -> ExportOptions:
        valid = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(options) - valid)
        if unknown:
            raise ExportError(f"unknown export option(s) {unknown}; valid options: {sorted(valid)}")
        co = options.get("compiler_options")
        if isinstance(co, (list, tuple)) and all(isinstance(kv, (list, tuple)) and len(kv) == 2 for kv in co):
            co = dict(co)  # pairs, as before: the same options as the dict (and the same hash)
        if isinstance(co, dict):
            options["compiler_options"] = tuple(sorted(co.items()))
        if isinstance(options.get("retained_buffers"), (list, str)):
            rb = options["retained_buffers"]
            options["retained_buffers"] = (rb,) if isinstance(rb, str) else tuple(rb)
        return cls(**options)

    def as_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["compiler_options"] = dict(self.compiler_options)
        return d

    def compute_hash(self, model_identity: dict[str, Any]) -> str:
        """Short sha256 of every field and the model's identity (sorted-key JSON)."""
        blob = json.dumps({"options": self.as_dict(), "model": model_identity}, sort_keys=True, default=str)
        return hashlib.sha256(blob.encode()).hexdigest()[:16]


# --- retained-state semantics for the qaic ops ----------------------------------------------


class RetainedStateKV(TorchFunctionMode):
    """While active, the qaic KV-update and attention ops act on retained-state caches.

    ``past`` holds each layer's caches ``[batch, heads, ctx_len, dim]`` in
    ``layer_names`` order; ``position_ids`` is ``[batch, seq_len]`` and the ops see the
    tokens flattened to ``batch * seq_len`` rows. Updates resolve their layer by name, or
    by call order for ``"from_forward_context"``; attention reads the layer updated last
    (or the one it names). ``updated`` and ``stems`` are filled in per layer.
    """

    def __init__(self, layer_names: Sequence[str], past: Sequence[Sequence[torch.Tensor]], position_ids: torch.Tensor) -> None:
        super().__init__()
        self.layer_names = list(layer_names)
        self.past = [list(p) for p in past]
        self.position_ids = position_ids
        self.updated: dict[int, list[torch.Tensor]] = {}
        self.stems: dict[int, tuple[str, ...]] = {}
        self._next = 0
        self._last: int | None = None
        # Built once here, before the model runs and so outside every decoder block: the
        # key positions, the causal mask and the gather index serve all layers (one set of
        # nodes, not one per layer), and in a layerwise trace they are values every block
        # shares rather than one block's outputs that the next block reads.
        caches = [c for p in self.past for c in p]
        ctx = caches[0].shape[2] if caches else 0
        self._key_pos = torch.arange(ctx, device=position_ids.device)
        self._pos = position_ids.unsqueeze(-1)  # [B, S, 1]
        self._causal = self._key_pos <= self._pos  # [B, S, C]
        self._gather_index = {}
        for c in caches:
            b, h, n, _ = c.shape
            if h not in self._gather_index:
                self._gather_index[h] = torch.arange(n, device=c.device).expand(b, h, n)

    def _layer(self, name: str, what: str) -> int:
        if name == FROM_FORWARD_CONTEXT:
            if what == "update":
                i, self._next = self._next, self._next + 1
            elif self._last is None:
                raise ExportError("attention ran before any KV-cache update: the export needs update-then-attend layers")
            else:
                i = self._last
        elif name in self.layer_names:
            i = self.layer_names.index(name)
        else:
            raise ExportError(f"the model's op names layer {name!r}, which is not one of its KV-cache layers")
        if i >= len(self.past):
            raise ExportError(f"the model updated more KV caches ({i + 1}) than it declares ({len(self.past)})")
        return i

    def _to_bhsd(self, t: torch.Tensor) -> torch.Tensor:
        """[B*S, H, D] (or [B*S, D]: one head) -> [B, H, S, D]."""
        b, s = self.position_ids.shape
        if t.dim() == 2:
            t = t.unsqueeze(1)
        return t.reshape(b, s, t.shape[-2], t.shape[-1]).transpose(1, 2)

    def _from_bhsd(self, t: torch.Tensor) -> torch.Tensor:
        b, h, s, d = t.shape
        return t.transpose(1, 2).reshape(b * s, h, d)

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        name = op_name(func) or ""
        entry = QAIC_OPS.get(name)
        if entry is None or not (entry.role is OpRole.KV_CACHE_UPDATE or entry.role is OpRole.SPLITTING):
            return func(*args, **kwargs)
        if entry.role is OpRole.KV_CACHE_UPDATE:
            first, second, layer_name = args[:3]
            i = self._layer(layer_name, "update")
            self.stems[i] = entry.retained_state
            self.updated[i] = [
                torch.ops.qaic.ctx_scatter(cache, self.position_ids, self._to_bhsd(new).to(cache.dtype))
                for cache, new in zip(self.past[i], (first, second))
            ]
            self._last = i
            return first.new_empty(0)
        if name == "qaic::unified_attention":
            return self._attention(*args, **kwargs)
        if name == "qaic::unified_mla_attention":
            return self._mla_attention(*args, **kwargs)
        raise ExportError(f"the deployment export has no retained-state form of {name}")

    def _read(self, i: int) -> list[torch.Tensor]:
        if i not in self.updated:
            raise ExportError(f"layer {self.layer_names[i]!r} attends before its KV cache was updated")
        return [torch.ops.qaic.ctx_gather(cache, self._gather_index[cache.shape[1]]) for cache in self.updated[i]]

    def _mask(self, sliding_window: int | None) -> torch.Tensor:
        """[B, 1, S, C]: key slot c is visible to the token at position p iff c <= p (and
        c > p - window); a padded token (p = -1) sees nothing."""
        allowed = self._causal
        if sliding_window is not None:
            allowed = allowed & (self._key_pos > self._pos - sliding_window)
        return allowed.unsqueeze(1)

    def _softmax_attend(self, scores: torch.Tensor, allowed: torch.Tensor, value: torch.Tensor,
                        softcap: float | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
        scores = scores.float()
        if softcap is not None:
            scores = torch.tanh(scores / softcap) * softcap
        # A finite minimum, not -inf: a padded row (nothing visible) gets a uniform, finite
        # softmax instead of NaN; its output is never read.
        scores = scores.masked_fill(~allowed, torch.finfo(torch.float32).min)
        if sinks is not None:  # one more logit per head in the denominator, with no value
            sink = sinks.float().view(1, -1, 1, 1).expand(scores.shape[0], -1, scores.shape[2], 1)
            probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
        else:
            probs = torch.softmax(scores, dim=-1)
        return probs.to(value.dtype) @ value

    def _attention(self, query, key, value, layer_name, scale=None, sliding_window=None, kv_cache_dependency=None,
                   softcap=None, sinks=None):
        i = self._layer(layer_name, "attention")
        k, v = self._read(i)
        q = self._to_bhsd(query)  # [B, Hq, S, D]
        group = q.shape[1] // k.shape[1]
        if group > 1:  # GQA: each kv head serves `group` query heads (expand, not repeat_interleave:
            # with symbolic batch and ctx_len its decomposition costs the trace ~0.2 s a layer)
            k, v = (t.unsqueeze(2).expand(t.shape[0], t.shape[1], group, t.shape[2], t.shape[3])
                    .reshape(t.shape[0], t.shape[1] * group, t.shape[2], t.shape[3]) for t in (k, v))
        scale = scale if scale is not None else q.shape[-1] ** -0.5
        scores = (q @ k.transpose(-1, -2)) * scale
        return self._from_bhsd(self._softmax_attend(scores, self._mask(sliding_window), v, softcap, sinks))

    def _mla_attention(self, q_latent, q_pe, layer_name, scale, kv_cache_dependency=None):
        i = self._layer(layer_name, "attention")
        c_kv, k_pe = self._read(i)  # [B, 1, C, R], [B, 1, C, P]
        ql, qp = self._to_bhsd(q_latent), self._to_bhsd(q_pe)
        scores = (ql @ c_kv.transpose(-1, -2) + qp @ k_pe.transpose(-1, -2)) * scale
        return self._from_bhsd(self._softmax_attend(scores, self._mask(None), c_kv))


# --- the model in retained-state form -------------------------------------------------------


class RetainedStateModel(nn.Module):
    """An engine model in QAIC's retained-state form, a plain ``nn.Module``:
    ``forward(input_ids [B, S], position_ids [B, S], *past) -> (logits [B, 1, V], *past')``
    with ``past`` each layer's caches ``[B, heads, ctx_len, dim]`` in layer order. Any
    tracer that runs Python (make_fx, ``torch.export`` non-strict) sees ``ctx_scatter`` /
    ``ctx_gather`` and plain attention math instead of the paged ops; the export traces it,
    and ``benchmarks/export.py`` hands it to ``torch.onnx.export`` for comparison."""

    def __init__(self, model: nn.Module, caches_per_layer: Sequence[int]) -> None:
        super().__init__()
        self.model = model
        self.caches_per_layer = list(caches_per_layer)
        #: The stems each layer's update op declared in the last forward.
        self.stems: dict[int, tuple[str, ...]] = {}

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, *flat_past: torch.Tensor) -> tuple:
        past, k = [], 0
        for n in self.caches_per_layer:
            past.append(list(flat_past[k: k + n]))
            k += n
        b, s = input_ids.shape
        # The logits row of each sequence: its last real token (the highest position).
        last = position_ids.argmax(dim=1) + torch.arange(b, device=input_ids.device) * s
        with RetainedStateKV(list(self.model.kv_cache_layers)[: len(past)], past, position_ids) as mode:
            logits = self.model(input_ids.reshape(-1), position_ids.reshape(-1), last)
        self.stems = mode.stems
        if len(mode.updated) != len(past):
            raise ExportError(f"the model updated {len(mode.updated)} of its {len(past)} KV caches in one forward")
        return (logits.unsqueeze(1), *[t for i in range(len(past)) for t in mode.updated[i]])


def _engine_model(model: Any) -> nn.Module:
    from qaic_dynamo.models import load_model

    try:
        m = load_model(model)
    except (TypeError, FileNotFoundError, NotImplementedError) as e:  # not a model, or one the qaic ops cannot run
        raise ExportError(str(e).replace("LLM:", "export_for_qaic:")) from e
    return m.eval()


def _identity(engine_model: nn.Module) -> dict[str, Any]:
    """What distinguishes one model from another in the export hash: its class, its
    config, the plain settings of every module (e.g. an attention's ``scaling`` set after
    loading) and a digest of every byte of every parameter and buffer.

    All of it, not a sample: the hash names the directory an export writes, so two models
    that hashed alike would overwrite each other's artifact (measured: sha256 hashes
    ~1.7 GB/s here, less than writing the weights takes)."""
    from qaic_dynamo.models import model_config

    cfg = model_config(engine_model, text=False)  # all of it: a multimodal model's top-level settings too
    cfg_dict = cfg.to_dict() if hasattr(cfg, "to_dict") else (dataclasses.asdict(cfg) if dataclasses.is_dataclass(cfg) else repr(cfg))
    h = hashlib.sha256(repr(_block_signature(engine_model, None)).encode())
    for name, t in _weights(engine_model).items():  # non-persistent buffers too (rotary inv_freq)
        h.update(f"{name}:{tuple(t.shape)}:{t.dtype}".encode())
        h.update(t.contiguous().reshape(-1).view(torch.uint8).numpy())
    return {"class": type(engine_model).__name__, "config": cfg_dict, "weights": h.hexdigest()[:16]}


def _weights(model: nn.Module, exclude: Sequence[str] = ()) -> dict[str, torch.Tensor]:
    """Parameters and buffers by qualified name (tied weights once), but ``exclude``."""
    out = {name: p.detach() for name, p in model.named_parameters()}
    out.update({name: b.detach() for name, b in model.named_buffers()})
    return {k: v for k, v in out.items() if k not in exclude}


@dataclass
class _Trace:
    """One traced export: the aten graph and what each of its inputs is."""

    gm: fx.GraphModule
    #: ("input", name) | ("past", layer, j) | ("weight", qualified name), per placeholder.
    inputs: list[tuple]
    stems: dict[int, tuple[str, ...]]
    num_layers: int
    #: Non-KV retained-state buffers (I/O named after them, never prefixed).
    retained: list[str] = field(default_factory=list)


def _trace(model: nn.Module, layer_names: list[str], past_shapes: list[tuple[tuple[int, ...], ...]],
           dtype: torch.dtype, opset: int, retained: Sequence[str] = ()) -> _Trace:
    """Trace ``model`` (the engine form) as input_ids, position_ids, past..., retained
    buffers..., weights -> logits [B, 1, V], updated past..., retained buffers... through
    the lowering's direct path."""
    from qaic_dynamo.lowering import aten_graph

    weights = _weights(model, exclude=retained)
    buffers = dict(model.named_buffers())
    weight_names = list(weights)
    past_spec = [(i, j) for i, shapes in enumerate(past_shapes) for j in range(len(shapes))]
    wrapper = RetainedStateModel(model, [len(shapes) for shapes in past_shapes])

    def forward(input_ids: torch.Tensor, position_ids: torch.Tensor, *rest: torch.Tensor):
        n_past = len(past_spec)
        flat_past, kept, params = rest[:n_past], rest[n_past: n_past + len(retained)], rest[n_past + len(retained):]
        tensors = {f"model.{k}": v for k, v in zip(weight_names, params)}
        tensors.update((f"model.{k}", v) for k, v in zip(retained, kept))
        out = torch.func.functional_call(wrapper, tensors, (input_ids, position_ids, *flat_past))
        # A retained buffer leaves as its value after the step (a copy: an ONNX output
        # must be a value of its own, not the input).
        return (*out, *[tensors[f"model.{name}"].clone() for name in retained])

    batch, seq, ctx = 3, 5, 17  # distinct, not 0/1: every one stays a symbol
    ex_ids = torch.zeros(batch, seq, dtype=torch.long)
    ex_pos = torch.arange(seq).repeat(batch, 1)
    ex_past = [torch.zeros((batch, *shape[1:2], ctx, *shape[3:]), dtype=dtype) for shapes in past_shapes for shape in shapes]
    example = [ex_ids, ex_pos, *ex_past, *[buffers[n].detach() for n in retained], *weights.values()]
    dynamic = [{0: "batch_size", 1: "seq_len"}] * 2 + [{0: "batch_size", 2: "ctx_len"}] * len(ex_past) + \
        [None] * (len(retained) + len(weights))
    try:
        with torch.no_grad(), torch.fx.traceback.preserve_node_meta():
            gm = aten_graph(forward, example, dynamic, opset)
    except ExportError:
        raise
    except Exception as e:  # torch's own trace errors name its internals, not the model's problem
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise ExportError(f"the model could not be traced for export: {type(e).__name__}: {first}") from e
    inputs = [("input", "input_ids"), ("input", "position_ids")] + [("past", i, j) for i, j in past_spec] + \
        [("retained", n) for n in retained] + [("weight", n) for n in weight_names]
    return _Trace(gm, inputs, dict(wrapper.stems), len(past_shapes), list(retained))


# --- ONNX assembly ---------------------------------------------------------------------------


def _io_names(trace: _Trace, layers: range, prefix: str | None) -> tuple[list[str], dict[tuple[int, int], str]]:
    """The model's output names (logits, then every layer's retained outputs, prefixed) and
    each (layer, j) cache's input name, derived from its output name."""
    outputs = ["logits"]
    for i in layers:
        outputs += retained_state_names(trace.stems.get(i, trace.stems[max(trace.stems)]), i)
    outputs += [f"{name}{RETAINED_STATE_SUFFIX}" for name in trace.retained]
    outputs = apply_kv_cache_prefix(outputs, prefix)
    inputs_of = align_inputs_to_outputs(outputs)
    past_name = {}
    k = 1
    for i in layers:
        for j in range(len(trace.stems.get(i, trace.stems[max(trace.stems)]))):
            past_name[(i, j)] = inputs_of[outputs[k]]
            k += 1
    return outputs, past_name


def _name_dims(model: onnx.ModelProto) -> None:
    """Symbolic dims get QEfficient's names: batch_size, seq_len, ctx_len."""
    rename: dict[str, str] = {}
    for value in model.graph.input:
        dims = value.type.tensor_type.shape.dim
        if value.name == "input_ids":
            rename[dims[0].dim_param] = "batch_size"
            rename[dims[1].dim_param] = "seq_len"
        elif len(dims) == 4 and dims[2].dim_param:
            rename[dims[2].dim_param] = "ctx_len"
    for value in [*model.graph.input, *model.graph.output, *model.graph.value_info]:
        for d in value.type.tensor_type.shape.dim:
            if d.dim_param in rename:
                d.dim_param = rename[d.dim_param]


def _external_weights(model: onnx.ModelProto, weights: dict[str, torch.Tensor], data_path: Path) -> None:
    """Weights (graph inputs, or names the stitched nodes read) become initializers whose
    bytes are written straight from the tensors to ``data_path`` (ONNX external data),
    once: putting them in the protobuf first and letting ``onnx.save`` move them out
    copies every byte twice."""
    from qaic_dynamo.artifact import ONNX_ELEMENT_TYPES

    keep = [v for v in model.graph.input if v.name not in weights]
    # Whole-model exports name them as inputs; stitched ones only reference them.
    used = ({v.name for v in model.graph.input} | {x for n in model.graph.node for x in n.input}) & set(weights)
    del model.graph.input[:]
    model.graph.input.extend(keep)
    offset = 0
    with open(data_path, "wb") as f:
        for name in sorted(used):
            t = weights[name].contiguous()
            if t.dtype not in ONNX_ELEMENT_TYPES:
                raise ExportError(f"weight {name} is {t.dtype}, which ONNX cannot store; cast the model first")
            raw = t.reshape(-1).view(torch.uint8).numpy()
            tensor = onnx.TensorProto(name=name, data_type=ONNX_ELEMENT_TYPES[t.dtype], dims=list(t.shape),
                                      data_location=onnx.TensorProto.EXTERNAL)
            for key, value in (("location", data_path.name), ("offset", str(offset)), ("length", str(raw.nbytes))):
                tensor.external_data.add(key=key, value=value)
            f.write(memoryview(raw))
            offset += raw.nbytes
            model.graph.initializer.append(tensor)


def _whole_model(trace: _Trace, prefix: str | None, opset: int) -> tuple[onnx.ModelProto, list[str]]:
    from qaic_dynamo.lowering import finish_model, translate_aten

    outputs, past_name = _io_names(trace, range(trace.num_layers), prefix)
    names = [x[1] if x[0] != "past" else past_name[(x[1], x[2])] for x in trace.inputs]
    try:
        model = translate_aten(trace.gm, names, outputs, opset)
    except Exception as e:
        raise ExportError(f"the model could not be translated to ONNX: {e}") from e
    return finish_model(model, opset, check=False), outputs


def _block_of(node: fx.Node) -> int | None:
    return node.meta.get("custom", {}).get(_BLOCK)


class _BlocksDiffer(Exception):
    """A two-block trace whose blocks are not one graph: trace three instead."""


def _hoist_shared_sizes(gm: fx.GraphModule) -> None:
    """Compute every symbolic size the blocks use before the blocks, from the input dims.

    A symbolic size (e.g. batch x seq for a reshape) is traced once and its node reused
    wherever the same size comes up again, so block 1 may read it from inside block 0,
    and where in a block a size first comes up can differ from block to block (an MoE
    layer's tokens x top-k). Either makes block 0 and block 1 different graphs, and the
    first makes block 1's input a value that is shared, not chained. Computed from the
    model inputs' dims before the blocks, each size is an input every block shares. A
    size that cannot be (not sums, products and floor divisions of input dims, e.g. a
    data-dependent one) stays where it is: if the blocks then differ, the export traces
    a third block to tell shared from chained values."""
    from qaic_dynamo.lowering import LoweringError, size_expression

    dims: dict[Any, tuple[fx.Node, int]] = {}
    for ph in gm.graph.find_nodes(op="placeholder"):
        val = ph.meta.get("val")
        for d, size in enumerate(val.shape if isinstance(val, torch.Tensor) else ()):
            if isinstance(size, torch.SymInt) and size.node.expr.is_Symbol:
                dims.setdefault(size.node.expr, (ph, d))
    anchor = next(n for n in gm.graph.nodes if n.op != "placeholder")
    hoisted: dict[Any, Any] = {}
    for node in list(gm.graph.nodes):
        b, val = _block_of(node), node.meta.get("val")
        if b is None or not isinstance(val, torch.SymInt):
            continue
        expr = val.node.expr
        if expr in hoisted:  # one node per size, whichever blocks use it
            node.replace_all_uses_with(hoisted[expr])
            gm.graph.erase_node(node)
            continue
        before = set(gm.graph.nodes)
        try:
            with gm.graph.inserting_before(anchor):
                size = size_expression(gm.graph, expr, dims)
        except LoweringError:
            continue
        if not isinstance(size, fx.Node):  # a constant: nothing to share
            continue
        hoisted[expr] = size
        for new in (n for n in gm.graph.nodes if n not in before):
            args = [a.meta["val"] if isinstance(a, fx.Node) else a for a in new.args]
            new.meta["val"] = args[0].shape[args[1]] if new.target is torch.ops.aten.sym_size.int else new.target(*args)
            new.meta["nn_module_stack"] = {}  # the translator records it per node
        node.replace_all_uses_with(size)
        gm.graph.erase_node(node)
    gm.recompile()


def _layerwise(trace: _Trace, blocks_path: str, num_layers: int, prefix: str | None, opset: int,
               on_layer: Callable[[int], None] = lambda i: None) -> tuple[onnx.ModelProto, list[str]]:
    """Cut a trace of the first two or three blocks into pre / blocks / post, translate
    pre, block 0, block 1 and post once each, and stitch block 0 plus ``num_layers - 1``
    instances of block 1 into one model.

    Block 0 is its own part because a first layer may differ from the rest (vLLM-style
    layers start the residual stream there), as the backend's first piece does. Two
    consecutive blocks that are one graph say which block inputs chain from the previous
    block, which are shared, and which are per layer (weights, caches): blocks 0 and 1 of
    a two-block trace, or blocks 1 and 2 of a three-block one. A two-block trace whose
    blocks differ raises :class:`_BlocksDiffer` (the caller then traces three)."""
    from torch.fx.passes.split_module import split_module

    from qaic_dynamo.lowering import finish_model, translate_aten

    gm = trace.gm
    traced = trace.num_layers
    _hoist_shared_sizes(gm)
    order = {n: k for k, n in enumerate(gm.graph.nodes)}
    first_block = min((order[n] for n in gm.graph.nodes if _block_of(n) is not None), default=None)
    if first_block is None:
        raise ExportError("layerwise export found no decoder-block nodes; export with layerwise=False")

    def part(node: fx.Node) -> int:
        b = _block_of(node)
        if b is not None:
            return b + 1
        return 0 if order[node] < first_block else traced + 1

    try:
        split = split_module(gm, gm, part, keep_original_order=True)
    except Exception as e:
        raise ExportError(f"the decoder blocks are not separable from the rest of the model ({e}); "
                          "export with layerwise=False") from e
    calls = {n.target: n for n in split.graph.nodes if n.op == "call_module"}
    names = [f"submod_{k}" for k in range(traced + 2)]
    PRE, POST, blocks = names[0], names[-1], names[1:-1]
    B0, B1, LAST = blocks[0], blocks[1], blocks[-1]
    if set(calls) != set(names):
        raise ExportError(f"layerwise export expected pre / {traced} blocks / post, got {sorted(calls)}; "
                          "use layerwise=False")
    sub = {k: getattr(split, k) for k in calls}
    # The pair of blocks that are one graph: the template's inputs are read off it.
    one, two = blocks[-2], blocks[-1]
    if _graph_signature(sub[one]) != _graph_signature(sub[two]):
        if traced == 2:
            raise _BlocksDiffer()
        raise ExportError("the decoder blocks differ structurally (e.g. per-layer attention types or windows); "
                          "export with layerwise=False")

    placeholder_kind = dict(zip([n for n in split.graph.nodes if n.op == "placeholder"], trace.inputs))

    def source(arg: fx.Node) -> tuple:
        """("in", kind, ...) for a top-level input, ("out", part, index) for a part's output."""
        if arg.op == "placeholder":
            return ("in",) + tuple(placeholder_kind[arg])
        if arg.op == "call_function" and arg.args and isinstance(arg.args[0], fx.Node) and arg.args[0].op == "call_module":
            return ("out", arg.args[0].target, arg.args[1])
        if arg.op == "call_module":
            return ("out", arg.target, 0)
        raise ExportError(f"layerwise export cannot follow value {arg.name}")

    srcs = {k: [source(a) for a in calls[k].args] for k in calls}

    def translate(k: str) -> onnx.ModelProto:
        _fill_output_meta(sub[k])
        ins = [f"in{m}" for m in range(len(srcs[k]))]
        outs = [f"out{m}" for m in range(_num_outputs(sub[k]))]
        try:
            # Finished (onnxscript helpers inlined) so the stitched model needs only the
            # qaic functions, which finish_model attaches once at the end.
            part_model = finish_model(translate_aten(sub[k], ins, outs, opset), opset, check=False)
        except Exception as e:
            raise ExportError(f"part {k} could not be translated to ONNX: {e}") from e
        del part_model.functions[:]
        return part_model

    parts = {k: translate(k) for k in (PRE, B0, B1, POST)}
    outputs, past_name = _io_names(trace, range(num_layers), prefix)
    nodes: list[onnx.NodeProto] = []
    initializers: list[onnx.TensorProto] = []
    emitted: dict[str, list[str]] = {}

    def value(src: tuple, layer: int) -> str:
        """The stitched value of a source as seen by ``layer`` (top-level inputs only
        depend on the layer for caches)."""
        if src[0] == "out":
            return emitted[src[1]][src[2]]
        if src[1] == "past":
            return past_name[(layer, src[3])]
        return src[2]  # input_ids / position_ids / a weight by its qualified name

    def emit(k: str, tag: str, inputs: list[str]) -> list[str]:
        return _append_renamed(nodes, initializers, parts[k].graph, tag, {f"in{m}": v for m, v in enumerate(inputs)})

    emitted[PRE] = emit(PRE, "pre", [value(s, 0) for s in srcs[PRE]])
    emitted[B0] = emit(B0, "layers.0", [value(s, 0) for s in srcs[B0]])
    a = blocks.index(one)  # the layer that block `one` is
    w1, w2 = f"{blocks_path}.{a}.", f"{blocks_path}.{a + 1}."
    prev = emitted[B0]
    block_outs = [prev]
    on_layer(0)
    for i in range(1, num_layers):
        ins = []
        for m, (s1, s2) in enumerate(zip(srcs[one], srcs[two])):
            if s2[:2] == ("out", one):  # chained: the previous block's output
                # Layer 1 reads what block 1 read in the trace (block 0 may differ from
                # the rest); later layers the template's own output.
                ins.append(value(srcs[B1][m], i) if i == 1 else prev[s2[2]])
            elif s1 == s2:  # shared by every layer
                ins.append(value(s1, i))
            elif s1[:2] == ("in", "weight") and s2[:2] == ("in", "weight") and s1[2].startswith(w1) \
                    and s2[2] == w2 + s1[2][len(w1):]:
                ins.append(f"{blocks_path}.{i}." + s1[2][len(w1):])
            elif s1[:2] == ("in", "past") and s2[:2] == ("in", "past") and s1[3] == s2[3]:
                ins.append(past_name[(i, s1[3])])
            elif traced == 2:  # block 0 may be special after all: let a third block tell
                raise _BlocksDiffer()
            else:
                raise ExportError(f"block input {m} differs between layers in a way layerwise export cannot map "
                                  f"({s1} vs {s2}); use layerwise=False")
        prev = emit(B1, f"layers.{i}", ins)
        block_outs.append(prev)
        on_layer(i)
    emitted[LAST] = prev  # post reads the last block's outputs
    if any(s[0] == "out" and s[1] in blocks[:-1] for s in srcs[POST]):
        raise ExportError("the model reads a non-final decoder block's output after the blocks; use layerwise=False")
    emitted[POST] = emit(POST, "post", [value(s, 0) for s in srcs[POST]])

    # Outputs: logits from post, then each layer's caches at the output positions its
    # block kind had in the trace (layer 0: block 0's, the others: block 1's).
    top = [source(a) for a in split.graph.find_nodes(op="output")[0].args[0]]
    if top[0][:2] != ("out", POST):
        raise ExportError("the logits are not computed after the decoder blocks; use layerwise=False")
    idx0 = [s[2] for s in top[1:] if s[:2] == ("out", B0)]
    idx1 = [s[2] for s in top[1:] if s[:2] == ("out", B1)]
    values = [emitted[POST][top[0][2]]] + [block_outs[i][k] for i in range(num_layers) for k in (idx0 if i == 0 else idx1)]
    kept_src = top[len(top) - len(trace.retained):] if trace.retained else []
    if any(s[0] == "out" and s[1] in blocks for s in kept_src):
        raise ExportError("a retained buffer is written inside the decoder blocks; use layerwise=False")
    values += [value(s, 0) for s in kept_src]
    for v, name in zip(values, outputs):
        nodes.append(onnx.helper.make_node("Identity", [v], [name], name=f"output/{name}"))

    past_vi = {src[3]: parts[B1].graph.input[m] for m, src in enumerate(srcs[B1]) if src[:2] == ("in", "past")}
    graph_inputs = []
    for name in ("input_ids", "position_ids"):
        vi = next((parts[k].graph.input[m] for k in (PRE, B0, B1, POST) for m, s in enumerate(srcs[k])
                   if s == ("in", "input", name)), None)
        if vi is None:
            raise ExportError(f"the model does not read {name}")
        graph_inputs.append(_renamed_vi(vi, name))
    graph_inputs += [_renamed_vi(past_vi[j], name) for (i, j), name in past_name.items()]
    kept_vi = {}
    for name in trace.retained:
        vi = next((parts[k].graph.input[m] for k in (PRE, B0, B1, POST) for m, s in enumerate(srcs[k])
                   if s == ("in", "retained", name)), None)
        if vi is None:
            raise ExportError(f"the model does not read its retained buffer {name!r}")
        kept_vi[name] = vi
        graph_inputs.append(_renamed_vi(vi, name))
    inputs_of = align_inputs_to_outputs(outputs)
    by_input = {n: j for (i, j), n in past_name.items()}
    graph_outputs = [_renamed_vi(parts[POST].graph.output[top[0][2]], "logits")]
    graph_outputs += [_renamed_vi(past_vi[by_input[inputs_of[name]]] if inputs_of[name] in by_input
                                  else kept_vi[inputs_of[name]], name) for name in outputs[1:]]
    graph = onnx.helper.make_graph(nodes, "main_graph", graph_inputs, graph_outputs, initializer=initializers)
    model = onnx.helper.make_model(graph, opset_imports=list(parts[B1].opset_import), producer_name="qaic_dynamo")
    return finish_model(model, opset, check=False), outputs


def _renamed_vi(vi: onnx.ValueInfoProto, name: str) -> onnx.ValueInfoProto:
    out = onnx.ValueInfoProto()
    out.CopyFrom(vi)
    out.name = name
    return out


def _append_renamed(nodes: list, initializers: list, g: onnx.GraphProto, tag: str, rename: dict[str, str]) -> list[str]:
    """Copy ``g``'s nodes (and constants) into ``nodes``, every value renamed to
    ``tag/name`` unless ``rename`` maps it (the part's inputs)."""
    def name_of(v: str) -> str:
        if not v:
            return v
        return rename.get(v, f"{tag}/{v}")

    for init in g.initializer:
        t = onnx.TensorProto()
        t.CopyFrom(init)
        t.name = name_of(init.name)
        initializers.append(t)
    for n in g.node:
        c = onnx.NodeProto()
        c.CopyFrom(n)
        del c.input[:]
        c.input.extend(name_of(v) for v in n.input)
        del c.output[:]
        c.output.extend(name_of(v) for v in n.output)
        c.name = f"{tag}/{n.name}" if n.name else ""
        if any(a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS) for a in n.attribute):
            raise ExportError(f"layerwise stitching does not handle control flow ({n.op_type}); use layerwise=False")
        nodes.append(c)
    return [name_of(o.name) for o in g.output]


def _graph_signature(gm: fx.GraphModule) -> list[tuple]:
    """A block graph's structure without its node names: op, target and arguments by
    position (placeholders by index)."""
    index = {n: k for k, n in enumerate(gm.graph.nodes)}

    def norm(a: Any) -> Any:
        if isinstance(a, fx.Node):
            return ("node", index[a])
        if isinstance(a, (list, tuple)):
            return tuple(norm(x) for x in a)
        if isinstance(a, dict):
            return tuple(sorted((k, norm(v)) for k, v in a.items()))
        return repr(a)

    return [(n.op, str(n.target) if n.op != "placeholder" else "", norm(n.args), norm(n.kwargs)) for n in gm.graph.nodes]


def _num_outputs(gm: fx.GraphModule) -> int:
    out = gm.graph.find_nodes(op="output")[0].args[0]
    return len(out) if isinstance(out, (tuple, list)) else 1


def _fill_output_meta(gm: fx.GraphModule) -> None:
    """split_module's parts return a single value bare; the translator wants a tuple."""
    out = gm.graph.find_nodes(op="output")[0]
    if not isinstance(out.args[0], (tuple, list)):
        out.args = ((out.args[0],),)
        gm.recompile()


# --- compiler inputs ---------------------------------------------------------------------------


def is_kv_retained_state(name: str) -> bool:
    """True if ``name`` is a KV retained-state output of the registry's KV updates, with
    or without a ``kv_cache_prefix`` (``past_key.3_RetainedState``, ``past_key.3_P_RetainedState``)."""
    m = _KV_OUTPUT.match(name)
    return bool(m) and m["stem"] in kv_stems()


# ONNX element types the compiler's custom IO can hold at float16 (-convert-to-fp16 makes
# every float buffer float16 on the device, so fp32, bf16 and fp64 all map to it).
_FLOAT_ELEM_TYPES = frozenset({onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16, onnx.TensorProto.BFLOAT16,
                               onnx.TensorProto.DOUBLE})


def custom_io_yaml(output_names: Sequence[str], precision: str = "float16",
                   dtypes: Mapping[str, int] | None = None) -> str:
    """``custom_io.yaml``: every retained-state output paired with its input.

    KV buffers are at ``precision`` (float16 by default; mxint8 is for the KV only).
    Other retained buffers (``retained_buffers``, e.g. ``vision_embeds``) keep their own
    precision, from ``dtypes`` (output name -> ONNX element type): float16 for a float
    buffer, and no entry for an integer or bool one, whose type the compiler keeps."""
    if precision not in KV_PRECISIONS:
        raise ExportError(f"kv_precision must be one of {KV_PRECISIONS}, got {precision!r}")
    dtypes = dtypes or {}
    lines = []
    for out, inp in align_inputs_to_outputs(output_names).items():
        if is_kv_retained_state(out):
            p = precision
        elif out not in dtypes:
            raise ExportError(f"custom_io_yaml: {out!r} is not a KV buffer and its element type is unknown; "
                              "pass dtypes={name: onnx element type} for every non-KV retained output")
        elif dtypes[out] in _FLOAT_ELEM_TYPES:
            p = "float16"
        else:
            continue
        lines += [f"- IOName: {inp}", f"  Precision: {p}", "", f"- IOName: {out}", f"  Precision: {p}", ""]
    return "\n".join(lines)


def specializations(options: ExportOptions) -> dict[str, Any]:
    """``specializations.json``: a Prefill and a Decode entry, both at ``batch_size``.

    The KV buffers' first dimension is the ``batch_size`` symbol, and a retained-state
    buffer keeps one shape on the card across specializations: a batch-1 Prefill beside a
    batch-N Decode would give it two. QEfficient prefills at batch 1 only with continuous
    batching, where the KV has a ``full_batch_size`` dimension of its own and a
    ``batch_index`` input picks the row - which this export does not have."""
    def entry(name: str, seq: int) -> dict[str, Any]:
        return {"name": name, "symbols": {"batch_size": str(options.batch_size), "seq_len": str(seq),
                                          "ctx_len": str(options.ctx_len)}}

    return {"specializations": [entry("Prefill", options.prefill_seq_len), entry("Decode", 1)]}


def compile_command(onnx_path: Path, qpc_dir: Path, custom_io: Path, specs: Path, options: ExportOptions,
                    compiler: Path | None = None) -> list[str]:
    """The ``qaic-compile`` command line, as a list: the runtime's (one builder for both)."""
    from qaic_dynamo.runtime import qaic_compile_command

    return qaic_compile_command(onnx_path.parent, qpc_dir, num_cores=options.num_cores, custom_io=custom_io,
                                specializations=specs, extra=dict(options.compiler_options), compiler=compiler)


# --- the entry point -----------------------------------------------------------------------------


@dataclass
class ExportResult:
    """What :func:`export_for_qaic` wrote."""

    onnx_path: Path
    input_names: list[str]
    output_names: list[str]
    custom_io_path: Path
    specializations_path: Path
    compile_command: list[str]
    export_dir: Path
    qpc_dir: Path
    #: True if qaic-compile ran (and succeeded); False: it was not found (or not run), and
    #: its command is in ``compile.sh``.
    compiled: bool
    layerwise: bool
    num_layers: int
    #: trace, translate (stitch included), weights (writing them), check, total.
    seconds: dict[str, float]
    compile_log: Path | None = None
    #: Decoder layers traced (layerwise: 2, or 3 when the first layer differs).
    traced_layers: int = 0

    def summary(self) -> str:
        lines = [
            f"onnx              {self.onnx_path}",
            f"custom_io         {self.custom_io_path}",
            f"specializations   {self.specializations_path}",
            f"inputs            {', '.join(self.input_names[:6])}{' ...' if len(self.input_names) > 6 else ''} "
            f"({len(self.input_names)})",
            f"outputs           {', '.join(self.output_names[:5])}{' ...' if len(self.output_names) > 5 else ''} "
            f"({len(self.output_names)})",
            f"layers            {self.num_layers} (" + (f"layerwise: {self.traced_layers} traced, one block lowered, "
                                                   "stitched" if self.layerwise else "whole model") + ")",
            "seconds           " + ", ".join(f"{k} {v:.2f}" for k, v in self.seconds.items()),
        ]
        if self.compiled:
            lines.append(f"qaic-compile      ran: {self.qpc_dir} (log {self.compile_log})")
        else:
            lines.append(f"qaic-compile      not run: command written to {self.export_dir / 'compile.sh'}")
        return "\n".join(lines)


#: Attributes that hold a block's own index or name (normalised before comparing blocks).
_INDEX_ATTRS = ("layer_idx", "layer_id", "layer_index", "layer_number", "idx")


def _block_signature(block: nn.Module, index: int | None) -> list[tuple]:
    """What makes a block's graph: its module tree, its parameter and buffer shapes, and
    the plain settings of each module (window sizes, flags, types), with the block's own
    index and name taken out (``index`` None: nothing taken out)."""
    def setting(key: str, v: Any) -> Any:
        if index is None:
            return v
        if key in _INDEX_ATTRS and v == index:
            return "<index>"
        if isinstance(v, str):
            return re.sub(rf"(^|\.){index}(\.|$)", r"\1<index>\2", v)
        return v

    plain = (bool, int, float, str, type(None))
    sig = []
    for name, mod in block.named_modules():
        settings = tuple(sorted((k, setting(k, v)) for k, v in vars(mod).items() if not k.startswith("_") and (
            isinstance(v, plain) or (isinstance(v, tuple) and all(isinstance(x, plain) for x in v)))))
        tensors = tuple((k, tuple(t.shape), t.dtype) for k, t in [*mod.named_parameters(recurse=False),
                                                                   *mod.named_buffers(recurse=False)])
        sig.append((name, type(mod).__qualname__, settings, tensors))
    return sig


def _check_uniform_blocks(path: str, blocks: nn.ModuleList) -> None:
    """Layerwise export stitches every layer after the first from one traced block, so
    they must all build the same graph. A model whose later layers differ (alternating
    sliding windows, a dense layer every k MoE ones, no-RoPE layers) is refused here,
    naming the first difference, rather than exported with the wrong layers."""
    if len(blocks) < 3:
        return
    ref = _block_signature(blocks[1], 1)
    for i in range(2, len(blocks)):
        sig = _block_signature(blocks[i], i)
        if sig == ref:
            continue
        a, b = next(((a, b) for a, b in zip(ref, sig) if a != b), (ref[-1], sig[-1]))
        if a[:2] != b[:2]:
            what = f"module {a[0] or '(block)'} is {a[1]} in layer 1, {b[0] or '(block)'} {b[1]} in layer {i}"
        elif a[2] != b[2]:
            d1, d2 = dict(a[2]), dict(b[2])
            keys = sorted(k for k in d1.keys() | d2.keys() if d1.get(k) != d2.get(k))
            what = f"{a[0] or 'the block'}: " + ", ".join(f"{k}={d1.get(k)!r} in layer 1, {d2.get(k)!r} in layer {i}"
                                                          for k in keys)
        else:
            what = f"{a[0] or 'the block'}: weights {a[3]} in layer 1, {b[3]} in layer {i}"
        raise ExportError(f"decoder layer {i} of {path} differs from layer 1 ({what}), so one traced layer "
                          "cannot stand for all of them; export with layerwise=False")


@contextlib.contextmanager
def _first_blocks(model: nn.Module, path: str, n: int) -> Iterator[nn.ModuleList]:
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
            stacks[i].enter_context(torch.fx.traceback.annotate({_BLOCK: i}))

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


def export_for_qaic(model: Any, out_dir: str | os.PathLike, *, batch_size: int = 1, prefill_seq_len: int = 32,
                    ctx_len: int = 128, kv_cache_prefix: str | None = None, layerwise: bool = True,
                    progress: Callable[[str, int, int], None] | None = None, run_compiler: bool = True,
                    **options: Any) -> ExportResult:
    """Export ``model`` for a Cloud AI 100 card into ``out_dir/<hash>/``.

    ``model``: what ``LLM`` takes (a transformers causal LM, a local model directory, a
    reference model or its name). ``options``: the rest of :class:`ExportOptions`
    (``kv_precision``, ``num_cores``, ``compiler_options``, ``retained_buffers``, ``opset``).
    ``progress(stage, done, total)`` is called as stages advance ("layers" counts the
    decoder layers built). ``run_compiler=False`` never runs qaic-compile (the command is
    still written). Raises ExportError for bad options or a model that cannot be exported.
    """
    opts = ExportOptions.from_options(batch_size=batch_size, prefill_seq_len=prefill_seq_len, ctx_len=ctx_len,
                                      kv_cache_prefix=kv_cache_prefix, layerwise=layerwise, **options)
    say = progress or (lambda stage, done, total: None)
    from qaic_dynamo.models import batch_dependent_rope, max_positions, max_positions_text

    t_start = time.perf_counter()
    engine_model = _engine_model(model)
    positions = max_positions(engine_model)
    if positions is not None and opts.ctx_len > positions:  # as LLM's max_model_len
        raise ExportError(f"ctx_len={opts.ctx_len} exceeds the model's {max_positions_text(engine_model)}; "
                          f"pass ctx_len <= {positions}")
    rope = batch_dependent_rope(engine_model)
    if rope is not None:
        # transformers picks these frequencies in Python from the longest position in the
        # forward (and longrope's from a tensor attribute it swaps): a traced graph would
        # keep one choice for every sequence.
        raise ExportError(f"the model's rope_type {rope[0]!r} chooses its RoPE frequencies from the sequence length "
                          "at run time, which an exported graph cannot; export a model with a fixed rope_type "
                          "(default, linear, llama3, yarn), or serve this one with LLM(...)")
    layer_names = list(engine_model.kv_cache_layers)
    shapes = engine_model.kv_cache_shapes(opts.batch_size, opts.ctx_len)
    past_shapes = [shapes[n] for n in layer_names]
    dtype = next(engine_model.parameters()).dtype
    buffers = dict(engine_model.named_buffers())
    unknown = [n for n in opts.retained_buffers if n not in buffers]
    if unknown:
        raise ExportError(f"retained_buffers {unknown} are not buffers of the model; its buffers: {sorted(buffers)}")
    retained = list(opts.retained_buffers)
    weights = _weights(engine_model, exclude=retained)
    t0 = time.perf_counter()
    identity = _identity(engine_model)  # hashes every weight: once
    digest = opts.compute_hash(identity)
    seconds_identity = time.perf_counter() - t0
    export_dir = Path(out_dir).expanduser().absolute() / digest  # compile.sh must run from anywhere
    export_dir.mkdir(parents=True, exist_ok=True)
    seconds: dict[str, float] = {"identity": seconds_identity}  # the weights' hash

    t0 = time.perf_counter()
    if opts.layerwise:
        from qaic_dynamo.regions import find_repeated_blocks

        blocks = [(p, lst) for p, lst in find_repeated_blocks(engine_model) if len(lst) == len(layer_names)]
        if not blocks:
            raise ExportError(f"{type(engine_model).__name__} has no list of {len(layer_names)} decoder blocks; "
                              "export with layerwise=False")
        path, block_list = blocks[0]
        _check_uniform_blocks(path, block_list)
        say("trace", 0, 1)

        def trace_first(n: int) -> _Trace:
            t = time.perf_counter()
            with _first_blocks(engine_model, path, n):
                out = _trace(engine_model, layer_names[:n], past_shapes[:n], dtype, opts.opset, retained)
            seconds["trace"] = seconds.get("trace", 0.0) + time.perf_counter() - t
            return out

        # Two blocks, which must be one graph once shared sizes are hoisted; if they are
        # not (a first layer that differs), three, of which the last two must be. Up to
        # that many layers, the trace is the whole model.
        L = len(layer_names)
        trace = trace_first(min(2, L))
        model_proto = None
        if L > 2:
            try:
                model_proto, outputs = _layerwise(trace, path, L, opts.kv_cache_prefix, opts.opset,
                                                  lambda i: say("layers", i + 1, L))
            except _BlocksDiffer:
                trace = trace_first(3)
        say("trace", 1, 1)
        if model_proto is None and trace.num_layers == L:
            model_proto, outputs = _whole_model(trace, opts.kv_cache_prefix, opts.opset)
            say("layers", L, L)
        elif model_proto is None:
            model_proto, outputs = _layerwise(trace, path, L, opts.kv_cache_prefix, opts.opset,
                                              lambda i: say("layers", i + 1, L))
    else:
        say("trace", 0, 1)
        trace = _trace(engine_model, layer_names, past_shapes, dtype, opts.opset, retained)
        say("trace", 1, 1)
        seconds["trace"] = time.perf_counter() - t0
        model_proto, outputs = _whole_model(trace, opts.kv_cache_prefix, opts.opset)
        say("layers", len(layer_names), len(layer_names))
    _name_dims(model_proto)
    # Translation and stitching: everything since t0 but the trace(s).
    seconds["translate"] = time.perf_counter() - t0 - seconds["trace"]

    t0 = time.perf_counter()
    say("weights", 0, 1)
    onnx_path = export_dir / ONNX_NAME
    _external_weights(model_proto, weights, export_dir / DATA_NAME)
    onnx.save_model(model_proto, str(onnx_path))
    seconds["weights"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    try:
        onnx.checker.check_model(str(onnx_path), full_check=True)
    except Exception as e:
        raise ExportError(f"the exported model fails onnx.checker: {e}") from e
    seconds["check"] = time.perf_counter() - t0

    inputs = [i.name for i in model_proto.graph.input]  # the weights are initializers by now
    custom_io = export_dir / "custom_io.yaml"
    custom_io.write_text(custom_io_yaml(outputs, opts.kv_precision,
                                        {o.name: o.type.tensor_type.elem_type for o in model_proto.graph.output}))
    specs_path = export_dir / "specializations.json"
    specs = specializations(opts)
    specs_path.write_text(json.dumps(specs, indent=2) + "\n")
    from qaic_dynamo.config import qaic_compiler_path

    compiler = qaic_compiler_path()
    probe = compile_command(onnx_path, Path("qpc"), custom_io, specs_path, opts, compiler)
    qpc_hash = hashlib.sha256(json.dumps({"command": probe, "specializations": specs,
                                          "custom_io": custom_io.read_text()}, sort_keys=True).encode()).hexdigest()[:16]
    qpc_dir = export_dir / f"qpc-{qpc_hash}"
    cmd = compile_command(onnx_path, qpc_dir, custom_io, specs_path, opts, compiler)
    (export_dir / "export_params.json").write_text(json.dumps(
        {"hash": digest, "options": opts.as_dict(), "model": identity,
         "compile": {"hash": qpc_hash, "command": cmd}}, indent=2, sort_keys=True, default=str) + "\n")
    compiled, log = False, None
    if run_compiler and compiler.exists() and os.access(compiler, os.X_OK):
        say("qaic-compile", 0, 1)
        qpc_dir.mkdir(parents=True, exist_ok=True)
        log = qpc_dir / "compile.log"
        proc = subprocess.run(cmd, capture_output=True, text=True)
        log.write_text(proc.stdout + proc.stderr)
        if proc.returncode != 0:
            raise ExportError(f"qaic-compile failed ({proc.returncode}); see {log}")
        compiled = True
    else:
        (export_dir / "compile.sh").write_text("#!/bin/sh\n# qaic-compile was not found here; run this where the "
                                               "Qualcomm Cloud AI SDK is installed.\n" + shlex.join(cmd) + "\n")
    seconds["total"] = time.perf_counter() - t_start
    return ExportResult(onnx_path, inputs, outputs, custom_io, specs_path, cmd, export_dir, qpc_dir, compiled,
                        opts.layerwise, len(layer_names), seconds, log,
                        trace.num_layers if opts.layerwise else len(layer_names))


# --- running the artifact on ONNX Runtime (validation) ------------------------------------------


def has_bfloat16_inputs(onnx_path: str | os.PathLike) -> bool:
    """Whether an exported model takes bfloat16 inputs (which ONNX Runtime's CPU kernels do
    not run); reads the graph only, not the weights."""
    graph = onnx.load(str(onnx_path), load_external_data=False).graph
    return any(i.type.tensor_type.elem_type == onnx.TensorProto.BFLOAT16 for i in graph.input)


def ort_generate(onnx_path: str | os.PathLike, prompts: Sequence[Sequence[int]], max_new_tokens: int,
                 prefill_seq_len: int, num_threads: int | None = None) -> tuple[list[list[int]], list[Any]]:
    """Greedy generation with an exported model on ONNX Runtime, the retained-state way:
    each prompt is prefilled alone in chunks of ``prefill_seq_len`` (padding has
    position -1), then all prompts decode together as one batch; every call's
    ``*_RetainedState`` outputs are fed back as the next call's inputs. Returns the new
    tokens per prompt and the logits [batch, vocab] of every decode step (numpy)."""
    import numpy as np
    import onnxruntime as ort

    for name, value in (("max_new_tokens", max_new_tokens), ("prefill_seq_len", prefill_seq_len)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ExportError(f"ort_generate: {name} must be a positive int, got {value!r}")
    try:
        if isinstance(prompts, (str, bytes)) or any(isinstance(p, (str, bytes)) for p in prompts):
            raise TypeError
        prompts = [list(p) for p in prompts]
    except TypeError:
        raise ExportError("ort_generate: prompts must be a list of token-id lists, e.g. [[1, 2, 3]] for one "
                          "prompt") from None
    if not prompts or any(not p for p in prompts):
        raise ExportError("ort_generate: pass at least one prompt, each with at least one token id")
    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    if num_threads:
        opts.intra_op_num_threads = num_threads
    try:
        sess = ort.InferenceSession(str(onnx_path), opts, providers=["CPUExecutionProvider"])
    except Exception as e:  # onnxruntime's own exception classes
        hint = ""
        if Path(onnx_path).is_file() and has_bfloat16_inputs(onnx_path):
            hint = " (its CPU kernels lack bfloat16: export a bfloat16 model in float16 to run it here)"
        raise ExportError(f"ONNX Runtime cannot load {onnx_path} on the CPU: "
                          f"{str(e).splitlines()[0] if str(e) else e!r}{hint}") from e
    past_inputs = [i for i in sess.get_inputs() if i.name not in ("input_ids", "position_ids")]
    others = [i.name for i in past_inputs if not is_kv_retained_state(i.name + RETAINED_STATE_SUFFIX)]
    if others:
        raise ExportError(f"ort_generate feeds KV caches only; {onnx_path} also takes {others} (retained buffers): "
                          "run it with onnxruntime directly, feeding their initial values")
    dtypes = {"tensor(float)": np.float32, "tensor(float16)": np.float16, "tensor(double)": np.float64}
    unknown = {i.name: i.type for i in past_inputs if i.type not in dtypes}
    if unknown:
        raise ExportError(f"ort_generate cannot make KV caches of {unknown}; ONNX Runtime's CPU kernels take "
                          "float32 or float16 models (export a bfloat16 model in float16 to run it here)")
    outputs = [o.name for o in sess.get_outputs()]
    vocab = sess.get_outputs()[0].shape[-1]
    for i, prompt in enumerate(prompts):
        # ONNX Gather reads a negative id from the end of the table: refuse it, as LLM does.
        bad = [t for t in prompt if not isinstance(t, (int, np.integer)) or isinstance(t, bool)
               or not 0 <= t < (vocab if isinstance(vocab, int) else t + 1)]
        if bad:
            raise ExportError(f"ort_generate: prompt {i} has token ids outside the vocabulary [0, {vocab}): {bad[:8]}")

    def empty(batch: int, ctx: int) -> dict[str, Any]:
        # Each cache in its input's element type: a float16 export takes float16 caches.
        return {i.name: np.zeros([batch, i.shape[1], ctx, i.shape[3]], dtype=dtypes[i.type]) for i in past_inputs}

    def step(ids: Any, pos: Any, past: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
        res = sess.run(outputs, {"input_ids": ids, "position_ids": pos, **past})
        new = {name[: -len(RETAINED_STATE_SUFFIX)]: v for name, v in zip(outputs[1:], res[1:])}
        return res[0][:, 0], new

    # ctx_len is a dynamic axis: the caches are sized for the longest sequence here.
    ctx = max(len(p) for p in prompts) + max_new_tokens
    rows, firsts = [], []
    for prompt in prompts:
        past = empty(1, ctx)
        for start in range(0, len(prompt), prefill_seq_len):
            chunk = list(prompt[start: start + prefill_seq_len])
            pad = prefill_seq_len - len(chunk)
            ids = np.array([chunk + [0] * pad], dtype=np.int64)
            pos = np.array([list(range(start, start + len(chunk))) + [-1] * pad], dtype=np.int64)
            logits, past = step(ids, pos, past)
        rows.append(past)
        firsts.append(int(logits[0].argmax()))
    past = {name: np.concatenate([r[name] for r in rows]) for name in rows[0]}
    tokens = [[t] for t in firsts]
    all_logits = []
    lengths = [len(p) for p in prompts]
    for k in range(1, max_new_tokens):
        ids = np.array([[t[-1]] for t in tokens], dtype=np.int64)
        pos = np.array([[n + k - 1] for n in lengths], dtype=np.int64)
        logits, past = step(ids, pos, past)
        all_logits.append(logits)
        for t, row in zip(tokens, logits):
            t.append(int(row.argmax()))
    return tokens, all_logits
