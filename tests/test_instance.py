"""One daemon per arena: a second `tierd serve` on a live daemon's socket, arena or disk
refuses, exits non-zero and leaves every byte of the first daemon as it was; a stopped daemon
leaves nothing behind, whatever its disk is doing."""

import os
import signal

import pytest

from tierd.client import Client, DaemonUnavailableError

from .daemon import DaemonProc
from .helpers import assert_exact, chain, make_ns, put_chain, wait_for




def second_daemon(tmp_path, first: DaemonProc, *, same_disk: bool) -> DaemonProc:
    """A second daemon on the first one's socket and arena directory (as a unit plus a manual
    start would be), with its own disk directory or the first one's."""
    (tmp_path / "second").mkdir()
    other = DaemonProc(tmp_path / "second")
    other.args[other.args.index("--socket") + 1] = first.socket
    other.env["TIERD_ARENA_DIR"] = first.env["TIERD_ARENA_DIR"]
    if same_disk:
        other.args[other.args.index("--disk-path") + 1] = first.disk
    return other


def refused(other: DaemonProc) -> str:
    with pytest.raises(RuntimeError, match="did not start"):
        other.start(timeout_s=60)
    assert other.proc.wait(30) != 0
    other._logf.close()
    return other.log.read_text()


@pytest.mark.parametrize("same_disk", [False, True], ids=["own-disk", "same-disk"])
def test_a_second_daemon_on_a_live_socket_changes_nothing_of_the_first(tmp_path, same_disk):
    (tmp_path / "first").mkdir()
    first = DaemonProc(tmp_path / "first").start()
    ns = make_ns()
    keys = chain(ns, 1, 6)
    try:
        old = Client(first.socket)
        assert put_chain(old, ns, keys) == 6
        wait_for(lambda: old.stats()["tiers"]["host"]["keep_pending"] == 0, what="host block records")
        arena_files = sorted(os.listdir(first.env["TIERD_ARENA_DIR"]))
        stats = {p: os.stat(os.path.join(first.env["TIERD_ARENA_DIR"], p)).st_ino for p in arena_files}

        log = refused(second_daemon(tmp_path, first, same_disk=same_disk))
        assert "another daemon is serving" in log
        assert "Traceback" not in log and "another daemon is serving" in log.splitlines()[-1]

        # nothing of the first daemon's was replaced or removed
        assert sorted(os.listdir(first.env["TIERD_ARENA_DIR"])) == arena_files
        for p, ino in stats.items():
            assert os.stat(os.path.join(first.env["TIERD_ARENA_DIR"], p)).st_ino == ino
        assert os.path.exists(first.socket)

        # old and new clients read exactly what was stored, and see each other's puts
        assert_exact(old, ns, keys)
        more = chain(ns, 2, 4)
        with Client(first.socket) as new:
            assert_exact(new, ns, keys)
            assert put_chain(new, ns, more) == 4
        assert_exact(old, ns, more)

        # and what was synced survives kill -9 and a restart, exact
        assert old.sync() == 10
        old.close()
        first.kill()
        first.start()
        with Client(first.socket) as c:
            assert_exact(c, ns, keys)
            assert_exact(c, ns, more)
    finally:
        if first.alive():
            assert first.stop() == 0


def test_a_second_daemon_on_a_live_disk_directory_touches_nothing(tmp_path):
    (tmp_path / "first").mkdir()
    first = DaemonProc(tmp_path / "first").start()
    ns = make_ns()
    keys = chain(ns, 3, 5)
    try:
        with Client(first.socket) as c:
            put_chain(c, ns, keys)
            c.sync()
        (tmp_path / "second").mkdir()
        other = DaemonProc(tmp_path / "second")   # its own socket and arena, the first's disk
        other.args[other.args.index("--disk-path") + 1] = first.disk
        log = refused(other)
        assert "in use by another tierd store" in log
        assert not os.path.exists(other.socket)
        assert os.listdir(other.env["TIERD_ARENA_DIR"]) == [], "the refused daemon left files behind"
        with Client(first.socket) as c:
            assert_exact(c, ns, keys)
    finally:
        assert first.stop() == 0


def test_a_client_refuses_an_arena_file_that_is_not_its_daemons(daemon):
    ns = make_ns()
    keys = chain(ns, 4, 3)
    with Client(daemon.socket) as c:
        put_chain(c, ns, keys)
    arena_dir = daemon.env["TIERD_ARENA_DIR"]
    (host,) = [p for p in os.listdir(arena_dir) if p.endswith(".host")]
    path = os.path.join(arena_dir, host)
    size = os.path.getsize(path)
    # someone replaces the file at the daemon's arena path (the daemon keeps its own open)
    os.rename(path, path + ".moved")
    with open(path, "wb") as f:
        f.truncate(size)
    try:
        with pytest.raises(DaemonUnavailableError, match="not the one the daemon"):
            Client(daemon.socket, retries=0)
    finally:
        os.replace(path + ".moved", path)
    with Client(daemon.socket) as c:
        assert_exact(c, ns, keys)


@pytest.mark.slow
@pytest.mark.parametrize("fault", ["write=EIO flush=EIO meta=EIO", "all=hang:300"], ids=["failing", "hanging"])
def test_a_daemon_stopped_with_a_bad_disk_exits_0_and_leaves_only_its_kept_arena(tmp_path, fault):
    faults = tmp_path / "faults"
    # a stop's sync gives up on the hanging disk after sync_on_stop_s (60 s by default)
    toml = f"""
sync_on_stop_s = 5.0
[host]
slab_bytes = "1MiB"
[disk]
slab_bytes = "4MiB"
file_bytes = "32MiB"
fault_file = "{faults}"
stall_s = 1.0
"""
    d = DaemonProc(tmp_path, toml=toml).start()
    ns = make_ns()
    with Client(d.socket) as c:
        put_chain(c, ns, chain(ns, 5, 6))
    faults.write_text(fault)
    d.signal(signal.SIGTERM)
    assert d.proc.wait(120) == 0
    d._logf.close()
    assert not os.path.exists(d.socket)
    # nothing but the host arena and its block records, kept for the next start (host.keep)
    left = sorted(os.listdir(d.env["TIERD_ARENA_DIR"]))
    assert [f.split(".", 1)[1] for f in left] == ["host", "host.rec", "host.rec.ns"], left
