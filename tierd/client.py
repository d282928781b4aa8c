"""`tierd.client.Client`: the Store interface over the daemon's Unix socket.

The socket carries only control frames; block bytes move through the daemon's host arena,
which the client maps once: `put` copies into reserved slots, `get` copies out of leased ones.
A lost connection is re-established on the next call (the daemon may have restarted); what the
old connection held — reservations, leases — is gone with it, and calls that cannot be
repeated safely say so. Thread-safe: one request at a time per client.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import mmap
import os
import select
import socket
import threading
import time
from collections.abc import Sequence

import numpy as np

from . import errors as E
from . import protocol as P
from .keys import check_keys
from .namespace import Namespace
from .transfer import as_u8, copy_out, fill_reservation

log = logging.getLogger("tierd.client")

_ERRORS = {cls.code: cls for cls in (
    E.ConfigError, E.NamespaceError, E.UnknownNamespaceError, E.BlockError, E.KeyFormatError,
    E.CapacityError, E.DiskTierError, E.DiskDegradedError, E.LeaseError, E.StoreClosedError,
    E.NamespaceLimitError, E.ForbiddenError)}


class DaemonUnavailableError(E.TierdError, ConnectionError):
    """The daemon cannot be reached (not running, wrong socket, or it went away mid-call)."""

    code = "unavailable"


def _raise_remote(err: dict) -> None:
    code = str(err.get("code", "internal"))
    message = str(err.get("message", ""))
    cls = _ERRORS.get(code)
    if cls is not None:
        raise cls(message)
    raise P.RemoteError(code, message)


class _Link:
    """One connection to the daemon and the holds on it. The daemon reclaims a connection's
    reservations and leases when its socket closes, so the socket is closed only once no hold
    is left: a link given up (a timeout on one thread) while another thread still copies through
    its slots stays open, unused, until that copy is done (`dead` and `holds > 0`)."""

    __slots__ = ("sock", "holds", "dead", "_hup")

    def __init__(self, sock: socket.socket):
        self.sock, self.holds, self.dead = sock, 0, False
        self._hup = select.poll()
        self._hup.register(sock, select.POLLRDHUP | select.POLLHUP | select.POLLERR)

    def intact(self) -> bool:
        """The daemon has not closed this connection (so it still honours its slots): one
        poll(2) with no wait."""
        return self.sock.fileno() >= 0 and not self._hup.poll(0)


class ClientReservation:
    """Slots in the daemon's arena to write into; `commit` makes them visible. It holds its
    connection open until committed or aborted (see `Client.acquire`)."""

    def __init__(self, rid, ns, keys, status, buffers, generation, link=None):
        self.id, self.namespace, self.keys = rid, ns, keys
        self.status, self.buffers = status, buffers
        self._generation = generation
        self._link = link   # the held connection (None: nothing reserved, nothing held)

    @property
    def num_reserved(self) -> int:
        return sum(s == "reserved" for s in self.status)


class ClientLease:
    """Read-only views of leased slots in the daemon's arena, valid until `release`."""

    def __init__(self, lid, ns, keys, buffers, tiers, client, generation, link=None):
        self.id, self.namespace, self.keys = lid, ns, keys
        self.buffers, self.tiers = buffers, tiers
        self.gpu_offsets: list[int] = []     # per block: offset in the daemon's HBM tier, or -1
        self.gpu_buffers: list = []          # per block: (block_bytes,) CUDA view, or None
        self._client, self._generation, self._open = client, generation, True
        self._link = link   # the held connection (None: nothing leased, nothing held)

    def __len__(self) -> int:
        return len(self.keys)

    def __enter__(self) -> "ClientLease":
        return self

    def __exit__(self, *exc) -> None:
        if self._open:
            self._client.release(self)


class Client:
    """A connection to `tierd serve` with the same interface as `TieredStore`."""

    RETRY_OPS = {"lookup", "lookup_all", "where", "acquire", "stats", "ping", "flush", "sync", "register"}
    NS_PER_REQUEST = 64   # namespaces per hello or register request (the daemon's limit)

    def __init__(self, path: str, *, timeout_s: float = 60.0, name: str | None = None,
                 connect_timeout_s: float = 5.0, retries: int = 1, spin_us: float = 100.0,
                 use_index: bool = True, hbm: bool | None = None):
        self.path = path
        self._spin_s = max(0.0, spin_us) / 1e6   # busy-poll for a reply this long (0: never)
        self._spin_skip = 0
        self.timeout_s = timeout_s
        self.retries = retries
        self.connect_timeout_s = connect_timeout_s
        self.name = name or f"pid{os.getpid()}"
        self._lock = threading.RLock()
        self._ids = itertools.count(1)
        self._sock: socket.socket | None = None
        self._namespaces: dict[str, Namespace] = {}
        self._arena = None
        self._arena_mmap = None
        self._gpu_arena = None
        self._gpu_map = None         # the daemon's HBM tier as mapped here (tierd.tiers.gpu.IpcMapping)
        self._generation = 0
        self._deferred: list[dict] = []
        self._deferred_commits = 0   # commits among them (a lookup from the index waits for them)
        self._rbuf = bytearray()     # received bytes not yet parsed into a reply
        self._index = None           # the daemon's shared lookup index (tierd.index), when mapped
        self.use_index = use_index
        self._hbm = hbm              # reads HBM copies: None = when it maps the daemon's HBM tier
        self._hold_lock = threading.Lock()
        self._link: _Link | None = None
        self.reconnects = 0
        with self._lock:
            self._connect()

    # -- connection ------------------------------------------------------------------------------
    def _connect(self) -> None:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        s.settimeout(self.connect_timeout_s)
        try:
            s.connect(self.path)
        except OSError as e:
            s.close()
            raise DaemonUnavailableError(
                f"cannot reach the tierd daemon at {self.path}: {e.strerror or e}; is `tierd serve` running?") from None
        s.setblocking(False)
        self._sock = s
        self._link = _Link(s)
        self._poller = select.poll()
        self._poller.register(s, select.POLLIN)
        self._rbuf = bytearray()
        self._generation += 1
        # A connection is either greeted and mapped, or closed: never left half-open (every
        # later call would then fail with "send hello first").
        try:
            # this client's namespaces again (a restarted daemon knows none of them), in requests
            # of at most NS_PER_REQUEST
            known = [ns.to_dict() for ns in self._namespaces.values()]
            reply = self._roundtrip({"op": "hello", "version": P.PROTOCOL_VERSION, "client": self.name,
                                     "namespaces": known[:self.NS_PER_REQUEST]})
            for i in range(self.NS_PER_REQUEST, len(known), self.NS_PER_REQUEST):
                try:
                    self._roundtrip({"op": "register", "namespaces": known[i:i + self.NS_PER_REQUEST]})
                except E.NamespaceLimitError:
                    break   # registered again when next used (and refused then, as a miss)
            self.server_version = reply.get("server")
            self.events = bool(reply.get("events"))   # the daemon publishes KV events: send token ids
            self.limits = reply.get("limits", {})
            self._map_arena(reply["arenas"][0])
            self._map_index(reply.get("index"))
            self._map_gpu([a for a in reply["arenas"][1:] if a.get("tier") == "gpu"])
        except BaseException:
            self._disconnect()
            raise

    def _map_gpu(self, descs: list[dict]) -> None:
        """Map the daemon's HBM tier once per export: a reconnect to the same daemon keeps the
        mapping (CUDA refuses to open one handle twice in a process); another export (a
        restarted daemon) closes the old mapping first."""
        if descs:
            from .tiers.gpu import ipc_key, open_ipc   # torch and CuPy: only where the daemon has HBM
            if self._gpu_map is not None and self._gpu_map.key == ipc_key(descs[0]):
                return
        if self._gpu_map is not None:
            self._gpu_arena = None
            self._gpu_map.close()
            self._gpu_map = None
        if descs:
            self._gpu_map = open_ipc(descs[0])
        self._gpu_arena = self._gpu_map.tensor if self._gpu_map is not None else None

    def _map_arena(self, desc: dict) -> None:
        if self._arena_mmap is not None:
            self._arena = None
            try:
                self._arena_mmap.close()
            except BufferError:
                pass  # a caller still holds views of the old arena; it goes with them
        try:
            fd = os.open(desc["path"], os.O_RDWR | os.O_CLOEXEC)
        except OSError as e:
            raise DaemonUnavailableError(f"cannot map the daemon's host arena {desc['path']}: {e.strerror}") from None
        try:
            st = os.fstat(fd)
            if "ino" in desc and (st.st_dev, st.st_ino) != (desc["dev"], desc["ino"]):
                # another process put a file at the daemon's path: its bytes are not the cache
                raise DaemonUnavailableError(
                    f"the host arena at {desc['path']} is not the one the daemon at {self.path} serves "
                    "(was a second `tierd serve` started on this socket?); restart the daemon")
            self._arena_mmap = mmap.mmap(fd, desc["capacity_bytes"], mmap.MAP_SHARED,
                                         mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        self._arena = np.frombuffer(self._arena_mmap, dtype=np.uint8)

    def _map_index(self, desc: dict | None) -> None:
        if self._index is not None:
            self._index.close()
            self._index = None
        if desc and self.use_index:
            from .index import SharedIndex
            self._index = SharedIndex.open(desc["path"], int(desc["instance"]))
        if self._index is not None:
            self._hup = select.poll()
            self._hup.register(self._sock, select.POLLRDHUP)

    def _index_usable(self) -> bool:
        """The shared index answers for the daemon only while this connection is up (a dead
        daemon's table is frozen) and once this client's commits have been applied (a lookup
        right after a put must see the blocks)."""
        if self._index is None or self._sock is None:
            return False
        if not self._index.fresh() or self._hup.poll(0):
            return False   # the daemon is stopped, stuck or gone: ask it (deadline, reconnect)
        if self._deferred_commits:
            try:
                self._drain_deferred(time.monotonic() + self.timeout_s)
            except (OSError, EOFError):
                self._disconnect()
                return False
        return True

    def _drain_deferred(self, deadline: float) -> None:
        """Read the replies of the requests sent deferred (they come first, in order)."""
        while self._deferred:
            sent = self._deferred.pop(0)
            r = self._read_reply(deadline)
            if "error" in r:
                log.warning("deferred %s failed: %s", sent["op"], r["error"].get("message"))
        self._deferred_commits = 0

    def _disconnect(self) -> None:
        """Give up the connection for new requests (lock held). Its socket closes now, or —
        when threads still hold its slots — when the last of them lets go."""
        self._deferred = []
        self._deferred_commits = 0
        self._rbuf = bytearray()
        if self._sock is not None:
            link, self._sock, self._link = self._link, None, None
            with self._hold_lock:
                link.dead = True
                if link.holds:
                    return
            link.sock.close()

    def _pin(self) -> _Link | None:
        """(Lock held.) Hold the current connection open: its slots stay this client's."""
        link = self._link
        if link is not None:
            with self._hold_lock:
                link.holds += 1
        return link

    def _unpin(self, link: _Link | None) -> None:
        if link is None:
            return
        with self._hold_lock:
            link.holds -= 1
            close = link.dead and not link.holds
        if close:
            link.sock.close()   # the daemon reclaims what it held now, after every copy

    @contextlib.contextmanager
    def hold(self):
        """Keep this connection's reservations and leases alive while the caller copies into or
        out of their slots from another thread: a request that fails meanwhile (a timeout on
        another thread) drops the connection for new requests, but its socket is closed — and
        the daemon reclaims the slots — only once every holder is done. (Every open lease and
        reservation holds its connection this way by itself; this is for callers that copy
        through slots they track on their own.)"""
        with self._lock:
            link = self._pin()
        try:
            yield
        finally:
            self._unpin(link)

    def reconnect(self) -> None:
        """Connect again if the connection was lost (for callers that reconnect off their hot path)."""
        with self._lock:
            if self._sock is None:
                self._connect()
                self.reconnects += 1

    def generation(self) -> int:
        """Changes with every new connection: slots obtained under an older one are gone."""
        return self._generation

    def _send_deferred(self, msg: dict) -> bool:
        """Send a request whose reply is read later (before the next reply). False if the
        connection is gone (and with it whatever the request was about)."""
        msg["id"] = next(self._ids)
        try:
            self._send(P.encode(msg), time.monotonic() + self.timeout_s)
            self._deferred.append(msg)
            return True
        except (OSError, EOFError):
            self._disconnect()
            return False

    # The socket is non-blocking; waiting is done here with poll(2), against a deadline for the
    # whole exchange (no per-call settimeout, which costs two fcntl calls each time).
    def _wait(self, events: int, deadline: float) -> None:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("timed out")
        poller = self._poller
        poller.modify(self._sock, events)
        if not poller.poll(max(1, int(left * 1000 + 0.999))):
            raise TimeoutError("timed out")

    def _send(self, data: bytes, deadline: float) -> None:
        view = memoryview(data)
        while view:
            try:
                n = self._sock.send(view)
            except BlockingIOError:
                self._wait(select.POLLOUT, deadline)
                continue
            view = view[n:]

    def _recv(self, deadline: float) -> bytes:
        """Some bytes of the reply stream. A reply usually comes within microseconds: the
        first wait spins (bounded by `spin_us`) before sleeping in poll, which saves a wake-up
        on another CPU (tens of microseconds on virtual machines). The spin adapts: after one
        that came up empty the next few requests sleep at once, so a busy host (more clients
        than CPUs) does not burn CPU the daemon needs."""
        sock = self._sock
        try:
            chunk = sock.recv(65536)
        except BlockingIOError:
            chunk = None
            if self._spin_s and self._spin_skip <= 0:
                end = time.perf_counter() + self._spin_s
                while time.perf_counter() < end:
                    try:
                        chunk = sock.recv(65536)
                        break
                    except BlockingIOError:
                        pass
                if chunk is None:
                    self._spin_skip = 8
            else:
                self._spin_skip -= 1
            while chunk is None:
                self._wait(select.POLLIN, deadline)
                try:
                    chunk = sock.recv(65536)
                except BlockingIOError:
                    pass
        if not chunk:
            raise EOFError("connection closed by the daemon")
        return chunk

    def _read_reply(self, deadline: float) -> dict:
        """The next reply frame. Replies to pipelined requests may arrive together: what is read
        past this frame stays in the receive buffer for the next call."""
        buf = self._rbuf
        while True:
            if len(buf) >= 4:
                (n,) = P.HEADER.unpack_from(buf)
                if len(buf) >= 4 + n:
                    msg = P.decode_body(bytes(memoryview(buf)[4:4 + n]))
                    del buf[:4 + n]
                    return msg
            buf += self._recv(deadline)

    def _roundtrip(self, msg: dict) -> dict:
        """One request and its reply, all within `timeout_s` (a deadline for the whole exchange,
        not per socket call: a daemon that trickles bytes cannot stretch it)."""
        req_id = next(self._ids)
        msg["id"] = req_id
        deadline = time.monotonic() + self.timeout_s
        try:
            self._send(P.encode(msg), deadline)
            self._drain_deferred(deadline)
            reply = self._read_reply(deadline)
        except (OSError, EOFError) as e:
            self._disconnect()
            raise DaemonUnavailableError(f"lost the tierd daemon at {self.path} during {msg['op']}: {e}") from None
        if "error" in reply:
            _raise_remote(reply["error"])
        if reply.get("id") != req_id:
            self._disconnect()
            raise P.ProtocolError(f"reply id {reply.get('id')} does not match request {req_id}")
        return reply

    def _call(self, op: str, **fields) -> dict:
        with self._lock:
            for attempt in range(self.retries + 1):
                if self._sock is None:
                    self._connect()
                    self.reconnects += 1
                try:
                    return self._roundtrip({"op": op, **fields})
                except E.UnknownNamespaceError:
                    # the daemon forgot an unused namespace of ours (its table is bounded):
                    # register it again, once, and ask again
                    if not self._register_again(fields):
                        raise
                    return self._roundtrip({"op": op, **fields})
                except DaemonUnavailableError:
                    if attempt == self.retries or op not in self.RETRY_OPS:
                        raise
                    time.sleep(0.05)
            raise AssertionError("unreachable")

    def _register_again(self, fields: dict) -> bool:
        names = [fields.get("ns")] + [q.get("ns") for q in fields.get("queries", ()) if isinstance(q, dict)]
        known = [self._namespaces[n].to_dict() for n in dict.fromkeys(names) if n in self._namespaces]
        if not known:
            return False
        for i in range(0, len(known), self.NS_PER_REQUEST):
            self._roundtrip({"op": "register", "namespaces": known[i:i + self.NS_PER_REQUEST]})
        return True

    def _ns_name(self, ns) -> str:
        if isinstance(ns, Namespace):
            if ns.name not in self._namespaces:
                with self._lock:   # other threads wait until the daemon knows it
                    if ns.name not in self._namespaces:
                        self._namespaces[ns.name] = ns   # a reconnect inside the call registers it too
                        try:
                            self._call("register", namespaces=[ns.to_dict()])
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
        v = self._arena[offset:offset + nbytes]
        if not writable:
            v = v.view()
            v.flags.writeable = False
        return v

    @property
    def connected(self) -> bool:
        return self._sock is not None

    def host_array(self) -> np.ndarray:
        """The daemon's host arena as mapped here, one uint8 array (for cudaHostRegister)."""
        return self._arena

    @property
    def arena_generation(self) -> int:
        """Changes whenever the arena is mapped anew (a reconnect): page-locked ranges of an
        earlier mapping are stale, even at the same address."""
        return self._generation

    # -- Store interface -----------------------------------------------------------------------
    def register(self, ns: Namespace) -> None:
        self._ns_name(ns)

    def lookup(self, ns, keys: Sequence[bytes]) -> int:
        keys = check_keys(keys)
        name = self._ns_name(ns)
        with self._lock:
            if self._index_usable():
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
            if self._index_usable():
                found = [self._index.leading(self._namespaces[x["ns"]].id, x["keys"]) for x in q]
                if all(f is not None for f in found):
                    return found if host else [n for n, _ in found]
        if host:
            r = self._call("lookup_all", queries=q, host=True)
            return list(zip(r["n"], r["host"]))
        return list(self._call("lookup_all", queries=q)["n"])

    def where(self, ns, keys: Sequence[bytes]) -> list[str]:
        keys = check_keys(keys)
        return self._call("where", ns=self._ns_name(ns), keys=keys)["tiers"]

    def reserve(self, ns, keys: Sequence[bytes], *, parent: bytes | None = None,
                token_ids: Sequence[int] | None = None) -> ClientReservation:
        """Slots to write `keys` into. `token_ids` (optional, `block_tokens` per key) go to the
        daemon only where it publishes KV events, for indexers that compute their own keys.
        The reservation holds its connection open until `commit` or `abort` (see `acquire`)."""
        keys = check_keys(keys)          # bad input is refused before anything is asked
        nsobj = self._namespace(ns)
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
        what was copied into its slots is then discarded."""
        if res.id == 0:
            return 0   # nothing was reserved: the daemon keeps no reservation
        link, res._link = res._link, None
        try:
            with self._lock:
                self._check_held(res, link, "reservation")
                return self._call("commit", res=res.id)["n"]
        finally:
            self._unpin(link)

    def _check_held(self, held, link: _Link | None, what: str) -> None:
        """(Lock held.) LeaseError unless `held` was made on the current, live connection."""
        if link is None or link is not self._link or link.dead or held._generation != self._generation:
            raise E.LeaseError(f"this {what} ({held.id}) was lost with its connection to the daemon "
                               "(the daemon restarted, or a request on another thread timed out)")

    def abort(self, res: ClientReservation) -> None:
        if res.id == 0:
            return
        link, res._link = res._link, None
        try:
            with self._lock:
                if link is not None and link is self._link and not link.dead:
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
        views = [as_u8(b, nsobj.block_bytes, nsobj.kv_dtype) for b in blocks]
        res = self.reserve(nsobj, keys, parent=parent, token_ids=token_ids)
        fill_reservation(self, res, views)
        if not res.num_reserved:
            return 0
        link, res._link = res._link, None
        try:
            with self._lock:
                self._check_held(res, link, "reservation")
                # The daemon serves a connection's requests in order, so everything this client
                # asks next already sees the blocks; the commit's reply is read with the next
                # reply.
                if not self._send_deferred({"op": "commit", "res": res.id}):
                    raise DaemonUnavailableError(f"lost the tierd daemon at {self.path} during put")
                self._deferred_commits += 1
                return res.num_reserved
        finally:
            self._unpin(link)

    def acquire(self, ns, keys: Sequence[bytes]) -> ClientLease:
        """Lease the longest present prefix of `keys`; read `lease.buffers`, then `release`.

        Threads: a client may be shared by threads. A lease (and a reservation) holds its
        connection open until released, so a request that times out on another thread — which
        gives the connection up — cannot make the daemon reclaim these slots while they are
        read. Bytes are trustworthy only if the lease still stands after they were read:
        `release(lease, confirm=True)` checks that (`get` does it for you, without a round
        trip)."""
        keys = check_keys(keys)          # bad input is refused before anything is asked
        nsobj = self._namespace(ns)
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
        if lease.id == 0:
            return   # nothing was leased
        link, lease._link = lease._link, None
        try:
            if confirm and (link is None or not link.intact()):
                raise E.LeaseError(f"lease {lease.id} was lost with its connection to the daemon")
            with self._lock:
                if link is not None and link is self._link and not link.dead:
                    # The reply is read before the next request's, not waited for now: a release
                    # cannot fail for a lease this client holds, and it saves a round trip per get.
                    self._send_deferred({"op": "release", "lease": lease.id})
        finally:
            self._unpin(link)

    def get(self, ns, keys: Sequence[bytes], out: Sequence | None = None) -> list:
        """The blocks of the longest present prefix of `keys`, copied out of leased slots.
        Raises LeaseError, returning nothing, if the lease was lost before the copy ended."""
        nsobj = self._namespace(ns)
        if out is not None and len(out) < len(keys):
            raise E.TierdError(f"get: {len(keys)} keys but only {len(out)} output buffers")
        dsts = None if out is None else [as_u8(o, nsobj.block_bytes, nsobj.kv_dtype) for o in out]
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

    def ping(self) -> dict:
        t0 = time.perf_counter()
        r = self._call("ping")
        return {"rtt_s": time.perf_counter() - t0, "version": r["version"]}

    def close(self) -> None:
        with self._lock:
            self._disconnect()
            if self._index is not None:
                self._index.close()
                self._index = None
            self._arena = None
            if self._arena_mmap is not None:
                try:
                    self._arena_mmap.close()
                except BufferError:
                    pass
                self._arena_mmap = None
            self._map_gpu([])

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
