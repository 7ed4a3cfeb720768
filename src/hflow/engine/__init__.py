"""hflow.engine: a paged-KV generation engine (continuous batching, prefix sharing, tensor
parallel, weights loaded in place) for Llama-family models.

    from hflow.engine import LLM, SamplingParams
    llm = LLM.from_pretrained(path)
    outs = llm.generate(prompt_token_ids, SamplingParams(n=4, temperature=1.0, max_tokens=64))
    outs[i].outputs[j].token_ids / .logprobs / .finish_reason
    llm.add_request(prompt_token_ids, params); llm.step()    # request by request (llm.py)
"""
from hflow.engine.config import EngineConfig
from hflow.engine.llm import LLM
from hflow.engine.loader import stop_token_ids
from hflow.engine.models import SUPPORTED_MODEL_TYPES
from hflow.engine.sequence import CompletionOutput, RequestOutput, SamplingParams

__all__ = ["LLM", "stop_token_ids", "SamplingParams", "EngineConfig", "RequestOutput", "CompletionOutput", "SUPPORTED_MODEL_TYPES"]
