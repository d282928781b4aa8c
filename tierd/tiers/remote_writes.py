"""The remote tier's write-behind (`WriteBehind`): its queue, its writer threads, batching, and
the probes of a degraded server. It writes through `RemoteTier` (tierd/tiers/remote.py) and
reaches the store (tierd/store/remote.py) only through three callbacks; it never holds its own
lock while calling them, and a block it could not write stays on this node.
"""

from __future__ import annotations

import collections
import threading
import time
from typing import TYPE_CHECKING

from .base import BlockMeta

if TYPE_CHECKING:
    from .remote import RemoteTier


class WriteBehind:
    """The remote tier's write-behind: blocks pinned in host RAM by the store, written to the
    server in batches (at most BATCH blocks, about BATCH_BYTES) by WRITERS threads on their own
    connections, so one batch is encoded while another waits for the server. The lead thread
    also probes a degraded server and refreshes the server's memory figures.

    It owns its queue, threads and batching, and reaches the store only through callbacks:
    `settle(tokens, metas, err, seconds)` when a batch is over (written, failed, or dropped
    because the tier is degraded: `DroppedError`), `degraded()` -> (is degraded, probe due),
    `probed(err)`. Its own lock is never held while it calls them, so the store may hold its
    lock when it calls `submit`. A token is the store's (its pinned block), opaque here."""

    BATCH = 32
    BATCH_BYTES = 8 << 20
    WRITERS = 2
    USAGE_S = 5.0

    class DroppedError(Exception):
        """The tier was degraded: the batch was dropped unsent."""

    def __init__(self, tier: "RemoteTier", *, queue_blocks: int, settle, degraded, probed):
        self.tier = tier
        self.queue_blocks = queue_blocks
        self._settle, self._degraded, self._probed = settle, degraded, probed
        self._lock = threading.Lock()
        self._q: collections.deque = collections.deque()   # (token, meta, view)
        self._inflight = 0
        self._wake = threading.Event()
        self._closing = False
        self._threads = [threading.Thread(target=self._run, args=(i == 0,), name=f"tierd-remote-{i}", daemon=True)
                         for i in range(self.WRITERS)]
        for t in self._threads:
            t.start()

    def submit(self, token, meta: BlockMeta, view) -> bool:
        """Queue one pinned block (`view`: its bytes, valid while the store keeps it pinned);
        False (not queued) when the queue is full."""
        with self._lock:
            if len(self._q) >= self.queue_blocks or self._closing:
                return False
            self._q.append((token, meta, view))
        self._wake.set()
        return True

    def pending(self) -> int:
        """Blocks waiting for, or on their way to, the server."""
        with self._lock:
            return len(self._q) + self._inflight

    def nudge(self) -> None:
        self._wake.set()

    def close(self, timeout_s: float) -> None:
        """Write what is queued (or drop it, degraded), then stop the threads."""
        with self._lock:
            self._closing = True
        self._wake.set()
        for t in self._threads:
            t.join(timeout_s)

    def _take(self, drop: bool) -> list:
        with self._lock:
            if drop:
                batch, self._q = list(self._q), collections.deque()
            else:
                n = min(self.BATCH, len(self._q))
                if n:   # a few MiB a round trip: the other writer's batch fills the wait
                    n = min(n, max(1, self.BATCH_BYTES // max(1, self._q[0][1].block_bytes)))
                batch = [self._q.popleft() for _ in range(n)]
            self._inflight += len(batch)
            return batch

    def _done(self, batch: list, err, seconds: float) -> None:
        try:
            self._settle([t for t, _, _ in batch], [m for _, m, _ in batch], err, seconds)
        finally:
            with self._lock:
                self._inflight -= len(batch)

    def _run(self, lead: bool) -> None:
        tier = self.tier
        usage_at = 0.0
        if lead:
            try:
                tier.probe()                 # is the server there at all? (else: degraded now)
            except Exception as e:  # noqa: BLE001 -- any client or server failure
                self._probed(e)
        while True:
            self._wake.wait(0.25)
            self._wake.clear()
            with self._lock:
                closing = self._closing
            degraded, probe_due = self._degraded()
            if degraded:
                dropped = self._take(drop=True)    # nothing waits for a degraded server
                if dropped:
                    self._done(dropped, self.DroppedError("remote tier degraded"), 0.0)
            if lead and probe_due:
                try:
                    tier.probe()
                except Exception as e:  # noqa: BLE001 -- any client or server failure
                    self._probed(e)
                else:
                    self._probed(None)
            now = time.monotonic()
            if lead and now >= usage_at:
                usage_at = now + self.USAGE_S
                try:
                    tier.refresh_usage()
                except Exception:  # noqa: BLE001 -- figures for stats only; probes judge health
                    pass
            batch = [] if degraded else self._take(drop=False)
            if batch:
                err = None
                t0 = time.perf_counter()
                try:
                    tier.set_many([(tier.rkey(m.ns_id, m.key), tier.encode(v, m)) for _, m, v in batch])
                except Exception as e:  # noqa: BLE001 -- the blocks stay on this node
                    err = e
                self._done(batch, err, time.perf_counter() - t0)
                if self.pending():
                    self._wake.set()
            if closing and not self.pending():
                return
