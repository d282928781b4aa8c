"""One client connection, the daemon's side (`_Conn`): the peer's credentials and admission,
frames in and replies out in request order, back-pressure, time limits, the half-close that keeps
a connection's slots its own until its client's end closes, and what the daemon takes back when
the client leaves. It never serves a request itself: `Daemon._dispatch` (tierd/server_dispatch.py)
does, and the daemon (tierd/server.py) owns the connections. Nothing here may block the event
loop or let one client's input touch another's connection."""

from __future__ import annotations

import asyncio
import fcntl
import logging
import os
import socket
import struct
import termios
import time
from typing import TYPE_CHECKING

from . import protocol as P

if TYPE_CHECKING:
    from .server import Daemon

log = logging.getLogger("tierd.server")

# ops a client may send unanswered ("noreply": true): a failure is logged, never written back
# (an acquire so sent is a quiet lease: see `_Conn.quiet`)
_NOREPLY_OPS = {"release", "hits", "acquire"}


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
        # Quiet leases: an `acquire` sent with `noreply` (a client's pipelined lease), served on
        # the event loop or not at all, never answered; named by its request's id, which a
        # `release` gives as `of`. Request id -> lease id, for those that leased something.
        self.quiet: dict[int, int] = {}
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


def _strip_private(reply: dict) -> dict:
    return {k: v for k, v in reply.items() if not k.startswith("_")}


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
