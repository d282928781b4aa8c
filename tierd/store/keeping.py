"""Keeping host blocks across restarts: block records, and the re-adoption of an earlier arena's
blocks at open. A part of `TieredStore` (the store's lock guards the queue and the blocks; the records
file is the host tier's, `tiers/host_records.py`).

**Recording.** A put acknowledged is a put recorded. A block that becomes READY in host RAM
with a known checksum (`put` hashes each block as it copies it, where the bytes are still in
the CPU's caches, and a daemon's client sends those checksums with its put or commit; a disk
read verifies a raw block's checksum as it copies it into the slot; `Block.csum`) is recorded
there and then, under the lock, before the commit returns: a record is a memory write into the
records file, a few microseconds. Nothing it needs is left to file work at that point: the
record's page is reserved as the slot is handed out (`HostTier.alloc_slot`: reserve, stage, a
promotion's slot), and the namespace's description goes into the records' namespace log by a
memory write too, at the commit of its first block (`HostRecords.note_namespace`). So such a
block never waits for a thread, and a kill -9 right after its put was acknowledged keeps it,
however busy the machine.

The keeper thread is left with the blocks whose checksum is not known (a writer that did not
hash, e.g. a GPU copy; a block decoded from a disk codec or fetched from the remote tier: those
two also have a copy below) and the rare ones whose record page could not be reserved (a full
tmpfs) or whose namespace found no room in the log: it pins a batch, reserves what they need,
checksums them outside the lock (xxh3, which lets go of the GIL), and writes each record under
the lock only if the block is still READY in the same slot and not flushed. It runs at the
lowest priority (`KEEP_NICE`), so a busy machine can starve it: what it left waiting longer than
`KEEP_DUE_S` is recorded by a second thread at normal priority (`HostKeeping._due_loop`), so a block
without its checksum is recorded within about KEEP_DUE_S of its commit plus the hash at a fair
share of the CPU (stats: `keep_pending`, `records_due`). A record is cleared before its slot
is freed (`HostTier.free_slot`) and when a flush dooms the block. A block that was not yet
recorded when the daemon died is simply not re-adopted; a clean close records the backlog first
(bounded by `KEEP_CLOSE_S`).

**Re-adoption.** The earlier arena and its records are moved aside, and a fresh arena is made
(a new file: a client of the dead daemon still copying through its old mapping can never touch
the new arena's slots). Each recorded block, newest first while there is room, is copied into a
slot of the new arena and its checksum computed over the copy that will be served; a mismatch,
a torn record or a record of another format is dropped and counted, never served. Each block's
pages in the old file are given back as it is copied, and the pages no record covers before any
copy, so the two arenas never take their full size at once. The new arena reserves its memory
once the copies are done, then the old files are removed. Adoption runs in the store's
constructor, before the daemon serves: a restart costs the copy (memory speed), not the hits.
"""

from __future__ import annotations

import collections
import itertools
import logging
import mmap
import os
import threading
import time

import numpy as np

from ..config import align_up, format_size
from ..errors import TierdError
from ..tiers.host import records_path
from ..tiers.host_records import (
    FLAG_DECODED,
    HostRecord,
    RecordsBusyError,
    checksum,
    punch_hole,
    read_records,
)
from ..tiers.host_records import pack as pack_record
from .records import ABSENT, DOOM_HOST, READY, Block, NsState

log = logging.getLogger("tierd.store")

_OLD = ".old"


def set_aside(shm_path: str) -> tuple[str, str] | None:
    """Move an earlier arena at `shm_path` and its records aside for re-adoption: (arena, records)
    paths, or None when there is nothing to adopt. Raises RecordsBusyError if a live store
    still holds them."""
    rec = records_path(shm_path)
    pairs = [(shm_path, shm_path + _OLD), (rec, rec + _OLD), (rec + ".ns", rec + _OLD + ".ns")]
    if os.path.exists(shm_path):
        if os.path.exists(rec):
            _check_not_busy(rec)
        for cur, old in pairs:       # the newest arena wins over one left by an interrupted adoption
            if os.path.exists(cur):
                os.replace(cur, old)
            elif os.path.exists(old):
                os.unlink(old)
    elif not os.path.exists(shm_path + _OLD):
        for cur, _ in pairs[1:]:     # records without their arena describe nothing
            if os.path.exists(cur):
                os.unlink(cur)
        return None
    return shm_path + _OLD, rec + _OLD


def _check_not_busy(path: str) -> None:
    import fcntl
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        raise RecordsBusyError(f"{path} belongs to a live store; stop it first") from None
    finally:
        os.close(fd)


class HostKeeping:
    """The host blocks' records for restarts, and their re-adoption (see the module docstring).

    Fields: `queue` (blocks waiting for the keeper, oldest first, each with when it was queued;
    None when the host tier keeps no records), `busy` (blocks of the batches being
    checksummed), `counters` (for stats), `seqs` (records' sequence numbers), the two threads
    and their wake-ups. Collaborators: the store's lock (`cond`: it guards the queue, the
    counters and the blocks), the block index (the host tier and its residency record, new
    block records, `enter`, `reap`) and the namespace table (re-adoption's namespaces).

    Invariants (where the host tier keeps records): a block READY in host RAM, not flushed, is
    recorded, queued, or in a batch being checksummed (pinned) — or counted `unrecorded`; a
    record is written only for a block still READY in the slot it describes and not flushed; a
    record is cleared before its slot is freed (`HostTier.free_slot`) and when a flush dooms
    its block (`forget`)."""

    KEEP_BATCH_BYTES = 16 << 20   # most bytes the keeper pins and checksums at a time
    KEEP_SETTLE_BLOCKS = 16       # records it writes per hold of the store lock
    KEEP_CLOSE_S = 30.0           # how long a close waits for the keeper's backlog
    KEEP_DUE_S = 1.0              # queued longer than this: recorded at normal priority (_due_loop)

    def __init__(self, cond, index, namespaces):
        self.cond = cond
        self.index = index
        self.namespaces = namespaces
        self.host = index.host.tier
        self.queue: collections.deque[tuple[Block, float]] | None = (
            collections.deque() if self.host.records is not None else None)
        self.wake = threading.Event()
        self.due_wake = threading.Event()   # (only to stop the due thread at once)
        self.seqs = itertools.count(1)      # (next() is atomic)
        self.busy = 0
        self.stopping = False
        self.failing = False                # writing records fails (logged once per episode)
        self.counters = {"adopted_blocks": 0, "adopted_bytes": 0, "adopt_dropped": 0,
                         "adopt_seconds": 0.0, "records_written": 0, "records_hashed": 0,
                         "records_due": 0, "unrecorded": 0}
        self.keeper = self.due_thread = None

    # (`_keep_start` and `_keep_loop` keep their names: tests/test_records_ack.py stops the
    # keeper by replacing them)
    def _keep_start(self) -> None:
        if self.queue is not None:
            self.keeper = threading.Thread(target=self._keep_loop, name="tierd-keeper", daemon=True)
            self.keeper.start()
            self.due_thread = threading.Thread(target=self._due_loop, name="tierd-keeper-due",
                                               daemon=True)
            self.due_thread.start()

    def note(self, b: Block) -> None:
        """(Lock held.) `b` became READY in host RAM: record it now when its writer gave its
        checksum (a few microseconds: memory writes into the records files), else soon, off the
        critical path (the keeper; within about KEEP_DUE_S on a busy machine)."""
        if self.queue is not None:
            if b.csum >= 0 and self._record_now(b):
                return
            self.queue.append((b, time.monotonic()))
            if not self.wake.is_set():   # (once per wake-up, not per block: set() takes a lock)
                self.wake.set()

    def _record_now(self, b: Block) -> bool:
        """(Lock held.) Write `b`'s record with the checksum its writer gave, its namespace's
        description first if it is not on file yet: memory writes, no file work. False only when
        one of them has no room (a full tmpfs, or a full namespace log): the keeper then tries
        again and reports it. (Handing the block to the keeper would cost more than this: a
        wake-up, a pin, a second hold of the lock, and the keeper's turns with the GIL, taken
        from the requests being served; and it would leave the block unrecorded after its put
        was acknowledged.)"""
        rec = self.host.records
        st = b.st
        if rec.namespaces.get(st.ns_id) is not st.desc and not rec.note_namespace(st.ns_id, st.desc):
            return False
        off = self.host.alloc.offset(b.host_slot)
        if not rec.write_packed(off, self._record_of(b, b.host_slot, b.csum)):
            return False
        self.counters["records_written"] += 1
        return True

    def _record_of(self, b: Block, slot: int, csum: int) -> bytes:
        """`b`'s record, packed, for its copy in `slot` with checksum `csum` (a new sequence number)."""
        return pack_record(HostRecord(self.host.alloc.offset(slot), b.st.ns_id, b.key,
                                      b.parent[len(b.st.ns_id):] if b.parent else None, b.st.block_bytes,
                                      next(self.seqs), csum, FLAG_DECODED if b.decoded else 0))

    def forget(self, b: Block) -> None:
        """(Lock held.) A flush doomed `b`'s host copy: its record goes now, before its pins do."""
        rec = self.host.records
        if rec is not None and b.host_slot >= 0:
            rec.clear(self.host.alloc.offset(b.host_slot))

    KEEP_NICE = 19                # the keeper's niceness: it yields the CPU to requests and copies

    def _keep_loop(self) -> None:
        try:   # this thread only (Linux: a thread id names one thread); best effort
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), self.KEEP_NICE)
        except (OSError, AttributeError):
            pass
        while True:
            self.wake.wait(0.5)
            self.wake.clear()
            try:
                while self._round():
                    pass
            except Exception:  # noqa: BLE001 -- records are best effort; serving goes on
                log.exception("host tier: recording blocks failed; blocks stored from now on may "
                              "not survive a restart")
                return
            if self.stopping:
                return

    def _due_loop(self) -> None:
        """Record, at normal priority, what waited on the keeper longer than KEEP_DUE_S (a busy
        machine starves the keeper): the bound on how long a block stays unrecorded. Idle, this
        thread wakes once per KEEP_DUE_S to look at the oldest queued block."""
        while True:
            with self.cond:
                if self.stopping:
                    return
                q = self.queue
                wait = self.KEEP_DUE_S if not q else q[0][1] + self.KEEP_DUE_S - time.monotonic()
            if wait > 0:
                self.due_wake.wait(wait)
                continue
            try:
                while self._round(due=time.monotonic() - self.KEEP_DUE_S):
                    pass
            except Exception:  # noqa: BLE001 -- records are best effort; serving goes on
                log.exception("host tier: recording overdue blocks failed")
                return

    def _round(self, due: float | None = None) -> bool:
        """Record one batch of queued blocks (with `due`: only those queued before it); False
        when there was none."""
        rec = self.host.records
        batch = []
        nbytes = 0
        with self.cond:
            q = self.queue
            while q and nbytes < self.KEEP_BATCH_BYTES and (due is None or q[0][1] <= due):
                b, _ = q.popleft()
                if b.host_state != READY or b.doomed & DOOM_HOST or b.host_slot < 0:
                    continue
                b.host_pins += 1
                batch.append((b, b.host_slot, b.csum))
                nbytes += b.st.block_bytes
            self.busy += len(batch)
            if due is not None:
                self.counters["records_due"] += len(batch)
        if not batch:
            return False
        named = True
        try:
            rec.reserve_pages(rec.pages_for(self.host.alloc.offset(slot) for _, slot, _ in batch))
        except OSError as e:
            named = False
            with self.cond:
                self.counters["unrecorded"] += len(batch)
            if not self.failing:    # once per episode (stats count every block)
                self.failing = True
                log.error("host tier: cannot write block records (%s); blocks stored meanwhile will not "
                          "survive a restart (stats: unrecorded)", e)
        else:
            if self.failing:
                self.failing = False
                log.info("host tier: block records are written again")
        # no records can be written: the batch is only unpinned, not checksummed for nothing
        # Checksums and records are made outside the lock (the blocks are pinned; a parent or
        # flag read here a moment early only orders eviction); under it, a few blocks at a
        # time, each record is written only if its block still holds that slot, READY and not
        # flushed: the lock is never held for long by this thread, whose work is not urgent.
        # A checksum the writer gave with the bytes (hashed as it copied them into the slot) is
        # recorded as it is: a wrong one only makes the next daemon drop that block.
        recs = []
        for b, slot, csum in batch:
            if not named:
                recs.append(None)
                continue
            if csum < 0:
                csum = checksum(self.host.view(slot, b.st.block_bytes))
                self.counters["records_hashed"] += 1
            recs.append(self._record_of(b, slot, csum))
        for i in range(0, len(batch), self.KEEP_SETTLE_BLOCKS):
            if i:
                time.sleep(0)   # let the GIL and the lock go to requests between chunks
            with self.cond:
                for (b, slot, _), data in zip(batch[i:i + self.KEEP_SETTLE_BLOCKS], recs[i:i + self.KEEP_SETTLE_BLOCKS]):
                    b.host_pins -= 1
                    if (data is not None and not self.stopping and b.host_slot == slot
                            and b.host_state == READY and not b.doomed & DOOM_HOST):
                        if (rec.note_namespace(b.st.ns_id, b.st.desc)
                                and rec.write_packed(self.host.alloc.offset(slot), data)):
                            self.counters["records_written"] += 1
                        else:
                            self.counters["unrecorded"] += 1
                    self.index.reap(b)
                    self.busy -= 1
                self.cond.notify_all()
        return True

    def close(self) -> None:
        """Record the backlog (at most KEEP_CLOSE_S), then stop the keeper and the due thread."""
        if self.keeper is None:
            return
        deadline = time.monotonic() + self.KEEP_CLOSE_S
        while self.keeper.is_alive() and time.monotonic() < deadline:
            with self.cond:
                if not self.queue and not self.busy:
                    break
            self.wake.set()
            time.sleep(0.01)
        with self.cond:
            left = len(self.queue)
            self.stopping = True
        self.wake.set()
        self.due_wake.set()
        self.keeper.join(max(0.1, deadline - time.monotonic()))
        if self.due_thread is not None:
            self.due_thread.join(max(0.1, deadline - time.monotonic()))
        if left:
            log.warning("host tier: %d blocks were not recorded before the close; they will not be "
                        "re-adopted", left)

    def pending(self) -> int:
        """Blocks in host RAM whose records are not written yet."""
        with self.cond:
            return len(self.queue) + self.busy if self.queue is not None else 0

    def stats(self) -> dict:
        """(Lock held.) The host tier's stats of records and re-adoption ({} without records)."""
        if self.queue is None:
            return {}
        return {**self.counters, "keep_pending": len(self.queue) + self.busy}

    # -- re-adoption at open ------------------------------------------------------------------
    def adopt(self, old: tuple[str, str]) -> None:
        """Re-adopt the blocks of the arena set aside at `old` (see the module docstring);
        remove the old files whatever happens."""
        arena_path, rec_path = old
        t0 = time.monotonic()
        adopted, dropped, nbytes = [], 0, 0
        try:
            fd = os.open(arena_path, os.O_RDWR | os.O_CLOEXEC)
        except OSError as e:
            log.warning("host tier: cannot open the earlier arena %s (%s); starting empty", arena_path, e)
            fd = -1
        try:
            records, descs, why = [], {}, ""
            if fd >= 0:
                try:
                    records, descs, why = read_records(rec_path, fd)
                except FileNotFoundError:
                    why = "it has no block records"
                if why:
                    log.warning("host tier: not re-adopting the earlier arena: %s", why)
            if records:
                dropped, nbytes = self._adopt_records(fd, records, descs, adopted)
        finally:
            if fd >= 0:
                os.close(fd)
            for p in (arena_path, rec_path, rec_path + ".ns"):
                try:
                    os.unlink(p)
                except FileNotFoundError:
                    pass
        dt = time.monotonic() - t0
        self.counters.update(adopted_blocks=len(adopted), adopted_bytes=nbytes, adopt_dropped=dropped,
                                adopt_seconds=dt)
        if adopted or dropped:
            log.info("host tier: re-adopted %d blocks (%s) from the last run in %.2fs; %d dropped "
                     "(torn, failed their checksum, or no room)", len(adopted), format_size(nbytes), dt, dropped)

    ADOPT_THREADS = 8              # at most, for the copies of a re-adoption (page faults scale with cores)

    def _adopt_records(self, fd: int, records: list[HostRecord], descs: dict, adopted: list) -> tuple[int, int]:
        size = os.fstat(fd).st_size
        # Give back the pages no record covers first: room for the copies.
        spans = sorted((r.offset, r.offset + align_up(r.length)) for r in records)
        pos = 0
        for lo, hi in spans:
            if lo > pos:
                punch_hole(fd, pos, lo - pos)
            pos = max(pos, hi)
        punch_hole(fd, pos, size - pos)
        mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ)
        src = np.frombuffer(mm, dtype=np.uint8)
        dropped = nbytes = 0
        rec = self.host.records
        try:
            plan = []
            with self.cond:                       # slots, newest first while there is room
                for r in sorted(records, key=lambda r: -r.seq):
                    st = self._adopt_ns(r, descs)
                    slot = self.host.alloc_slot(st.host_slot_bytes) if st is not None else None
                    if slot is None:
                        dropped += 1
                        punch_hole(fd, r.offset, align_up(r.length))
                    else:
                        plan.append((r, st, slot))

            new_fd = self.host.arena.fd

            def copy(part) -> list[bool]:          # no lock: the slots are the store's alone yet
                ok = []
                for r, _, slot in part:
                    try:   # the slot's pages first: a full tmpfs is a dropped block, not a SIGBUS
                        os.posix_fallocate(new_fd, self.host.alloc.offset(slot), align_up(r.length))
                    except OSError:
                        punch_hole(fd, r.offset, align_up(r.length))
                        ok.append(False)
                        continue
                    dst = self.host.view(slot, r.length)
                    np.copyto(dst, src[r.offset:r.offset + r.length])
                    punch_hole(fd, r.offset, align_up(r.length))
                    ok.append(checksum(dst) == r.checksum)   # over the copy that will be served
                return ok

            parts, cur, cur_bytes = [], [], 0
            for item in plan:
                cur.append(item)
                cur_bytes += item[0].length
                if cur_bytes >= 32 << 20:
                    parts.append(cur)
                    cur, cur_bytes = [], 0
            if cur:
                parts.append(cur)
            threads = max(1, min(self.ADOPT_THREADS, os.cpu_count() or 1, len(parts)))
            if threads > 1:
                from concurrent.futures import ThreadPoolExecutor
                with ThreadPoolExecutor(threads, thread_name_prefix="tierd-adopt") as ex:
                    verdicts = [v for part in ex.map(copy, parts) for v in part]
            else:
                verdicts = [v for part in parts for v in copy(part)]
            named = {}
            with self.cond:
                for (r, st, slot), good in zip(plan, verdicts):
                    b = self.index.blocks.get(r.ns_id + r.key)
                    if not good or (b is not None and b.host_state != ABSENT):
                        self.host.free_slot(slot)
                        dropped += 1
                        continue
                    if b is None:
                        b = self.index.new_block(r.ns_id + r.key, st, r.key)
                    if b.parent is None and r.parent:
                        b.parent = r.ns_id + r.parent
                    b.host_slot, b.host_state, b.decoded = slot, READY, bool(r.flags & FLAG_DECODED)
                    b.csum = r.checksum    # verified over this copy
                    self.index.host.owner[slot] = b
                    adopted.append((b, r))
                    nbytes += r.length
                    if r.ns_id in descs:
                        named[r.ns_id] = descs[r.ns_id]
            try:   # (reserved as their slots were taken, unless the tmpfs was full)
                rec.reserve_pages(rec.pages_for(self.host.alloc.offset(b.host_slot) for b, _ in adopted))
            except OSError as e:
                log.error("host tier: cannot write the re-adopted blocks' records (%s); the keeper retries", e)
            with self.cond:
                for ns_id, desc in named.items():   # the descriptions on file, also of namespaces known
                    rec.note_namespace(ns_id, desc)  # only from these records (a memory write each)
                self.queue.clear()
                for b, _ in reversed(adopted):                       # oldest first: eviction order
                    self.index.host.policy.insert(b.ikey)
                    self.index.enter(b, "host")   # recorded here (its checksum is known), or by the keeper
        finally:
            src = None   # noqa: F841 -- the last view of the mapping goes before it is closed
            mm.close()
        return dropped, nbytes

    def _adopt_ns(self, r: HostRecord, descs: dict) -> NsState | None:
        """(Lock held.) The namespace a re-adopted block belongs to (known from an earlier record
        or the disk tier, else made from its description), or None when the block cannot be
        one of its blocks here."""
        st = self.namespaces.get(r.ns_id)
        if st is None:
            try:
                self.host.check_block(r.length)
            except TierdError:
                return None
            st = self.namespaces.recovered(r.ns_id, r.length, descs.get(r.ns_id, {}))
        return st if st.block_bytes == r.length else None
