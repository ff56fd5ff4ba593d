"""The engine: ``LLM``, a small paged-KV inference engine over the qaic ops (:mod:`.llm`),
its requests and outputs (:mod:`.request`) and sampling (:mod:`.sampling`)."""

from qaic_dynamo.engine.llm import BACKENDS, LLM
from qaic_dynamo.engine.request import Request, RequestOutput, prompt_list
from qaic_dynamo.engine.sampling import Sampler, SamplingParams, is_token_id

__all__ = ["BACKENDS", "LLM", "Request", "RequestOutput", "Sampler", "SamplingParams", "is_token_id", "prompt_list"]
