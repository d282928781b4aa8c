"""`tierd serve` as a real process: clients, faults, restarts, bad input."""

import os
import signal
import socket
import struct
import subprocess
import sys
import time

import msgpack
import pytest

import tierd
from tierd.client import Client, DaemonUnavailableError
from tierd.errors import LeaseError, UnknownNamespaceError

from .daemon import ROOT, SMALL_TOML, DaemonProc
from .helpers import assert_exact, block_for, chain, make_ns, put_chain




def wait_for(pred, timeout_s=10.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(0.05)
    return pred()


def test_client_round_trip_through_the_daemon(daemon):
    c = tierd.connect(daemon.url)
    try:
        assert isinstance(c, Client)
        spaces = [make_ns(), make_ns(model="b", kv_dtype="bfloat16", num_layers=3)]
        for i, ns in enumerate(spaces):
            keys = chain(ns, i, 6)
            assert put_chain(c, ns, keys) == 6
            assert put_chain(c, ns, keys) == 0
            assert c.lookup(ns, keys + chain(ns, 99, 1)) == 6
            assert_exact(c, ns, keys)
            with c.acquire(ns, keys) as lease:
                assert lease.tiers == ["host"] * 6
                with pytest.raises(ValueError):
                    lease.buffers[0][0] = 1  # read-only views
        assert c.sync() == 12
        assert c.flush(tier="host") == 12
        assert c.where(spaces[0], chain(spaces[0], 0, 6)) == ["disk"] * 6
        assert_exact(c, spaces[0], chain(spaces[0], 0, 6))
        st = c.stats()
        assert st["daemon"]["clients"] == 1 and st["leases"] == 0
    finally:
        c.close()


def test_zero_copy_reserve_commit_through_the_daemon(daemon):
    ns = make_ns()
    keys = chain(ns, 5, 4)
    with Client(daemon.socket) as c:
        res = c.reserve(ns, keys)
        assert res.status == ["reserved"] * 4
        for k, buf in zip(keys, res.buffers):
            buf[:] = block_for(ns, k)
        assert c.lookup(ns, keys) == 0
        assert c.commit(res) == 4
        assert_exact(c, ns, keys)


@pytest.mark.slow
def test_eight_client_processes_mixed_ops_bit_exact(daemon):
    procs = [subprocess.Popen([sys.executable, "-m", "tests.client_worker", daemon.socket, "mixed", str(i), "1000"],
                              cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for i in range(8)]
    outs = [p.communicate(timeout=600) for p in procs]
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, out + err
        assert out.startswith("OK 1000")
    verified = sum(int(out.split()[2]) for out, _ in outs)
    assert verified > 1000
    with Client(daemon.socket) as c:
        st = c.stats()
        assert st["leases"] == 0 and st["reservations"] == 0
        # every op reached the daemon, but gets it published as ready in host RAM, which were
        # copied without a lease (bit-exact all the same, above)
        unleased = sum(int(out.split()[3]) for out, _ in outs)
        assert unleased > 0
        assert st["daemon"]["requests"] + unleased >= 8 * 1000


def test_killed_client_loses_its_reservations_and_leases(daemon):
    p = subprocess.Popen([sys.executable, "-m", "tests.client_worker", daemon.socket, "hold", "1", "5"],
                         cwd=ROOT, stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "HOLDING"
    with Client(daemon.socket) as c:
        st = c.stats()
        assert st["leases"] == 1 and st["reservations"] == 1
        used_before = st["tiers"]["host"]["used_bytes"]
        p.send_signal(signal.SIGKILL)
        p.wait()
        assert wait_for(lambda: c.stats()["reservations"] == 0 and c.stats()["leases"] == 0)
        st = c.stats()
        assert st["daemon"]["reclaimed_leases"] == 1 and st["daemon"]["reclaimed_reservations"] == 1
        assert st["tiers"]["host"]["used_bytes"] == used_before - 5 * 16384  # reserved slots freed
        assert c.flush(tier="host") == 4  # the formerly leased blocks can go now


def raw_conn(path):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(10)
    s.connect(path)
    return s


def read_reply(s):
    hdr = b""
    while len(hdr) < 4:
        chunk = s.recv(4 - len(hdr))
        if not chunk:
            return None
        hdr += chunk
    (n,) = struct.unpack(">I", hdr)
    body = b""
    while len(body) < n:
        chunk = s.recv(n - len(body))
        if not chunk:
            return None
        body += chunk
    return msgpack.unpackb(body, raw=False)


def send(s, obj=None, raw=None):
    body = raw if raw is not None else msgpack.packb(obj, use_bin_type=True)
    try:
        s.sendall(struct.pack(">I", len(body)) + body)
    except BrokenPipeError:
        pass  # the daemon may cut off an oversized frame before it has all arrived


def test_bad_input_gets_errors_and_other_clients_are_served(daemon):
    ns = make_ns()
    good = Client(daemon.socket)
    keys = chain(ns, 1, 4)
    put_chain(good, ns, keys)
    try:
        s = raw_conn(daemon.socket)
        send(s, {"id": 1, "op": "lookup", "ns": ns.name, "keys": []})
        assert "hello" in read_reply(s)["error"]["message"]   # hello comes first
        send(s, {"id": 1, "op": "hello", "version": 1, "namespaces": [ns.to_dict()]})
        assert read_reply(s)["ok"]
        send(s, raw=b"\xc1\xc1garbage")                       # not msgpack
        assert read_reply(s)["error"]["code"] == "bad_request"
        send(s, [1, 2, 3])                                     # not a map
        assert read_reply(s)["error"]["code"] == "bad_request"
        send(s, {"id": 1, "op": "launch_missiles"})            # unknown op
        assert read_reply(s)["error"]["code"] == "unknown_op"
        send(s, {"id": 2, "op": "lookup", "ns": 7, "keys": "x"})  # wrong types
        assert read_reply(s)["error"]["code"] == "bad_request"
        send(s, {"id": 3, "op": "lookup", "ns": ns.name, "keys": [b"short"]})
        assert read_reply(s)["error"]["code"] == "bad_request"
        send(s, {"id": 4, "op": "lookup", "ns": "nosuchnamespace", "keys": []})
        assert read_reply(s)["error"]["code"] == "unknown_namespace"
        send(s, {"id": 5, "op": "hello", "version": 99})  # wrong protocol version
        assert read_reply(s)["error"]["code"] == "bad_request"
        send(s, {"id": 6, "op": "lookup", "ns": ns.name, "keys": [b"k" * 16] * 100_000})
        r = read_reply(s)
        assert r is None or r["error"]["code"] in ("frame_too_large", "bad_request")
        s.close()

        s = raw_conn(daemon.socket)
        s.sendall(struct.pack(">I", (4 << 30) - 1) + b"xx")  # a 4 GiB length prefix
        r = read_reply(s)
        assert r is None or r["error"]["code"] == "frame_too_large"
        s.close()

        # a lease and a reservation that belong to another client
        lease = good.acquire(ns, keys)
        res = good.reserve(ns, chain(ns, 2, 2))
        s = raw_conn(daemon.socket)
        send(s, {"id": 0, "op": "hello", "version": 1})
        assert read_reply(s)["ok"]
        send(s, {"id": 1, "op": "release", "lease": lease.id})
        assert read_reply(s)["error"]["code"] == "bad_lease"
        send(s, {"id": 2, "op": "commit", "res": res.id})
        assert read_reply(s)["error"]["code"] == "bad_lease"
        send(s, {"id": 3, "op": "release", "lease": 10**12})
        assert read_reply(s)["error"]["code"] == "bad_lease"
        s.close()
        good.release(lease)
        good.abort(res)

        # the well-behaved client never noticed
        assert_exact(good, ns, keys)
        assert daemon.alive()
        st = good.stats()
        assert st["daemon"]["bad_requests"] >= 7
    finally:
        good.close()


def test_slow_client_stalling_mid_frame_is_cut_off(tmp_path):
    d = DaemonProc(tmp_path, toml="[limits]\nframe_timeout_s = 0.5\n").start()
    try:
        s = raw_conn(d.socket)
        s.sendall(struct.pack(">I", 100) + b"only part of it")
        t0 = time.monotonic()
        r = read_reply(s)
        assert r is not None and r["error"]["code"] == "timeout"
        assert s.recv(1) == b""  # closed
        assert time.monotonic() - t0 < 5
        with Client(d.socket) as c:
            assert c.ping()["version"]
    finally:
        assert d.stop() == 0


def test_synced_blocks_survive_a_daemon_sigkill_and_the_client_reconnects(tmp_path):
    ns = make_ns()
    keys = chain(ns, 3, 8)
    d = DaemonProc(tmp_path).start()
    c = Client(d.socket)
    put_chain(c, ns, keys)
    assert c.sync() == 8
    d.kill()
    with pytest.raises(DaemonUnavailableError):
        c.lookup(ns, keys)  # retried once, the daemon is still gone
    d.start()
    try:
        assert c.lookup(ns, keys) == 8  # reconnected by itself, namespaces re-registered
        assert_exact(c, ns, keys)
        assert c.reconnects >= 1
        st = c.stats()
        assert st["tiers"]["disk"]["recovered_from"] == "scan"
    finally:
        c.close()
        assert d.stop() == 0


def test_sigterm_finishes_syncs_and_exits_zero(tmp_path):
    ns = make_ns()
    keys = chain(ns, 4, 5)
    d = DaemonProc(tmp_path).start()
    with Client(d.socket) as c:
        put_chain(c, ns, keys)
    assert d.stop() == 0  # sync_on_stop writes the host blocks down
    assert not os.path.exists(d.socket)
    d.start()
    try:
        with Client(d.socket) as c:
            assert c.stats()["tiers"]["disk"]["recovered_from"] == "checkpoint"
            assert_exact(c, ns, keys)
    finally:
        assert d.stop() == 0


def test_a_second_daemon_on_the_same_socket_is_refused(daemon, tmp_path):
    (tmp_path / "x").mkdir()
    other = DaemonProc(tmp_path / "x")
    other.args[1] = daemon.socket
    with pytest.raises(RuntimeError, match="did not start"):
        other.start(timeout_s=20)
    other.proc.wait(20)
    assert other.proc.returncode == 1
    assert "another daemon is serving" in other.log.read_text()
    with Client(daemon.socket) as c:  # the first one is unharmed
        assert c.ping()["version"]


def test_unknown_namespace_and_stale_lease_errors_map_to_exceptions(daemon):
    with Client(daemon.socket) as c:
        with pytest.raises(UnknownNamespaceError):
            c.lookup("feedfacefeedface", [b"k" * 16])
        ns = make_ns()
        keys = chain(ns, 6, 2)
        put_chain(c, ns, keys)
        lease = c.acquire(ns, keys)
        c.release(lease)
        with pytest.raises(LeaseError):
            c.release(lease)


def test_peer_with_another_uid_is_refused(tmp_path):
    if os.geteuid() != 0:
        pytest.skip("needs root to run a client under another uid")
    import shutil
    import tempfile
    from pathlib import Path
    base = Path(tempfile.mkdtemp(prefix="tierd-peer-"))  # reachable by uid 65534, unlike tmp_path
    base.chmod(0o755)
    (base / "run").mkdir(mode=0o755)
    d = DaemonProc(base, toml="socket_mode = \"0666\"\n")
    d.start()
    try:
        code = ("import os, socket, struct, msgpack\n"
                "os.setgid(65534); os.setuid(65534)\n"
                f"s = socket.socket(socket.AF_UNIX); s.connect({d.socket!r})\n"
                "n = struct.unpack('>I', s.recv(4))[0]; print(msgpack.unpackb(s.recv(n))['error']['code'])\n")
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30)
        assert r.stdout.strip() == "forbidden", r.stderr
        with Client(d.socket) as c:
            assert c.stats()["daemon"]["refused_peers"] == 1
        mode = os.stat(next((base / "arena").iterdir())).st_mode
        assert mode & 0o007 == 0, "the host arena must not be readable by other users"
    finally:
        assert d.stop() == 0
        shutil.rmtree(base, ignore_errors=True)


PEER_CLIENT = """
import json, os, sys, time
import numpy as np
import tierd
from tierd.client import Client
from tierd.errors import TierdError
from tests.helpers import make_ns, chain
ns = make_ns()
keys = chain(ns, 2, 7)
blocks = [np.full(ns.block_shape, i + 3, dtype=np.float16) for i in range(len(keys))]
groups = json.loads(sys.argv[2])
# what runs from here on imports nothing more from the interpreter's tree (mode 0700 here)
os.setgroups(groups); os.setgid(65534); os.setuid(65534)   # an engine user, in these groups
t0 = time.monotonic()
try:
    with Client(sys.argv[1], timeout_s=10) as c:
        c.put(ns, keys, blocks)
        with c.acquire(ns, keys) as lease:
            ok = all(np.array_equal(np.frombuffer(b, np.float16).reshape(ns.block_shape), x)
                     for b, x in zip(lease.buffers, blocks))
        print(json.dumps({"ok": ok}))
except TierdError as e:
    print(json.dumps({"error": type(e).__name__, "message": str(e), "s": time.monotonic() - t0}))
"""


def test_a_member_of_an_allowed_group_by_supplementary_group_connects_and_others_learn_why(tmp_path):
    """allowed_gids, and the daemon's own group, admit a peer by any of its groups (an engine
    user added to group tierd with `usermod -aG`, a pod's supplementalGroups), not only its
    primary gid; a refused peer's client raises the daemon's reason (never "broken pipe during
    hello"), and one the socket's mode keeps out is told which group to join."""
    if os.geteuid() != 0:
        pytest.skip("needs root to run a client under another uid")
    import json
    import shutil
    import tempfile
    from pathlib import Path
    base = Path(tempfile.mkdtemp(prefix="tierd-peer-"))  # reachable by uid 65534, unlike tmp_path
    base.chmod(0o755)
    (base / "run").mkdir(mode=0o755)
    # the daemon runs as root:root here; the socket and (for this test) the arena are open to all
    # (mode 0666), so the peer check is what admits or refuses
    d = DaemonProc(base, toml='allowed_gids = [4242]\nsocket_mode = "0666"\n' + SMALL_TOML)
    d.start()
    for f in (base / "arena").iterdir():
        f.chmod(0o666)
    try:
        def client(groups):
            r = subprocess.run([sys.executable, "-c", PEER_CLIENT, d.socket, json.dumps(groups)], cwd=ROOT,
                               capture_output=True, text=True, timeout=60)
            assert r.returncode == 0, r.stderr
            return json.loads(r.stdout.strip().splitlines()[-1])
        assert client([4242]) == {"ok": True}, "a member of an allowed group by a supplementary group"
        assert client([0]) == {"ok": True}, "a member of the daemon's own group (the socket's)"
        refused = client([])
        assert refused["error"] == "ForbiddenError", refused
        assert "uid 65534" in refused["message"] and "allowed_gids [4242]" in refused["message"], refused
        assert refused["s"] < 5
        with Client(d.socket) as c:
            assert c.stats()["daemon"]["refused_peers"] == 1
        # a socket whose mode keeps the client out: the client says which group to join
        os.chmod(d.socket, 0o660)
        refused = client([])
        assert refused["error"] == "DaemonUnavailableError" and "usermod -aG" in refused["message"], refused
        assert "mode 0660" in refused["message"], refused
    finally:
        assert d.stop() == 0
        shutil.rmtree(base, ignore_errors=True)


def test_request_over_its_time_limit_gets_a_timeout_reply(tmp_path):
    from tierd.protocol import RemoteError
    d = DaemonProc(tmp_path, toml=SMALL_TOML + "[limits]\nrequest_timeout_s = 0.001\n").start()
    try:
        ns = make_ns()
        with Client(d.socket) as c:
            for seed in range(20):
                put_chain(c, ns, chain(ns, 500 + seed, 5))
            with pytest.raises(RemoteError) as e:
                c.sync()  # 100 blocks to write: far over a millisecond
            assert e.value.code == "timeout"
            assert c.ping()["version"]  # the connection and the daemon carry on
            assert wait_for(lambda: c.stats()["tiers"]["disk"]["blocks"] == 100)
    finally:
        assert d.stop() == 0


def _wait_stats(url, pred, timeout_s=10.0):
    deadline = time.monotonic() + timeout_s
    with tierd.connect(url) as admin:
        while True:
            st = admin.stats()
            if pred(st) or time.monotonic() > deadline:
                return st
            time.sleep(0.05)


def test_a_held_connection_keeps_its_slots_until_the_copy_ends(daemon):
    """A request that times out on one thread must not let the daemon reclaim the slots another
    thread is still copying: the socket is closed only when the last holder is done, and a lease
    lost with its connection cannot be confirmed."""
    ns = make_ns()
    keys = chain(ns, 7, 2)
    c = Client(daemon.socket, timeout_s=0.3, retries=0)
    c.put(ns, keys, [block_for(ns, k) for k in keys])
    lease = c.acquire(ns, keys)
    assert len(lease) == 2
    with c.hold():
        daemon.signal(signal.SIGSTOP)
        try:
            with pytest.raises(DaemonUnavailableError):
                c.stats()                             # times out: this connection is dead for requests
        finally:
            daemon.signal(signal.SIGCONT)
        assert not c.connected
        time.sleep(0.3)
        assert _wait_stats(daemon.url, lambda s: False, 0.2)["leases"] == 1   # still held: still leased
        assert bytes(lease.buffers[0]) == block_for(ns, keys[0]).tobytes()
    # the open lease holds the connection too: still leased, so what was read stands
    assert _wait_stats(daemon.url, lambda s: False, 0.2)["leases"] == 1
    c.release(lease, confirm=True)
    assert _wait_stats(daemon.url, lambda s: s["leases"] == 0)["leases"] == 0  # reclaimed after the copy
    with pytest.raises(LeaseError):
        c.release(lease, confirm=True)                # released already
    # a new connection serves again, and a lease on it is confirmed at release
    lease = c.acquire(ns, keys)
    c.release(lease, confirm=True)
    assert _wait_stats(daemon.url, lambda s: s["leases"] == 0)["leases"] == 0
    c.close()


def test_lookup_all_answers_per_namespace_in_one_request(daemon):
    a, b = make_ns(model="m-a"), make_ns(model="m-b")
    ka, kb = chain(a, 1, 3), chain(b, 2, 3)
    with tierd.connect(daemon.url) as c:
        c.put(a, ka, [block_for(a, k) for k in ka])
        c.put(b, kb[:1], [block_for(b, kb[0])])
        assert c.lookup_all([(a, ka), (b, kb), (a, kb)]) == [3, 1, 0]
        assert c.lookup_all([]) == []


def test_no_reservation_or_lease_outlives_its_request_on_a_live_connection(tmp_path):
    """Every reservation and lease ends — committed, aborted, released or undone after a
    timeout — while the client stays connected: puts of blocks already there, gets that hit
    and miss, reservations aborted or of nothing, and requests answered with a timeout."""
    from tierd.protocol import RemoteError
    d = DaemonProc(tmp_path, toml=SMALL_TOML + "[limits]\nrequest_timeout_s = 0.001\n").start()
    try:
        ns = make_ns()
        with Client(d.socket) as c:
            keys = chain(ns, 7, 4)
            put_chain(c, ns, keys)
            for _ in range(101):                    # the same block again and again: all present
                assert c.put(ns, keys[:1], [block_for(ns, keys[0])]) == 0
            assert c.put(ns, keys, [block_for(ns, k) for k in keys]) == 0
            res = c.reserve(ns, keys)               # a reservation of nothing
            assert res.num_reserved == 0
            c.commit(res)
            other = chain(ns, 8, 3)
            c.abort(c.reserve(ns, other))           # aborted
            res = c.reserve(ns, other)
            c.abort(res)
            c.abort(res)                            # twice: harmless
            assert_exact(c, ns, keys)               # hits
            assert c.get(ns, other) == []           # a miss
            with c.acquire(ns, other) as lease:     # a lease of nothing
                assert len(lease) == 0
            with c.acquire(ns, keys) as lease:
                assert len(lease) == 4
            for seed in range(20):                  # enough to write that sync must time out
                put_chain(c, ns, chain(ns, 500 + seed, 5))
            with pytest.raises(RemoteError):
                c.sync()
            st = _wait_stats(d.url, lambda s: not s["leases"] and not s["reservations"])
            assert (st["leases"], st["reservations"]) == (0, 0), st
            assert c.connected
            assert c.stats()["daemon"]["reclaimed_leases"] == 0
            assert c.stats()["daemon"]["reclaimed_reservations"] == 0
    finally:
        assert d.stop() == 0


def _arena_rss(arena_dir, size: int) -> list[int]:
    """Resident kB of each `size`-byte mapping of a file under `arena_dir` in this process
    (/proc/self/smaps): the host arenas mapped here (the shared index is mapped from there too)."""
    out, current = [], None
    with open("/proc/self/smaps") as f:
        for line in f:
            fields = line.split()
            if "-" in fields[0] and len(fields) >= 5 and ":" in fields[3]:    # a mapping's header
                lo, hi = (int(x, 16) for x in fields[0].split("-"))
                current = len(fields) >= 6 and fields[5].startswith(str(arena_dir)) and hi - lo == size
                if current:
                    out.append(0)
            elif fields[0] == "Rss:" and current:
                out[-1] = int(fields[1])
    return out


def test_a_prefaulting_client_maps_the_whole_arena_ahead_of_use_and_again_after_a_restart(tmp_path):
    d = DaemonProc(tmp_path, host_bytes="64MiB").start()
    arena = tmp_path / "arena"
    ns = make_ns()
    keys = chain(ns, 4, 6)
    size = 64 << 20
    plain = tierd.connect(d.url)
    c = tierd.connect(d.url + "?prefault=1")
    try:
        assert c.prefault and not plain.prefault
        assert wait_for(lambda: c.prefaulted_bytes == size)
        # the prefaulting client's mapping is resident in full; the plain one maps nothing yet
        assert sorted(_arena_rss(arena, size)) == [0, size >> 10]
        put_chain(plain, ns, keys)
        assert_exact(c, ns, keys)      # mapping pages ahead changes no byte
        assert d.stop() == 0
        d.start()
        assert c.lookup(ns, keys) == 6  # the restarted daemon re-adopted its arena
        assert c.reconnects == 1        # and this client mapped it again, ahead of use again
        assert wait_for(lambda: c.prefaulted_bytes == size)
        assert sorted(_arena_rss(arena, size)) == [0, size >> 10]
        assert_exact(c, ns, keys)
        more = chain(ns, 5, 3)
        put_chain(c, ns, more)
        assert_exact(plain, ns, more)
    finally:
        plain.close()
        c.close()
        if d.alive():
            assert d.stop() == 0
    assert _arena_rss(arena, size) == []      # every mapping went with its client, the old arena's too


def test_closing_a_client_while_it_prefaults_stops_the_prefault(tmp_path):
    import threading
    d = DaemonProc(tmp_path, host_bytes="512MiB").start()
    try:
        for _ in range(3):
            c = Client(d.socket, prefault=True)
            c.close()
            assert c.prefaulted_bytes < 512 << 20
        assert wait_for(lambda: not any(t.name == "tierd-prefault" for t in threading.enumerate()))
        assert _arena_rss(tmp_path / "arena", 512 << 20) == []
    finally:
        assert d.stop() == 0
