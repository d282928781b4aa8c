"""One request's state as the engine advances it."""

from __future__ import annotations

import enum
import time

import torch

from .sampling import Logprob, SamplingParams


class Status(enum.Enum):
    WAITING = 0
    RUNNING = 1
    FINISHED = 2


class Sequence:
    def __init__(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
                 params: SamplingParams):
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = list(prompt_token_ids)
        self.token_ids = list(prompt_token_ids)          # prompt + output
        self.params = params
        self.status = Status.WAITING
        self.num_computed = 0                             # tokens whose K/V are in the cache
        self.block_table: list[int] = []
        self.block_keys: list[bytes] = []                 # keys of full blocks, in order
        self.num_cached_tokens = 0                        # prompt tokens served by the prefix cache
        self.logprobs: list[dict[int, Logprob]] = []
        self.cumulative_logprob = 0.0
        self.finish_reason: str | None = None
        self.preemptions = 0
        self.arrival_time = time.time()
        self.first_token_time: float | None = None
        self.finished_time: float | None = None
        self.tier_keys: list[bytes] = []                  # keys of full tier blocks (connector)
        self.tier_loaded = 0                              # tier blocks loaded from the store
        self.tier_saved = 0                               # tier blocks handed to the store
        self.tier_sources: list[str] = []                 # where loaded blocks were: host, disk
        self.block_mass: torch.Tensor | None = None       # eviction: attention mass per table entry
        self.block_seen: torch.Tensor | None = None       # ... and the layer-queries that saw it
        self.generator = None
        if params.seed is not None:
            self.generator = torch.Generator().manual_seed(params.seed)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[len(self.prompt_token_ids):]

    def reset_for_recompute(self) -> None:
        """Preempted: its blocks are gone; the prompt and the output so far are recomputed."""
        self.status = Status.WAITING
        self.num_computed = 0
        self.block_table = []
        self.block_mass = self.block_seen = None
        self.tier_loaded = 0
        self.preemptions += 1
