"""Sampling parameters and the sampler (vLLM names and semantics)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..errors import ConfigError


@dataclass(slots=True)
class SamplingParams:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1                # -1: all tokens
    max_tokens: int = 16
    min_tokens: int = 0
    seed: int | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    logprobs: int | None = None    # also report the top-k logprobs of each step
    ignore_eos: bool = False
    forced_token_ids: list[int] | None = None   # score a continuation: output these tokens in turn
                                                # (logprobs still describe the model's distribution)

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ConfigError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ConfigError(f"top_p must lie in (0, 1], got {self.top_p}")
        if self.top_k == 0 or self.top_k < -1:
            raise ConfigError(f"top_k must be -1 (off) or >= 1, got {self.top_k}")
        if self.max_tokens < 1:
            raise ConfigError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise ConfigError(f"min_tokens must lie in [0, max_tokens], got {self.min_tokens}")
        if self.logprobs is not None and self.logprobs < 0:
            raise ConfigError("logprobs must be >= 0")


@dataclass(slots=True)
class Logprob:
    logprob: float
    rank: int
    decoded_token: str | None = None


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None,
           banned: list[int]) -> tuple[int, torch.Tensor]:
    """One token from logits (vocab,) float32; returns (token, logprobs of the raw distribution).
    `banned` tokens (stop tokens before min_tokens) are never chosen."""
    logprobs = torch.log_softmax(logits, dim=-1)
    x = logits.clone()
    if banned:
        x[banned] = float("-inf")
    if params.temperature == 0:
        return int(torch.argmax(x)), logprobs
    x = x / params.temperature
    if params.top_k > 0 and params.top_k < x.numel():
        kth = torch.topk(x, params.top_k).values[-1]
        x[x < kth] = float("-inf")
    if params.top_p < 1.0:
        sorted_x, idx = torch.sort(x, descending=True)
        cum = torch.softmax(sorted_x, dim=-1).cumsum(-1)
        drop = cum - torch.softmax(sorted_x, dim=-1) > params.top_p  # keep the token that crosses
        x[idx[drop]] = float("-inf")
    probs = torch.softmax(x, dim=-1)
    return int(torch.multinomial(probs, 1, generator=generator)), logprobs
