"""Regression cases for the third review's findings (shared notes, review-2026-12c): a client's
process outlives its connection, a lease outlives a daemon, a stage outlives its client, an arena
file outlives nothing. Each runs against a real daemon and asserts what users rely on: no block
of one client read back with another's bytes, no lost lease ending quietly, no slot or writer
leaked, a daemon that cannot serve does not look healthy."""

import os
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from tierd import protocol as P
from tierd.client import Client
from tierd.errors import LeaseError, RequestTooLargeError

from .daemon import ROOT, SMALL_TOML, DaemonProc
from .helpers import block_for, chain, make_ns, wait_for
from .test_review_edges import HANGING_TOML, assert_exact, daemon_staged, put_all, requests_done


def daemon_stats(d) -> dict:
    with Client(d.socket, stage_bytes=0, data_plane=False) as c:
        return c.stats()


def fill(res, value: int) -> None:
    for b in res.buffers:
        if b is not None:
            b[:] = value


# -- F-C: a close the daemon makes while another thread of the client copies ------------------

@pytest.mark.parametrize("loop", ["uvloop", "asyncio"])
def test_a_close_the_daemon_makes_keeps_the_slots_until_the_client_lets_go(tmp_path, loop):
    """One client, two threads: thread 1 copies into staged slots; thread 2's request makes the
    daemon end the connection (a frame over max_frame_bytes, as a client that does not check
    the limits would send). Another client's puts meanwhile must never get those slots: thread
    1's late bytes (0xAB) must land in no other client's block. Once thread 1 lets go, the
    daemon takes the slots back."""
    if loop == "uvloop":
        pytest.importorskip("uvloop")
    d = DaemonProc(tmp_path, host_bytes="2MiB", toml=f'event_loop = "{loop}"\n' + SMALL_TOML).start()
    ns = make_ns()
    try:
        a = Client(d.socket, name="a", stage_bytes=1 << 20)
        keys = chain(ns, 1, 4)
        res = a.reserve(ns, keys)                      # staged slots: no request
        assert res._staged is not None and res.num_reserved == 4
        started, go = threading.Event(), threading.Event()

        def copier():                                   # thread 1: writes, pauses, writes on
            fill(res, 0x11)
            started.set()
            go.wait(30)
            fill(res, 0xAB)

        t = threading.Thread(target=copier)
        t.start()
        started.wait(30)
        with a._lock:                                   # thread 2: a frame the daemon refuses
            a._sock.sendall(P.HEADER.pack(a.limits["max_frame_bytes"] + 1))
        wait_for(lambda: not a._link.intact(), what="the daemon to end a's connection")
        assert daemon_stats(d)["daemon"]["ended_waiting"] == 1
        # another client fills the host tier with its own blocks meanwhile
        with Client(d.socket, name="b", stage_bytes=0) as b:
            theirs = chain(ns, 2, 120)                  # 2 MiB of 16 KiB slots: every free slot
            put_all(b, ns, theirs)
        go.set()
        t.join(30)
        stored = assert_exact(d, ns, theirs)            # never 0xAB
        assert stored > 60
        with pytest.raises(LeaseError):
            a.commit(res)                               # lost: nothing of a's is stored
        wait_for(lambda: daemon_stats(d)["daemon"]["ended_waiting"] == 0,
                 what="the daemon to take the slots back once a let go")
        assert daemon_staged(d) == 0
        assert a.lookup(ns, keys) == 0                  # a reconnects; its block was never stored
        mine = chain(ns, 3, 4)
        a.put(ns, mine, [block_for(ns, k) for k in mine])
        assert assert_exact(d, ns, mine) == 4
        a.close()
    finally:
        assert d.stop() == 0


def events_toml(tmp_path) -> str:
    return (f'events_addr = "ipc://{tmp_path}/ev"\nevents_token_ids = true\n' + SMALL_TOML
            + "[limits]\nmax_frame_bytes = 65536\n")


def test_a_put_over_the_daemons_limits_is_split_and_other_requests_refused_before_sending(tmp_path):
    """A put whose request would pass the daemon's max_frame_bytes (token ids in KV events make
    it large) is split into puts that fit; a reserve over the limit is refused by the client
    before anything is sent: the connection stays up either way."""
    d = DaemonProc(tmp_path, toml=events_toml(tmp_path), host_bytes="16MiB").start()
    ns = make_ns(block_tokens=256, num_layers=1, num_kv_heads=1, head_dim=16)
    try:
        with Client(d.socket, stage_bytes=0) as c:
            assert c.events and c.limits["max_frame_bytes"] == 65536
            toks = np.random.default_rng(5).integers(1000, 32000, 200 * 256)
            keys = ns.block_keys(toks)
            assert len(P.encode({"op": "reserve", "keys": keys, "tokens": [int(t) for t in toks]})) > 65536
            assert c.put(ns, keys, [block_for(ns, k) for k in keys], token_ids=[int(t) for t in toks]) == 200
            assert c.lookup(ns, keys) == 200 and c.reconnects == 0
            assert assert_exact(d, ns, keys) == 200
            more = ns.block_keys(toks + 1)
            with pytest.raises(RequestTooLargeError, match="max_frame_bytes"):
                c.reserve(ns, more, token_ids=[int(t) + 1 for t in toks])
            assert c._link.intact() and c.lookup(ns, more) == 0 and c.reconnects == 0
    finally:
        assert d.stop() == 0


# -- W6: a lease (and a reservation) held across a restart ------------------------------------

@pytest.mark.parametrize("how", ["SIGTERM", "SIGKILL"])
def test_a_lease_held_across_a_restart_raises_when_the_with_ends(tmp_path, how):
    """The README's zero-copy read, `with store.acquire(...) as lease:`, held while the daemon
    restarts: leaving the `with` raises LeaseError (its bytes may be another block's), and a
    reservation made before the restart cannot be committed."""
    d = DaemonProc(tmp_path).start()
    ns = make_ns()
    keys = chain(ns, 7, 8)
    c = Client(d.socket, stage_bytes=0)
    w = Client(d.socket)                               # a writer with staged slots
    try:
        c.put(ns, keys, [block_for(ns, k) for k in keys])
        res = c.reserve(ns, chain(ns, 8, 2))
        staged = w.reserve(ns, chain(ns, 9, 2))
        assert res.num_reserved == 2 and staged._staged is not None
        with pytest.raises(LeaseError, match="lost"):
            with c.acquire(ns, keys) as lease:
                assert len(lease) == 8
                assert all(np.array_equal(b, block_for(ns, k)) for b, k in zip(lease.buffers, keys))
                if how == "SIGTERM":
                    assert d.stop() == 0
                else:
                    d.kill()
                d.start()
                _ = [int(b[0]) for b in lease.buffers]     # read on: nothing says so until the end
        for r in (res, staged):
            fill(r, 0xAB)
        with pytest.raises(LeaseError):
            c.commit(res)
        with pytest.raises(LeaseError):
            w.commit(staged)
        lease = c.acquire(ns, keys)                    # the new daemon: re-adopted or not, exact
        assert all(np.array_equal(b, block_for(ns, k)) for b, k in zip(lease.buffers, keys))
        lease.release()                                # confirms: still standing
        assert c.lookup(ns, chain(ns, 8, 2)) == 0 and c.lookup(ns, chain(ns, 9, 2)) == 0
    finally:
        c.close()
        w.close()
        assert d.stop() == 0


# -- F-B: a stage that reaches the store after its client left --------------------------------

def lone_share(d, ns) -> int:
    """Staged slots a lone writer gets when it asks for as many as a request may name."""
    with Client(d.socket, stage_bytes=0, name="probe") as c:
        c.register(ns)
        return len(c._call("stage", ns=ns.name, n=4096)["slots"])


def test_a_stage_that_outlives_its_client_leaves_no_writer_behind(tmp_path):
    """Host RAM full of blocks without disk copies and a disk whose writes hang: clients ask
    for staged slots (which needs a write down) and leave before the answer. When the disk
    heals and the stages finish, nothing they made stays: no staged slot, and no departed
    client counted as a writer, so a lone writer gets the share it got before."""
    faults = tmp_path / "faults"
    d = DaemonProc(tmp_path, toml=HANGING_TOML + f'fault_file = "{faults}"\n').start()
    ns = make_ns()
    try:
        before = lone_share(d, ns)
        assert before > 8
        with Client(d.socket, stage_bytes=0) as b:
            put_all(b, ns, chain(ns, 2, 600))           # 8 MiB host, 512 slots: full, all dirty
        faults.write_text("write=hang:60")
        for i in range(3):
            x = Client(d.socket, stage_bytes=0, name=f"x{i}")
            x.register(ns)
            with x._lock:
                assert x._send_deferred({"op": "stage", "ns": ns.name, "n": 8})
                x._disconnect()                          # gone before the reply
        wait_for(lambda: daemon_stats(d)["daemon"]["requests_running"] >= 1, what="the stages to wait on the disk")
        time.sleep(0.3)
        faults.write_text("")
        wait_for(lambda: requests_done(d), timeout_s=60, what="the late stages to end")
        assert daemon_staged(d) == 0
        assert lone_share(d, ns) == before, "a departed client is still counted as a staging writer"
    finally:
        faults.write_text("")
        assert d.stop() == 0


# -- W7: the arena file removed under a running daemon ------------------------------------------

@pytest.mark.parametrize("how", ["removed", "replaced"])
def test_a_daemon_whose_arena_file_is_gone_exits_non_zero(tmp_path, how):
    d = DaemonProc(tmp_path).start()
    ns = make_ns()
    keys = chain(ns, 1, 4)
    with Client(d.socket) as c:
        c.put(ns, keys, [block_for(ns, k) for k in keys])
    arena = next(p for p in (tmp_path / "arena").iterdir() if p.name.endswith(".host"))
    t0 = time.monotonic()
    arena.unlink()
    if how == "replaced":
        arena.write_bytes(b"\0" * 4096)
    try:
        rc = d.proc.wait(15)
    except subprocess.TimeoutExpired:
        d.kill()
        raise AssertionError("the daemon ran on without its arena file") from None
    d._logf.close()
    assert rc == 2 and time.monotonic() - t0 < 15
    log = d.log.read_text()
    assert f"the host arena {arena} was {'removed' if how == 'removed' else 'replaced'}" in log
    assert "kept the host arena" not in log
    d.start()                                           # the service manager's restart serves again
    try:
        with Client(d.socket) as c:
            assert c.lookup(ns, keys) in (0, 4)
            c.put(ns, keys, [block_for(ns, k) for k in keys])
            assert assert_exact(d, ns, keys) == 4
    finally:
        assert d.stop() == 0


def test_the_default_arena_dir_is_a_directory_of_the_daemons_own():
    from tierd.config import ServeConfig
    d = ServeConfig().arena_dir
    assert d.startswith("/dev/shm/tierd") and d != "/dev/shm"


# -- W13: ping says a stopped daemon is dead within its timeout ---------------------------------

def test_ping_and_stats_give_up_within_their_timeout_and_map_no_arena(tmp_path):
    d = DaemonProc(tmp_path).start()
    try:
        with Client(d.socket, data_plane=False) as c:
            assert c._arena is None and c.ping()["version"]
        cli = [sys.executable, "-m", "tierd"]
        ok = subprocess.run([*cli, "ping", "--socket", d.socket], cwd=ROOT, capture_output=True, text=True,
                            timeout=60)
        assert ok.returncode == 0, ok.stderr
        d.signal(signal.SIGSTOP)
        try:
            for cmd in (["ping", "--timeout", "1"], ["stats", "--timeout", "1"]):
                t0 = time.monotonic()
                r = subprocess.run([*cli, *cmd, "--socket", d.socket], cwd=ROOT, capture_output=True,
                                   text=True, timeout=60)
                took = time.monotonic() - t0
                assert r.returncode != 0 and "timed out" in r.stderr and took < 10, (cmd, took, r.stderr)
                assert "Traceback" not in r.stderr
            bad = subprocess.run([*cli, "ping", "--timeout", "-1", "--socket", d.socket], cwd=ROOT,
                                 capture_output=True, text=True, timeout=60)
            assert bad.returncode == 2 and "above 0" in bad.stderr
        finally:
            d.signal(signal.SIGCONT)
    finally:
        assert d.stop() == 0


# -- S-3: `tierd clean` and a daemon still starting ----------------------------------------------

def test_clean_never_removes_the_arena_of_a_store_that_is_starting_or_running(tmp_path):
    """A store without host.keep (no records lock) whose daemon has not yet taken its own lock
    on the arena — or a daemon in another PID namespace, whose mappings `clean` cannot see:
    the arena is locked from the instant it exists, so `clean` refuses it; once the store
    closed, the arena is gone with it and clean finds nothing."""
    from tierd import TieredStore, leftovers
    from .helpers import small_config
    shm = tmp_path / "shm"
    shm.mkdir()
    path = shm / f"tierd-{os.geteuid()}-0123456789ab.host"
    store = TieredStore(small_config(host_shm_path=str(path), host_keep=False))
    try:
        (group,) = leftovers.find([str(shm)])
        assert group.live and "locked" in group.live_because     # (this process's own maps are not counted)
        with pytest.raises(RuntimeError, match="locked"):
            leftovers.remove(group)
        assert path.exists()
    finally:
        store.close()
    assert leftovers.find([str(shm)]) == []


# -- W17(g): engines reconnect promptly when the daemon comes back ------------------------------

def test_a_link_backing_off_reconnects_as_soon_as_the_daemon_is_back(tmp_path):
    """A connector's link that lost its daemon backs off (up to 30 s of recomputes); a daemon
    that comes back (a rolled pod, a restart) binds its socket anew, and the link connects at
    its next request instead of waiting the backoff out."""
    pytest.importorskip("torch")
    from tierd.connectors.link import StoreLink
    d = DaemonProc(tmp_path).start()
    link = StoreLink(f"unix://{d.socket}", retry_after_s=20.0, timeout_s=2.0)
    ns = make_ns()
    try:
        store = link.get()
        assert store is not None and store.lookup(ns, chain(ns, 1, 2)) == 0
        assert d.stop() == 0
        with pytest.raises(Exception):
            store.lookup(ns, chain(ns, 1, 2))
        link.failed(RuntimeError("gone"), "lookup")          # as a connector reports a failed call
        assert link.get() is None                             # backing off: recompute
        d.start()
        t0 = time.monotonic()
        store = wait_for(link.get, timeout_s=5, what="the link to come back")
        assert time.monotonic() - t0 < 5 and store.lookup(ns, chain(ns, 1, 2)) == 0
    finally:
        link.close() if hasattr(link, "close") else None
        if d.alive():
            assert d.stop() == 0


# -- a client that leaves while the daemon still has replies for it ----------------------------

@pytest.mark.parametrize("loop", ["uvloop", "asyncio"])
def test_a_put_sent_before_the_client_left_lands_even_when_its_replies_could_not(tmp_path, loop):
    """A client's put returns once its request is sent (a staged put is not waited for), so an
    engine may exit right after it. Here the daemon still has replies for that client it cannot
    deliver (the client never read them: its receive buffer is full, the daemon stopped reading
    behind them), so the daemon's next write fails (EPIPE) before it has read the put. The put
    must still be served: another client reads every block of it back, bit-exact."""
    if loop == "uvloop":
        pytest.importorskip("uvloop")
    d = DaemonProc(tmp_path, host_bytes="16MiB", toml=f'event_loop = "{loop}"\n' + SMALL_TOML).start()
    ns = make_ns()
    try:
        a = Client(d.socket, name="leaver", stage_bytes=1 << 20)
        keys = chain(ns, 7, 4)
        res = a.reserve(ns, keys)
        assert res._staged is not None and res.num_reserved == 4
        for k, b in zip(keys, res.buffers):
            b[:] = block_for(ns, k)
        with a._lock:   # requests whose replies the client never reads: the daemon's writes back up
            frames = b"".join(P.encode({"op": "stats", "id": 10_000 + i}) for i in range(400))
            a._send(frames, time.monotonic() + 10)
        time.sleep(0.5)
        a.commit(res)                      # sent; not waited for
        a._sock.close()                    # the process "exits": its end of the socket closes
        with Client(d.socket, stage_bytes=0, name="reader") as r:
            wait_for(lambda: r.lookup(ns, keys) == len(keys), timeout_s=10, what="the put to land")
        assert assert_exact(d, ns, keys) == len(keys)
    finally:
        assert d.stop() == 0
