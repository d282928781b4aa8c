"""The tier interface: what every tier (host, disk, gpu; remote next) offers the store.

A tier is storage and nothing else: slots carved from its capacity (slabs of one slot size
each, memcached-style, see `tierd.arena.SlabAllocator`), and the bytes in them. It never
decides what to keep, evict or move (the store's index, pins and policy do), never takes the
store's lock, and keeps two kinds of calls apart:

- **slot calls** (`alloc_slot`, `free_slot`, `release_slab`, `check_block`, `usage`) are made
  with the store lock held: they touch memory only, never a file, a device or the network;
- **data calls** (`write`, `read`, `flush`, `close`) are made without the lock, on slots the
  store has pinned for the call, and may block on I/O for as long as the hardware takes.

Adding a tier means writing one module with a `Tier` subclass; the store holds one residency
record per tier (which block owns each slot, the tier's eviction order, its counters) and moves
blocks between tiers through this interface only.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..arena import SlabAllocator
from ..config import align_up
from ..errors import CapacityError


@dataclass(slots=True, frozen=True)
class BlockMeta:
    """What a tier that describes its own contents (disk, remote) writes beside a block."""

    ns_id: bytes
    key: bytes
    parent: bytes | None
    block_bytes: int
    dtype_bytes: int
    lossy: str = ""          # the namespace's lossy codec (disk and remote), "" = exact
    kv_dtype: str = ""       # the block's element type (lossy codecs need it)
    # The copy's write sequence number (disk), taken by the store under its lock when it chose
    # the slot (0: the tier takes one as it writes). A flush's fence is taken under the same
    # lock, so a copy chosen before a flush is always below its fence, however late it lands.
    seq: int = 0


class Tier:
    """Base of every tier. Subclasses set `name`, `capacity_bytes` and `alloc`, and implement
    the data calls they support."""

    name: str = ""
    capacity_bytes: int = 0
    alloc: SlabAllocator

    # -- slot calls (store lock held; no I/O) --------------------------------------------------
    def slot_bytes_for(self, block_bytes: int) -> int:
        """Size of the slot a block of `block_bytes` takes here (4096-aligned)."""
        return align_up(block_bytes)

    def check_block(self, block_bytes: int, whose: str = "") -> int:
        """The slot size of such a block; CapacityError if it can never fit this tier."""
        sb = self.slot_bytes_for(block_bytes)
        if sb > self.capacity_bytes:
            raise CapacityError(
                f"{self.name} tier: capacity {self.capacity_bytes} bytes is smaller than one block "
                f"{whose}({block_bytes} bytes); raise {self.name}_bytes")
        self.alloc.check_slot_bytes(sb, f"{self.name} tier")
        return sb

    def alloc_slot(self, slot_bytes: int) -> int | None:
        """A free slot of `slot_bytes` (taking a free slab if needed), or None when full."""
        return self.alloc.alloc(slot_bytes)

    def free_slot(self, slot: int) -> None:
        self.alloc.free(slot)

    def release_slab(self, slab: int) -> None:
        """Give an empty slab back to the free pool (so another slot size can take it)."""
        self.alloc.release_slab(slab)

    def offset(self, slot: int) -> int:
        return self.alloc.offset(slot)

    def usage(self) -> dict:
        """Capacity and occupancy, as `tierd stats` shows them for every tier."""
        a = self.alloc
        return {"capacity_bytes": self.capacity_bytes, "used_bytes": a.used_bytes,
                "free_bytes": self.capacity_bytes - a.used_bytes, "slab_bytes": a.slab_bytes,
                "waste_bytes": a.waste_bytes()}

    # -- data calls (no lock; the store has pinned the slot) ---------------------------------------
    def write(self, slot: int, src: np.ndarray, meta: BlockMeta):
        """Store the block `src` ((block_bytes,) uint8) in `slot`; returns where it is (what
        `read` takes). Not durable before `flush`, for tiers where that means anything."""
        raise NotImplementedError

    def read(self, where, dst: np.ndarray) -> None:
        """Copy a block written by `write` into `dst`, verified where the tier can verify."""
        raise NotImplementedError

    def flush(self) -> None:
        """Make every completed write durable (a no-op for memory tiers)."""

    def descriptor(self) -> dict | None:
        """What another process needs to map this tier's slots, or None if it cannot."""
        return None

    def close(self) -> None:
        """Release the tier's memory, files or connections."""
