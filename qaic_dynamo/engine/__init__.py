"""The engine: ``LLM`` (:mod:`.llm`), used as vLLM's, over the engine core
(:mod:`.core`): the scheduler (:mod:`.scheduler`), the model runner (:mod:`.runner`),
sampling (:mod:`.sampling`) and detokenization (:mod:`.detokenizer`); requests
(:mod:`.request`) and vLLM's output types (:mod:`.outputs`)."""

from qaic_dynamo.engine.llm import BACKENDS, LLM
from qaic_dynamo.engine.outputs import CompletionOutput, GreedyOutput, Logprob, RequestOutput
from qaic_dynamo.engine.request import Request, prompt_list
from qaic_dynamo.engine.sampling import Sampler, SamplingParams, is_token_id

__all__ = [
    "BACKENDS",
    "LLM",
    "CompletionOutput",
    "GreedyOutput",
    "Logprob",
    "Request",
    "RequestOutput",
    "Sampler",
    "SamplingParams",
    "is_token_id",
    "prompt_list",
]
