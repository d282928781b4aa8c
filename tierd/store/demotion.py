"""Demotion: making room in host RAM by writing blocks down to disk (and evicting), the
background demoter, and `sync`'s durable writes. Writes run outside the store lock on pinned
blocks; one write batch at a time keeps each batch one sequential run."""

from __future__ import annotations

import logging
import threading
import time

from ..config import format_size
from ..errors import DiskDegradedError, DiskTierError
from ..tiers.disk import DiskEntry
from ..policy import AdmissionFilter
from .lock import SCAN_CHUNK, SCAN_YIELD_S
from .records import DOOM_DISK, DOOM_HOST, READY, Block, NsState, disk_evictable, host_evictable, unsynced

log = logging.getLogger("tierd.store")


class FlushWalk:
    """A flush under way (`TieredStore.flush`), as the rest of the store sees it. It drops what
    its scope (a namespace, or all: `ns_id` None) held when it began; its walk lets go of the
    lock between chunks, so puts land meanwhile. Those are not its to drop: every block of its
    scope committed after it began goes into `born` (`TieredStore._commit_locked`), and the walk skips
    them. A `fenced` flush (disk or all) also holds back the write-down of the blocks of its
    scope it may still walk, all but `born` (`Demotion._flush_hold`); `drops_host`: it drops
    host copies too (host or all). Guarded by the store's lock."""

    __slots__ = ("ns_id", "fenced", "drops_host", "born")

    def __init__(self, ns_id: bytes | None, *, fenced: bool, drops_host: bool):
        self.ns_id, self.fenced, self.drops_host = ns_id, fenced, drops_host
        self.born: set[Block] = set()

    def covers(self, b: Block) -> bool:
        return self.ns_id is None or b.st.ns_id == self.ns_id


class Demotion:
    """Writing blocks down: room in host RAM (and HBM, and disk) made in policy order, host
    blocks written to disk ahead of need or as they are evicted, the demoter's passes, and
    `sync`'s durable writes.

    Fields: `admission` (the SSD admission filter), `writes_in_flight` (disk writes of the
    current disk tier under way), `batch_writing` (a write batch is under way: one at a time,
    so each batch is one sequential run and blocks reach the disk's eviction order in the order
    they were chosen), `disk_epoch` (changes when the disk tier's copies are forgotten:
    `forget_writes`), `flushing` (the flushes under way: `FlushWalk`), `flushes_begun` (fenced
    flushes begun so far: a sync re-plans after one), `syncing` (one set per sync under way:
    the blocks whose disk copy or write a flush dropped meanwhile), all guarded by the store's
    lock; and `wanted`, an event set when host RAM is past its high watermark (the demoter is
    woken for a pass).
    Collaborators: the store's lock (`cond`: `StoreLock`), the block index (the blocks, their
    residency records and tiers), the disk's health, the store's config, and `walk(fn)`, the
    store's chunked walk over its blocks.

    Invariants: a block being written down is pinned in host RAM (`host_pins`, `disk_writing`)
    and its write's sequence number is taken under the lock when its slot is chosen, so a flush
    that comes meanwhile fences it; no write-down of a block a fenced flush has yet to walk
    starts (`_flush_hold`); a write that returns after its tier's directory vanished settles
    as the dead tier's (`disk_epoch`); no write runs under the lock, and a stalled disk is
    never waited for."""

    WRITE_BATCH = 32  # blocks per parallel disk write batch (bounded by the I/O pool)
    CLEAN_DISK_SHARE = 0.5   # most of the disk tier that copies of host blocks written ahead may fill
    ALLOC_WAIT_S = 5.0  # longest a put waits for in-flight disk writes to free host room
    SYNC_WAIT_S = 30.0   # longest a sync waits for flushes under way to let it write their scope
    HELD_DROP, HELD_KEEP = 1, 2   # (`_flush_hold`)

    def __init__(self, cond, index, health, config, *, walk):
        self.cond = cond
        self.index = index
        self.health = health
        self.config = config
        self.walk = walk
        self.admission = AdmissionFilter(config.disk_admit_min_hits)
        self.writes_in_flight = 0
        self.batch_writing = False
        self.disk_epoch = 0
        self.flushing: list[FlushWalk] = []
        self.flushes_begun = 0
        self.syncing: list[set[Block]] = []
        # set when a pass is wanted (and when the store closes): what the maintainer waits on, not
        # the store's condition, whose `notify_all` on every lease, release and commit would
        # otherwise wake it each time (and it would queue for the lock the notifier holds)
        self.wanted = threading.Event()

    @property
    def host(self):
        """The host tier."""
        return self.index.host.tier

    @property
    def disk(self):
        """The disk tier, or None."""
        return self.index.disk.tier

    def forget_writes(self) -> None:
        """(Lock held.) The disk tier's directory vanished: the writes under way are not waited
        for (one may hang for ever); they settle as the dead tier's when they return."""
        self.disk_epoch += 1
        self.writes_in_flight = 0
        self.batch_writing = False

    def host_alloc(self, st: NsState) -> int | None:
        """A free host slot for `st`, evicting (demoting) in policy order if needed.
        Lock held; may release it during disk writes."""
        deadline = None

        def wait() -> bool:
            # Everything evictable is being written to disk right now: wait for those writes
            # (bounded, and never for a stalled disk) rather than drop the block.
            nonlocal deadline
            if not self.writes_in_flight or self.health.waiting():
                return False
            deadline = deadline or time.monotonic() + self.ALLOC_WAIT_S
            if time.monotonic() >= deadline:
                return False
            self.cond.wait(min(0.05, deadline - time.monotonic()))
            return True

        return self.index.host.alloc(st.host_slot_bytes, self._evict_host, wait)

    def _evict_host(self, b: Block) -> bool:
        """(Lock held; let go during a write-down.) Remove `b` from host RAM: drop it if its disk copy is valid, else write it down
        (if admitted) first. Returns True if the host slot was freed."""
        if self.disk is not None and b.disk is None and not b.disk_writing:
            if self.admission.admit(b.hits):
                if self._flush_hold(b) == self.HELD_KEEP:
                    # a disk flush holds its write back but keeps its host copy: dropped now,
                    # unwritten, it would be lost; the flush's walk is short (bounded wait)
                    self._wait_for_flushes(time.monotonic() + self.ALLOC_WAIT_S, b)
                self._write_down(b)
            else:
                self.index.disk.counters["admission_rejected"] += 1
        if host_evictable(b):
            self.index.drop_host(b, evicted=True)
            return True
        return False

    def gpu_alloc(self, st: NsState) -> int | None:
        """(Lock held.) An HBM slot for a block of `st`, making room in policy order."""
        return self.index.gpu.alloc(st.host_slot_bytes, lambda b: self.index.drop_gpu(b, evicted=True))

    def _disk_alloc(self, st: NsState) -> int | None:
        """(Lock held.) A disk slot for a block of `st`, making room in policy order."""
        return self.index.disk.alloc(st.disk_slot_bytes, lambda b: self.index.drop_disk(b, evicted=True))

    def _write_down(self, b: Block) -> bool:
        """(Lock held; let go during the write.) Copy one READY host block to disk (its host copy
        stays); see `_write_down_batch`."""
        self._write_down_batch([b])
        return b.disk is not None

    def _write_down_batch(self, blocks: list[Block]) -> int:
        """Copy READY host-only blocks to disk, in parallel on the I/O pool; host copies stay.
        Lock held on entry and exit, released during the writes. Returns blocks written."""
        # One batch at a time: blocks reach the disk tier (and its eviction order) in the
        # order they were chosen, and each batch's writes stay one sequential run. A stalled
        # disk is not waited for.
        while self.batch_writing:
            if self.health.waiting():
                return 0
            self.cond.wait(0.05)
        disk = self.disk
        if disk is None or disk.closed or self.health.waiting():
            return 0
        jobs = []
        remember: dict[bytes, dict] = {}
        flushing = self.flushing
        for b in blocks:
            if not unsynced(b):      # written meanwhile, or flushed while it waited
                continue
            if flushing and self._flush_hold(b):
                continue                   # a flush has yet to walk it (see `flush`)
            st = b.st
            slot = self._disk_alloc(st)   # no I/O: slab headers are queued
            if slot is None:
                break
            if st.ns is not None and disk.namespaces.get(st.ns_id) != st.desc:
                remember[st.ns_id] = st.desc
            b.disk_writing = True
            b.host_pins += 1
            self.writes_in_flight += 1
            # The copy's sequence number is taken now, under the lock, not when the write runs:
            # a flush that comes while it is written fences it (its number is below the fence),
            # on disk as in memory, so a kill -9 can never bring it back.
            jobs.append((b, slot, b.parent[16:] if b.parent else None,
                         self.host.view(b.host_slot, st.host_slot_bytes), disk.next_seq()))
        if not jobs:
            return 0
        headers = disk.take_pending_headers()
        self.batch_writing = True
        epoch = self.disk_epoch

        def write_all():
            # slots next to each other on disk go out in one call (each block its own slot)
            try:
                return disk.write_many([(slot, src, b.st.meta(b.key, parent_key, exact=b.decoded, seq=seq))
                                        for b, slot, parent_key, src, seq in jobs])
            except Exception as e:  # noqa: BLE001 - any failure must still unpin below
                return [e] * len(jobs)

        self.cond.release()
        try:
            # Everything a block's recovery depends on goes first: its slab's header and its
            # namespace's description. If they fail, no block of the batch is written.
            try:
                if headers:
                    disk.write_headers(headers)
                for ns_id, desc in remember.items():
                    disk.remember_namespace(ns_id, desc)
            except OSError as e:
                results = [e] * len(jobs)
            else:
                results = write_all()
        finally:
            self.cond.acquire()
        if epoch != self.disk_epoch:
            # the tier's directory vanished while these were written (`forget_writes`, which
            # did not wait for them): their copies went with it
            for b, *_ in jobs:
                b.disk_writing = False
                b.host_pins -= 1
                self.index.reap(b)
            self.cond.notify_all()
            return 0
        self.batch_writing = False
        written = failed = 0
        for (b, slot, *_), entry in zip(jobs, results):
            b.disk_writing = False
            b.host_pins -= 1
            self.writes_in_flight -= 1
            # (a flush of the host tier during the write doomed the host copy: `reap` drops it
            # only once the new disk copy is indexed below, so the block stays, on disk)
            if not isinstance(entry, DiskEntry):
                self.index.reap(b)
                disk.free_slot(slot)
                if not failed:
                    self.health.error("write", entry)  # the block stays in host RAM only
                failed += 1
                continue
            if disk.fenced(entry.ns_id, entry.seq) or b.orphan:
                # a flush came while it was written: that copy is dead (an orphan's key is
                # another block's now; only a flush that dropped its disk copy, and so fenced
                # it, makes one while its write is in flight)
                self.index.reap(b)
                disk.free_slot(slot)
                continue
            b.disk = entry
            self.index.disk.owner[slot] = b
            self.index.disk.policy.insert(b.ikey)
            self.index.enter(b, "disk")
            self.index.reap(b)          # a flush came during the write: the new copy goes too
            c = self.index.disk.counters
            c["demotions"] += 1
            c["bytes_in"] += b.st.block_bytes
            written += 1
        if written and not failed:
            self.health.healthy()
        self.cond.notify_all()
        return written

    def _flush_hold(self, b: Block) -> int:
        """(Lock held.) 0 when no flush under way holds back a write-down of `b`; else a fenced
        flush of its scope has yet to walk it (it was there before the flush began, see
        `flush`): HELD_DROP when such a flush drops its host copy too (tier all: dropping it
        now, unwritten, is what the flush does), HELD_KEEP when none does (tier disk: it
        stays, and must be written once the flush is done)."""
        held = 0
        for f in self.flushing:
            if f.fenced and f.covers(b) and b not in f.born:
                if f.drops_host:
                    return self.HELD_DROP
                held = self.HELD_KEEP
        return held

    def _wait_for_flushes(self, deadline: float, b: Block | None = None) -> bool:
        """(Lock held; let go while waiting.) Wait until no fenced flush is under way (or none
        holds back `b`), until `deadline`. True when none is (any more)."""
        while any(f.fenced for f in self.flushing) and (b is None or self._flush_hold(b)):
            left = deadline - time.monotonic()
            if left <= 0 or self.cond.closed:
                return False
            self.cond.wait(min(0.05, left))
        return True

    def _not_durable(self, blocks: list[Block], skip: set[Block]) -> list[Block]:
        """(Lock held; let go between chunks.) Those of `blocks` still indexed and READY in host
        RAM (not dropped by a flush) with no disk copy that stays, but those in `skip`: what a
        sync has yet to write."""
        out = []
        for i in range(0, len(blocks), SCAN_CHUNK):
            if i:
                self.cond.release()
                try:
                    time.sleep(SCAN_YIELD_S)
                finally:
                    self.cond.acquire()
            for b in blocks[i:i + SCAN_CHUNK]:
                if (self.index.blocks.get(b.ikey) is b and b.host_state == READY and not b.doomed & DOOM_HOST
                        and (b.disk is None or b.doomed & DOOM_DISK) and b not in skip):
                    out.append(b)
        return out

    def unsynced_blocks(self) -> int:
        """Host blocks without a disk copy: what `sync()` would write."""
        n = 0

        def count(b: Block) -> None:
            nonlocal n
            n += unsynced(b)
        self.walk(count)
        return n

    def sync_disk(self, max_blocks: int | None) -> int:
        """`sync`'s disk part: plan (the host-only blocks there now), write them in batches,
        then settle: whatever of the plan is still not on disk (held back by a flush that
        began meanwhile, or its new copy dropped by one) is written again once the flush is
        done; what cannot be written fails the sync."""
        if self.disk is None:
            return 0
        written = 0
        with self.cond:
            self.cond.check_open()
            degraded, disk = self.health.fault is not None, self.disk
        if degraded and not disk.closed:
            # an explicit sync probes the disk at once (outside the lock): a disk that is back
            # takes the sync now, not at the maintainer's next probe
            self.health.probe(disk)
        deadline = time.monotonic() + self.SYNC_WAIT_S
        with self.cond:
            # a flush under way holds back the write-down of what it has yet to walk: what it
            # drops need not be written, what it keeps is written after it
            self._wait_for_flushes(deadline)
        todo: list[Block] = []   # insertion order: a chain's ancestors before its descendants
        self.walk(lambda b: todo.append(b) if unsynced(b) else None)
        todo = todo[:max_blocks] if max_blocks is not None else todo
        with self.cond:
            self.cond.check_open()
            if self.health.fault is not None:
                self.health.probe_soon()       # the sync's first write batch probes too
            flushed: set[Block] = set()    # their disk copy (or write) a flush dropped meanwhile
            self.syncing.append(flushed)
            try:
                while True:
                    begun = self.flushes_begun
                    for i in range(0, len(todo), self.WRITE_BATCH):
                        written += self._write_down_batch(todo[i:i + self.WRITE_BATCH])
                        if self.health.fault is not None:
                            break
                    while self.writes_in_flight and not self.health.note_stall():
                        self.cond.wait(0.05)
                    # (a flush that dropped a copy this sync wrote, or was writing, came after it)
                    todo = self._not_durable(todo, flushed)
                    if not todo or self.health.fault is not None:
                        break
                    if begun == self.flushes_begun and not any(f.fenced for f in self.flushing):
                        break            # no flush in the way: the disk had no room for them
                    if not self._wait_for_flushes(deadline):   # it held them back: written after it
                        break
            finally:
                # (by identity: two syncs' sets may be equal)
                self.syncing[:] = [s for s in self.syncing if s is not flushed]
            fault, disk = self.health.fault, self.disk
            if todo and fault is None:
                flushing = [f for f in self.flushing if f.fenced]
                if flushing:
                    scope = "every namespace" if any(f.ns_id is None for f in flushing) else "a namespace"
                    why = f"a flush of {scope} is still under way after {self.SYNC_WAIT_S:.0f}s"
                else:
                    why = (f"the disk tier ({format_size(disk.capacity_bytes)}, {len(self.index.disk.owner)} blocks) "
                           "has no room for them")
        if fault is not None:
            raise DiskDegradedError(f"sync: disk tier degraded ({fault}); "
                                    f"{len(todo)} blocks are in host RAM only")
        try:
            disk.flush()
        except OSError as e:
            with self.cond:
                self.health.error("fdatasync", e)
            raise DiskDegradedError(f"sync: disk tier degraded (fdatasync: {e})") from None
        if todo:
            raise DiskTierError(f"sync: {len(todo)} blocks are in host RAM only, not written to disk: {why} "
                                f"({written} written)")
        return written

    def _cleaning(self) -> bool:
        """(Lock held.) Whether host RAM is kept clean ahead of eviction: with a disk tier and
        no SSD admission filter (the filter judges a block as it leaves host RAM, by the hits
        it had by then; writing it ahead would judge it too early)."""
        return self.disk is not None and self.admission.min_hits == 0

    def wake(self) -> None:
        """(Lock held; each commit.) Wake the demoter once host RAM is past its high watermark
        and it has something to do there: with no disk tier it has nothing (it only writes
        host blocks down; an allocation drops the coldest block itself), so it is left alone."""
        if self.disk is None:
            return
        cap = self.host.capacity_bytes
        if self.host.alloc.used_bytes > self.config.host_high_watermark * cap and (
                not self._cleaning() or self.index.dirty_bytes > self.config.host_dirty_ratio * cap):
            self.wanted.set()

    def host_room_inline(self, st: NsState, n: int) -> bool:
        """(Lock held; the event loop's thread.) At least `n` free host slots of `st`'s size,
        dropping the coldest blocks only while each is clean (its disk copy stays, on a disk
        that is not failing). No I/O, no wait. False when the next victim would need a write
        first, or there is none."""
        sb = st.host_slot_bytes
        while self.host.alloc.free_slot_count(sb) < n:
            if self.disk is None:
                # no disk tier: an eviction is a drop, no I/O (host RAM is kept full, not
                # emptied to the low watermark ahead of need: see `demote_pass`)
                b = self.index.host.victim(sb)
                if b is None:
                    return False
                self.index.drop_host(b, evicted=True)
                continue
            if self.health.waiting():
                return False             # (a failing disk: its copies may not be readable)
            b = self.index.host.victim(sb)
            if b is None or b.clean != 1 or b.doomed & DOOM_DISK:
                return False             # it would be written down (or lost) first
            # (the block stays, on disk: a key of the same request it is, it is still present
            # and needs no slot, so `TieredStore._slots_needed` never under-counts)
            self.index.drop_host(b, evicted=True)
        return True

    def demote_pass(self) -> int:
        """Host use above its high watermark. With a disk tier (and no SSD admission filter):
        once blocks with no disk copy (dirty) pass `host_dirty_ratio` of the host, write the
        oldest down until they are at half of it. They stay in host RAM, clean, and an
        allocation that needs room drops the coldest clean block at once: host RAM stays full
        of cached blocks, and neither a put nor a promotion waits for a write. Otherwise (SSD
        admission, writes that failed): evict coldest first, written down if admitted, until
        host use is at the low watermark. No disk tier: nothing here (an allocation drops the
        coldest block when it needs room). Disk above its high watermark: evict
        until its low watermark. Lock held."""
        cfg, moved = self.config, 0
        host_cap = self.host.capacity_bytes
        # (no disk tier: nothing to write, and an allocation drops the coldest block at once,
        # inline too; emptying host RAM to the low watermark would only lose cached blocks)
        over = self.disk is not None and self.host.alloc.used_bytes > cfg.host_high_watermark * host_cap
        dirty_limit = cfg.host_dirty_ratio * host_cap
        if over and self._cleaning():
            blocked = False
            if self.index.dirty_bytes > dirty_limit:
                wrote, blocked = self._clean_pass(dirty_limit / 2)
                moved += wrote
            over = blocked and self.index.dirty_bytes > dirty_limit     # what cleaning cannot relieve
        while over and not self.cond.closed:
            low = cfg.host_low_watermark * host_cap
            if self.host.alloc.used_bytes <= low or (self._cleaning() and self.index.dirty_bytes <= dirty_limit / 2):
                break
            # Pick a batch of distinct victims: each picked one is pinned while picking so
            # the policy moves on (and its parent keeps a resident child: not picked).
            batch: list[Block] = []
            excess = self.host.alloc.used_bytes - low
            while len(batch) < self.WRITE_BATCH and excess > 0:
                key = self.index.host.policy.victim(
                    lambda k: host_evictable(self.index.blocks[k]) and self.index.blocks[k].host_children == 0)
                if key is None:
                    break
                b = self.index.blocks[key]
                b.host_pins += 1
                batch.append(b)
                excess -= b.st.host_slot_bytes
            if not batch:
                break
            for b in batch:
                b.host_pins -= 1
            need = []
            for b in batch:
                if self.disk is not None and b.disk is None and not b.disk_writing:
                    if self.admission.admit(b.hits):
                        need.append(b)
                    else:
                        self.index.disk.counters["admission_rejected"] += 1
            if need:
                moved += self._write_down_batch(need)
            freed = 0
            for b in batch:
                if b in need and b.disk is None and self._flush_hold(b) == self.HELD_KEEP:
                    continue      # a disk flush held its write back: kept, written after it
                if host_evictable(b):
                    self.index.drop_host(b, evicted=True)
                    freed += 1
            if not freed:
                break
        if self.disk is not None:
            disk_cap = self.disk.capacity_bytes
            if self.disk.alloc.used_bytes > cfg.disk_high_watermark * disk_cap:
                while self.disk.alloc.used_bytes > cfg.disk_low_watermark * disk_cap:
                    key = self.index.disk.policy.victim(
                        lambda k: disk_evictable(self.index.blocks[k]) and self.index.blocks[k].disk_children == 0)
                    if key is None:
                        break
                    self.index.drop_disk(self.index.blocks[key], evicted=True)
        return moved

    def _clean_pass(self, target: float) -> tuple[int, bool]:
        """(Lock held; let go during the writes.) Write dirty host blocks down to disk, oldest
        first (a chain's blocks in order, so each batch is one sequential run), until the dirty
        bytes are at `target`. Returns the blocks written, and whether cleaning is blocked: the
        disk is failing or stalled, has no slot to give, or copies of host blocks fill
        `CLEAN_DISK_SHARE` of it (a disk smaller than about twice the host: past that share,
        writing host blocks down ahead would make the disk evict other host blocks' copies,
        which would then be written again). Blocked, the demoter evicts as it did before."""
        if self.health.waiting():
            return 0, True
        moved = 0
        todo = iter(list(self.index.dirty.values()))   # each block looked at once per pass
        share = self.CLEAN_DISK_SHARE * self.disk.capacity_bytes
        while not self.cond.closed and self.index.dirty_bytes > target:
            excess = self.index.dirty_bytes - target
            room = share - self.index.clean_bytes
            batch: list[Block] = []
            full = False
            for b in todo:
                if unsynced(b) and b.clean == 0:
                    if room < b.st.host_slot_bytes:
                        full = True
                        break
                    batch.append(b)
                    excess -= b.st.host_slot_bytes
                    room -= b.st.host_slot_bytes
                    if len(batch) >= self.WRITE_BATCH or excess <= 0:
                        break
            if batch:
                wrote = self._write_down_batch(batch)
                moved += wrote
                if not wrote and any(unsynced(b) for b in batch):
                    return moved, True       # no disk slot, a failed write, or a stall
            if full:
                return moved, True
            if not batch:
                break
        return moved, False
