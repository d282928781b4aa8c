"""A client's connection to the daemon: the socket and its framing (deadlines, busy-polling,
pipelined replies), reconnects, the holds that keep a connection's slots its own while threads
copy through them, and the mappings of the daemon's arena, HBM tier and lookup index. `Client`
(tierd.client) builds the Store interface on it. Nothing here may close a socket while a hold
is on it: the daemon would reclaim the slots under a copy."""

from __future__ import annotations

import contextlib
import ctypes
import errno
import logging
import mmap
import os
import select
import socket
import threading
import time

import numpy as np

from . import errors as E
from . import protocol as P
from . import threads
from .access import not_admitted
from .config import socket_path_problem

log = logging.getLogger("tierd.client")


MADV_POPULATE_READ = 22      # Linux 5.14: map a range's pages now, as a read would (no page
# is dirtied: a shared-memory arena's pages come writable, a file's on disk stay clean)
PREFAULT_CHUNK = 32 << 20    # populated per call: a re-map or close waits for one chunk at most
_libc = None


def _madvise(addr: int, length: int, advice: int) -> int:
    """madvise(2) through ctypes (which lets go of the GIL while the kernel works); 0 or errno."""
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(None, use_errno=True)
        _libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    return 0 if _libc.madvise(addr, length, advice) == 0 else ctypes.get_errno()


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

    __slots__ = ("sock", "holds", "dead")

    def __init__(self, sock: socket.socket):
        self.sock, self.holds, self.dead = sock, 0, False

    def intact(self) -> bool:
        """The daemon has not closed this connection (so it still honours its slots): one
        poll(2) with no wait, on a poll object of this call's own (threads call this at once,
        and one poll object may not be polled by two threads)."""
        if self.sock.fileno() < 0:
            return False
        p = select.poll()
        p.register(self.sock, select.POLLRDHUP | select.POLLHUP | select.POLLERR)
        return not p.poll(0)


def _connect_advice(path: str, e: OSError) -> str:
    """What to do about a socket that cannot be connected to."""
    too_long = socket_path_problem(path)
    if too_long is not None:
        return too_long   # ("AF_UNIX path too long", without the limit)
    if e.errno == errno.EACCES:
        return not_admitted(path)
    if e.errno == errno.ENOENT:
        return ("no socket there: is `tierd serve` running, with this --socket (and, in a container, is its "
                "directory mounted)?")
    return "is `tierd serve` running?"


def _arena_advice(path: str, e: OSError) -> str:
    """What to do about a host arena that cannot be opened."""
    if e.errno == errno.ENOENT:
        return ("the daemon's arena_dir must be visible here at the same path (in a container: mount "
                f"{os.path.dirname(path)} from the host at {os.path.dirname(path)})")
    if e.errno == errno.EROFS:
        return f"clients write into the arena: mount {os.path.dirname(path)} read-write"
    if e.errno == errno.EACCES:
        return not_admitted(path)
    return "check that this process may open it for reading and writing"


class DaemonConnection:
    """Part of `Client`: its state is the client's."""

    def _connect(self) -> None:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        s.settimeout(self.connect_timeout_s)
        try:
            s.connect(self.path)
        except OSError as e:
            s.close()
            raise DaemonUnavailableError(f"cannot reach the tierd daemon at {self.path}: {e.strerror or e}; "
                                         f"{_connect_advice(self.path, e)}") from None
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
            nss = list(self._namespaces.values())
            known, labels = [ns.to_dict() for ns in nss], [ns.label for ns in nss]
            reply = self._roundtrip({"op": "hello", "version": P.PROTOCOL_VERSION, "client": self.name,
                                     "namespaces": known[:self.NS_PER_REQUEST],
                                     "labels": labels[:self.NS_PER_REQUEST]})
            for i in range(self.NS_PER_REQUEST, len(known), self.NS_PER_REQUEST):
                try:
                    self._roundtrip({"op": "register", "namespaces": known[i:i + self.NS_PER_REQUEST],
                                     "labels": labels[i:i + self.NS_PER_REQUEST]})
                except E.NamespaceLimitError:
                    break   # registered again when next used (and refused then, as a miss)
            self.server_version = reply.get("server")
            self.events = bool(reply.get("events"))   # the daemon publishes KV events: send token ids
            self._noreply = reply.get("noreply") is True   # releases may go unanswered
            self._quiet = reply.get("quiet") is True        # ... and acquires: quiet leases
            self._evictions = reply.get("evictions") is True   # its index dates the last eviction
            self._checksums = reply.get("checksums") is True   # it records blocks: put hashes as it copies
            self.limits = reply.get("limits", {})
            if not self.data_plane:
                # control only (`tierd ping`, `stats`, `sync`, `flush`): no arena, index or HBM
                # mapping, so these answer even where the arena cannot be mapped
                self._map_index(None)
                return
            self._map_arena(reply["arenas"][0])
            self._map_index(reply.get("index"))
            # reads without a lease: a daemon that takes their reports, its index (whose version
            # carries the slots and sequence numbers), on a machine whose memory order allows it
            from .index import LEASE_FREE_READS
            self._unleased_ok = reply.get("hits") is True and self._index is not None and LEASE_FREE_READS
            self._map_gpu([a for a in reply["arenas"][1:] if a.get("tier") == "gpu"])
        except BaseException:
            self._disconnect()
            raise

    def _map_gpu(self, descs: list[dict]) -> None:
        """Map the daemon's HBM tier once per export: a reconnect to the same daemon keeps the
        mapping (CUDA refuses to open one handle twice in a process); another export (a
        restarted daemon) closes the old mapping first."""
        if descs:
            from .tiers.gpu import (  # torch and CuPy: only where the daemon has HBM
                ipc_key,
                open_ipc,
            )
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
        self._close_arena()
        self.prefaulted_bytes = 0
        try:
            fd = os.open(desc["path"], os.O_RDWR | os.O_CLOEXEC)
        except OSError as e:
            raise DaemonUnavailableError(f"cannot map the daemon's host arena {desc['path']}: {e.strerror}; "
                                         f"{_arena_advice(desc['path'], e)}") from None
        try:
            st = os.fstat(fd)
            if "ino" in desc and (st.st_dev, st.st_ino) != (desc["dev"], desc["ino"]):
                # another process put a file at the daemon's path: its bytes are not the cache
                raise DaemonUnavailableError(
                    f"the host arena at {desc['path']} is not the one the daemon at {self.path} serves "
                    "(was a second `tierd serve` started on this socket?); restart the daemon")
            mm = mmap.mmap(fd, desc["capacity_bytes"], mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        with self._prefault_lock:
            self._arena_mmap = mm
            self._prefault_stop = threading.Event()
        self._arena = np.frombuffer(mm, dtype=np.uint8)
        self._arena_ro = self._arena.view()    # (its slices are read-only: leased views)
        self._arena_ro.flags.writeable = False
        if self.prefault:
            threads.start(self._prefault, self._prefault_stop, self._arena.ctypes.data, len(self._arena),
                          name="tierd-prefault")

    def _close_arena(self) -> None:
        """Unmap the arena (lock held), once no prefault call runs on it."""
        self._arena = self._arena_ro = None
        self._prefault_stop.set()    # a prefault stops at its next chunk (the lock is not fair)
        with self._prefault_lock:
            mm, self._arena_mmap = self._arena_mmap, None
            if mm is not None:
                try:
                    mm.close()
                except BufferError:
                    pass  # a caller still holds views of the old arena; it goes with them

    def _prefault(self, stop: threading.Event, addr: int, size: int) -> None:
        """Map every page of the arena into this process's page tables ahead of use (a client
        made with `prefault`, such as an engine's connector), so that the first copy through a
        slot does not stop on a page fault per 4 KiB (on this kind of machine a first copy out of
        a fresh mapping ran at a third of memcpy; inside an engine, slower still). The pages are
        the daemon's, already allocated: only page-table entries are made (about 2 MiB per GiB
        of arena, which a long-running engine ends up with anyway). At the lowest priority, in
        chunks; stops when the mapping is replaced or closed, and where the kernel lacks
        MADV_POPULATE_READ (before 5.14)."""
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)   # this thread only
        except (OSError, AttributeError):
            pass
        t0 = time.perf_counter()
        for off in range(0, size, PREFAULT_CHUNK):
            with self._prefault_lock:
                if stop.is_set():      # the mapping is being replaced or closed
                    return
                err = _madvise(addr + off, min(PREFAULT_CHUNK, size - off), MADV_POPULATE_READ)
            if err:
                if err != errno.EINVAL:
                    log.debug("prefaulting the arena stopped at %d of %d bytes: %s", off, size, os.strerror(err))
                return
            self.prefaulted_bytes = off + min(PREFAULT_CHUNK, size - off)
        log.debug("prefaulted the %d-byte arena in %.2f s", size, time.perf_counter() - t0)

    def _map_index(self, desc: dict | None) -> None:
        if self._index is not None:
            self._index.close()
            self._index = None
        if desc and self.use_index:
            from .index import SharedIndex
            self._index = SharedIndex.open(desc["path"], int(desc["instance"]))
        # the daemon's end of this connection closed (a poll, no read): its slots are gone
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

    def _drain_deferred(self, deadline: float, enough=None) -> None:
        """Read the replies of the requests sent deferred (they come first, in order), each
        handed to its callback (which reports an error reply its own way), or an error logged
        where there is none; all of them, or until `enough()` says so."""
        while self._deferred and not (enough is not None and enough()):
            sent, on_reply = self._deferred.pop(0)
            r = self._read_reply(deadline)
            if on_reply is not None:
                on_reply(r)
            elif "error" in r:
                log.warning("deferred %s failed: %s", sent["op"], r["error"].get("message"))
        if not self._deferred:
            self._deferred_commits = 0

    def _disconnect(self) -> None:
        """Give up the connection for new requests (lock held). Its socket closes now, or —
        when threads still hold its slots — when the last of them lets go."""
        self._deferred = []
        self._deferred_commits = 0
        self._hits, self._hits_keys = [], 0   # reads under this connection: its daemon may be gone
        self._unleased_ok = False
        self._stage_pool = {}        # staged slots belong to the connection
        self._stage_short = {}
        self._putting = {}
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

    def _encode(self, msg: dict) -> bytes:
        """`msg` as a frame, or RequestTooLargeError (nothing sent) when it is over the limits the
        daemon's hello gave: a daemon cannot read past a frame over its `max_frame_bytes` and ends
        the connection, so a request over it is never sent (`put` splits what it can)."""
        limits = self.limits
        keys = msg.get("keys")
        max_keys = limits.get("max_keys_per_request", P.DEFAULT_MAX_KEYS)
        if isinstance(keys, list) and len(keys) > max_keys:
            raise E.RequestTooLargeError(f"{msg.get('op')}: {len(keys)} keys in one request, over the daemon's "
                                         f"max_keys_per_request ({max_keys}); nothing was sent")
        frame = P.encode(msg)
        max_bytes = limits.get("max_frame_bytes", P.DEFAULT_MAX_FRAME_BYTES)
        if len(frame) - P.HEADER.size > max_bytes:
            raise E.RequestTooLargeError(f"{msg.get('op')}: a {len(frame) - P.HEADER.size}-byte request, over the "
                                         f"daemon's max_frame_bytes ({max_bytes}); nothing was sent")
        return frame

    def _send_deferred(self, msg: dict, on_reply=None, *, answered: bool = True) -> bool:
        """Send a request whose reply is read later (before the next reply), then handed to
        `on_reply` (an error reply too); or, not `answered`, one the daemon does not answer at
        all (a release, where its hello says it can). False if the connection is gone (and
        with it whatever the request was about)."""
        msg["id"] = next(self._ids)
        if not answered:
            msg["noreply"] = True
        frame = self._encode(msg)
        try:
            self._send(frame, time.monotonic() + self.timeout_s)
            if answered:
                self._deferred.append((msg, on_reply))
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
        frame = self._encode(msg)
        try:
            self._send(frame, deadline)
            self._drain_deferred(deadline)
            reply = self._read_reply(deadline)
        except (OSError, EOFError) as e:
            parting = self._parting_error()
            self._disconnect()
            if parting is not None:
                _raise_remote(parting)   # why the daemon closed (e.g. a refused peer)
            raise DaemonUnavailableError(f"lost the tierd daemon at {self.path} during {msg['op']}: {e}") from None
        if "error" in reply:
            _raise_remote(reply["error"])
        if reply.get("id") != req_id:
            self._disconnect()
            raise P.ProtocolError(f"reply id {reply.get('id')} does not match request {req_id}")
        return reply

    def _parting_error(self) -> dict | None:
        """The error a daemon wrote before it closed this connection, if it did: a daemon that
        refuses a peer replies with the reason and hangs up, and the client may see the broken
        pipe on its send before it reads that reply."""
        buf = self._rbuf
        try:
            while True:
                chunk = self._sock.recv(65536)
                if not chunk:
                    break
                buf += chunk
        except OSError:
            pass
        if len(buf) >= 4:
            (n,) = P.HEADER.unpack_from(buf)
            if len(buf) >= 4 + n:
                try:
                    msg = P.decode_body(bytes(memoryview(buf)[4:4 + n]))
                except Exception:  # noqa: BLE001 -- a broken frame says nothing more
                    return None
                if isinstance(msg, dict) and msg.get("id") is None and isinstance(msg.get("error"), dict):
                    return msg["error"]
        return None

    def _call(self, op: str, **fields) -> dict:
        with self._lock:
            for attempt in range(self.retries + 1):
                if self._hits:
                    self._report_hits()   # counted before what this request may show
                if self._sock is not None and self._hup.poll(0):
                    # the daemon ended this connection (it stopped, or refused a frame): a new one,
                    # rather than a request it would never read
                    self._disconnect()
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
        nss = [self._namespaces[n] for n in dict.fromkeys(names) if n in self._namespaces]
        if not nss:
            return False
        known, labels = [ns.to_dict() for ns in nss], [ns.label for ns in nss]
        for i in range(0, len(known), self.NS_PER_REQUEST):
            self._roundtrip({"op": "register", "namespaces": known[i:i + self.NS_PER_REQUEST],
                             "labels": labels[i:i + self.NS_PER_REQUEST]})
        return True

    @property
    def connected(self) -> bool:
        return self._sock is not None

    @property
    def arena_generation(self) -> int:
        """Changes whenever the arena is mapped anew (a reconnect): page-locked ranges of an
        earlier mapping are stale, even at the same address."""
        return self._generation
