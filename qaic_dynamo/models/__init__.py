"""Models that run their attention through the qaic ops, and the loader the engine uses.

* :mod:`~qaic_dynamo.models.llama` - a reference Llama-style decoder on the qaic ops.
* :mod:`~qaic_dynamo.models.mla` - a reference MLA (DeepSeek-style latent KV) decoder.
* :mod:`~qaic_dynamo.models.hf` - any Hugging Face ``transformers`` decoder, through the
  ``attn_implementation="qaic"`` attention interface.

Every model the engine drives has the same small surface: ``forward(input_ids [T],
positions [T], logits_indices [N]) -> logits [N, vocab]``, ``vocab_size``,
``kv_cache_layers`` (model order) and ``kv_cache_shapes(num_blocks, block_size)``.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from qaic_dynamo.models.llama import QaicLlamaConfig, QaicLlamaForCausalLM
from qaic_dynamo.models.mla import QaicMLAConfig, QaicMLAForCausalLM

__all__ = [
    "QaicLlamaConfig",
    "QaicLlamaForCausalLM",
    "QaicMLAConfig",
    "QaicMLAForCausalLM",
    "REFERENCE_MODELS",
    "hf_config",
    "hf_model_from_config",
    "load_model",
]

logger = logging.getLogger("qaic_dynamo")

#: Reference models by name, built with random weights (seed 0).
REFERENCE_MODELS = {"llama": (QaicLlamaConfig, QaicLlamaForCausalLM), "mla": (QaicMLAConfig, QaicMLAForCausalLM)}


def hf_config(source: str | os.PathLike | dict[str, Any]) -> Any:
    """A transformers config from a local directory, a JSON file or a dict."""
    from transformers import AutoConfig

    if isinstance(source, dict):
        d = dict(source)
    else:
        path = Path(source)
        if path.is_dir():
            return AutoConfig.from_pretrained(str(path), local_files_only=True)
        if not path.is_file():
            raise FileNotFoundError(f"no model directory or config JSON at {path}")
        d = json.loads(path.read_text())
    if "model_type" not in d:
        raise ValueError("the config needs a 'model_type' (e.g. 'llama', 'qwen2', 'mistral')")
    return AutoConfig.for_model(d.pop("model_type"), **d)


def hf_model_from_config(config: Any, seed: int = 0) -> nn.Module:
    """A transformers causal LM with random weights from a fixed seed."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval()


def _from_local(path: Path) -> nn.Module:
    from transformers import AutoModelForCausalLM

    if path.is_dir() and any(path.glob("*.safetensors")):
        return AutoModelForCausalLM.from_pretrained(str(path), local_files_only=True, attn_implementation="sdpa").eval()
    logger.warning("qaic: %s has no safetensors weights; using random weights (seed 0)", path)
    return hf_model_from_config(hf_config(path))


def load_model(model: Any, layer_agnostic_kv_update: bool = True) -> nn.Module:
    """Whatever ``LLM(model)`` was given, as a model the engine can drive."""
    from qaic_dynamo.models.hf import HFCausalLM

    if isinstance(model, (str, os.PathLike)):
        key = str(model)
        if key in REFERENCE_MODELS:
            cfg_cls, model_cls = REFERENCE_MODELS[key]
            torch.manual_seed(0)
            model = model_cls(cfg_cls())
        elif Path(key).exists():
            model = _from_local(Path(key))
        else:
            raise FileNotFoundError(
                f"LLM: {key!r} is neither a local model directory nor a reference model "
                f"({sorted(REFERENCE_MODELS)}); models are never downloaded"
            )
    if isinstance(model, (QaicLlamaForCausalLM, QaicMLAForCausalLM)):
        model.set_layer_agnostic_kv_update(layer_agnostic_kv_update)
        return model
    if isinstance(model, HFCausalLM):
        return HFCausalLM(model.hf, layer_agnostic_kv_update)
    try:
        from transformers import PreTrainedModel
    except ImportError:  # pragma: no cover
        PreTrainedModel = ()  # type: ignore[assignment]
    if isinstance(model, PreTrainedModel):
        return HFCausalLM(model, layer_agnostic_kv_update)
    raise TypeError(
        f"LLM: cannot run a {type(model).__name__}; pass a transformers causal LM, a local model "
        f"directory, a qaic_dynamo.models reference model or one of {sorted(REFERENCE_MODELS)}"
    )
