"""Run lowered pieces: ONNX Runtime sessions whose inputs and outputs are torch memory.

Compile and load are separate: lowering writes an artifact directory (a readable path:
``model.onnx`` + ``layout.json``); :func:`load` turns it into an :class:`Artifact` with
one ONNX Runtime session. One artifact serves every layer whose piece has its
fingerprint; each call site (each layer) gets a :class:`PieceRunner` with its own
IOBinding, so bindings that do not change between calls (weights, that layer's caches)
are bound once.

Zero copies: every input is bound to the torch tensor's memory (IOBinding with the data
pointer), and every output is written into a torch tensor allocated for it. A layer's KV
cache is bound as both the ``past_key`` input and the ``past_key_RetainedState`` output,
so the scatter updates it in place and a decode step costs the same whatever the cache
capacity.

With ``runtime="qaic"`` each new artifact is also compiled with ``qaic-compile`` into
``<artifact>/qpc`` (QEfficient's flags). Running a QPC on a card needs the QAIC runtime,
which this package does not drive yet, so pieces still execute on ONNX Runtime on the
host; without the SDK, ``runtime="qaic"`` is refused up front with a clear error.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import onnx
import onnxruntime as ort
import sympy
import torch
import torch.fx as fx
import torch.utils._sympy.functions as sympy_functions
from torch.utils import _pytree as pytree

from qaic_dynamo import _C
from qaic_dynamo.config import CompilationConfig
from qaic_dynamo.counter import compilation_counter
from qaic_dynamo.lowering import LAYOUT_FILE, ONNX_FILE, LoweringError, PieceLayout

__all__ = [
    "Artifact",
    "PieceRunner",
    "QAIC_COMPILE",
    "load",
    "qaic_compile",
    "qaic_compile_command",
    "qaic_sdk_available",
    "warn_fallback",
]

logger = logging.getLogger("qaic_dynamo")

QAIC_COMPILE = Path("/opt/qti-aic/exec/qaic-compile")

#: torch dtype -> ONNX TensorProto element type, as IOBinding takes it (an integer type
#: also covers bfloat16, which numpy has no dtype for).
_ONNX_TYPES = {
    torch.float32: onnx.TensorProto.FLOAT,
    torch.float16: onnx.TensorProto.FLOAT16,
    torch.bfloat16: onnx.TensorProto.BFLOAT16,
    torch.float64: onnx.TensorProto.DOUBLE,
    torch.int64: onnx.TensorProto.INT64,
    torch.int32: onnx.TensorProto.INT32,
    torch.bool: onnx.TensorProto.BOOL,
}
_CPU = ort.OrtDevice.make("cpu", 0)._get_c_device()
_SYMPY_LOCALS = {name: getattr(sympy_functions, name) for name in dir(sympy_functions) if not name.startswith("_")}

_warned: set[str] = set()


def warn_fallback(what: str, reason: str) -> None:
    """Count an eager fallback and warn once per distinct reason."""
    compilation_counter.num_eager_fallbacks += 1
    if reason not in _warned:
        _warned.add(reason)
        msg = f"qaic: {what} runs eagerly: {reason}"
        logger.warning(msg)
        warnings.warn(msg, RuntimeWarning, stacklevel=3)


def _shape_fn(shape: list[int | str] | None, symbols: dict[str, list[Any]]) -> Callable[[dict[str, int]], list[int]]:
    """Compile an output's shape spec (ints and expressions in canonical symbols)."""
    if shape is None:
        return lambda sym: []
    parts: list[Callable[[dict[str, int]], int]] = []
    for dim in shape:
        if isinstance(dim, int):
            parts.append(lambda sym, d=dim: d)
        elif dim in symbols:
            parts.append(lambda sym, d=dim: sym[d])
        else:
            expr = sympy.sympify(dim, locals={**_SYMPY_LOCALS, **{s: sympy.Symbol(s, integer=True) for s in symbols}})
            missing = {str(s) for s in expr.free_symbols} - set(symbols)
            if missing:
                raise LoweringError(f"an output size {dim} uses {sorted(missing)}, which no input carries")
            parts.append(lambda sym, e=expr: int(e.xreplace({sympy.Symbol(k, integer=True): v for k, v in sym.items()})))
    return lambda sym: [p(sym) for p in parts]


@dataclass
class Artifact:
    """A loaded artifact: its directory, layout and session (shared by every call site)."""

    path: Path
    layout: PieceLayout
    session: ort.InferenceSession
    output_shapes: list[Callable[[dict[str, int]], list[int]]]
    output_dtypes: list[torch.dtype]

    @property
    def needs_symbols(self) -> bool:
        return any(o["target"][0] == "leaf" and any(isinstance(d, str) for d in o["shape"]) for o in self.layout.outputs) or any(
            leaf[0] == "sym" for leaf in self.layout.leaves
        )


def load(path: Path, config: CompilationConfig) -> Artifact:
    """Create the runtime for an artifact directory written by :func:`lowering.lower_piece`."""
    layout = PieceLayout.from_json((path / LAYOUT_FILE).read_text())
    dtypes = []
    for o in layout.outputs:
        dtype = getattr(torch, o["dtype"])
        if dtype not in _ONNX_TYPES:
            raise LoweringError(
                f"output {o['name']} is {dtype}; the runtime binds {sorted(str(d) for d in _ONNX_TYPES)}"
            )
        dtypes.append(dtype)
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = config.num_threads or torch.get_num_threads()
    opts.inter_op_num_threads = 1
    opts.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    # Spinning worker threads would steal the cores from PyTorch's eager attention that
    # runs between pieces.
    opts.add_session_config_entry("session.intra_op.allow_spinning", "0")
    try:
        session = ort.InferenceSession(str(path / ONNX_FILE), sess_options=opts, providers=["CPUExecutionProvider"])
    except Exception as e:
        raise LoweringError(f"ONNX Runtime could not load the model: {str(e).splitlines()[0]}") from e
    compilation_counter.num_runtime_sessions += 1
    shapes = [_shape_fn(o["shape"], layout.symbols) for o in layout.outputs]
    return Artifact(path, layout, session, shapes, dtypes)


class PieceRunner(torch.nn.Module):
    """One call site of an artifact; falls back to the eager piece if a run fails.

    The per-call path is kept lean because it runs once per layer per step: bindings are
    compared with what is already bound and only changed ones are re-bound (weights and
    the layer's caches stay bound), and the C-level IOBinding is called directly.
    """

    def __init__(self, artifact: Artifact, eager: fx.GraphModule, config: CompilationConfig, label: str) -> None:
        super().__init__()
        self.artifact = artifact
        self.eager = eager
        self.config = config
        self.label = label
        self.use_eager = False
        self._io = artifact.session.io_binding()
        # The wrapper's bind_* build a device object per call; this is the same binding.
        self._c_io = self._io._iobinding
        self._bound: dict[str, tuple[int, tuple[int, ...], torch.dtype]] = {}
        layout = artifact.layout
        self._updates = [(u["layer_name"], u["op"]) for u in layout.kv_updates]
        self._needs_symbols = artifact.needs_symbols
        self._inputs = [(spec["name"], spec["source"]) for spec in layout.inputs]
        self._outputs = [
            (spec["name"], spec["target"], shape_fn, dtype)
            for spec, shape_fn, dtype in zip(layout.outputs, artifact.output_shapes, artifact.output_dtypes)
        ]
        spec = pytree.treespec_loads(layout.out_spec)
        self._spec = spec
        self._flat_tuple = spec.type is tuple and all(c.is_leaf() for c in spec.children())
        self._dep = {leaf[1]: torch.empty(0, dtype=getattr(torch, leaf[1])) for leaf in layout.leaves if leaf[0] == "dep"}

    def _bind(self, name: str, t: torch.Tensor, output: bool = False) -> None:
        sig = (t.data_ptr(), t.shape, t.dtype, output)
        if self._bound.get(name) != sig:
            dtype = _ONNX_TYPES.get(t.dtype)
            if dtype is None:
                raise LoweringError(f"{name} is {t.dtype}, which the runtime cannot bind")
            bind = self._c_io.bind_output if output else self._c_io.bind_input
            bind(name, _CPU, dtype, list(t.shape), t.data_ptr())
            self._bound[name] = sig

    def _symbols(self, args: Sequence[Any]) -> dict[str, int]:
        sym = {}
        for name, src in self.artifact.layout.symbols.items():
            sym[name] = int(args[src[1]].shape[src[2]]) if src[0] == "dim" else int(args[src[1]])
        return sym

    def forward(self, *args: Any) -> Any:
        if self.use_eager:
            return self.eager(*args)
        ctx = _C.current_forward_context(self.label) if self._updates else None
        start = ctx.kv_cache_layer_index if ctx is not None else 0
        try:
            return self._run(args, ctx)
        except Exception as e:
            if self.config.fallback == "error":
                raise
            if ctx is not None:  # nothing was written; let the eager ops resolve again
                ctx.rewind_kv_cache_layer_index(start)
            # If eager fails too, the inputs were bad: report that, stay compiled.
            out = self.eager(*args)
            self.use_eager = True
            warn_fallback(self.label, f"ONNX Runtime failed: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
            return out

    def _run(self, args: Sequence[Any], ctx: Any) -> Any:
        keep: list[torch.Tensor] = []  # contiguous copies must outlive the run
        caches = [ctx.resolve_for_update(name, op)[1] for name, op in self._updates]
        for name, src in self._inputs:
            kind = src[0]
            if kind == "arg":
                t = args[src[1]]
                if not t.is_contiguous():
                    t = t.contiguous()
                    keep.append(t)
            elif kind == "cache":
                t = caches[src[1]][src[2]]
            else:
                t = ctx.attn_metadata.slot_mapping_i64
            self._bind(name, t)

        sym = self._symbols(args) if self._needs_symbols else None
        outs: list[torch.Tensor | None] = []
        for name, target, shape_fn, dtype in self._outputs:
            if target[0] == "cache":  # in place: the retained-state output is the cache
                self._bind(name, caches[target[1]][target[2]], output=True)
                outs.append(None)
            else:
                t = torch.empty(shape_fn(sym), dtype=dtype)
                self._bind(name, t, output=True)
                outs.append(t)
        self.artifact.session._sess.run_with_iobinding(self._c_io, None)

        leaves = []
        for leaf in self.artifact.layout.leaves:
            kind = leaf[0]
            if kind == "onnx":
                leaves.append(outs[leaf[1]])
            elif kind == "arg":
                leaves.append(args[leaf[1]])
            elif kind == "dep":
                leaves.append(self._dep[leaf[1]])
            elif kind == "sym":
                leaves.append(int(sympy.sympify(leaf[1], locals=_SYMPY_LOCALS).xreplace(
                    {sympy.Symbol(k, integer=True): v for k, v in sym.items()})))
            else:
                leaves.append(leaf[1])
        return tuple(leaves) if self._flat_tuple else pytree.tree_unflatten(leaves, self._spec)


def qaic_compile_command(
    artifact_dir: Path,
    out_dir: Path,
    num_cores: int = 16,
    custom_io: Path | None = None,
    specializations: Path | None = None,
    extra: dict[str, Any] | None = None,
) -> list[str]:
    """The ``qaic-compile`` command line for an artifact (QEfficient's conventions).

    ``extra`` maps ``key_name=value`` to ``-key-name=value``; ``True`` gives a bare flag.
    """
    cmd = [
        str(QAIC_COMPILE), "-aic-hw", "-aic-hw-version=2.0", f"-m={artifact_dir / ONNX_FILE}",
        "-retained-state", "-convert-to-fp16", f"-aic-num-cores={num_cores}",
    ]
    if custom_io is not None:
        cmd.append(f"-custom-IO-list-file={custom_io}")
    if specializations is not None:
        cmd.append(f"-network-specialization-config={specializations}")
    for key, value in (extra or {}).items():
        flag = "-" + key.replace("_", "-")
        if value is True:
            cmd.append(flag)
        elif value is not False and value is not None:
            cmd.append(f"{flag}={value}")
    cmd.append(f"-aic-binary-dir={out_dir}")
    return cmd


def qaic_sdk_available() -> bool:
    return (QAIC_COMPILE.exists() and os.access(QAIC_COMPILE, os.X_OK)) or shutil.which("qaic-compile") is not None


def qaic_compile(artifact_dir: Path, out_dir: Path, **kwargs: Any) -> Path:
    """Compile an artifact with the Qualcomm SDK into ``out_dir`` (a QPC directory)."""
    if not qaic_sdk_available():
        raise LoweringError(
            f"runtime='qaic' needs the Qualcomm Cloud AI SDK ({QAIC_COMPILE} not found); "
            "install it, or use runtime='onnxruntime'"
        )
    cmd = qaic_compile_command(artifact_dir, out_dir, **kwargs)
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise LoweringError(f"qaic-compile failed ({proc.returncode}): {proc.stderr.strip()[-2000:]}")
    return out_dir
