"""A reference MLA decoder (DeepSeek-V2 style latent KV cache) on the qaic ops.

Multi-head latent attention caches, per token, one normalised latent ``c_kv`` (rank R)
and one shared rotary key ``k_pe`` (P dims) instead of per-head keys and values. Keys and
values are ``c_kv`` up-projected by ``kv_b_proj``; the *absorbed* form folds those
up-projections into the query and the output, so attention runs on the latent directly:

    q_latent = q_nope @ W_UK          scores = q_latent . c_kv + q_pe . k_pe
    out      = (softmax(scores) @ c_kv) @ W_UV

Each layer writes ``(c_kv, k_pe)`` with ``qaic::unified_mla_kv_cache_update`` and attends
with ``qaic::unified_mla_attention`` (the splitting op). Caches are
``compressed_kv [N, 1, B, R]`` and ``k_pe [N, 1, B, P]``.

:meth:`QaicMLAForCausalLM.reference_logits` computes the same model the naive way
(up-projected per-head K/V, dense causal attention, one sequence) so tests can check the
absorbed path against it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from qaic_dynamo.forward_context import FROM_FORWARD_CONTEXT
from qaic_dynamo.models.llama import QaicCausalLM, QaicModelConfig, rotate_half

__all__ = ["QaicMLAConfig", "QaicMLAForCausalLM"]


@dataclass(kw_only=True)
class QaicMLAConfig(QaicModelConfig):
    kv_lora_rank: int = 64
    qk_nope_head_dim: int = 32
    qk_rope_head_dim: int = 16
    v_head_dim: int = 32
    rms_norm_eps: float = 1e-6  # DeepSeek-V2's (the base keeps Llama's 1e-5)


class QaicMLAttention(nn.Module):
    def __init__(self, cfg: QaicMLAConfig, layer_name: str) -> None:
        super().__init__()
        self.cfg = cfg
        self.h, self.nope, self.rope, self.v = (
            cfg.num_attention_heads,
            cfg.qk_nope_head_dim,
            cfg.qk_rope_head_dim,
            cfg.v_head_dim,
        )
        self.rank = cfg.kv_lora_rank
        self.q_proj = nn.Linear(cfg.hidden_size, self.h * (self.nope + self.rope), bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(cfg.hidden_size, self.rank + self.rope, bias=False)
        self.kv_a_layernorm = nn.RMSNorm(self.rank, eps=cfg.rms_norm_eps)
        self.kv_b_proj = nn.Linear(self.rank, self.h * (self.nope + self.v), bias=False)
        self.o_proj = nn.Linear(self.h * self.v, cfg.hidden_size, bias=False)
        self.scale = (self.nope + self.rope) ** -0.5
        self.layer_name = layer_name
        # What both qaic ops are called with: the magic name keeps every per-layer constant
        # out of a traced block (a block compiles once); the real name is the baseline.
        self.op_layer_name = FROM_FORWARD_CONTEXT if cfg.layer_agnostic_kv_update else layer_name

    def _project(self, x, cos, sin):
        q = self.q_proj(x).view(-1, self.h, self.nope + self.rope)
        q_nope, q_pe = q.split([self.nope, self.rope], dim=-1)
        c_kv, k_pe = self.kv_a_proj_with_mqa(x).split([self.rank, self.rope], dim=-1)
        c_kv = self.kv_a_layernorm(c_kv)
        q_pe = q_pe * cos + rotate_half(q_pe) * sin
        k_pe = k_pe * cos[:, 0] + rotate_half(k_pe) * sin[:, 0]
        return q_nope, q_pe, c_kv, k_pe

    def _up_projections(self):
        w = self.kv_b_proj.weight.view(self.h, self.nope + self.v, self.rank)
        return w[:, : self.nope], w[:, self.nope :]  # W_UK [H, nope, R], W_UV [H, v, R]

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        q_nope, q_pe, c_kv, k_pe = self._project(x, cos, sin)
        w_uk, w_uv = self._up_projections()
        q_latent = torch.einsum("thn,hnr->thr", q_nope, w_uk)
        dep = torch.ops.qaic.unified_mla_kv_cache_update(c_kv, k_pe, self.op_layer_name)
        o_latent = torch.ops.qaic.unified_mla_attention(q_latent, q_pe, self.op_layer_name, self.scale, dep)
        o = torch.einsum("thr,hvr->thv", o_latent, w_uv)
        return self.o_proj(o.reshape(-1, self.h * self.v))

    def naive(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Per-head K/V from the latent and dense causal attention (one sequence)."""
        q_nope, q_pe, c_kv, k_pe = self._project(x, cos, sin)
        kv = self.kv_b_proj(c_kv).view(-1, self.h, self.nope + self.v)
        k_nope, v = kv.split([self.nope, self.v], dim=-1)
        q = torch.cat([q_nope, q_pe], -1).transpose(0, 1)
        k = torch.cat([k_nope, k_pe.unsqueeze(1).expand(-1, self.h, -1)], -1).transpose(0, 1)
        o = F.scaled_dot_product_attention(q, k, v.transpose(0, 1), is_causal=True, scale=self.scale)
        return self.o_proj(o.transpose(0, 1).reshape(-1, self.h * self.v))


class QaicMLAForCausalLM(QaicCausalLM):
    kv_cache_update = "qaic::unified_mla_kv_cache_update"

    def __init__(self, cfg: QaicMLAConfig) -> None:
        super().__init__(cfg, QaicMLAttention, cfg.qk_rope_head_dim)

    def kv_cache_shapes(self, num_blocks: int, block_size: int) -> dict[str, tuple[tuple[int, ...], ...]]:
        c = self.config
        shapes = ((num_blocks, 1, block_size, c.kv_lora_rank), (num_blocks, 1, block_size, c.qk_rope_head_dim))
        return {name: shapes for name in self.kv_cache_layers}

    @torch.no_grad()
    def reference_logits(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The same model computed naively for one sequence (no caches, no qaic ops)."""
        x = self.embed_tokens(input_ids)
        cos, sin = self.rope(torch.arange(input_ids.numel()), x.dtype)
        for layer in self.layers:
            x = layer(x, cos, sin, attn=layer.self_attn.naive)
        return self.lm_head(self.norm(x))
