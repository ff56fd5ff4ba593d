"""Models that run their attention through the qaic ops, and the loader the engine uses.

* :mod:`~qaic_dynamo.models.llama` - a reference Llama-style decoder on the qaic ops.
* :mod:`~qaic_dynamo.models.mla` - a reference MLA (DeepSeek-style latent KV) decoder.
* :mod:`~qaic_dynamo.models.hf` - any Hugging Face ``transformers`` decoder, through the
  ``attn_implementation="qaic"`` attention interface.

Every model the engine drives has the same small surface: ``forward(input_ids [T],
positions [T], logits_indices [N]) -> logits [N, vocab]``, ``vocab_size``,
``kv_cache_layers`` (model order) and ``kv_cache_shapes(num_blocks, block_size)``.

:func:`load_model` never changes a model it is given: adapting one (naming attention
layers, switching ``attn_implementation``, choosing the KV-update name, casting) happens
on a copy of its module tree that shares the weight tensors (:func:`copy_module_tree`),
so the caller's model still runs as before and no weights are duplicated.
"""

from __future__ import annotations

import copy
import json
import logging
import os
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from qaic_dynamo.models.llama import QaicCausalLM, QaicLlamaConfig, QaicLlamaForCausalLM, QaicModelConfig
from qaic_dynamo.models.mla import QaicMLAConfig, QaicMLAForCausalLM

__all__ = [
    "QaicLlamaConfig",
    "QaicLlamaForCausalLM",
    "QaicMLAConfig",
    "QaicMLAForCausalLM",
    "QaicModelConfig",
    "REFERENCE_MODELS",
    "BATCH_DEPENDENT_ROPE",
    "batch_dependent_rope",
    "max_positions",
    "max_positions_text",
    "model_config",
    "copy_module_tree",
    "has_weights",
    "local_model",
    "hf_config",
    "hf_model_from_config",
    "load_model",
]

logger = logging.getLogger("qaic_dynamo")

#: Reference models by name, built with random weights (seed 0).
REFERENCE_MODELS = {"llama": (QaicLlamaConfig, QaicLlamaForCausalLM), "mla": (QaicMLAConfig, QaicMLAForCausalLM)}


def _require_config_json(path: Path) -> None:
    # transformers' own message for a directory without one blames its model_type key.
    if path.is_dir() and not (path / "config.json").is_file():
        raise FileNotFoundError(
            f"{path} has no config.json: a local model directory needs one (and its weights, "
            "else the model gets random weights)"
        )


def hf_config(source: str | os.PathLike | dict[str, Any]) -> Any:
    """A transformers config from a local directory, a JSON file or a dict."""
    from transformers import AutoConfig

    if isinstance(source, dict):
        d = dict(source)
    else:
        path = Path(source)
        if path.is_dir():
            _require_config_json(path)
            return AutoConfig.from_pretrained(str(path), local_files_only=True)
        if not path.is_file():
            raise FileNotFoundError(f"no model directory or config JSON at {path}")
        d = json.loads(path.read_text())
    if "model_type" not in d:
        raise ValueError("the config needs a 'model_type' (e.g. 'llama', 'qwen2', 'mistral')")
    return AutoConfig.for_model(d.pop("model_type"), **d)


def hf_model_from_config(config: Any, seed: int = 0) -> nn.Module:
    """A transformers causal LM with random weights from a fixed seed.

    Its own attention is transformers' default (sdpa, or eager where the architecture has
    no sdpa path, e.g. Gemma2), so any architecture can be built and then checked by
    ``HFCausalLM``, whose refusal names what the qaic ops lack."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config).eval()


#: Weight files transformers' from_pretrained reads (safetensors, or PyTorch's pickles).
WEIGHT_FILES = ("*.safetensors", "pytorch_model*.bin")


def has_weights(path: str | os.PathLike) -> bool:
    """Whether ``path`` is a model directory with weights transformers can load."""
    p = Path(path)
    return p.is_dir() and any(any(p.glob(pattern)) for pattern in WEIGHT_FILES)


def local_model(path: str | os.PathLike) -> nn.Module:
    """The causal LM in a local directory: its weights if it has any (safetensors or
    ``pytorch_model*.bin``), else random weights (seed 0) from its config, with a warning."""
    from transformers import AutoModelForCausalLM

    path = Path(path)
    _require_config_json(path)
    if has_weights(path):
        return AutoModelForCausalLM.from_pretrained(str(path), local_files_only=True).eval()
    logger.warning("qaic: %s has no weights (%s); using random weights (seed 0)", path, " or ".join(WEIGHT_FILES))
    return hf_model_from_config(hf_config(path))


def copy_module_tree(model: nn.Module, dtype: torch.dtype | None = None) -> nn.Module:
    """A copy of ``model`` whose modules, config and other attributes are its own but whose
    parameters and buffers are ``model``'s tensors (tied weights stay tied).

    Changing an attribute of the copy, or of its config, leaves ``model`` as it was, at no
    cost in memory. With ``dtype``, floating-point parameters and buffers of another dtype
    are cast copies instead (what ``model.to(dtype)`` would cast), made directly rather
    than by casting in place: ``Module.to`` swaps the ``.data`` of the very parameter
    objects the caller's model holds.
    """

    def own(t: torch.Tensor) -> torch.Tensor:
        if dtype is None or not t.is_floating_point() or t.dtype == dtype:
            return t
        cast = t.detach().to(dtype)
        return nn.Parameter(cast, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else cast

    tensors = {id(t): t for t in (*model.parameters(), *model.buffers())}
    return copy.deepcopy(model, memo={key: own(t) for key, t in tensors.items()})


def _build(source: str) -> nn.Module:
    """A new model from a reference model name or a local directory."""
    if source in REFERENCE_MODELS:
        cfg_cls, model_cls = REFERENCE_MODELS[source]
        torch.manual_seed(0)
        return model_cls(cfg_cls())
    if Path(source).exists():
        return local_model(source)
    raise FileNotFoundError(
        f"LLM: {source!r} is neither a local model directory nor a reference model "
        f"({sorted(REFERENCE_MODELS)}); models are never downloaded"
    )


def model_config(model: nn.Module, text: bool = True) -> Any:
    """The config of a model as :func:`load_model` returns it: the transformers text config
    (a multimodal model's language part holds its positions and RoPE; ``text=False``: the
    whole config), or the reference model's (None if it has neither)."""
    cfg = getattr(getattr(model, "hf", None), "config", None) or getattr(model, "config", None)
    return cfg.get_text_config() if text and hasattr(cfg, "get_text_config") else cfg


def max_positions_text(model: nn.Module) -> str:
    """What :func:`max_positions` is, for an error message: ``max_position_embeddings=N``,
    or how RoPE scaling stretched it."""
    n, raw = max_positions(model), getattr(model_config(model), "max_position_embeddings", None)
    if n == raw:
        return f"max_position_embeddings={n}"
    return f"maximum of {n} positions (max_position_embeddings={raw} stretched by its RoPE scaling factor)"


def max_positions(model: nn.Module) -> int | None:
    """The longest context the model supports, if its config says (``max_position_embeddings``).

    As vLLM derives it: RoPE scaling that stretches the trained range (linear, dynamic,
    yarn) multiplies it by the scaling factor - yarn from its
    ``original_max_position_embeddings``; other kinds (llama3, longrope) already state the
    extended range. The engine and the deployment export both refuse a longer context:
    learned position tables would index out of range, and RoPE models degrade silently."""
    cfg = model_config(model)
    n = getattr(cfg, "max_position_embeddings", None)
    if not isinstance(n, int) or isinstance(n, bool):
        return None
    rope = getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None)
    if isinstance(rope, dict) and rope and all(isinstance(v, dict) for v in rope.values()):  # per layer type
        rope = rope.get("full_attention") or next(iter(rope.values()))
    if isinstance(rope, dict):
        kind, factor = rope.get("rope_type") or rope.get("type"), rope.get("factor")
        if kind in ("linear", "dynamic", "yarn") and isinstance(factor, (int, float)) and factor > 1:
            base = rope.get("original_max_position_embeddings") if kind == "yarn" else None
            n = int((base if isinstance(base, int) else n) * factor)
    return n


#: RoPE kinds whose frequencies transformers picks per forward from the largest position in
#: it (``max(position_ids) + 1``) once that passes the trained length: in a batch, the
#: longest sequence's choice then holds for all.
BATCH_DEPENDENT_ROPE = ("dynamic", "longrope")


def batch_dependent_rope(model: nn.Module) -> tuple[str, int] | None:
    """(kind, length) if the model's RoPE (of any layer type) is one of
    :data:`BATCH_DEPENDENT_ROPE`: sequences up to ``length`` tokens keep the trained
    frequencies whatever else is in the forward (longrope: its
    ``original_max_position_embeddings``; dynamic: ``max_position_embeddings``)."""
    cfg = model_config(model)
    rope = getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None)
    if not isinstance(rope, dict):
        return None
    kinds = (
        [r for r in rope.values() if isinstance(r, dict)] if all(isinstance(v, dict) for v in rope.values()) else [rope]
    )
    for r in kinds:
        kind = r.get("rope_type") or r.get("type")
        if kind in BATCH_DEPENDENT_ROPE:
            length = (
                r.get("original_max_position_embeddings") or getattr(cfg, "original_max_position_embeddings", None)
                if kind == "longrope"
                else getattr(cfg, "max_position_embeddings", None)
            )
            return kind, int(length) if isinstance(length, int) else 0
    return None


def load_model(model: Any, layer_agnostic_kv_update: bool = True, dtype: torch.dtype | None = None) -> nn.Module:
    """Whatever ``LLM(model)`` was given, as a model the engine can drive, in ``dtype``
    (default: the model's own). A model instance given is not changed (see the module
    docstring)."""
    from qaic_dynamo.models.hf import HFCausalLM

    try:
        from transformers import PreTrainedModel
    except ImportError:  # pragma: no cover
        PreTrainedModel = ()  # type: ignore[assignment]
    if isinstance(model, (str, os.PathLike)):
        model = _build(str(model))  # ours: adapted in place
        if dtype is not None:
            model = model.to(dtype)
    elif isinstance(model, HFCausalLM):
        model = copy_module_tree(model.hf, dtype)  # re-wrapped below with this call's options
    elif isinstance(model, (QaicCausalLM, PreTrainedModel)):
        if isinstance(model, PreTrainedModel) and model.get_output_embeddings() is None:
            raise TypeError(
                f"LLM: {type(model).__name__} has no language-model head (a base model gives hidden states, not "
                "logits); pass the causal LM, e.g. AutoModelForCausalLM. To compile this model itself, use "
                "torch.compile(model, backend='qaic')"
            )
        model = copy_module_tree(model, dtype)
    else:
        raise TypeError(
            f"LLM: cannot run a {type(model).__name__}; pass a transformers causal LM, a local model "
            f"directory, a qaic_dynamo.models reference model or one of {sorted(REFERENCE_MODELS)}"
        )
    if isinstance(model, QaicCausalLM):
        model.set_layer_agnostic_kv_update(layer_agnostic_kv_update)
        return model
    return HFCausalLM(model, layer_agnostic_kv_update)
