"""The store's side of the remote tier: lookups past this node's blocks, fetches planned into
host slots and settled, the write-behind queue of pinned host blocks, pushes and flushes. The
tier itself (tiers/remote.py) is storage only; no call to the server runs under the store lock."""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

from ..errors import ConfigError, TierdError
from ..tiers.disk import CorruptBlockError
from .health import TierHealth
from .lock import SCAN_CHUNK
from .records import LOADING, READY, REMOTE, Block, NsState

log = logging.getLogger("tierd.store")


class RemoteLink:
    """The store's side of the remote tier. Fields: `tier` (the `RemoteTier`, None without one),
    `memory` (which keys the server had or lacked lately: `RemoteMemory`), `write_behind` (its
    queue and threads: `WriteBehind`), `health` (fault episodes: `TierHealth`) and `counters`
    (for stats). Collaborators: the store's lock (`cond`: `StoreLock`), the block index (blocks fetched into
    host slots are indexed and settled there), the event feed, the store's config, and three
    calls on the store: `host_alloc(st)` (lock held: a host slot, making room; may let go of the
    lock) and `walk(fn)` (the store's chunked walk over its blocks).

    Invariants: a block queued for the server pins its host slot (`host_pins`) until its write
    is settled; a fetch lands in a LOADING host slot, pinned, and becomes READY only once its
    value was verified (`tiers/remote.py`); no call to the server runs under the lock, and
    nothing here ever deletes a shared value but an explicit flush of the remote tier."""

    RETRY_S = 1.0     # while degraded, one call per interval probes the server
    DRAIN_S = 10.0    # how long a sync waits for the remote write-behind queue

    def __init__(self, cond, index, feed, config, *, host_alloc, walk):
        self.cond = cond
        self.index = index
        self.feed = feed
        self.config = config
        self.host_alloc, self.walk = host_alloc, walk
        self.tier = None
        self.memory = None
        self.write_behind = None
        self.health = TierHealth("remote", self.RETRY_S, "serving from this node's tiers")
        self.counters = dict.fromkeys(("hits", "misses", "bytes_in", "bytes_out", "writes", "write_dropped",
                                       "errors", "corrupt_dropped", "lookups"), 0)
        self.counters["latency_ms"] = 0.0

    def connect(self, tier) -> None:
        """Serve from `tier` (a `RemoteTier`) from now on: its memory of the server and its
        write-behind start here."""
        from ..tiers.remote import RemoteMemory, WriteBehind
        cfg = self.config
        self.tier = tier
        self.memory = RemoteMemory(cfg.remote_known_s, cfg.remote_absent_s)
        self.write_behind = WriteBehind(tier, queue_blocks=cfg.remote_queue_blocks, settle=self._written,
                                        degraded=self._degraded, probed=self._probed)

    def close(self) -> None:
        """Stop the write-behind (what it still holds is dropped) and disconnect."""
        if self.tier is not None:
            self.write_behind.close(10 + 2 * self.config.remote_timeout_s)
            self.tier.close()

    def stats(self) -> dict:
        """(Lock held; a remote tier.) The remote tier's stats."""
        h = self.health
        return {**self.tier.usage(), **self.counters, "queue": self.write_behind.pending(),
                "degraded": h.fault or "",
                "degraded_seconds": time.monotonic() - h.since if h.fault else 0.0,
                "degraded_episodes": h.count}

    def error(self, what: str, e: BaseException) -> None:
        """(Lock held.) A remote failure: the first of an episode degrades the tier (logged once);
        lookups, loads and writes skip it until a probe succeeds."""
        self.counters["errors"] += 1
        self.health.error(what, e)

    def ok(self) -> bool:
        """(Lock held.) The remote tier is there and not degraded."""
        return self.tier is not None and self.health.fault is None

    def had(self, b: Block) -> bool:
        """(Lock held.) The remote tier holds `b`, as far as the store knows lately."""
        return self.memory is not None and self.memory.had(b.ikey, time.monotonic())

    def timed(self, seconds: float) -> None:
        """(Lock held.) A call to the server took `seconds`: the latency's moving average."""
        r = self.counters
        r["latency_ms"] = seconds * 1e3 if not r["latency_ms"] else 0.9 * r["latency_ms"] + 0.1 * seconds * 1e3

    # -- write-behind (tiers/remote_writes.py: WriteBehind owns the queue and threads) ----------------
    def enqueue(self, b: Block) -> None:
        """(Lock held.) Write `b` (READY in host RAM) to the remote tier behind the caller's back:
        its host slot stays pinned until the write is settled; a full queue or a degraded tier
        drops it."""
        if not self.ok() or self.memory.had(b.ikey, time.monotonic()):
            return
        meta = b.st.meta(b.key, b.parent[16:] if b.parent else None, exact=b.decoded)
        b.host_pins += 1
        if not self.write_behind.submit(b, meta, self.index.host.tier.view(b.host_slot, b.st.block_bytes)):
            b.host_pins -= 1
            self.counters["write_dropped"] += 1

    def _written(self, blocks: list[Block], metas, err, seconds: float) -> None:
        """(WriteBehind's callback, no lock held.) A batch is over: unpin, remember, count."""
        with self.cond:
            now = time.monotonic()
            for b in blocks:
                b.host_pins -= 1
                self.index.reap(b)
            if err is None:
                self.timed(seconds)
                for b in blocks:
                    self.memory.note_had(b.ikey, now)
                    if self.feed.on:
                        self.feed.event(b, "remote", True)
                self.counters["writes"] += len(blocks)
                self.counters["bytes_in"] += sum(m.block_bytes for m in metas)
            else:
                self.counters["write_dropped"] += len(blocks)
                if not isinstance(err, self.write_behind.DroppedError):
                    self.error("write", err)
            self.cond.notify_all()

    def _degraded(self) -> tuple[bool, bool]:
        """(WriteBehind's callback.) (degraded now, time for a probe)."""
        with self.cond:
            h = self.health
            return h.fault is not None, h.fault is not None and time.monotonic() >= h.retry_at

    def _probed(self, err) -> None:
        """(WriteBehind's callback.) A probe's outcome (None: the server answered)."""
        with self.cond:
            if err is None:
                self.health.healthy()
            else:
                self.error("probe" if self.health.count else "connect", err)

    def pending(self) -> int:
        """Blocks waiting for (or on their way to) the remote tier."""
        return self.write_behind.pending() if self.write_behind is not None else 0

    def drain(self, timeout_s: float) -> int:
        """(Lock held.) Wait until the write-behind queue is empty (written, or dropped by a
        degraded tier), at most `timeout_s`. Returns the blocks still pending."""
        deadline = time.monotonic() + timeout_s
        while self.write_behind.pending():
            left = deadline - time.monotonic()
            if left <= 0 or self.cond.closed:
                break
            self.write_behind.nudge()
            self.cond.wait(min(left, 0.1))
        return self.write_behind.pending()

    def leading(self, st: NsState, keys: Sequence[bytes]) -> int:
        """Leading `keys` the remote tier holds: from the store's memory of the server where it
        has one, else asked in one round trip (no lock held). 0 when the tier is degraded."""
        now = time.monotonic()
        with self.cond:
            if not self.ok():
                return 0
            n = 0
            memory = self.memory
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
            self.counters["lookups"] += 1
        ask = list(keys[n:])
        t0 = time.perf_counter()
        try:
            found = self.tier.exists_many(st.ns_id, ask)
        except Exception as e:  # noqa: BLE001 -- a remote failure is a miss
            with self.cond:
                self.error("lookup", e)
            return n
        with self.cond:
            self.timed(time.perf_counter() - t0)
            self.health.healthy()
            t = time.monotonic()
            for k, there in zip(ask, found):
                if there:
                    self.memory.note_had(st.ns_id + k, t)
                else:
                    self.memory.note_lacked(st.ns_id + k, t)
        for there in found:
            if not there:
                break
            n += 1
        return n

    def plan(self, st: NsState, keys: Sequence[bytes], plan: list) -> None:
        """(Lock held; may release it to make room.) Continue an acquire's plan with keys this
        node does not have: host slots (LOADING) for the remote tier to fill."""
        now = time.monotonic()
        prev = st.ns_id + keys[len(plan) - 1] if plan else None
        for k in keys[len(plan):]:
            ikey = st.ns_id + k
            if self.memory.lacked(ikey, now) or self.index.blocks.get(ikey) is not None:
                return   # known missing, or this node has it in some state: stop here
            slot = self.host_alloc(st)
            if slot is None:
                return
            if self.index.blocks.get(ikey) is not None or not self.ok():
                self.index.host.tier.free_slot(slot)
                return
            b = self.index.new_block(ikey, st, k)
            self.index.link(b, prev)
            b.host_slot, b.host_state = slot, LOADING
            self.index.host.owner[slot] = b
            self.index.publish(b)
            b.host_pins += 1
            plan.append((b, REMOTE))
            prev = ikey

    def settle(self, b: Block, err) -> bool:
        """(Lock held.) A remote fetch into `b`'s host slot is over: READY on success (True),
        else the slot goes back and the key is remembered as missing."""
        now = time.monotonic()
        if err is None:
            b.host_state, b.csum = READY, -1
            b.decoded = bool(b.st.lossy)   # the server's value may have been lossy: write it exact
            self.index.host.policy.insert(b.ikey)
            self.index.enter(b, "host")
            self.memory.note_had(b.ikey, now)
            self.counters["hits"] += 1
            self.counters["bytes_out"] += b.st.block_bytes
            self.health.healthy()
            return True
        b.host_pins -= 1
        self.index.drop_host(b, evicted=False)
        self.memory.forget(b.ikey)
        if isinstance(err, KeyError):
            self.counters["misses"] += 1
            self.memory.note_lacked(b.ikey, now)
        elif isinstance(err, CorruptBlockError):
            # dropped, never served — and never deleted: the tier is shared, and what this node
            # cannot verify (another fleet key, a newer format) may be another node's block; a
            # node that holds the block writes it over the damaged value
            log.warning("remote tier: dropped a damaged value of %s (%s)", b.st.name, err)
            self.counters["corrupt_dropped"] += 1
            self.memory.note_lacked(b.ikey, now)
        else:
            self.error("read", err)
        return False

    def load(self, blocks: list[Block]) -> dict[int, Exception | None]:
        """Fetch remote blocks into their LOADING host slots, one round trip, verified (no lock).
        Returns per block id: None (loaded), KeyError (gone), CorruptBlockError or the failure."""
        out: dict[int, Exception | None] = {}
        if not blocks:
            return out
        st = blocks[0].st
        t0 = time.perf_counter()
        try:
            errs = self.tier.fetch_many(st.ns_id, [b.key for b in blocks],
                                          [self.index.host.tier.view(b.host_slot, st.block_bytes) for b in blocks],
                                          lossy_ok=bool(st.lossy))
        except Exception as e:  # noqa: BLE001 -- every block of the call is a miss
            return {id(b): e for b in blocks}
        elapsed = time.perf_counter() - t0
        out = {id(b): e for b, e in zip(blocks, errs)}
        with self.cond:
            self.timed(elapsed)
        return out

    def flush(self, ns_id: bytes | None) -> int:
        """Delete a namespace's values (`ns_id`; None: all of tierd's) from the remote tier,
        which other nodes share (never part of "all"). SCAN by prefix and DEL in batches, no
        lock held."""
        if self.tier is None:
            return 0
        with self.cond:
            self.memory.forget_namespace(ns_id)
        try:
            removed = self.tier.flush_namespace(ns_id)
        except Exception as e:  # noqa: BLE001 -- report it as a tier error
            with self.cond:
                self.error("flush", e)
            raise TierdError(f"flush: remote tier failed ({e})") from None
        if self.feed.on:   # what left the shared tier, for routers (in chunks)
            for i in range(0, len(removed), SCAN_CHUNK):
                with self.cond:
                    for nsid, key in removed[i:i + SCAN_CHUNK]:
                        self.feed.removed(nsid, key, "remote")
        return len(removed)

    def push(self, max_blocks: int | None = None) -> int:
        """Send the remote tier every block this node holds in host RAM that the server lacks
        (at most `max_blocks`), in chain order, and wait until they are written: a node about to
        be drained hands its cache to the fleet; with `remote.write_behind` off this is the only
        way blocks reach the server. Returns how many were written; 0 when the remote tier is
        degraded; raises ConfigError where there is no remote tier."""
        if self.tier is None:
            raise ConfigError("sync --remote: this store has no remote tier ([remote] url); nothing was sent")
        written = 0
        todo: list[Block] = []
        self.walk(lambda b: todo.append(b) if b.host_state == READY and b.owner_res == 0 else None)
        todo = todo[:max_blocks] if max_blocks is not None else todo
        step = self.config.remote_queue_blocks
        for i in range(0, len(todo), step):
            chunk = todo[i:i + step]
            by_ns: dict[bytes, list[Block]] = {}
            for b in chunk:
                by_ns.setdefault(b.st.ns_id, []).append(b)
            try:   # skip what the server has (one round trip per namespace)
                lacking = [b for ns_id, bs in by_ns.items()
                           for b, there in zip(bs, self.tier.exists_many(ns_id, [b.key for b in bs]))
                           if not there]
            except Exception as e:  # noqa: BLE001 -- a remote failure: nothing more to push
                with self.cond:
                    self.error("lookup", e)
                break
            with self.cond:
                if not self.ok():
                    break
                self.drain(self.DRAIN_S)   # room in the queue for the whole chunk
                before = self.counters["writes"]
                for b in lacking:
                    if b.host_state == READY and self.index.blocks.get(b.ikey) is b:
                        self.memory.forget(b.ikey)
                        self.enqueue(b)
                self.drain(self.DRAIN_S)
                written += self.counters["writes"] - before
        return written
