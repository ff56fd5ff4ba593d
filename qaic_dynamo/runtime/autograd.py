"""Autograd edges for outputs that ONNX Runtime computed.

ONNX Runtime computes no gradients. A compiled piece's outputs still get the autograd
edges an eager piece would give them, with a backward that raises, so that ``backward()``
through a compiled model fails loudly instead of silently skipping the piece's parameters.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

__all__ = ["no_backward"]


class _NoBackward(torch.autograd.Function):
    """Gives a piece's outputs the autograd edges an eager piece would have, with a backward
    that raises: ONNX Runtime computes no gradients, and an output without a ``grad_fn``
    would make ``backward()`` skip the piece's parameters silently whenever another term
    of the loss still reaches the graph.

    The piece runs inside ``forward``, so its outputs are new tensors of this function,
    not its inputs returned (autograd would make those views, and forbid writing into
    them in place, as ``logits.div_(t)`` does)."""

    @staticmethod
    def forward(ctx: Any, label: str, produce: Callable[[], list[torch.Tensor]], *needs: torch.Tensor) -> Any:
        ctx.label = label
        outs = produce()
        ctx.mark_non_differentiable(*(o for o in outs if not (o.is_floating_point() or o.is_complex())))
        return tuple(outs)

    @staticmethod
    def backward(ctx: Any, *grads: Any) -> Any:
        raise RuntimeError(
            f"qaic_dynamo: {ctx.label} ran on ONNX Runtime, which computes no gradients; backend='qaic' is for "
            "inference. Run the model under torch.no_grad() or torch.inference_mode(), or compile it with a "
            "training backend (e.g. backend='inductor') to differentiate through it"
        )


def no_backward(label: str, run: Callable[[], Any], inputs: Sequence[Any], keep: Sequence[torch.Tensor] = ()) -> Any:
    """``run()`` (a piece's result: a tensor or a tuple/list of them), its new tensors
    connected through :class:`_NoBackward` to the ``inputs`` that require grad. An input
    the piece passes through unchanged keeps its own autograd history, and tensors in
    ``keep`` (the runner's own, returned on every call) are returned untouched: autograd
    would attach this call's history to the object itself."""
    needs = [a for a in inputs if isinstance(a, torch.Tensor) and a.requires_grad]
    if not needs:
        return run()
    given = {id(a) for a in inputs if isinstance(a, torch.Tensor)} | {id(t) for t in keep}
    made: dict[str, Any] = {}

    def produce() -> list[torch.Tensor]:
        out = made["out"] = run()
        flat = made["flat"] = [out] if isinstance(out, torch.Tensor) else list(out)
        made["where"] = [i for i, o in enumerate(flat) if isinstance(o, torch.Tensor) and id(o) not in given]
        return [flat[i] for i in made["where"]]

    tied = _NoBackward.apply(label, produce, *needs)
    out, flat = made["out"], made["flat"]
    for i, t in zip(made["where"], tied):
        flat[i] = t
    return flat[0] if isinstance(out, torch.Tensor) else type(out)(flat)
