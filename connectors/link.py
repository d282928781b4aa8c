"""What every connector needs from a Store: back-off while it is unavailable, and stores that
never make the engine wait.

`StoreLink` wraps a Store (or a URL opened lazily). `get()` returns the store, or None while
a recent failure's back-off runs, so callers recompute instead of waiting on a dead daemon.
`submit()` queues one filled block for a background thread; when the bounded queue is full the
block is dropped and counted, so decode never stalls on a slow store. Daemon URLs get a 10 s
request timeout unless they name one (`unix:///...?timeout_s=0.5`): a stalled daemon costs a
request at most twice that (the client retries once) once per back-off period. Any tierd error, OS error
or lost connection is counted and starts a back-off (1 s, doubling, at most 30 s).

With `background_connect` (the vLLM scheduler's lookups) the link never connects in the
caller's thread: a connection attempt runs on its own thread, the caller that starts it waits at
most one request timeout, and callers arriving meanwhile get None at once; with `retries=0` a
timed-out request is not retried. Together: no caller waits longer than the timeout.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import threading
import time
from collections.abc import Sequence
from urllib.parse import urlparse

import numpy as np
import torch

import tierd
from tierd import threads
from tierd.costs import SYNC_S as COSTS_SYNC_S
from tierd.errors import LeaseError, NamespaceLimitError, TierdError

log = logging.getLogger("tierd.connectors")

STORE_ERRORS = (TierdError, OSError, ConnectionError)
DEFAULT_TIMEOUT_S = 10.0  # per request to a daemon, for connectors (the Client's own default is 60 s);
# long enough for a large prefix promoted from disk in one acquire, short enough to bound a stall
STAT_KEYS = ("lookups", "hit_blocks", "loaded_tokens", "load_failures", "stored_blocks", "store_failures",
             "stores_dropped", "unavailable", "refused", "load_s", "loaded_bytes")
# failures of one request, not of the link: a miss for that request, no back-off
REQUEST_ERRORS = (NamespaceLimitError,)
DEFAULT_URL = "unix:///run/tierd/tierd.sock"   # the daemon's default socket (or $TIERD_URL)
_EMBEDDED: dict[str, object] = {}


def open_store(url: str):
    """Store for `url`: an embedded store is shared by every connector of this process, so a
    scheduler's lookups see a worker's stores when both run in one process."""
    if not url.startswith("embedded:"):
        return url   # opened lazily by StoreLink (and reopened after failures)
    if url not in _EMBEDDED:
        _EMBEDDED[url] = tierd.connect(url)
    return _EMBEDDED[url]


@contextlib.contextmanager
def holding(store, held):
    """While copying through the slots of `held` (a lease or reservation `store` handed out):
    keep the daemon connection that obtained them open (`Client.hold`), and raise LeaseError if
    it is already gone — then the daemon may have given the slots to someone else. An embedded
    store's slots cannot be lost."""
    if not hasattr(store, "hold"):
        yield
        return
    with store.hold():
        if not store.connected or held._generation != store.generation():
            raise LeaseError("the connection that holds these slots is gone")
        yield



def _socket_identity(path: str):
    """(device, inode) of the socket file at `path`, or None where there is none."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino

class PendingBytes:
    """A block's bytes still being copied out of a device: `result()` waits for the copy's event
    (on the store thread, never the engine's) and returns them."""

    __slots__ = ("array", "event", "streams")

    def __init__(self, array, event, streams):
        self.array, self.event, self.streams = array, event, streams

    def result(self):
        if self.event is not None:
            self.streams.synchronize(self.event)
            self.event = None
        return self.array


def drain_quietly(xfer) -> None:
    """After a failed load: wait until whatever it queued on `xfer`'s streams has run, so nothing
    lands later in blocks that are recomputed; a device error here is only logged."""
    try:
        xfer.drain()
    except Exception:  # noqa: BLE001
        log.exception("tierd: waiting for the transfer streams failed")


def acquire_for(store, ns, keys: Sequence[bytes], device):
    """`store.acquire(ns, keys)` for a reader on `device` that confirms the lease after its copy
    (`release(lease, confirm=True)`; a lost lease means recompute): an embedded store whose HBM
    tier is on that device is asked for its HBM copies too (`lease.gpu_buffers`), which the
    reader copies device-to-device; a daemon's client asks for them itself when it maps the
    daemon's tier, and pipelines the lease's request (`Client.acquire`: its answer is read at
    the release, not before the copy)."""
    tier = getattr(store, "gpu", None)
    buffer = getattr(tier, "buffer", None)
    if isinstance(buffer, torch.Tensor) and buffer.device == torch.device(device):
        return store.acquire(ns, keys, gpu=True)
    return store.acquire(ns, keys, pipelined=True)


def load_unleased(store, ns, keys: Sequence[bytes], copy) -> int | None:
    """A load copied straight out of the daemon's host slots, with no round trip
    (`Client.read_unleased`): `copy(views)` copies the blocks into the engine's at once. How many
    blocks were loaded, or None where the load must lease instead: an embedded store, a client
    without the daemon's shared index, an index that cannot tell, or a block that changed during
    the copy — the lease path then copies again over what `copy` wrote, before anything reads
    it. Only for copies that are done when `copy` returns (CPU caches)."""
    read = getattr(store, "read_unleased", None)
    if read is None:
        return None
    try:
        return read(ns, keys, copy)
    except STORE_ERRORS:
        return None


class StoreLink:
    """A Store (object or URL) with back-off, counters and a bounded background store queue."""

    def __init__(self, store, *, max_pending_blocks: int = 64, retry_after_s: float = 1.0,
                 max_batch: int = 16, name: str = "tierd-kv-store", timeout_s: float = DEFAULT_TIMEOUT_S,
                 background_connect: bool = False, retries: int | None = None, use_index: bool = False,
                 prefault: bool = False, read_index: bool = False):
        if isinstance(store, str) and store.startswith("unix:"):
            params = [] if use_index or "index=" in store else ["index_lookups=0"] if read_index else ["index=0"]
            if prefault and "prefault=" not in store:
                # a link that copies through slots maps the arena's pages ahead of its first copy
                params.append("prefault=1")
            if "timeout_s=" not in store:
                # a stalled daemon may cost a request at most this much before it recomputes
                params.append(f"timeout_s={timeout_s:g}")
            if background_connect and "connect_timeout_s=" not in store:
                params.append(f"connect_timeout_s={max(timeout_s, 0.5):g}")
            if retries is not None and "retries=" not in store:
                params.append(f"retries={retries}")
            if params:
                store += ("&" if "?" in store else "?") + "&".join(params)
        # Connectors ask the daemon for lookups (use_index=False): a lookup to a stalled daemon
        # then ends at the request timeout as a miss, where an answer from the daemon's shared
        # index could promise blocks for up to 100 ms after the stall, and the load would wait.
        # A link that loads (read_index) still maps the index for reads without a lease
        # (`load_unleased`): those are checked after the copy, stall or not.
        # With background_connect, get() never connects (or reconnects) in the caller's thread:
        # it starts a connection attempt in the background and answers None until it is up, so
        # a caller with a deadline never waits on connect + hello to a stalled daemon.
        self._background = background_connect
        self._connecting = False
        self._connected_event = threading.Event()
        self._timeout_s = timeout_s
        self._url = store if isinstance(store, str) else None
        self.store = None if isinstance(store, str) else store
        self._owns_store = isinstance(store, str)
        self.stats: dict = dict.fromkeys(STAT_KEYS, 0)
        self._retry_after_s = retry_after_s
        self._backoff = retry_after_s
        self._down_until = 0.0
        # the daemon's socket (unix:// URLs): its identity when the link went down
        if self._url is not None:
            self._socket_path = urlparse(self._url).path if self._url.startswith("unix:") else None
        else:
            self._socket_path = getattr(self.store, "path", None) if hasattr(self.store, "reconnect") else None
        self._socket_seen = None
        self._next_look = 0.0
        self._lock = threading.Lock()
        self._connect_lock = threading.Lock()
        self._queue: queue.Queue = queue.Queue(maxsize=max_pending_blocks)
        self._max_batch = max_batch
        self._pending = 0  # blocks queued or being stored
        self._stop = False
        self._name = name
        self._worker: threading.Thread | None = None
        self._probing = False
        self._prober: threading.Thread | None = None
        self._prober_store = None
        self._side_lock = threading.Lock()
        self._exchanger: threading.Thread | None = None   # exchanges the cost model when due
        self._costs_due = threading.Event()
        self._warm_namespaces: list = []   # a background link's: registered on each connection
        self._warming: threading.Event | None = None   # set when the warm-up's connection attempt ends

    # -- availability ------------------------------------------------------------------------
    SOCKET_LOOK_S = 0.25   # while backing off, how often the daemon's socket is looked at

    @property
    def backing_off(self) -> bool:
        now = time.monotonic()
        if now >= self._down_until:
            return False
        # a daemon that came back (a rolled pod Ready, a restart) binds its socket anew: then
        # connect at once instead of waiting out the backoff (up to 30 s of misses otherwise)
        if now >= self._next_look and self._socket_path is not None:
            self._next_look = now + self.SOCKET_LOOK_S
            if _socket_identity(self._socket_path) not in (None, self._socket_seen):
                with self._lock:
                    self._down_until = 0.0
                    self._backoff = self._retry_after_s
                return False
        return True

    def get(self):
        """The store, or None while backing off after a failure (the caller recomputes)."""
        if self.backing_off:
            return None
        if self._background:
            if self.store is None or not getattr(self.store, "connected", True):
                # the caller that starts an attempt waits for it at most one request timeout (its
                # deadline); callers arriving while it runs do not wait at all
                done, started = self._connect_in_background()
                # (and a caller arriving while the warm-up's attempt runs waits as its first caller
                # would have: that attempt stands for the one a first request would start)
                if not (started or done is self._warming) or not done.wait(self._timeout_s):
                    return None
                if self.store is None or not getattr(self.store, "connected", True):
                    return None
            return self.store
        if self.store is None:
            with self._connect_lock:          # (a caller and `warm` may race for the first one)
                if self.store is None and not self.backing_off:
                    try:
                        self.store = tierd.connect(self._url)
                    except STORE_ERRORS as e:
                        self.failed(e, "connect")
        return self.store if not self.backing_off else None

    def warm(self, then=None, namespaces: Sequence = (), *, wait: bool = False) -> None:
        """Connect now, in a thread of its own, so that the first request finds the daemon's
        arena mapped and its pages faulted in (with `prefault`) instead of paying for it, the
        daemon knowing `namespaces` (a first request in a namespace registers it: a round trip)
        and the cost model exchanged; then, in that thread, `then(store)` where a store was
        reached (page-locking its arena).

        A link that connects in the background (`background_connect`) starts its connection
        now (with `wait`, waiting for it at most one request timeout, as a first `get` would)
        and registers `namespaces` once it is up, in the connecting thread after the connection's
        waiters are let go; so on every connection it makes: a restarted daemon knows them again
        before the next request asks. `then` is not run."""
        if self._background:
            self._warm_namespaces = list(namespaces)
            if self.store is None or not getattr(self.store, "connected", True):
                if not self.backing_off:
                    done, started = self._connect_in_background()
                    if started:
                        self._warming = done
                    if wait:
                        done.wait(self._timeout_s)
            elif self._warm_namespaces and hasattr(self.store, "hold"):   # a daemon's client, connected
                threads.start(self._register_warm, self._warm_namespaces, name=f"{self._name}-warm")
            return

        def work():
            store = self.get()
            if store is None:
                return
            self._register_warm(namespaces)
            try:
                if hasattr(store, "hold"):            # a daemon's client
                    store.cost_model(via=self._probe_store())   # (its side connection, made now)
                    self._start_exchanges()
                if then is not None:
                    then(store)
            except STORE_ERRORS as e:
                self.failed(e, "warm-up")
        if self.store is None or then is not None or (namespaces and hasattr(self.store, "hold")):
            threads.start(work, name=f"{self._name}-warm")

    def _connect_in_background(self) -> tuple[threading.Event, bool]:
        """Start a connection attempt unless one runs: (an event set when it ends, whether this
        call started it)."""
        with self._lock:
            if self._connecting or self._stop:
                return self._connected_event, False
            self._connecting = True
            done = self._connected_event = threading.Event()

        def attempt():
            try:
                if self.store is None:
                    self.store = tierd.connect(self._url)
                else:
                    self.store.reconnect()
                self.ok()
            except STORE_ERRORS as e:
                self.failed(e, "connect")
            finally:
                self._connecting = False
                done.set()
            # after `done`: a caller waiting for the connection does not wait for this too (its
            # own first call in a namespace waits for the daemon to know it, as it would anyway)
            if self._warm_namespaces:
                self._register_warm(self._warm_namespaces)

        threads.start(attempt, name=f"{self._name}-connect")
        return done, True

    def _register_warm(self, namespaces: Sequence) -> None:
        """A warm-up's part with a daemon: `namespaces` registered and the client's reporter of
        reads without a lease started (`Client.warm_up`); nothing for an embedded store."""
        store = self.store
        if store is None or not hasattr(store, "hold") or not getattr(store, "connected", True):
            return
        try:
            store.warm_up(namespaces)
        except REQUEST_ERRORS as e:     # a namespace refused: counted and told, as a request's would be
            self.failed(e, "warm-up")
        except STORE_ERRORS as e:
            # best effort, no back-off: a link with a short deadline (lookups) may time out here
            # while its engine starts; its first request then registers, as without a warm-up
            log.debug("tierd %s: warm-up did not finish (%s)", self._name, e)

    def failed(self, e: Exception, what: str) -> None:
        """A store call failed: back off — unless the failure concerns only that request (a
        namespace the daemon refused): then that request is a miss, and the link stays up for
        every other namespace."""
        if isinstance(e, REQUEST_ERRORS):
            with self._lock:
                self.stats["refused"] += 1
            if self.stats["refused"] & (self.stats["refused"] - 1) == 0:   # 1st, 2nd, 4th, ...: not every time
                log.warning("tierd refused a request during %s (%s); that request is a miss", what, e)
            return
        with self._lock:
            self.stats["unavailable"] += 1
            self._down_until = time.monotonic() + self._backoff
            self._next_look = time.monotonic() + self.SOCKET_LOOK_S
            self._socket_seen = _socket_identity(self._socket_path) if self._socket_path else None
            wait, self._backoff = self._backoff, min(self._backoff * 2, 30.0)
        log.warning("tierd store unavailable during %s (%s); recomputing, retry in %.1fs", what, e, wait)

    def ok(self) -> None:
        self._backoff = self._retry_after_s

    # -- background stores -------------------------------------------------------------------
    def submit(self, ns, key: bytes, parent: bytes | None, block, tokens: Sequence[int] | None = None) -> bool:
        """Queue one block (bytes already copied out of the engine's cache), with its tokens
        where known (for the daemon's KV events). False if dropped."""
        if self._worker is None:
            with self._lock:
                if self._worker is None:
                    self._worker = threads.start(self._loop, name=self._name)
        with self._lock:
            try:
                self._queue.put_nowait((ns, key, parent, block, tokens))
            except queue.Full:
                self.stats["stores_dropped"] += 1
                return False
            self._pending += 1
        return True

    def _loop(self) -> None:
        while not self._stop:
            try:
                item = self._queue.get(timeout=0.1)
            except queue.Empty:
                continue
            batch = [item]
            while len(batch) < self._max_batch:
                try:
                    batch.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            try:
                self._put_batch(batch)
            except Exception:  # never let the store thread die; the blocks are lost, counted
                log.exception("tierd store thread: unexpected error")
                self.stats["store_failures"] += len(batch)
            finally:
                with self._lock:
                    self._pending -= len(batch)

    def _put_batch(self, batch) -> None:
        store = self.get()
        if store is None:
            self.stats["stores_dropped"] += len(batch)
            return
        # consecutive blocks of one chain (same namespace, each the parent of the next) go in one put
        runs, run = [], [batch[0]]
        for it in batch[1:]:
            if it[0] == run[-1][0] and it[2] == run[-1][1]:
                run.append(it)
            else:
                runs.append(run)
                run = [it]
        runs.append(run)
        for i, run in enumerate(runs):
            tokens = None
            if all(it[4] is not None for it in run):
                tokens = [int(t) for it in run for t in it[4]]
            try:
                blocks = [it[3].result() if isinstance(it[3], PendingBytes) else it[3] for it in run]
                store.put(run[0][0], [it[1] for it in run], blocks, parent=run[0][2], token_ids=tokens)
                self.stats["stored_blocks"] += len(run)
                self.ok()
            except REQUEST_ERRORS as e:
                self.stats["store_failures"] += len(run)   # this run only: the others go on
                self.failed(e, "store")
            except STORE_ERRORS as e:
                self.stats["store_failures"] += sum(len(r) for r in runs[i:])
                self.failed(e, "store")
                return

    # -- re-measuring a declined tier --------------------------------------------------------------
    def probe(self, ns, keys: Sequence[bytes], tier: str, model) -> bool:
        """Time one load of `keys` (blocks the cost model declined on `tier`) on a thread of
        its own, off the request's path, so that a tier that healed is seen to have healed (a
        tier never loaded from is never measured again otherwise). One at a time; False if one
        runs. The load promotes the blocks into host RAM, as any load does."""
        with self._lock:
            if self._probing or self._stop:
                return False
            self._probing = True

        def run():
            try:
                store = self._probe_store()
                if store is None:
                    return
                t0 = time.perf_counter()
                lease = store.acquire(ns, list(keys))
                try:
                    if len(lease):
                        for buf in lease.buffers:
                            np.array(buf, copy=True)     # (the copy a load makes)
                        model.observe_transfer(tier, "load", sum(len(b) for b in lease.buffers),
                                               time.perf_counter() - t0)
                        self.stats["probes"] = self.stats.get("probes", 0) + 1
                finally:
                    lease.__exit__(None, None, None)
            except Exception as e:  # noqa: BLE001 -- a measurement off the path: never an engine's error
                log.debug("tierd: probing the %s tier failed (%s)", tier, e)
            finally:
                self._probing = False
        self._prober = threads.start(run, name=f"{self._name}-probe")
        return True

    PROBE_TIMEOUT_S = 30.0   # a probe may wait this long for a slow tier (off every request's path)

    def _probe_store(self):
        """The store probes load through: a daemon link's own connection of its own (with a
        long timeout), so that a probe of a slow tier never times out the connection requests
        use (a lookup link's deadline is tens of milliseconds); an embedded store itself."""
        if self._url is None:
            return self.store
        with self._side_lock:           # (the prober and the cost model's exchange share it)
            if self._prober_store is None:
                base = self._url.split("?", 1)[0]
                self._prober_store = tierd.connect(f"{base}?timeout_s={self.PROBE_TIMEOUT_S:g}&index=0&retries=0")
            return self._prober_store

    def cost_model(self, *, exchange: bool = True):
        """The store's cost model (tierd/costs.py) without a request on the caller's thread: a
        daemon client's replica is exchanged with the daemon's on a thread of its own when due
        (not with `exchange=False`: a load that calls this again once it is done, so that the
        thread's start and its Python work never run beside the load's). None without a store."""
        store = self.store
        if store is None or not hasattr(store, "cost_model"):
            return None
        model = store.cost_model(sync=False)
        if exchange and hasattr(store, "hold") and time.monotonic() - model.synced_at >= COSTS_SYNC_S:
            self._start_exchanges()
            self._costs_due.set()
        return model

    def _start_exchanges(self) -> None:
        """The thread that exchanges the cost model (one per link, asleep until one is due):
        a kick is an Event's set, where a thread started per exchange cost a load or a forward
        next to it up to milliseconds of the GIL."""
        with self._lock:
            if self._stop or (self._exchanger is not None and self._exchanger.is_alive()):
                return
            self._exchanger = threads.start(self._exchange_costs, name=f"{self._name}-costs")

    def _exchange_costs(self) -> None:
        while True:
            self._costs_due.wait()
            self._costs_due.clear()
            store = self.store
            if self._stop:
                return
            if store is None:
                continue
            try:
                # through the link's side connection: the exchange's round trip never holds the
                # connection a load uses (it measured 0.3-1 ms of a 512-token host hit's load
                # part through a daemon when it did)
                store.cost_model(via=self._probe_store())
            except Exception as e:  # noqa: BLE001 -- a measurement exchange: never an engine's error
                log.debug("tierd: exchanging the cost model failed (%s)", e)

    def flush(self, timeout_s: float = 30.0) -> bool:
        """Wait until every queued block has been handed to the store. True if none is left."""
        deadline = time.monotonic() + timeout_s
        while self._pending and time.monotonic() < deadline:
            time.sleep(0.005)
        return not self._pending

    def close(self) -> None:
        self.flush(5.0)
        self._stop = True
        self._costs_due.set()              # (the exchanger sees the stop and ends)
        if self._exchanger is not None:
            self._exchanger.join(5)        # (it uses the side connection: done before it closes)
        if self._worker is not None:
            self._worker.join(5)
        if self._prober is not None:
            self._prober.join(5)       # (it reads through the store: done before the store closes)
        if self._prober_store is not None:
            try:
                self._prober_store.close()
            except STORE_ERRORS:
                pass
        store = self.store
        if store is not None and hasattr(store, "hold") and hasattr(store, "cost_model") and store.connected:
            try:    # what this engine measured since the last exchange reaches the daemon's model
                store.cost_model(now=True)
            except Exception as e:  # noqa: BLE001 -- a close never fails over measurements
                log.debug("tierd: the last cost measurements were not sent (%s)", e)
        if self._owns_store and self.store is not None:
            try:
                self.store.close()
            except STORE_ERRORS:
                pass
            self.store = None
