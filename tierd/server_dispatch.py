"""Which thread serves a request, and how its outcome becomes a reply: `Dispatch`, part of
`Daemon` (tierd/server.py). Ops that never wait on I/O run inline on the event loop thread, the
others on the worker pool; a handler's error becomes an error reply (a bug too: the daemon never
crashes on a request); a request answered with a timeout gives back what it took when it ends.
The handlers themselves are in tierd/server_ops.py; a connection's framing in
tierd/server_conn.py."""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

from . import protocol as P
from .errors import TierdError
from .store import Lease, Reservation, WouldBlock

if TYPE_CHECKING:
    from .server_conn import _Conn

log = logging.getLogger("tierd.server")

# ops that never wait on disk I/O (only briefly on the store lock): served on the event loop
# thread, saving a thread hop; the others (acquire may read disk, reserve may wait for room,
# flush and sync write) run on the worker pool.
_INLINE_OPS = {"hello", "register", "lookup", "lookup_all", "where", "commit", "abort", "release", "put", "hits",
               "stats", "ping", "costs"}
# ... but with a remote tier a lookup may ask the server: then it runs on the worker pool
_REMOTE_OPS = {"lookup", "lookup_all"}


class Dispatch:
    """Part of `Daemon`: its state is the daemon's."""

    def _dispatch(self, conn: "_Conn", msg: dict):
        """Serve one decoded request. Returns its reply, or a concurrent future for an op that
        runs on the worker pool (it may wait on disk I/O); never raises."""
        req_id = msg.get("id")
        if not isinstance(req_id, int) or isinstance(req_id, bool):
            self.counters["bad_requests"] += 1
            return P.error_reply(None, "bad_request", "request needs an integer id")
        op = msg.get("op")
        if op not in P.OPS:
            self.counters["bad_requests"] += 1
            return P.error_reply(req_id, "unknown_op", f"unknown op {op!r}; ops: {', '.join(P.OPS)}")
        if not conn.greeted and op not in ("hello", "ping"):
            self.counters["bad_requests"] += 1
            return P.error_reply(req_id, "bad_request", "send hello (protocol version) first")
        conn.ops += 1
        self.counters["requests"] += 1
        handler = getattr(self, f"_op_{op}")
        msg.pop("_inline", None)        # the daemon's own mark, never a client's
        quick = False
        if op in ("acquire", "reserve", "stage"):
            # reserve and acquire (unless it may copy into HBM) refuse inline, changing nothing,
            # whatever would need I/O or a wait (WouldBlock): tried inline at once, without
            # asking the store first
            quick = (op == "reserve" or (op == "acquire" and (msg.get("gpu") is not True or msg.get("noreply") is True))
                     or self._quick(op, msg))
        if (op in _INLINE_OPS and not (op in _REMOTE_OPS and self.store.remote is not None)) or quick:
            t0 = time.perf_counter()
            if quick:
                msg["_inline"] = True   # the store refuses (WouldBlock) what would need I/O after all
            try:
                return self._reply(req_id, op, handler, conn, msg)
            except WouldBlock:
                del msg["_inline"]      # it needs I/O or a wait: run it on the pool
            finally:
                self._observe(op, time.perf_counter() - t0)
        self._inflight += 1
        return self.executor.submit(self._timed_reply, req_id, op, handler, conn, msg)

    def _timed_reply(self, req_id, op, handler, conn, msg) -> dict:
        t0 = time.perf_counter()
        try:
            return self._reply(req_id, op, handler, conn, msg)
        finally:
            self._observe(op, time.perf_counter() - t0)

    def _observe(self, op: str, seconds: float) -> None:
        self.metrics.op_seconds.observe(op, seconds)

    def _reply(self, req_id, op, handler, conn, msg) -> dict:
        try:
            return {"id": req_id, "ok": True, **handler(conn, msg)}
        except WouldBlock:
            raise
        except P.ProtocolError as e:
            self.counters["bad_requests"] += 1
            return P.error_reply(req_id, e.code, str(e))
        except TierdError as e:
            return P.error_reply(req_id, e.code, str(e))
        except Exception as e:  # a bug must not take the daemon down
            log.exception("internal error in %s", op)
            return P.error_reply(req_id, "internal", f"internal error: {type(e).__name__}: {e}")

    def _quick(self, op: str, msg: dict) -> bool:
        try:
            ns = self.store.namespace(msg["ns"])
            if op == "stage":
                n = msg.get("n", 0)
                ok = isinstance(n, int) and 0 <= n <= self.cfg.max_keys_per_request
                return self.store.is_quick("reserve", ns, range(n if ok else 0))
            keys = msg["keys"]
            if not isinstance(keys, list) or len(keys) > self.cfg.max_keys_per_request:
                return False
            return self.store.is_quick(op, ns, [k for k in keys if isinstance(k, bytes)], gpu=msg.get("gpu") is True)
        except Exception:  # malformed: let the handler produce the error reply
            return True

    def _undo_late(self, reply: dict, conn: "_Conn") -> None:
        """A request of `conn` answered with a timeout finished later: give back what it took."""
        if reply.get("_staged"):
            if conn._closed:
                # the connection is gone (its slots were taken back with it): whatever this
                # late stage made — its slots, and the connection's count as a writer — goes
                self.store.unstage(conn.id, None)
            else:
                # Only the slots this request took, which its client never saw: the connection
                # is still open, and the slots already in the client's pool stay its own (it
                # writes through them with no request).
                self.store.unstage(conn.id, reply.get("slots", ()))
        obj = reply.get("_obj")
        conn.held.discard(("lease" if isinstance(obj, Lease) else "res", getattr(obj, "id", 0)))
        try:
            if isinstance(obj, Lease):
                self.store.release(obj)
            elif isinstance(obj, Reservation):
                self.store.abort(obj)
        except TierdError:
            pass  # already reclaimed with the connection
