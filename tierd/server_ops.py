"""The daemon's operations: one handler per protocol op (docs/protocol.md), run on the event
loop thread or a worker thread by `Daemon._dispatch` (tierd/server_dispatch.py). A handler
checks its fields, names only the connection's own slots, and returns its reply fields or raises
a `tierd.errors` error."""

from __future__ import annotations

import logging
import os
import time

from . import __version__
from . import protocol as P
from .errors import ForbiddenError, NamespaceLimitError, TierdError
from .namespace import Namespace
from .store import WouldBlock

log = logging.getLogger("tierd.server")
NAMESPACES_PER_REQUEST = 64   # in one hello or register


class Ops:
    """Part of `Daemon`: its state is the daemon's."""

    def _ns(self, conn, msg: dict) -> Namespace:
        name = P.field(msg, "ns", str, what="a namespace name")
        return self.store.namespace(name)

    def _register(self, conn, descs, labels=None) -> list[str]:
        """Register namespace descriptions; `labels` (optional, one per description): the
        display names clients give them (a model's name: shown in stats and metrics, never part
        of the identity)."""
        if not isinstance(descs, list):
            raise P.ProtocolError("namespaces must be a list of namespace descriptions")
        if not isinstance(labels, list) or len(labels) != len(descs):
            labels = [""] * len(descs)
        names = []
        if len(descs) > NAMESPACES_PER_REQUEST:
            raise P.ProtocolError(f"at most {NAMESPACES_PER_REQUEST} namespaces per request")
        for d in descs:
            if not isinstance(d, dict):
                raise P.ProtocolError("a namespace description must be a map")
        for d, label in zip(descs, labels):
            ns = Namespace.from_dict(d)
            if isinstance(label, str) and label:
                ns = ns.with_label(label)
            mine = self.uid_namespaces.setdefault(conn.uid, set())
            limit = self.cfg.max_namespaces_per_uid
            if ns.name not in mine and len(mine) >= limit:
                mine.difference_update(self.store.forget_unused(list(mine)))
                if len(mine) >= limit:
                    raise NamespaceLimitError(
                        f"uid {conn.uid} has {len(mine)} namespaces with blocks in the daemon (the limit); "
                        f"namespace {ns.name} is refused: flush unused ones (tierd flush --namespace)")
            self.store.register(ns)
            mine.add(ns.name)
            conn.namespaces.add(ns.name)
            names.append(ns.name)
        return names

    def _op_hello(self, conn, msg: dict) -> dict:
        version = P.field(msg, "version", int)
        if version != P.PROTOCOL_VERSION:
            raise P.ProtocolError(f"protocol version {version} is not supported (this daemon speaks "
                                  f"{P.PROTOCOL_VERSION})")
        conn.name = str(msg.get("client", ""))[:64]
        names = self._register(conn, msg.get("namespaces", []), msg.get("labels"))
        conn.greeted = True
        host = self.store.host
        dev, ino = host.arena.identity()
        arenas = [{"tier": "host", "path": self.arena_path, "capacity_bytes": host.capacity_bytes,
                   "dev": dev, "ino": ino}]
        if self.gpu_descriptor is not None:
            arenas.append(self.gpu_descriptor)
        index = {"path": self.index_path, "instance": self.instance} if self.index is not None else None
        return {"version": P.PROTOCOL_VERSION, "server": __version__, "pid": os.getpid(),
                "namespaces": names,
                "arenas": arenas,
                "index": index,
                # clients send the blocks' token ids only where events carry them (opt-in)
                "events": self.events is not None and self.cfg.events_token_ids,
                "noreply": True,   # a release may ask to go unanswered
                "quiet": True,     # ... and an acquire: a quiet lease, released by its request's id
                "hits": True,      # reads without a lease are reported (op hits)
                # its index's header has the host tier's last eviction: a quiet lease pins its
                # blocks (sends its acquire) only while evictions are recent
                "evictions": True,
                # a writer's checksums of what it copied (put, commit) spare the keeper a read
                "checksums": self.store.host.records is not None,
                "limits": {"max_frame_bytes": self.cfg.max_frame_bytes,
                           "max_keys_per_request": self.cfg.max_keys_per_request}}

    def _op_register(self, conn, msg: dict) -> dict:
        return {"namespaces": self._register(conn, P.field(msg, "namespaces", list), msg.get("labels"))}

    def _op_lookup(self, conn, msg: dict) -> dict:
        ns = self._ns(conn, msg)
        return {"n": self.store.lookup(ns, P.keys_field(msg, self.cfg.max_keys_per_request))}

    def _op_lookup_all(self, conn, msg: dict) -> dict:
        queries = P.field(msg, "queries", list)
        budget = self.cfg.max_keys_per_request
        parsed = []
        for q in queries:
            if not isinstance(q, dict):
                raise P.ProtocolError("lookup_all: each query is a map {ns, keys}")
            keys = P.keys_field(q, budget)
            budget -= len(keys)
            parsed.append((self._ns(conn, q), keys))
        if msg.get("host"):
            pairs = self.store.lookup_all(parsed, host=True)
            return {"n": [n for n, _ in pairs], "host": [h for _, h in pairs]}
        return {"n": self.store.lookup_all(parsed)}

    def _op_where(self, conn, msg: dict) -> dict:
        ns = self._ns(conn, msg)
        return {"tiers": self.store.where(ns, P.keys_field(msg, self.cfg.max_keys_per_request))}

    def _write_fields(self, msg: dict, ns: Namespace, keys: list[bytes]):
        """(parent, token ids) of a reserve or put request, checked."""
        parent = P.field(msg, "parent", bytes, default=None)
        if parent is not None and len(parent) != 16:
            raise P.ProtocolError("parent must be a 16-byte key")
        tokens = P.field(msg, "tokens", list, default=None)
        if not self.cfg.events_token_ids:
            tokens = None   # never recorded unless the operator opted in
        if tokens is not None and (len(tokens) != len(keys) * ns.block_tokens
                                   or not all(isinstance(t, int) and not isinstance(t, bool) for t in tokens)):
            raise P.ProtocolError(f"tokens must be {ns.block_tokens} integers per key")
        return parent, tokens

    def _op_reserve(self, conn, msg: dict) -> dict:
        ns = self._ns(conn, msg)
        keys = P.keys_field(msg, self.cfg.max_keys_per_request)
        parent, tokens = self._write_fields(msg, ns, keys)
        res = self.store.reserve(ns, keys, parent=parent, owner=conn.id, token_ids=tokens,
                                 inline=msg.get("_inline", False))
        if res.id:
            conn.held.add(("res", res.id))
        slots = [[P.SLOT_STATUS[s], off] for s, off in zip(res.status, res.offsets)]
        return {"res": res.id, "slots": slots, "_obj": res}

    def _count_field(self, msg: dict, name: str) -> int:
        n = P.field(msg, name, int, default=0)
        if not 0 <= n <= self.cfg.max_keys_per_request:
            raise P.ProtocolError(f"{name} must be between 0 and {self.cfg.max_keys_per_request}")
        return n

    def _op_stage(self, conn, msg: dict) -> dict:
        """Free slots for this connection to write blocks into before it names their keys
        (`put`): fewer than asked where there is no room or past the per-connection limit."""
        ns = self._ns(conn, msg)
        n = self._count_field(msg, "n")
        offsets = self.store.stage(ns, n, owner=conn.id, inline=msg.get("_inline", False),
                                   limit_bytes=self.stage_limit_bytes, pool_bytes=self.stage_pool_bytes)
        return {"slots": offsets, "_staged": True}

    def _op_put(self, conn, msg: dict) -> dict:
        """Blocks written into this connection's staged slots, stored under their keys; the
        reply hands out up to `refill` new staged slots (free ones only: a put never waits).
        A request malformed in its shape changes nothing; once its slots are known, whatever
        fails gives them back to the free pool (an unknown namespace included): the client gave
        them up when it sent the put, and its pool no longer holds them."""
        keys = P.keys_field(msg, self.cfg.max_keys_per_request)
        offsets = P.field(msg, "slots", list, what="a list of arena offsets (-1: not written)")
        if len(offsets) != len(keys) or not all(isinstance(o, int) and not isinstance(o, bool) and o >= -1
                                                for o in offsets):
            raise P.ProtocolError("slots must hold one arena offset (or -1) per key")
        refill = self._count_field(msg, "refill")
        try:
            ns = self._ns(conn, msg)
            parent, tokens = self._write_fields(msg, ns, keys)
            n = self.store.put_staged(ns, keys, offsets, owner=conn.id, parent=parent, token_ids=tokens,
                                      checksums=P.checksums_field(msg, len(keys)))
        except Exception:
            self.store.unstage(conn.id, [o for o in offsets if o >= 0])
            raise
        reply = {"n": n, "slots": []}
        if refill:
            # the put is stored: a refill that fails says so beside it (and stages nothing: `stage`
            # gives back what it took before it raises), never as the put's failure
            try:
                reply["slots"] = self.store.stage(ns, refill, owner=conn.id, inline=True,
                                                  limit_bytes=self.stage_limit_bytes,
                                                  pool_bytes=self.stage_pool_bytes)
            except TierdError as e:
                reply["refill_error"] = {"code": e.code, "message": str(e)}
        return reply

    def _op_commit(self, conn, msg: dict) -> dict:
        rid = P.field(msg, "res", int)
        if rid == 0:
            return {"n": 0}   # a reservation of nothing (every block present or no room)
        res = self.store.find_reservation(rid, conn.id)
        res.checksums = P.checksums_field(msg, len(res.keys))
        n = self.store.commit(res)
        conn.held.discard(("res", rid))
        return {"n": n}

    def _op_abort(self, conn, msg: dict) -> dict:
        rid = P.field(msg, "res", int)
        res = self.store.find_reservation(rid, conn.id, missing_ok=True) if rid else None
        if res is not None:   # aborting twice is harmless; another client's, an error
            self.store.abort(res)
        conn.held.discard(("res", rid))
        return {}

    def _op_acquire(self, conn, msg: dict) -> dict:
        ns = self._ns(conn, msg)
        gpu = P.field(msg, "gpu", bool, default=False)     # the client reads HBM copies
        quiet = msg.get("noreply") is True                  # a quiet lease (`_Conn.quiet`)
        if quiet and gpu:
            raise P.ProtocolError("acquire: a lease sent with noreply reads host RAM only (no gpu)")
        try:
            lease = self.store.acquire(ns, P.keys_field(msg, self.cfg.max_keys_per_request), owner=conn.id,
                                       gpu=gpu, inline=msg.get("_inline", False))
        except WouldBlock:
            if quiet:   # taken at once or not at all: its client is already copying what the
                return {"lease": 0}   # shared index showed, and checks it afterwards
            raise
        if lease.id:
            conn.held.add(("lease", lease.id))
            if quiet:
                conn.quiet[msg["id"]] = lease.id
        reply = {"lease": lease.id, "offsets": lease.offsets, "tiers": lease.tiers, "_obj": lease}
        if any(o >= 0 for o in lease.gpu_offsets):
            reply["gpu_offsets"] = lease.gpu_offsets
        return reply

    def _op_release(self, conn, msg: dict) -> dict:
        if "of" in msg:   # a quiet lease, by its acquire's id (none where nothing was leased)
            self.end_lease(conn, conn.quiet.pop(P.field(msg, "of", int), 0))
            return {}
        self.end_lease(conn, P.field(msg, "lease", int))
        return {}

    def end_lease(self, conn, lid: int) -> None:
        if lid:   # 0: a lease of nothing, never held
            self.store.release(self.store.find_lease(lid, conn.id))
            conn.held.discard(("lease", lid))

    def _op_hits(self, conn, msg: dict) -> dict:
        """Blocks a client read without a lease (from slots the shared index published): counted
        as the hits a lease would have been. {reads: [{ns, keys, asked}]}."""
        reads = P.field(msg, "reads", list)
        budget = self.cfg.max_keys_per_request
        parsed = []
        for r in reads:
            if not isinstance(r, dict):
                raise P.ProtocolError("hits: each read is a map {ns, keys, asked}")
            keys = P.keys_field(r, budget)
            budget -= len(keys)
            asked = P.field(r, "asked", int)
            if not len(keys) <= asked < 1 << 31:
                raise P.ProtocolError("hits: asked must count the keys read and those missed")
            parsed.append((self._ns(conn, r), keys, asked))
        for ns, keys, asked in parsed:
            self.store.note_hits(ns, keys, asked)
        return {}

    def _op_costs(self, conn, msg: dict) -> dict:
        """An engine's measurements and ledger counts for the node's cost model
        (tierd/costs.py), and the model back: {report: {transfers: [[tier, direction, bytes,
        seconds]], forwards: [[engine, tokens, quad, seconds]], ledger: {tier: {key: n}}}}."""
        report = P.field(msg, "report", dict, default={})
        for name in ("transfers", "forwards"):
            rows = report.get(name, [])
            if not isinstance(rows, list) or len(rows) > 4096 or not all(
                    isinstance(r, list) and len(r) == 4 for r in rows):
                raise P.ProtocolError(f"costs: report.{name} must be a list of 4-item lists")
        if not isinstance(report.get("ledger", {}), dict):
            raise P.ProtocolError("costs: report.ledger must be a map")
        self.store.costs.merge_report(report)
        return {"state": self.store.costs.state()}

    def _operator(self, uid: int, groups: frozenset[int]) -> bool:
        return (uid in (os.geteuid(), 0) or uid in self.cfg.operator_uids
                or not groups.isdisjoint(self.cfg.operator_gids))

    def _op_flush(self, conn, msg: dict) -> dict:
        if not self._operator(conn.uid, conn.groups):
            raise ForbiddenError(f"flush is an operator action; uid {conn.uid} is not an operator "
                                 "(operator_uids / operator_gids)")
        tier = P.field(msg, "tier", str, default="all")
        namespace = P.field(msg, "namespace", str, default=None)
        return {"dropped": self.store.flush(tier=tier, namespace=namespace)}

    def _op_sync(self, conn, msg: dict) -> dict:
        limit = P.field(msg, "max_blocks", int, default=None)
        if limit is not None and limit < 1:
            raise P.ProtocolError("max_blocks must be >= 1")
        remote = P.field(msg, "remote", bool, default=False)
        written = self.store.sync(limit)
        pushed = self.store.push_remote(limit) if remote else 0
        return {"written": written, "remaining": self.store.unsynced_blocks(),
                "remote_written": pushed, "remote_pending": self.store.remote_pending()}

    def _op_stats(self, conn, msg: dict) -> dict:
        return {"stats": self.stats()}

    def _op_ping(self, conn, msg: dict) -> dict:
        return {"pong": time.time(), "version": __version__}
