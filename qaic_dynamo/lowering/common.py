"""Small helpers the lowering's modules share: symbolic sizes, and error messages."""

from __future__ import annotations

import re
from typing import Any

import torch
import torch.fx as fx

__all__ = ["MAX_IR_VERSION", "append_outputs", "failing_op", "first_line", "is_symbolic", "size_hint"]

#: onnxruntime 1.31 reads IR version <= 13; the exporter's default is within that, but a
#: newer onnx could raise it, so it is capped.
MAX_IR_VERSION = 10


def is_symbolic(x: Any) -> bool:
    return isinstance(x, torch.SymInt) and not x.node.expr.is_number


def size_hint(x: Any) -> int:
    if isinstance(x, torch.SymInt):
        return int(x.node.hint) if x.node.hint is not None else int(x.node.shape_env.size_hint(x.node.expr))
    return int(x)


def failing_op(e: BaseException) -> str:
    """The op named in a translation error ("... target=torch.ops.aten.x.default ..."), or
    the error's type."""
    match = re.search(r"target=([\w.:]+)", str(e))
    return match.group(1) if match else type(e).__name__


def first_line(e: BaseException) -> str:
    """The exporter's errors are pages long; the reason is in the innermost cause."""
    while e.__cause__ is not None:
        e = e.__cause__
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}"


def append_outputs(gm: fx.GraphModule, values: list[fx.Node]) -> None:
    """Append ``values`` to the graph's output tuple (the lowering's extra outputs:
    written-back inputs, error checks, domain tests)."""
    if not values:
        return
    output = gm.graph.output_node()
    results = list(output.args[0]) if isinstance(output.args[0], (tuple, list)) else [output.args[0]]
    output.args = (tuple(results + values),)
    gm.recompile()
