"""Eager's data-dependent errors, kept: a check becomes a piece output the runner tests.

``torch.linalg.inv`` (``solve``, ``cholesky``, ``lu_factor``) decomposes into its ``_ex``
form, which returns an ``info`` tensor, and ``aten._linalg_check_errors(info, ...)``,
which raises where ``info`` says the matrix was singular or not positive-definite. An
ONNX graph cannot raise. So the check node is taken out of the aten graph and its
``info`` becomes one more output, with target ``["check", api_name, is_matrix]``; the
runner calls the same check on it after each run, so a compiled call raises eager's
``LinAlgError`` with eager's message.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx

from qaic_dynamo.errors import LoweringError
from qaic_dynamo.runtime import dtype_name

__all__ = ["CHECK_ERRORS", "checks_to_outputs"]

#: The check op a checked linear-algebra call decomposes into.
CHECK_ERRORS = torch.ops.aten._linalg_check_errors.default


def checks_to_outputs(gm: fx.GraphModule, first: int) -> list[dict[str, Any]]:
    """Take every check out of ``gm``, append its ``info`` to the graph's outputs, and
    return their layout outputs (named ``out<first>``, ``out<first+1>``, ...)."""
    checks = [n for n in gm.graph.nodes if n.op == "call_function" and n.target is CHECK_ERRORS]
    if not checks:
        return []
    output = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    results = list(output.args[0]) if isinstance(output.args[0], (tuple, list)) else [output.args[0]]
    specs = []
    for node in checks:
        info, api_name = node.args[0], node.args[1]
        is_matrix = bool(node.kwargs.get("is_matrix", node.args[2] if len(node.args) > 2 else True))
        val = info.meta.get("val")
        if not isinstance(val, torch.Tensor) or not all(isinstance(d, int) for d in val.shape):
            raise LoweringError(f"{api_name}: its error check has a dynamic shape; the piece runs eagerly")
        specs.append(
            {
                "name": f"out{first + len(specs)}",
                "dtype": dtype_name(val.dtype),
                "shape": list(val.shape),
                "target": ["check", str(api_name), is_matrix],
            }
        )
        results.append(info)
        gm.graph.erase_node(node)
    output.args = (tuple(results),)
    gm.recompile()
    return specs
