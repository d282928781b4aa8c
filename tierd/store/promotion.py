"""Promotion: serving a lease, reading blocks up from disk or the remote tier into host RAM
(and into HBM when hit often) — plan under the lock, reads outside it, settle on every exit."""

from __future__ import annotations

import logging
from collections.abc import Sequence

from .. import codec as _codec
from ..keys import check_keys
from ..namespace import Namespace
from ..tiers.disk import CorruptBlockError, DiskEntry, DiskTier
from .ownership import Lease
from .records import (
    ABSENT,
    DOOM_HOST,
    LOADING,
    READY,
    REMOTE,
    Block,
    NsState,
    WouldBlock,
    disk_servable,
    host_servable,
)

log = logging.getLogger("tierd.store")


class Promotion:
    """Serving leases: the leading present blocks of a request pinned, those below host RAM
    read up into it (from disk, verified; from the remote tier), HBM copies made for blocks hit
    often, and damaged disk copies erased. Plan under the lock, reads outside it, settle on
    every exit. No state of its own: it moves blocks between the parts that hold them.

    Collaborators: the store's lock (`cond`: `StoreLock`), the block index, the namespace table,
    the event feed, `held` (the open leases: `Holdings`), demotion (room in host RAM and HBM),
    the disk's health, the remote link, the store's config, `ids` (the store's reservation and
    lease ids) and `store`, the one a lease is released to (`Lease.release`).

    Invariants: a planned block is pinned (`host_pins`; `disk_pins` while its disk copy is
    read) from its plan to its settle, and the settle drops every pin the plan took whatever
    happens; a block read up is LOADING — counted by lookups, never leased — until it was
    verified and becomes READY; only READY host copies no flush dropped are leased."""

    def __init__(self, cond, index, namespaces, feed, held, demotion, health, remote, config, *, ids, store):
        self.cond = cond
        self.index = index
        self.namespaces = namespaces
        self.feed = feed
        self.held = held
        self.demotion = demotion
        self.health = health
        self.remote = remote
        self.config = config
        self.ids = ids
        self.store = store

    @property
    def host(self):
        return self.index.host.tier

    @property
    def disk(self):
        return self.index.disk.tier

    @property
    def gpu(self):
        return self.index.gpu.tier

    def _gpu_lease(self, b: Block) -> tuple[int, bool]:
        """(Lock held.) For a leased host-resident block: its HBM offset, pinned for the lease,
        and whether the copy into HBM is still to be made (by `_gpu_fill`, outside the lock: the
        block is admitted once it has been served `gpu_admit_hits` times); (-1, False) when the
        block is not in HBM."""
        if b.gpu_slot < 0:
            if b.hits - 1 < self.config.gpu_admit_hits:   # hits counts this serve too
                return -1, False
            slot = self.demotion.gpu_alloc(b.st)
            if slot is None:
                return -1, False
            b.gpu_slot, b.gpu_filling = slot, True
            self.index.gpu.owner[slot] = b
            b.gpu_pins += 1
            return self.gpu.offset(slot), True
        if b.gpu_filling:
            return -1, False   # another lease is copying it in right now
        self.index.gpu.policy.hit(b.ikey)
        self.index.gpu.counters["bytes_out"] += b.st.block_bytes
        b.gpu_pins += 1
        return self.gpu.offset(b.gpu_slot), False

    def is_quick(self, op: str, ns: Namespace, keys: Sequence[bytes], *, gpu: bool = False) -> bool:
        """Whether `acquire` or `reserve` of `keys` would finish without disk I/O, a copy into
        HBM or waiting for room (a hint for the daemon, which then serves it on its event loop
        thread)."""
        with self.cond:
            st = self.namespaces.get(ns.id)
            if st is None:
                return False
            if op == "reserve":
                return self.host.alloc.free_slot_count(st.host_slot_bytes) >= len(keys)
            hbm = gpu and self.gpu is not None
            for k in keys:
                b = self.index.blocks.get(st.ns_id + k)
                if b is None:
                    return self.remote.tier is None   # the remote tier may have it: not quick
                if b.host_state != READY:
                    return b.disk is None and self.remote.tier is None  # a promotion: not quick
                if hbm and b.gpu_slot < 0 and b.hits >= self.config.gpu_admit_hits:
                    return False                 # this serve would copy it into HBM
            return True

    def acquire(self, ns: Namespace, keys: Sequence[bytes], *, owner=None, gpu: bool = False,
                inline: bool = False) -> Lease:
        """Lease the longest present prefix of `keys`, promoting disk blocks to host RAM.

        `gpu`: the caller reads HBM copies (`lease.gpu_buffers`); only then are blocks copied
        into the HBM tier and its copies leased. Without a reader the tier costs nothing.

        Plan → execute → settle: the plan pins blocks and marks promotions LOADING under the
        lock; the reads run outside it; the settle returns every planned block to a stable
        state (READY and leased, or its slot given back) and drops the plan's pins — on every
        exit, an unexpected exception or a store closing under a wait included.

        `inline` (the daemon's event loop thread): raise WouldBlock, changing nothing, when the
        plan would read a tier, wait for another promotion or copy into HBM."""
        keys = check_keys(keys)
        plan: list[tuple[Block, DiskEntry | str | None]] = []
        with self.cond:
            self.cond.check_open()
            st = self.namespaces.state(ns, self.host, self.disk)
            try:
                # (inline for an HBM reader too: a block that left host RAM since `is_quick`
                # must not be read from disk on the daemon's event loop)
                self._plan_acquire(st, keys, plan, inline=inline)
                if inline and gpu and self.gpu is not None:
                    if any(b.gpu_slot < 0 and b.hits >= self.config.gpu_admit_hits for b, _ in plan):
                        raise WouldBlock()   # this serve would copy into HBM
            except BaseException:
                self._settle_failed(st, plan)
                raise
            quick = all(e is None for _, e in plan)
            if quick:
                # every block READY in host RAM (a host hit): nothing to read, settled at once
                lease, fills, discard, disk = self._settle(st, keys, plan, {}, {}, owner, gpu)
        if not quick:
            sums: dict[int, int] = {}
            try:
                errors = self._load_from_disk([(b, e) for b, e in plan if e is not None and e is not REMOTE], sums)
                errors.update(self.remote.load([b for b, e in plan if e is REMOTE]))
            except BaseException:
                with self.cond:
                    self._settle_failed(st, plan)
                raise
            with self.cond:
                lease, fills, discard, disk = self._settle(st, keys, plan, errors, sums, owner, gpu)
        if discard:
            self._tombstone(disk, discard)   # erase damaged copies on disk (no lock)
        if fills:
            self._gpu_fill(lease, fills)
        if gpu and self.gpu is not None:
            lease.gpu_buffers = [self.gpu.buffer[o:o + st.block_bytes] if o >= 0 else None
                                 for o in lease.gpu_offsets]
        return lease

    def _settle(self, st: NsState, keys: list[bytes], plan: list, errors: dict, sums: dict, owner,
                gpu: bool) -> tuple[Lease, list[int], list[int], object]:
        """(Lock held.) `acquire`'s settle: every planned block back to a stable state (READY and
        leased, or its slot given back), the lease made. Returns (lease, its blocks to copy into
        HBM, damaged disk entries to erase, the disk tier they are on)."""
        discard: list[int] = []
        disk = self.disk
        cut = len(plan)
        for i, (b, e) in enumerate(plan):
            if e is None:
                continue
            if e is REMOTE:
                err = errors.get(id(b))
                if err is None and b.doomed & DOOM_HOST:
                    err = KeyError("flushed while it was fetched")
                if self.remote.settle(b, err):
                    continue
                cut = min(cut, i)
                continue
            b.disk_pins -= 1
            err = errors.get(id(b))
            if b.doomed & DOOM_HOST:          # flushed while it was read: not served
                cut = min(cut, i)
                b.host_pins -= 1
                b.doomed &= ~DOOM_HOST
                self.index.drop_host(b, evicted=False)
                self.index.reap(b)
                continue
            if err is None:
                # the checksum the disk read verified over the bytes now in the slot (a raw
                # payload): the block is recorded for restarts at once, not hashed again
                b.host_state, b.csum = READY, sums.get(id(b), -1)
                b.decoded = e.codec in _codec.LOSSY
                self.index.host.policy.insert(b.ikey)
                self.index.enter(b, "host")
                c = self.index.disk.counters
                c["promotions"] += 1
                c["bytes_out"] += st.block_bytes
            else:
                cut = min(cut, i)
                b.host_pins -= 1
                self.index.drop_host(b, evicted=False)
                if isinstance(err, CorruptBlockError):
                    log.warning("disk tier: dropped a damaged block of %s (%s)", st.name, err)
                    self.index.disk.counters["corrupt_dropped"] += 1
                    if b.disk is not None:
                        discard.append(self.index.unindex_disk(b))
                else:
                    self.health.error("read", err)   # a miss; the copy may read later
        for i, (b, _) in enumerate(plan[:cut]):
            if b.doomed & DOOM_HOST:          # flushed since it was planned: not served
                cut = i
                break
        for b, _ in plan[cut:]:
            if b.host_state == READY:
                b.host_pins -= 1
                self.index.reap(b)
            elif b.disk is not None:
                self.index.reap(b)
        leased = [b for b, _ in plan[:cut]]
        for b in reversed(leased):  # ancestors touched last: they stay the most recent
            b.hits += 1
            self.index.host.policy.hit(b.ikey)
        st.counters["hits"] += len(leased)
        st.counters["hit_bytes"] += len(leased) * st.block_bytes
        st.counters["misses"] += len(keys) - len(leased)
        self.index.host.counters["bytes_out"] += len(leased) * st.block_bytes
        lid = next(self.ids) if leased else 0   # nothing leased: nothing to release
        tiers = ["host" if e is None else "remote" if e is REMOTE else "disk" for _, e in plan[:cut]]
        lease = Lease(lid, st.ns, keys[:cut], leased, tiers, owner, self.store,
                      [self.host.offset(b.host_slot) for b in leased])
        fills = []
        hbm = gpu and self.gpu is not None
        if hbm:
            lease.gpu_offsets = []
            for i, b in enumerate(leased):
                off, fill = self._gpu_lease(b)
                lease.gpu_offsets.append(off)
                if fill:
                    fills.append(i)
        if lid and not fills:
            self.held.open_lease(lease)
        if cut < len(plan) or any(e is not None for _, e in plan):
            self.cond.notify_all()   # a promotion settled or pins dropped: what waiters wait for
        return lease, fills, discard, disk

    def note_hits(self, ns: Namespace, keys: Sequence[bytes], asked: int) -> int:
        """Account for a read served without a lease: a client copied the blocks of `keys` (the
        leading ones of the `asked` keys it wanted) straight out of their host slots, as the
        shared index published them (tierd/index.py). Does for them what `acquire` does for the
        blocks it leases — recency, hit counts, counters — for those still ready in host RAM.
        Returns how many were counted."""
        keys = check_keys(keys)
        with self.cond:
            self.cond.check_open()
            st = self.namespaces.state(ns, self.host, self.disk)
            found = [b for b in map(self.index.blocks.get, (st.ns_id + k for k in keys))
                     if b is not None and host_servable(b)]
            for b in reversed(found):   # ancestors touched last, as a lease does
                b.hits += 1
                self.index.host.policy.hit(b.ikey)
            n = len(keys)
            st.counters["hits"] += n
            st.counters["hit_bytes"] += n * st.block_bytes
            st.counters["misses"] += max(0, asked - n)
            self.index.host.counters["bytes_out"] += n * st.block_bytes
        return len(found)

    def _plan_acquire(self, st: NsState, keys: Sequence[bytes], plan: list, *, inline: bool = False) -> None:
        """(Lock held; may wait on it.) Pin the leading present blocks of `keys` into `plan`:
        (block, None) for a READY host block, (block, DiskEntry) for a promotion from disk into
        a new LOADING host slot, (block, REMOTE) for a fetch from the remote tier. `inline`:
        WouldBlock at the first block that is not READY in host RAM (or past the last one, when
        the remote tier may continue the prefix)."""
        for k in keys:
            ikey = st.ns_id + k
            b = self.index.blocks.get(ikey)
            if inline and b is not None and b.host_state != READY and (b.host_state == LOADING or b.disk is not None):
                raise WouldBlock()
            while b is not None and b.host_state == LOADING:
                # another request's promotion (its settle always ends it); a stalled disk or
                # a store closing ends the wait
                if self.health.note_stall():
                    b = None
                    break
                self.cond.wait(0.05)
                self.cond.check_open()
                b = self.index.blocks.get(ikey)
            if b is None:
                break
            if b.host_state == READY:
                if b.doomed & DOOM_HOST:    # flushed, still leased by someone: not served
                    break
                b.host_pins += 1
                plan.append((b, None))
                continue
            if not disk_servable(b) or self.health.note_stall():   # a stalled disk: a miss, not a wait
                break
            b.disk_pins += 1  # making room may evict from disk: not this block
            try:
                slot = self.demotion.host_alloc(st)
            finally:
                b.disk_pins -= 1
                self.index.reap(b)  # a flush meanwhile (the lock may have been let go) doomed it
            b = self.index.blocks.get(ikey)
            if b is not None and host_servable(b):  # promoted meanwhile
                if slot is not None:
                    self.host.free_slot(slot)
                b.host_pins += 1
                plan.append((b, None))
                continue
            if b is None or not disk_servable(b) or b.host_state != ABSENT or slot is None:
                if slot is not None:
                    self.host.free_slot(slot)
                break
            b.host_slot, b.host_state = slot, LOADING
            self.index.host.owner[slot] = b
            self.index.publish(b)
            b.host_pins += 1
            b.disk_pins += 1
            plan.append((b, b.disk))
        if self.remote.tier is not None and len(plan) < len(keys) and self.remote.ok():
            if inline:
                raise WouldBlock()
            self.remote.plan(st, keys, plan)

    def _settle_failed(self, st: NsState, plan: list) -> None:
        """(Lock held.) Undo an acquire's plan that will not be served: every pin it took is
        dropped and every slot it filled is given back, so nothing waits for it."""
        for b, e in plan:
            b.host_pins -= 1
            if e is None:
                self.index.reap(b)   # flushed while planned (the lock may have been let go): goes now
                continue
            if e is not REMOTE:
                b.disk_pins -= 1
            if b.host_state == LOADING:
                self.index.drop_host(b, evicted=False)
            self.index.reap(b)
        plan.clear()
        self.cond.notify_all()

    def _gpu_fill(self, lease: Lease, fills: list[int]) -> None:
        """Copy newly admitted blocks of `lease` into their HBM slots (no lock; the slots and the
        host copies are pinned by the lease), then make them visible to other leases."""
        blocks = [lease._blocks[i] for i in fills]
        # every copy queued, one wait for the lease (a failed one: the host copy serves it)
        ok = self.gpu.fill_many([(b.gpu_slot, self.host.view(b.host_slot, b.st.block_bytes)) for b in blocks])
        with self.cond:
            c = self.index.gpu.counters
            for i, good in zip(fills, ok):
                b = lease._blocks[i]
                b.gpu_filling = False
                if good:
                    self.index.gpu.policy.insert(b.ikey)
                    if self.feed.on:
                        self.feed.event(b, "gpu", True)
                    c["promotions"] += 1
                    c["bytes_in"] += b.st.block_bytes
                else:
                    b.gpu_pins -= 1
                    self.index.gpu.free(b.gpu_slot, evicted=False)
                    b.gpu_slot = -1
                    lease.gpu_offsets[i] = -1
            if lease.id:
                self.held.open_lease(lease)
            self.cond.notify_all()

    def _load_from_disk(self, loads: list[tuple[Block, DiskEntry]], sums: dict[int, int]) -> dict[int, Exception]:
        """Read pinned disk copies into their LOADING host slots in parallel (no lock); `sums`
        gets each block's verified checksum where the read knows it (by `id` of the block)."""
        errors: dict[int, Exception] = {}
        if not loads:
            return errors
        reads = []
        for b, e in loads:
            if e.codec in _codec.LOSSY and not b.st.lossy:
                errors[id(b)] = CorruptBlockError(f"a {_codec.CODEC_NAMES[e.codec]} (lossy) copy in an exact namespace")
            else:
                reads.append((b, e))
        # slots next to each other on disk are read in one call (each block still checked alone)
        got = [-1] * len(reads)
        failed = self.disk.read_many([(e, self.host.view(b.host_slot, b.st.host_slot_bytes)) for b, e in reads], got)
        for i, ex in failed.items():
            errors[id(reads[i][0])] = ex
        for (b, _), csum in zip(reads, got):
            if csum >= 0:
                sums[id(b)] = csum
        return errors

    def _tombstone(self, disk: DiskTier, slots: list[int], *, durable: bool = False) -> OSError | None:
        """(No lock.) Zero the headers of `slots` so that a restart does not bring their blocks
        back (and fdatasync with `durable`), then free the slots. Returns the error, if any."""
        err = None
        try:
            for slot in slots:
                disk.tombstone(slot)
            if durable:
                disk.flush()
        except OSError as e:
            err = e
        with self.cond:
            if self.disk is disk and not disk.closed:
                for slot in slots:
                    disk.free_slot(slot)
            if err is not None:
                self.health.error("tombstone", err)
            self.cond.notify_all()
        return err
