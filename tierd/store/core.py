"""`TieredStore`: the embedded block store — the Store interface, composed of its parts.

Owns which block lives where, who pins it, and when it moves: blocks enter host RAM (the hub),
are demoted to disk past the host's high watermark, promoted back to host on a hit (the disk
copy stays valid), copied to HBM when hit often (an inclusive cache of host blocks), and evicted
in policy order, descendants of a prefix chain before their ancestors. The tiers themselves
(`tierd.tiers`) are storage only, behind one interface; the store keeps one `Resident` record
per tier (slot owners, eviction order, counters) and moves blocks through that interface.

The parts (listed in `tierd/store/__init__.py`) are objects with their own fields, their
invariants written beside them, and the few collaborators each needs handed to it here: the
namespace table, the block index (with the tiers' residency records), the event feed, host
keeping, disk health, demotion, ownership (with its `Holdings`), the remote link and
promotion. This class creates them, keeps the write path itself (reserve, commit, put), the
flush and the close, which touch several parts at once, and the maintainer thread.

**The lock.** One lock (`_cond`, a `StoreLock`: lock.py), owned by the store and handed to
every part that takes it, guards every field of the store, of its parts and of its `Block`s,
the tiers' slot allocators and the residency records. A method documented "(Lock held.)" is
called with it held. It is held only for memory work: no disk, device or network I/O ever
runs under it, and nothing under it waits on such I/O (a stalled disk is detected from the
calls in flight, `DiskTier.oldest_io`, and skipped). Code that does I/O pins what it touches,
drops the lock, does the I/O, retakes the lock and settles, on every exit. An O(N) walk holds
it one chunk at a time (`_each_block`).
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import threading
import time
from collections.abc import Sequence

from ..config import StoreConfig, format_size
from ..costs import CostModel
from ..errors import (
    ConfigError,
    DiskDegradedError,
    LeaseError,
    TierdError,
)
from ..keys import check_keys, checksums_ok
from ..namespace import Namespace, shown_description
from ..policy import AdmissionFilter, make_policy
from ..tiers.disk import DiskTier
from ..tiers.host import HostTier
from ..transfer import as_u8, copy_out, fill_reservation
from .demotion import Demotion, FlushWalk
from .feed import EventFeed
from .health import DiskHealth
from .index import BlockIndex
from .keeping import HostKeeping, set_aside
from . import lock
from .lock import StoreLock
from .namespaces import NamespaceTable
from .ownership import Lease, Ownership, Reservation
from .promotion import Promotion
from .records import (
    DOOM_DISK,
    DOOM_HOST,
    LOADING,
    READY,
    RESERVED,
    Block,
    NsState,
    WouldBlock,
    disk_servable,
    has_copy,
    host_evictable,
    host_servable,
)
from .remote import RemoteLink

log = logging.getLogger("tierd.store")


class TieredStore:
    """Embedded tiered block store (host RAM + optional disk, HBM and remote tiers). Thread-safe.

    Besides its public surface, the tests read a few private names, kept here as views of the
    parts: `_cond`, `_blocks`, `_dirty`, `_clean_bytes`, `_dirty_bytes`, `_namespaces`, `_ns`,
    `_held` and `_demote_pass` (which the maintainer calls through the store)."""

    def __init__(self, config: StoreConfig | None = None, **overrides):
        cfg = dataclasses.replace(config) if config is not None else StoreConfig()
        for k, v in overrides.items():
            if k not in StoreConfig.__dataclass_fields__:
                raise ConfigError(f"unknown store setting {k!r}")
            setattr(cfg, k, v)
        self.config = cfg = cfg.resolved()
        self._cond = StoreLock()   # the one lock, and whether the store is closed (lock.py)
        self._namespaces = NamespaceTable()
        self._feed = EventFeed(self._cond, self._namespaces, walk=self._each_block,
                               remote_had=lambda b: self._remote.had(b))
        # which block lives where, and one residency record per tier (the tiers themselves are
        # storage only)
        self._index = BlockIndex(self._namespaces, self._feed, cfg.eviction_policy)
        self._blocks = self._index.blocks
        self._rh, self._rd, self._rg = self._index.host, self._index.disk, self._index.gpu
        self.costs = CostModel()  # loads against recompute, measured by the engines (tierd/costs.py)
        self._ids = itertools.count(1)   # reservation and lease ids
        # an earlier arena at the same path (host_keep): its blocks are re-adopted below
        old = set_aside(cfg.host_shm_path) if cfg.host_keep and cfg.host_shm_path else None
        self._rh.tier = HostTier(cfg.host_bytes, cfg.host_slab_bytes, shm_path=cfg.host_shm_path,
                                 shm_mode=cfg.host_shm_mode, keep=cfg.host_keep,
                                 reserve=False if old else None)
        self._keeping = self._index.keeping = HostKeeping(self._cond, self._index, self._namespaces)
        self._health = DiskHealth(self._cond, self._rd, cfg, forget=self._forget_disk,
                                  reopened=self._disk_reopened)
        self._demotion = Demotion(self._cond, self._index, self._health, cfg, walk=self._each_block)
        self._ownership = Ownership(self._cond, self._index, self._namespaces, self._demotion)
        self._held = self._ownership.held   # open reservations, leases and staged slots
        # the remote tier's side here (tiers/remote.py: no slots, the server owns capacity and
        # eviction)
        self._remote = RemoteLink(self._cond, self._index, self._feed, cfg,
                                  host_alloc=self._demotion.host_alloc, walk=self._each_block)
        self._promotion = Promotion(self._cond, self._index, self._namespaces, self._feed, self._held,
                                    self._demotion, self._health, self._remote, cfg, ids=self._ids, store=self)
        remote = None
        try:
            if cfg.gpu_bytes:
                from ..tiers.gpu import (
                    GpuTier,  # imports torch: only when an HBM tier is wanted
                )
                self.gpu = GpuTier(cfg.gpu_bytes, cfg.gpu_slab_bytes, cfg.gpu_device)
            if cfg.disk_path:
                self.disk = self._health.open_tier()
                self._rd.counters["corrupt_dropped"] = self.disk.corrupt_at_open
                self._index.adopt_recovered(self.disk)
            if old is not None:
                self._keeping.adopt(old)
                self.host.arena.reserve_now()
            if cfg.remote_url:
                # imports redis-py: only when a remote tier is wanted
                from ..tiers.remote import RemoteTier, read_fleet_key
                remote = RemoteTier(cfg.remote_url, timeout_s=cfg.remote_timeout_s,
                                    fleet_key=read_fleet_key(cfg.remote_fleet_key_file),
                                    codec=cfg.remote_codec, zstd_level=cfg.disk_zstd_level)
        except BaseException:
            self.host.close()
            if self.disk is not None:
                self.disk.close(None)
            raise
        if remote is not None:
            self._remote.connect(remote)
        self._maintainer = threading.Thread(target=self._maintain, name="tierd-demoter", daemon=True)
        self._maintainer.start()
        self._keeping._keep_start()

    # the tiers (storage only; the store's view of each is its Resident record)
    @property
    def host(self) -> HostTier:
        return self._rh.tier

    @property
    def disk(self) -> DiskTier | None:
        return self._rd.tier

    @disk.setter
    def disk(self, tier: DiskTier | None) -> None:
        self._rd.tier = tier

    @property
    def gpu(self):
        return self._rg.tier

    @gpu.setter
    def gpu(self, tier) -> None:
        self._rg.tier = tier

    def attach_index(self, index) -> None:
        """Publish every block's presence in `index` (a tierd.index.SharedIndex) from now on."""
        with self._cond:
            self._index.shared = index
            self._health.index = index   # told whether a stalled disk's copies count
            for b in self._blocks.values():
                self._index.publish(b)
            self._health.note_stall()

    def keep_pending(self) -> int:
        """Blocks in host RAM whose records for restarts are not written yet."""
        return self._keeping.pending()

    # (read by the tests and the model test: the block index's clean/dirty accounting)
    @property
    def _dirty(self) -> dict[bytes, Block]:
        return self._index.dirty

    @property
    def _clean_bytes(self) -> int:
        return self._index.clean_bytes

    @property
    def _dirty_bytes(self) -> int:
        return self._index.dirty_bytes

    SCAN_CHUNK = lock.SCAN_CHUNK       # an O(N) walk's chunks (lock.py)
    SCAN_HOLD_S = lock.SCAN_HOLD_S
    SCAN_YIELD_S = lock.SCAN_YIELD_S
    WRITE_BATCH = Demotion.WRITE_BATCH   # (read by the tests)

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
                self._cond.check_open()
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

    def _maintain(self) -> None:
        """The maintainer thread ("tierd-demoter"): once per `demotion_interval_s`, or when
        demotion asks for it (`Demotion.wake`), a look at the disk's health, then a demotion
        pass; what the pass wrote is made durable."""
        cfg = self.config
        wanted = self._demotion.wanted
        while True:
            # a pass when asked for (`Demotion.wake`) or once per interval: not on every
            # `notify_all` of the store's condition (each lease, commit, release, write settled)
            wanted.wait(cfg.demotion_interval_s)
            with self._cond:
                if self._cond.closed:
                    return
                wanted.clear()
            wrote = 0
            try:
                self._health.check()            # takes the lock itself, does its I/O without it
                with self._cond:
                    if not self._cond.closed:
                        wrote = self._demote_pass()   # releases the lock around disk writes
            except Exception:  # noqa: BLE001 -- the maintainer must outlive any one pass
                log.exception("tierd maintainer: unexpected error; continuing")
            if wrote and self.disk is not None:
                try:
                    self.disk.flush()
                except OSError as e:
                    with self._cond:
                        self._health.error("fdatasync", e)

    def _demote_pass(self) -> int:
        """(Lock held; let go during disk writes.) One demotion pass (`Demotion.demote_pass`);
        the maintainer calls it through the store (tests count its passes)."""
        return self._demotion.demote_pass()

    def unsynced_blocks(self) -> int:
        """Host blocks without a disk copy: what `sync()` would write."""
        return self._demotion.unsynced_blocks()

    def attach_events(self, publisher) -> None:
        """Record KV events (tierd.events) from now on, starting with a snapshot."""
        publisher.snapshot = self.snapshot_events
        self._feed.attach(publisher)

    def snapshot_events(self) -> None:
        """Record a clean slate per namespace, then what every tier holds (`EventFeed.snapshot`)."""
        self._feed.snapshot()

    def refresh_health(self) -> None:
        """Notice a stalled disk now (the daemon calls this with its heartbeat, so the shared
        index stops counting a hung disk's blocks even while nobody asks the daemon).
        Lock-free: see `DiskHealth.refresh`."""
        self._health.refresh()

    def _forget_disk(self) -> None:
        """(Lock held; `DiskHealth.check`: the disk tier's directory vanished.) Forget every
        disk copy (their files are gone); the caller then abandons the old tier outside the
        lock. Writes still under way are not waited for (one may hang for ever on a vanished
        directory): they settle as the dead tier's when they return (`Demotion.disk_epoch`), and
        nothing waits for them meanwhile."""
        self._demotion.forget_writes()
        self._index.forget_disk(make_policy(self.config.eviction_policy))
        self.disk.mark_closed()   # no new I/O goes to it

    def _disk_reopened(self, tier: DiskTier) -> None:
        """(Lock held; `DiskHealth.check`.) A fresh disk tier in the returning directory."""
        self.disk = tier
        self._index.adopt_recovered(self.disk)

    @property
    def remote(self):
        """The remote tier (`tiers/remote.py`: storage only), or None."""
        return self._remote.tier

    def remote_pending(self) -> int:
        """Blocks waiting for (or on their way to) the remote tier."""
        return self._remote.pending()

    def push_remote(self, max_blocks: int | None = None) -> int:
        """Send the remote tier every block this node holds in host RAM that the server lacks
        (`RemoteLink.push`); raises ConfigError where there is no remote tier."""
        return self._remote.push(max_blocks)

    def host_array(self):
        """The whole host arena as one uint8 array (for page-locking it, e.g. cudaHostRegister)."""
        return self.host.arena.array

    def register(self, ns: Namespace) -> None:
        """Make `ns` known (done implicitly by every operation that takes a Namespace).
        Raises CapacityError when a block of `ns` cannot fit a tier."""
        with self._cond:
            self._cond.check_open()
            self._ns(ns)

    def _ns(self, ns) -> NsState:
        """(Lock held.) The state of `ns` (`NamespaceTable.state`)."""
        return self._namespaces.state(ns, self.host, self.disk)

    def _ns_for_flush(self, namespace) -> bytes:
        return self._namespaces.flush_scope(namespace)

    def namespace_count(self) -> int:
        with self._cond:
            return len(self._namespaces)

    def namespace(self, name: str) -> Namespace:
        """The registered Namespace whose name (or hex id) is `name`."""
        with self._cond:
            return self._ns(name).ns

    def forget_unused(self, names) -> list[str]:
        """Forget the namespaces among `names` that nothing refers to: no block in any local
        tier (and so no lease or reservation) and no staged slot, which a client's next put
        names with no request first. The daemon's table of namespaces stays bounded. A
        forgotten one is registered again by its next user (a client does it by itself on
        `unknown_namespace`). Returns the names forgotten."""
        with self._cond:
            return self._namespaces.forget(names)

    def reserve(self, ns: Namespace, keys: Sequence[bytes], *, parent: bytes | None = None,
                owner=None, token_ids: Sequence[int] | None = None, inline: bool = False) -> Reservation:
        """Host slots to write `keys` into (zero-copy put). Commit or abort the result.
        `token_ids` (optional, `block_tokens` per key): the blocks' tokens, for KV events only
        (an indexer computes its own keys from them); never stored. `inline`: raise WouldBlock,
        changing nothing but clean host copies dropped (`Demotion.host_room_inline`), unless free slots
        take every key at once with no I/O and no wait."""
        keys = check_keys(keys)
        with self._cond:
            self._cond.check_open()
            st = self._ns(ns)
            if inline and not self._demotion.host_room_inline(st, self._slots_needed(st, keys)):
                raise WouldBlock()
            res = self._reserve_locked(st, keys, parent, owner, token_ids)
            if res.id:
                self._held.open_reservation(res)
            return res

    def _slots_needed(self, st: NsState, keys: Sequence[bytes]) -> int:
        """(Lock held.) How many host slots reserving `keys` may take: one per key that is
        absent (or doomed by a flush), never fewer."""
        pid, blocks = st.ns_id, self._blocks
        n = 0
        for k in keys:
            b = blocks.get(pid + k)
            n += b is None or b.doomed != 0 or not has_copy(b)
        return n

    def _reserve_locked(self, st: NsState, keys: list[bytes], parent: bytes | None, owner,
                        token_ids, slots: list[int] | None = None) -> Reservation:
        """(Lock held.) Blocks RESERVED for `keys`: in new host slots, or in `slots[i]` (a
        staged slot of the writer's, already written; -1: the writer skipped the key) — a slot
        given for a key that turns out present goes back to the free pool."""
        if token_ids is not None and len(token_ids) != len(keys) * st.ns.block_tokens:
            raise TierdError(f"reserve: {len(token_ids)} token ids for {len(keys)} blocks of "
                             f"{st.ns.block_tokens} tokens")
        pid = st.ns_id
        status, blocks = [], []
        rid = next(self._ids)
        for i, k in enumerate(keys):
            ikey = pid + k
            b = self._blocks.get(ikey)
            if b is not None and self._index.retire_doomed(b):   # flushed while pinned: written anew
                b = None
            given = slots[i] if slots is not None else None
            if given == -1 or (b is not None and has_copy(b)):
                if given is not None and given >= 0:
                    self.host.free_slot(given)
                status.append("present"); blocks.append(None)
                continue
            slot = given if given is not None else self._demotion.host_alloc(st)
            b = self._blocks.get(ikey)  # the lock may have been released
            if b is not None and self._index.retire_doomed(b):
                b = None
            if b is not None and has_copy(b):
                if slot is not None:
                    self.host.free_slot(slot)
                status.append("present"); blocks.append(None)
                continue
            if slot is None:
                st.counters["put_dropped"] += 1
                status.append("full"); blocks.append(None)
                continue
            if b is None:
                b = self._index.new_block(ikey, st, k)
            b.host_slot, b.host_state, b.owner_res = slot, RESERVED, rid
            b.decoded = False   # the writer's own bytes
            b.doomed = 0
            self._rh.owner[slot] = b
            status.append("reserved")
            blocks.append(b)
        offsets = [self.host.alloc.offset(b.host_slot) if b is not None else None for b in blocks]
        if not any(b is not None for b in blocks):
            # Nothing to write: no reservation is left open (id 0; commit and abort are
            # no-ops), and the chain is re-linked for eviction order now.
            self._index.relink(st.ns_id, keys, parent)
            res = Reservation(0, st.ns, keys, status, blocks, owner, offsets, self.host)
            res._parent = parent
            return res
        res = Reservation(rid, st.ns, keys, status, blocks, owner, offsets, self.host)
        res._parent = parent
        res._tokens = list(token_ids) if token_ids is not None and self._feed.on else None
        return res

    def commit(self, res: Reservation) -> int:
        """Make the reserved blocks visible. Returns how many became visible."""
        if res.id == 0:
            return 0   # nothing was reserved
        if res.checksums is not None and not checksums_ok(res.checksums, len(res.keys)):
            raise TierdError(f"commit: checksums must hold one 64-bit checksum (or -1) for each of "
                             f"the {len(res.keys)} keys")
        with self._cond:
            self._cond.check_open()
            if self._held.end_reservation(res.id) is None:
                raise LeaseError(f"reservation {res.id} is unknown or already committed/aborted")
            return self._commit_locked(res)

    def _commit_locked(self, res: Reservation) -> int:
        """(Lock held.) Make a reservation's blocks visible (it is no longer registered)."""
        pid = res.namespace.id
        n = 0
        sums = res.checksums   # (checked by `commit`, `put_staged` and the daemon's requests)
        # Links first, then residency in reverse chain order so that the chain's tail is
        # the least recent: descendants are evicted before their ancestors.
        for i, b in enumerate(res._blocks):
            if b is not None:
                self._index.link(b, pid + res.keys[i - 1] if i else (pid + res._parent if res._parent else None))
        for i in range(len(res._blocks) - 1, -1, -1):
            b = res._blocks[i]
            if b is None or b.host_state != RESERVED or b.owner_res != res.id:
                continue
            b.host_state, b.owner_res = READY, 0
            b.csum = sums[i] if sums is not None else -1
            self._rh.policy.insert(b.ikey)
            self._index.enter(b, "host", event=False)   # events below, in chain order
            b.st.counters["puts"] += 1
            b.st.counters["put_bytes"] += b.st.block_bytes
            self._rh.counters["bytes_in"] += b.st.block_bytes
            n += 1
            for f in self._demotion.flushing:   # committed after these flushes began: not theirs to drop
                if f.covers(b):
                    f.born.add(b)
        self._index.relink(pid, res.keys, res._parent)
        if self._feed.on:
            bt = len(res._tokens) // len(res.keys) if res._tokens else 0
            for i, b in enumerate(res._blocks):
                if b is not None and b.host_state == READY and b.owner_res == 0:
                    self._feed.event(b, "host", True, res._tokens[i * bt:(i + 1) * bt] if bt else None)
        if self.remote is not None and self.config.remote_write_behind:   # in chain order
            for b in res._blocks:
                if b is not None and b.host_state == READY and b.owner_res == 0:
                    self._remote.enqueue(b)
        self._demotion.wake()
        self._cond.notify_all()
        return n

    def abort(self, res: Reservation) -> None:
        """Give back the slots of an uncommitted reservation."""
        self._ownership.abort(res)

    def release(self, lease: Lease, *, confirm: bool = False) -> None:
        """End a lease; its buffers must no longer be read. (`confirm` is for the daemon's
        client, where a lease can be lost with its connection; here it cannot.)"""
        self._ownership.release(lease, confirm=confirm)

    def find_reservation(self, rid: int, owner, *, missing_ok: bool = False) -> Reservation | None:
        """The open reservation `rid` held by `owner`; LeaseError otherwise (the daemon's check
        that a client names only its own slots)."""
        return self._ownership.find_reservation(rid, owner, missing_ok=missing_ok)

    def find_lease(self, lid: int, owner) -> Lease:
        """The open lease `lid` held by `owner`; LeaseError otherwise."""
        return self._ownership.find_lease(lid, owner)

    def drop_owner(self, owner) -> tuple[int, int]:
        """Abort every reservation and release every lease held by `owner` (a disconnected
        client), and give back its staged slots. Returns (reservations aborted, leases released)."""
        return self._ownership.drop_owner(owner)

    def stage(self, ns: Namespace, n: int, *, owner, inline: bool = False,
              limit_bytes: int | None = None, pool_bytes: int | None = None) -> list[int]:
        """Up to `n` free host slots of `ns`'s slot size for `owner` to write blocks into before
        it names their keys (`put_staged`): their byte offsets in the arena (`Ownership.stage`)."""
        return self._ownership.stage(ns, n, owner=owner, inline=inline, limit_bytes=limit_bytes,
                                     pool_bytes=pool_bytes)

    def put_staged(self, ns: Namespace, keys: Sequence[bytes], offsets: Sequence[int], *, owner,
                   parent: bytes | None = None, token_ids: Sequence[int] | None = None,
                   checksums: Sequence[int] | None = None) -> int:
        """Store the blocks `owner` wrote into its staged slots: `keys[i]`'s block is at
        `offsets[i]` (-1: not written, the writer found it present). All at once, as `commit`:
        each slot becomes its block's, or goes back to the free pool where the key is present
        (or repeated). LeaseError, changing nothing, if any offset is not one of `owner`'s
        staged slots of this namespace. `checksums`: per key, the writer's checksum
        of what it wrote (see `Reservation.checksums`). Returns how many blocks were newly stored."""
        keys = check_keys(keys)
        if len(offsets) != len(keys):
            raise TierdError(f"put: {len(keys)} keys but {len(offsets)} slots")
        if checksums is not None:
            checksums = list(checksums)
            if not checksums_ok(checksums, len(keys)):
                raise TierdError(f"put: checksums must hold one 64-bit checksum (or -1) for each of the "
                                 f"{len(keys)} keys")
        with self._cond:
            self._cond.check_open()
            st = self._ns(ns)
            if token_ids is not None and len(token_ids) != len(keys) * st.ns.block_tokens:
                raise TierdError(f"put: {len(token_ids)} token ids for {len(keys)} blocks of "
                                 f"{st.ns.block_tokens} tokens")
            slots = self._held.take_staged(owner, offsets, st)
            res = self._reserve_locked(st, keys, parent, owner, token_ids, slots=slots)   # never lets go of the lock
            if not res.id:
                return 0
            res.checksums = checksums
            return self._commit_locked(res)

    def unstage(self, owner, offsets: Sequence[int] | None = None) -> int:
        """Give `owner`'s staged slots at `offsets` (None: all of them) back to the free pool;
        offsets it does not hold are ignored. Returns how many went back."""
        return self._ownership.unstage(owner, offsets)

    def staged_slots(self, owner=...) -> int:
        """Staged slots held by `owner` (all owners when not given)."""
        return self._ownership.staged_slots(owner)

    def put(self, ns: Namespace, keys: Sequence[bytes], blocks: Sequence, *,
            parent: bytes | None = None, token_ids: Sequence[int] | None = None) -> int:
        """Store `blocks[i]` under `keys[i]` (a prefix chain in order; `parent` is the key
        before `keys[0]`). Already-present keys are skipped; under pressure blocks may be
        dropped. Returns how many blocks were newly stored."""
        keys = check_keys(keys)
        if len(blocks) != len(keys):
            raise TierdError(f"put: {len(keys)} keys but {len(blocks)} blocks")
        with self._cond:
            self._cond.check_open()
            st = self._ns(ns)
        views = [as_u8(blk, st.block_bytes, st.desc.get("kv_dtype", "")) for blk in blocks]
        res = self.reserve(ns, keys, parent=parent, token_ids=token_ids)
        fill_reservation(self, res, views, hashed=self.host.records is not None)
        return self.commit(res)

    def lookup(self, ns: Namespace, keys: Sequence[bytes]) -> int:
        """Number of leading `keys` present in any tier."""
        return self._leading(ns, keys)[0]

    def lookup_all(self, queries: Sequence[tuple[Namespace, Sequence[bytes]]], *,
                   host: bool = False) -> list[int] | list[tuple[int, int]]:
        """`lookup` for several (namespace, keys) pairs at once (e.g. every tensor-parallel
        rank's chain of one prompt): one call, one answer per pair. With `host`, each answer is
        (leading keys present in any tier, leading keys ready in host RAM): a load of more than
        the second number needs a promotion from disk."""
        found = [self._leading(ns, keys) for ns, keys in queries]
        return found if host else [n for n, _ in found]

    def _leading(self, ns: Namespace, keys: Sequence[bytes]) -> tuple[int, int]:
        """(leading keys present in any tier, leading keys ready in host RAM)."""
        keys = check_keys(keys)
        with self._cond:
            self._cond.check_open()
            st = self._ns(ns)
            st.counters["lookups"] += 1
            disk_ok = self.disk is not None and not self._health.note_stall()
            n = n_host = 0
            for k in keys:
                b = self._blocks.get(st.ns_id + k)
                if b is None or not ((b.host_state in (READY, LOADING) and not b.doomed & DOOM_HOST)
                                     or (disk_servable(b) and disk_ok)):
                    break
                if n_host == n and host_servable(b):
                    n_host += 1
                n += 1
            rest = self.remote is not None and n < len(keys)
        if rest:   # the remote tier may continue the prefix (asked outside the lock)
            n += self._remote.leading(st, keys[n:])
        return n, n_host

    def where(self, ns: Namespace, keys: Sequence[bytes]) -> list[str]:
        """Per key: "host", "disk", "host+disk" or "" (absent): the copies a new reader would be
        served (a copy a flush dropped while it was leased is not, though it lives on until the
        lease ends)."""
        keys = check_keys(keys)
        with self._cond:
            st = self._ns(ns)
            out = []
            for k in keys:
                b = self._blocks.get(st.ns_id + k)
                tiers = []
                if b is not None and host_servable(b):
                    tiers.append("host")
                if b is not None and disk_servable(b):
                    tiers.append("disk")
                out.append("+".join(tiers))
            return out

    def is_quick(self, op: str, ns: Namespace, keys: Sequence[bytes], *, gpu: bool = False) -> bool:
        """Whether `acquire` or `reserve` of `keys` would finish without disk I/O, a copy into
        HBM or waiting for room (`Promotion.is_quick`)."""
        return self._promotion.is_quick(op, ns, keys, gpu=gpu)

    def acquire(self, ns: Namespace, keys: Sequence[bytes], *, owner=None, gpu: bool = False,
                inline: bool = False, pipelined: bool = False) -> Lease:
        """Lease the longest present prefix of `keys`, promoting disk blocks to host RAM
        (`Promotion.acquire`). `gpu`: the caller reads HBM copies (`lease.gpu_buffers`);
        `inline` (the daemon's event loop thread): raise WouldBlock, changing nothing, when it
        would read a tier, wait for another promotion or copy into HBM. `pipelined`: as
        `Client.acquire`'s, for the same interface; a lease here is pinned when it returns."""
        return self._promotion.acquire(ns, keys, owner=owner, gpu=gpu, inline=inline)

    def note_hits(self, ns: Namespace, keys: Sequence[bytes], asked: int) -> int:
        """Account for a read served without a lease (`Promotion.note_hits`)."""
        return self._promotion.note_hits(ns, keys, asked)

    def get(self, ns: Namespace, keys: Sequence[bytes], out: Sequence | None = None) -> list:
        """The blocks of the longest present prefix of `keys` (`len(result) <= len(keys)`):
        new (block_bytes,) uint8 arrays, or copied into `out[i]` (any writable buffer of
        block_bytes, e.g. a CPU tensor) and those returned."""
        if out is not None and len(out) < len(keys):
            raise TierdError(f"get: {len(keys)} keys but only {len(out)} output buffers")
        with self._cond:
            self._cond.check_open()
            st = self._ns(ns)
        dsts = None if out is None else [as_u8(o, st.block_bytes, st.desc.get("kv_dtype", "")) for o in out]
        with self.acquire(ns, keys) as lease:
            return copy_out(lease, dsts, out)

    def flush(self, tier: str = "all", namespace=None) -> int:
        """Drop blocks from `tier` ("gpu", "host", "disk" or "all"), of one namespace or all:
        those held when the flush begins; what is committed while it runs is kept (and written
        down as usual). A copy that is pinned (leased, being read in, being written down) is
        dropped as soon as its pins go and never served meanwhile. Returns the number of
        blocks dropped."""
        if tier not in ("host", "disk", "all", "gpu", "remote"):
            raise TierdError(f"flush: unknown tier {tier!r}; use gpu, host, disk, remote or all")
        absent = {"gpu": not self.config.gpu_bytes and "an HBM tier ([gpu] bytes)",
                  "disk": not self.config.disk_path and "a disk tier (disk.path, --disk-path)",
                  "remote": not self.config.remote_url and "a remote tier ([remote] url)"}.get(tier)
        if absent:
            raise ConfigError(f"flush --tier {tier}: this store has no {tier} tier; nothing dropped "
                              f"(configure {absent} to have one)")
        if tier == "remote":
            with self._cond:
                self._cond.check_open()
                ns_id = None if namespace is None else self._ns_for_flush(namespace)
            return self._remote.flush(ns_id)
        with self._cond:
            self._cond.check_open()
            ns_id = None if namespace is None else self._ns_for_flush(namespace)
            dropped = 0
            disk = self.disk
            fence = tier in ("disk", "all") and disk is not None and not disk.closed
            if fence:
                # Every copy written before now is dead, indexed or not (copies evicted earlier
                # left valid headers behind): recovery and write settles check the fence. A
                # write's number is taken when its slot is chosen, under this lock, so one
                # chosen before now is below the fence wherever it lands. The walk below lets
                # go of the lock between chunks: until it is done no write-down of a block of
                # this scope it may still walk starts (`Demotion._write_down_batch`), else such
                # a block could be written with a number above the fence and then dropped from
                # memory only. Blocks committed from now on are not walked, so they are written
                # down.
                disk.set_fence(ns_id)
                self._demotion.flushes_begun += 1
            walk = FlushWalk(ns_id, fenced=fence, drops_host=tier in ("host", "all"))
            self._demotion.flushing.append(walk)
        born = walk.born

        def one(b: Block) -> None:
            nonlocal dropped
            if b in born:                 # committed after the flush began: not its to drop
                return
            hit = False
            if tier == "gpu" and b.gpu_slot >= 0 and b.gpu_pins == 0:
                self._index.drop_gpu(b, evicted=False)
                hit = True
            if tier in ("host", "all") and b.host_state in (READY, LOADING):
                if host_evictable(b):
                    self._index.drop_host(b, evicted=False)
                else:                     # leased, being read in or written down: goes after
                    self._index.doom(b, DOOM_HOST)
                hit = True
            if tier in ("disk", "all") and disk is not None and (b.disk is not None or b.disk_writing):
                if b.disk is not None and b.disk_pins == 0 and not b.disk_writing:
                    self._index.drop_disk(b, evicted=False)   # its slot may be reused at once
                else:
                    self._index.doom(b, DOOM_DISK)
                for dropped_for in self._demotion.syncing:
                    dropped_for.add(b)
                hit = True
            dropped += hit
        try:
            self._each_block(one, ns_id)
        finally:
            with self._cond:
                self._demotion.flushing.remove(walk)
                self._cond.notify_all()   # a sync or an allocation waits for it (demotion.py)
        # Gone from the index now; the fence is made durable outside the lock.
        if fence:
            try:
                disk.save_fences()
            except OSError as e:
                with self._cond:
                    self._health.error("flush record", e)
                raise DiskDegradedError(f"flush: {dropped} blocks were dropped but the flush could not be "
                                        f"recorded on disk ({e}); they may come back after a restart") from None
        return dropped

    def sync(self, max_blocks: int | None = None) -> int:
        """Write every host-only block (the first `max_blocks` of them) to disk and make all
        disk writes durable; a reopen then serves them. Returns only once every such block
        there when it was called is on disk (a flush under way is waited for, up to
        `Demotion.SYNC_WAIT_S`: it holds back the writes of its scope), or one a flush or an
        eviction has dropped since. With a remote tier, also wait (up to `RemoteLink.DRAIN_S`) until its
        write-behind queue has gone to the server (`remote_pending` says what is left).
        Returns the number of blocks written to disk. Raises DiskDegradedError when the disk
        tier is failing, DiskTierError when it could not take every block (no room, or a
        flush that did not end in time), naming how many are in host RAM only: nothing is
        acknowledged durable that is not."""
        written = self._demotion.sync_disk(max_blocks)
        if self.remote is not None:
            with self._cond:
                self._remote.drain(RemoteLink.DRAIN_S)
        return written

    def reconfigure(self, new: StoreConfig) -> None:
        """Apply the settings that can change while running: watermarks and SSD admission."""
        new = new.resolved()
        with self._cond:
            for name in ("host_high_watermark", "host_low_watermark", "host_dirty_ratio", "disk_high_watermark",
                         "disk_low_watermark", "disk_admit_min_hits"):
                setattr(self.config, name, getattr(new, name))
            self._demotion.admission = AdmissionFilter(new.disk_admit_min_hits)
            self._demotion.wake()

    def stats(self) -> dict:
        """Counters and gauges per tier and per namespace (see docs/operations.md)."""
        with self._cond:
            self._health.note_stall()
            tiers = {"host": self._rh.stats(extra_waste=self._index.pad_bytes)}
            # clean: READY with a disk copy (dropped with no I/O when the room is needed);
            # dirty: READY with none yet (the demoter writes the oldest down past the watermark)
            tiers["host"].update(clean_bytes=self._index.clean_bytes,
                                 dirty_bytes=self._index.dirty_bytes)
            tiers["host"].update(self._keeping.stats())
            if self.gpu is not None:
                tiers["gpu"] = self._rg.stats()
            if self.disk is not None:
                pad = sum(st.counters["disk_blocks"] * (st.disk_slot_bytes - st.block_bytes)
                          for st in self._namespaces.values())
                disk = self._rd.stats(extra_waste=pad)
                episodes = self._health.episodes
                disk.update(degraded=episodes.fault or "",
                            degraded_seconds=time.monotonic() - episodes.since if episodes.fault else 0.0,
                            degraded_episodes=episodes.count)
                tiers["disk"] = disk
            if self.remote is not None:
                tiers["remote"] = self._remote.stats()
            namespaces = {}
            for st in self._namespaces.values():
                c = dict(st.counters)
                asked = c["hits"] + c["misses"]
                c["hit_rate"] = c["hits"] / asked if asked else 0.0
                c["block_bytes"] = st.block_bytes
                c["label"] = st.label
                c["description"] = shown_description(st.desc)
                namespaces[st.name] = c
            reservations, leases, staged = self._held.counts()
            return {"tiers": tiers, "namespaces": namespaces, "leases": leases, "reservations": reservations,
                    "staged_slots": staged, "policy": self.config.eviction_policy, "time": time.time(),
                    "costs": self.costs.describe()}

    def cost_model(self, *, sync: bool = True, now: bool = False) -> CostModel:
        """The node's cost model (tierd/costs.py): what connectors decide loads with and record
        their measurements and ledger in."""
        return self.costs

    CLOSE_WAIT_S = 10.0   # how long close waits for disk writes in flight (never for a hung disk)

    def close(self, *, sync: bool = False) -> None:
        """Stop background work, flush the disk tier and write its checkpoint. Host-only blocks
        are lost unless `sync=True` (or `sync()` was called). Always completes: a disk that
        hangs or fails is left without a checkpoint (the next open scans its headers)."""
        if sync and not self._cond.closed:
            try:
                self.sync()
            except TierdError as e:   # (what it could not write is lost; the close still happens)
                log.error("close: %s", e)
        with self._cond:
            if self._cond.closed:
                return
            self._cond.closed = True
            self._cond.notify_all()
            self._demotion.wanted.set()     # the maintainer ends
        deadline = time.monotonic() + self.CLOSE_WAIT_S
        self._maintainer.join(max(0.1, deadline - time.monotonic()))
        self._remote.close()
        with self._cond:
            while self._demotion.writes_in_flight and time.monotonic() < deadline and not self._health.note_stall():
                self._cond.wait(0.05)
            stuck = self._demotion.writes_in_flight or self._demotion.batch_writing or self._maintainer.is_alive()
            for r in self._held.end_all_reservations():
                self._ownership.abort_locked(r)
            entries = [b.disk for b in self._blocks.values() if b.disk is not None]
        disk = self.disk
        if disk is not None:
            if stuck or (disk.oldest_io() is not None):
                log.error("disk tier: I/O still in flight at close (a hung disk?); closing without a "
                          "checkpoint, the next start scans the slot headers")
                disk.mark_closed()
            else:
                try:
                    disk.close(entries)
                except Exception as e:  # noqa: BLE001 -- the next open scans instead
                    log.error("disk tier: closing failed (%s); no checkpoint written, the next start "
                              "scans the slot headers", e)
        if self.gpu is not None:
            self.gpu.close()
        self._keeping.close()
        kept = sum(1 for b in self._blocks.values() if b.host_slot >= 0 and b.host_state == READY)
        keep = self.config.host_keep and kept > 0   # an empty arena is not worth its memory
        self.host.close(keep=keep)
        if keep and self.host.records is not None:
            log.info("kept the host arena %s (%d blocks, %s of shared memory) for the next start to "
                     "re-adopt; `tierd clean` removes it once no daemon will start on it", self.host.arena.path,
                     kept, format_size(self.host.capacity_bytes))

    def __enter__(self) -> "TieredStore":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
