"""Layer and batch norm in the precision eager's CPU kernels use."""

from __future__ import annotations

from typing import Any

import torch

_aten = torch.ops.aten

__all__ = ["batch_norm_no_training", "batch_norm_training", "batch_norm_with_update", "layer_norm_in_float32"]


def layer_norm_in_float32(x: Any, shape: Any, weight: Any = None, bias: Any = None, eps: float = 1e-5) -> Any:
    """float16 / bfloat16 ``native_layer_norm`` in float32, rounded back (as eager's CPU
    kernel accumulates): the translation's LayerNormalization stashes mean and rstd in
    float32 while the graph declares them float16, which fails the ONNX checker - every
    float16 LayerNorm piece ran eagerly."""
    if x.dtype not in (torch.float16, torch.bfloat16):
        return NotImplemented

    def widen(t: Any) -> Any:
        return t.float() if t is not None else None

    out, mean, rstd = _aten.native_layer_norm.default(x.float(), shape, widen(weight), widen(bias), eps)
    return out.to(x.dtype), mean.to(x.dtype), rstd.to(x.dtype)


def batch_norm_no_training(
    x: Any, weight: Any, bias: Any, running_mean: Any, running_var: Any, momentum: float, eps: float
) -> Any:
    """Eval-mode batch norm with its running statistics, as torch's CPU decomposition
    computes it (float16 / bfloat16 in float32), with empty saved statistics. onnxscript's
    translation declares those empty outputs with the channel count, which fails the ONNX
    checker (every eval-mode BatchNorm piece ran eagerly); torch's own decomposition goes
    through ``_native_batch_norm_legit``, whose schema writes the running statistics (the
    piece would run eagerly as one writing its inputs)."""
    work = torch.float32 if x.dtype in (torch.float16, torch.bfloat16) else x.dtype
    shape = [-1] + [1] * (x.dim() - 2)  # channels in dim 1, broadcast over the rest

    def channel(t: Any) -> Any:
        return t.to(work).flatten().reshape(shape)

    out = (x.to(work) - channel(running_mean)) * channel(1 / torch.sqrt(running_var.to(work) + eps))
    if weight is not None:
        out = out * channel(weight)
    if bias is not None:
        out = out + channel(bias)
    return out.to(x.dtype), x.new_zeros((0,)), x.new_zeros((0,))


def batch_norm_training(
    x: Any,
    weight: Any,
    bias: Any,
    running_mean: Any,
    running_var: Any,
    training: bool,
    momentum: float,
    eps: float,
) -> Any:
    """Training-mode ``_native_batch_norm_legit_functional``: (output, batch mean, batch
    rstd, new running mean, new running var), as torch's decomposition computes them:
    the running variance takes the *unbiased* batch variance, ``momentum`` weighs the
    batch. onnxscript's translation (ONNX BatchNormalization in training mode) weighs
    the other way round and normalized the output wrongly (off by 1.2 on randn input);
    the piece writing the running statistics back (``prepare.input_writes_written_back``)
    made it reachable."""
    if not training:
        return NotImplemented
    work = torch.float32 if x.dtype in (torch.float16, torch.bfloat16) else x.dtype
    dims = [0, *range(2, x.dim())]
    shape = [-1] + [1] * (x.dim() - 2)
    # two passes, in ops functionalising can trace (var_mean goes through prims there)
    wide = x.to(work)
    mean = wide.mean(dims, keepdim=True)
    centered = wide - mean
    biased_var = (centered * centered).mean(dims, keepdim=True)
    rstd = torch.rsqrt(biased_var + eps)
    out = (x - mean) * rstd
    if weight is not None:
        out = out * weight.flatten().reshape(shape)
    if bias is not None:
        out = out + bias.flatten().reshape(shape)
    save_mean, save_rstd = mean.flatten(), rstd.flatten()
    n = x.numel() / x.shape[1]
    new_mean = momentum * save_mean + (1 - momentum) * running_mean
    new_var = momentum * (biased_var.flatten() * (n / (n - 1))) + (1 - momentum) * running_var
    return out.to(x.dtype), save_mean.to(x.dtype), save_rstd.to(x.dtype), new_mean, new_var


def batch_norm_with_update(
    x: Any, weight: Any, bias: Any, running_mean: Any, running_var: Any, momentum: float, eps: float
) -> Any:
    """``_batch_norm_with_update``: training batch norm that writes its running statistics
    in place (the piece writes them back) - torch's own decomposition goes through prims
    that functionalising refuses. Returns (output, batch mean, batch rstd, an empty
    reserve), as eager's CPU kernel."""
    out, mean, rstd, new_mean, new_var = batch_norm_training(
        x, weight, bias, running_mean, running_var, True, momentum, eps
    )
    running_mean.copy_(new_mean)
    running_var.copy_(new_var)
    return out, mean, rstd, torch.empty(0, dtype=torch.uint8)
