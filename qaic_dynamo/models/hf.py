"""Run any Hugging Face ``transformers`` decoder through the qaic ops, unchanged.

transformers dispatches attention through ``AttentionInterface`` by the name in
``config._attn_implementation``. We register an implementation called ``"qaic"`` that
writes the layer's K/V with ``qaic::unified_kv_cache_update`` and attends with
``qaic::unified_attention``, and a mask function that returns ``None`` (the qaic ops take
causality and sequence boundaries from the forward context, so the dense mask transformers
would build is never needed). Every decoder that uses transformers' standard attention
path works without special cases; nothing here names a model family.

The engine feeds a flat batch: all new tokens of all sequences as one row
``input_ids [1, T]`` with their real ``position_ids``, so RoPE is right per token and the
attention op, not the mask, keeps sequences apart. A sliding window that a model applies only
through its mask reaches the op through the mask function (:func:`qaic_mask`).

Attention the qaic op does not implement (non-causal, chunked, transformers' latent
attention) and recurrent state are refused when :class:`HFCausalLM` is built, before
anything is traced, as is attention transformers itself marks as bypassing the interface
(GPT-J, Falcon); the mask function checks again at run time, and the engine checks after
every forward that each layer wrote its KV cache.
"""

from __future__ import annotations

import re
from typing import Any

import torch
import torch.nn as nn

from qaic_dynamo.forward_context import FROM_FORWARD_CONTEXT

__all__ = [
    "ATTN_IMPLEMENTATION",
    "HFCausalLM",
    "SLIDING_WINDOW_MASK",
    "qaic_mask",
    "register_qaic_attention",
    "unsupported_attention_features",
]

ATTN_IMPLEMENTATION = "qaic"


def qaic_attention_forward(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention signature: q [1, H, T, D], k/v [1, Hkv, T, D] -> [1, T, H, D]."""
    # Only the op layer name is read here: it is the same for every layer, so a traced
    # block carries no per-layer value for Dynamo to guard on.
    op_layer_name = getattr(module, "qaic_op_layer_name", None)
    if op_layer_name is None:
        raise RuntimeError(
            f"{type(module).__name__} has no qaic layer name: wrap the model with "
            "qaic_dynamo.models.hf.HFCausalLM (or qaic_dynamo.LLM) before running it with "
            "attn_implementation='qaic'"
        )
    if query.shape[0] != 1:
        raise RuntimeError(
            f"attn_implementation='qaic' runs a flat batch (batch dimension 1, sequences kept "
            f"apart by the forward context); got batch {query.shape[0]}"
        )
    if isinstance(attention_mask, tuple) and attention_mask[:1] == (SLIDING_WINDOW_MASK,):
        # A window transformers applies only through the mask (Qwen2-MoE, PhiMoE): the op
        # applies it, as it does a window the attention passes as an argument.
        window = attention_mask[1]
        if sliding_window is not None and sliding_window != window:
            raise RuntimeError(
                f"{type(module).__name__}: the attention passes sliding_window={sliding_window} but "
                f"its mask has a window of {window}"
            )
        sliding_window = window
    q = query[0].transpose(0, 1)  # [T, H, D]
    k = key[0].transpose(0, 1)
    v = value[0].transpose(0, 1)
    dep = torch.ops.qaic.unified_kv_cache_update(k, v, op_layer_name)
    # Soft-capping (Gemma 2) and sinks (transformers' s_aux, a learned per-head logit) are
    # op arguments: per-layer values never become constants inside a compiled piece.
    out = torch.ops.qaic.unified_attention(
        q, k, v, op_layer_name, scaling, sliding_window, dep, softcap, kwargs.get("s_aux")
    )
    return out.unsqueeze(0), None


#: Module classes that hold recurrent state (checked in models transformers marks stateful).
_RECURRENT = re.compile(r"Mamba|Mixer|SSM|DeltaNet|LinearAttention|Recurrent|RWKV", re.IGNORECASE)

#: What the "qaic" mask function returns for a sliding-window mask: ``(SLIDING_WINDOW_MASK,
#: window)``, a constant Dynamo guards on by value (one trace per window size).
SLIDING_WINDOW_MASK = "qaic_sliding_window"


def qaic_mask(*args: Any, **kwargs: Any) -> tuple[str, int] | None:
    """transformers' mask interface for ``attn_implementation="qaic"``: no dense mask.

    Causality and sequence boundaries come from the forward context, so a causal mask
    (and transformers' packed-sequence or padding overlays on it) is None. A sliding
    window is passed on as ``(SLIDING_WINDOW_MASK, window)`` - transformers' mask builders
    give it as ``local_size`` - because some models (Qwen2-MoE, PhiMoE) apply their window
    only through the mask, never as the attention's ``sliding_window`` argument. Masks the
    op cannot apply are refused: chunked attention (which also arrives as ``local_size``)
    and a model's own mask functions (``or_mask_function`` / ``and_mask_function``, which
    transformers flags with ``use_vmap``)."""
    config = kwargs.get("config")
    if getattr(config, "attention_chunk_size", None) is not None:
        raise NotImplementedError(
            "attn_implementation='qaic': chunked attention (attention_chunk_size) is not "
            "implemented by the qaic attention op"
        )
    if kwargs.get("use_vmap"):
        raise NotImplementedError(
            "attn_implementation='qaic': the model combines the causal mask with a mask "
            "function of its own, which the qaic attention op cannot apply"
        )
    window = kwargs.get("local_size")
    return None if window is None else (SLIDING_WINDOW_MASK, int(window))


def register_qaic_attention() -> None:
    """Register ``attn_implementation="qaic"`` with transformers (idempotent)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(ATTN_IMPLEMENTATION, qaic_attention_forward)
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, qaic_mask)


def attention_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """transformers' attention modules, in model order: they carry ``layer_idx`` and
    ``is_causal`` and call the attention interface."""
    found = [
        (name, m)
        for name, m in model.named_modules()
        if isinstance(getattr(m, "layer_idx", None), int) and getattr(m, "is_causal", None) is not None
    ]
    return sorted(found, key=lambda nm: nm[1].layer_idx)


def unsupported_attention_features(config: Any, layers: list[tuple[str, nn.Module]]) -> list[str]:
    """The attention features of a model that the qaic attention op does not implement,
    found from its config and attention modules (what they would pass the interface)."""
    # Soft-capping and sinks are op arguments now; what remains unsupported is attention
    # that is not causal self-attention over one K/V head size.
    found = [f"non-causal attention ({name})" for name, m in layers if getattr(m, "is_causal", True) is False]
    if getattr(config, "attention_chunk_size", None) is not None or "chunked_attention" in (
        getattr(config, "layer_types", None) or ()
    ):
        found.append("chunked attention (attention_chunk_size)")
    if getattr(config, "kv_lora_rank", None) is not None:
        # transformers' multi-head latent attention (DeepSeek-V2/V3): keys and values of
        # other head sizes than head_dim; the reference MLA model runs it (models.mla).
        found.append("multi-head latent attention (kv_lora_rank; use qaic_dynamo.models' MLA model)")
    return found


class HFCausalLM(nn.Module):
    """A transformers causal LM as the engine sees it: flat tokens in, chosen logits out.

    Adapts ``hf_model`` in place: names its attention modules (``qaic_layer_name``, the
    real name, and ``qaic_op_layer_name``, what the qaic ops are called with) and switches its ``config._attn_implementation`` to
    ``"qaic"``. ``qaic_dynamo.LLM`` hands it a copy of the module tree sharing the weights
    (:func:`qaic_dynamo.models.copy_module_tree`), so the caller's model is left as it was.

    Raises NotImplementedError for an architecture whose attention the qaic ops cannot
    run (see :func:`unsupported_attention_features`).
    """

    #: The op registry's KV-cache update every layer calls (see ``qaic_attention_forward``).
    kv_cache_update = "qaic::unified_kv_cache_update"

    def __init__(self, hf_model: nn.Module, layer_agnostic_kv_update: bool = True) -> None:
        super().__init__()
        register_qaic_attention()
        self.hf = hf_model
        config = hf_model.config
        text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
        self.config = text_config
        if getattr(type(hf_model), "_supports_attention_backend", True) is False:
            # transformers' own flag: this model's attention never calls the attention
            # interface (GPT-J, Falcon, Falcon-H1), so it would compute without the qaic ops.
            raise NotImplementedError(
                f"{type(hf_model).__name__}'s attention does not go through transformers' attention interface "
                "(_supports_attention_backend is False); this architecture is not supported by attn_implementation='qaic' "
                "(LLM's paged KV cache). torch.compile(model, backend='qaic') still compiles it as it is, with its "
                "own attention and cache"
            )
        recurrent = (
            sorted({type(m).__name__ for m in hf_model.modules() if _RECURRENT.search(type(m).__name__)})
            if getattr(type(hf_model), "_is_stateful", False)
            else []
        )
        if recurrent:
            # Recurrent state (Mamba mixers beside attention: Falcon-H1, Jamba, ...) is
            # neither cached per sequence nor kept apart between the sequences of a batch.
            # The class flag alone is not enough: GraniteMoeHybrid built with attention
            # layers only has no mixer and runs.
            raise NotImplementedError(
                f"{type(hf_model).__name__} keeps recurrent state next to its KV cache ({', '.join(recurrent)}), which "
                "the qaic engine does not carry between steps; this architecture is not supported by "
                "attn_implementation='qaic'"
            )
        layers = attention_modules(hf_model)
        expected = getattr(text_config, "num_hidden_layers", len(layers))
        if len(layers) != expected:
            raise NotImplementedError(
                f"{type(hf_model).__name__}: found {len(layers)} attention modules using transformers' "
                f"attention interface but the config has {expected} layers; this architecture is not "
                "supported by attn_implementation='qaic'"
            )
        head_dims = {i: m.head_dim for i, (_, m) in enumerate(layers) if isinstance(getattr(m, "head_dim", None), int)}
        if len(set(head_dims.values())) > 1:
            # One KV cache shape serves every layer (Gemma 4's full-attention layers have
            # their own global_head_dim): a cache of the wrong size would fail at the first step.
            sizes = ", ".join(f"layer {i}: {d}" for i, d in head_dims.items())
            raise NotImplementedError(
                f"{type(hf_model).__name__} has attention layers with different head sizes ({sizes}); the qaic "
                "engine keeps one KV-cache shape for every layer, so this architecture is not supported"
            )
        unsupported = unsupported_attention_features(text_config, layers)
        if unsupported:
            raise NotImplementedError(
                f"{type(hf_model).__name__} uses {' and '.join(unsupported)}, which the qaic attention op "
                "does not implement; run this model with another attn_implementation (outside qaic_dynamo)"
            )
        for name, m in layers:
            m.qaic_layer_name = name
            # Both ops get the magic name unless the per-layer baseline is asked for: a
            # layer's name read inside a traced block would make Dynamo re-trace it per layer.
            m.qaic_op_layer_name = FROM_FORWARD_CONTEXT if layer_agnostic_kv_update else name
        self._layers = [name for name, _ in layers]
        hf_model.config._attn_implementation = ATTN_IMPLEMENTATION
        if text_config is not config:
            text_config._attn_implementation = ATTN_IMPLEMENTATION
        # Mixture-of-experts layers: transformers' "batched_mm" experts gather each token's
        # expert weights and run dense batched matmuls - static shapes, no per-layer
        # constants, no custom op - where "grouped_mm" (its default) calls a custom op no
        # ONNX translation knows and "eager" loops over experts with data-dependent shapes.
        if (
            hasattr(type(hf_model), "_can_set_experts_implementation")
            and type(hf_model)._can_set_experts_implementation()
        ):
            hf_model.set_experts_implementation("batched_mm")
        self.vocab_size = text_config.vocab_size
        # Multi-head attention configs (GPT-2, GPT-NeoX, OPT) have no num_key_value_heads.
        self.num_kv_heads = getattr(text_config, "num_key_value_heads", None) or text_config.num_attention_heads
        self.head_dim = (
            next(iter(head_dims.values()))
            if head_dims
            else getattr(text_config, "head_dim", None) or text_config.hidden_size // text_config.num_attention_heads
        )

    @property
    def kv_cache_layers(self) -> list[str]:
        return list(self._layers)

    def kv_cache_shapes(self, num_blocks: int, block_size: int) -> dict[str, tuple[tuple[int, ...], ...]]:
        shape = (num_blocks, self.num_kv_heads, block_size, self.head_dim)
        return {name: (shape, shape) for name in self._layers}

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, logits_indices: torch.Tensor | None = None
    ) -> torch.Tensor:
        out = self.hf(
            input_ids=input_ids.unsqueeze(0),
            position_ids=positions.unsqueeze(0),
            use_cache=False,
            logits_to_keep=logits_indices if logits_indices is not None else 0,
        )
        return out.logits[0]
