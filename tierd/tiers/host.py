"""The host tier: a shared-memory arena carved into slab-class slots.

Owns the arena's memory and its slot allocator, and (when it keeps its blocks across restarts)
the records file beside the arena (`host_records.py`): a slot's record is cleared before the
slot is freed. Never decides what to evict (the store does) and never copies a block on its own.
"""

from __future__ import annotations

import numpy as np

from ..arena import SharedArena, SlabAllocator, plan_slabs
from ..config import ALIGN
from ..errors import ConfigError
from .base import BlockMeta, Tier
from .host_records import HostRecords


class HostTier(Tier):
    name = "host"

    def __init__(self, capacity_bytes: int, slab_bytes: int, *, shm_path: str | None = None,
                 shm_mode: int = 0o600, keep: bool = False, reserve: bool | None = None):
        """`keep`: keep block records beside the arena (`shm_path` + ".rec") so that the next
        store at this path can re-adopt the blocks; `reserve=False`: reserve the arena's memory
        later (`arena.reserve_now`)."""
        capacity_bytes = capacity_bytes // ALIGN * ALIGN
        num_slabs, slab_bytes = plan_slabs(capacity_bytes, slab_bytes, "host tier")
        self.capacity_bytes = capacity_bytes
        self.arena = SharedArena(capacity_bytes, path=shm_path, mode=shm_mode, reserve=reserve)
        self.alloc = SlabAllocator(num_slabs, slab_bytes, capacity_bytes=capacity_bytes)
        self.records: HostRecords | None = None
        if keep:
            if shm_path is None:
                self.arena.close()
                raise ConfigError("host_keep needs host_shm_path: an anonymous arena dies with its process")
            try:
                self.records = HostRecords(records_path(shm_path), capacity_bytes, self.arena.identity(),
                                           mode=shm_mode)
            except BaseException:
                self.arena.close()
                raise

    def alloc_slot(self, slot_bytes: int) -> int | None:
        slot = self.alloc.alloc(slot_bytes)
        if slot is not None and self.records is not None:
            self.records.prepare(self.alloc.offset(slot))   # its block can be recorded at commit
        return slot

    def free_slot(self, slot: int) -> None:
        if self.records is not None:
            self.records.clear(self.alloc.offset(slot))
        self.alloc.free(slot)

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

    def close(self, *, keep: bool = False) -> None:
        """Unmap the arena; with `keep` (and records), its files stay for the next store."""
        keep = keep and self.records is not None
        if self.records is not None:
            self.records.close(keep=keep)
        self.arena.close(keep=keep)


def records_path(shm_path: str) -> str:
    """Where the block records of the host arena at `shm_path` are kept."""
    return shm_path + ".rec"
