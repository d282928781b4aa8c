"""The host tier: a shared-memory arena carved into slab-class slots.

Owns the arena's memory and its slot allocator; never decides what to evict (the store does)
and never copies a block on its own.
"""

from __future__ import annotations

import numpy as np

from ..arena import SharedArena, SlabAllocator, plan_slabs
from ..config import ALIGN
from .base import BlockMeta, Tier


class HostTier(Tier):
    name = "host"

    def __init__(self, capacity_bytes: int, slab_bytes: int, *, shm_path: str | None = None,
                 shm_mode: int = 0o600):
        capacity_bytes = capacity_bytes // ALIGN * ALIGN
        num_slabs, slab_bytes = plan_slabs(capacity_bytes, slab_bytes, "host tier")
        self.capacity_bytes = capacity_bytes
        self.arena = SharedArena(capacity_bytes, path=shm_path, mode=shm_mode)
        self.alloc = SlabAllocator(num_slabs, slab_bytes, capacity_bytes=capacity_bytes)

    def view(self, slot: int, nbytes: int) -> np.ndarray:
        """(nbytes,) uint8 view of a slot; nbytes <= the slot's size. Clients write into and
        read out of these directly (the zero-copy data plane); `write`/`read` are the copies."""
        return self.arena.view(self.alloc.offset(slot), nbytes)

    def write(self, slot: int, src: np.ndarray, meta: BlockMeta) -> int:
        np.copyto(self.view(slot, meta.block_bytes), src[:meta.block_bytes])
        return slot

    def read(self, slot: int, dst: np.ndarray) -> None:
        np.copyto(dst, self.view(slot, dst.nbytes))

    def descriptor(self) -> dict:
        """What another process needs to map this arena."""
        return {"tier": "host", "path": self.arena.path, "capacity_bytes": self.capacity_bytes,
                "slab_bytes": self.alloc.slab_bytes}

    def close(self) -> None:
        self.arena.close()
