"""What the vLLM connector's scheduler half hands its workers each step (pickled)."""

from __future__ import annotations

from dataclasses import dataclass, field

from .vllm_base import KVConnectorMetadata


@dataclass
class LoadSpec:
    """Load tier blocks `keys[rank]` (the first is tier block `first_tier`) into the request's
    vLLM blocks `first_block` .. `first_block + n - 1`: `block_ids[group]` per KV cache group,
    -1 where a group has nothing to write (the null block of a sliding window)."""

    req_id: str
    salt: str
    keys: list[list[bytes]]      # per tensor-parallel rank
    first_tier: int
    first_block: int
    block_ids: list[list[int]]   # per KV group (`KVGroups.kv`)
    is_async: bool = False
    state_keys: list[bytes] = field(default_factory=list)    # per rank: the state after the last block
    state_ids: list[list[int]] = field(default_factory=list)  # per state group: the blocks it goes into
    # the cost model's deadline for this load (tierd/costs.py): past it, the worker stops between
    # two parts and vLLM computes the rest; inf: none (not decided, or the load policy "always")
    deadline_s: float = float("inf")

    @property
    def num_blocks(self) -> int:
        return len(self.block_ids[0])

    def real_ids(self, since: int = 0) -> set[int]:
        """The vLLM blocks written from the request's block `since` on (every group, and the
        state blocks with them)."""
        lo = max(0, since - self.first_block)
        ids = {b for row in self.block_ids for b in row[lo:] if b >= 0}
        # a state is written once all the KV of the hit is: with any of it missing, so is the state
        return ids | {b for row in self.state_ids for b in row} if ids else ids


@dataclass
class SaveSpec:
    """Store the vLLM blocks `block_ids[group]` (`ratio` per tier block, in order; -1: zeros,
    a sliding window's tokens that are gone) under consecutive tier keys `keys[rank]`, the first
    chained to `parents[rank]`; and (models with recurrent state) the state pages of blocks
    `state_ids` under `state_keys[rank]` in the state namespace."""

    salt: str
    keys: list[list[bytes]]
    parents: list[bytes | None]
    block_ids: list[list[int]]   # per KV group (`KVGroups.kv`)
    token_ids: list[int] | None = None   # the blocks' tokens, for tierd's KV events
    state_keys: list[bytes] = field(default_factory=list)   # per rank: a recurrent state to store
    state_ids: list[int] = field(default_factory=list)      # per state group: its vLLM block


@dataclass
class TierdConnectorMetadata(KVConnectorMetadata):
    loads: list[LoadSpec] = field(default_factory=list)
    saves: list[SaveSpec] = field(default_factory=list)
    # the scheduler half's time in vLLM's scheduler hooks since the last metadata (lookups,
    # planning): the workers add it to their `sched_s`, so that one place counts what the
    # connector costs the engine's step
    sched_s: float = 0.0
    # (new tokens, tokens computed before them) per request this step computes: the workers
    # time the step's forward for the cost model's recompute estimate (tierd/costs.py)
    forward: list = field(default_factory=list)
