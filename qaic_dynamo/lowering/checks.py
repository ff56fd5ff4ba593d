"""Eager's data-dependent errors and domains, kept: each becomes a piece output the
runner tests after the run.

``torch.linalg.inv`` (``solve``, ``cholesky``, ``lu_factor``) decomposes into its ``_ex``
form, which returns an ``info`` tensor, and ``aten._linalg_check_errors(info, ...)``,
which raises where ``info`` says the matrix was singular or not positive-definite. An
ONNX graph cannot raise. So the check node is taken out of the aten graph and its
``info`` becomes one more output, with target ``["check", api_name, is_matrix]``; the
runner calls the same check on it after each run, so a compiled call raises eager's
``LinAlgError`` with eager's message.

Likewise a decomposition's ``eager_unless(ok, why)`` (``semantics.common``), an
``aten._assert_async`` with a marked message: its boolean becomes an output with target
``["eager_unless", why]``, and where it is False the runner runs that call eagerly. The
call's ONNX run has written nothing by then - except a KV cache, so a piece that updates
one may not have such a domain (it runs eagerly).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx

from qaic_dynamo.errors import LoweringError
from qaic_dynamo.lowering.common import append_outputs
from qaic_dynamo.lowering.semantics.common import EAGER_UNLESS
from qaic_dynamo.runtime import dtype_name

__all__ = ["CHECK_ERRORS", "checks_to_outputs"]

#: The check op a checked linear-algebra call decomposes into.
CHECK_ERRORS = torch.ops.aten._linalg_check_errors.default
_ASSERT = torch.ops.aten._assert_async.msg


def _eager_unless(node: fx.Node) -> bool:
    return node.target is _ASSERT and str(node.args[1]).startswith(EAGER_UNLESS)


def checks_to_outputs(gm: fx.GraphModule, first: int, updates_caches: bool = False) -> list[dict[str, Any]]:
    """Take every check and ``eager_unless`` out of ``gm``, append the tensor it tests to
    the graph's outputs, and return their layout outputs (named ``out<first>``, ...)."""
    checks = [n for n in gm.graph.nodes if n.op == "call_function" and (n.target is CHECK_ERRORS or _eager_unless(n))]
    if not checks:
        return []
    if updates_caches and any(_eager_unless(n) for n in checks):
        why = next(str(n.args[1])[len(EAGER_UNLESS) :] for n in checks if _eager_unless(n))
        raise LoweringError(
            f"its translation is exact only on part of the domain ({why} runs eagerly), and a piece that "
            "updates a KV cache cannot run a call again eagerly; it runs eagerly"
        )
    specs, tested = [], []
    for node in checks:
        if _eager_unless(node):
            tested.append(node.args[0])
            dtype, shape, target = "bool", [], ["eager_unless", str(node.args[1])[len(EAGER_UNLESS) :]]
        else:
            info, api_name = node.args[0], node.args[1]
            is_matrix = bool(node.kwargs.get("is_matrix", node.args[2] if len(node.args) > 2 else True))
            val = info.meta.get("val")
            if not isinstance(val, torch.Tensor) or not all(isinstance(d, int) for d in val.shape):
                raise LoweringError(f"{api_name}: its error check has a dynamic shape; the piece runs eagerly")
            tested.append(info)
            dtype, shape, target = dtype_name(val.dtype), list(val.shape), ["check", str(api_name), is_matrix]
        specs.append({"name": f"out{first + len(specs)}", "dtype": dtype, "shape": shape, "target": target})
        gm.graph.erase_node(node)
    append_outputs(gm, tested)
    return specs
