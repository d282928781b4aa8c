"""Tier health: fault episodes (degraded, probed, recovered) and the disk tier's watch — a
stalled call noticed while it still hangs, a vanished directory let go and a returning one
reopened. A part of `TieredStore`; no disk call runs under its lock."""

from __future__ import annotations

import logging
import os
import threading
import time

from ..errors import TierdError
from ..tiers.disk import DiskTier

log = logging.getLogger("tierd.store")


class TierHealth:
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


class DiskHealth:
    """The disk tier's health: its fault episodes, and the maintainer's watch on it — a stalled
    call noticed while it still hangs, a vanished directory let go and a returning one reopened.

    Fields, guarded by the store's lock (`cond`): `episodes` (the disk's `TierHealth`),
    `checked_at` (the watch's last look), `index` (the daemon's shared lookup index, told
    whether disk copies count; set by `TieredStore.attach_index`). Collaborators: the store's
    lock, the disk tier's residency record (`Resident`: its tier, and the `io_errors`
    counter), the store's config, and two calls on the store: `forget()` (lock held: the
    directory vanished, every disk copy is forgotten) and `reopened(tier)` (lock held: a fresh
    disk tier in the returning directory, its blocks to index).

    Invariant: no disk call runs under the lock; a stalled call is seen from the calls in
    flight (`DiskTier.oldest_io`), never waited for."""

    RETRY_S = 1.0      # while degraded, one write batch per interval probes the disk
    CHECK_S = 0.5      # how often the maintainer checks the directory is still there

    def __init__(self, cond, resident, config, *, forget, reopened):
        self.cond = cond
        self.resident = resident
        self.config = config
        self.forget, self.reopened = forget, reopened
        self.episodes = TierHealth("disk", self.RETRY_S, "serving from host RAM only")
        self.checked_at = 0.0
        self.index = None

    @property
    def fault(self) -> str | None:
        """(Lock held.) Why the disk tier is degraded; None while it is healthy."""
        return self.episodes.fault

    def probe_soon(self) -> None:
        """(Lock held.) The next write batch probes the disk, not waiting for `RETRY_S`."""
        self.episodes.retry_at = 0.0

    def open_tier(self) -> DiskTier:
        """(No lock: may scan the directory.) A disk tier as the config describes it."""
        cfg = self.config
        return DiskTier(cfg.disk_path, cfg.disk_bytes, cfg.disk_slab_bytes, cfg.disk_file_bytes,
                        direct_io=cfg.disk_direct_io, codec=cfg.disk_codec, zstd_level=cfg.disk_zstd_level,
                        io_threads=cfg.disk_io_threads, fault_file=cfg.disk_fault_file,
                        buffer_idle_s=cfg.disk_buffer_idle_s)

    def error(self, what: str, e: BaseException) -> None:
        """(Lock held.) A disk fault: count it; the first one of an episode degrades the disk
        tier (logged once) until a later write or probe succeeds."""
        self.resident.counters["io_errors"] += 1
        self.episodes.error(what, e)

    def healthy(self) -> None:
        """(Lock held.) A disk call succeeded: an episode under way ends."""
        self.episodes.healthy()

    def waiting(self) -> bool:
        """(Lock held.) Degraded and not yet time for the next probe: leave the disk alone."""
        self.note_stall()
        return self.episodes.fault is not None and time.monotonic() < self.episodes.retry_at

    def note_stall(self) -> bool:
        """(Lock held.) True while a disk call has been running longer than `disk_stall_s`: the
        disk tier is then degraded (reads and writes skip it) until the call returns and a write
        or a probe succeeds."""
        disk = self.resident.tier
        io = disk.oldest_io() if disk is not None else None
        if io is None or io[1] < self.config.disk_stall_s:
            if self.index is not None:
                self.index.set_disk_ok(True)
            return False
        if self.index is not None:
            self.index.set_disk_ok(False)
        op, age = io
        if self.episodes.fault is None:
            self.error(f"{op} stalled", TimeoutError(f"a disk {op} has not returned for {age:.1f}s"))
        self.episodes.retry_at = max(self.episodes.retry_at, time.monotonic() + self.RETRY_S)
        return True

    def refresh(self) -> None:
        """Lock-free (the daemon's heartbeat, on its event loop, which never waits for the
        store lock): tell the shared index whether a disk call has stalled, from the disk's
        calls in flight only."""
        disk, index = self.resident.tier, self.index
        if index is not None:
            io = disk.oldest_io() if disk is not None else None
            index.set_disk_ok(io is None or io[1] < self.config.disk_stall_s)

    def check(self) -> None:
        """Maintainer (takes the lock itself; every disk call runs outside it): notice a
        vanished directory; probe a degraded disk; once a vanished directory is back, start a
        fresh disk tier there (the old one's blocks went with it)."""
        now = time.monotonic()
        with self.cond:
            disk = self.resident.tier
            if disk is None or now < self.checked_at + self.CHECK_S:
                return
            self.checked_at = now
            stalled = self.note_stall()
            probe = self.episodes.fault is not None and now >= self.episodes.retry_at and not stalled
            reopen = disk.closed and now >= self.episodes.retry_at
        if not disk.closed:
            try:
                disk.check_present()
            except OSError as e:
                with self.cond:
                    if self.resident.tier is not disk:
                        return
                    self.error("directory check", e)
                    self.forget()
                # its I/O threads may be stuck in a call that never returns: let go of the tier
                # on a thread of its own, so this one (the demoter) goes on
                threading.Thread(target=_abandon, args=(disk,), name="tierd-disk-abandon", daemon=True).start()
                return
            if probe:
                self.probe(disk)
            disk.trim_buffers()       # I/O buffers idle for a while go back to the system
            return
        if reopen and os.path.isdir(self.config.disk_path):
            try:
                new = self.open_tier()   # may scan the directory: no lock
            except (OSError, TierdError) as e:
                with self.cond:
                    self.error("reopen", e)
                return
            with self.cond:
                self.reopened(new)
                self.healthy()

    def probe(self, disk) -> None:
        """(No lock.) Probe `disk` (a small durable write, read back): success ends a fault
        episode, failure extends it."""
        try:
            disk.probe()
        except OSError as e:
            with self.cond:
                self.error("probe", e)
        else:
            with self.cond:
                if not self.note_stall():
                    self.healthy()


def _abandon(disk: DiskTier) -> None:
    try:
        disk.abandon()
    except OSError:
        pass
