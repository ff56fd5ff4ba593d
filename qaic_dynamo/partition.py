"""Split a Dynamo graph into pieces at its splitting ops (attention).

Why split: attention reads a paged KV cache through the forward context, which an
accelerator graph cannot express in a layer-agnostic way, so it runs eagerly; everything
between two attentions becomes one compiled piece. With parameters lifted to graph inputs
(Dynamo's default), the pieces of all middle layers are structurally identical, so one
compiled artifact serves every layer.

Rules (as vLLM's piecewise backend):
  * ``split_module(..., keep_original_order=True)``: nodes keep their order, which keeps
    side effects (the KV-cache update) ordered;
  * consecutive splitting ops share one splitting piece;
  * an ``operator.getitem`` stays with the node it reads from.

Every piece records why it starts where it does, for the compile report.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
import torch.fx as fx
from torch.fx.passes.split_module import split_module

__all__ = ["Piece", "SplitGraph", "op_name", "split_graph"]


@dataclass
class Piece:
    """One submodule of the split graph."""

    index: int
    name: str  # attribute name in the split GraphModule, e.g. "submod_3"
    is_splitting: bool
    graph_module: fx.GraphModule
    #: Why this piece exists: the splitting op it holds, or the one it follows.
    reason: str


@dataclass
class SplitGraph:
    graph_module: fx.GraphModule
    pieces: list[Piece]


def op_name(target: object) -> str | None:
    """Canonical 'namespace::name' of a call_function target, or None.

    Dynamo graphs hold OpOverloadPackets (``torch.ops.qaic.unified_attention``) for custom
    ops and Python builtins for aten ops (``torch._C._nn.scaled_dot_product_attention``);
    both map to one name so ``splitting_ops`` can be written the same way.
    """
    if isinstance(target, torch._ops.OpOverload):
        return target._schema.name
    if isinstance(target, torch._ops.OpOverloadPacket):
        return target._qualified_op_name
    name = getattr(target, "__name__", None)
    module = getattr(target, "__module__", None) or ""
    if name and module.startswith("torch") and hasattr(torch.ops.aten, name):
        return f"aten::{name}"
    return None


def _is_splitting(node: fx.Node, splitting_ops: frozenset[str]) -> bool:
    return node.op == "call_function" and op_name(node.target) in splitting_ops


def split_graph(gm: fx.GraphModule, splitting_ops: Iterable[str]) -> SplitGraph:
    ops = frozenset(splitting_ops)
    assignment: dict[fx.Node, int] = {}
    reasons: dict[int, str] = {}
    piece_id = 0
    prev_split: fx.Node | None = None  # the last splitting node, while we are right after it
    reasons[0] = "start of graph"
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "output"):
            continue
        if node.op == "call_function" and node.target is operator.getitem and node.args[0] in assignment:
            assignment[node] = assignment[node.args[0]]
            continue
        if _is_splitting(node, ops):
            if prev_split is None:
                piece_id += 1
                reasons[piece_id] = f"splitting op {op_name(node.target)} (node {node.name})"
            else:
                reasons[piece_id] += f" + {op_name(node.target)} (node {node.name})"
            prev_split = node
        elif prev_split is not None:
            piece_id += 1
            reasons[piece_id] = f"after splitting op {op_name(prev_split.target)} (node {prev_split.name})"
            prev_split = None
        assignment[node] = piece_id

    split_gm = split_module(gm, None, lambda n: assignment[n], keep_original_order=True)
    pieces = []
    for index, node in enumerate(n for n in split_gm.graph.nodes if n.op == "call_module"):
        sub = getattr(split_gm, node.target)
        piece_id = int(node.target.rsplit("_", 1)[1])
        is_splitting = any(_is_splitting(n, ops) for n in sub.graph.nodes)
        pieces.append(Piece(index, node.target, is_splitting, sub, reasons[piece_id]))
    return SplitGraph(split_gm, pieces)


def readable_split(split: SplitGraph, describe: Callable[[Piece], str] | None = None) -> str:
    """A short, stable text form of the split: one line per piece with its ops."""
    lines = []
    for p in split.pieces:
        ops = []
        for n in p.graph_module.graph.nodes:
            if n.op == "call_function":
                ops.append(op_name(n.target) or getattr(n.target, "__name__", str(n.target)))
            elif n.op == "call_method":
                ops.append(f".{n.target}")
        kind = "split" if p.is_splitting else "piece"
        extra = f"  {describe(p)}" if describe else ""
        lines.append(f"{p.name} [{kind}] {' '.join(ops)}{extra}")
    return "\n".join(lines)
