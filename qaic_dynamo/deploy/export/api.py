"""Deployment export: one self-contained ONNX model per LLM, in QAIC's conventions.

The torch.compile path runs pieces on the host. A Cloud AI 100 card needs something else:
one model whose KV cache is *retained state* - input ``past_key.{i}``, output
``past_key.{i}_RetainedState`` in the layout ``[batch, kv_heads, ctx_len, head_dim]`` -
with the cache write and read as ``com.qualcomm.cloud`` functions (``CtxScatter``,
``CtxGather``), plus the compiler's ``custom_io.yaml`` and ``specializations.json``.
:func:`export_for_qaic` builds it for every model the engine runs (transformers families,
a local model directory, the reference Llama and MLA models).

The export directory is named by a hash of everything that changes the artifact
(``ExportOptions.compute_hash`` and the model's identity), and the hashed parameters are
written beside it. Weights are ONNX external data beside the model (real models exceed
protobuf's 2 GB), so the artifact loads from any working directory.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shlex
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import onnx
import torch
import torch.nn as nn

from qaic_dynamo.compiler.regions import find_repeated_blocks
from qaic_dynamo.config import qaic_compiler_path
from qaic_dynamo.deploy.export.assemble import external_weights, name_dims, whole_model
from qaic_dynamo.deploy.export.compiler_inputs import compile_command, custom_io_yaml, specializations
from qaic_dynamo.deploy.export.layerwise import BLOCK_ANNOTATION, layerwise_model
from qaic_dynamo.deploy.export.options import ExportOptions
from qaic_dynamo.deploy.export.trace import (
    Trace,
    block_signature,
    engine_model_of,
    model_identity,
    model_weights,
    trace_model,
)
from qaic_dynamo.errors import BlocksDiffer, ExportError
from qaic_dynamo.models import batch_dependent_rope, max_positions, max_positions_text

__all__ = ["DATA_NAME", "ONNX_NAME", "ExportResult", "export_for_qaic"]

ONNX_NAME = "model.onnx"
DATA_NAME = "model.onnx.data"


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
            f"layers            {self.num_layers} ("
            + (
                f"layerwise: {self.traced_layers} traced, one block lowered, stitched"
                if self.layerwise
                else "whole model"
            )
            + ")",
            "seconds           " + ", ".join(f"{k} {v:.2f}" for k, v in self.seconds.items()),
        ]
        if self.compiled:
            lines.append(f"qaic-compile      ran: {self.qpc_dir} (log {self.compile_log})")
        else:
            lines.append(f"qaic-compile      not run: command written to {self.export_dir / 'compile.sh'}")
        return "\n".join(lines)


def _check_uniform_blocks(path: str, blocks: nn.ModuleList) -> None:
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


def export_for_qaic(
    model: Any,
    out_dir: str | os.PathLike,
    *,
    batch_size: int = 1,
    prefill_seq_len: int = 32,
    ctx_len: int = 128,
    kv_cache_prefix: str | None = None,
    layerwise: bool = True,
    progress: Callable[[str, int, int], None] | None = None,
    run_compiler: bool = True,
    **options: Any,
) -> ExportResult:
    """Export ``model`` for a Cloud AI 100 card into ``out_dir/<hash>/``.

    ``model``: what ``LLM`` takes (a transformers causal LM, a local model directory, a
    reference model or its name). ``options``: the rest of :class:`ExportOptions`
    (``kv_precision``, ``num_cores``, ``compiler_options``, ``retained_buffers``, ``opset``).
    ``progress(stage, done, total)`` is called as stages advance ("layers" counts the
    decoder layers built). ``run_compiler=False`` never runs qaic-compile (the command is
    still written). Raises ExportError for bad options or a model that cannot be exported.
    """
    opts = ExportOptions.from_options(
        batch_size=batch_size,
        prefill_seq_len=prefill_seq_len,
        ctx_len=ctx_len,
        kv_cache_prefix=kv_cache_prefix,
        layerwise=layerwise,
        **options,
    )
    say = progress or (lambda stage, done, total: None)
    t_start = time.perf_counter()
    engine_model = engine_model_of(model)
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
    past_shapes = [shapes[n] for n in layer_names]
    dtype = next(engine_model.parameters()).dtype
    buffers = dict(engine_model.named_buffers())
    unknown = [n for n in opts.retained_buffers if n not in buffers]
    if unknown:
        raise ExportError(f"retained_buffers {unknown} are not buffers of the model; its buffers: {sorted(buffers)}")
    retained = list(opts.retained_buffers)
    weights = model_weights(engine_model, exclude=retained)
    t0 = time.perf_counter()
    identity = model_identity(engine_model)  # hashes every weight: once
    digest = opts.compute_hash(identity)
    seconds_identity = time.perf_counter() - t0
    export_dir = Path(out_dir).expanduser().absolute() / digest  # compile.sh must run from anywhere
    export_dir.mkdir(parents=True, exist_ok=True)
    seconds: dict[str, float] = {"identity": seconds_identity}  # the weights' hash

    t0 = time.perf_counter()
    if opts.layerwise:
        blocks = [(p, lst) for p, lst in find_repeated_blocks(engine_model) if len(lst) == len(layer_names)]
        if not blocks:
            raise ExportError(
                f"{type(engine_model).__name__} has no list of {len(layer_names)} decoder blocks; "
                "export with layerwise=False"
            )
        path, block_list = blocks[0]
        _check_uniform_blocks(path, block_list)
        say("trace", 0, 1)

        def trace_first(n: int) -> Trace:
            t = time.perf_counter()
            with _first_blocks(engine_model, path, n):
                out = trace_model(engine_model, layer_names[:n], past_shapes[:n], dtype, opts.opset, retained)
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
                model_proto, outputs = layerwise_model(
                    trace, path, L, opts.kv_cache_prefix, opts.opset, lambda i: say("layers", i + 1, L)
                )
            except BlocksDiffer:
                trace = trace_first(3)
        say("trace", 1, 1)
        if model_proto is None and trace.num_layers == L:
            model_proto, outputs = whole_model(trace, opts.kv_cache_prefix, opts.opset)
            say("layers", L, L)
        elif model_proto is None:
            model_proto, outputs = layerwise_model(
                trace, path, L, opts.kv_cache_prefix, opts.opset, lambda i: say("layers", i + 1, L)
            )
    else:
        say("trace", 0, 1)
        trace = trace_model(engine_model, layer_names, past_shapes, dtype, opts.opset, retained)
        say("trace", 1, 1)
        seconds["trace"] = time.perf_counter() - t0
        model_proto, outputs = whole_model(trace, opts.kv_cache_prefix, opts.opset)
        say("layers", len(layer_names), len(layer_names))
    name_dims(model_proto)
    # Translation and stitching: everything since t0 but the trace(s).
    seconds["translate"] = time.perf_counter() - t0 - seconds["trace"]

    t0 = time.perf_counter()
    say("weights", 0, 1)
    onnx_path = export_dir / ONNX_NAME
    external_weights(model_proto, weights, export_dir / DATA_NAME)
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
    custom_io.write_text(
        custom_io_yaml(
            outputs, opts.kv_precision, {o.name: o.type.tensor_type.elem_type for o in model_proto.graph.output}
        )
    )
    specs_path = export_dir / "specializations.json"
    specs = specializations(opts)
    specs_path.write_text(json.dumps(specs, indent=2) + "\n")
    compiler = qaic_compiler_path()
    probe = compile_command(onnx_path, Path("qpc"), custom_io, specs_path, opts, compiler)
    qpc_hash = hashlib.sha256(
        json.dumps(
            {"command": probe, "specializations": specs, "custom_io": custom_io.read_text()}, sort_keys=True
        ).encode()
    ).hexdigest()[:16]
    qpc_dir = export_dir / f"qpc-{qpc_hash}"
    cmd = compile_command(onnx_path, qpc_dir, custom_io, specs_path, opts, compiler)
    (export_dir / "export_params.json").write_text(
        json.dumps(
            {
                "hash": digest,
                "options": opts.as_dict(),
                "model": identity,
                "compile": {"hash": qpc_hash, "command": cmd},
            },
            indent=2,
            sort_keys=True,
            default=str,
        )
        + "\n"
    )
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
        (export_dir / "compile.sh").write_text(
            "#!/bin/sh\n# qaic-compile was not found here; run this where the "
            "Qualcomm Cloud AI SDK is installed.\n" + shlex.join(cmd) + "\n"
        )
    seconds["total"] = time.perf_counter() - t_start
    return ExportResult(
        onnx_path,
        inputs,
        outputs,
        custom_io,
        specs_path,
        cmd,
        export_dir,
        qpc_dir,
        compiled,
        opts.layerwise,
        len(layer_names),
        seconds,
        log,
        trace.num_layers if opts.layerwise else len(layer_names),
    )
