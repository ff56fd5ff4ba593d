"""``scaled_dot_product_attention`` as torch's CPU kernel computes it: masked rows,
grouped keys, bfloat16, negative scales and dropout."""

from __future__ import annotations

import math
import threading
from typing import Any

import torch

_aten = torch.ops.aten

__all__ = ["masked_attention", "open_sdpa"]


_reentry = threading.local()


def masked_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    *,
    attn_mask: torch.Tensor | None = None,
    scale: float | None = None,
) -> Any:
    """``scaled_dot_product_attention`` with a mask, as torch's CPU kernel computes it: a
    query row whose keys are all masked out gives zeros (onnxscript's plain Softmax gives
    NaN there, which spreads into anything reduced over that row - a left-padded batch's
    padding rows). The op itself stays (its translation, and its fake kernel, which does not
    compare the key's and value's lengths: dynamic pieces keep tracing at example sizes);
    only those rows are set. sdpa has made a bool mask a float one with -inf by now. The
    logsumexp output is left as the translation gives it (sdpa drops it). Also: grouped
    keys and values are repeated per query head, and bfloat16 runs in float32 (the
    translation fails the checker or has no ONNX Runtime CPU kernel for either). A negative
    ``scale`` goes on the query, as ``-scale`` on ``-query``: the translation scales query
    and key by ``Sqrt(scale)`` each, NaN for a negative scale (every output was NaN)."""
    if getattr(_reentry, "attention", False):
        return NotImplemented
    if dropout_p:
        return _attention_with_dropout(query, key, value, dropout_p, is_causal, attn_mask, scale)
    grouped = query.dim() == 4 and key.shape[1] != query.shape[1]
    wide = query.dtype == torch.bfloat16  # ONNX Runtime's CPU kernels lack bfloat16 Sqrt / MatMul
    negative = isinstance(scale, (int, float)) and scale < 0
    if attn_mask is None and not grouped and not wide and not negative:
        return NotImplemented
    if negative:
        query, scale = -query, -scale
    if grouped:  # the translation's MatMul wants one kv head per query head
        if query.shape[1] % key.shape[1]:
            return NotImplemented
        key = key.repeat_interleave(query.shape[1] // key.shape[1], dim=1)
        value = value.repeat_interleave(query.shape[1] // value.shape[1], dim=1)
    dtype = query.dtype
    if wide:  # computed in float32 and rounded once, as the kernel accumulates in float
        query, key, value = query.float(), key.float(), value.float()
        attn_mask = attn_mask.float() if attn_mask is not None else None
    _reentry.attention = True
    try:
        out, *rest = _aten._scaled_dot_product_flash_attention_for_cpu.default(
            query, key, value, dropout_p, is_causal, attn_mask=attn_mask, scale=scale
        )
    finally:
        _reentry.attention = False
    if attn_mask is not None:
        dead = (attn_mask == float("-inf")).all(-1, keepdim=True)  # [..., L, 1]: broadcasts to out
        out = out.masked_fill(dead, 0)
    return (out.to(dtype), *rest)


def _attention_with_dropout(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    dropout_p: float,
    is_causal: bool,
    attn_mask: torch.Tensor | None,
    scale: float | None,
) -> Any:
    """Attention with dropout on its weights (training mode), written out: the translation's
    Dropout has no ``training_mode`` (the identity, by ONNX's definition), so the weights
    were never dropped. Dropout draws from ONNX Runtime's generator, as ``F.dropout`` in a
    lowered piece does."""
    if query.dim() == 4 and key.shape[1] != query.shape[1]:
        key = key.repeat_interleave(query.shape[1] // key.shape[1], dim=1)
        value = value.repeat_interleave(query.shape[1] // value.shape[1], dim=1)
    dtype = query.dtype
    query, key, value = query.float(), key.float(), value.float()
    factor = scale if scale is not None else 1.0 / math.sqrt(query.shape[-1])
    scores = query @ key.transpose(-2, -1) * factor
    if is_causal:
        keep = torch.ones(query.shape[-2], key.shape[-2], dtype=torch.bool).tril()
        scores = scores.masked_fill(~keep, float("-inf"))
    if attn_mask is not None:
        scores = scores.masked_fill(~attn_mask, float("-inf")) if attn_mask.dtype == torch.bool else scores + attn_mask
    dead = (scores == float("-inf")).all(-1, keepdim=True)  # eager's kernel gives such rows zeros
    weights = torch.softmax(scores, -1).masked_fill(dead, 0)
    out = torch.nn.functional.dropout(weights, dropout_p, training=True) @ value
    return out.to(dtype), torch.logsumexp(scores, -1)


def open_sdpa(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    *,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> Any:
    """sdpa as its CPU kernel runs it in inference: the flash op, a bool mask made a float
    one, which :func:`masked_attention` then gives eager's masked rows (the exporter path,
    where torch.export keeps sdpa whole)."""
    if query.dim() != 4:
        return NotImplemented
    if attn_mask is not None and attn_mask.dtype == torch.bool:
        attn_mask = torch.zeros(attn_mask.shape, dtype=query.dtype).masked_fill(~attn_mask, float("-inf"))
    return _aten._scaled_dot_product_flash_attention_for_cpu.default(
        query, key, value, dropout_p, is_causal, attn_mask=attn_mask, scale=scale
    )[0]
