"""Passes over the traced aten graph before translation, each fixing where the
translation would differ from eager: float64 scalars kept exact, the exporter's type
promotion (only where needed), ``sym_numel`` expanded, ``-0.0`` kept apart from
``0.0``, and assertions removed (except the semantics' own ``eager_unless``)."""

from __future__ import annotations

import math
import operator
from typing import Any

import torch
import torch.fx as fx

from qaic_dynamo._compat import pytree, torch_onnx_internals
from qaic_dynamo.lowering.semantics.common import EAGER_UNLESS

__all__ = [
    "NegativeZero",
    "exact_float64_scalars",
    "expand_sym_numel",
    "insert_type_promotion",
    "keep_negative_zeros_apart",
    "remove_assertions",
]

_aten = torch.ops.aten

#: What torch.onnx's ``remove_assertion_nodes`` removes (ONNX has no assertions).
_ASSERTIONS = frozenset(
    {
        _aten.sym_constrain_range_for_size.default,
        _aten._assert_async.default,
        _aten._assert_async.msg,
        _aten._assert_scalar.default,
        _aten._assert_tensor_metadata.default,
    }
)


def remove_assertions(gm: fx.GraphModule) -> None:
    """torch.onnx's ``remove_assertion_nodes``, keeping the ``eager_unless`` marks a
    decomposition made (``lowering.checks`` turns them into outputs)."""
    for m in gm.modules():
        if not isinstance(m, fx.GraphModule):
            continue
        for node in list(m.graph.nodes):
            if node.op != "call_function" or node.target not in _ASSERTIONS:
                continue
            if node.target is _aten._assert_async.msg and str(node.args[1]).startswith(EAGER_UNLESS):
                continue
            m.graph.erase_node(node)
        m.recompile()


def exact_float64_scalars(gm: fx.GraphModule) -> None:
    """Python float operands of float64 ops as float64 tensor constants. The translation
    emits a Python float as a float32 constant and casts it, so ``x * 0.1`` on a float64
    ``x`` multiplied by 0.10000000149011612 (eager: 0.1)."""
    count = 0

    def constant(value: float, before: fx.Node) -> fx.Node:
        nonlocal count
        name = f"_qaic_float64_scalar_{count}"
        count += 1
        gm.register_buffer(name, torch.tensor(value, dtype=torch.float64))
        with gm.graph.inserting_before(before):
            return gm.graph.get_attr(name)

    for node in list(gm.graph.nodes):
        val = node.meta.get("val")
        if (
            node.op != "call_function"
            or not isinstance(node.target, torch._ops.OpOverload)
            or not isinstance(val, torch.Tensor)
            or val.dtype != torch.float64
        ):
            continue
        if node.target is _aten.scalar_tensor.default and isinstance(node.args[0], float):
            # type promotion wraps a scalar operand so (then translated the same way)
            node.replace_all_uses_with(constant(node.args[0], node))
            gm.graph.erase_node(node)
            continue
        if node.target is _aten.full.default and isinstance(node.args[1], float):
            fill = constant(node.args[1], node)
            with gm.graph.inserting_before(node):
                filled = gm.graph.call_function(_aten.expand.default, (fill, list(node.args[0])))
            filled.meta["val"] = val
            node.replace_all_uses_with(filled)
            gm.graph.erase_node(node)
            continue
        args = list(node.args)
        for i, (param, a) in enumerate(zip(node.target._schema.arguments, node.args)):
            if isinstance(a, float) and isinstance(param.type, torch.TensorType):
                args[i] = constant(a, node)
        node.args = tuple(args)
    if count:
        gm.recompile()


def insert_type_promotion(gm: fx.GraphModule) -> None:
    """The exporter's type-promotion pass (explicit casts where an op's inputs or output
    disagree with its promotion rule), re-running only the nodes it changes.

    ``insert_type_promotion_nodes`` re-runs *every* node on fake tensors to recompute
    values it already has: most of the pass's time on a Llama trace in which it casts one
    input of one node (a cumsum). Here each node with a rule is first checked against
    the rule using the values the trace recorded (``meta["val"]``); nodes that need no
    cast pass their recorded value through, and the rest go through the exporter's own
    promotion, unchanged. The result is the same graph: a test compares it with the full
    pass's."""
    tp = torch_onnx_internals().type_promotion

    class Selective(tp._TypePromotionInterpreter):
        def run_node(self, n: fx.Node) -> Any:
            if n.op == "call_function" and "val" in n.meta:
                rule = tp.get_type_promotion_rule(n, self.type_promotion_table)
                if rule is None or not _needs_promotion(n, rule):
                    return n.meta["val"]
            return super().run_node(n)

    promote = tp.InsertTypePromotion(gm)
    promote.interpreter = Selective(gm, promote.interpreter.type_promotion_table)
    promote.run()


def _needs_promotion(node: fx.Node, rule: Any) -> bool:
    """Whether the exporter's promotion would cast any argument of ``node`` (its
    ``_maybe_promote_arg`` logic, read off the recorded values)."""
    scalar_dtype = torch_onnx_internals().type_promotion.fx_type_utils.from_scalar_type_to_torch_dtype

    def value(a: Any) -> Any:
        return a.meta["val"] if isinstance(a, fx.Node) else a

    args = pytree.tree_map(value, node.args)
    kwargs = pytree.tree_map(value, dict(node.kwargs))
    info = rule.preview_type_promotion(args, kwargs)

    def casts(v: Any, dtype: torch.dtype | None) -> bool:
        if dtype is None:
            return False
        if isinstance(v, torch.Tensor):
            return v.dtype != dtype
        if isinstance(v, (tuple, list)):
            return any(casts(x, dtype) for x in v)
        scalar = scalar_dtype(type(v))
        return scalar is not None and scalar != dtype

    return any(casts(v, info.args_dtypes.get(i)) for i, v in enumerate(args)) or any(
        casts(v, info.kwargs_dtypes.get(k)) for k, v in kwargs.items()
    )


def expand_sym_numel(gm: fx.GraphModule) -> None:
    """``aten.sym_numel(x)`` (a reshape's -1 over symbolic sizes) has no ONNX translation;
    the product of ``x``'s ``sym_size``s has. (torch.export never emits it: there the
    product is already folded into the sizes it traces.)"""
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target is not torch.ops.aten.sym_numel.default:
            continue
        x = node.args[0]
        with gm.graph.inserting_before(node):
            product = None
            for d in range(x.meta["val"].dim()):
                size = gm.graph.call_function(torch.ops.aten.sym_size.int, (x, d))
                size.meta["val"] = x.meta["val"].shape[d]
                product = size if product is None else gm.graph.call_function(operator.mul, (product, size))
                product.meta["val"] = (
                    size.meta["val"] if product is size else product.args[0].meta["val"] * size.meta["val"]
                )
                for new in (size, product):  # keep the replaced node's annotations (export's block tags)
                    if "custom" in node.meta:
                        new.meta["custom"] = node.meta["custom"]
            if product is None:  # a 0-d tensor holds one element
                product = 1
        node.replace_all_uses_with(product)
        gm.graph.erase_node(node)
    gm.recompile()


class NegativeZero(float):
    """``-0.0`` that is not equal to ``0.0`` as a dict key. The translation makes one ONNX
    constant per distinct Python number (a dict keyed by value), and ``-0.0 == 0.0``: a
    graph using both got one of them twice (``1 / (x * 0.0 + s)`` at ``s = -0.0`` gave
    -inf, eager inf). Everywhere else it is the float -0.0."""

    def __eq__(self, other: object) -> bool:
        return isinstance(other, float) and float(other) == 0.0 and math.copysign(1.0, other) < 0

    def __ne__(self, other: object) -> bool:
        return not self == other

    def __hash__(self) -> int:
        return hash(("qaic_dynamo.NegativeZero",))


def keep_negative_zeros_apart(gm: fx.GraphModule) -> None:
    """Every ``-0.0`` argument of the graph (also inside lists) becomes :class:`NegativeZero`."""

    def swap(a: Any) -> Any:
        if type(a) is float and a == 0.0 and math.copysign(1.0, a) < 0:
            return NegativeZero(-0.0)
        if isinstance(a, (list, tuple)):
            items = [swap(x) for x in a]
            return type(a)(items) if any(x is not y for x, y in zip(items, a)) else a
        return a

    for module in gm.modules():
        if isinstance(module, fx.GraphModule):
            for node in module.graph.nodes:
                # Assigned only where a value changes: the setters re-link every use.
                args, kwargs = swap(node.args), {k: swap(v) for k, v in node.kwargs.items()}
                if args is not node.args:
                    node.args = args
                if any(kwargs[k] is not v for k, v in node.kwargs.items()):
                    node.kwargs = kwargs
