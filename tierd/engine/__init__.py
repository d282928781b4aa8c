"""The bundled paged-attention engine (Llama family; CPU path in torch)."""

from .llm import LLM, CompletionOutput, RequestOutput
from .sampling import Logprob, SamplingParams

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "Logprob"]
