"""Tier health: fault episodes (degraded, probed, recovered) and the disk tier's watch — a
stalled call noticed while it still hangs, a vanished directory let go and a returning one
reopened. Part of `TieredStore`; no disk call runs under its lock."""

from __future__ import annotations

import logging
import os
import threading
import time

from ..errors import TierdError
from ..policy import make_policy
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
    """Part of `TieredStore` (see its docstring): state and lock are the store's."""

    def _open_disk(self) -> DiskTier:
        cfg = self.config
        return DiskTier(cfg.disk_path, cfg.disk_bytes, cfg.disk_slab_bytes, cfg.disk_file_bytes,
                        direct_io=cfg.disk_direct_io, codec=cfg.disk_codec, zstd_level=cfg.disk_zstd_level,
                        io_threads=cfg.disk_io_threads, fault_file=cfg.disk_fault_file,
                        buffer_idle_s=cfg.disk_buffer_idle_s)

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
                # its I/O threads may be stuck in a call that never returns: let go of the tier
                # on a thread of its own, so this one (the demoter) goes on
                threading.Thread(target=_abandon, args=(disk,), name="tierd-disk-abandon", daemon=True).start()
                return
            if probe:
                self._probe_disk(disk)
            disk.trim_buffers()       # I/O buffers idle for a while go back to the system
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

    def _probe_disk(self, disk) -> None:
        """(No lock.) Probe `disk` (a small durable write, read back): success ends a fault
        episode, failure extends it."""
        try:
            disk.probe()
        except OSError as e:
            with self._cond:
                self._disk_error("probe", e)
        else:
            with self._cond:
                if not self._note_stall():
                    self._disk_healthy()

    def _forget_disk(self) -> None:
        """(Lock held.) Forget every disk copy (their files are gone); the caller then
        abandons the old tier outside the lock. Writes still under way are not waited for (one
        may hang for ever on a vanished directory): they settle as the dead tier's when they
        return (`_disk_epoch`), and nothing waits for them meanwhile."""
        self._disk_epoch += 1
        self._writes_in_flight = 0
        self._batch_writing = False
        for b in [b for b in self._blocks.values() if b.disk is not None]:
            self._drop_disk(b, evicted=False)
        for b in self._rd.owner.values():
            if b.orphan:
                # a doomed copy a read still pins, whose key was written again (out of
                # `_blocks`): it goes with the old tier; when its pin goes nothing is left to drop
                b.disk = None
        self._rd.owner.clear()
        self._rd.policy = make_policy(self.config.eviction_policy)
        self.disk.mark_closed()   # no new I/O goes to it


def _abandon(disk: DiskTier) -> None:
    try:
        disk.abandon()
    except OSError:
        pass
