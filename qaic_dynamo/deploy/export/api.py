"""Deployment export: one self-contained ONNX model per LLM, in QAIC's conventions.

The torch.compile path runs pieces on the host. A Cloud AI 100 card needs something else:
one model whose KV cache is *retained state* - input ``past_key.{i}``, output
``past_key.{i}_RetainedState`` in the layout ``[batch, kv_heads, ctx_len, head_dim]`` -
with the cache write and read as ``com.qualcomm.cloud`` functions (``CtxScatter``,
``CtxGather``; ``CtxScatterCB`` / ``CtxGatherCB`` with continuous batching), plus the
compiler's ``custom_io.yaml`` and ``specializations.json``. :func:`export_for_qaic`
builds it for every model the engine runs (transformers families, a local model
directory, the reference Llama and MLA models); :func:`export_prefill_decode` builds the
prefill-only and decode-only pair of disaggregated serving from one trace.

The export directory is named by a hash of everything that changes the artifact
(``ExportOptions.compute_hash`` and the model's identity), and the hashed parameters are
written beside it. Weights are ONNX external data beside the model (real models exceed
protobuf's 2 GB), so the artifact loads from any working directory.
"""

from __future__ import annotations

import hashlib
import json
import os
import shlex
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import onnx
import torch

from qaic_dynamo.config import qaic_compiler_path
from qaic_dynamo.deploy.export.assemble import external_weights
from qaic_dynamo.deploy.export.build import Built, Prepared, build, prepare
from qaic_dynamo.deploy.export.compiler_inputs import compile_command, custom_io_yaml, mdp_partition_config
from qaic_dynamo.deploy.export.options import ExportOptions
from qaic_dynamo.deploy.export.specializations import ccl_lengths, specializations
from qaic_dynamo.errors import ExportError

__all__ = ["DATA_NAME", "ONNX_NAME", "ExportPair", "ExportResult", "export_for_qaic", "export_prefill_decode"]

ONNX_NAME = "model.onnx"
DATA_NAME = "model.onnx.data"


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


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
    #: load, identity, trace, translate (stitch included), weights (writing them), check, total.
    seconds: dict[str, float]
    compile_log: Path | None = None
    #: Decoder layers traced (layerwise: 2, or 3 when the first layer differs).
    traced_layers: int = 0
    #: The options it was built with (the hash's), and the checkpoint's and the export's dtypes.
    options: ExportOptions = field(default_factory=ExportOptions)
    source_dtype: str = "float32"
    dtype: str = "float32"
    #: The specializations' names, in file order.
    specialization_names: list[str] = field(default_factory=list)
    #: Compute-context lengths of the Prefill and Decode specializations (None: no CCL).
    comp_ctx_lengths_prefill: list[int] | None = None
    comp_ctx_lengths_decode: list[int] | None = None
    #: What the summary must say beyond the figures (a dtype changed, an option ignored).
    notes: list[str] = field(default_factory=list)

    def summary(self) -> str:
        o = self.options
        lines = [
            f"onnx              {self.onnx_path}",
            f"custom_io         {self.custom_io_path}"
            + ("" if "-custom-IO-list-file" in " ".join(self.compile_command) else " (written, not passed: all bf16)"),
            f"specializations   {self.specializations_path} ({', '.join(self.specialization_names)})",
            f"hardware          {o.hw_version}; weights and KV {self.dtype}, logits float32"
            + (f" (checkpoint {self.source_dtype})" if self.source_dtype != self.dtype else ""),
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
        ]
        if o.continuous_batching:
            lines.append(f"batching          continuous: full_batch_size {o.full_batch_size}, batch_index input")
        if self.comp_ctx_lengths_prefill or self.comp_ctx_lengths_decode:
            lines.append(
                f"compute contexts  prefill {self.comp_ctx_lengths_prefill}, decode {self.comp_ctx_lengths_decode}"
            )
        lines += [f"note              {n}" for n in self.notes]
        lines.append("seconds           " + ", ".join(f"{k} {v:.2f}" for k, v in self.seconds.items()))
        if self.compiled:
            lines.append(f"qaic-compile      ran: {self.qpc_dir} (log {self.compile_log})")
        else:
            lines.append(f"qaic-compile      not run: command written to {self.export_dir / 'compile.sh'}")
        return "\n".join(lines)


@dataclass
class ExportPair:
    """What :func:`export_prefill_decode` wrote: the prefill-only and decode-only artifacts
    of one model file."""

    prefill: ExportResult
    decode: ExportResult
    seconds: dict[str, float]


def _check_out_dir(out_dir: str | os.PathLike) -> None:
    """Refuse, before anything is traced, an output root that cannot hold directories."""
    path = Path(out_dir).expanduser()
    for parent in (path, *path.parents):
        if parent.exists():
            if not parent.is_dir():
                raise ExportError(f"the output directory {path} cannot be made: {parent} is a file")
            if not os.access(parent, os.W_OK | os.X_OK):
                raise ExportError(f"the output directory {path} cannot be made: {parent} is not writable")
            return


def _options(
    batch_size: int,
    prefill_seq_len: int,
    ctx_len: int,
    kv_cache_prefix: str | None,
    layerwise: bool,
    options: dict[str, Any],
) -> ExportOptions:
    return ExportOptions.from_options(
        batch_size=batch_size,
        prefill_seq_len=prefill_seq_len,
        ctx_len=ctx_len,
        kv_cache_prefix=kv_cache_prefix,
        layerwise=layerwise,
        **options,
    )


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
    (``hw_version``, ``full_batch_size``, ``prefill_only``, ``comp_ctx_lengths_prefill`` /
    ``_decode``, ``kv_precision``, ``num_cores``, ``num_devices``, ``compiler_options``,
    ``retained_buffers``, ``specializations_format``, ``opset``, ...).
    ``progress(stage, done, total)`` is called as stages advance ("layers" counts the
    decoder layers built). ``run_compiler=False`` never runs qaic-compile (the command is
    still written). Raises ExportError for bad options or a model that cannot be exported.
    """
    t_start = time.perf_counter()
    opts = _options(batch_size, prefill_seq_len, ctx_len, kv_cache_prefix, layerwise, options)
    _check_out_dir(out_dir)
    say = progress or (lambda stage, done, total: None)
    prepared = prepare(model, opts)
    built = build(prepared, opts, say)
    result = _write(out_dir, opts, prepared, built, say, run_compiler)
    result.seconds["total"] = time.perf_counter() - t_start
    return result


def export_prefill_decode(
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
) -> ExportPair:
    """The artifacts of disaggregated serving, as QEfficient's ``prefill_only=True`` and
    ``prefill_only=False`` compiles of one model: ``out_dir/<hash>/model.onnx`` (and its
    weights) once, with ``prefill/`` (the Prefill specializations) and ``decode/`` (the
    Decode ones) beside it, each with its own ``specializations.json``, ``custom_io.yaml``
    and compile command over that one model.

    One trace, one translation and one weights file: the graph does not depend on which
    specializations it is compiled for. Options as :func:`export_for_qaic`, but
    ``prefill_only``; give the pair a ``kv_cache_prefix`` to serve both in one process."""
    if "prefill_only" in options:
        raise ExportError("export_prefill_decode writes both artifacts; pass prefill_only to export_for_qaic instead")
    t_start = time.perf_counter()
    opts = _options(batch_size, prefill_seq_len, ctx_len, kv_cache_prefix, layerwise, options)
    _check_out_dir(out_dir)
    say = progress or (lambda stage, done, total: None)
    prepared = prepare(model, opts)
    built = build(prepared, opts, say)
    pair_dir = Path(out_dir).expanduser().absolute() / opts.compute_hash(prepared.identity)
    onnx_path, model_proto, seconds = _write_model(pair_dir, prepared, built, say)
    results = [
        _write_compiler_inputs(
            pair_dir / role,
            onnx_path,
            model_proto,
            opts.replace(prefill_only=only),
            prepared,
            built,
            dict(seconds),
            say,
            run_compiler,
        )
        for role, only in (("prefill", True), ("decode", False))
    ]
    return ExportPair(
        results[0], results[1], {**prepared.seconds, **built.seconds, **seconds, "total": time.perf_counter() - t_start}
    )


def _write_model(
    export_dir: Path, prepared: Prepared, built: Built, say: Callable[[str, int, int], None]
) -> tuple[Path, onnx.ModelProto, dict[str, float]]:
    """Write the model with its weights as external data into ``export_dir`` and check it."""
    export_dir.mkdir(parents=True, exist_ok=True)
    onnx_path = export_dir / ONNX_NAME
    t0 = time.perf_counter()
    say("weights", 0, 1)
    model_proto = onnx.ModelProto()
    model_proto.CopyFrom(built.model)  # the weights are attached to this copy
    external_weights(model_proto, prepared.weights, export_dir / DATA_NAME)
    onnx.save_model(model_proto, str(onnx_path))
    seconds = {"weights": time.perf_counter() - t0}
    t0 = time.perf_counter()
    try:
        onnx.checker.check_model(str(onnx_path), full_check=True)
    except Exception as e:
        raise ExportError(f"the exported model fails onnx.checker: {e}") from e
    seconds["check"] = time.perf_counter() - t0
    return onnx_path, model_proto, seconds


def _write(
    out_dir: str | os.PathLike,
    opts: ExportOptions,
    prepared: Prepared,
    built: Built,
    say: Callable[[str, int, int], None],
    run_compiler: bool,
) -> ExportResult:
    """Write one artifact into ``out_dir/<hash>/``: the model, and what qaic-compile reads."""
    export_dir = Path(out_dir).expanduser().absolute() / opts.compute_hash(prepared.identity)
    onnx_path, model_proto, seconds = _write_model(export_dir, prepared, built, say)
    return _write_compiler_inputs(
        export_dir,
        onnx_path,
        model_proto,
        opts,
        prepared,
        built,
        {**prepared.seconds, **built.seconds, **seconds},
        say,
        run_compiler,
    )


def _write_compiler_inputs(
    export_dir: Path,
    onnx_path: Path,
    model_proto: onnx.ModelProto,
    opts: ExportOptions,
    prepared: Prepared,
    built: Built,
    seconds: dict[str, float],
    say: Callable[[str, int, int], None],
    run_compiler: bool,
) -> ExportResult:
    """Write what qaic-compile reads beside ``onnx_path`` into ``export_dir``, and run it
    where the SDK is installed."""
    export_dir.mkdir(parents=True, exist_ok=True)
    precision = prepared.precision
    digest = opts.compute_hash(prepared.identity)

    inputs = [i.name for i in model_proto.graph.input]  # the weights are initializers by now
    custom_io = export_dir / "custom_io.yaml"
    custom_io.write_text(
        custom_io_yaml(
            built.outputs, precision.kv, {o.name: o.type.tensor_type.elem_type for o in model_proto.graph.output}
        )
    )
    specs_path = export_dir / "specializations.json"
    specs = specializations(opts)
    specs_path.write_text(json.dumps(specs, indent=2) + "\n")
    names = [s.get("name", f"Graph_{i}") for i, s in enumerate(specs["specializations"])]
    mdp = None
    if opts.num_devices > 1:
        mdp = export_dir / f"mdp_ts_{opts.num_devices}.json"
        mdp.write_text(json.dumps(mdp_partition_config(opts.num_devices, opts.num_cores), indent=2) + "\n")
    passed_io = custom_io if precision.pass_custom_io else None
    compiler = qaic_compiler_path()
    probe = compile_command(onnx_path, Path("qpc"), passed_io, specs_path, opts, precision, compiler, mdp)
    qpc_hash = hashlib.sha256(
        json.dumps(
            {"command": probe, "specializations": specs, "custom_io": custom_io.read_text()}, sort_keys=True
        ).encode()
    ).hexdigest()[:16]
    qpc_dir = export_dir / f"qpc-{qpc_hash}"
    cmd = compile_command(onnx_path, qpc_dir, passed_io, specs_path, opts, precision, compiler, mdp)
    (export_dir / "export_params.json").write_text(
        json.dumps(
            {
                "hash": digest,
                "onnx": os.path.relpath(onnx_path, export_dir),
                "options": opts.as_dict(),
                "model": prepared.identity,
                "dtype": {"checkpoint": _dtype_name(precision.source), "exported": _dtype_name(precision.exported)},
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
    prefill_ccl, decode_ccl = ccl_lengths(opts)
    return ExportResult(
        onnx_path,
        inputs,
        built.outputs,
        custom_io,
        specs_path,
        cmd,
        export_dir,
        qpc_dir,
        compiled,
        opts.layerwise,
        len(prepared.layer_names),
        seconds,
        log,
        built.traced_layers,
        opts,
        _dtype_name(precision.source),
        _dtype_name(precision.exported),
        names,
        prefill_ccl,
        decode_ccl,
        list(prepared.notes),
    )
