"""The block index and residency bookkeeping: block records, chain links, what each tier
holds, and the shared lookup index the daemon publishes. Memory only, always under the store's
lock.

Invariants: a block is in `_blocks` iff it has a host slot (any state), a disk copy or a disk
write in flight (`_forget_if_gone`); `st.records` counts a namespace's records; a READY block is
in its tier's eviction order, a RESERVED or LOADING one is not; resident-children counts may
under-estimate after a parent is re-created, never over-estimate (eviction order only)."""

from __future__ import annotations

import time
from collections.abc import Sequence

from .records import ABSENT, DOOM_DISK, DOOM_HOST, LOADING, READY, Block, NsState


class BlockIndex:
    """Part of `TieredStore` (see its docstring): state and lock are the store's."""

    def _link(self, b: Block, parent_ikey: bytes | None) -> None:
        if parent_ikey is None or b.parent is not None or parent_ikey == b.ikey:
            return
        b.parent = parent_ikey
        p = self._blocks.get(parent_ikey)
        if p is not None:
            p.host_children += b.host_state == READY
            p.disk_children += b.disk is not None

    def _relink(self, pid: bytes, keys: Sequence[bytes], parent: bytes | None) -> None:
        """A chain seen again (existing blocks) is linked for eviction order too."""
        for i, k in enumerate(keys):
            b = self._blocks.get(pid + k)
            if b is not None and b.parent is None:
                self._link(b, pid + keys[i - 1] if i else (pid + parent if parent else None))

    def attach_index(self, index) -> None:
        """Publish every block's presence in `index` (a tierd.index.SharedIndex) from now on."""
        with self._cond:
            self._index = index
            self._health.index = index   # told whether a stalled disk's copies count
            for b in self._blocks.values():
                self._publish(b)
            self._health.note_stall()

    SCAN_CHUNK = 2048     # most blocks an O(N) walk handles per hold of the lock
    SCAN_HOLD_S = 0.002   # and the longest it holds the lock at a time
    SCAN_YIELD_S = 5e-5   # how long it stays out between holds, so that a waiter gets the lock

    def _each_block(self, fn, ns_id: bytes | None = None) -> None:
        """Call `fn(block)` (lock held) for every block indexed now, a chunk at a time: the lock
        is held for at most `SCAN_CHUNK` blocks or `SCAN_HOLD_S`, whichever comes first, then
        let go for `SCAN_YIELD_S`, so an O(N) walk (snapshots, flushes, syncs) never keeps
        other callers out for more than a few milliseconds. (Letting go and taking the lock at
        once is not enough: `threading.Lock` is not fair, and the walker, already running,
        takes it again before a woken waiter is scheduled.) A block that leaves meanwhile is
        skipped; one that comes meanwhile may be missed."""
        with self._cond:
            ikeys = list(self._blocks)   # one C-level copy of the keys
        i, n, clock = 0, len(ikeys), time.perf_counter
        while i < n:
            with self._cond:
                self._check_open()
                deadline = clock() + self.SCAN_HOLD_S
                end = min(n, i + self.SCAN_CHUNK)
                while i < end:
                    for ikey in ikeys[i:min(end, i + 64)]:
                        b = self._blocks.get(ikey)
                        if b is not None and (ns_id is None or b.st.ns_id == ns_id):
                            fn(b)
                    i = min(end, i + 64)
                    if clock() >= deadline:
                        break
            if i < n:
                time.sleep(self.SCAN_YIELD_S)

    def _publish(self, b: Block) -> None:
        """(Lock held.) Publish `b`'s state in the shared index. Called wherever it changes —
        in particular in the same hold of the lock that frees its host slot (`_drop_host`):
        clients read published host slots without a lease (tierd/index.py)."""
        if self._index is not None and not b.orphan:   # an orphan's key is another block's
            host = self._host_servable(b)
            self._index.set(b.st.ns_id, b.key, host | (self._disk_servable(b) << 1)
                            | ((b.host_state == LOADING and not b.doomed & DOOM_HOST) << 2),
                            self.host.offset(b.host_slot) if host else -1)

    @staticmethod
    def _host_servable(b: Block) -> bool:
        return b.host_state == READY and not b.doomed & DOOM_HOST

    @staticmethod
    def _disk_servable(b: Block) -> bool:
        return b.disk is not None and not b.doomed & DOOM_DISK

    def _doom(self, b: Block, copies: int) -> None:
        """(Lock held.) A flush dropped these copies of `b` while they are pinned (leased, being
        read or written): from now on they are not served, and they go when their pins do."""
        b.doomed |= copies
        if copies & DOOM_HOST:
            self._keep_forget(b)   # a flushed block never comes back after a restart
        self._publish(b)
        self._reap(b)

    def _retire_doomed(self, b: Block) -> bool:
        """(Lock held.) Before a write of `b`'s key (`b` the block `_blocks` holds for it): if a
        flush dropped every copy of `b` while they were pinned — a host copy leased, being
        recorded or being read up (LOADING), a disk copy being read, a disk write in flight
        (which the flush's fence discards when it lands) — `b` leaves the key now: an orphan,
        out of `_blocks`, the policies, the tiers' counts and the shared index, whose slots are
        freed when its pins go (`_drop_host`, `_drop_disk`). The write then goes ahead. Else it
        would find the key present and skip it, and the doomed copies would go after: the key
        lost right after a put that said it was stored. False, changing nothing, while `b` has
        a copy no flush dropped (or an HBM copy)."""
        if not b.doomed or b.gpu_slot >= 0:
            return False
        host = b.host_state == ABSENT or (b.doomed & DOOM_HOST and b.host_state in (READY, LOADING))
        disk = (b.disk is None and not b.disk_writing) or b.doomed & DOOM_DISK
        if not (host and disk):
            return False
        if b.host_state == READY:                  # (a LOADING copy never entered)
            self._rh.policy.remove(b.ikey, evicted=False)
            self._leave(b, "host")
        if b.disk is not None:
            self._rd.policy.remove(b.ikey, evicted=False)
            self._leave(b, "disk")
        b.orphan = True
        del self._blocks[b.ikey]
        b.st.records -= 1
        return True

    def _reap(self, b: Block) -> None:
        """(Lock held.) Drop the doomed copies of `b` whose pins are gone; called wherever a pin
        of a block ends."""
        if not b.doomed:
            return
        if b.doomed & DOOM_HOST and (b.host_state == ABSENT or self._host_evictable(b)):
            b.doomed &= ~DOOM_HOST
            if b.host_state != ABSENT:
                self._drop_host(b, evicted=False)
        # (a write in flight keeps the mark: the fence discards what it writes when it lands)
        if b.doomed & DOOM_DISK and not b.disk_writing and (b.disk is None or b.disk_pins == 0):
            b.doomed &= ~DOOM_DISK
            if b.disk is not None:
                self._drop_disk(b, evicted=False)

    def _enter(self, b: Block, tier: str, event: bool = True) -> None:
        self._publish(b)
        if self._feed.on and event:
            self._feed.event(b, tier, True)
        p = self._blocks.get(b.parent) if b.parent else None
        if tier == "host":
            self._keep_note(b)
            self._mark_clean(b, 1 if b.disk is not None else 0)
            b.st.counters["host_blocks"] += 1
            self._pad_bytes += b.st.host_slot_bytes - b.st.block_bytes
            if p is not None:
                p.host_children += 1
        else:
            if b.clean == 0:
                self._mark_clean(b, 1)
            b.st.counters["disk_blocks"] += 1
            if p is not None:
                p.disk_children += 1

    def _leave(self, b: Block, tier: str) -> None:
        # Counts may under-estimate after a parent is re-created, never over-estimate: a
        # wrong count can reorder eviction but never pin a block forever.
        if self._feed.on:
            self._feed.event(b, tier, False)
        p = self._blocks.get(b.parent) if b.parent else None
        if tier == "host":
            self._mark_clean(b, -1)
            b.st.counters["host_blocks"] -= 1
            self._pad_bytes -= b.st.host_slot_bytes - b.st.block_bytes
            if p is not None and p.host_children > 0:
                p.host_children -= 1
        else:
            if b.clean == 1:
                self._mark_clean(b, 0)
            b.st.counters["disk_blocks"] -= 1
            if p is not None and p.disk_children > 0:
                p.disk_children -= 1

    def _mark_clean(self, b: Block, clean: int) -> None:
        """(Lock held.) `b.clean` becomes `clean` (1: READY in host RAM with a disk copy,
        0: without one, -1: not READY in host RAM); `_dirty` and the byte counts follow.
        Invariants: `_dirty` holds exactly the blocks whose `clean` is 0, in the order they
        became so, and `_dirty_bytes` sums their host slots; `_clean_bytes` sums the host
        slots of those whose `clean` is 1."""
        old = b.clean
        if old == clean:
            return
        if old == 1:
            self._clean_bytes -= b.st.host_slot_bytes
        elif old == 0:
            self._dirty_bytes -= b.st.host_slot_bytes
            if self._dirty.get(b.ikey) is b:
                del self._dirty[b.ikey]
        if clean == 1:
            self._clean_bytes += b.st.host_slot_bytes
        elif clean == 0:
            self._dirty_bytes += b.st.host_slot_bytes
            self._dirty[b.ikey] = b
        b.clean = clean

    def _new_block(self, ikey: bytes, st: NsState, key: bytes) -> Block:
        """(Lock held.) Index a new block record. Invariant: `st.records` counts the records
        of `st` in `_blocks`, and `st` is the table's state of its namespace
        (`NamespaceTable.live`)."""
        st = self._namespaces.live(st)
        b = self._blocks[ikey] = Block(ikey, st, key)
        st.records += 1
        return b

    @staticmethod
    def _has_copy(b: Block) -> bool:
        """`b` holds a host slot (any state), a disk copy, or a disk write in flight."""
        return b.host_state != ABSENT or b.disk is not None or b.disk_writing

    def _forget_if_gone(self, b: Block) -> None:
        if not self._has_copy(b):
            if self._blocks.get(b.ikey) is b:
                del self._blocks[b.ikey]
                b.st.records -= 1

    def _host_evictable(self, b: Block) -> bool:
        return b.host_state == READY and b.host_pins == 0 and not b.disk_writing

    def _disk_evictable(self, b: Block) -> bool:
        return b.disk is not None and b.disk_pins == 0

    def _drop_host(self, b: Block, *, evicted: bool) -> None:
        if b.gpu_slot >= 0:
            self._drop_gpu(b, evicted=False)   # inclusive: no HBM copy without the host copy
        if b.host_state == READY and not b.orphan:    # (an orphan left both when it became one)
            self._rh.policy.remove(b.ikey, evicted=evicted)
            self._leave(b, "host")
        self._rh.free(b.host_slot, evicted=evicted)
        b.host_slot, b.host_state = -1, ABSENT
        self._publish(b)
        self._forget_if_gone(b)

    def _drop_gpu(self, b: Block, *, evicted: bool) -> None:
        if self._feed.on:
            self._feed.event(b, "gpu", False)
        self._rg.policy.remove(b.ikey, evicted=evicted)
        self._rg.free(b.gpu_slot, evicted=evicted)
        b.gpu_slot = -1

    def _drop_disk(self, b: Block, *, evicted: bool, free: bool = True) -> None:
        """(Lock held.) Forget `b`'s disk copy; with `free=False` its slot stays taken until its
        header is erased on disk (`_tombstone`)."""
        if not b.orphan:                     # (an orphan left both when it became one)
            self._rd.policy.remove(b.ikey, evicted=evicted)
            self._leave(b, "disk")
        self._rd.free(b.disk.slot, evicted=evicted, free=free)
        b.disk = None
        self._publish(b)
        self._forget_if_gone(b)

    def _unindex_disk(self, b: Block) -> int:
        """(Lock held.) Take `b`'s disk copy out of the index for good; its slot stays taken
        until `_tombstone` has erased the header on disk (outside the lock). Returns the slot."""
        slot = b.disk.slot
        self._drop_disk(b, evicted=False, free=False)
        return slot

    @staticmethod
    def _unsynced(b: Block) -> bool:
        """A host-only block that a sync or a demotion would write to disk (not one a flush
        dropped while it was leased: written down, it would come back as a disk copy)."""
        return b.host_state == READY and not b.doomed & DOOM_HOST and b.disk is None and not b.disk_writing
