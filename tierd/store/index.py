"""The block index: every block the store knows (`Block` records by ikey), their chain links,
which tiers hold them (entering and leaving a tier, dropping a copy, flushed copies), the
host copies' clean/dirty accounting, and the shared lookup index the daemon publishes. Memory
only; every method is called with the store's lock held."""

from __future__ import annotations

from collections.abc import Sequence

from ..policy import make_policy
from .records import (
    ABSENT,
    DOOM_DISK,
    DOOM_HOST,
    LOADING,
    READY,
    Block,
    NsState,
    disk_evictable,
    disk_servable,
    has_copy,
    host_evictable,
    host_servable,
)
from .residency import Resident


class BlockIndex:
    """The store's blocks and where each one is. Called with the store's lock held.

    Fields: `blocks` (ikey -> Block), the three tiers' residency records (`host`, `disk`,
    `gpu`: `Resident`, their tiers set by the store as it opens them), `dirty`, `clean_bytes`,
    `dirty_bytes` and `pad_bytes` (below), and `shared`, the daemon's shared lookup index
    (`tierd.index`, None until attached), in which every change of a block is published.
    Collaborators: the namespace table, the event feed, and `keeping` (the host block records,
    keeping.py: told when a host copy becomes READY or is flushed; set once by the store, as
    re-adoption needs this index first).

    Invariants:
    - a block is in `blocks` iff it has a host slot (any state), a disk copy or a disk write in
      flight (`forget_if_gone`), and is not an orphan; `st.records` counts a namespace's
      records, and `st` is the table's state of its namespace (`NamespaceTable.live`);
    - a READY block is in its tier's eviction order, a RESERVED or LOADING one is not;
    - resident-children counts may under-estimate after a parent is re-created, never
      over-estimate (they only order eviction: a wrong count never pins a block forever);
    - `dirty` holds exactly the blocks whose `clean` is 0 (READY in host RAM, no disk copy), in
      the order they became so, and `dirty_bytes` sums their host slots; `clean_bytes` sums
      the host slots of those whose `clean` is 1 (READY with a disk copy);
    - `pad_bytes` sums the slot padding (slot size - block size) of the blocks READY in host RAM;
    - a block's published state changes in the same hold of the lock as the block: clients
      read published host slots without a lease (tierd/index.py)."""

    def __init__(self, namespaces, feed, eviction_policy: str):
        self.blocks: dict[bytes, Block] = {}
        self.namespaces = namespaces
        self.feed = feed
        self.keeping = None
        self.host = Resident("host", make_policy(eviction_policy), self.blocks, slot_of=lambda b: b.host_slot,
                             children_of=lambda b: b.host_children, evictable=host_evictable)
        self.disk = Resident("disk", make_policy(eviction_policy), self.blocks, slot_of=lambda b: b.disk.slot,
                             children_of=lambda b: b.disk_children, evictable=disk_evictable)
        self.gpu = Resident("gpu", make_policy("lru"), self.blocks, slot_of=lambda b: b.gpu_slot,
                            children_of=lambda b: 0, evictable=lambda b: b.gpu_pins == 0)
        self.dirty: dict[bytes, Block] = {}
        self.clean_bytes = self.dirty_bytes = 0
        self.pad_bytes = 0
        self.shared = None

    def link(self, b: Block, parent_ikey: bytes | None) -> None:
        if parent_ikey is None or b.parent is not None or parent_ikey == b.ikey:
            return
        b.parent = parent_ikey
        p = self.blocks.get(parent_ikey)
        if p is not None:
            p.host_children += b.host_state == READY
            p.disk_children += b.disk is not None

    def relink(self, pid: bytes, keys: Sequence[bytes], parent: bytes | None) -> None:
        """A chain seen again (existing blocks) is linked for eviction order too."""
        for i, k in enumerate(keys):
            b = self.blocks.get(pid + k)
            if b is not None and b.parent is None:
                self.link(b, pid + keys[i - 1] if i else (pid + parent if parent else None))

    def publish(self, b: Block) -> None:
        """Publish `b`'s state in the shared index. Called wherever it changes — in particular
        in the same hold of the lock that frees its host slot (`drop_host`): clients read
        published host slots without a lease (tierd/index.py)."""
        if self.shared is not None and not b.orphan:   # an orphan's key is another block's
            host = host_servable(b)
            self.shared.set(b.st.ns_id, b.key, host | (disk_servable(b) << 1)
                            | ((b.host_state == LOADING and not b.doomed & DOOM_HOST) << 2),
                            self.host.tier.offset(b.host_slot) if host else -1)

    def doom(self, b: Block, copies: int) -> None:
        """A flush dropped these copies of `b` while they are pinned (leased, being read or
        written): from now on they are not served, and they go when their pins do."""
        b.doomed |= copies
        if copies & DOOM_HOST:
            self.keeping.forget(b)   # a flushed block never comes back after a restart
        self.publish(b)
        self.reap(b)

    def retire_doomed(self, b: Block) -> bool:
        """Before a write of `b`'s key (`b` the block `blocks` holds for it): if a flush dropped
        every copy of `b` while they were pinned — a host copy leased, being recorded or being
        read up (LOADING), a disk copy being read, a disk write in flight (which the flush's
        fence discards when it lands) — `b` leaves the key now: an orphan, out of `blocks`, the
        policies, the tiers' counts and the shared index, whose slots are freed when its pins go
        (`drop_host`, `drop_disk`). The write then goes ahead. Else it would find the key
        present and skip it, and the doomed copies would go after: the key lost right after a
        put that said it was stored. False, changing nothing, while `b` has a copy no flush
        dropped (or an HBM copy)."""
        if not b.doomed or b.gpu_slot >= 0:
            return False
        host = b.host_state == ABSENT or (b.doomed & DOOM_HOST and b.host_state in (READY, LOADING))
        disk = (b.disk is None and not b.disk_writing) or b.doomed & DOOM_DISK
        if not (host and disk):
            return False
        if b.host_state == READY:                  # (a LOADING copy never entered)
            self.host.policy.remove(b.ikey, evicted=False)
            self.leave(b, "host")
        if b.disk is not None:
            self.disk.policy.remove(b.ikey, evicted=False)
            self.leave(b, "disk")
        b.orphan = True
        del self.blocks[b.ikey]
        b.st.records -= 1
        return True

    def reap(self, b: Block) -> None:
        """Drop the doomed copies of `b` whose pins are gone; called wherever a pin of a block
        ends."""
        if not b.doomed:
            return
        if b.doomed & DOOM_HOST and (b.host_state == ABSENT or host_evictable(b)):
            b.doomed &= ~DOOM_HOST
            if b.host_state != ABSENT:
                self.drop_host(b, evicted=False)
        # (a write in flight keeps the mark: the fence discards what it writes when it lands)
        if b.doomed & DOOM_DISK and not b.disk_writing and (b.disk is None or b.disk_pins == 0):
            b.doomed &= ~DOOM_DISK
            if b.disk is not None:
                self.drop_disk(b, evicted=False)

    def enter(self, b: Block, tier: str, event: bool = True) -> None:
        """`b`'s copy in `tier` ("host" or "disk") is in place: published, counted, recorded."""
        self.publish(b)
        if self.feed.on and event:
            self.feed.event(b, tier, True)
        p = self.blocks.get(b.parent) if b.parent else None
        if tier == "host":
            self.keeping.note(b)
            self.mark_clean(b, 1 if b.disk is not None else 0)
            b.st.counters["host_blocks"] += 1
            self.pad_bytes += b.st.host_slot_bytes - b.st.block_bytes
            if p is not None:
                p.host_children += 1
        else:
            if b.clean == 0:
                self.mark_clean(b, 1)
            b.st.counters["disk_blocks"] += 1
            if p is not None:
                p.disk_children += 1

    def leave(self, b: Block, tier: str) -> None:
        # Counts may under-estimate after a parent is re-created, never over-estimate: a
        # wrong count can reorder eviction but never pin a block forever.
        if self.feed.on:
            self.feed.event(b, tier, False)
        p = self.blocks.get(b.parent) if b.parent else None
        if tier == "host":
            self.mark_clean(b, -1)
            b.st.counters["host_blocks"] -= 1
            self.pad_bytes -= b.st.host_slot_bytes - b.st.block_bytes
            if p is not None and p.host_children > 0:
                p.host_children -= 1
        else:
            if b.clean == 1:
                self.mark_clean(b, 0)
            b.st.counters["disk_blocks"] -= 1
            if p is not None and p.disk_children > 0:
                p.disk_children -= 1

    def mark_clean(self, b: Block, clean: int) -> None:
        """`b.clean` becomes `clean` (1: READY in host RAM with a disk copy, 0: without one,
        -1: not READY in host RAM); `dirty` and the byte counts follow (see the invariants)."""
        old = b.clean
        if old == clean:
            return
        if old == 1:
            self.clean_bytes -= b.st.host_slot_bytes
        elif old == 0:
            self.dirty_bytes -= b.st.host_slot_bytes
            if self.dirty.get(b.ikey) is b:
                del self.dirty[b.ikey]
        if clean == 1:
            self.clean_bytes += b.st.host_slot_bytes
        elif clean == 0:
            self.dirty_bytes += b.st.host_slot_bytes
            self.dirty[b.ikey] = b
        b.clean = clean

    def new_block(self, ikey: bytes, st: NsState, key: bytes) -> Block:
        """Index a new block record (of the table's state of `st`'s namespace)."""
        st = self.namespaces.live(st)
        b = self.blocks[ikey] = Block(ikey, st, key)
        st.records += 1
        return b

    def adopt_recovered(self, disk) -> None:
        """Index the blocks `disk` (a disk tier just opened) found at open, oldest first in
        eviction order. (Lock held, or at the store's own open, before anyone else has it.)"""
        adopted = []
        for e in sorted(disk.recovered, key=lambda e: e.seq):
            st = self.namespaces.get(e.ns_id) or self.namespaces.recovered(e.ns_id, e.raw_len,
                                                                           disk.namespaces.get(e.ns_id, {}))
            b = self.blocks.get(e.ns_id + e.key)
            if b is not None:
                # a reopened directory: this node still holds the block in RAM; the copy on disk
                # joins it (the old disk tier's copies were forgotten with it)
                if b.disk is not None or b.disk_writing:
                    disk.free_slot(e.slot)
                    continue
            else:
                b = self.new_block(e.ns_id + e.key, st, e.key)
                b.parent = (e.ns_id + e.parent) if e.parent else None
            b.disk = e
            adopted.append(b)
            self.publish(b)
            self.disk.owner[e.slot] = b
            self.disk.policy.insert(b.ikey)
            if b.clean == 0:
                self.mark_clean(b, 1)          # a host block that has a disk copy again
            b.st.counters["disk_blocks"] += 1
        for b in adopted:
            p = self.blocks.get(b.parent) if b.parent else None
            if p is not None:
                p.disk_children += 1
        disk.recovered = []

    def forget_if_gone(self, b: Block) -> None:
        if not has_copy(b):
            if self.blocks.get(b.ikey) is b:
                del self.blocks[b.ikey]
                b.st.records -= 1

    def drop_host(self, b: Block, *, evicted: bool) -> None:
        if b.gpu_slot >= 0:
            self.drop_gpu(b, evicted=False)   # inclusive: no HBM copy without the host copy
        if b.host_state == READY and not b.orphan:    # (an orphan left both when it became one)
            self.host.policy.remove(b.ikey, evicted=evicted)
            self.leave(b, "host")
            if evicted and self.shared is not None:
                self.shared.note_eviction()   # readers pin what they copy for a while (tierd/index.py)
        self.host.free(b.host_slot, evicted=evicted)
        b.host_slot, b.host_state = -1, ABSENT
        self.publish(b)
        self.forget_if_gone(b)

    def drop_gpu(self, b: Block, *, evicted: bool) -> None:
        if self.feed.on:
            self.feed.event(b, "gpu", False)
        self.gpu.policy.remove(b.ikey, evicted=evicted)
        self.gpu.free(b.gpu_slot, evicted=evicted)
        b.gpu_slot = -1

    def drop_disk(self, b: Block, *, evicted: bool, free: bool = True) -> None:
        """Forget `b`'s disk copy; with `free=False` its slot stays taken until its header is
        erased on disk (`Promotion.tombstone`)."""
        if not b.orphan:                     # (an orphan left both when it became one)
            self.disk.policy.remove(b.ikey, evicted=evicted)
            self.leave(b, "disk")
        self.disk.free(b.disk.slot, evicted=evicted, free=free)
        b.disk = None
        self.publish(b)
        self.forget_if_gone(b)

    def forget_disk(self, policy) -> None:
        """The disk tier's files are gone: every disk copy is forgotten, and the disk's
        residency record starts afresh, `policy` its eviction order."""
        for b in [b for b in self.blocks.values() if b.disk is not None]:
            self.drop_disk(b, evicted=False)
        for b in self.disk.owner.values():
            if b.orphan:
                # a doomed copy a read still pins, whose key was written again (out of
                # `blocks`): it goes with the old tier; when its pin goes nothing is left to drop
                b.disk = None
        self.disk.owner.clear()
        self.disk.policy = policy

    def unindex_disk(self, b: Block) -> int:
        """Take `b`'s disk copy out of the index for good; its slot stays taken until its
        header is erased on disk (outside the lock). Returns the slot."""
        slot = b.disk.slot
        self.drop_disk(b, evicted=False, free=False)
        return slot
