"""The store's side of the remote tier: lookups past this node's blocks, fetches planned into
host slots and settled, the write-behind queue of pinned host blocks, pushes and flushes. The
tier itself (tiers/remote.py) is storage only; no call to the server runs under the store lock."""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

from ..errors import ConfigError, TierdError
from ..tiers.disk import CorruptBlockError
from .records import LOADING, READY, REMOTE, Block, NsState

log = logging.getLogger("tierd.store")


class RemoteLink:
    """Part of `TieredStore` (see its docstring): state and lock are the store's."""

    REMOTE_RETRY_S = 1.0     # while degraded, one call per interval probes the server
    REMOTE_DRAIN_S = 10.0    # how long a sync waits for the remote write-behind queue

    def _remote_error(self, what: str, e: BaseException) -> None:
        """(Lock held.) A remote failure: the first of an episode degrades the tier (logged once);
        lookups, loads and writes skip it until a probe succeeds."""
        self._rr["errors"] += 1
        self._remote_health.error(what, e)

    def _remote_healthy(self) -> None:
        self._remote_health.healthy()

    def _remote_had(self, b: Block) -> bool:
        """(Lock held.) The remote tier holds `b`, as far as the store knows lately."""
        return self._remote_memory is not None and self._remote_memory.had(b.ikey, time.monotonic())

    def _remote_ok(self) -> bool:
        """(Lock held.) The remote tier is there and not degraded."""
        return self.remote is not None and self._remote_health.fault is None

    def _remote_timed(self, seconds: float) -> None:
        r = self._rr
        r["latency_ms"] = seconds * 1e3 if not r["latency_ms"] else 0.9 * r["latency_ms"] + 0.1 * seconds * 1e3

    # -- write-behind (tiers/remote.py: WriteBehind owns the queue and threads) ----------------
    def _remote_enqueue(self, b: Block) -> None:
        """(Lock held.) Write `b` (READY in host RAM) to the remote tier behind the caller's back:
        its host slot stays pinned until the write is settled; a full queue or a degraded tier
        drops it."""
        if not self._remote_ok() or self._remote_memory.had(b.ikey, time.monotonic()):
            return
        meta = b.st.meta(b.key, b.parent[16:] if b.parent else None, exact=b.decoded)
        b.host_pins += 1
        if not self._write_behind.submit(b, meta, self.host.view(b.host_slot, b.st.block_bytes)):
            b.host_pins -= 1
            self._rr["write_dropped"] += 1

    def _remote_written(self, blocks: list[Block], metas, err, seconds: float) -> None:
        """(WriteBehind's callback, no lock held.) A batch is over: unpin, remember, count."""
        with self._cond:
            now = time.monotonic()
            for b in blocks:
                b.host_pins -= 1
                self._index.reap(b)
            if err is None:
                self._remote_timed(seconds)
                for b in blocks:
                    self._remote_memory.note_had(b.ikey, now)
                    if self._feed.on:
                        self._feed.event(b, "remote", True)
                self._rr["writes"] += len(blocks)
                self._rr["bytes_in"] += sum(m.block_bytes for m in metas)
            else:
                self._rr["write_dropped"] += len(blocks)
                if not isinstance(err, self._write_behind.DroppedError):
                    self._remote_error("write", err)
            self._cond.notify_all()

    def _remote_degraded(self) -> tuple[bool, bool]:
        """(WriteBehind's callback.) (degraded now, time for a probe)."""
        with self._cond:
            h = self._remote_health
            return h.fault is not None, h.fault is not None and time.monotonic() >= h.retry_at

    def _remote_probed(self, err) -> None:
        """(WriteBehind's callback.) A probe's outcome (None: the server answered)."""
        with self._cond:
            if err is None:
                self._remote_healthy()
            else:
                self._remote_error("probe" if self._remote_health.count else "connect", err)

    def remote_pending(self) -> int:
        """Blocks waiting for (or on their way to) the remote tier."""
        return self._write_behind.pending() if self._write_behind is not None else 0

    def _drain_remote(self, timeout_s: float) -> int:
        """(Lock held.) Wait until the write-behind queue is empty (written, or dropped by a
        degraded tier), at most `timeout_s`. Returns the blocks still pending."""
        deadline = time.monotonic() + timeout_s
        while self._write_behind.pending():
            left = deadline - time.monotonic()
            if left <= 0 or self._closed:
                break
            self._write_behind.nudge()
            self._cond.wait(min(left, 0.1))
        return self._write_behind.pending()

    def _remote_leading(self, st: NsState, keys: Sequence[bytes]) -> int:
        """Leading `keys` the remote tier holds: from the store's memory of the server where it
        has one, else asked in one round trip (no lock held). 0 when the tier is degraded."""
        now = time.monotonic()
        with self._cond:
            if not self._remote_ok():
                return 0
            n = 0
            memory = self._remote_memory
            for k in keys:
                ikey = st.ns_id + k
                if memory.had(ikey, now):
                    n += 1
                    continue
                if memory.lacked(ikey, now):
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
                    self._remote_memory.note_had(st.ns_id + k, t)
                else:
                    self._remote_memory.note_lacked(st.ns_id + k, t)
        for there in found:
            if not there:
                break
            n += 1
        return n

    def _plan_remote(self, st: NsState, keys: Sequence[bytes], plan: list) -> None:
        """(Lock held; may release it to make room.) Continue an acquire's plan with keys this
        node does not have: host slots (LOADING) for the remote tier to fill."""
        now = time.monotonic()
        prev = st.ns_id + keys[len(plan) - 1] if plan else None
        for k in keys[len(plan):]:
            ikey = st.ns_id + k
            if self._remote_memory.lacked(ikey, now) or self._blocks.get(ikey) is not None:
                return   # known missing, or this node has it in some state: stop here
            slot = self._host_alloc(st)
            if slot is None:
                return
            if self._blocks.get(ikey) is not None or not self._remote_ok():
                self.host.free_slot(slot)
                return
            b = self._index.new_block(ikey, st, k)
            self._index.link(b, prev)
            b.host_slot, b.host_state = slot, LOADING
            self._rh.owner[slot] = b
            self._index.publish(b)
            b.host_pins += 1
            plan.append((b, REMOTE))
            prev = ikey

    def _settle_remote(self, b: Block, err) -> bool:
        """(Lock held.) A remote fetch into `b`'s host slot is over: READY on success (True),
        else the slot goes back and the key is remembered as missing."""
        now = time.monotonic()
        if err is None:
            b.host_state, b.csum = READY, -1
            b.decoded = bool(b.st.lossy)   # the server's value may have been lossy: write it exact
            self._rh.policy.insert(b.ikey)
            self._index.enter(b, "host")
            self._remote_memory.note_had(b.ikey, now)
            self._rr["hits"] += 1
            self._rr["bytes_out"] += b.st.block_bytes
            self._remote_healthy()
            return True
        b.host_pins -= 1
        self._index.drop_host(b, evicted=False)
        self._remote_memory.forget(b.ikey)
        if isinstance(err, KeyError):
            self._rr["misses"] += 1
            self._remote_memory.note_lacked(b.ikey, now)
        elif isinstance(err, CorruptBlockError):
            # dropped, never served — and never deleted: the tier is shared, and what this node
            # cannot verify (another fleet key, a newer format) may be another node's block; a
            # node that holds the block writes it over the damaged value
            log.warning("remote tier: dropped a damaged value of %s (%s)", b.st.name, err)
            self._rr["corrupt_dropped"] += 1
            self._remote_memory.note_lacked(b.ikey, now)
        else:
            self._remote_error("read", err)
        return False

    def _load_from_remote(self, blocks: list[Block]) -> dict[int, Exception | None]:
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

    def _flush_remote(self, namespace) -> int:
        """Delete a namespace's values (or all of tierd's) from the remote tier, which other
        nodes share (never part of "all"). SCAN by prefix and DEL in batches, no lock held."""
        if self.remote is None:
            return 0
        with self._cond:
            self._check_open()
            ns_id = None if namespace is None else self._ns_for_flush(namespace)
            self._remote_memory.forget_namespace(ns_id)
        try:
            removed = self.remote.flush_namespace(ns_id)
        except Exception as e:  # noqa: BLE001 -- report it as a tier error
            with self._cond:
                self._remote_error("flush", e)
            raise TierdError(f"flush: remote tier failed ({e})") from None
        if self._feed.on:   # what left the shared tier, for routers (in chunks)
            for i in range(0, len(removed), self.SCAN_CHUNK):
                with self._cond:
                    for nsid, key in removed[i:i + self.SCAN_CHUNK]:
                        self._feed.removed(nsid, key, "remote")
        return len(removed)

    def push_remote(self, max_blocks: int | None = None) -> int:
        """Send the remote tier every block this node holds in host RAM that the server lacks
        (at most `max_blocks`), in chain order, and wait until they are written: a node about to
        be drained hands its cache to the fleet; with `remote.write_behind` off this is the only
        way blocks reach the server. Returns how many were written; 0 when there is no remote
        tier is degraded; raises ConfigError where there is no remote tier."""
        if self.remote is None:
            raise ConfigError("sync --remote: this store has no remote tier ([remote] url); nothing was sent")
        written = 0
        todo: list[Block] = []
        self._each_block(lambda b: todo.append(b) if b.host_state == READY and b.owner_res == 0 else None)
        todo = todo[:max_blocks] if max_blocks is not None else todo
        step = self.config.remote_queue_blocks
        for i in range(0, len(todo), step):
            chunk = todo[i:i + step]
            by_ns: dict[bytes, list[Block]] = {}
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
                        self._remote_memory.forget(b.ikey)
                        self._remote_enqueue(b)
                self._drain_remote(self.REMOTE_DRAIN_S)
                written += self._rr["writes"] - before
        return written
