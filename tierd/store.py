"""`TieredStore`: the embedded block store — index, pins, policy and the Store interface.

Owns which block lives where, who pins it, and when it moves: blocks enter host RAM (the hub),
are demoted to disk past the host's high watermark, promoted back to host on a hit (the disk
copy stays valid), copied to HBM when hit often (an inclusive cache of host blocks), and evicted
in policy order, descendants of a prefix chain before their ancestors. The tiers themselves
(`tierd.tiers`) are storage only, behind one interface; the store keeps one `_Resident` record
per tier (slot owners, eviction order, counters) and moves blocks through that interface.

Invariants (the tests and the crash harness hold the store to them):

- **The lock.** One lock (`_cond`) guards every field of the store and of its `_Block`s, the
  tiers' slot allocators and the residency records. It is held only for memory work: no disk,
  device or network I/O ever runs under it, and nothing under it waits on such I/O (a stalled
  disk is detected from the calls in flight, `DiskTier.oldest_io`, and skipped). Code that does
  I/O pins what it touches, drops the lock, does the I/O, retakes the lock and settles.
- **Pins.** `host_pins > 0` (a lease, a copy to disk or HBM in flight): the host slot is neither
  freed nor reused, so its bytes stay the block's. `disk_pins > 0` (a read in flight): the disk
  copy is not evicted. `gpu_pins > 0` (a lease, or the copy into HBM in flight): the HBM slot
  stays. A slot taken out of the index for erasure (a tombstone being written) stays allocated,
  owned by no block, until the erase is done.
- **Block states.** In host RAM a block is ABSENT, RESERVED (a writer's slot, invisible, owned by
  one reservation), LOADING (a disk read into its slot in flight, invisible to acquire until
  READY, counted by lookup) or READY (servable). On disk it has a copy (`disk`, an index entry
  whose header and payload were written and read back only through checksums) or a write in
  flight (`disk_writing`, host copy pinned). A block is in the index iff it has a host slot, a
  disk copy or a disk write in flight; a READY block is in its tier's eviction order, a
  RESERVED or LOADING one is not.
- **What is served.** Only READY host slots are leased; a disk copy reaches a client only by
  being read into a host slot and verified first; a block that fails verification is dropped
  from the index and erased on disk, never served.
- **Ownership.** Every reservation and lease has an owner (a daemon connection) and ends —
  committed, aborted, released, or reclaimed with its connection; a request that touches
  nothing leaves nothing open (id 0).
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import logging
import os
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from . import codec as _codec
from . import events
from .arena import slot_bytes_for
from .config import StoreConfig
from .errors import (ConfigError, DiskDegradedError, LeaseError, StoreClosedError, TierdError,
                     UnknownNamespaceError)
from .keys import check_keys
from .namespace import Namespace
from .policy import AdmissionFilter, make_policy
from .tiers.disk import CorruptBlockError, DiskEntry, DiskTier
from .tiers.base import BlockMeta
from .tiers.host import HostTier
from .transfer import as_u8, copy_out, fill_reservation

log = logging.getLogger("tierd.store")


class WouldBlock(Exception):
    """(Internal.) An operation asked to run `inline` (on the daemon's event loop thread) would
    need I/O or a wait: nothing was changed; run it on a worker thread instead."""

# host_state of a block
ABSENT, RESERVED, LOADING, READY = 0, 1, 2, 3
REMOTE = "remote"   # in an acquire's plan: a block fetched from the remote tier


@dataclass(slots=True)
class _NsState:
    """A namespace as the store knows it; `ns` is None for one known only from disk."""

    ns_id: bytes
    ns: Namespace | None
    block_bytes: int
    dtype_bytes: int
    host_slot_bytes: int
    disk_slot_bytes: int
    desc: dict
    records: int = 0          # its blocks in the store's index (any state): 0 = it may be forgotten
    forgotten: bool = False   # dropped from the table while unused; revived by its next block
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

    def meta(self, key: bytes, parent: bytes | None, *, exact: bool = False) -> BlockMeta:
        """How a block of this namespace is written to a tier; `exact`: never with the lossy
        codec (its bytes were decoded from a lossy copy already: a second quantisation would
        compound the error past the codec's bound)."""
        return BlockMeta(self.ns_id, key, parent, self.block_bytes, self.dtype_bytes,
                         "" if exact else self.lossy, self.desc.get("kv_dtype", ""))


@dataclass(slots=True, eq=False)
class _Block:
    """One block known to the store. Invariant: present in `_blocks` iff it has a host slot
    (any state) or a disk copy or a disk write in flight."""

    ikey: bytes                 # ns_id + key: the index key
    st: _NsState
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


class Reservation:
    """Slots handed to a writer; a block becomes visible at `commit`.

    `status[i]` is "reserved" (write `buffers[i]`), "present" (already stored: skip) or
    "full" (no room: the store dropped it).
    """

    def __init__(self, rid: int, ns: Namespace, keys: list[bytes], status: list[str],
                 blocks: list[_Block | None], owner, offsets: list[int | None], host):
        self.id = rid
        self.namespace = ns
        self.keys = keys
        self.status = status
        self.offsets = offsets  # byte offset of each reserved slot in the host arena
        self._blocks = blocks
        self.owner = owner
        self._host = host
        self._buffers = None
        self._tokens = None   # token ids of the keys, for KV events (when the store publishes them)

    @property
    def buffers(self) -> list[np.ndarray | None]:
        """Per key: a writable (block_bytes,) uint8 view of its reserved slot, or None. Made on
        first use (the daemon hands out offsets and never needs them)."""
        if self._buffers is None:
            n = self.namespace.block_bytes
            self._buffers = [self._host.arena.view(o, n) if o is not None else None for o in self.offsets]
        return self._buffers

    @property
    def num_reserved(self) -> int:
        return sum(s == "reserved" for s in self.status)


class Lease:
    """Read pins on the slots of the leading present blocks of a request.

    `buffers[i]` is a read-only (block_bytes,) uint8 view of block `keys[i]`, valid until
    `release`. Use as a context manager to release on exit.
    """

    def __init__(self, lid: int, ns: Namespace, keys: list[bytes], blocks: list[_Block],
                 tiers: list[str], owner, store: "TieredStore", offsets: list[int]):
        self.id = lid
        self.namespace = ns
        self.keys = keys
        self._buffers = None
        self.offsets = offsets  # byte offset of each leased slot in the host arena
        self.tiers = tiers  # where each block was found: "host" or "disk" (promoted)
        self.gpu_offsets: list[int] = []     # per block: byte offset in the HBM tier, or -1
        self.gpu_buffers: list = []          # per block: (block_bytes,) device view, or None
        self._blocks = blocks
        self.owner = owner
        self._store = store

    @property
    def buffers(self) -> list[np.ndarray]:
        """Per leased block: a read-only (block_bytes,) uint8 view of its slot, valid until
        `release`. Made on first use (the daemon hands out offsets and never needs them)."""
        if self._buffers is None:
            n = self.namespace.block_bytes
            arena = self._store.host.arena
            views = []
            for o in self.offsets:
                v = arena.view(o, n).view()
                v.flags.writeable = False
                views.append(v)
            self._buffers = views
        return self._buffers

    def __len__(self) -> int:
        return len(self.keys)

    def __enter__(self) -> "Lease":
        return self

    def __exit__(self, *exc) -> None:
        if self._blocks is not None:
            self._store.release(self)


COUNTERS = ("evictions", "demotions", "promotions", "bytes_in", "bytes_out", "corrupt_dropped",
            "admission_rejected", "io_errors")


class _Health:
    """A tier's fault episodes: the first error degrades it (logged once), every error pushes the
    next probe back by `retry_s`, a success ends the episode (logged once)."""

    __slots__ = ("tier", "retry_s", "serving", "fault", "since", "retry_at", "count")

    def __init__(self, tier: str, retry_s: float, serving: str):
        self.tier, self.retry_s, self.serving = tier, retry_s, serving
        self.fault: str | None = None      # why the tier is degraded; None: healthy
        self.since = self.retry_at = 0.0
        self.count = 0                     # episodes so far

    def error(self, what: str, e: BaseException) -> None:
        now = time.monotonic()
        if self.fault is None:
            self.fault = f"{what}: {e}"
            self.since = now
            self.count += 1
            log.error("%s tier degraded (%s); %s, retrying every %.0fs", self.tier, self.fault, self.serving,
                      self.retry_s)
        self.retry_at = now + self.retry_s

    def healthy(self) -> None:
        if self.fault is not None:
            log.warning("%s tier recovered after %.1fs (was: %s)", self.tier, time.monotonic() - self.since,
                        self.fault)
            self.fault = None


class _Resident:
    """The store's record of one tier: which block owns each of its slots, the tier's eviction
    order, its counters, and how a block's slot, resident children and evictability are read
    (the block fields differ per tier). Allocation with eviction and slab reclaim are written
    once, for every tier, in terms of this record (TieredStore._alloc, _evict_slab)."""

    __slots__ = ("name", "tier", "owner", "policy", "counters", "slot_of", "children_of", "evictable")

    def __init__(self, name: str, policy, *, slot_of, children_of, evictable):
        self.name = name
        self.tier = None                       # the Tier (None: not configured)
        self.owner: dict[int, _Block] = {}     # slot -> the block holding it
        self.policy = policy                   # eviction order of the blocks resident here
        self.counters = dict.fromkeys(COUNTERS, 0)
        self.slot_of, self.children_of, self.evictable = slot_of, children_of, evictable

    def stats(self, extra_waste: int = 0) -> dict:
        u = self.tier.usage()
        u["waste_bytes"] += extra_waste
        u.update(blocks=len(self.owner), **self.counters)
        u["waste_ratio"] = u["waste_bytes"] / max(1, u["capacity_bytes"])
        return u


class TieredStore:
    """Embedded tiered block store (host RAM + optional disk). Thread-safe."""

    def __init__(self, config: StoreConfig | None = None, **overrides):
        cfg = dataclasses.replace(config) if config is not None else StoreConfig()
        for k, v in overrides.items():
            if k not in StoreConfig.__dataclass_fields__:
                raise ConfigError(f"unknown store setting {k!r}")
            setattr(cfg, k, v)
        self.config = cfg = cfg.resolved()
        self._cond = threading.Condition(threading.Lock())
        self._blocks: dict[bytes, _Block] = {}
        self._namespaces: dict[bytes, _NsState] = {}
        self._by_name: dict[str, _NsState] = {}
        self._reservations: dict[int, Reservation] = {}
        self._leases: dict[int, Lease] = {}
        self._ids = itertools.count(1)
        self._closed = False
        self._writes_in_flight = 0
        self._batch_writing = False   # one disk write batch at a time (see _write_down_batch)
        self._demote_wanted = False   # set past the host high watermark: wakes the demoter
        # One residency record per tier (see _Resident): the tiers themselves are storage only.
        self._rh = _Resident("host", make_policy(cfg.eviction_policy), slot_of=lambda b: b.host_slot,
                             children_of=lambda b: b.host_children, evictable=self._host_evictable)
        self._rd = _Resident("disk", make_policy(cfg.eviction_policy), slot_of=lambda b: b.disk.slot,
                             children_of=lambda b: b.disk_children, evictable=self._disk_evictable)
        self._rg = _Resident("gpu", make_policy("lru"), slot_of=lambda b: b.gpu_slot,
                             children_of=lambda b: 0, evictable=lambda b: b.gpu_pins == 0)
        self._rh.tier = HostTier(cfg.host_bytes, cfg.host_slab_bytes, shm_path=cfg.host_shm_path,
                                 shm_mode=cfg.host_shm_mode)
        self._pad_bytes = 0  # slot padding of host blocks (slot size - block size), for waste
        self._admission = AdmissionFilter(cfg.disk_admit_min_hits)
        self._index = None   # the daemon's shared lookup index (tierd.index), if attached
        self._events = None  # the daemon's KV-event publisher (tierd.events), if attached
        self._disk_health = _Health("disk", self.DISK_RETRY_S, "serving from host RAM only")
        self._disk_checked_at = 0.0
        # The remote tier (tiers/remote.py): no slots here, the server owns capacity and eviction.
        # What the store keeps: a short memory of which keys the server had or lacked, the
        # write-behind queue (blocks pinned in host RAM until written), health and counters.
        self.remote = None
        self._remote_q: collections.deque = collections.deque()
        self._remote_inflight = 0    # blocks of the write-behind batch on its way to the server
        self._remote_wake = threading.Event()
        self._remote_known: dict[bytes, float] = {}    # ikey -> until when it counts as there
        self._remote_absent: dict[bytes, float] = {}   # ikey -> until when it counts as missing
        self._remote_health = _Health("remote", self.REMOTE_RETRY_S, "serving from this node's tiers")
        self._rr = dict.fromkeys(("hits", "misses", "bytes_in", "bytes_out", "writes", "write_dropped",
                                  "errors", "corrupt_dropped", "lookups"), 0)
        self._rr["latency_ms"] = 0.0
        try:
            if cfg.gpu_bytes:
                from .tiers.gpu import GpuTier   # imports torch: only when an HBM tier is wanted
                self.gpu = GpuTier(cfg.gpu_bytes, cfg.gpu_slab_bytes, cfg.gpu_device)
            if cfg.disk_path:
                self.disk = self._open_disk()
                self._rd.counters["corrupt_dropped"] = self.disk.corrupt_at_open
                self._adopt_recovered()
            if cfg.remote_url:
                # imports redis-py: only when a remote tier is wanted
                from .tiers.remote import RemoteTier, read_fleet_key
                self.remote = RemoteTier(cfg.remote_url, timeout_s=cfg.remote_timeout_s,
                                         fleet_key=read_fleet_key(cfg.remote_fleet_key_file),
                                         codec=cfg.remote_codec, zstd_level=cfg.disk_zstd_level)
        except BaseException:
            self.host.close()
            if self.disk is not None:
                self.disk.close(None)
            raise
        if self.remote is not None:
            self._remote_threads = [threading.Thread(target=self._remote_writer, args=(i == 0,),
                                                     name=f"tierd-remote-{i}", daemon=True)
                                    for i in range(self.REMOTE_WRITERS)]
            for t in self._remote_threads:
                t.start()
        self._maintainer = threading.Thread(target=self._maintain, name="tierd-demoter", daemon=True)
        self._maintainer.start()

    # the tiers (storage only; the store's view of each is its _Resident record)
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

    def _open_disk(self) -> DiskTier:
        cfg = self.config
        return DiskTier(cfg.disk_path, cfg.disk_bytes, cfg.disk_slab_bytes, cfg.disk_file_bytes,
                        direct_io=cfg.disk_direct_io, codec=cfg.disk_codec, zstd_level=cfg.disk_zstd_level,
                        io_threads=cfg.disk_io_threads, fault_file=cfg.disk_fault_file)

    def host_array(self):
        """The whole host arena as one uint8 array (for page-locking it, e.g. cudaHostRegister)."""
        return self.host.arena.array

    # -- disk health --------------------------------------------------------------------------
    DISK_RETRY_S = 1.0      # while degraded, one write batch per interval probes the disk
    DISK_CHECK_S = 0.5      # how often the maintainer checks the directory is still there

    def _disk_error(self, what: str, e: BaseException) -> None:
        """A disk fault (lock held): count it; the first one of an episode degrades the disk
        tier (logged once) until a later write or probe succeeds."""
        self._rd.counters["io_errors"] += 1
        self._disk_health.error(what, e)

    def _disk_healthy(self) -> None:
        self._disk_health.healthy()

    def _disk_waiting(self) -> bool:
        """Degraded and not yet time for the next probe: leave the disk alone."""
        self._note_stall()
        return self._disk_health.fault is not None and time.monotonic() < self._disk_health.retry_at

    def _note_stall(self) -> bool:
        """(Lock held.) True while a disk call has been running longer than `disk_stall_s`: the
        disk tier is then degraded (reads and writes skip it) until the call returns and a write
        or a probe succeeds."""
        disk = self.disk
        io = disk.oldest_io() if disk is not None else None
        if io is None or io[1] < self.config.disk_stall_s:
            if self._index is not None:
                self._index.set_disk_ok(True)
            return False
        if self._index is not None:
            self._index.set_disk_ok(False)
        op, age = io
        if self._disk_health.fault is None:
            self._disk_error(f"{op} stalled", TimeoutError(f"a disk {op} has not returned for {age:.1f}s"))
        self._disk_health.retry_at = max(self._disk_health.retry_at, time.monotonic() + self.DISK_RETRY_S)
        return True

    def _check_disk(self) -> None:
        """Maintainer (takes the lock itself; every disk call runs outside it): notice a
        vanished directory; probe a degraded disk; once a vanished directory is back, start a
        fresh disk tier there (the old one's blocks went with it)."""
        now = time.monotonic()
        with self._cond:
            disk = self.disk
            if disk is None or now < self._disk_checked_at + self.DISK_CHECK_S:
                return
            self._disk_checked_at = now
            stalled = self._note_stall()
            probe = self._disk_health.fault is not None and now >= self._disk_health.retry_at and not stalled
            reopen = disk.closed and now >= self._disk_health.retry_at
        if not disk.closed:
            try:
                disk.check_present()
            except OSError as e:
                with self._cond:
                    if self.disk is not disk:
                        return
                    self._disk_error("directory check", e)
                    self._forget_disk()
                try:
                    disk.abandon()
                except OSError:
                    pass
                return
            if probe:
                try:
                    disk.probe()
                except OSError as e:
                    with self._cond:
                        self._disk_error("probe", e)
                else:
                    with self._cond:
                        if not self._note_stall():
                            self._disk_healthy()
            return
        if reopen and os.path.isdir(self.config.disk_path):
            try:
                new = self._open_disk()   # may scan the directory: no lock
            except (OSError, TierdError) as e:
                with self._cond:
                    self._disk_error("reopen", e)
                return
            with self._cond:
                self.disk = new
                self._adopt_recovered()
                self._disk_healthy()

    def _forget_disk(self) -> None:
        """(Lock held.) Forget every disk copy (their files are gone); the caller then
        abandons the old tier outside the lock."""
        while self._writes_in_flight or self._batch_writing:
            self._cond.wait(0.1)
        for b in [b for b in self._blocks.values() if b.disk is not None]:
            self._drop_disk(b, evicted=False)
        self._rd.owner.clear()
        self._rd.policy = make_policy(self.config.eviction_policy)
        self.disk.mark_closed()   # no new I/O goes to it

    # -- the remote tier --------------------------------------------------------------------------
    REMOTE_RETRY_S = 1.0     # while degraded, one call per interval probes the server
    REMOTE_BATCH = 32        # blocks per write-behind round trip, at most
    REMOTE_BATCH_BYTES = 8 << 20   # and about this many bytes
    REMOTE_WRITERS = 2       # write-behind threads: one batch is encoded while another is sent

    def _remote_error(self, what: str, e: BaseException) -> None:
        """(Lock held.) A remote failure: the first of an episode degrades the tier (logged once);
        lookups, loads and writes skip it until a probe succeeds."""
        self._rr["errors"] += 1
        self._remote_health.error(what, e)

    def _remote_healthy(self) -> None:
        self._remote_health.healthy()

    def _remote_ok(self) -> bool:
        """(Lock held.) The remote tier is there and not degraded."""
        return self.remote is not None and self._remote_health.fault is None

    def _remote_timed(self, seconds: float) -> None:
        r = self._rr
        r["latency_ms"] = seconds * 1e3 if not r["latency_ms"] else 0.9 * r["latency_ms"] + 0.1 * seconds * 1e3

    def _remote_enqueue(self, b: _Block) -> None:
        """(Lock held.) Write `b` (READY in host RAM) to the remote tier behind the caller's back:
        its host slot stays pinned until written; a full queue or a degraded tier drops it."""
        if not self._remote_ok() or self._remote_known.get(b.ikey, 0.0) > time.monotonic():
            return
        if len(self._remote_q) >= self.config.remote_queue_blocks:
            self._rr["write_dropped"] += 1
            return
        b.host_pins += 1
        self._remote_q.append(b)
        self._remote_wake.set()

    def _remote_writer(self, lead: bool) -> None:
        """A write-behind thread: batches of pinned host blocks to the server, one round trip
        each (on its own connection: while one thread waits for the server, the other encodes
        and sends). The lead thread also probes a degraded server and refreshes the server's memory figures."""
        remote = self.remote
        usage_at = 0.0
        if lead:
            try:
                remote.probe()                 # is the server there at all? (else: degraded now)
            except Exception as e:  # noqa: BLE001 -- any client or server failure
                with self._cond:
                    self._remote_error("connect", e)
        while True:
            self._remote_wake.wait(0.25)
            self._remote_wake.clear()
            now = time.monotonic()
            with self._cond:
                closing = self._closed
                probe = lead and self._remote_health.fault is not None and now >= self._remote_health.retry_at
                if self._remote_health.fault is not None and self._remote_q:
                    for b in self._remote_q:          # degraded: nothing waits for the server
                        b.host_pins -= 1
                    self._rr["write_dropped"] += len(self._remote_q)
                    self._remote_q.clear()
                    self._cond.notify_all()
                n = min(self.REMOTE_BATCH, len(self._remote_q))
                if n:   # a few MiB a round trip: the other writer's batch fills the wait
                    n = min(n, max(1, self.REMOTE_BATCH_BYTES // self._remote_q[0].st.block_bytes))
                batch = [self._remote_q.popleft() for _ in range(n)]
                self._remote_inflight += len(batch)
                items = [(b, b.st.meta(b.key, b.parent[16:] if b.parent else None, exact=b.decoded),
                          self.host.view(b.host_slot, b.st.block_bytes)) for b in batch]
            if probe:
                try:
                    remote.probe()
                except Exception as e:  # noqa: BLE001 -- any client or server failure
                    with self._cond:
                        self._remote_error("probe", e)
                else:
                    with self._cond:
                        self._remote_healthy()
            if lead and now >= usage_at:
                usage_at = now + 5.0
                try:
                    remote.refresh_usage()
                except Exception:  # noqa: BLE001 -- figures for stats only; probes judge health
                    pass
            if items:
                err = None
                t0 = time.perf_counter()
                try:
                    remote.set_many([(remote.rkey(m.ns_id, m.key), remote.encode(v, m)) for _, m, v in items])
                except Exception as e:  # noqa: BLE001 -- the blocks stay on this node
                    err = e
                with self._cond:
                    until = time.monotonic() + self.config.remote_known_s
                    self._remote_inflight -= len(items)
                    for b, _, _ in items:
                        b.host_pins -= 1
                    if err is None:
                        self._remote_timed(time.perf_counter() - t0)
                        for b, _, _ in items:
                            self._remote_known[b.ikey] = until
                            self._remote_absent.pop(b.ikey, None)
                            if self._events is not None:
                                self._event(b, "remote", True)
                        self._rr["writes"] += len(items)
                        self._rr["bytes_in"] += sum(m.block_bytes for _, m, _ in items)
                    else:
                        self._rr["write_dropped"] += len(items)
                        self._remote_error("write", err)
                    self._cond.notify_all()
                if self._remote_q:
                    self._remote_wake.set()
            if closing and not self._remote_q:
                return

    def remote_pending(self) -> int:
        """Blocks waiting for (or on their way to) the remote tier."""
        with self._cond:
            return len(self._remote_q) + self._remote_inflight

    def _drain_remote(self, timeout_s: float) -> int:
        """(Lock held.) Wait until the write-behind queue is empty (written, or dropped by a
        degraded tier), at most `timeout_s`. Returns the blocks still pending."""
        deadline = time.monotonic() + timeout_s
        while self._remote_q or self._remote_inflight:
            left = deadline - time.monotonic()
            if left <= 0 or self._closed:
                break
            self._remote_wake.set()
            self._cond.wait(min(left, 0.1))
        return len(self._remote_q) + self._remote_inflight

    def _remote_leading(self, st: _NsState, keys: Sequence[bytes]) -> int:
        """Leading `keys` the remote tier holds: from the store's memory of the server where it
        has one, else asked in one round trip (no lock held). 0 when the tier is degraded."""
        now = time.monotonic()
        with self._cond:
            if not self._remote_ok():
                return 0
            n = 0
            for k in keys:
                ikey = st.ns_id + k
                if self._remote_known.get(ikey, 0.0) > now:
                    n += 1
                    continue
                if self._remote_absent.get(ikey, 0.0) > now:
                    return n
                break
            if n == len(keys):
                return n
            self._rr["lookups"] += 1
        ask = list(keys[n:])
        t0 = time.perf_counter()
        try:
            found = self.remote.exists_many(st.ns_id, ask)
        except Exception as e:  # noqa: BLE001 -- a remote failure is a miss
            with self._cond:
                self._remote_error("lookup", e)
            return n
        with self._cond:
            self._remote_timed(time.perf_counter() - t0)
            self._remote_healthy()
            t = time.monotonic()
            for k, there in zip(ask, found):
                if there:
                    self._remote_known[st.ns_id + k] = t + self.config.remote_known_s
                else:
                    self._remote_absent[st.ns_id + k] = t + self.config.remote_absent_s
            self._trim_remote_memory()
        for there in found:
            if not there:
                break
            n += 1
        return n

    def _trim_remote_memory(self) -> None:
        """(Lock held.) Forget expired entries once the memory of the server grows large."""
        for d in (self._remote_known, self._remote_absent):
            if len(d) > 200_000:
                now = time.monotonic()
                for k in [k for k, until in d.items() if until <= now]:
                    del d[k]

    def _plan_remote(self, st: _NsState, keys: Sequence[bytes], plan: list) -> None:
        """(Lock held; may release it to make room.) Continue an acquire's plan with keys this
        node does not have: host slots (LOADING) for the remote tier to fill."""
        now = time.monotonic()
        prev = st.ns_id + keys[len(plan) - 1] if plan else None
        for k in keys[len(plan):]:
            ikey = st.ns_id + k
            if self._remote_absent.get(ikey, 0.0) > now or self._blocks.get(ikey) is not None:
                return   # known missing, or this node has it in some state: stop here
            slot = self._host_alloc(st)
            if slot is None:
                return
            if self._blocks.get(ikey) is not None or not self._remote_ok():
                self.host.free_slot(slot)
                return
            b = self._new_block(ikey, st, k)
            self._link(b, prev)
            b.host_slot, b.host_state = slot, LOADING
            self._rh.owner[slot] = b
            self._publish(b)
            b.host_pins += 1
            plan.append((b, REMOTE))
            prev = ikey

    def _settle_remote(self, b: _Block, err) -> bool:
        """(Lock held.) A remote fetch into `b`'s host slot is over: READY on success (True),
        else the slot goes back and the key is remembered as missing."""
        now = time.monotonic()
        if err is None:
            b.host_state = READY
            b.decoded = bool(b.st.lossy)   # the server's value may have been lossy: write it exact
            self._rh.policy.insert(b.ikey)
            self._enter(b, "host")
            self._remote_known[b.ikey] = now + self.config.remote_known_s
            self._rr["hits"] += 1
            self._rr["bytes_out"] += b.st.block_bytes
            self._remote_healthy()
            return True
        b.host_pins -= 1
        self._drop_host(b, evicted=False)
        self._remote_known.pop(b.ikey, None)
        if isinstance(err, KeyError):
            self._rr["misses"] += 1
            self._remote_absent[b.ikey] = now + self.config.remote_absent_s
        elif isinstance(err, CorruptBlockError):
            # dropped, never served — and never deleted: the tier is shared, and what this node
            # cannot verify (another fleet key, a newer format) may be another node's block; a
            # node that holds the block writes it over the damaged value
            log.warning("remote tier: dropped a damaged value of %s (%s)", b.st.name, err)
            self._rr["corrupt_dropped"] += 1
            self._remote_absent[b.ikey] = now + self.config.remote_absent_s
        else:
            self._remote_error("read", err)
        return False

    def _load_from_remote(self, blocks: list[_Block]) -> dict[int, Exception | None]:
        """Fetch remote blocks into their LOADING host slots, one round trip, verified (no lock).
        Returns per block id: None (loaded), KeyError (gone), CorruptBlockError or the failure."""
        out: dict[int, Exception | None] = {}
        if not blocks:
            return out
        st = blocks[0].st
        t0 = time.perf_counter()
        try:
            errs = self.remote.fetch_many(st.ns_id, [b.key for b in blocks],
                                          [self.host.view(b.host_slot, st.block_bytes) for b in blocks],
                                          lossy_ok=bool(st.lossy))
        except Exception as e:  # noqa: BLE001 -- every block of the call is a miss
            return {id(b): e for b in blocks}
        elapsed = time.perf_counter() - t0
        out = {id(b): e for b, e in zip(blocks, errs)}
        with self._cond:
            self._remote_timed(elapsed)
        return out

    # -- namespaces -------------------------------------------------------------------------
    def register(self, ns: Namespace) -> None:
        """Make `ns` known (done implicitly by every operation that takes a Namespace).
        Raises CapacityError when a block of `ns` cannot fit a tier."""
        with self._cond:
            self._check_open()
            self._ns(ns)

    def _ns(self, ns) -> _NsState:
        if isinstance(ns, Namespace):
            st = self._namespaces.get(ns.id)
            if st is not None and st.ns is not None:
                return st
            whose = f"of namespace {ns.name} "
            host_sb = self.host.check_block(ns.block_bytes, whose)
            disk_sb = DiskTier.slot_bytes_for(ns.block_bytes)
            if self.disk is not None:
                self.disk.check_block(ns.block_bytes, whose)
            if st is None:
                st = _NsState(ns.id, ns, ns.block_bytes, ns.dtype_bytes, host_sb, disk_sb, ns.to_dict())
                self._namespaces[ns.id] = st
            else:  # known from disk: attach the description
                st.ns, st.desc = ns, ns.to_dict()
            self._by_name[st.name] = st    # the names clients use (the daemon's protocol)
            return st
        if isinstance(ns, (bytes, str)):
            st = self._by_name.get(ns)
            if st is not None and st.ns is not None:
                return st
            for st in self._namespaces.values():
                if ns in (st.ns_id, st.name, st.ns_id.hex()):
                    if st.ns is None:
                        raise UnknownNamespaceError(
                            f"namespace {st.name} is known only from disk; register it with its Namespace first")
                    return st
            raise UnknownNamespaceError(
                f"unknown namespace {ns if isinstance(ns, str) else ns.hex()!r}; pass a tierd.Namespace "
                "or the name of a registered one (see stats)")
        raise TypeError(f"expected a tierd.Namespace, got {type(ns).__name__}")

    def namespace_count(self) -> int:
        with self._cond:
            return len(self._namespaces)

    def namespace(self, name: str) -> Namespace:
        """The registered Namespace whose name (or hex id) is `name`."""
        with self._cond:
            return self._ns(name).ns

    def _adopt_recovered(self) -> None:
        """Index the blocks the disk tier found at open (oldest first in eviction order)."""
        disk = self.disk
        adopted = []
        for e in sorted(disk.recovered, key=lambda e: e.seq):
            st = self._namespaces.get(e.ns_id)
            if st is None:
                desc = disk.namespaces.get(e.ns_id, {})
                dtype_bytes = 2
                if desc:
                    try:
                        dtype_bytes = Namespace.from_dict(desc).dtype_bytes
                    except TierdError:
                        desc = {}
                st = _NsState(e.ns_id, None, e.raw_len, dtype_bytes, slot_bytes_for(e.raw_len),
                              DiskTier.slot_bytes_for(e.raw_len), desc)
                self._namespaces[e.ns_id] = st
            b = self._blocks.get(e.ns_id + e.key)
            if b is not None:
                # a reopened directory: this node still holds the block in RAM; the copy on disk
                # joins it (the old disk tier's copies were forgotten with it)
                if b.disk is not None or b.disk_writing:
                    disk.free_slot(e.slot)
                    continue
            else:
                b = self._new_block(e.ns_id + e.key, st, e.key)
                b.parent = (e.ns_id + e.parent) if e.parent else None
            b.disk = e
            adopted.append(b)
            self._publish(b)
            self._rd.owner[e.slot] = b
            self._rd.policy.insert(b.ikey)
            b.st.counters["disk_blocks"] += 1
        for b in adopted:
            p = self._blocks.get(b.parent) if b.parent else None
            if p is not None:
                p.disk_children += 1
        disk.recovered = []

    # -- chain links --------------------------------------------------------------------------
    def _link(self, b: _Block, parent_ikey: bytes | None) -> None:
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

    # -- the shared lookup index (daemon only) ----------------------------------------------------
    def attach_index(self, index) -> None:
        """Publish every block's presence in `index` (a tierd.index.SharedIndex) from now on."""
        with self._cond:
            self._index = index
            for b in self._blocks.values():
                self._publish(b)
            self._note_stall()

    def attach_events(self, publisher) -> None:
        """Record KV events (tierd.events) from now on, starting with a snapshot."""
        publisher.snapshot = self.snapshot_events
        with self._cond:
            self._events = publisher
        self.snapshot_events()

    SCAN_CHUNK = 2048   # blocks an O(N) walk handles per hold of the lock (a few ms at most)

    def _each_block(self, fn, ns_id: bytes | None = None) -> None:
        """Call `fn(block)` (lock held) for every block indexed now, `SCAN_CHUNK` at a time: the
        lock is let go between chunks, so an O(N) walk (snapshots, flushes, syncs) never holds
        it for more than a few milliseconds. A block that leaves meanwhile is skipped; one that
        comes meanwhile may be missed."""
        with self._cond:
            ikeys = list(self._blocks)   # one C-level copy of the keys
        for i in range(0, len(ikeys), self.SCAN_CHUNK):
            with self._cond:
                self._check_open()
                for ikey in ikeys[i:i + self.SCAN_CHUNK]:
                    b = self._blocks.get(ikey)
                    if b is not None and (ns_id is None or b.st.ns_id == ns_id):
                        fn(b)
            time.sleep(0)    # let a waiting thread take the lock

    def snapshot_events(self) -> None:
        """Record a clean slate per namespace, then what every tier holds, in order with the
        live events: each block's events reflect its state when its chunk was walked, and any
        later change follows as a live event."""
        publisher = self._events
        if publisher is None:
            return
        with self._cond:
            for st in self._namespaces.values():
                publisher.record(st.name, events.all_cleared())

        def one(b: _Block) -> None:
            if b.host_state == READY:
                self._event(b, "host", True)
            if b.disk is not None:
                self._event(b, "disk", True)
            if b.gpu_slot >= 0 and not b.gpu_filling:
                self._event(b, "gpu", True)
            if self._remote_known.get(b.ikey, 0.0) > time.monotonic():
                self._event(b, "remote", True)
        self._each_block(one)

    def _event(self, b: _Block, tier: str, stored: bool, token_ids=None) -> None:
        st = b.st
        if stored:
            ev = events.block_stored([b.key], b.parent[16:] if b.parent else None,
                                     st.ns.block_tokens if st.ns is not None else st.desc.get("block_tokens", 0),
                                     tier, token_ids)
        else:
            ev = events.block_removed([b.key], tier)
        self._events.record(st.name, ev)

    def refresh_health(self) -> None:
        """Notice a stalled disk now (the daemon calls this with its heartbeat, so the shared
        index stops counting a hung disk's blocks even while nobody asks the daemon).
        Lock-free: the heartbeat runs on the daemon's event loop, which never waits for the
        store lock; it reads only the disk's calls in flight and sets the index's flag."""
        disk, index = self.disk, self._index
        if index is not None:
            io = disk.oldest_io() if disk is not None else None
            index.set_disk_ok(io is None or io[1] < self.config.disk_stall_s)

    def _publish(self, b: _Block) -> None:
        if self._index is not None:
            self._index.set(b.st.ns_id, b.key, (b.host_state == READY) | ((b.disk is not None) << 1)
                            | ((b.host_state == LOADING) << 2))

    def _enter(self, b: _Block, tier: str, event: bool = True) -> None:
        self._publish(b)
        if self._events is not None and event:
            self._event(b, tier, True)
        p = self._blocks.get(b.parent) if b.parent else None
        if tier == "host":
            b.st.counters["host_blocks"] += 1
            self._pad_bytes += b.st.host_slot_bytes - b.st.block_bytes
            if p is not None:
                p.host_children += 1
        else:
            b.st.counters["disk_blocks"] += 1
            if p is not None:
                p.disk_children += 1

    def _leave(self, b: _Block, tier: str) -> None:
        # Counts may under-estimate after a parent is re-created, never over-estimate: a
        # wrong count can reorder eviction but never pin a block forever.
        if self._events is not None:
            self._event(b, tier, False)
        p = self._blocks.get(b.parent) if b.parent else None
        if tier == "host":
            b.st.counters["host_blocks"] -= 1
            self._pad_bytes -= b.st.host_slot_bytes - b.st.block_bytes
            if p is not None and p.host_children > 0:
                p.host_children -= 1
        else:
            b.st.counters["disk_blocks"] -= 1
            if p is not None and p.disk_children > 0:
                p.disk_children -= 1

    def _new_block(self, ikey: bytes, st: _NsState, key: bytes) -> _Block:
        """(Lock held.) Index a new block record. Invariant: `st.records` counts the records
        of `st` in `_blocks`; a namespace forgotten while it had none is known again."""
        b = self._blocks[ikey] = _Block(ikey, st, key)
        st.records += 1
        if st.forgotten:
            st.forgotten = False
            self._namespaces[st.ns_id] = st
            if st.ns is not None:
                self._by_name[st.name] = st
        return b

    def _forget_if_gone(self, b: _Block) -> None:
        if b.host_state == ABSENT and b.disk is None and not b.disk_writing:
            if self._blocks.get(b.ikey) is b:
                del self._blocks[b.ikey]
                b.st.records -= 1

    def forget_unused(self, names) -> list[str]:
        """Forget the namespaces among `names` that hold no block in any local tier (and so no
        lease or reservation): the daemon's table of namespaces stays bounded. A forgotten one
        is registered again by its next user. Returns the names forgotten."""
        gone = []
        with self._cond:
            for name in names:
                st = self._by_name.get(name)
                if st is None:
                    gone.append(name)    # forgotten already (another uid's request)
                    continue
                if st.records or st.forgotten:
                    continue
                st.forgotten = True
                del self._by_name[name]
                self._namespaces.pop(st.ns_id, None)
                gone.append(name)
        return gone

    # -- eviction predicates ----------------------------------------------------------------
    def _host_evictable(self, b: _Block) -> bool:
        return b.host_state == READY and b.host_pins == 0 and not b.disk_writing

    def _disk_evictable(self, b: _Block) -> bool:
        return b.disk is not None and b.disk_pins == 0

    # -- slots in any tier: allocation with eviction, written once ---------------------------------
    def _alloc(self, r: _Resident, slot_bytes: int, evict, wait=None) -> int | None:
        """(Lock held.) A free slot of `slot_bytes` in `r`'s tier: a free slot; else an empty
        slab of another size class given back and taken; else the policy's coldest evictable
        block of that size with no resident descendants evicted (`evict(block)`); else a whole
        slab of another class emptied. When nothing can go, `wait()` may wait for something to
        become evictable (True: try again). None when there is no room."""
        tier = r.tier
        alloc = tier.alloc
        if slot_bytes > alloc.usable_slab_bytes:
            return None
        blocks = self._blocks
        for _ in range(64 + 2 * len(r.owner)):
            slot = tier.alloc_slot(slot_bytes)
            if slot is not None:
                return slot
            slab = alloc.empty_slab_elsewhere(slot_bytes)
            if slab is not None:
                tier.release_slab(slab)
                continue
            victim = None
            cls = alloc.classes.get(slot_bytes)
            if cls is not None and cls.slabs:
                key = r.policy.victim(
                    lambda k: r.evictable(blocks[k]) and r.children_of(blocks[k]) == 0
                    and alloc.slot_bytes_of(r.slot_of(blocks[k])) == slot_bytes)
                victim = blocks[key] if key is not None else None
            if victim is not None:
                evict(victim)
                continue
            if self._evict_slab(r, slot_bytes, evict):
                continue
            if wait is None or not wait():
                return None
        return None

    def _evict_slab(self, r: _Resident, slot_bytes: int, evict) -> bool:
        """(Lock held.) Empty the slab of another size class that is cheapest to empty (every
        block in it evictable, no slot held by a write or an erase in flight) and give it back
        to the free pool. True on success."""
        alloc = r.tier.alloc
        best, best_used = None, None
        for sb, c in alloc.classes.items():
            if sb == slot_bytes:
                continue
            for slab in c.slabs:
                owned = [r.owner[s] for s in alloc.slots_of_slab(slab) if s in r.owner]
                if len(owned) != alloc.slab_used[slab] or not all(r.evictable(b) for b in owned):
                    continue
                if best is None or len(owned) < best_used:
                    best, best_used = slab, len(owned)
        if best is None:
            return False
        for s in alloc.slots_of_slab(best):
            b = r.owner.get(s)
            if b is not None and r.evictable(b):
                evict(b)     # may release the lock (a host block written down first)
        if alloc.slab_used[best] == 0 and alloc.slab_class[best]:
            r.tier.release_slab(best)
            return True
        return False

    def _free(self, r: _Resident, slot: int, *, evicted: bool, free: bool = True) -> None:
        """(Lock held.) `slot` of `r`'s tier no longer belongs to its block."""
        del r.owner[slot]
        if free:
            r.tier.free_slot(slot)
        if evicted:
            r.counters["evictions"] += 1

    # -- host ------------------------------------------------------------------------------------------
    def _drop_host(self, b: _Block, *, evicted: bool) -> None:
        if b.gpu_slot >= 0:
            self._drop_gpu(b, evicted=False)   # inclusive: no HBM copy without the host copy
        if b.host_state == READY:
            self._rh.policy.remove(b.ikey, evicted=evicted)
            self._leave(b, "host")
        self._free(self._rh, b.host_slot, evicted=evicted)
        b.host_slot, b.host_state = -1, ABSENT
        self._publish(b)
        self._forget_if_gone(b)

    def _host_alloc(self, st: _NsState) -> int | None:
        """A free host slot for `st`, evicting (demoting) in policy order if needed.
        Lock held; may release it during disk writes."""
        deadline = None

        def wait() -> bool:
            # Everything evictable is being written to disk right now: wait for those writes
            # (bounded, and never for a stalled disk) rather than drop the block.
            nonlocal deadline
            if not self._writes_in_flight or self._disk_waiting():
                return False
            deadline = deadline or time.monotonic() + self.ALLOC_WAIT_S
            if time.monotonic() >= deadline:
                return False
            self._cond.wait(min(0.05, deadline - time.monotonic()))
            return True

        return self._alloc(self._rh, st.host_slot_bytes, self._evict_host, wait)

    def _evict_host(self, b: _Block) -> bool:
        """Remove `b` from host RAM: drop it if its disk copy is valid, else write it down
        (if admitted) first. Returns True if the host slot was freed."""
        if self.disk is not None and b.disk is None and not b.disk_writing:
            if self._admission.admit(b.hits):
                self._write_down(b)
            else:
                self._rd.counters["admission_rejected"] += 1
        if self._host_evictable(b):
            self._drop_host(b, evicted=True)
            return True
        return False

    # -- HBM (an inclusive cache of host blocks) ------------------------------------------------------
    def _drop_gpu(self, b: _Block, *, evicted: bool) -> None:
        if self._events is not None:
            self._event(b, "gpu", False)
        self._rg.policy.remove(b.ikey, evicted=evicted)
        self._free(self._rg, b.gpu_slot, evicted=evicted)
        b.gpu_slot = -1

    def _gpu_alloc(self, st: _NsState) -> int | None:
        return self._alloc(self._rg, st.host_slot_bytes, lambda b: self._drop_gpu(b, evicted=True))

    def _gpu_lease(self, b: _Block) -> tuple[int, bool]:
        """(Lock held.) For a leased host-resident block: its HBM offset, pinned for the lease,
        and whether the copy into HBM is still to be made (by `_gpu_fill`, outside the lock: the
        block is admitted once it has been served `gpu_admit_hits` times); (-1, False) when the
        block is not in HBM."""
        if b.gpu_slot < 0:
            if b.hits - 1 < self.config.gpu_admit_hits:   # hits counts this serve too
                return -1, False
            slot = self._gpu_alloc(b.st)
            if slot is None:
                return -1, False
            b.gpu_slot, b.gpu_filling = slot, True
            self._rg.owner[slot] = b
            b.gpu_pins += 1
            return self.gpu.offset(slot), True
        if b.gpu_filling:
            return -1, False   # another lease is copying it in right now
        self._rg.policy.hit(b.ikey)
        self._rg.counters["bytes_out"] += b.st.block_bytes
        b.gpu_pins += 1
        return self.gpu.offset(b.gpu_slot), False

    # -- disk ------------------------------------------------------------------------------------------
    def _drop_disk(self, b: _Block, *, evicted: bool, free: bool = True) -> None:
        """(Lock held.) Forget `b`'s disk copy; with `free=False` its slot stays taken until its
        header is erased on disk (`_tombstone`)."""
        self._rd.policy.remove(b.ikey, evicted=evicted)
        self._leave(b, "disk")
        self._free(self._rd, b.disk.slot, evicted=evicted, free=free)
        b.disk = None
        self._publish(b)
        self._forget_if_gone(b)

    def _disk_alloc(self, st: _NsState) -> int | None:
        return self._alloc(self._rd, st.disk_slot_bytes, lambda b: self._drop_disk(b, evicted=True))

    def _write_down(self, b: _Block) -> bool:
        """Copy one READY host block to disk (its host copy stays); see `_write_down_batch`."""
        self._write_down_batch([b])
        return b.disk is not None

    def _write_down_batch(self, blocks: list[_Block]) -> int:
        """Copy READY host-only blocks to disk, in parallel on the I/O pool; host copies stay.
        Lock held on entry and exit, released during the writes. Returns blocks written."""
        # One batch at a time: blocks reach the disk tier (and its eviction order) in the
        # order they were chosen, and each batch's writes stay one sequential run. A stalled
        # disk is not waited for.
        while self._batch_writing:
            if self._disk_waiting():
                return 0
            self._cond.wait(0.05)
        disk = self.disk
        if disk is None or disk.closed or self._disk_waiting():
            return 0
        jobs = []
        remember: dict[bytes, dict] = {}
        for b in blocks:
            if b.host_state != READY or b.disk is not None or b.disk_writing:
                continue
            st = b.st
            slot = self._disk_alloc(st)   # no I/O: slab headers are queued
            if slot is None:
                break
            if st.ns is not None and disk.namespaces.get(st.ns_id) != st.desc:
                remember[st.ns_id] = st.desc
            b.disk_writing = True
            b.host_pins += 1
            self._writes_in_flight += 1
            jobs.append((b, slot, b.parent[16:] if b.parent else None,
                         self.host.view(b.host_slot, st.host_slot_bytes)))
        if not jobs:
            return 0
        headers = disk.take_pending_headers()
        self._batch_writing = True

        def write(job):
            b, slot, parent_key, src = job
            try:
                return disk.write(slot, src, b.st.meta(b.key, parent_key, exact=b.decoded))
            except Exception as e:  # noqa: BLE001 - any failure must still unpin below
                return e

        self._cond.release()
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
                results = [write(jobs[0])] if len(jobs) == 1 else list(disk.pool.map(write, jobs))
        finally:
            self._cond.acquire()
            self._batch_writing = False
        written = failed = 0
        for (b, slot, _, _), entry in zip(jobs, results):
            b.disk_writing = False
            b.host_pins -= 1
            self._writes_in_flight -= 1
            if not isinstance(entry, DiskEntry):
                disk.free_slot(slot)
                if not failed:
                    self._disk_error("write", entry)  # the block stays in host RAM only
                failed += 1
                continue
            if disk.fenced(entry.ns_id, entry.seq):
                disk.free_slot(slot)   # a flush came while it was written: that copy is dead
                continue
            b.disk = entry
            self._rd.owner[slot] = b
            self._rd.policy.insert(b.ikey)
            self._enter(b, "disk")
            c = self._rd.counters
            c["demotions"] += 1
            c["bytes_in"] += b.st.block_bytes
            written += 1
        if written and not failed:
            self._disk_healthy()
        self._cond.notify_all()
        return written

    # -- Store interface: writes -------------------------------------------------------------
    def reserve(self, ns: Namespace, keys: Sequence[bytes], *, parent: bytes | None = None,
                owner=None, token_ids: Sequence[int] | None = None, inline: bool = False) -> Reservation:
        """Host slots to write `keys` into (zero-copy put). Commit or abort the result.
        `token_ids` (optional, `block_tokens` per key): the blocks' tokens, for KV events only
        (an indexer computes its own keys from them); never stored. `inline`: raise WouldBlock,
        changing nothing, unless free slots take every key at once (no eviction, no wait)."""
        keys = check_keys(keys)
        with self._cond:
            self._check_open()
            st = self._ns(ns)
            if inline and self.host.alloc.free_slot_count(st.host_slot_bytes) < len(keys):
                raise WouldBlock()
            if token_ids is not None and len(token_ids) != len(keys) * st.ns.block_tokens:
                raise TierdError(f"reserve: {len(token_ids)} token ids for {len(keys)} blocks of "
                                 f"{st.ns.block_tokens} tokens")
            pid = st.ns_id
            status, blocks = [], []
            rid = next(self._ids)
            for i, k in enumerate(keys):
                ikey = pid + k
                b = self._blocks.get(ikey)
                if b is None or (b.host_state == ABSENT and b.disk is None and not b.disk_writing):
                    slot = self._host_alloc(st)
                    b = self._blocks.get(ikey)  # the lock may have been released
                    if b is not None and (b.host_state != ABSENT or b.disk is not None or b.disk_writing):
                        if slot is not None:
                            self.host.free_slot(slot)
                        status.append("present"); blocks.append(None)
                        continue
                    if slot is None:
                        st.counters["put_dropped"] += 1
                        status.append("full"); blocks.append(None)
                        continue
                    if b is None:
                        b = self._new_block(ikey, st, k)
                    b.host_slot, b.host_state, b.owner_res = slot, RESERVED, rid
                    b.decoded = False   # the writer's own bytes
                    self._rh.owner[slot] = b
                    status.append("reserved")
                    blocks.append(b)
                else:
                    status.append("present"); blocks.append(None)
            offsets = [self.host.alloc.offset(b.host_slot) if b is not None else None for b in blocks]
            if not any(b is not None for b in blocks):
                # Nothing to write: no reservation is left open (id 0; commit and abort are
                # no-ops), and the chain is re-linked for eviction order now.
                self._relink(st.ns_id, keys, parent)
                res = Reservation(0, st.ns, keys, status, blocks, owner, offsets, self.host)
                res._parent = parent
                return res
            res = Reservation(rid, st.ns, keys, status, blocks, owner, offsets, self.host)
            res._parent = parent
            res._tokens = list(token_ids) if token_ids is not None and self._events is not None else None
            self._reservations[rid] = res
            return res

    def commit(self, res: Reservation) -> int:
        """Make the reserved blocks visible. Returns how many became visible."""
        if res.id == 0:
            return 0   # nothing was reserved
        with self._cond:
            self._check_open()
            if self._reservations.pop(res.id, None) is None:
                raise LeaseError(f"reservation {res.id} is unknown or already committed/aborted")
            pid = res.namespace.id
            n = 0
            # Links first, then residency in reverse chain order so that the chain's tail is
            # the least recent: descendants are evicted before their ancestors.
            for i, b in enumerate(res._blocks):
                if b is not None:
                    self._link(b, pid + res.keys[i - 1] if i else (pid + res._parent if res._parent else None))
            for i in range(len(res._blocks) - 1, -1, -1):
                b = res._blocks[i]
                if b is None or b.host_state != RESERVED or b.owner_res != res.id:
                    continue
                b.host_state, b.owner_res = READY, 0
                self._rh.policy.insert(b.ikey)
                self._enter(b, "host", event=False)   # events below, in chain order
                b.st.counters["puts"] += 1
                b.st.counters["put_bytes"] += b.st.block_bytes
                self._rh.counters["bytes_in"] += b.st.block_bytes
                n += 1
            self._relink(pid, res.keys, res._parent)
            if self._events is not None:
                bt = len(res._tokens) // len(res.keys) if res._tokens else 0
                for i, b in enumerate(res._blocks):
                    if b is not None and b.host_state == READY and b.owner_res == 0:
                        self._event(b, "host", True, res._tokens[i * bt:(i + 1) * bt] if bt else None)
            if self.remote is not None and self.config.remote_write_behind:   # in chain order
                for b in res._blocks:
                    if b is not None and b.host_state == READY and b.owner_res == 0:
                        self._remote_enqueue(b)
            self._wake_demoter()
            self._cond.notify_all()
            return n

    def abort(self, res: Reservation) -> None:
        """Give back the slots of an uncommitted reservation."""
        if res.id == 0:
            return
        with self._cond:
            if self._reservations.pop(res.id, None) is None:
                return
            self._abort_locked(res)

    def _abort_locked(self, res: Reservation) -> None:
        for b in res._blocks:
            if b is not None and b.host_state == RESERVED and b.owner_res == res.id:
                self._drop_host(b, evicted=False)
        self._cond.notify_all()

    def put(self, ns: Namespace, keys: Sequence[bytes], blocks: Sequence, *,
            parent: bytes | None = None, token_ids: Sequence[int] | None = None) -> int:
        """Store `blocks[i]` under `keys[i]` (a prefix chain in order; `parent` is the key
        before `keys[0]`). Already-present keys are skipped; under pressure blocks may be
        dropped. Returns how many blocks were newly stored."""
        keys = check_keys(keys)
        if len(blocks) != len(keys):
            raise TierdError(f"put: {len(keys)} keys but {len(blocks)} blocks")
        with self._cond:
            self._check_open()
            st = self._ns(ns)
        views = [as_u8(blk, st.block_bytes, st.desc.get("kv_dtype", "")) for blk in blocks]
        res = self.reserve(ns, keys, parent=parent, token_ids=token_ids)
        fill_reservation(self, res, views)
        return self.commit(res)

    # -- Store interface: reads --------------------------------------------------------------
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
            self._check_open()
            st = self._ns(ns)
            st.counters["lookups"] += 1
            disk_ok = self.disk is not None and not self._note_stall()
            n = n_host = 0
            for k in keys:
                b = self._blocks.get(st.ns_id + k)
                if b is None or not (b.host_state in (READY, LOADING) or (b.disk is not None and disk_ok)):
                    break
                if n_host == n and b.host_state == READY:
                    n_host += 1
                n += 1
            rest = self.remote is not None and n < len(keys)
        if rest:   # the remote tier may continue the prefix (asked outside the lock)
            n += self._remote_leading(st, keys[n:])
        return n, n_host

    def where(self, ns: Namespace, keys: Sequence[bytes]) -> list[str]:
        """Per key: "host", "disk", "host+disk" or "" (absent)."""
        keys = check_keys(keys)
        with self._cond:
            st = self._ns(ns)
            out = []
            for k in keys:
                b = self._blocks.get(st.ns_id + k)
                tiers = []
                if b is not None and b.host_state == READY:
                    tiers.append("host")
                if b is not None and b.disk is not None:
                    tiers.append("disk")
                out.append("+".join(tiers))
            return out

    def is_quick(self, op: str, ns: Namespace, keys: Sequence[bytes], *, gpu: bool = False) -> bool:
        """Whether `acquire` or `reserve` of `keys` would finish without disk I/O, a copy into
        HBM or waiting for room (a hint for the daemon, which then serves it on its event loop
        thread)."""
        with self._cond:
            st = self._namespaces.get(ns.id)
            if st is None:
                return False
            if op == "reserve":
                return self.host.alloc.free_slot_count(st.host_slot_bytes) >= len(keys)
            hbm = gpu and self.gpu is not None
            for k in keys:
                b = self._blocks.get(st.ns_id + k)
                if b is None:
                    return self.remote is None   # the remote tier may have it: not quick
                if b.host_state != READY:
                    return b.disk is None and self.remote is None  # a promotion: not quick
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
        plan: list[tuple[_Block, DiskEntry | str | None]] = []
        with self._cond:
            self._check_open()
            st = self._ns(ns)
            try:
                self._plan_acquire(st, keys, plan, inline=inline and not (gpu and self.gpu is not None))
                if inline and gpu and self.gpu is not None:
                    if any(b.gpu_slot < 0 and b.hits >= self.config.gpu_admit_hits for b, _ in plan):
                        raise WouldBlock()   # this serve would copy into HBM
            except BaseException:
                self._settle_failed(st, plan)
                raise
        try:
            errors = self._load_from_disk([(b, e) for b, e in plan if e is not None and e is not REMOTE])
            errors.update(self._load_from_remote([b for b, e in plan if e is REMOTE]))
        except BaseException:
            with self._cond:
                self._settle_failed(st, plan)
            raise
        discard: list[int] = []
        with self._cond:
            disk = self.disk
            cut = len(plan)
            for i, (b, e) in enumerate(plan):
                if e is None:
                    continue
                if e is REMOTE:
                    if self._settle_remote(b, errors.get(id(b))):
                        continue
                    cut = min(cut, i)
                    continue
                b.disk_pins -= 1
                err = errors.get(id(b))
                if err is None:
                    b.host_state = READY
                    b.decoded = e.codec in _codec.LOSSY
                    self._rh.policy.insert(b.ikey)
                    self._enter(b, "host")
                    c = self._rd.counters
                    c["promotions"] += 1
                    c["bytes_out"] += st.block_bytes
                else:
                    cut = min(cut, i)
                    b.host_pins -= 1
                    self._drop_host(b, evicted=False)
                    if isinstance(err, CorruptBlockError):
                        log.warning("disk tier: dropped a damaged block of %s (%s)", st.name, err)
                        self._rd.counters["corrupt_dropped"] += 1
                        if b.disk is not None:
                            discard.append(self._unindex_disk(b))
                    else:
                        self._disk_error("read", err)   # a miss; the copy may read later
            for b, _ in plan[cut:]:
                if b.host_state == READY:
                    b.host_pins -= 1
            leased = [b for b, _ in plan[:cut]]
            for b in reversed(leased):  # ancestors touched last: they stay the most recent
                b.hits += 1
                self._rh.policy.hit(b.ikey)
            st.counters["hits"] += len(leased)
            st.counters["hit_bytes"] += len(leased) * st.block_bytes
            st.counters["misses"] += len(keys) - len(leased)
            self._rh.counters["bytes_out"] += len(leased) * st.block_bytes
            lid = next(self._ids) if leased else 0   # nothing leased: nothing to release
            tiers = ["host" if e is None else "remote" if e is REMOTE else "disk" for _, e in plan[:cut]]
            lease = Lease(lid, st.ns, keys[:cut], leased, tiers, owner, self,
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
                self._leases[lid] = lease
            self._cond.notify_all()
        if discard:
            self._tombstone(disk, discard)   # erase damaged copies on disk (no lock)
        if fills:
            self._gpu_fill(lease, fills)
        if hbm:
            lease.gpu_buffers = [self.gpu.buffer[o:o + st.block_bytes] if o >= 0 else None
                                 for o in lease.gpu_offsets]
        return lease

    def _plan_acquire(self, st: _NsState, keys: Sequence[bytes], plan: list, *, inline: bool = False) -> None:
        """(Lock held; may wait on it.) Pin the leading present blocks of `keys` into `plan`:
        (block, None) for a READY host block, (block, DiskEntry) for a promotion from disk into
        a new LOADING host slot, (block, REMOTE) for a fetch from the remote tier. `inline`:
        WouldBlock at the first block that is not READY in host RAM (or past the last one, when
        the remote tier may continue the prefix)."""
        for k in keys:
            ikey = st.ns_id + k
            b = self._blocks.get(ikey)
            if inline and b is not None and b.host_state != READY and (b.host_state == LOADING or b.disk is not None):
                raise WouldBlock()
            while b is not None and b.host_state == LOADING:
                # another request's promotion (its settle always ends it); a stalled disk or
                # a store closing ends the wait
                if self._note_stall():
                    b = None
                    break
                self._cond.wait(0.05)
                self._check_open()
                b = self._blocks.get(ikey)
            if b is None:
                break
            if b.host_state == READY:
                b.host_pins += 1
                plan.append((b, None))
                continue
            if b.disk is None or self._note_stall():   # a stalled disk: a miss, not a wait
                break
            b.disk_pins += 1  # making room may evict from disk: not this block
            try:
                slot = self._host_alloc(st)
            finally:
                b.disk_pins -= 1
            b = self._blocks.get(ikey)
            if b is not None and b.host_state == READY:  # promoted meanwhile
                if slot is not None:
                    self.host.free_slot(slot)
                b.host_pins += 1
                plan.append((b, None))
                continue
            if b is None or b.disk is None or b.host_state != ABSENT or slot is None:
                if slot is not None:
                    self.host.free_slot(slot)
                break
            b.host_slot, b.host_state = slot, LOADING
            self._rh.owner[slot] = b
            self._publish(b)
            b.host_pins += 1
            b.disk_pins += 1
            plan.append((b, b.disk))
        if self.remote is not None and len(plan) < len(keys) and self._remote_ok():
            if inline:
                raise WouldBlock()
            self._plan_remote(st, keys, plan)

    def _settle_failed(self, st: _NsState, plan: list) -> None:
        """(Lock held.) Undo an acquire's plan that will not be served: every pin it took is
        dropped and every slot it filled is given back, so nothing waits for it."""
        for b, e in plan:
            b.host_pins -= 1
            if e is None:
                continue
            if e is not REMOTE:
                b.disk_pins -= 1
            if b.host_state == LOADING:
                self._drop_host(b, evicted=False)
        plan.clear()
        self._cond.notify_all()

    def _gpu_fill(self, lease: Lease, fills: list[int]) -> None:
        """Copy newly admitted blocks of `lease` into their HBM slots (no lock; the slots and the
        host copies are pinned by the lease), then make them visible to other leases."""
        ok = []
        for i in fills:
            b = lease._blocks[i]
            try:
                self.gpu.write(b.gpu_slot, self.host.view(b.host_slot, b.st.block_bytes),
                               b.st.meta(b.key, None))
                ok.append(True)
            except Exception as e:  # noqa: BLE001 -- the host copy still serves the block
                log.warning("HBM tier: copy failed (%s); serving from host RAM", e)
                ok.append(False)
        with self._cond:
            c = self._rg.counters
            for i, good in zip(fills, ok):
                b = lease._blocks[i]
                b.gpu_filling = False
                if good:
                    self._rg.policy.insert(b.ikey)
                    if self._events is not None:
                        self._event(b, "gpu", True)
                    c["promotions"] += 1
                    c["bytes_in"] += b.st.block_bytes
                else:
                    b.gpu_pins -= 1
                    self._free(self._rg, b.gpu_slot, evicted=False)
                    b.gpu_slot = -1
                    lease.gpu_offsets[i] = -1
            if lease.id:
                self._leases[lease.id] = lease
            self._cond.notify_all()

    def _load_from_disk(self, loads: list[tuple[_Block, DiskEntry]]) -> dict[int, Exception]:
        """Read pinned disk copies into their LOADING host slots in parallel (no lock)."""
        errors: dict[int, Exception] = {}
        if not loads:
            return errors

        def one(item):
            b, e = item
            try:
                if e.codec in _codec.LOSSY and not b.st.lossy:
                    raise CorruptBlockError(f"a {_codec.CODEC_NAMES[e.codec]} (lossy) copy in an exact namespace")
                self.disk.read(e, self.host.view(b.host_slot, b.st.host_slot_bytes))
            except (CorruptBlockError, OSError) as ex:
                errors[id(b)] = ex

        if len(loads) == 1:
            one(loads[0])
        else:
            list(self.disk.pool.map(one, loads))
        return errors

    def _unindex_disk(self, b: _Block) -> int:
        """(Lock held.) Take `b`'s disk copy out of the index for good; its slot stays taken
        until `_tombstone` has erased the header on disk (outside the lock). Returns the slot."""
        slot = b.disk.slot
        self._drop_disk(b, evicted=False, free=False)
        return slot

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
        with self._cond:
            if self.disk is disk and not disk.closed:
                for slot in slots:
                    disk.free_slot(slot)
            if err is not None:
                self._disk_error("tombstone", err)
            self._cond.notify_all()
        return err

    def release(self, lease: Lease, *, confirm: bool = False) -> None:
        """End a lease; its buffers must no longer be read. (`confirm` is for the daemon's
        client, where a lease can be lost with its connection; here it cannot.)"""
        if lease.id == 0:
            if lease._blocks is None:
                raise LeaseError("this (empty) lease is already released")
            lease._blocks = None
            return
        with self._cond:
            if self._leases.pop(lease.id, None) is None:
                raise LeaseError(f"lease {lease.id} is unknown or already released")
            self._release_locked(lease)

    def _release_locked(self, lease: Lease) -> None:
        for i, b in enumerate(lease._blocks):
            b.host_pins -= 1
            if i < len(lease.gpu_offsets) and lease.gpu_offsets[i] >= 0:
                b.gpu_pins -= 1
        lease._blocks = None
        self._cond.notify_all()

    def get(self, ns: Namespace, keys: Sequence[bytes], out: Sequence | None = None) -> list:
        """The blocks of the longest present prefix of `keys` (`len(result) <= len(keys)`):
        new (block_bytes,) uint8 arrays, or copied into `out[i]` (any writable buffer of
        block_bytes, e.g. a CPU tensor) and those returned."""
        if out is not None and len(out) < len(keys):
            raise TierdError(f"get: {len(keys)} keys but only {len(out)} output buffers")
        with self._cond:
            self._check_open()
            st = self._ns(ns)
        dsts = None if out is None else [as_u8(o, st.block_bytes, st.desc.get("kv_dtype", "")) for o in out]
        with self.acquire(ns, keys) as lease:
            return copy_out(lease, dsts, out)

    def find_reservation(self, rid: int, owner, *, missing_ok: bool = False) -> Reservation | None:
        """The open reservation `rid` held by `owner`; LeaseError otherwise (the daemon's check
        that a client names only its own slots)."""
        with self._cond:
            r = self._reservations.get(rid)
            if r is None and missing_ok:
                return None   # already committed, aborted or reclaimed
            if r is None or r.owner != owner:
                raise LeaseError(f"reservation {rid} is not an open reservation of this client")
            return r

    def find_lease(self, lid: int, owner) -> Lease:
        """The open lease `lid` held by `owner`; LeaseError otherwise."""
        with self._cond:
            lease = self._leases.get(lid)
            if lease is None or lease.owner != owner:
                raise LeaseError(f"lease {lid} is not an open lease of this client")
            return lease

    def drop_owner(self, owner) -> tuple[int, int]:
        """Abort every reservation and release every lease held by `owner` (a disconnected
        client). Returns (reservations aborted, leases released)."""
        with self._cond:
            rs = [r for r in self._reservations.values() if r.owner == owner]
            ls = [l for l in self._leases.values() if l.owner == owner]
            for r in rs:
                del self._reservations[r.id]
                self._abort_locked(r)
            for l in ls:
                del self._leases[l.id]
                self._release_locked(l)
            return len(rs), len(ls)

    # -- operator actions ---------------------------------------------------------------------
    def flush(self, tier: str = "all", namespace=None) -> int:
        """Drop blocks from `tier` ("gpu", "host", "disk" or "all"), of one namespace or all.
        Leased or in-flight blocks are skipped. Returns the number of blocks dropped."""
        if tier not in ("host", "disk", "all", "gpu", "remote"):
            raise TierdError(f"flush: unknown tier {tier!r}; use gpu, host, disk, remote or all")
        if tier == "remote":
            return self._flush_remote(namespace)
        with self._cond:
            self._check_open()
            ns_id = None if namespace is None else self._ns_for_flush(namespace)
            dropped = 0
            disk = self.disk
            fence = tier in ("disk", "all") and disk is not None and not disk.closed
            if fence:
                # every copy written before now is dead, indexed or not (copies evicted earlier
                # left valid headers behind): recovery and write settles check the fence
                disk.set_fence(ns_id)

        def one(b: _Block) -> None:
            nonlocal dropped
            hit = False
            if tier == "gpu" and b.gpu_slot >= 0 and b.gpu_pins == 0:
                self._drop_gpu(b, evicted=False)
                hit = True
            if tier in ("host", "all") and self._host_evictable(b):
                self._drop_host(b, evicted=False)
                hit = True
            if tier in ("disk", "all") and disk is not None and b.disk is not None and b.disk_pins == 0:
                self._drop_disk(b, evicted=False)   # its slot may be reused at once
                hit = True
            dropped += hit
        self._each_block(one, ns_id)
        # Gone from the index now; the fence is made durable outside the lock.
        if fence:
            try:
                disk.save_fences()
            except OSError as e:
                with self._cond:
                    self._disk_error("flush record", e)
                raise DiskDegradedError(f"flush: {dropped} blocks were dropped but the flush could not be "
                                        f"recorded on disk ({e}); they may come back after a restart") from None
        return dropped

    def _flush_remote(self, namespace) -> int:
        """Delete a namespace's values (or all of tierd's) from the remote tier, which other
        nodes share (never part of "all"). SCAN by prefix and DEL in batches, no lock held."""
        if self.remote is None:
            return 0
        with self._cond:
            self._check_open()
            ns_id = None if namespace is None else self._ns_for_flush(namespace)
            for d in (self._remote_known, self._remote_absent):
                for k in [k for k in d if ns_id is None or k[:16] == ns_id]:
                    del d[k]
        try:
            removed = self.remote.flush_namespace(ns_id)
        except Exception as e:  # noqa: BLE001 -- report it as a tier error
            with self._cond:
                self._remote_error("flush", e)
            raise TierdError(f"flush: remote tier failed ({e})") from None
        if self._events is not None:   # what left the shared tier, for routers (in chunks)
            for i in range(0, len(removed), self.SCAN_CHUNK):
                with self._cond:
                    for nsid, key in removed[i:i + self.SCAN_CHUNK]:
                        self._events.record(nsid.hex()[:16], events.block_removed([key], "remote"))
        return len(removed)

    def _ns_for_flush(self, namespace) -> bytes:
        if isinstance(namespace, Namespace):
            return namespace.id
        for st in self._namespaces.values():
            if namespace in (st.ns_id, st.name, st.ns_id.hex()):
                return st.ns_id
        raise UnknownNamespaceError(f"flush: unknown namespace {namespace!r}")

    @staticmethod
    def _unsynced(b: _Block) -> bool:
        return b.host_state == READY and b.disk is None and not b.disk_writing

    def unsynced_blocks(self) -> int:
        """Host blocks without a disk copy: what `sync()` would write."""
        n = 0

        def count(b: _Block) -> None:
            nonlocal n
            n += self._unsynced(b)
        self._each_block(count)
        return n

    REMOTE_DRAIN_S = 10.0    # how long a sync waits for the remote write-behind queue

    def sync(self, max_blocks: int | None = None) -> int:
        """Write every host-only block (at most `max_blocks`) to disk and make all disk
        writes durable; a reopen then serves them. With a remote tier, also wait (up to
        REMOTE_DRAIN_S) until its write-behind queue has gone to the server (`remote_pending`
        says what is left). Returns the number of blocks written to disk.
        Raises DiskDegradedError when the disk tier cannot take them (nothing is acknowledged
        durable that is not)."""
        written = self._sync_disk(max_blocks)
        if self.remote is not None:
            with self._cond:
                self._drain_remote(self.REMOTE_DRAIN_S)
        return written

    def push_remote(self, max_blocks: int | None = None) -> int:
        """Send the remote tier every block this node holds in host RAM that the server lacks
        (at most `max_blocks`), in chain order, and wait until they are written: a node about to
        be drained hands its cache to the fleet; with `remote.write_behind` off this is the only
        way blocks reach the server. Returns how many were written; 0 when there is no remote
        tier or it is degraded."""
        if self.remote is None:
            return 0
        written = 0
        todo: list[_Block] = []
        self._each_block(lambda b: todo.append(b) if b.host_state == READY and b.owner_res == 0 else None)
        todo = todo[:max_blocks] if max_blocks is not None else todo
        step = self.config.remote_queue_blocks
        for i in range(0, len(todo), step):
            chunk = todo[i:i + step]
            by_ns: dict[bytes, list[_Block]] = {}
            for b in chunk:
                by_ns.setdefault(b.st.ns_id, []).append(b)
            try:   # skip what the server has (one round trip per namespace)
                lacking = [b for ns_id, bs in by_ns.items()
                           for b, there in zip(bs, self.remote.exists_many(ns_id, [b.key for b in bs]))
                           if not there]
            except Exception as e:  # noqa: BLE001 -- a remote failure: nothing more to push
                with self._cond:
                    self._remote_error("lookup", e)
                break
            with self._cond:
                if not self._remote_ok():
                    break
                self._drain_remote(self.REMOTE_DRAIN_S)   # room in the queue for the whole chunk
                before = self._rr["writes"]
                for b in lacking:
                    if b.host_state == READY and self._blocks.get(b.ikey) is b:
                        self._remote_known.pop(b.ikey, None)
                        self._remote_enqueue(b)
                self._drain_remote(self.REMOTE_DRAIN_S)
                written += self._rr["writes"] - before
        return written

    def _sync_disk(self, max_blocks: int | None) -> int:
        if self.disk is None:
            return 0
        written = 0
        with self._cond:
            self._check_open()
            degraded, disk = self._disk_health.fault is not None, self.disk
        if degraded and not disk.closed:
            # an explicit sync probes the disk at once (outside the lock): a disk that is back
            # takes the sync now, not at the maintainer's next probe
            try:
                disk.probe()
            except OSError as e:
                with self._cond:
                    self._disk_error("probe", e)
            else:
                with self._cond:
                    if not self._note_stall():
                        self._disk_healthy()
        todo: list[_Block] = []   # insertion order: a chain's ancestors before its descendants
        self._each_block(lambda b: todo.append(b) if self._unsynced(b) else None)
        todo = todo[:max_blocks] if max_blocks is not None else todo
        with self._cond:
            self._check_open()
            if self._disk_health.fault is not None:
                self._disk_health.retry_at = 0.0       # the sync's first write batch probes too
            for i in range(0, len(todo), self.WRITE_BATCH):
                written += self._write_down_batch(todo[i:i + self.WRITE_BATCH])
                if self._disk_health.fault is not None:
                    break
            while self._writes_in_flight and not self._note_stall():
                self._cond.wait(0.05)
            fault, disk = self._disk_health.fault, self.disk
        if fault is not None:
            raise DiskDegradedError(f"sync: disk tier degraded ({fault}); "
                                    f"{len(todo) - written} blocks are in host RAM only")
        try:
            disk.flush()
        except OSError as e:
            with self._cond:
                self._disk_error("fdatasync", e)
            raise DiskDegradedError(f"sync: disk tier degraded (fdatasync: {e})") from None
        return written

    # -- background demotion ----------------------------------------------------------------
    def _wake_demoter(self) -> None:
        if self.host.alloc.used_bytes > self.config.host_high_watermark * self.host.capacity_bytes:
            self._demote_wanted = True
            self._cond.notify_all()

    WRITE_BATCH = 32  # blocks per parallel disk write batch (bounded by the I/O pool)
    ALLOC_WAIT_S = 5.0  # longest a put waits for in-flight disk writes to free host room

    def _maintain(self) -> None:
        cfg = self.config
        while True:
            with self._cond:
                if not self._closed and not self._demote_wanted:
                    self._cond.wait(cfg.demotion_interval_s)
                if self._closed:
                    return
                self._demote_wanted = False
            wrote = 0
            try:
                self._check_disk()            # takes the lock itself, does its I/O without it
                with self._cond:
                    if not self._closed:
                        wrote = self._demote_pass()   # releases the lock around disk writes
            except Exception:  # noqa: BLE001 -- the maintainer must outlive any one pass
                log.exception("tierd maintainer: unexpected error; continuing")
            if wrote and self.disk is not None:
                try:
                    self.disk.flush()
                except OSError as e:
                    with self._cond:
                        self._disk_error("fdatasync", e)

    def _demote_pass(self) -> int:
        """Host above its high watermark: demote coldest blocks until the low watermark;
        disk above its high watermark: evict until its low watermark. Lock held."""
        cfg, moved = self.config, 0
        host_cap = self.host.capacity_bytes
        if self.host.alloc.used_bytes > cfg.host_high_watermark * host_cap:
            while self.host.alloc.used_bytes > cfg.host_low_watermark * host_cap and not self._closed:
                # Pick a batch of distinct victims: each picked one is pinned while picking so
                # the policy moves on (and its parent keeps a resident child: not picked).
                batch: list[_Block] = []
                excess = self.host.alloc.used_bytes - cfg.host_low_watermark * host_cap
                while len(batch) < self.WRITE_BATCH and excess > 0:
                    key = self._rh.policy.victim(
                        lambda k: self._host_evictable(self._blocks[k]) and self._blocks[k].host_children == 0)
                    if key is None:
                        break
                    b = self._blocks[key]
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
                        if self._admission.admit(b.hits):
                            need.append(b)
                        else:
                            self._rd.counters["admission_rejected"] += 1
                if need:
                    moved += self._write_down_batch(need)
                freed = 0
                for b in batch:
                    if self._host_evictable(b):
                        self._drop_host(b, evicted=True)
                        freed += 1
                if not freed:
                    break
        if self.disk is not None:
            disk_cap = self.disk.capacity_bytes
            if self.disk.alloc.used_bytes > cfg.disk_high_watermark * disk_cap:
                while self.disk.alloc.used_bytes > cfg.disk_low_watermark * disk_cap:
                    key = self._rd.policy.victim(
                        lambda k: self._disk_evictable(self._blocks[k]) and self._blocks[k].disk_children == 0)
                    if key is None:
                        break
                    self._drop_disk(self._blocks[key], evicted=True)
        return moved

    def reconfigure(self, new: StoreConfig) -> None:
        """Apply the settings that can change while running: watermarks and SSD admission."""
        new = new.resolved()
        with self._cond:
            for name in ("host_high_watermark", "host_low_watermark", "disk_high_watermark",
                         "disk_low_watermark", "disk_admit_min_hits"):
                setattr(self.config, name, getattr(new, name))
            self._admission = AdmissionFilter(new.disk_admit_min_hits)
            self._wake_demoter()

    # -- stats and lifecycle ----------------------------------------------------------------
    def stats(self) -> dict:
        """Counters and gauges per tier and per namespace (see docs/operations.md)."""
        with self._cond:
            self._note_stall()
            tiers = {"host": self._rh.stats(extra_waste=self._pad_bytes)}
            if self.gpu is not None:
                tiers["gpu"] = self._rg.stats()
            if self.disk is not None:
                pad = sum(st.counters["disk_blocks"] * (st.disk_slot_bytes - st.block_bytes)
                          for st in self._namespaces.values())
                disk = self._rd.stats(extra_waste=pad)
                disk.update(degraded=self._disk_health.fault or "",
                            degraded_seconds=(time.monotonic() - self._disk_health.since
                                              if self._disk_health.fault else 0.0),
                            degraded_episodes=self._disk_health.count)
                tiers["disk"] = disk
            if self.remote is not None:
                tiers["remote"] = {**self.remote.usage(), **self._rr, "queue": len(self._remote_q),
                                   "degraded": self._remote_health.fault or "",
                                   "degraded_seconds": (time.monotonic() - self._remote_health.since
                                                        if self._remote_health.fault else 0.0),
                                   "degraded_episodes": self._remote_health.count}
            namespaces = {}
            for st in self._namespaces.values():
                c = dict(st.counters)
                asked = c["hits"] + c["misses"]
                c["hit_rate"] = c["hits"] / asked if asked else 0.0
                c["block_bytes"] = st.block_bytes
                c["description"] = st.desc
                namespaces[st.name] = c
            return {"tiers": tiers, "namespaces": namespaces, "leases": len(self._leases),
                    "reservations": len(self._reservations), "policy": self.config.eviction_policy,
                    "time": time.time()}

    def _check_open(self) -> None:
        if self._closed:
            raise StoreClosedError("the store is closed")

    CLOSE_WAIT_S = 10.0   # how long close waits for disk writes in flight (never for a hung disk)

    def close(self, *, sync: bool = False) -> None:
        """Stop background work, flush the disk tier and write its checkpoint. Host-only blocks
        are lost unless `sync=True` (or `sync()` was called). Always completes: a disk that
        hangs or fails is left without a checkpoint (the next open scans its headers)."""
        if sync and not self._closed:
            self.sync()
        with self._cond:
            if self._closed:
                return
            self._closed = True
            self._cond.notify_all()
        deadline = time.monotonic() + self.CLOSE_WAIT_S
        self._maintainer.join(max(0.1, deadline - time.monotonic()))
        if self.remote is not None:
            self._remote_wake.set()
            for t in self._remote_threads:
                t.join(10 + 2 * self.config.remote_timeout_s)
            self.remote.close()
        with self._cond:
            while self._writes_in_flight and time.monotonic() < deadline and not self._note_stall():
                self._cond.wait(0.05)
            stuck = self._writes_in_flight or self._batch_writing or self._maintainer.is_alive()
            for r in list(self._reservations.values()):
                self._abort_locked(r)
            self._reservations.clear()
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
        self.host.close()

    def __enter__(self) -> "TieredStore":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
