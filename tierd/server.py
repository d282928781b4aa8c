"""`tierd serve`: the daemon. Owns one TieredStore and serves it on a Unix socket: its start
(instance lock, directories, arena, shared index), its event loop (socket, signals, heartbeat,
reload), its stop and its close, and the connections it holds.

The event loop only reads and writes frames; a store call that may wait on I/O runs on a worker
thread, so a disk read for one client never stalls another. Reservations and leases belong to
the connection that made them and are reclaimed when it goes. The daemon must never crash on a
client's input and never let one client name another's slots. Its neighbours: one connection's
framing and state (tierd/server_conn.py), which thread serves a request and how it is answered
(tierd/server_dispatch.py), one handler per op (tierd/server_ops.py), the checks of its
directories (tierd/server_dirs.py).
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
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import Any

import aiofiles

from . import __version__
from .arena import filesystem_type
from .config import (RELOADABLE, SERVE_KEYS, ServeConfig, load_serve_config, setting_value,
                     socket_path_problem)
from .errors import ConfigError, InstanceLockedError, TierdError
from .index import BEAT_S, SharedIndex
from .instance import InstanceLock
from .metrics import Metrics
from .sdnotify import notify, watchdog_interval_s
from .server_conn import (SO_PEERGROUPS, _NOREPLY_OPS, _Conn, _strip_private,  # noqa: F401
                          peer_credentials, peer_groups)
from .server_dirs import _own_directory, check_socket_dir, prepare_arena_dir  # noqa: F401
from .server_dispatch import _INLINE_OPS, _REMOTE_OPS, Dispatch  # noqa: F401
from .server_ops import Ops
from .store import TieredStore
from .tiers.host import records_path

log = logging.getLogger("tierd.server")


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


class Daemon(Dispatch, Ops):
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
