"""`tierd serve`: the daemon. Owns one TieredStore and serves it on a Unix socket.

The event loop only reads and writes frames; every store call runs on a worker thread, so a
disk read for one client never stalls another. Reservations and leases belong to the
connection that made them and are reclaimed when it goes. The daemon must never crash on a
client's input and never let one client name another's slots.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import hashlib
import logging
import os
import signal
import socket
import stat
import struct
import sys
import termios
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import Any

import aiofiles

from . import __version__
from . import protocol as P
from .arena import filesystem_type
from .config import (RELOADABLE, SERVE_KEYS, ServeConfig, load_serve_config, setting_value,
                     socket_path_problem)
from .errors import ConfigError, InstanceLockedError, TierdError
from .index import BEAT_S, SharedIndex
from .instance import InstanceLock
from .metrics import Metrics
from .sdnotify import notify, watchdog_interval_s
from .server_ops import Ops
from .store import Lease, Reservation, TieredStore, WouldBlock
from .tiers.host import records_path

log = logging.getLogger("tierd.server")

# ops that never wait on disk I/O (only briefly on the store lock): served on the event loop
# thread, saving a thread hop; the others (acquire may read disk, reserve may wait for room,
# flush and sync write) run on the worker pool.
_INLINE_OPS = {"hello", "register", "lookup", "lookup_all", "where", "commit", "abort", "release", "put", "hits",
               "stats", "ping", "costs"}
# ops a client may send unanswered ("noreply": true): a failure is logged, never written back
_NOREPLY_OPS = {"release", "hits"}
# ... but with a remote tier a lookup may ask the server: then it runs on the worker pool
_REMOTE_OPS = {"lookup", "lookup_all"}


class _Conn(asyncio.Protocol):
    """One client connection: frames in, replies out, in request order.

    Frames are parsed as bytes arrive (no reader task, no per-frame timers); a request served
    inline is answered before the next frame is read. One that runs on the worker pool holds
    back the connection's later requests until its reply is written, so replies never
    overtake each other. Reading pauses while replies cannot be written (a client that does not
    read), or while a request is running and BUSY_BUFFER_FRAMES frames' worth waits behind it,
    which bounds what one connection can make the daemon buffer. Reading on while a request
    runs means a pipelined write behind it is in hand when its client goes away: the writes
    (`put`, `commit`) a client sent before it left are served before the daemon takes back
    what the connection held (LEFT_OPS; see `_leave`).
    """

    BUSY_BUFFER_FRAMES = 1      # frames of max_frame_bytes read ahead behind a running request (the
                                # same bound as one frame on its way in)
    LEFT_OPS = ("put", "commit")   # served after the client left: what they store stands

    def __init__(self, daemon: "Daemon", cid: int):
        self.d = daemon
        self.id = cid
        self.pid = self.uid = self.gid = -1
        self.greeted = False
        self.name = ""
        self.namespaces: set[str] = set()
        self.held: set[tuple[str, int]] = set()   # open ("res"|"lease", id): never idle-closed
        self.ops = 0
        self.transport: asyncio.Transport | None = None
        self._buf = bytearray()
        self._busy = False          # a request on the worker pool: later frames wait
        self._paused_write = False
        self._paused_read = False
        self._closed = False
        self._last = 0.0            # monotonic time of the last complete frame
        self._frame_started = 0.0   # when the incomplete frame at the head of _buf began (0: none)
        self._timer = None
        self._stop_left: int | None = None   # stopping: bytes sent before the stop, not read yet
        self._ending = False        # the daemon ended it; its slots wait for the client's end to close

    # -- asyncio.Protocol ---------------------------------------------------------------------
    def connection_made(self, transport) -> None:
        self.transport = transport
        d = self.d
        try:
            self.pid, self.uid, self.gid = peer_credentials(transport.get_extra_info("socket"))
        except OSError:
            transport.abort()
            self._closed = True
            return
        self.groups = peer_groups(transport.get_extra_info("socket"), self.pid, self.uid, self.gid)
        allowed = d._allowed(self.uid, self.groups)
        if not allowed or len(d.conns) >= d.cfg.max_clients:
            d.counters["refused_peers"] += not allowed
            groups = ", ".join(str(g) for g in sorted(self.groups))
            reason = (f"uid {self.uid} (groups {groups}) is not allowed by this daemon (it admits its own "
                      f"uid {os.geteuid()}, root, allowed_uids {list(d.cfg.allowed_uids)} and members of its "
                      f"group {os.getegid()} and of allowed_gids {list(d.cfg.allowed_gids)}); add the uid to "
                      "allowed_uids or the "
                      "client's user to an allowed group, e.g. `usermod -aG tierd USER`, then restart "
                      "the client") if not allowed else f"too many clients (max_clients {d.cfg.max_clients})"
            log.warning("refused connection from %s: %s",
                        f"pid {self.pid}" if self.pid else "a process of another PID namespace", reason)
            self._write(P.error_reply(None, "forbidden" if not allowed else "busy", reason))
            self._close()
            return
        d.conns[self.id] = self
        d.counters["connections_total"] += 1
        self._last = time.monotonic()
        self._arm_timer()

    def data_received(self, data: bytes) -> None:
        if self._closed or self._ending:
            return   # (ended by the daemon: what comes now is read only to see the client's end close)
        self._buf += data
        if self._stop_left is not None:
            self._stop_left -= len(data)
        self._pump()

    def eof_received(self):
        return False   # close our side too

    def pause_writing(self) -> None:
        self._paused_write = True
        self._set_reading()

    def resume_writing(self) -> None:
        self._paused_write = False
        self._set_reading()
        self._pump()

    def connection_lost(self, exc) -> None:
        self._closed = True
        if self._timer is not None:
            self._timer.cancel()
        if self.d.conns.pop(self.id, None) is None:
            return
        if self._ending:
            self.d.ending_conns -= 1
            self._buf.clear()   # read after the daemon ended it: never served
        elif exc is not None:
            self._read_left()
        self._leave()

    LEFT_READ_BYTES = 64 << 20   # the most read off a socket whose transport failed (see below)

    def _read_left(self) -> None:
        """(The transport failed: a write met a client already gone, EPIPE.) The requests that
        client sent before it left may still sit unread in the socket — a transport that fails
        on a write closes without reading them, and a put whose call returned would be lost —
        so read them now, before `_leave` serves them. The socket is still open here (the
        transport closes it after `connection_lost`); read without waiting, through a
        duplicate of its descriptor, up to what a socket buffer can hold and then some."""
        sock = self.transport.get_extra_info("socket") if self.transport is not None else None
        try:
            fd = os.dup(sock.fileno())
        except (AttributeError, OSError, ValueError):
            return
        try:
            with socket.socket(fileno=fd) as s:
                s.setblocking(False)
                got = 0
                while got < self.LEFT_READ_BYTES:
                    data = s.recv(1 << 20)
                    if not data:
                        break
                    self._buf += data
                    got += len(data)
        except OSError:
            pass   # nothing more (EAGAIN), or the connection's error: what was read is served

    def _leave(self) -> None:
        """The client is gone: serve the writes it sent before it left (complete frames already
        read; their replies go nowhere), then take back its reservations, leases and staged
        slots. A request of its still running on the pool gives back what it takes when it
        ends (`_undo_late`); a write behind it cannot depend on its reply, which never came."""
        d = self.d
        while True:
            try:
                body = self._take_frame()
            except P.FrameTooLarge:
                break
            if body is None:
                break
            try:
                msg = P.decode_body(body)
            except P.ProtocolError:
                continue
            if msg.get("op") not in self.LEFT_OPS:
                continue
            out = d._dispatch(self, msg)   # (inline ops: a reply, never a future)
            if isinstance(out, dict) and "error" in out:
                log.warning("client %d (pid %d) left; its %s failed: %s", self.id, self.pid, msg.get("op"),
                            out["error"].get("message"))
        self._buf.clear()
        nr, nl = d.store.drop_owner(self.id)   # only the store lock, never I/O: inline
        d.counters["reclaimed_reservations"] += nr
        d.counters["reclaimed_leases"] += nl
        if nr or nl:
            log.info("client %d (pid %d) went away: reclaimed %d reservations, %d leases",
                     self.id, self.pid, nr, nl)

    # -- frames -------------------------------------------------------------------------------
    def _take_frame(self) -> bytes | None:
        """The next complete frame's body, taken off the buffer; None while it is incomplete.
        Raises FrameTooLarge for a length over the limit (the stream cannot be resynchronised)."""
        buf = self._buf
        if len(buf) < 4:
            return None
        n = P.frame_length(bytes(buf[:4]), self.d.cfg.max_frame_bytes)
        if len(buf) < 4 + n:
            return None
        body = bytes(buf[4:4 + n])
        del buf[:4 + n]
        return body

    def _pump(self) -> None:
        """Serve every complete frame in the buffer, in order, until one must wait."""
        buf = self._buf
        while not self._busy and not self._paused_write and not self._closed and not self._ending:
            try:
                body = self._take_frame()
            except P.FrameTooLarge as e:
                self.d.counters["bad_requests"] += 1
                self._write(P.error_reply(None, e.code, str(e)))
                self._close()   # the stream cannot be resynchronised
                return
            if body is None:
                break
            self._frame_started = 0.0
            self._last = time.monotonic()
            try:
                msg = P.decode_body(body)
            except P.ProtocolError as e:
                self.d.counters["bad_requests"] += 1
                self._write(P.error_reply(None, e.code, str(e)))
                continue   # framing is intact: keep the connection
            out = self.d._dispatch(self, msg)
            if isinstance(out, dict):
                if msg.get("noreply") is True and msg.get("op") in _NOREPLY_OPS:
                    # (a request the client does not want answered: it was served inline)
                    if "error" in out:
                        log.warning("client %d (pid %d): %s failed: %s", self.id, self.pid, msg.get("op"),
                                    out["error"].get("message"))
                else:
                    self._write(out)
            else:
                self._wait_for(out, msg)
        if buf and not self._frame_started and not self._busy:
            self._frame_started = time.monotonic()
        self._set_reading()

    def _wait_for(self, fut, msg: dict) -> None:
        """A request runs on the worker pool: hold later frames until its reply is written, or
        until it passes request_timeout_s (then it is answered with a timeout, and whatever it
        takes when it finishes is given back)."""
        d = self.d
        loop = asyncio.get_running_loop()
        self._busy = True
        state = {"answered": False}
        req_id, op = msg.get("id"), msg.get("op")

        def finish(reply: dict | None) -> None:
            if state["answered"]:
                return
            state["answered"] = True
            timer.cancel()
            self._busy = False
            if reply is not None and not self._closed:
                self._write(reply)
            self._pump()

        def on_timeout() -> None:
            if state["answered"]:
                return
            finish(P.error_reply(req_id, "timeout", f"{op} took longer than {d.cfg.request_timeout_s}s"))

        def done(f) -> None:   # on a worker thread
            loop.call_soon_threadsafe(settle, f)

        def settle(f) -> None:
            d._inflight -= 1
            reply = f.result()   # _reply never raises
            if state["answered"] or self._closed or self._ending:
                d._undo_late(reply, self)   # nobody will use what it took
                if self._ending:
                    self._busy = False
                    self._end_if_empty()
                return
            finish(reply)

        timer = loop.call_later(d.cfg.request_timeout_s, on_timeout)
        fut.add_done_callback(done)

    def _write(self, reply: dict) -> None:
        if self._closed or self._ending or self.transport is None:
            return
        if "_obj" in reply or "_staged" in reply:
            reply = _strip_private(reply)
        try:
            self.transport.write(P.encode(reply))
        except (RuntimeError, OSError):
            self._close()

    def _set_reading(self) -> None:
        if self.transport is None or self._closed or self._ending:
            return
        want_pause = (self._paused_write or (self._stop_left is not None and self._stop_left <= 0)
                      or (self._busy and len(self._buf) >= self.BUSY_BUFFER_FRAMES * self.d.cfg.max_frame_bytes))
        if want_pause and not self._paused_read:
            self.transport.pause_reading()
            self._paused_read = True
        elif not want_pause and self._paused_read:
            self.transport.resume_reading()
            self._paused_read = False

    def stop_after_pending(self) -> None:
        """The daemon is stopping: serve the requests whose bytes had reached this socket by now
        (a client's put may have returned on a commit it sent unanswered), read nothing after."""
        if self._closed or self.transport is None:
            return
        try:
            fd = self.transport.get_extra_info("socket").fileno()
            self._stop_left = struct.unpack("i", fcntl.ioctl(fd, termios.FIONREAD, b"\0" * 4))[0]
        except (OSError, AttributeError, ValueError):
            self._stop_left = 0
        self._set_reading()

    @property
    def draining(self) -> bool:
        """Stopping, and requests sent before the stop are still to be read or served."""
        if self._closed or self._ending or self._stop_left is None:
            return False
        return self._busy or (self._stop_left > 0 and not self._paused_write)

    def _close(self) -> None:
        """The daemon ends this connection (an oversize or broken frame, a timeout, a failed
        write, a refused peer, a stop): every close the daemon makes goes through here.

        The rule (tierd/store/ownership.py, "Slots and the client's process"): a slot this
        connection staged, reserved or leased is handed on only once the client's end of the
        socket is closed — the client's process has exited, or it closed the socket itself, which
        tierd's client does only once no thread copies through the connection's slots. So a
        connection that holds slots is not closed here but half-closed: the daemon writes what
        it had to say and an end-of-stream (the client sees POLLRDHUP at once and stops using
        the connection), serves nothing more, and takes the slots back when the client's end
        closes (`connection_lost` → `_leave`). One that holds nothing closes at once."""
        if self._closed or self._ending or self.transport is None:
            return
        self._buf.clear()
        if self._holding() and self.transport.can_write_eof():
            self._ending = True
            self.d.ending_conns += 1
            if self._timer is not None:
                self._timer.cancel()
            self.transport.write_eof()
            if self._paused_read:   # keep reading: the client's end closing is the signal
                self.transport.resume_reading()
                self._paused_read = False
            return
        self._closed = True
        self.transport.close()

    def _holding(self) -> bool:
        """Whether the client may be copying through slots of this connection: it holds leases,
        reservations or staged slots, or a request runs for it (whatever that takes)."""
        return bool(self._busy or self.held or self.d.store.staged_slots(self.id))

    def _end_if_empty(self) -> None:
        """(Ended by the daemon.) Close at once once it holds nothing and nothing runs for it."""
        if self._ending and not self._closed and not self._holding():
            self._closed = True
            self.transport.close()

    def _abort(self) -> None:
        """Close at once, whatever the connection holds: the daemon is stopping, and its arena
        file is never served again (a restart maps a new one: tierd/store/keeping.py)."""
        if not self._closed and self.transport is not None:
            self._closed = True
            self.transport.close()

    # -- time limits --------------------------------------------------------------------------
    def _arm_timer(self) -> None:
        """One periodic check per connection (not one timer per frame): a frame started but not
        finished within frame_timeout_s, or no request for idle_timeout_s, closes it."""
        cfg = self.d.cfg
        period = min(cfg.frame_timeout_s, cfg.idle_timeout_s or cfg.frame_timeout_s) / 4
        self._timer = asyncio.get_running_loop().call_later(max(0.05, period), self._check_time)

    def _check_time(self) -> None:
        if self._closed:
            return
        cfg, now = self.d.cfg, time.monotonic()
        if self._frame_started and now - self._frame_started > cfg.frame_timeout_s:
            self._write(P.error_reply(None, "timeout", "frame incomplete"))
            self._close()
            return
        if cfg.idle_timeout_s and now - self._last > cfg.idle_timeout_s and not self._holding():
            # (a connection with open leases, reservations or staged slots is never idle: its
            # client may be copying through their slots right now, and closing it would
            # reclaim them)
            self._write(P.error_reply(None, "timeout", "connection idle"))
            self._close()
            return
        self._arm_timer()


def peer_credentials(sock: socket.socket) -> tuple[int, int, int]:
    """(pid, uid, gid) of the process at the other end of a Unix socket."""
    raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    return struct.unpack("3i", raw)


SO_PEERGROUPS = getattr(socket, "SO_PEERGROUPS", 59)   # Linux >= 4.13


def peer_groups(sock: socket.socket, pid: int, uid: int, gid: int) -> frozenset[int]:
    """Every group of the peer: its primary gid and its supplementary groups as they were
    when it connected (SO_PEERGROUPS), so an engine that joined group tierd
    (`usermod -aG`, a pod's supplementalGroups) counts as a member. Where the kernel cannot
    say (over 256 groups, an old kernel), the peer's /proc status (same PID namespace), then
    the user database's group list for its uid."""
    groups = {gid}
    try:
        raw = sock.getsockopt(socket.SOL_SOCKET, SO_PEERGROUPS, 1024)
        return frozenset(groups | set(struct.unpack(f"{len(raw) // 4}I", raw[:len(raw) // 4 * 4])))
    except OSError:
        pass
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("Groups:"):
                    if os.stat(f"/proc/{pid}").st_uid == uid:   # still that process
                        return frozenset(groups | {int(g) for g in line.split()[1:]})
                    break
    except (OSError, ValueError):
        pass
    try:
        import pwd
        return frozenset(groups | set(os.getgrouplist(pwd.getpwuid(uid).pw_name, gid)))
    except (KeyError, OSError):
        return frozenset(groups)


def _own_directory(d: str, mode: int, what: str, create_fix: str, fix: str) -> os.stat_result:
    """Make directory `d` (`what`: how messages name it) where it is missing, with `mode`;
    refuse, in one line ending in the fix, one that cannot be made, is no directory, is
    world-writable without the sticky bit (another user could replace what the daemon puts
    there) or that this user may not write. Returns its stat."""
    try:
        os.makedirs(d, mode=mode, exist_ok=True)
        st = os.stat(d)
    except OSError as e:
        raise ConfigError(f"{what} {d}: cannot create it ({e.strerror or e}; uid {os.geteuid()}); {create_fix}") from None
    if not stat.S_ISDIR(st.st_mode):
        raise ConfigError(f"{what} {d} is not a directory; {fix}")
    if st.st_mode & stat.S_IWOTH and not st.st_mode & stat.S_ISVTX:
        raise ConfigError(f"{what} {d} is world-writable (another user could replace or remove what the daemon "
                          f"puts there); {fix}")
    if not os.access(d, os.W_OK | os.X_OK, effective_ids=os.access in os.supports_effective_ids):
        raise ConfigError(f"{what} {d} (owner uid {st.st_uid}, mode {stat.S_IMODE(st.st_mode):04o}) is "
                          f"not writable by uid {os.geteuid()}; {fix}, or run the daemon as the directory's owner")
    return st


def check_socket_dir(path: str) -> None:
    """Make the socket's directory where it is missing; refuse one this user may not write, one
    other users could write, or one of another user (they could replace the socket and
    impersonate the daemon)."""
    d = os.path.dirname(os.path.abspath(path))
    st = _own_directory(d, 0o755, "socket directory",
                        "create it for the daemon's user (the systemd unit's RuntimeDirectory= makes /run/tierd; "
                        "by hand: install -d -m 0750 -o USER -g tierd DIR), or set socket (--socket) to a path in a "
                        "directory this user may write",
                        "set socket (--socket) to a path in a private directory of this user's own such as /run/tierd")
    if st.st_uid not in (os.geteuid(), 0):
        raise ConfigError(f"socket directory {d} belongs to uid {st.st_uid}, not this user ({os.geteuid()})")


@contextlib.contextmanager
def _extending_start(step_s: float, max_s: float):
    """Under systemd (Type=notify), ask for more start-up time while the block runs: reserving a
    large arena and re-adopting the last one's blocks take about a second per GB here, past
    the unit's TimeoutStartSec on a large node. Every step_s / 3 it asks for step_s more
    (EXTEND_TIMEOUT_USEC), up to max_s in all, so a start that hangs is still killed."""
    if not os.environ.get("NOTIFY_SOCKET"):
        yield
        return
    done = threading.Event()

    def extend() -> None:
        t0 = time.monotonic()
        while not done.wait(step_s / 3) and time.monotonic() - t0 < max_s:
            notify(f"EXTEND_TIMEOUT_USEC={int(step_s * 1e6)}\nSTATUS=starting: reserving and re-adopting the host tier")
    t = threading.Thread(target=extend, name="tierd-start", daemon=True)
    notify(f"EXTEND_TIMEOUT_USEC={int(step_s * 1e6)}")
    t.start()
    try:
        yield
    finally:
        done.set()
        t.join()


def prepare_arena_dir(path: str) -> None:
    """Make `arena_dir` where it is missing (mode 0750: the daemon's group reads it); refuse one
    other users may write without the sticky bit (they could remove or replace the arena)."""
    fix = ("set arena_dir to a directory on a tmpfs of this user's own (the default: /dev/shm/tierd for the "
           "service, /dev/shm/tierd-UID for a user's own daemon)")
    _own_directory(path, 0o750, "arena_dir", fix, fix)


class Daemon(Ops):
    """The daemon: one store served on one socket. Construction takes the instance lock first
    (tierd.instance) and touches no path before it holds it; `close` gives back everything it
    made, whatever stage construction or `run` reached."""

    def __init__(self, cfg: ServeConfig, flags: dict[str, Any] | None = None):
        self.cfg = cfg
        self.flags = flags or {}
        self.store = self.index = self.events = self.executor = self.metrics = self.metrics_at = None
        self._closed = False
        self.exit_status = 0     # what `tierd serve` exits with (2: the arena was lost)
        # what can be checked is checked before anything is made: the socket's path and
        # directory, the instance lock, then the metrics port (bound now, served once the store
        # is open), and only then the tiers
        problem = socket_path_problem(cfg.socket)
        if problem is not None:
            raise ConfigError(f"{problem}; set socket (--socket)")
        check_socket_dir(cfg.socket)
        try:
            self.lock = InstanceLock(cfg.socket + ".lock", cfg.socket)
        except OSError as e:
            raise ConfigError(f"socket {cfg.socket}: cannot create its lock file {cfg.socket}.lock "
                              f"({e.strerror or e}); the socket's directory must be one where this user can "
                              "make files (not under /proc or /sys, not read-only): set socket (--socket) to "
                              "a path such as /run/tierd/tierd.sock") from None
        try:
            if os.path.exists(cfg.socket) and _socket_alive(cfg.socket):
                # a daemon that predates the instance lock, or one on another lock path
                raise InstanceLockedError(f"another daemon is serving {cfg.socket}; stop it or choose "
                                          "another --socket")
            self.metrics = Metrics(self.stats)
            self.metrics_at = self.metrics.listen(cfg.metrics_addr) if cfg.metrics_addr else None
            with _extending_start(self.START_EXTEND_S, self.START_EXTEND_MAX_S):
                self._open()   # reserves the arena, re-adopts the last one, opens the disk tier
        except BaseException:
            self.close()
            raise

    def _open(self) -> None:
        cfg = self.cfg
        prepare_arena_dir(cfg.arena_dir)
        tag = hashlib.blake2b(os.path.abspath(cfg.socket).encode(), digest_size=6).hexdigest()
        self.arena_path = os.path.join(cfg.arena_dir, f"tierd-{os.geteuid()}-{tag}.host")
        if not cfg.store.host_keep:
            # left by a daemon that died (we hold its lock now); with host.keep the store
            # re-adopts its verified blocks instead
            for p in (self.arena_path, records_path(self.arena_path), records_path(self.arena_path) + ".ns"):
                try:
                    os.unlink(p)
                except FileNotFoundError:
                    pass
        fs = filesystem_type(cfg.arena_dir)
        if fs not in ("tmpfs", "hugetlbfs", "ramfs"):
            log.warning("arena_dir %s is on %s, not tmpfs: the host tier will be written back to "
                        "that filesystem; use /dev/shm or /run/tierd", cfg.arena_dir, fs or "an unknown filesystem")
        store_cfg = replace(cfg.store, host_shm_path=self.arena_path, host_shm_mode=0o660)
        self.store = TieredStore(store_cfg)
        # a shared lock on the arena while this daemon runs: `tierd clean` (tierd.leftovers)
        # removes only arenas nobody holds, whichever container it runs in
        self._live_fd = os.open(self.arena_path, os.O_RDONLY | os.O_CLOEXEC)
        fcntl.flock(self._live_fd, fcntl.LOCK_SH)
        # The shared lookup index: clients answer lookups from it without a request.
        self.index_path = os.path.join(cfg.arena_dir, f"tierd-{os.geteuid()}-{tag}.index")
        self.instance = int.from_bytes(os.urandom(8), "little")
        try:
            os.unlink(self.index_path)
        except FileNotFoundError:
            pass
        try:
            self.index = SharedIndex.create(self.index_path, self.store.host.capacity_bytes
                                            + (self.store.disk.capacity_bytes if self.store.disk else 0),
                                            self.instance)
        except OSError as e:
            log.warning("no shared lookup index (%s): clients will ask for every lookup", e)
            self.index = None
        else:
            self.store.attach_index(self.index)
            # with a remote tier, a miss in this node's table is not the answer: clients ask
            self.index.set_misses_final(self.store.remote is None)
        if cfg.events_addr:
            from .events import EventPublisher
            self.events = EventPublisher(cfg.events_addr, allow_remote=cfg.events_allow_remote)
            self.store.attach_events(self.events)
        self.gpu_descriptor = None
        if self.store.gpu is not None:
            try:
                self.gpu_descriptor = self.store.gpu.descriptor()   # CUDA IPC handle (None on CPU)
            except Exception as e:  # noqa: BLE001 -- clients then read HBM blocks from host copies
                log.warning("cannot export the HBM tier to clients (%s); they will use host copies", e)
        self.executor = ThreadPoolExecutor(32, thread_name_prefix="tierd-op")
        # staged slots one connection may hold, and all connections together (see Ops._op_stage)
        self.stage_limit_bytes = min(self.STAGE_LIMIT_BYTES, self.store.host.capacity_bytes // 8)
        self.stage_pool_bytes = int(self.store.host.capacity_bytes * self.STAGE_POOL_SHARE)
        self.conns: dict[int, _Conn] = {}
        self.uid_namespaces: dict[int, set[str]] = {}   # what each uid registered (see _register)
        self._next_conn = 0
        self._inflight = 0
        self.ending_conns = 0   # connections the daemon ended, waiting for their client's end to close
        self._server: asyncio.AbstractServer | None = None
        self._stop = None
        self.started = time.time()
        self.counters = {"connections_total": 0, "reclaimed_leases": 0, "reclaimed_reservations": 0,
                         "refused_peers": 0, "bad_requests": 0, "requests": 0, "reloads": 0}

    # -- stats --------------------------------------------------------------------------------
    def stats(self) -> dict:
        st = self.store.stats()
        st["daemon"] = {"version": __version__, "pid": os.getpid(), "uptime_s": time.time() - self.started,
                        "socket": self.cfg.socket, "clients": len(self.conns), "requests_running": self._inflight,
                        "ended_waiting": self.ending_conns,
                        **self.counters,
                        **(self.events.counters if self.events is not None else {}),
                        "settings": {k: setting_value(self.cfg, k) for k in sorted(RELOADABLE)},
                        "client_list": [{"id": c.id, "pid": c.pid, "uid": c.uid, "name": c.name, "ops": c.ops,
                                         "staged_slots": self.store.staged_slots(c.id),
                                         "ending": c._ending}
                                        for c in self.conns.values()]}
        return st

    # -- lifecycle ----------------------------------------------------------------------------
    STOP_REQUESTS_S = 20.0   # how long a stop waits for requests still running
    STAGE_LIMIT_BYTES = 256 << 20   # staged slots per connection (at most 1/8 of the arena)
    # staged slots of all connections together, as a share of the host tier: they hold no
    # cached block (a node's engines staging 1/8 each left the shared pool 60% of its blocks)
    STAGE_POOL_SHARE = 1 / 16
    START_EXTEND_S = 30.0    # under systemd, each start-up message asks this much more time ...
    START_EXTEND_MAX_S = 900.0   # ... for at most this long (a start that hangs is still killed)
    ARENA_CHECK_S = 1.0      # how often the heartbeat checks that the arena file is still there

    async def run(self) -> None:
        """Serve until SIGTERM/SIGINT, then stop. Whatever happens, `close` runs: the socket,
        arena and index are removed and the lock is given back."""
        try:
            await self._serve()
        finally:
            await self._stop_serving()
            await asyncio.get_running_loop().run_in_executor(None, self.close)

    async def _serve(self) -> None:
        loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        path = self.cfg.socket
        try:
            os.unlink(path)   # a dead daemon's (this daemon holds the socket's lock)
        except FileNotFoundError:
            pass
        self._server = await loop.create_unix_server(self._connection, path=path)
        os.chmod(path, self.cfg.socket_mode)
        metrics_at = self.metrics.start() if self.metrics_at is not None else None
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._stop.set)
        loop.add_signal_handler(signal.SIGHUP, lambda: loop.create_task(self.reload_async()))
        arena_every = max(1, round(self.ARENA_CHECK_S / BEAT_S))
        beats = 0

        def beat():
            nonlocal beats
            if self.index is not None:
                self.index.beat()
            self.store.refresh_health()   # lock-free: reads the disk's calls in flight only
            beats += 1
            if beats % arena_every == 0 and not self._arena_intact():
                return
            self._beat_handle = loop.call_later(BEAT_S, beat)
        beat()
        wd = watchdog_interval_s()
        self._wd_task = asyncio.create_task(self._watchdog(wd)) if wd else None
        status = f"serving {path}" + (f", metrics on {metrics_at[0]}:{metrics_at[1]}" if metrics_at else "") \
            + (f", events on {self.events.addr}" if self.events is not None else "")
        log.info("tierd %s %s (pid %d)", __version__, status, os.getpid())
        print(f"tierd: {status}", flush=True)
        notify(f"READY=1\nSTATUS={status}\nMAINPID={os.getpid()}")
        await self._stop.wait()

    def _arena_intact(self) -> bool:
        """The heartbeat's check that the host arena file is still the one this daemon serves.
        Removed (an operator's cleanup, another job emptying /dev/shm) or replaced, no new client
        can map it (`hello` hands out its path) while the metrics and the watchdog look healthy:
        the daemon stops with exit status 2 and one clear line, so systemd or the kubelet starts
        it again, on a new arena. Its blocks are not kept (the arena they were in is gone)."""
        try:
            st = os.stat(self.arena_path)
            same = (st.st_dev, st.st_ino) == self.store.host.arena.identity()
        except FileNotFoundError:
            same, st = False, None
        except OSError:
            return True   # cannot tell (a transient error): look again at the next check
        if same:
            return True
        what = "removed" if st is None else "replaced by another file"
        log.error("the host arena %s was %s under the running daemon; no new client can map it: "
                  "stopping (exit status 2) so that the service manager starts it again on a new arena",
                  self.arena_path, what)
        self.exit_status = 2
        self.store.config.host_keep = False   # (the store's own copy of the settings: nothing to keep)
        self._stop.set()
        return False

    async def _stop_serving(self) -> None:
        """No new connections; requests still running finish (or fail: the store refuses new
        work once closing) before the store closes; sync_on_stop is tried, and its failure
        logged, never a reason to skip the rest."""
        loop = asyncio.get_running_loop()
        notify("STOPPING=1\nSTATUS=stopping")
        log.info("stopping: no new connections; finishing %d requests and those already sent", self._inflight)
        if self._server is not None:
            self._server.close()
        if getattr(self, "_beat_handle", None) is not None:
            self._beat_handle.cancel()
        if getattr(self, "_wd_task", None) is not None:
            self._wd_task.cancel()
        for c in list(self.conns.values()):
            c.stop_after_pending()      # what clients sent before the stop is still served
        deadline = time.monotonic() + self.STOP_REQUESTS_S
        while (self._inflight or any(c.draining for c in list(self.conns.values()))) \
                and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        if self._inflight:
            log.warning("stopping with %d requests still running (a hung disk?); they will fail",
                        self._inflight)
        for c in list(self.conns.values()):
            c._abort()
        if self.cfg.sync_on_stop and self.store.disk is not None:
            try:
                n = await asyncio.wait_for(loop.run_in_executor(self.executor, self.store.sync),
                                           self.cfg.sync_on_stop_s)
                log.info("sync_on_stop: wrote %d blocks to disk", n)
            except asyncio.TimeoutError:
                log.error("sync_on_stop: the disk did not finish within sync_on_stop_s (%.0fs); stopping "
                          "without it", self.cfg.sync_on_stop_s)
            except Exception as e:  # noqa: BLE001 -- a failed sync must not skip the shutdown
                log.error("sync_on_stop failed (%s); host-only blocks are lost, disk blocks stay", e)

    def close(self) -> None:
        """Close the store (checkpoint, or without one when the disk hangs), the index, the
        events and metrics, remove the socket, arena and index files, and give back the
        instance lock. Idempotent; safe at any stage of construction."""
        if self._closed:
            return
        self._closed = True
        steps = [("store", lambda: self.store.close()),
                 ("index", lambda: self.index.close()),
                 ("events", lambda: self.events.close()),
                 ("metrics", lambda: self.metrics.close()),
                 ("executor", lambda: self.executor.shutdown(wait=False))]
        for what, step in steps:
            if getattr(self, what) is None:
                continue
            try:
                step()
            except Exception:  # noqa: BLE001 -- every other step still runs
                log.exception("stopping: closing the %s failed", what)
        if getattr(self, "_live_fd", None) is not None:
            os.close(self._live_fd)
            self._live_fd = None
        if self.lock.held:
            for path in (self.cfg.socket, getattr(self, "index_path", None)):
                if path is not None:
                    try:
                        os.unlink(path)
                    except FileNotFoundError:
                        pass
            self.lock.release()
        log.info("stopped")

    async def _watchdog(self, interval: float) -> None:
        while True:
            notify("WATCHDOG=1")
            await asyncio.sleep(interval)

    async def reload_async(self) -> None:
        """SIGHUP: read the config file without blocking the event loop (aiofiles: a slow or
        hung filesystem stalls this task, not the clients), then `reload`."""
        data = None
        path = self.cfg.config_path
        if path is not None:
            try:
                async with aiofiles.open(path, "rb") as f:
                    data = await f.read()
            except OSError as e:
                log.error("reload refused, keeping the running settings: cannot read %s: %s", path,
                          e.strerror or e)
                return
        self.reload(data)

    def reload(self, data: bytes | None = None) -> None:
        """Re-read the config file (flags still override it) and apply the settings that can
        change live (RELOADABLE); others need a restart and are reported."""
        try:
            new = load_serve_config(self.cfg.config_path, self.flags, data=data)
        except TierdError as e:
            log.error("reload refused, keeping the running settings: %s", e)
            return
        changed, ignored = [], []
        for key in SERVE_KEYS:
            old_v, new_v = setting_value(self.cfg, key), setting_value(new, key)
            if old_v != new_v:
                (changed if key in RELOADABLE else ignored).append(f"{key}: {old_v!r} -> {new_v!r}")
        self.store.reconfigure(new.store)
        self.counters["reloads"] += 1
        for key in RELOADABLE:
            _, attr, _ = SERVE_KEYS[key]
            setattr(self.cfg.store, attr, setting_value(new, key))
        log.info("reloaded %s: %s", self.cfg.config_path or "(no config file)", "; ".join(changed) or "nothing changed")
        if ignored:
            hint = ""
            if any(i.startswith("disk.bytes:") for i in ignored):
                hint += (" (disk.bytes at the next start: a larger size adds slab files and keeps every block on "
                         "disk; a smaller one drops the last slab files and their blocks)")
            if any(i.startswith("disk.slab_bytes:") for i in ignored):
                hint += " (disk.slab_bytes applies only to a new disk directory)"
            log.warning("reload: these need a restart and were not applied: %s%s", "; ".join(ignored), hint)

    # -- connections ----------------------------------------------------------------------------
    def _allowed(self, uid: int, groups: frozenset[int]) -> bool:
        """Its own uid, root, allowed_uids, and members of its own group (the socket's: an
        engine user added to group tierd) or of allowed_gids."""
        return (uid in (os.geteuid(), 0) or uid in self.cfg.allowed_uids or os.getegid() in groups
                or not groups.isdisjoint(self.cfg.allowed_gids))

    def _connection(self) -> "_Conn":
        self._next_conn += 1
        return _Conn(self, self._next_conn)

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
            quick = op == "reserve" or (op == "acquire" and msg.get("gpu") is not True) or self._quick(op, msg)
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

    # -- ops (run on worker threads) -------------------------------------------------------------


def _strip_private(reply: dict) -> dict:
    return {k: v for k, v in reply.items() if not k.startswith("_")}


def _socket_alive(path: str) -> bool:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(1)
        try:
            s.connect(path)
            return True
        except OSError:
            return False


def log_sources(cfg: ServeConfig) -> None:
    for key in SERVE_KEYS:
        log.info("setting %s = %r (%s)", key, setting_value(cfg, key), cfg.sources.get(key, "default"))


def serve(config_path: str | None = None, flags: dict[str, Any] | None = None) -> int:
    """Load the settings, log where each came from, and run the daemon until SIGTERM."""
    cfg = load_serve_config(config_path, flags)
    log_sources(cfg)
    run = _loop_runner(cfg.event_loop)
    daemon = Daemon(cfg, flags)
    run(daemon.run())
    _exit_past_stuck_threads(daemon.exit_status)
    return daemon.exit_status


def _exit_past_stuck_threads(status: int = 0, grace_s: float = 2.0) -> None:
    """A thread still stuck in a disk call (a hung disk) would keep the interpreter from
    exiting; the daemon has closed and removed everything by now, so leave at once."""
    deadline = time.monotonic() + grace_s
    for t in threading.enumerate():
        if t is not threading.main_thread() and not t.daemon:
            t.join(max(0.0, deadline - time.monotonic()))
    stuck = [t.name for t in threading.enumerate() if t is not threading.main_thread() and not t.daemon
             and t.is_alive()]
    if stuck:
        log.warning("exiting with %d threads stuck in I/O (%s)", len(stuck), ", ".join(stuck[:4]))
        logging.shutdown()
        sys.stdout.flush()
        os._exit(status)


def _loop_runner(choice: str):
    """How to run the daemon's event loop (setting `event_loop`: auto, uvloop or asyncio): on
    uvloop (libuv, a faster loop) where it is installed, else on asyncio's own."""
    if choice not in ("auto", "uvloop", "asyncio"):
        raise ConfigError(f"event_loop = {choice!r}: use auto, uvloop or asyncio")
    if choice != "asyncio":
        try:
            import uvloop
        except ImportError:
            if choice == "uvloop":
                raise ConfigError("event_loop = 'uvloop' but uvloop is not installed (pip install uvloop)") from None
        else:
            log.info("event loop: uvloop %s", uvloop.__version__)
            return uvloop.run
    log.info("event loop: asyncio")
    return asyncio.run
