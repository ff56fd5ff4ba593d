"""The direct path's trace: a piece as a functional aten graph, in one fake-tensor trace.

The decompositions for every op the ONNX registry lacks are applied *during* the trace
(no torch.export, no run_decompositions re-trace), in a fake mode and shape environment
of the lowering's own, so that nothing leaks into the frame Dynamo is compiling. A trace
that specialised a dynamic size, or whose size guards do not follow from Dynamo's, is
refused.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from typing import Any

import sympy
import torch
import torch.fx as fx

from qaic_dynamo._compat import (
    FakeTensorMode,
    backed_size_oblivious,
    make_fx,
    new_shape_env,
    no_tracing_context,
    python_dispatcher,
    symbolic_context,
)
from qaic_dynamo.errors import DirectPathError, LoweringError, SizeBranchError
from qaic_dynamo.lowering.aten_passes import (
    exact_float64_scalars,
    expand_sym_numel,
    insert_type_promotion,
    remove_assertions,
)
from qaic_dynamo.lowering.common import append_outputs
from qaic_dynamo.lowering.registry import decompositions, functional_semantics
from qaic_dynamo.lowering.size_guards import guards_not_implied
from qaic_dynamo.lowering.writes import is_mutation, returned_written_inputs

__all__ = ["aten_graph", "fake_inputs"]


def fake_inputs(
    example: Sequence[torch.Tensor], dynamic_shapes: Sequence[dict[int, Any] | None], duck_shape: bool = True
) -> list[torch.Tensor]:
    """Fresh fake inputs whose dynamic dims (and only those) are symbols; dims given the
    same *string* name (the deployment export's "batch_size", "ctx_len") are one symbol.
    ``duck_shape=False``: equal example sizes stay separate symbols.

    A private fake mode and shape env: tracing in Dynamo's own would add guards to the
    frame being compiled.
    """
    # Real tensors reach this mode only as a piece's tensor constants (a Dynamo get_attr,
    # e.g. transformers' DynamicCache starts each layer from ``torch.tensor([])``): every
    # input is made fake below. Allowed, they are traced as constants of the aten graph,
    # translated to initializers (their bytes are in the piece's fingerprint).
    mode = FakeTensorMode(shape_env=new_shape_env(duck_shape=duck_shape), allow_non_fake_inputs=True)
    # Without the fake-tensor dispatch cache: a piece is traced once, so an entry is almost
    # never hit again, and building one with symbolic sizes (validating and re-deriving
    # the output's sizes and strides as sympy expressions) costs more than running the
    # op's meta kernel. Measured: the decoder block's first piece traces in 0.30 s
    # instead of 0.53-0.67 s; the pieces' ONNX is byte-identical.
    mode.cache_enabled = False
    fakes = []
    for t, dynamic in zip(example, dynamic_shapes):
        dims = [d in (dynamic or {}) for d in range(t.dim())]
        fakes.append(mode.from_tensor(t, symbolic_context=symbolic_context(dims)))
    # Said equal up front rather than left to whichever op happens to combine two of them
    # (if none does, the ONNX gets one free dim per input).
    named: dict[str, Any] = {}
    for fake, dynamic in zip(fakes, dynamic_shapes):
        for d, name in (dynamic or {}).items():
            if isinstance(name, str):
                torch._check(fake.shape[d] == named.setdefault(name, fake.shape[d]))
    return fakes


#: op -> (position of its "compute the vectors" flag, its name, the outputs that are vectors)
_VECTOR_FLAGS = {
    torch.ops.aten._linalg_svd.default: (2, "compute_uv", (0, 2)),
    torch.ops.aten._linalg_eigh.default: (2, "compute_v", (1,)),
}


def values_only(gm: fx.GraphModule) -> bool:
    """Turn off the vectors of every SVD / symmetric eigendecomposition whose vectors
    nothing reads. ``svdvals``, ``eigvalsh``, ``matrix_rank``, ``cond`` ask for the
    vectors under fake tensors (``_may_require_fw_or_bw_grad`` is true for a tensor
    subclass), though eager does not compute them; the values alone are unique and
    have a translation (``semantics.spectra``), the vectors' signs do not. Returns
    whether any node changed."""
    changed = False
    for node in gm.graph.nodes:
        spec = _VECTOR_FLAGS.get(node.target) if node.op == "call_function" else None
        if spec is None:
            continue
        position, name, vector_outputs = spec
        used = {u.args[1] for u in node.users if u.target is operator.getitem and u.users}
        flag = node.kwargs.get(name, node.args[position] if len(node.args) > position else True)
        if flag and not used & set(vector_outputs):
            schema = node.target._schema.arguments
            args = list(node.args) + [schema[i].default_value for i in range(len(node.args), position + 1)]
            args[position] = False
            node.args = tuple(args[: position + 1]) + tuple(node.args[position + 1 :])
            node.kwargs = {k: v for k, v in node.kwargs.items() if k != name}
            changed = True
    if changed:
        gm.recompile()
    return changed


def written_back_outputs(gm: fx.GraphModule, returned: frozenset[int]) -> None:
    """Functionalising replays a write into an input as a ``copy_`` at the end of the
    graph; the ONNX cannot write its input, so each such copy goes. For an input the
    prepared piece already returns (``returned``) its value is an output; for any other
    the copied value becomes one more output, and ``gm.meta["written_back"]`` lists those
    inputs' indices (the lowering adds their layout outputs, the runner copies them)."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    returned_values = set(gm.graph.output_node().all_input_nodes)
    new_values: list[fx.Node] = []
    written_back: list[int] = []
    for node in list(gm.graph.nodes):
        if node.op == "call_function" and node.target is torch.ops.aten.copy_.default and node.args[0] in placeholders:
            index = placeholders.index(node.args[0])
            if node.users or index in written_back:
                raise LoweringError(f"{node.name} writes piece input {node.args[0].name} in place; runs eagerly")
            if index not in returned:
                new_values.append(node.args[1])
                written_back.append(index)
            elif node.args[1] not in returned_values:
                raise LoweringError(
                    f"{node.name}: the written-back value of input {index} is not returned; runs eagerly"
                )
            gm.graph.erase_node(node)
    append_outputs(gm, new_values)
    gm.meta["written_back"] = written_back
    gm.recompile()


def aten_graph(
    fn: Any,
    example: Sequence[torch.Tensor],
    dynamic_shapes: Sequence[dict[int, Any] | None],
    opset: int,
    keep_symbols_apart: bool = False,
    guards_follow_from: Sequence[tuple[Any, ...]] | None = None,
) -> fx.GraphModule:
    """``fn`` (a piece, or any traceable callable of tensors) as a functional aten graph,
    decomposed to what the registry translates: one fake-tensor trace with the
    decompositions applied during it (no torch.export, no run_decompositions re-trace).
    ``dynamic_shapes[i]`` holds the dynamic dims of ``example[i]``; the example sizes of
    dynamic dims must not be 0 or 1 (they would be specialised). ``keep_symbols_apart``
    (the real sizes' second try, where two sizes may happen to be equal): equal sizes are
    separate symbols, and a trace that took one for the other is refused.
    ``guards_follow_from``: Dynamo's sizes of the first inputs; a trace whose size guards
    (a branch a decomposition took on a size) do not follow from Dynamo's guards on those
    sizes is refused: the ONNX would serve sizes the branch does not hold for."""
    fakes = fake_inputs(example, dynamic_shapes, duck_shape=not keep_symbols_apart)
    with (
        no_tracing_context(),  # the passes below detect their fake mode through it
        backed_size_oblivious(),
        python_dispatcher(),
    ):
        gm = make_fx(fn, decomposition_table=decompositions(opset), tracing_mode="fake")(*fakes)
        if values_only(gm):  # traced again: the decompositions now apply to those nodes
            traced = gm
            gm = make_fx(
                lambda *a: fx.Interpreter(traced).run(*a),
                decomposition_table=decompositions(opset),
                tracing_mode="fake",
            )(*fakes)
        # A few decompositions (rms_norm's) write in place; ONNX has no mutation. The
        # second trace is of an aten graph with no decompositions left, so it is cheap.
        if any(is_mutation(n) for n in gm.graph.nodes):
            written_back = returned_written_inputs(gm)
            # Through an Interpreter, so node annotations (preserve_node_meta) carry over.
            first = gm
            gm = make_fx(
                torch.func.functionalize(lambda *a: fx.Interpreter(first).run(*a), remove="mutations"),
                # functional forms that appear only now (a training batch norm's)
                decomposition_table=functional_semantics(),
                tracing_mode="fake",
            )(*fakes)
            written_back_outputs(gm, written_back)
        insert_type_promotion(gm)
        remove_assertions(gm)
    # The trace ran in a private shape env whose guards are dropped: if it specialised a
    # dynamic size to a number, the ONNX would silently serve one size. Let the exporter
    # (which refuses such a specialisation for a Dim.DYNAMIC) take the piece instead.
    shape_env = fakes[0].fake_mode.shape_env if fakes else None
    if shape_env is not None:
        fixed = sorted(str(k) for k, v in shape_env.replacements.items() if v.is_number)
        if fixed:
            raise DirectPathError("(trace)", f"the trace specialised dynamic size(s) {fixed} to constants")
        merged = sorted(f"{k} -> {v}" for k, v in shape_env.replacements.items() if not v.is_number)
        if keep_symbols_apart and merged:
            raise DirectPathError("(trace)", f"the trace related dynamic sizes {merged}")
        if guards_follow_from is not None:
            implied: list[sympy.Basic] = []
            unproven = guards_not_implied(
                fakes, shape_env, guards_follow_from, strict=keep_symbols_apart, implied=implied
            )
            if unproven:
                raise SizeBranchError("(trace)", f"size guards {unproven} do not follow from Dynamo's")
            gm.meta["size_assumptions"] = implied
    expand_sym_numel(gm)
    exact_float64_scalars(gm)
    for node in gm.graph.nodes:
        node.meta.setdefault("nn_module_stack", {})  # the translator records it per node
        if node.op == "get_attr":  # a tensor constant: translate its real value
            node.meta["val"] = operator.attrgetter(node.target)(gm)
    return gm
