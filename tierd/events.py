"""KV events: which blocks each tier of this node holds, for cache-aware routers.

The daemon publishes, on a ZeroMQ PUB socket (`events_addr`), one batch of events at a time in
vLLM's KV-events wire format, so that consumers of vLLM's events (llm-d's KV-cache indexer, a
router) read tierd's with the same decoder:

    frames: topic (the namespace name), sequence number (u64 big-endian), payload
    payload: msgpack array [ts, [event, ...]]  (vLLM's `KVEventBatch`, array-like)
    events:  maps tagged by "type":
             {"type": "BlockStored", "block_hashes": [key], "parent_block_hash": key | None,
              "token_ids": [...], "block_size": block_tokens, "lora_id": None,
              "medium": tier, "lora_name": None, "locality": "LOCAL" | "REMOTE"}
             {"type": "BlockRemoved", "block_hashes": [key], "medium": tier, "locality": ...}
             {"type": "AllBlocksCleared"}

`token_ids` are the block's tokens where the client sent them (the vLLM connector does, so
an indexer can compute its own keys); empty otherwise (and for blocks moving between tiers).
`medium` and `locality` name the tier as vLLM 0.32 does: GPU (HBM), CPU (host RAM), STORAGE with
locality LOCAL (this node's disk) or REMOTE (the shared remote tier). Block hashes are
tierd's 16-byte keys. A namespace is one topic: subscribe to a namespace's name for one model
layout, or to "" for all.

A subscriber never starts from a partial picture: the socket is an XPUB, and every
subscription (a new consumer, or one reconnecting to a restarted daemon) makes the daemon
publish a snapshot — AllBlocksCleared for every namespace, then BlockStored for every block of
every tier — in order with the live events. Consumers already subscribed see the same state
again, which changes nothing for them.

Events are recorded under the store lock (a list append) and sent by this module's thread: no
socket call ever runs under the lock. When the consumer is slow the queue is bounded: the
oldest batches are dropped and counted (`events_dropped`).
"""

from __future__ import annotations

import collections
import logging
import threading
import time

import msgpack

log = logging.getLogger("tierd.events")

# tier -> (medium, locality) as vLLM 0.32 names them (vllm.distributed.kv_events: MEDIUM_GPU,
# MEDIUM_CPU, MEDIUM_STORAGE; locality LOCAL or REMOTE relative to the publisher)
MEDIUM = {"gpu": ("GPU", "LOCAL"), "host": ("CPU", "LOCAL"), "disk": ("STORAGE", "LOCAL"),
          "remote": ("STORAGE", "REMOTE")}


def block_stored(keys: list[bytes], parent: bytes | None, block_tokens: int, tier: str,
                 token_ids: list[int] | None = None) -> dict:
    medium, locality = MEDIUM[tier]
    return {"type": "BlockStored", "block_hashes": keys, "parent_block_hash": parent,
            "token_ids": token_ids or [], "block_size": block_tokens, "lora_id": None,
            "medium": medium, "lora_name": None, "locality": locality}


def block_removed(keys: list[bytes], tier: str) -> dict:
    medium, locality = MEDIUM[tier]
    return {"type": "BlockRemoved", "block_hashes": keys, "medium": medium, "locality": locality}


def all_cleared() -> dict:
    return {"type": "AllBlocksCleared"}


def check_bind_address(addr: str, allow_remote: bool) -> None:
    """Refuse an address other hosts could reach unless the operator allowed it: events name
    every block a node holds (and, when enabled, prompt tokens). Only ipc:// paths, inproc://
    and TCP on loopback stay on this host; every other transport (a TCP address of an
    interface, epgm://, pgm://, norm://, udp://, ws://, ...) needs events_allow_remote."""
    from .errors import ConfigError
    if allow_remote or addr.startswith(("ipc://", "inproc://")):
        return
    if addr.startswith("tcp://"):
        host = addr[len("tcp://"):].rsplit(":", 1)[0].strip("[]")
        if host in ("localhost", "::1") or host.startswith("127."):
            return
    raise ConfigError(f"events_addr {addr!r} is reachable from other hosts; bind it to loopback "
                      "(tcp://127.0.0.1:PORT) or an ipc:// path, or set events_allow_remote = true")


def encode_batch(ts: float, events: list[dict]) -> bytes:
    """One `KVEventBatch` payload: [ts, events] (data_parallel_rank omitted: a default)."""
    return msgpack.packb([ts, events], use_bin_type=True)


class EventRecorder:
    """Events recorded per topic (namespace) in order, taken out as batches. `record` is what
    the store calls, under its lock: memory only. `snapshot`, when set, records the whole state
    (the store sets it to its `snapshot_events`)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._pending: dict[str, list[dict]] = {}
        self.snapshot = None

    def record(self, topic: str, event: dict) -> None:
        with self._lock:
            self._pending.setdefault(topic, []).append(event)

    def take(self) -> dict[str, list[dict]]:
        """Everything recorded since the last call, per topic."""
        with self._lock:
            pending, self._pending = self._pending, {}
        return pending


class EventPublisher(EventRecorder):
    """Batches events per namespace and publishes them from its own thread."""

    SNAPSHOT_INTERVAL_S = 1.0   # at most one snapshot a second, whoever subscribes how often

    def __init__(self, addr: str, *, snapshot=None, max_batches: int = 10_000, interval_s: float = 0.02,
                 allow_remote: bool = False):
        super().__init__()
        check_bind_address(addr, allow_remote)
        import zmq   # only where events are wanted
        self._zmq = zmq
        self._ctx = zmq.Context()
        self._pub = self._ctx.socket(zmq.XPUB)
        self._pub.setsockopt(zmq.XPUB_VERBOSE, 1)     # every subscription, also a repeated one
        self._pub.setsockopt(zmq.LINGER, 0)
        self._pub.setsockopt(zmq.SNDHWM, 100_000)
        self.snapshot = snapshot                       # records the whole state (store.snapshot_events)
        try:
            self._pub.bind(addr)     # e.g. tcp://127.0.0.1:5557, tcp://*:0 (any port), ipc://PATH
        except zmq.ZMQError as e:
            self._pub.close()
            self._ctx.term()
            from .errors import ConfigError
            raise ConfigError(f"events_addr {addr!r}: cannot bind ({e})") from None
        self.addr = self._pub.getsockopt(zmq.LAST_ENDPOINT).decode()
        self._queue: collections.deque = collections.deque()
        self._max = max_batches
        self._interval = interval_s
        self._wake = threading.Event()
        self._stop = False
        self._seq = 0
        self._snapshot_due = False
        self._snapshot_at = 0.0
        self.counters = {"events_published": 0, "batches_published": 0, "events_dropped": 0,
                         "event_snapshots": 0}
        self._thread = threading.Thread(target=self._run, name="tierd-events", daemon=True)
        self._thread.start()

    def _cut(self) -> None:
        """Turn pending events into one batch per topic (in the order they were recorded)."""
        pending = self.take()
        with self._lock:
            ts = time.time()
            for topic, events in pending.items():
                self._queue.append((topic, ts, events))
            while len(self._queue) > self._max:
                _, _, dropped = self._queue.popleft()
                self.counters["events_dropped"] += len(dropped)

    def flush(self, timeout_s: float = 5.0) -> None:
        """Publish everything recorded so far (tests, shutdown)."""
        self._cut()
        self._wake.set()
        deadline = time.monotonic() + timeout_s
        while self._queue and time.monotonic() < deadline:
            time.sleep(0.005)

    def _run(self) -> None:
        zmq = self._zmq
        while not self._stop:
            self._wake.wait(self._interval)
            self._wake.clear()
            subscribed = False
            try:
                while self._pub.poll(0, zmq.POLLIN):
                    msg = self._pub.recv()
                    subscribed |= bool(msg) and msg[0] == 1
            except zmq.ZMQError:
                pass
            self._snapshot_due |= subscribed
            now = time.monotonic()
            if self._snapshot_due and self.snapshot is not None and now >= self._snapshot_at:
                # rate-limited: subscriptions coming faster share one snapshot (a peer that
                # subscribes in a loop cannot make the daemon walk its index in a loop)
                self._snapshot_due = False
                self._snapshot_at = now + self.SNAPSHOT_INTERVAL_S
                try:
                    self.snapshot()      # records in chunks of the store lock; sent below, in order
                    self.counters["event_snapshots"] += 1
                except Exception:  # noqa: BLE001 -- events are a hint; never take the thread down
                    log.exception("events: snapshot failed")
            self._cut()
            while self._queue:
                topic, ts, events = self._queue[0]
                payload = encode_batch(ts, events)
                try:
                    self._pub.send_multipart([topic.encode(), self._seq.to_bytes(8, "big"), payload])
                except self._zmq.ZMQError as e:   # never fatal: events are a hint for routers
                    log.warning("events: cannot publish (%s); dropping %d events", e, len(events))
                    self.counters["events_dropped"] += len(events)
                else:
                    self.counters["events_published"] += len(events)
                    self.counters["batches_published"] += 1
                self._seq += 1
                self._queue.popleft()

    def close(self) -> None:
        self.flush(1.0)
        self._stop = True
        self._wake.set()
        self._thread.join(5)
        self._pub.close()
        self._ctx.term()
