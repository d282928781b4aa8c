"""`tierd.client.Client`: the Store interface over the daemon's Unix socket.

The socket carries only control frames; block bytes move through the daemon's host arena,
which the client maps once: `put` copies into reserved slots, `get` copies out of leased ones.
A lost connection is re-established on the next call (the daemon may have restarted); what the
old connection held — reservations, leases — is gone with it, and calls that cannot be
repeated safely say so. Thread-safe: one request at a time per client.

`Client` is this module (the Store interface) and its parts: the connection (tierd/connection.py:
socket, framing, reconnects, holds, mappings), staged slots for writes without a round trip
(tierd/client_staging.py) and reads without a lease (tierd/client_unleased.py); the reservations
and leases it hands out are tierd/client_handles.py.
"""

from __future__ import annotations

import itertools
import logging
import os
import socket
import threading
import time
from collections.abc import Sequence

import numpy as np

from . import errors as E
from . import protocol as P
from .client_handles import ClientLease, ClientReservation, _with_checksums  # noqa: F401
from .client_staging import STAGE_DEPTH, STAGE_RETRY_S, Staging  # noqa: F401
from .client_unleased import UnleasedReads, _report_hits_when_due  # noqa: F401
from .costs import SYNC_S, CostModel
from .connection import DaemonConnection, DaemonUnavailableError, _Link  # noqa: F401 -- DaemonUnavailableError is part of this API
from .keys import check_keys
from .namespace import Namespace
from .transfer import as_u8, copy_out, fill_reservation

log = logging.getLogger("tierd.client")


class Client(Staging, UnleasedReads, DaemonConnection):
    """A connection to `tierd serve` with the same interface as `TieredStore`."""

    RETRY_OPS = {"lookup", "lookup_all", "where", "acquire", "stage", "stats", "ping", "flush", "sync", "register"}
    NS_PER_REQUEST = 64   # namespaces per hello or register request (the daemon's limit)

    def __init__(self, path: str, *, timeout_s: float = 60.0, name: str | None = None,
                 connect_timeout_s: float = 5.0, retries: int = 1, spin_us: float = 100.0,
                 use_index: bool = True, index_lookups: bool = True, hbm: bool | None = None, prefault: bool = False,
                 stage_bytes: int = 64 << 20, data_plane: bool = True, pin_after_eviction_s: float = 1.0):
        self.path = path
        # False: a control client (ping, stats, sync, flush) that maps nothing of the daemon's
        self.data_plane = data_plane
        self._spin_s = max(0.0, spin_us) / 1e6   # busy-poll for a reply this long (0: never)
        self._spin_skip = 0
        self.timeout_s = timeout_s
        self.retries = retries
        self.connect_timeout_s = connect_timeout_s
        self.name = name or f"{socket.gethostname()}/pid{os.getpid()}"[-64:]   # a pod's name, in a pod
        self._lock = threading.RLock()
        self._ids = itertools.count(1)
        self._sock: socket.socket | None = None
        self._namespaces: dict[str, Namespace] = {}
        self._arena = self._arena_ro = None   # the daemon's host arena as mapped here; read-only
        self._arena_mmap = None
        self.prefault = prefault     # map the arena's pages ahead of use, in the background
        self.prefaulted_bytes = 0    # how far that has come
        self._prefault_lock = threading.Lock()   # a prefault call and unmapping the arena
        self._prefault_stop = threading.Event()  # set when the mapping it works on goes
        self._gpu_arena = None
        self._gpu_map = None         # the daemon's HBM tier as mapped here (tierd.tiers.gpu.IpcMapping)
        self._generation = 0
        self._deferred: list[tuple[dict, object]] = []   # (request, callback for its reply)
        # Staged slots (see `reserve`): free slots of the daemon's arena this connection holds,
        # per namespace, to write blocks into with no request; 0 turns staging off.
        self.stage_bytes = stage_bytes
        self._stage_pool: dict[str, list[int]] = {}
        self._stage_short: dict[str, float] = {}   # namespace -> when to ask for staged slots again
        self._putting: dict[bytes, int] = {}   # namespaced keys of puts sent, reply not read yet
        self._stage_ok = stage_bytes > 0   # False against a daemon without the `stage` op
        self._deferred_commits = 0   # commits among them (a lookup from the index waits for them)
        self._rbuf = bytearray()     # received bytes not yet parsed into a reply
        self._index = None           # the daemon's shared lookup index (tierd.index), when mapped
        self.use_index = use_index
        self.index_lookups = index_lookups   # False: lookups ask the daemon; reads still use the index
        self._hbm = hbm              # reads HBM copies: None = when it maps the daemon's HBM tier
        self._hold_lock = threading.Lock()
        self._noreply = False        # the daemon serves releases without a reply (its hello says)
        self._quiet = False          # ... and acquires: quiet leases, for pipelined ones (its hello says)
        self._evictions = False      # ... and its index dates the host tier's last eviction
        # A pipelined lease pins its blocks (a quiet acquire, then a release: two messages that
        # wake the daemon) only while the host tier evicted within this many seconds; otherwise
        # nothing would take its slots but a flush, and the copy is checked afterwards either
        # way (inf: always pin; 0: never)
        if not pin_after_eviction_s >= 0:
            raise E.TierdError(f"pin_after_eviction_s must be >= 0, not {pin_after_eviction_s}")
        self.pin_after_eviction_s = pin_after_eviction_s
        self._checksums = False      # the daemon records blocks for restarts: puts send checksums
        # Reads without a lease (see `get`): possible where the daemon's hello and shared index
        # allow them; the keys read are reported to the daemon later, in one message.
        self._unleased_ok = False
        self._hits: list[dict] = []  # reads not reported yet: {ns, keys, asked}
        self._hits_keys = 0
        self._hits_since = 0.0
        self._hits_cv = threading.Condition(self._lock)
        self._hits_reporter: threading.Thread | None = None   # reports them when a client idles
        self.unleased_reads = 0      # gets served without a lease (a count, for tests and tools)
        self.unleased_discarded = 0  # copies made without a lease, then discarded (a block changed)
        self.pipelined_leases = 0    # leases handed out before the daemon's answer (`acquire(pipelined=)`)
        self.pipelined_lost = 0      # ... whose answer or the index then said the bytes may be wrong
        self.unpinned_leases = 0     # ... which sent nothing: no eviction lately (`pin_after_eviction_s`)
        self._link: _Link | None = None
        self.limits: dict = {}       # the daemon's, from its hello (until then, the protocol's defaults)
        self.events = False          # the daemon publishes KV events with token ids (its hello says)
        self.reconnects = 0
        self._costs = CostModel(replica=True)    # a replica of the daemon's cost model (see `cost_model`)
        self._costs_ok = True        # False against a daemon without the `costs` op
        with self._lock:
            self._connect()

    # -- connection ------------------------------------------------------------------------------


    def _ns_name(self, ns) -> str:
        if isinstance(ns, Namespace):
            if ns.name not in self._namespaces:
                with self._lock:   # other threads wait until the daemon knows it
                    if ns.name not in self._namespaces:
                        self._namespaces[ns.name] = ns   # a reconnect inside the call registers it too
                        try:
                            self._call("register", namespaces=[ns.to_dict()], labels=[ns.label])
                        except DaemonUnavailableError:
                            raise   # kept: the next connection's hello registers it
                        except BaseException:
                            del self._namespaces[ns.name]   # refused by the daemon
                            raise
            return ns.name
        if isinstance(ns, str) and ns in self._namespaces:
            return ns
        raise E.UnknownNamespaceError(f"namespace {ns!r} is not registered with this client; pass a Namespace")

    def _namespace(self, ns) -> Namespace:
        return self._namespaces[self._ns_name(ns)]

    def _view(self, offset: int, nbytes: int, writable: bool) -> np.ndarray:
        return (self._arena if writable else self._arena_ro)[offset:offset + nbytes]


    def host_array(self) -> np.ndarray:
        """The daemon's host arena as mapped here, one uint8 array (for cudaHostRegister)."""
        return self._arena


    # -- Store interface -----------------------------------------------------------------------
    def register(self, ns: Namespace) -> None:
        self._ns_name(ns)

    def warm_up(self, namespaces=()) -> None:
        """Register `namespaces` and start what a first read would start (the thread that
        reports reads without a lease), so that the first load pays for neither: for a
        connector's warm-up thread, before its engine serves."""
        for ns in namespaces:
            self.register(ns)
        with self._lock:
            if self._unleased_ok:
                self._wake_hits_reporter()

    def lookup(self, ns, keys: Sequence[bytes]) -> int:
        keys = check_keys(keys)
        name = self._ns_name(ns)
        with self._lock:
            if self.index_lookups and self._index_usable():
                r = self._index.leading(self._namespaces[name].id, keys)
                if r is not None:
                    return r[0]
            return self._call("lookup", ns=name, keys=keys)["n"]

    def lookup_all(self, queries, *, host: bool = False):
        """`lookup` for several (namespace, keys) pairs at once, from the shared index or in one
        round trip (see `TieredStore.lookup_all`; with `host`, (present, ready in host RAM)
        pairs)."""
        q = [{"ns": self._ns_name(ns), "keys": check_keys(keys)} for ns, keys in queries]
        with self._lock:
            if self.index_lookups and self._index_usable():
                found = [self._index.leading(self._namespaces[x["ns"]].id, x["keys"]) for x in q]
                if all(f is not None for f in found):
                    return found if host else [n for n, _ in found]
        if host:
            r = self._call("lookup_all", queries=q, host=True)
            return list(zip(r["n"], r["host"]))
        return list(self._call("lookup_all", queries=q)["n"])

    def where(self, ns, keys: Sequence[bytes]) -> list[str]:
        """Per key "host", "disk", "host+disk" or "" (`TieredStore.where`). From the shared
        index where this client reads through it (lookups from it, or reads without a lease:
        a loading connector asks `where` right before its load, which reads through the index
        anyway), else one round trip."""
        keys = check_keys(keys)
        name = self._ns_name(ns)
        with self._lock:
            if (self.index_lookups or self._unleased_ok) and not self._putting and self._index_usable():
                tiers = self._index.where(self._namespaces[name].id, keys)
                if tiers is not None:
                    return tiers
            return self._call("where", ns=name, keys=keys)["tiers"]

    def reserve(self, ns, keys: Sequence[bytes], *, parent: bytes | None = None,
                token_ids: Sequence[int] | None = None) -> ClientReservation:
        """Slots to write `keys` into. `token_ids` (optional, `block_tokens` per key) go to the
        daemon only where it publishes KV events, for indexers that compute their own keys.
        The reservation holds its connection open until `commit` or `abort` (see `acquire`)."""
        keys = check_keys(keys)          # bad input is refused before anything is asked
        nsobj = self._namespace(ns)
        # (staged only where its put will fit in one request: over the daemon's limits, the
        # reserve request below is refused before it is sent)
        fits = len(keys) <= self._put_step(nsobj, token_ids is not None)
        staged = self._reserve_staged(nsobj, keys) if fits else None
        if staged is not None:
            staged._parent = None if parent is None else check_keys([parent])[0]
            staged._tokens = [int(t) for t in token_ids] if token_ids is not None and self.events else None
            return staged
        fields = {"ns": nsobj.name, "keys": keys}
        if parent is not None:
            fields["parent"] = check_keys([parent])[0]
        if token_ids is not None and self.events:
            fields["tokens"] = [int(t) for t in token_ids]
        with self._lock:
            r = self._call("reserve", **fields)
            gen = self._generation
            status = [P.SLOT_STATUS_NAMES[s] for s, _ in r["slots"]]
            buffers = [self._view(off, nsobj.block_bytes, True) if s == P.SLOT_RESERVED else None
                       for s, off in r["slots"]]
            link = self._pin() if r["res"] else None
        return ClientReservation(r["res"], nsobj, keys, status, buffers, gen, link)

    def commit(self, res: ClientReservation) -> int:
        """Make the reserved blocks visible. Raises LeaseError, committing nothing, when the
        reservation's connection was lost (a daemon restart, or a timeout on another thread):
        what was copied into its slots is then discarded. A staged reservation's commit is not
        waited for: this client's next requests see its blocks, and it returns how many blocks
        were written (a key another writer stored meanwhile is dropped by the daemon)."""
        if res.id == 0:
            return 0   # nothing was reserved: the daemon keeps no reservation
        link, res._link = res._link, None
        if res._staged is not None:
            try:
                with self._lock:
                    self._check_held(res, link, "reservation")
                    self._send_put(res)
                    return res.num_reserved
            finally:
                self._unpin(link)
        try:
            with self._lock:
                self._check_held(res, link, "reservation")
                return self._call(**_with_checksums({"op": "commit", "res": res.id}, res))["n"]
        finally:
            self._unpin(link)

    def _check_held(self, held, link: _Link | None, what: str) -> None:
        """(Lock held.) LeaseError unless `held` was made on the current, live connection."""
        if link is not None and link is self._link and not link.dead and not link.intact():
            # the daemon ended this connection (it stopped, restarted, or refused a frame): its
            # slots are not this client's any more; new requests go to a new connection, and this
            # socket closes once no other thread holds it
            self._disconnect()
        if link is None or link is not self._link or link.dead or held._generation != self._generation:
            raise E.LeaseError(f"this {what} ({held.id}) was lost with its connection to the daemon "
                               "(the daemon restarted, or a request on another thread timed out)")

    def abort(self, res: ClientReservation) -> None:
        if res.id == 0:
            return
        link, res._link = res._link, None
        try:
            with self._lock:
                if res._staged is not None:   # nothing was asked: the slots go back to the pool
                    self._give_back(res.namespace.name, [o for o in res._staged if o >= 0], link,
                                    res._generation)
                    res._staged = []
                elif link is not None and link is self._link and not link.dead:
                    self._call("abort", res=res.id)
        finally:
            self._unpin(link)

    def put(self, ns, keys: Sequence[bytes], blocks: Sequence, *, parent: bytes | None = None,
            token_ids: Sequence[int] | None = None) -> int:
        """Store blocks (reserve, copy into the arena, commit); returns how many were newly
        reserved and committed. The copy runs while the reservation holds its connection, so
        no other thread's timeout can hand its slots to someone else mid-copy; a reservation
        lost meanwhile raises LeaseError and commits nothing."""
        keys = check_keys(keys)          # bad input is refused before anything is asked
        nsobj = self._namespace(ns)
        if len(blocks) != len(keys):
            raise E.TierdError(f"put: {len(keys)} keys but {len(blocks)} blocks")
        if token_ids is not None and len(token_ids) != len(keys) * nsobj.block_tokens:
            raise E.TierdError(f"put: {len(token_ids)} token ids for {len(keys)} blocks of {nsobj.block_tokens} tokens")
        step = self._put_step(nsobj, token_ids is not None)
        if len(keys) > step:
            # over what one request may carry (the daemon's limits from its hello): several puts,
            # each chained to the one before
            n, bt = 0, nsobj.block_tokens
            for i in range(0, len(keys), step):
                n += self.put(nsobj, keys[i:i + step], blocks[i:i + step],
                              parent=parent if i == 0 else keys[i - 1],
                              token_ids=None if token_ids is None else token_ids[i * bt:(i + step) * bt])
            return n
        views = [as_u8(b, nsobj.block_bytes, nsobj.kv_dtype) for b in blocks]
        res = self.reserve(nsobj, keys, parent=parent, token_ids=token_ids)
        fill_reservation(self, res, views, hashed=self._checksums)
        if not res.num_reserved:
            return 0
        if res._staged is not None:
            return self.commit(res)
        link, res._link = res._link, None
        try:
            with self._lock:
                self._check_held(res, link, "reservation")
                # The daemon serves a connection's requests in order, so everything this client
                # asks next already sees the blocks; the commit's reply is read with the next
                # reply.
                if not self._send_deferred(_with_checksums({"op": "commit", "res": res.id}, res)):
                    raise DaemonUnavailableError(f"lost the tierd daemon at {self.path} during put")
                self._deferred_commits += 1
                return res.num_reserved
        finally:
            self._unpin(link)

    def _put_step(self, nsobj: Namespace, tokens: bool) -> int:
        """How many blocks one put request may name within the daemon's limits: a key, a slot
        offset and a checksum each (about 40 bytes of msgpack), and their token ids where they
        are sent (up to 5 bytes each), within `max_frame_bytes` less room for the rest."""
        limits = self.limits
        per_key = 48 + (5 * nsobj.block_tokens if tokens and self.events else 0)
        room = limits.get("max_frame_bytes", P.DEFAULT_MAX_FRAME_BYTES) - 1024
        return max(1, min(limits.get("max_keys_per_request", P.DEFAULT_MAX_KEYS), room // per_key))

    def acquire(self, ns, keys: Sequence[bytes], *, pipelined: bool = False) -> ClientLease:
        """Lease the longest present prefix of `keys`; read `lease.buffers`, then `release`.

        Threads: a client may be shared by threads. A lease (and a reservation) holds its
        connection open until released, so a request that times out on another thread — which
        gives the connection up — cannot make the daemon reclaim these slots while they are
        read. Bytes are trustworthy only if the lease still stands after they were read:
        `release(lease, confirm=True)` checks that (`get` does it for you, without a round
        trip).

        `pipelined`: for a reader that confirms (a load that copies the blocks, then releases
        with `confirm=True`). Where the daemon's shared index shows the blocks ready in host RAM,
        the request is sent and not waited for: the lease comes back at once with the slots the
        index shows, the daemon's answer arrives while they are copied, and the release reads
        it — one round trip less on the reader's path. The bytes count only if the daemon leased
        those very slots and the index shows no change to them until its answer; else the
        confirming release raises LeaseError (read again). Until the release, such a lease's
        blocks may not yet be pinned: a reader that does not confirm must not use it."""
        keys = check_keys(keys)          # bad input is refused before anything is asked
        nsobj = self._namespace(ns)
        if pipelined and keys:
            lease = self._acquire_pipelined(nsobj, keys)
            if lease is not None:
                return lease
        with self._lock:
            hbm = self._gpu_arena is not None if self._hbm is None else self._hbm
            r = self._call("acquire", ns=nsobj.name, keys=keys, **({"gpu": True} if hbm else {}))
            views = [self._view(off, nsobj.block_bytes, False) for off in r["offsets"]]
            gen = self._generation
            link = self._pin() if r["lease"] else None
            lease = ClientLease(r["lease"], nsobj, keys[:len(views)], views, r["tiers"], self, gen, link)
            offs = r.get("gpu_offsets")
            if offs and self._gpu_arena is not None:
                lease.gpu_offsets = list(offs)
                lease.gpu_buffers = [self._gpu_arena[o:o + nsobj.block_bytes] if o >= 0 else None for o in offs]
        return lease

    def release(self, lease: ClientLease, *, confirm: bool = False) -> None:
        """End a lease. With `confirm`, raise LeaseError if the lease was lost before now (the
        daemon closed the connection: it restarted, or reclaimed the slots): then the bytes
        read under it may have been overwritten, and the reader must not use them. The check
        costs no round trip: the lease held its connection open, so the slots stayed this
        client's for as long as the daemon's end of it is still open."""
        if not lease._open:
            raise E.LeaseError(f"lease {lease.id} is already released")
        lease._open = False
        if lease._pending is not None:
            self._release_pipelined(lease, confirm)
            return
        if lease.id == 0:
            return   # nothing was leased
        link, lease._link = lease._link, None
        try:
            if confirm and (link is None or not link.intact()):
                with self._lock:
                    if link is not None and link is self._link:
                        self._disconnect()   # (closes once no other thread holds it)
                raise E.LeaseError(f"lease {lease.id} was lost with its connection to the daemon (it "
                                   "restarted or ended the connection): the bytes read under it may not be "
                                   "the block's; read it again")
            with self._lock:
                if link is not None and link is self._link and not link.dead:
                    # Not waited for: a release cannot fail for a lease this client holds, and it
                    # saves a round trip per get. Unanswered where the daemon allows it (no reply
                    # to write and read), else its reply is read before the next one.
                    self._send_deferred({"op": "release", "lease": lease.id}, answered=not self._noreply)
        finally:
            self._unpin(link)

    def _release_pipelined(self, lease: ClientLease, confirm: bool) -> None:
        """`release` of a pipelined lease: its answer read, the lease ended where it was granted,
        LeaseError with `confirm` where the bytes read under it may not be the blocks'."""
        link, lease._link = lease._link, None
        try:
            with self._lock:
                why = self._settle_grant(lease, link)
                if why is None and confirm and (link is None or not link.intact()):
                    why = "its connection to the daemon was lost (it restarted or ended the connection)"
                if link is not None and link is self._link and not link.dead:
                    if lease._pending.unpinned:    # nothing was sent: its hit is reported later
                        if why is None:
                            self._note_hits(lease.namespace, lease.keys, len(lease.keys))
                    elif lease._pending.request:   # a quiet lease: named by its request
                        self._send_deferred({"op": "release", "of": lease._pending.request}, answered=False)
                    elif lease.id:
                        self._send_deferred({"op": "release", "lease": lease.id}, answered=not self._noreply)
            if why is not None:
                self.pipelined_lost += 1
                if confirm:
                    raise E.LeaseError(f"a pipelined lease of {len(lease.keys)} blocks: {why}: the bytes read "
                                       "under it may not be the blocks'; read them again")
        finally:
            self._unpin(link)

    def get(self, ns, keys: Sequence[bytes], out: Sequence | None = None) -> list:
        """The blocks of the longest present prefix of `keys`, copied out of leased slots.
        Raises LeaseError, returning nothing, if the lease was lost before the copy ended.

        Where the daemon's shared index shows the blocks ready in host RAM, they are copied
        without a lease (no round trip): the copy counts only if the index shows no change to
        those blocks afterwards and the daemon is still connected; otherwise — and whenever
        the index cannot tell — the blocks are leased and copied again."""
        nsobj = self._namespace(ns)
        if out is not None and len(out) < len(keys):
            raise E.TierdError(f"get: {len(keys)} keys but only {len(out)} output buffers")
        dsts = None if out is None else [as_u8(o, nsobj.block_bytes, nsobj.kv_dtype) for o in out]
        if self._unleased_ok and keys:
            got = self._get_unleased(nsobj, check_keys(keys), dsts, out)
            if got is not None:
                return got
        lease = self.acquire(nsobj, keys)
        try:
            got = copy_out(lease, dsts, out)
        except BaseException:
            self.release(lease)
            raise
        self.release(lease, confirm=True)
        return got

    def flush(self, tier: str = "all", namespace=None) -> int:
        if isinstance(namespace, Namespace):
            namespace = namespace.name
        fields = {"tier": tier}
        if namespace is not None:
            fields["namespace"] = namespace
        return self._call("flush", **fields)["dropped"]

    def sync(self, max_blocks: int | None = None) -> int:
        """Write host-only blocks to disk durably (at most `max_blocks`); see `sync_step`."""
        if max_blocks is None:
            return self._call("sync")["written"]
        return self.sync_step(max_blocks)[0]

    def sync_step(self, max_blocks: int) -> tuple[int, int]:
        """One bounded sync: (written, still unsynced) — for progress reporting."""
        r = self._call("sync", max_blocks=max_blocks)
        return r["written"], r["remaining"]

    def push_remote(self) -> tuple[int, int]:
        """Send the remote tier every host block it lacks and wait for the write-behind queue:
        (blocks sent, blocks still queued). Also syncs the disk tier, as `sync` does."""
        r = self._call("sync", remote=True)
        return r["remote_written"], r["remote_pending"]

    def stats(self) -> dict:
        return self._call("stats")["stats"]

    def cost_model(self, *, sync: bool = True, now: bool = False, via: "Client | None" = None) -> CostModel:
        """This client's replica of the daemon's cost model (tierd/costs.py). What this process
        measures goes into it at once; at most every `costs.SYNC_S` (at once with `now`: a
        closing engine's last measurements) it is exchanged with the daemon's (one request;
        never with `sync=False`), which holds what every engine on the node measured. A daemon
        that cannot be asked leaves the replica as it is: decisions go on from it. `via`: another
        client of the same daemon whose connection carries the exchange, so that it never holds
        this one's (a load's) for its round trip."""
        m = self._costs
        if sync and self._costs_ok and (now or time.monotonic() - m.synced_at >= SYNC_S):
            report = m.take_outbox()
            m.synced_at = time.monotonic()   # (one try per period, whatever it meets)
            try:
                m.adopt((via or self)._call("costs", report=report)["state"])
            except P.RemoteError as e:
                if e.code == "unknown_op":
                    self._costs_ok = False   # an older daemon: this replica is the whole model
            except (E.TierdError, OSError) as e:
                log.debug("tierd: the cost model was not exchanged with the daemon (%s)", e)
        return m

    def ping(self) -> dict:
        t0 = time.perf_counter()
        r = self._call("ping")
        return {"rtt_s": time.perf_counter() - t0, "version": r["version"]}

    def close(self) -> None:
        with self._lock:
            self._report_hits()
            if self._deferred and self._sock is not None:
                # the replies of requests still unanswered (a put's commit): a put that
                # returned is applied before the close does (a daemon stopped right after
                # serves what reached it, but it cannot serve what is still being sent)
                try:
                    self._drain_deferred(time.monotonic() + self.timeout_s)
                except Exception:  # noqa: BLE001 -- a close never raises; the connection goes anyway
                    pass
            if self._hits_reporter is not None:
                self._hits_reporter = None   # it sees that and ends
                self._hits_cv.notify()
            self._disconnect()
            if self._index is not None:
                self._index.close()
                self._index = None
            self._close_arena()
            self._map_gpu([])

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
