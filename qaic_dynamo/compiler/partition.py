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

import enum
import operator
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch.fx as fx
from torch.fx.passes.split_module import split_module

from qaic_dynamo.ops import op_name

__all__ = ["Piece", "PieceKind", "SplitGraph", "SplitReason", "readable_split", "split_graph"]


class PieceKind(enum.StrEnum):
    #: Holds splitting ops; runs eagerly between compiled pieces.
    SPLITTING = "splitting"
    #: Everything else: lowered and compiled (or reused).
    COMPILABLE = "compilable"


class SplitReason(enum.StrEnum):
    """Why a piece starts where it does."""

    START = "start of graph"
    SPLITTING_OP = "splitting op"
    AFTER_SPLITTING_OP = "after splitting op"


@dataclass
class Piece:
    """One submodule of the split graph."""

    index: int
    name: str  # attribute name in the split GraphModule, e.g. "submod_3"
    kind: PieceKind
    graph_module: fx.GraphModule
    reason: SplitReason
    #: The splitting op(s) and node(s) the reason refers to ("" at the start of the graph).
    detail: str = ""

    @property
    def is_splitting(self) -> bool:
        return self.kind is PieceKind.SPLITTING

    @property
    def why(self) -> str:
        """The reason in words, e.g. "after splitting op qaic::unified_attention (node o)"."""
        return f"{self.reason.value} {self.detail}".strip()


@dataclass
class SplitGraph:
    graph_module: fx.GraphModule
    pieces: list[Piece]


def _is_splitting(node: fx.Node, splitting_ops: frozenset[str]) -> bool:
    return node.op == "call_function" and op_name(node.target) in splitting_ops


def split_graph(gm: fx.GraphModule, splitting_ops: Iterable[str]) -> SplitGraph:
    ops = frozenset(splitting_ops)
    assignment: dict[fx.Node, int] = {}
    reasons: dict[int, tuple[SplitReason, str]] = {0: (SplitReason.START, "")}
    piece_id = 0
    prev_split: fx.Node | None = None  # the last splitting node, while we are right after it
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "output"):
            continue
        if node.op == "call_function" and node.target is operator.getitem and node.args[0] in assignment:
            assignment[node] = assignment[node.args[0]]
            continue
        if _is_splitting(node, ops):
            here = f"{op_name(node.target)} (node {node.name})"
            if prev_split is None:
                piece_id += 1
                reasons[piece_id] = (SplitReason.SPLITTING_OP, here)
            else:
                reasons[piece_id] = (SplitReason.SPLITTING_OP, f"{reasons[piece_id][1]} + {here}")
            prev_split = node
        elif prev_split is not None:
            piece_id += 1
            reasons[piece_id] = (
                SplitReason.AFTER_SPLITTING_OP,
                f"{op_name(prev_split.target)} (node {prev_split.name})",
            )
            prev_split = None
        assignment[node] = piece_id

    split_gm = split_module(gm, None, lambda n: assignment[n], keep_original_order=True)
    pieces = []
    for index, node in enumerate(n for n in split_gm.graph.nodes if n.op == "call_module"):
        sub = getattr(split_gm, node.target)
        piece_id = int(node.target.rsplit("_", 1)[1])
        kind = PieceKind.SPLITTING if any(_is_splitting(n, ops) for n in sub.graph.nodes) else PieceKind.COMPILABLE
        reason, detail = reasons[piece_id]
        pieces.append(Piece(index, node.target, kind, sub, reason, detail))
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
        kind = "split" if p.is_splitting else "piece"  # short words keep snapshots readable
        extra = f"  {describe(p)}" if describe else ""
        lines.append(f"{p.name} [{kind}] {' '.join(ops)}{extra}")
    return "\n".join(lines)
