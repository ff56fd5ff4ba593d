"""A reference Llama-style decoder on the qaic ops.

The model works on a flat batch of tokens (``input_ids [T]``, ``positions [T]``), as a
paged-KV engine feeds it: which sequence a token belongs to, and where its K/V go, is in
the forward context, not in the model. Each attention layer writes its cache with
``qaic::unified_kv_cache_update`` and reads it with ``qaic::unified_attention`` (the
splitting op).

``layer_agnostic_kv_update=True`` (the default) calls the update with
``"from_forward_context"``: no per-layer constant reaches the traced graph, so every
middle layer's piece is identical and compiles once. ``False`` passes each layer's real
name, the baseline the cold-start benchmark compares against.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from qaic_dynamo.forward_context import FROM_FORWARD_CONTEXT

__all__ = ["QaicCausalLM", "QaicDecoderLayer", "QaicLlamaConfig", "QaicLlamaForCausalLM", "QaicModelConfig"]


@dataclass(kw_only=True)
class QaicModelConfig:
    """What every reference model's config holds: the decoder's sizes, norm, RoPE, and
    how attention layers name themselves to the KV-cache update (see the module docstring).
    Keyword-only, so a subclass adding fields cannot shift a positional argument."""

    vocab_size: int = 512
    hidden_size: int = 128
    intermediate_size: int = 256
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    layer_agnostic_kv_update: bool = True


@dataclass(kw_only=True)
class QaicLlamaConfig(QaicModelConfig):
    num_key_value_heads: int = 2
    head_dim: int | None = None  # None: hidden_size // num_attention_heads

    def __post_init__(self) -> None:
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class QaicAttention(nn.Module):
    def __init__(self, cfg: QaicLlamaConfig, layer_name: str) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = (
            cfg.num_attention_heads,
            cfg.num_key_value_heads,
            cfg.head_dim,
        )
        self.q_size, self.kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.qkv_proj = nn.Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=False)
        self.o_proj = nn.Linear(self.q_size, cfg.hidden_size, bias=False)
        self.layer_name = layer_name
        # What both qaic ops are called with: the magic name keeps every per-layer constant
        # out of a traced block (a block compiles once); the real name is the baseline.
        self.op_layer_name = FROM_FORWARD_CONTEXT if cfg.layer_agnostic_kv_update else layer_name
        self.scale = 1.0 / math.sqrt(self.head_dim)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        dep = torch.ops.qaic.unified_kv_cache_update(k, v, self.op_layer_name)
        o = torch.ops.qaic.unified_attention(q, k, v, self.op_layer_name, self.scale, None, dep)
        return self.o_proj(o.reshape(-1, self.q_size))


class QaicDecoderLayer(nn.Module):
    """Pre-norm decoder layer: attention (any qaic attention module) + SwiGLU MLP."""

    def __init__(self, cfg: QaicModelConfig, attention: nn.Module) -> None:
        super().__init__()
        self.input_layernorm = nn.RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.self_attn = attention
        self.post_attention_layernorm = nn.RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attn: Any = None) -> torch.Tensor:
        x = x + (attn or self.self_attn)(self.input_layernorm(x), cos, sin)
        gate, up = self.gate_up_proj(self.post_attention_layernorm(x)).chunk(2, dim=-1)
        return x + self.down_proj(F.silu(gate) * up)


class QaicCausalLM(nn.Module):
    """What the reference models share: embedding, decoder layers, final norm, head, RoPE,
    and the surface the engine drives (vocab_size, kv_cache_layers, kv_cache_shapes)."""

    #: The op registry's KV-cache update every layer calls (its retained-state stems name
    #: the caches in exports and disaggregated serving).
    kv_cache_update = "qaic::unified_kv_cache_update"

    def __init__(self, cfg: QaicModelConfig, attention_cls: type[nn.Module], rope_dim: int) -> None:
        super().__init__()
        self.config = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(
            QaicDecoderLayer(cfg, attention_cls(cfg, f"model.layers.{i}.self_attn"))
            for i in range(cfg.num_hidden_layers)
        )
        self.norm = nn.RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, rope_dim, 2, dtype=torch.float32) / rope_dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    @property
    def vocab_size(self) -> int:
        return self.config.vocab_size

    @property
    def kv_cache_layers(self) -> list[str]:
        """Layer names in the order the model updates them."""
        return [layer.self_attn.layer_name for layer in self.layers]

    def set_layer_agnostic_kv_update(self, agnostic: bool) -> None:
        self.config.layer_agnostic_kv_update = agnostic
        for layer in self.layers:
            attn = layer.self_attn
            attn.op_layer_name = FROM_FORWARD_CONTEXT if agnostic else attn.layer_name

    def kv_cache_shapes(self, num_blocks: int, block_size: int) -> dict[str, tuple[tuple[int, ...], ...]]:
        raise NotImplementedError

    def rope(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin as [T, 1, rope_dim]: broadcast over heads."""
        freqs = positions.unsqueeze(-1).to(torch.float32) * self.inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype).unsqueeze(1), emb.sin().to(dtype).unsqueeze(1)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, logits_indices: torch.Tensor | None = None
    ) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        cos, sin = self.rope(positions, x.dtype)
        for layer in self.layers:
            x = layer(x, cos, sin)
        if logits_indices is not None:  # only the rows we sample from
            x = x[logits_indices]
        return self.lm_head(self.norm(x))


class QaicLlamaForCausalLM(QaicCausalLM):
    def __init__(self, cfg: QaicLlamaConfig) -> None:
        super().__init__(cfg, QaicAttention, cfg.head_dim)

    def kv_cache_shape(self, num_blocks: int, block_size: int) -> tuple[int, int, int, int]:
        return (num_blocks, self.config.num_key_value_heads, block_size, self.config.head_dim)

    def kv_cache_shapes(self, num_blocks: int, block_size: int) -> dict[str, tuple[tuple[int, ...], ...]]:
        shape = self.kv_cache_shape(num_blocks, block_size)
        return {name: (shape, shape) for name in self.kv_cache_layers}
