"""Models that run their attention through the qaic ops.

* :mod:`qaic_dynamo.models.llama` - a reference Llama-style decoder (RMSNorm, RoPE, GQA,
  SwiGLU) written directly on ``qaic::unified_kv_cache_update`` / ``unified_attention``.
"""

from qaic_dynamo.models.llama import QaicLlamaConfig, QaicLlamaForCausalLM

__all__ = ["QaicLlamaConfig", "QaicLlamaForCausalLM"]
