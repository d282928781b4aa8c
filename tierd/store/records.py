"""Block and namespace records: what the store knows of each block, and the states a block
goes through. Memory only; every field is guarded by the store's lock.

Invariants (the tests, the model test and the crash harness hold the store to them):

- **Pins.** `host_pins > 0` (a lease, a copy to disk or HBM in flight): the host slot is neither
  freed nor reused, so its bytes stay the block's. `disk_pins > 0` (a read in flight): the disk
  copy is not evicted. `gpu_pins > 0` (a lease, or the copy into HBM in flight): the HBM slot
  stays.
- **States.** In host RAM a block is ABSENT, RESERVED (a writer's slot, invisible, owned by one
  reservation), LOADING (a read into its slot in flight, invisible to acquire until READY,
  counted by lookup) or READY (servable). On disk it has a copy (`disk`, an index entry whose
  header and payload were written and are read back only through checksums) or a write in
  flight (`disk_writing`, host copy pinned).
- **What is served.** Only READY host slots are leased; a disk or remote copy reaches a client
  only by being read into a host slot and verified first.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..namespace import Namespace
from ..tiers.base import BlockMeta
from ..tiers.disk import DiskEntry

# host_state of a block
ABSENT, RESERVED, LOADING, READY = 0, 1, 2, 3
REMOTE = "remote"   # in an acquire's plan: a block fetched from the remote tier
DOOM_HOST, DOOM_DISK = 1, 2   # Block.doomed: which copies a flush has dropped

class WouldBlock(Exception):
    """(Internal.) An operation asked to run `inline` (on the daemon's event loop thread) would
    need I/O or a wait: nothing was changed; run it on a worker thread instead."""


@dataclass(slots=True)
class NsState:
    """A namespace as the store knows it; `ns` is None for one known only from disk."""

    ns_id: bytes
    ns: Namespace | None
    block_bytes: int
    dtype_bytes: int
    host_slot_bytes: int
    disk_slot_bytes: int
    desc: dict
    records: int = 0          # its blocks in the store's index (any state)
    staged: int = 0           # host slots staged for it (ownership.py): a put will name them
    forgotten: bool = False   # dropped from the table while unused (namespaces.py)
    label: str = ""           # display name its clients gave it (Namespace.label), for stats
    counters: dict = field(default_factory=lambda: dict.fromkeys(
        ("puts", "put_bytes", "put_dropped", "hits", "hit_bytes", "misses", "lookups",
         "host_blocks", "disk_blocks"), 0))

    @property
    def name(self) -> str:
        return self.ns_id.hex()[:16]

    @property
    def lossy(self) -> str:
        """The namespace's lossy tier codec ("" = exact everywhere)."""
        return self.desc.get("tier_codec", "")

    def meta(self, key: bytes, parent: bytes | None, *, exact: bool = False, seq: int = 0) -> BlockMeta:
        """How a block of this namespace is written to a tier; `exact`: never with the lossy
        codec (its bytes were decoded from a lossy copy already: a second quantisation would
        compound the error past the codec's bound); `seq`: the disk copy's sequence number."""
        return BlockMeta(self.ns_id, key, parent, self.block_bytes, self.dtype_bytes,
                         "" if exact else self.lossy, self.desc.get("kv_dtype", ""), seq)


@dataclass(slots=True, eq=False)
class Block:
    """One block known to the store. Invariant: present in the block index iff it has a host slot
    (any state) or a disk copy or a disk write in flight, and is not an orphan."""

    ikey: bytes                 # ns_id + key: the index key
    st: NsState
    key: bytes
    parent: bytes | None = None  # ikey of the previous block of its chain, if known
    host_slot: int = -1
    host_state: int = ABSENT
    host_pins: int = 0           # leases + copies/writes in flight from the host slot
    owner_res: int = 0           # reservation id while RESERVED
    disk: DiskEntry | None = None
    disk_writing: bool = False
    disk_pins: int = 0           # reads in flight from the disk slot
    host_children: int = 0       # resident descendants (one level) per tier: evict those first
    disk_children: int = 0
    hits: int = 0
    gpu_slot: int = -1           # copy in the HBM tier (always beside a host copy), or -1
    gpu_pins: int = 0            # leases reading the HBM copy
    gpu_filling: bool = False    # its HBM copy is being made (outside the lock): not served yet
    decoded: bool = False        # its host bytes were decoded from a lossy copy: written exact
    csum: int = -1               # checksum of its host bytes, given with them when they became
    #                              READY (the writer hashed them as it copied), else -1: the
    #                              keeper computes it (`keeping.py`)
    doomed: int = 0              # copies a flush dropped while pinned (DOOM_HOST | DOOM_DISK):
    #                              never served again, dropped when their pins go (`BlockIndex.reap`)
    clean: int = -1              # READY in host RAM: 1 with a disk copy (evicting it needs no
    #                              I/O), 0 without (`BlockIndex.dirty`); -1 not READY in host RAM
    orphan: bool = False         # a doomed block whose key was written again meanwhile: out of
    #                              the block index, the shared index and the policy; its pinned
    #                              slot is freed when its pins go, nothing else
    #                              (`BlockIndex.retire_doomed`)


# What a block's fields say about it (the store's lock held to read them).

def host_servable(b: Block) -> bool:
    """A new reader is served `b`'s host copy: READY, and no flush dropped it."""
    return b.host_state == READY and not b.doomed & DOOM_HOST


def disk_servable(b: Block) -> bool:
    """A new reader is served `b`'s disk copy (read up first): there, and no flush dropped it."""
    return b.disk is not None and not b.doomed & DOOM_DISK


def has_copy(b: Block) -> bool:
    """`b` holds a host slot (any state), a disk copy, or a disk write in flight."""
    return b.host_state != ABSENT or b.disk is not None or b.disk_writing


def host_evictable(b: Block) -> bool:
    """`b`'s host copy may be dropped now: READY, unpinned, not being written down."""
    return b.host_state == READY and b.host_pins == 0 and not b.disk_writing


def disk_evictable(b: Block) -> bool:
    """`b`'s disk copy may be dropped now: there, and no read pins it."""
    return b.disk is not None and b.disk_pins == 0


def unsynced(b: Block) -> bool:
    """A host-only block that a sync or a demotion would write to disk (not one a flush
    dropped while it was leased: written down, it would come back as a disk copy)."""
    return b.host_state == READY and not b.doomed & DOOM_HOST and b.disk is None and not b.disk_writing
