"""Staged slots, the client's side: free slots of the daemon's arena a connection holds per
namespace ahead of its writes, so that a write copies at once and names its keys in one `put`
whose reply is read later (the daemon's side: `stage` and `put` in tierd/server_ops.py). Part of
`Client` (tierd/client.py), whose constructor declares the state used here (`stage_bytes`,
`_stage_pool`, `_stage_short`, `_stage_ok`, `_putting`, `_deferred_commits`); the connection
(tierd/connection.py) empties the pool when it goes. A staged slot is written only while its
connection is this client's live one.
"""

from __future__ import annotations

import logging
import time

from . import errors as E
from . import protocol as P
from .client_handles import ClientReservation, _with_checksums
from .namespace import Namespace

log = logging.getLogger("tierd.client")

# Staged slots held per namespace, in writes of the size being written (where `stage_bytes`
# allows; at least two): a write must not wait for the replies of the ones before it, which
# bring its slots back. A writer of 8 x 1 MiB blocks per put took about 540 us a put two deep,
# 445 us four deep (design-notes).
STAGE_DEPTH = 4
STAGE_RETRY_S = 0.5   # after a `stage` that fell short: writes reserve until then


class Staging:
    """Part of `Client`: its state is the client's."""

    # A write needs slots in the daemon's arena before its bytes can be copied. Asking for them
    # per write (reserve) costs a round trip to the daemon on the writer's critical path. So a
    # client holds a few free slots per namespace ahead of time ("staged": the daemon's `stage`
    # op): a write copies into them at once and names its keys in one `put` request whose reply
    # is read later; that reply hands out as many new slots as the put used. Only this
    # connection may name its staged slots, and they go back to the daemon's free pool when it
    # closes. Keys the daemon's shared index already shows are not written; a key written that
    # the daemon has meanwhile is dropped there (its slot freed). The pool is at most
    # `stage_bytes` per namespace; larger writes, a daemon without the op, or a full arena take
    # the reserve path.

    def _stage_take(self, nsobj: Namespace, want: int) -> list[int] | None:
        """(Lock held.) `want` staged slots for `nsobj`, or None (then reserve instead)."""
        if not self._stage_ok or self._sock is None or want * nsobj.block_bytes * 2 > self.stage_bytes:
            return None
        pool = self._stage_pool.setdefault(nsobj.name, [])
        if len(pool) < want and self._deferred:
            try:   # replies of earlier puts bring new slots
                self._drain_deferred(time.monotonic() + self.timeout_s, lambda: len(pool) >= want)
            except (OSError, EOFError):
                self._disconnect()
                return None
        if len(pool) < want:
            if time.monotonic() < self._stage_short.get(nsobj.name, 0.0):
                return None   # the daemon had no more for us a moment ago: reserve, one request
            try:
                depth = max(2 * want, min(STAGE_DEPTH * want, self.stage_bytes // nsobj.block_bytes))
                # no more than one request may name (fewer than `want` then: reserve instead)
                limit = self.limits.get("max_keys_per_request", P.DEFAULT_MAX_KEYS)
                r = self._call("stage", ns=nsobj.name, n=min(depth - len(pool), limit))
            except P.RemoteError as e:
                if e.code != "unknown_op":
                    raise
                self._stage_ok = False   # an older daemon: reserve from now on
                return None
            pool = self._stage_pool.setdefault(nsobj.name, [])   # (a reconnect made a new pool)
            pool.extend(r["slots"])
            if len(pool) < want:
                # no room, or past this client's share of the daemon's staged slots: reserve
                # (it says which blocks are dropped), and ask again only after a while
                self._stage_short[nsobj.name] = time.monotonic() + STAGE_RETRY_S
                return None
        return [pool.pop() for _ in range(want)]

    def _give_back(self, name: str, offsets: list[int], link, generation: int) -> None:
        """(Lock held.) Staged slots taken but not written: back into the pool, if it is
        still the same connection's."""
        if link is not None and link is self._link and not link.dead and generation == self._generation:
            self._stage_pool.setdefault(name, []).extend(offsets)

    def _reserve_staged(self, nsobj: Namespace, keys: list[bytes]) -> ClientReservation | None:
        """A reservation in staged slots (no request), or None."""
        with self._lock:
            if not self._stage_ok or self._sock is None:
                return None
            if self._hup.poll(0):
                # the daemon closed this connection (it stopped, or refused a frame): the slots
                # in the pool were the connection's and are another client's now; never write
                # through them (the reserve path reconnects)
                self._disconnect()
                return None
            idx = self._index
            present = idx.key_states(nsobj.id, keys) if idx is not None and idx.fresh() else None
            putting = self._putting
            todo = [i for i, k in enumerate(keys)
                    if (present is None or not present[i]) and nsobj.id + k not in putting]
            if not todo:
                return None   # all present: reserve re-links the chain for eviction order
            offsets = self._stage_take(nsobj, len(todo))
            if offsets is None:
                return None
            staged = [-1] * len(keys)
            status = ["present"] * len(keys)
            buffers: list = [None] * len(keys)
            for i, off in zip(todo, offsets):
                staged[i], status[i] = off, "reserved"
                buffers[i] = self._view(off, nsobj.block_bytes, True)
            return ClientReservation(-1, nsobj, keys, status, buffers, self._generation, self._pin(), staged)

    def _send_put(self, res: ClientReservation) -> None:
        """(Lock held, its connection checked.) The deferred `put` of a staged reservation."""
        name = res.namespace.name
        msg = {"op": "put", "ns": name, "keys": res.keys, "slots": res._staged, "refill": res.num_reserved}
        if res._parent is not None:
            msg["parent"] = res._parent
        if res._tokens is not None:
            msg["tokens"] = res._tokens
        _with_checksums(msg, res)
        # this client's own puts count as present until their replies are read
        written = [res.namespace.id + k for k, off in zip(res.keys, res._staged) if off >= 0]
        putting = self._putting
        for k in written:
            putting[k] = putting.get(k, 0) + 1

        def landed() -> None:   # the put's keys are no longer in flight
            for k in written:
                left = putting.get(k, 0) - 1
                if left > 0:
                    putting[k] = left
                else:
                    putting.pop(k, None)

        def done(r: dict) -> None:
            landed()
            if "error" in r:
                log.warning("deferred put failed: %s", r["error"].get("message"))
            if "slots" in r:
                self._stage_pool.setdefault(name, []).extend(r["slots"])

        try:
            sent = self._send_deferred(msg, done)
        except E.RequestTooLargeError:
            # nothing was sent: the keys are not in flight, and the slots are still this
            # connection's (back into its pool)
            landed()
            self._stage_pool.setdefault(name, []).extend(o for o in res._staged if o >= 0)
            raise
        if not sent:
            raise E.LeaseError(f"lost the tierd daemon at {self.path} before this put was sent; nothing was stored")
        self._deferred_commits += 1
