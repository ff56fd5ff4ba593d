"""Lower one graph piece to accelerator ONNX.

Input: a compilable piece (an FX GraphModule from the partition stage) and fake example
arguments. Output: an *artifact directory* holding ``model.onnx`` and ``layout.json``,
the description the runtime needs to call it. Lowering never runs the model.

What happens to a piece:

1. **KV-cache updates become retained state.** Each ``qaic::unified_kv_cache_update(k, v,
   name)`` (and its MLA twin) is replaced by a functional scatter into two new graph
   inputs, ``past_key`` / ``past_value`` (MLA: ``compressed_kv`` / ``k_pe``), whose
   results are the outputs ``past_key_RetainedState`` / ``past_value_RetainedState``; one
   more input, ``slot_mapping``, says where each token goes. In ONNX the scatter is the
   ``com.qualcomm.cloud::KVCacheScatter`` function. A piece with several updates numbers
   them (``past_key.0``, ``past_key.1``, ...). The layer name stays in ``layout.json``:
   the runtime resolves it through the forward context at call time, exactly as the eager
   op does, and binds that layer's cache as both the input and its ``_RetainedState``
   output, so the update is in place. The dependency token the op returned is made by the
   runtime (it carries no data).
2. **Symbolic sizes come from tensors.** Dynamo passes symbolic sizes (``s0``) as graph
   inputs; ONNX has no scalar-int inputs for them, so each is rewritten to the size of a
   tensor input that has it (``aten.sym_size``). Symbolic dims become dynamic ONNX dims,
   so one artifact serves every token count.
3. **Export** with ``torch.onnx.export(dynamo=True)`` and the custom translation above,
   then ``onnx.checker.check_model(full_check=True)``.

Anything that cannot be lowered raises :class:`LoweringError` with the reason; the backend
decides whether that means an eager fallback or an error.
"""

from __future__ import annotations

import functools
import json
import logging
import operator
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import onnx
import onnx.inliner
import sympy
import torch
import torch.fx as fx
from torch.fx.passes.fake_tensor_prop import FakeTensorProp
from torch.utils import _pytree as pytree

from qaic_dynamo.config import CompilationConfig
from qaic_dynamo.counter import compilation_counter
from qaic_dynamo.fingerprint import _Canon
from qaic_dynamo.onnx_functions import QAIC_DOMAIN, function_protos, kv_cache_scatter_node
from qaic_dynamo.partition import op_name

__all__ = ["LoweringError", "PieceLayout", "lower_piece", "ONNX_FILE", "LAYOUT_FILE"]

logger = logging.getLogger("qaic_dynamo")
# The exporter warns on every export that torchvision (whose ops we never use) is missing.
logging.getLogger("torch.onnx._internal.exporter._registration").setLevel(logging.ERROR)

ONNX_FILE = "model.onnx"
LAYOUT_FILE = "layout.json"
#: onnxruntime 1.31 reads IR version <= 13; the exporter's default is within that, but a
#: newer onnx could raise it, so it is capped.
MAX_IR_VERSION = 10

#: cache-update op -> the retained-state stems of its two caches
KV_UPDATE_OPS: dict[str, tuple[str, str]] = {
    "qaic::unified_kv_cache_update": ("past_key", "past_value"),
    "qaic::unified_mla_kv_cache_update": ("compressed_kv", "k_pe"),
}


class LoweringError(RuntimeError):
    """A piece could not be lowered; the message says why."""


# --- the functional stand-in for the cache-update ops -----------------------------------


@torch.library.custom_op("qaic_lowering::kv_cache_scatter", mutates_args=())
def kv_cache_scatter(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Functional reshape_and_cache: returns the updated caches (only used for export)."""
    kc, vc = key_cache.clone(), value_cache.clone()
    torch.ops.qaic.reshape_and_cache(key, value, kc, vc, slot_mapping)
    return kc, vc


@kv_cache_scatter.register_fake
def _(key, value, key_cache, value_cache, slot_mapping):
    return torch.empty_like(key_cache), torch.empty_like(value_cache)


def _translate_kv_cache_scatter(key, value, key_cache, value_cache, slot_mapping):
    return (
        kv_cache_scatter_node(key_cache, slot_mapping, key),
        kv_cache_scatter_node(value_cache, slot_mapping, value),
    )


# --- layout: what the runtime needs to call an artifact ---------------------------------


@dataclass
class PieceLayout:
    """How to call an artifact. JSON-serialisable; written next to the ONNX file.

    ``inputs``: one entry per ONNX input, in order: ``{"name", "source"}`` where source is
        ``["arg", i]`` (the piece's i-th argument), ``["cache", u, j]`` (cache j of update
        u, resolved at call time) or ``["slot_mapping"]``.
    ``outputs``: one per ONNX output: ``{"name", "dtype", "shape", "target"}``; target is
        ``["leaf", k]`` or ``["cache", u, j]`` (written in place); shape entries are ints
        or expressions in the canonical symbols.
    ``leaves``: the piece's flattened outputs: ``["onnx", i]``, ``["arg", i]`` (an input
        passed through), ``["dep", dtype]`` (a dependency token), ``["sym", expr]`` or
        ``["const", value]``.
    ``symbols``: canonical symbol -> ``["dim", arg, dim]`` or ``["int", arg]``.
    """

    inputs: list[dict[str, Any]]
    outputs: list[dict[str, Any]]
    leaves: list[list[Any]]
    out_spec: str
    symbols: dict[str, list[Any]]
    kv_updates: list[dict[str, Any]]
    num_args: int
    export_seconds: float = 0.0
    stats: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> PieceLayout:
        return cls(**json.loads(text))


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def _is_kv_update(node: fx.Node) -> bool:
    return node.op == "call_function" and op_name(node.target) in KV_UPDATE_OPS


def _is_symbolic(x: Any) -> bool:
    return isinstance(x, torch.SymInt) and not x.node.expr.is_number


def _hint(x: Any) -> int:
    if isinstance(x, torch.SymInt):
        return int(x.node.hint) if x.node.hint is not None else int(x.node.shape_env.size_hint(x.node.expr))
    return int(x)


# --- the FX rewrite ------------------------------------------------------------------------


@dataclass
class _Prepared:
    gm: fx.GraphModule
    example: list[torch.Tensor]
    dynamic_shapes: list[dict[int, Any] | None]
    input_names: list[str]
    output_names: list[str]
    layout: PieceLayout


def _prepare(gm: fx.GraphModule, example_args: Sequence[Any], fake_mode: Any) -> _Prepared:
    FakeTensorProp(gm, mode=fake_mode).propagate_dont_convert_inputs(*example_args)
    canon = _Canon()
    for a in example_args:  # same canonical symbol names as the fingerprint
        canon.example(a)
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]

    # Symbol bindings: where the runtime reads each canonical symbol from.
    symbols: dict[str, list[Any]] = {}
    sym_source: dict[sympy.Symbol, tuple[int, int]] = {}
    for i, a in enumerate(example_args):
        if isinstance(a, torch.Tensor):
            for d, size in enumerate(a.shape):
                if isinstance(size, torch.SymInt) and isinstance(size.node.expr, sympy.Symbol):
                    sym_source.setdefault(size.node.expr, (i, d))
                    symbols.setdefault(canon.expr(size.node.expr), ["dim", i, d])
        elif isinstance(a, torch.SymInt) and isinstance(a.node.expr, sympy.Symbol):
            symbols.setdefault(canon.expr(a.node.expr), ["int", i])
        elif not isinstance(a, torch.SymInt):
            raise LoweringError(f"piece input {i} is a {type(a).__name__}; only tensors and sizes can be lowered")

    g = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    out_val = g.graph_copy(gm.graph, env)  # copies everything but the output node
    orig_of = {new: old for old, new in env.items()}
    new_ph = [env[p] for p in placeholders]
    first_body = next((n for n in g.nodes if n.op != "placeholder"), None)

    # 1. symbolic-size inputs -> sizes of tensor inputs
    input_sources: list[list[Any]] = []
    for i, (ph, a) in enumerate(zip(new_ph, example_args)):
        if isinstance(a, torch.Tensor):
            input_sources.append(["arg", i])
            continue
        if ph.users:
            expr = a.node.expr
            if expr not in sym_source:
                raise LoweringError(
                    f"symbolic input '{placeholders[i].name}' = {expr} is not a dimension of any tensor input"
                )
            j, d = sym_source[expr]
            with g.inserting_before(first_body):
                size = g.call_function(torch.ops.aten.sym_size.int, (new_ph[j], d))
            ph.replace_all_uses_with(size)
        g.erase_node(ph)

    # 2. cache updates -> functional scatter into retained-state inputs
    updates = [n for n in g.nodes if _is_kv_update(n)]
    kv_updates: list[dict[str, Any]] = []
    cache_inputs: list[fx.Node] = []
    slot_ph = None
    dep_nodes: dict[fx.Node, str] = {}
    if updates:
        with g.inserting_before(first_body):
            for u, node in enumerate(updates):
                stems = KV_UPDATE_OPS[op_name(node.target)]
                suffix = f".{u}" if len(updates) > 1 else ""
                names = [f"{stem}{suffix}" for stem in stems]
                cache_inputs += [g.placeholder(names[0]), g.placeholder(names[1])]
                layer = node.kwargs.get("layer_name", node.args[2] if len(node.args) > 2 else None)
                if not isinstance(layer, str):
                    raise LoweringError(f"{node.name}: the layer name must be a constant string, got {layer!r}")
                kv_updates.append({"op": op_name(node.target), "layer_name": layer, "names": names})
            slot_ph = g.placeholder("slot_mapping")
        for u, node in enumerate(updates):
            key, value = node.args[0], node.args[1]
            with g.inserting_before(node):
                fixed, cache_dims = [], []
                for t in (key, value):  # MLA passes [T, dim]: caches have one head
                    val = orig_of[t].meta["val"]
                    heads = 1 if val.dim() == 2 else _hint(val.shape[1])
                    cache_dims.append([heads, _hint(val.shape[-1]), _dtype_name(val.dtype)])
                    if val.dim() == 2:
                        t = g.call_function(torch.ops.aten.unsqueeze.default, (t, 1))
                    fixed.append(t)
                kv_updates[u]["cache_dims"] = cache_dims  # [heads, head_size, dtype] per cache
                scatter = g.call_function(
                    torch.ops.qaic_lowering.kv_cache_scatter.default,
                    (fixed[0], fixed[1], cache_inputs[2 * u], cache_inputs[2 * u + 1], slot_ph),
                )
                new_k = g.call_function(operator.getitem, (scatter, 0))
                new_v = g.call_function(operator.getitem, (scatter, 1))
            kv_updates[u]["retained"] = [new_k, new_v]
            dep_nodes[node] = _dtype_name(orig_of[node].meta["val"].dtype)

    # 3. outputs: tensors go to ONNX; sizes, constants and dependency tokens do not.
    flat, spec = pytree.tree_flatten(out_val)
    leaves: list[list[Any]] = []
    onnx_outputs: list[fx.Node] = []
    out_meta: list[dict[str, Any]] = []
    ph_index = {p: i for i, p in enumerate(new_ph)}
    for leaf in flat:
        if not isinstance(leaf, fx.Node):
            leaves.append(["const", leaf])
        elif leaf in dep_nodes:
            leaves.append(["dep", dep_nodes[leaf]])
        elif leaf in ph_index:
            leaves.append(["arg", ph_index[leaf]])
        else:
            val = orig_of[leaf].meta["val"]
            if isinstance(val, torch.SymInt):
                leaves.append(["sym", canon.expr(val.node.expr)])
            elif isinstance(val, torch.Tensor):
                if leaf not in onnx_outputs:
                    onnx_outputs.append(leaf)
                    out_meta.append(
                        {"name": f"out{len(onnx_outputs) - 1}", "dtype": _dtype_name(val.dtype),
                         "shape": [_dim(canon, d) for d in val.shape]}
                    )
                idx = onnx_outputs.index(leaf)
                leaves.append(["onnx", idx])
            else:
                raise LoweringError(f"piece output {leaf.name} is a {type(val).__name__}")
    for node in updates:
        if node.users:  # the copy has no output node, so any user is inside the piece
            raise LoweringError(
                f"{node.name}: the dependency token of a cache update is used inside the piece; "
                "only attention (a splitting op) may consume it"
            )
        g.erase_node(node)  # replaced by the scatter; its token is made by the runtime

    outputs: list[dict[str, Any]] = [dict(m, target=["leaf", i]) for i, m in enumerate(out_meta)]
    retained_nodes: list[fx.Node] = []
    for u, upd in enumerate(kv_updates):
        for j, name in enumerate(upd["names"]):
            retained_nodes.append(upd["retained"][j])
            outputs.append({"name": f"{name}_RetainedState", "target": ["cache", u, j]})
        del upd["retained"]
    g.output(tuple(onnx_outputs + retained_nodes))
    g.lint()
    new_gm = fx.GraphModule(gm, g).eval()

    # Example inputs and dynamic dims for the exporter.
    values = {s: max(_hint(s_int), 2) for s, s_int in _symbol_hints(example_args).items()}
    example: list[torch.Tensor] = []
    dynamic: list[dict[int, Any] | None] = []
    input_names: list[str] = []
    inputs: list[dict[str, Any]] = []
    for src in input_sources:
        a = example_args[src[1]]
        shape = [_concrete(d, values) for d in a.shape]
        example.append(torch.zeros(shape, dtype=a.dtype))
        dyn = {d: torch.export.Dim.DYNAMIC for d, size in enumerate(a.shape) if _is_symbolic(size)}
        dynamic.append(dyn or None)
        name = f"arg{src[1]}"
        input_names.append(name)
        inputs.append({"name": name, "source": src})
    for u, upd in enumerate(kv_updates):
        for j, name in enumerate(upd["names"]):
            heads, head_size, dtype = upd["cache_dims"][j]
            example.append(torch.zeros(4, heads, 4, head_size, dtype=getattr(torch, dtype)))
            dynamic.append({0: torch.export.Dim.DYNAMIC, 2: torch.export.Dim.DYNAMIC})
            input_names.append(name)
            inputs.append({"name": name, "source": ["cache", u, j]})
    if slot_ph is not None:
        example.append(torch.zeros(3, dtype=torch.int64))
        dynamic.append({0: torch.export.Dim.DYNAMIC})
        input_names.append("slot_mapping")
        inputs.append({"name": "slot_mapping", "source": ["slot_mapping"]})

    layout = PieceLayout(
        inputs=inputs,
        outputs=outputs,
        leaves=leaves,
        out_spec=pytree.treespec_dumps(spec),
        symbols=symbols,
        kv_updates=kv_updates,
        num_args=len(example_args),
    )
    return _Prepared(new_gm, example, dynamic, input_names, [o["name"] for o in outputs], layout)


def _symbol_hints(example_args: Sequence[Any]) -> dict[sympy.Symbol, torch.SymInt]:
    hints: dict[sympy.Symbol, torch.SymInt] = {}
    for a in example_args:
        sizes = list(a.shape) if isinstance(a, torch.Tensor) else [a]
        for s in sizes:
            if isinstance(s, torch.SymInt):
                for sym in s.node.expr.free_symbols:
                    if sym not in hints and isinstance(s.node.expr, sympy.Symbol):
                        hints[sym] = s
    return hints


def _concrete(size: Any, values: dict[sympy.Symbol, int]) -> int:
    if _is_symbolic(size):
        expr = size.node.expr
        if not expr.free_symbols <= set(values):
            raise LoweringError(f"size {expr} uses a symbol that no input dimension carries")
        return int(expr.xreplace(values))
    return int(size)


def _dim(canon: _Canon, size: Any) -> int | str:
    if _is_symbolic(size):
        return canon.expr(size.node.expr)
    return _hint(size)


# --- export --------------------------------------------------------------------------------


def lower_piece(
    gm: fx.GraphModule,
    example_args: Sequence[Any],
    fake_mode: Any,
    config: CompilationConfig,
    out_dir: Path,
) -> PieceLayout:
    """Lower ``gm`` into ``out_dir`` (``model.onnx`` + ``layout.json``) and return its layout."""
    try:
        prepared = _prepare(gm, example_args, fake_mode)
    except LoweringError:
        raise
    except Exception as e:  # a rewrite we did not foresee: say where, fall back upstream
        raise LoweringError(f"could not prepare the piece for export: {type(e).__name__}: {e}") from e

    layout = prepared.layout
    for entry in layout.outputs:  # resolve retained-state output dtypes
        if entry["target"][0] == "cache":
            u, j = entry["target"][1:]
            idx = next(k for k, i in enumerate(layout.inputs) if i["source"] == ["cache", u, j])
            entry["dtype"] = _dtype_name(prepared.example[idx].dtype)
            entry["shape"] = None
    t0 = time.perf_counter()
    compilation_counter.num_onnx_exports += 1
    try:
        # The exporter traces with torch.export. Run it outside Dynamo's tracing context,
        # or the guards it records on its own inputs leak into the frame being compiled.
        with torch._guards.tracing(None):
            program = _export(prepared, config)
        model = program.model_proto
    except Exception as e:
        raise LoweringError(f"the ONNX exporter failed: {_first_line(e)}") from e
    layout.export_seconds = time.perf_counter() - t0

    model.ir_version = min(model.ir_version, MAX_IR_VERSION)
    # Helper functions of onnxscript's torch library (pkg.onnxscript.torch_lib) are
    # inlined so the model holds only standard ops and our own functions.
    if len(model.functions):
        model = onnx.inliner.inline_local_functions(model)
    used = {n.op_type for n in model.graph.node if n.domain == QAIC_DOMAIN}
    model.functions.extend(function_protos(used))
    if layout.kv_updates and "KVCacheScatter" not in used:
        raise LoweringError("the exported model has no KVCacheScatter node for its cache update")
    try:
        onnx.checker.check_model(model, full_check=True)
    except Exception as e:
        raise LoweringError(f"the lowered model fails onnx.checker: {_first_line(e)}") from e
    names = [i.name for i in model.graph.input]
    want = [i["name"] for i in layout.inputs]
    if names != want:
        raise LoweringError(f"the exporter changed the inputs: expected {want}, got {names}")

    layout.stats = {
        "nodes": len(model.graph.node),
        "functions": sorted(f"{f.domain}::{f.name}" for f in model.functions),
        "opset": config.opset,
    }
    out_dir.mkdir(parents=True, exist_ok=True)
    onnx.save(model, str(out_dir / ONNX_FILE))
    (out_dir / LAYOUT_FILE).write_text(layout.to_json())
    return layout


_TRANSLATIONS = {torch.ops.qaic_lowering.kv_cache_scatter.default: _translate_kv_cache_scatter}


@functools.cache
def _registry(opset: int) -> Any:
    """torch.onnx's op registry with our translation, built once per opset.

    The public ``torch.onnx.export`` rebuilds this registry from onnxscript's torch
    library on every call (~1 s here, a third of a piece's export), so lowering builds it
    once and calls the exporter's core entry with it. That entry is private; if it is not
    there (another torch), lowering uses the public API instead.
    """
    from torch.onnx._internal.exporter import _registration

    registry = _registration.ONNXRegistry.from_torchlib(opset_version=opset)
    for target, fn in _TRANSLATIONS.items():
        registry.register_op(target, fn, is_complex=False)
    return registry


def _export(prepared: _Prepared, config: CompilationConfig) -> Any:
    common = dict(
        dynamic_shapes=tuple(prepared.dynamic_shapes),
        input_names=prepared.input_names,
        output_names=prepared.output_names,
        # The exporter's optimizer would inline KVCacheScatter; ONNX Runtime optimises the
        # graph itself when it loads it, and the QAIC compiler wants the function intact.
        optimize=False,
        verbose=False,
    )
    try:
        from torch.onnx._internal.exporter import _core

        core_export = _core.export
        registry = _registry(config.opset)
    except (ImportError, AttributeError, TypeError) as e:  # pragma: no cover - other torch versions
        logger.debug("qaic: using the public torch.onnx.export (%s)", e)
    else:
        # opset_version=None: the registry already targets config.opset, so no version
        # conversion (which would also inline every function) is needed.
        return core_export(prepared.gm, tuple(prepared.example), registry=registry, opset_version=None, **common)
    return torch.onnx.export(
        prepared.gm, tuple(prepared.example), dynamo=True, opset_version=config.opset,
        custom_translation_table=dict(_TRANSLATIONS), **common,
    )


def _first_line(e: BaseException) -> str:
    """The exporter's errors are pages long; the reason is in the innermost cause."""
    while e.__cause__ is not None:
        e = e.__cause__
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}"
