"""Staged slots: a client writes blocks into free slots it holds ahead of time and names their
keys in one deferred `put` (no reserve round trip). Bytes must be exact, a slot must never be
named by anyone but its holder, and nothing may leak when a client fails, dies or misbehaves."""

import os
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from tierd import TieredStore
from tierd.client import Client
from tierd.errors import LeaseError, TierdError

from .daemon import ROOT
from .helpers import assert_exact, block_for, chain, make_ns, put_chain, wait_for
from .test_daemon import raw_conn, read_reply, send


def staged(c: Client) -> int:
    return c.stats()["staged_slots"]


# -- the store ---------------------------------------------------------------------------------

def test_store_staged_slots_become_blocks_or_go_back_exactly_once():
    ns = make_ns()
    with TieredStore(host_bytes="4MiB", host_slab_bytes="1MiB") as s:
        s.register(ns)
        free0 = s.host.alloc.free_slot_count(s._ns(ns).host_slot_bytes)
        offs = s.stage(ns, 6, owner="a")
        assert len(offs) == len(set(offs)) == 6 and s.staged_slots("a") == 6
        assert s.host.alloc.free_slot_count(s._ns(ns).host_slot_bytes) == free0 - 6
        keys = chain(ns, 1, 4)
        for k, off in zip(keys, offs):
            s.host.arena.view(off, ns.block_bytes)[:] = block_for(ns, k)
        # another owner cannot name them, nor can a slot be named twice: nothing changes
        with pytest.raises(LeaseError):
            s.put_staged(ns, keys[:1], offs[:1], owner="b")
        with pytest.raises(LeaseError):
            s.put_staged(ns, keys[:2], [offs[0], offs[0]], owner="a")
        # nor can it give malformed checksums: too few, out of range, not integers
        for sums in ([1], [1, 1 << 64], [-2, 0], [1.0, 2], [True, 0]):
            with pytest.raises(TierdError, match="checksums"):
                s.put_staged(ns, keys[:2], offs[:2], owner="a", checksums=sums)
        assert s.staged_slots("a") == 6 and s.lookup(ns, keys) == 0
        assert s.put_staged(ns, keys, offs[:4], owner="a") == 4
        assert_exact(s, ns, keys)
        with pytest.raises(LeaseError):            # adopted: no longer staged
            s.put_staged(ns, keys[:1], offs[:1], owner="a")
        # a key already present: its staged slot goes back to the free pool
        assert s.put_staged(ns, keys[:1] + chain(ns, 2, 1), [offs[4], -1], owner="a") == 0
        assert s.staged_slots("a") == 1
        assert s.drop_owner("a") == (0, 0) and s.staged_slots() == 0
        assert s.host.alloc.free_slot_count(s._ns(ns).host_slot_bytes) == free0 - 4
        assert_exact(s, ns, keys)


def test_store_stage_respects_its_limit_and_a_namespace_of_another_slot_size():
    ns, big = make_ns(), make_ns(model="big", num_layers=8)
    with TieredStore(host_bytes="4MiB", host_slab_bytes="1MiB") as s:
        s.register(ns)
        s.register(big)
        offs = s.stage(ns, 100, owner=1, limit_bytes=5 * ns.block_bytes)
        assert len(offs) == 5
        assert s.stage(ns, 3, owner=1, limit_bytes=5 * ns.block_bytes) == []
        with pytest.raises(LeaseError):   # a slot of another size is not this namespace's
            s.put_staged(big, chain(big, 1, 1), offs[:1], owner=1)
        assert s.unstage(1, offs[:2] + [12345]) == 2 and s.staged_slots(1) == 3


def test_store_staging_of_all_writers_together_stays_within_its_pool():
    """Staged slots hold no cached block, so all writers together stage at most `pool_bytes`:
    each at most an equal share of it, and a writer arriving when the others hold it all gets
    none (it reserves instead) until they use theirs and ask again."""
    ns = make_ns()
    bb = ns.block_bytes
    with TieredStore(host_bytes="4MiB", host_slab_bytes="1MiB") as s:
        s.register(ns)
        pool = 12 * bb
        a = s.stage(ns, 100, owner="a", pool_bytes=pool)
        assert len(a) == 12                                    # alone: the whole pool
        assert s.stage(ns, 5, owner="b", pool_bytes=pool) == []   # nothing left to share
        # a uses half: its refill is capped at its share of two writers, b gets the rest
        for k, off in zip(chain(ns, 1, 6), a):
            s.host.arena.view(off, bb)[:] = block_for(ns, k)
        assert s.put_staged(ns, chain(ns, 1, 6), a[:6], owner="a") == 6
        assert s.stage(ns, 6, owner="a", pool_bytes=pool) == []   # 6 held = its share of 2
        b = s.stage(ns, 100, owner="b", pool_bytes=pool)
        assert len(b) == 6
        c = s.stage(ns, 100, owner="c", pool_bytes=pool)
        assert c == [] and s.staged_slots() == 12               # never past the pool
        s.unstage("a")                                          # a is done: b and c share it
        assert len(s.stage(ns, 100, owner="c", pool_bytes=pool)) == 6 and s.staged_slots() == 12
        s.unstage("b")
        assert len(s.stage(ns, 100, owner="d", pool_bytes=pool, limit_bytes=2 * bb)) == 2
        assert s.staged_slots() == 8
        assert_exact(s, ns, chain(ns, 1, 6))


# -- through the daemon ------------------------------------------------------------------------

def test_puts_and_reservations_through_staged_slots_are_exact(daemon):
    ns = make_ns()
    with Client(daemon.socket) as c:
        keys = chain(ns, 1, 6)
        assert put_chain(c, ns, keys) == 6
        assert staged(c) > 0                      # it holds slots for its next write
        assert put_chain(c, ns, keys) == 0        # present (the shared index): nothing written
        assert c.lookup(ns, keys) == 6
        assert_exact(c, ns, keys)
        more = chain(ns, 2, 4)
        res = c.reserve(ns, keys[4:] + more)      # a staged reservation: no request
        assert res.status == ["present"] * 2 + ["reserved"] * 4
        for k, buf in zip(keys[4:] + more, res.buffers):
            if buf is not None:
                buf[:] = block_for(ns, k)
        assert c.lookup(ns, more) == 0
        assert c.commit(res) == 4
        assert c.lookup(ns, keys + more) == 10
        assert_exact(c, ns, keys + more)
        before = staged(c)
        res = c.reserve(ns, chain(ns, 3, 2))
        c.abort(res)                              # its slots go back to the pool, unused
        assert staged(c) == before
        with pytest.raises(LeaseError):
            c.commit(res)
        assert c.stats()["reservations"] == 0
    with Client(daemon.socket) as c2:             # the first client's slots went with it
        wait_for(lambda: staged(c2) == 0, what="staged slots reclaimed")
        assert_exact(c2, ns, keys + more)


def test_a_client_without_staging_and_a_staging_one_store_the_same(daemon):
    ns = make_ns()
    with Client(daemon.socket, stage_bytes=0) as plain, Client(daemon.socket) as fast:
        a, b = chain(ns, 10, 5), chain(ns, 11, 5)
        assert put_chain(plain, ns, a) == 5 and staged(plain) == 0
        assert put_chain(fast, ns, b) == 5
        assert put_chain(fast, ns, a) == 0 and put_chain(plain, ns, b) == 0
        assert_exact(plain, ns, b)
        assert_exact(fast, ns, a)


def test_a_client_holds_at_most_stage_bytes_of_staged_slots(daemon):
    """A client stages several writes ahead (so its writes need not wait for the daemon's
    replies), but never more than `stage_bytes` per namespace; a write too large for that takes
    the reserve path. Bytes are exact either way."""
    ns = make_ns()
    cap = 6
    with Client(daemon.socket, stage_bytes=cap * ns.block_bytes) as c:
        keys = chain(ns, 20, 12)
        for i in range(0, 8, 2):
            assert put_chain(c, ns, keys[i:i + 2]) == 2
            assert 0 < staged(c) <= cap
        before = staged(c)
        assert put_chain(c, ns, keys[8:]) == 4     # 4 blocks: twice that is past the cap
        assert staged(c) == before
        assert c.lookup(ns, keys) == 12
        assert_exact(c, ns, keys)
    with Client(daemon.socket) as c:               # the default: several writes deep
        keys = chain(ns, 21, 8)
        for i in range(0, 8, 2):
            assert put_chain(c, ns, keys[i:i + 2]) == 2
        assert staged(c) > 2 * 2
        assert_exact(c, ns, keys)


def test_writers_to_one_daemon_share_its_staged_slots_and_store_exact_bytes(daemon):
    """Three writers each asking for more staged slots than their share: all together they hold
    at most 1/16 of the host tier (8 MiB here: 32 slots), none more than an equal share, and
    the writes the pool cannot take go through reservations, every byte exact."""
    ns = make_ns()
    pool = (8 << 20) // 16 // ns.block_bytes
    clients = [Client(daemon.socket) for _ in range(3)]
    try:
        keys = [chain(ns, 40 + i, 48) for i in range(3)]
        for j in range(0, 48, 8):
            for c, ks in zip(clients, keys):
                assert put_chain(c, ns, ks[j:j + 8]) == 8
                held = {x["id"]: x["staged_slots"] for x in c.stats()["daemon"]["client_list"]}
                assert sum(held.values()) <= pool, held
                assert max(held.values()) <= pool, held
        held = [x["staged_slots"] for x in clients[0].stats()["daemon"]["client_list"]]
        assert sum(held) <= pool and max(held) <= pool // 3 + 8, held   # (+ one write in flight)
        for c, ks in zip(clients, keys):
            assert c.lookup(ns, ks) == 48
            assert_exact(c, ns, ks)
    finally:
        for c in clients:
            c.close()
    with Client(daemon.socket) as c:
        wait_for(lambda: staged(c) == 0, what="the writers' staged slots to go back")


def test_staging_asks_no_more_slots_than_one_request_may_name(tmp_path):
    """The slots a client stages ahead are asked for in one `stage` request, which may name at
    most the daemon's `max_keys_per_request`: a write of more than half that many blocks still
    stores every block, exact (staged in part, or reserved)."""
    from .daemon import SMALL_TOML, DaemonProc
    d = DaemonProc(tmp_path, host_bytes="16MiB", toml=SMALL_TOML + "[limits]\nmax_keys_per_request = 6\n").start()
    try:
        ns = make_ns()
        with Client(d.socket) as c:
            for i, n in enumerate((4, 5, 6, 3)):
                keys = chain(ns, 30 + i, n)
                assert put_chain(c, ns, keys) == n
                assert c.lookup(ns, keys) == n
                assert_exact(c, ns, keys)
            assert 0 < staged(c) <= 6
    finally:
        assert d.stop() == 0


def test_many_threads_on_one_client_put_and_read_exact(daemon):
    ns = make_ns()
    errors = []
    with Client(daemon.socket) as c:
        def work(t):
            try:
                for r in range(12):
                    keys = chain(ns, 1000 * t + r, 3)
                    put_chain(c, ns, keys)
                    got = c.get(ns, keys)
                    for k, g in zip(keys, got):   # evicted ones are misses, never wrong
                        assert np.array_equal(g, block_for(ns, k))
            except Exception as e:  # noqa: BLE001
                errors.append(e)
        threads = [threading.Thread(target=work, args=(t,)) for t in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert not errors, errors
        st = c.stats()
        assert st["reservations"] == 0 and st["leases"] == 0


def test_a_killed_writer_leaks_no_staged_slot(daemon):
    ns = make_ns()
    code = (
        "import os, sys, time\n"
        "from tierd.client import Client\n"
        "from tests.helpers import block_for, chain, make_ns\n"
        "ns = make_ns()\n"
        "c = Client(sys.argv[1])\n"
        "keys = chain(ns, 7, 4)\n"
        "c.put(ns, keys, [block_for(ns, k) for k in keys])\n"
        "res = c.reserve(ns, chain(ns, 8, 4))\n"   # staged, half written, never committed
        "res.buffers[0][:] = 7\n"
        "print(c.stats()['staged_slots'], flush=True)\n"
        "time.sleep(60)\n")
    p = subprocess.Popen([sys.executable, "-c", code, daemon.socket], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    try:
        assert int(p.stdout.readline()) > 0
    finally:
        p.send_signal(signal.SIGKILL)
        p.wait(30)
    with Client(daemon.socket) as c:
        wait_for(lambda: staged(c) == 0, what="the dead writer's staged slots reclaimed")
        assert c.lookup(ns, chain(ns, 7, 4)) == 4
        assert c.lookup(ns, chain(ns, 8, 4)) == 0   # never committed: never served
        assert_exact(c, ns, chain(ns, 7, 4))
        assert c.stats()["tiers"]["host"]["blocks"] == 4   # and no slot held for anyone


def test_a_client_names_only_its_own_staged_slots(daemon):
    """A put naming a block's slot, another client's staged slot, a slot twice or a malformed
    list is refused; nothing is stored, no byte of another block changes, and the slots it did
    hold go back to the free pool (it gave them up when it sent them)."""
    ns = make_ns()
    victim_keys = chain(ns, 20, 2)
    with Client(daemon.socket) as victim:
        put_chain(victim, ns, victim_keys)
        with victim.acquire(ns, victim_keys) as lease:
            victim_block_off = int(lease.buffers[0].ctypes.data - victim.host_array().ctypes.data)
        res = victim.reserve(ns, chain(ns, 21, 1))   # the victim's staged slot
        victim_staged_off = res._staged[0]
        s = raw_conn(daemon.socket)
        send(s, {"id": 1, "op": "hello", "version": 1, "namespaces": [ns.to_dict()]})
        assert read_reply(s)["ok"]
        send(s, {"id": 2, "op": "stage", "ns": ns.name, "n": 3})
        mine = read_reply(s)["slots"]
        assert len(mine) == 3
        k1, k2 = chain(ns, 22, 2)
        bad = [([k1], [victim_block_off], "bad_lease"), ([k1], [victim_staged_off], "bad_lease"),
               ([k1, k2], [mine[0], mine[0]], "bad_lease"), ([k1], [mine[0], mine[1]], "bad_request"),
               ([k1], ["x"], "bad_request"), ([k1], [-7], "bad_request")]
        for i, (keys, offs, code) in enumerate(bad):
            send(s, {"id": 10 + i, "op": "put", "ns": ns.name, "keys": keys, "slots": offs})
            r = read_reply(s)
            assert r["error"]["code"] == code, (offs, r)
        assert victim.lookup(ns, [k1, k2]) == 0
        assert_exact(victim, ns, victim_keys)
        # the lease-refused puts gave up mine[0]; mine[1] and mine[2] are still held
        send(s, {"id": 30, "op": "put", "ns": ns.name, "keys": [k1], "slots": [mine[1]], "refill": 0})
        r = read_reply(s)
        assert r["ok"] and r["n"] == 1
        send(s, {"id": 31, "op": "put", "ns": ns.name, "keys": [k2], "slots": [mine[0]]})
        assert read_reply(s)["error"]["code"] == "bad_lease"
        s.close()
        victim.abort(res)
        # the raw client's slots went with its connection: only the victim's own pool is left
        wait_for(lambda: staged(victim) == len(victim._stage_pool[ns.name]), what="raw client's slots reclaimed")


def test_staged_slots_survive_nothing_across_a_daemon_restart(daemon):
    ns = make_ns()
    with Client(daemon.socket) as c:
        keys = chain(ns, 40, 3)
        put_chain(c, ns, keys)
        res = c.reserve(ns, chain(ns, 41, 2))
        daemon.stop()
        daemon.start()
        for buf in res.buffers:
            buf[:] = 1
        with pytest.raises(LeaseError):           # its connection is gone: nothing committed
            c.commit(res)
        more = chain(ns, 42, 3)
        assert put_chain(c, ns, more) == 3        # a new connection, a new pool
        assert_exact(c, ns, more)
        assert c.lookup(ns, chain(ns, 41, 2)) == 0


def test_an_unanswered_release_keeps_the_reply_stream_in_order(daemon):
    """A release sent with `noreply` (the client's default where the daemon's hello allows it)
    is served and never answered, also when it fails; the next reply is the next request's."""
    ns = make_ns()
    keys = chain(ns, 60, 2)
    with Client(daemon.socket) as c:
        put_chain(c, ns, keys)
        assert c._noreply
    s = raw_conn(daemon.socket)
    send(s, {"id": 1, "op": "hello", "version": 1, "namespaces": [ns.to_dict()]})
    assert read_reply(s)["noreply"] is True
    send(s, {"id": 2, "op": "acquire", "ns": ns.name, "keys": keys})
    lease = read_reply(s)["lease"]
    assert lease
    with Client(daemon.socket) as c:
        assert c.stats()["leases"] == 1
        send(s, {"id": 3, "op": "release", "lease": lease, "noreply": True})
        send(s, {"id": 4, "op": "release", "lease": 999999, "noreply": True})   # unknown: not answered either
        send(s, {"id": 5, "op": "ping"})
        r = read_reply(s)
        assert r["id"] == 5 and r["ok"]
        assert c.stats()["leases"] == 0
        send(s, {"id": 6, "op": "release", "lease": 999999})                   # answered: an error
        assert read_reply(s)["error"]["code"] == "bad_lease"
    s.close()


def test_an_idle_connection_holding_staged_slots_is_not_closed(tmp_path):
    """idle_timeout_s closes idle connections, which gives back what they hold: never one
    whose client may be copying into staged slots (a writer may stage, then copy much later)."""
    from .daemon import SMALL_TOML, DaemonProc
    d = DaemonProc(tmp_path, toml=SMALL_TOML + "[limits]\nidle_timeout_s = 0.3\n").start()
    try:
        ns = make_ns()
        with Client(d.socket) as writer, Client(d.socket, stage_bytes=0) as idle:
            idle.lookup(ns, chain(ns, 70, 1))
            put_chain(writer, ns, chain(ns, 71, 2))
            res = writer.reserve(ns, chain(ns, 72, 2))
            assert res._staged is not None
            gen = writer.generation()
            with Client(d.socket) as watcher:
                wait_for(lambda: watcher.stats()["daemon"]["clients"] == 2, what="the idle connection closed")
                for _ in range(10):                  # several idle periods: the writer stays
                    time.sleep(0.1)
                    assert watcher.stats()["daemon"]["clients"] == 2
            for k, buf in zip(chain(ns, 72, 2), res.buffers):
                buf[:] = block_for(ns, k)
            assert writer.commit(res) == 2 and writer.generation() == gen
            assert_exact(writer, ns, chain(ns, 72, 2))
    finally:
        d.stop()


@pytest.mark.parametrize("write", ["put", "commit"])
def test_a_write_pipelined_behind_a_waiting_request_is_stored_though_its_writer_left(tmp_path, write):
    """A client may pipeline (docs/protocol.md): here it sends a put into staged slots (or the
    commit of a reservation) while its acquire waits on a hung disk read, and goes away before
    either reply. The write is still served — what a writer sent before it left is not lost —
    and the acquire's lease and the writer's staged slots are reclaimed."""
    from .daemon import SMALL_TOML, DaemonProc
    from .test_client_threads import disk_only_block
    faults = tmp_path / "faults"
    d = DaemonProc(tmp_path, toml=SMALL_TOML + f'fault_file = "{faults}"\n').start()
    try:
        ns = make_ns()
        cold = disk_only_block(d, ns, 5)
        (k,) = chain(ns, 6, 1)
        with Client(d.socket) as c:
            s = raw_conn(d.socket)
            send(s, {"id": 1, "op": "hello", "version": 1, "namespaces": [ns.to_dict()]})
            assert read_reply(s)["ok"]
            if write == "put":
                send(s, {"id": 2, "op": "stage", "ns": ns.name, "n": 2})
                slots = read_reply(s)["slots"]
                off, last = slots[0], {"op": "put", "ns": ns.name, "keys": [k], "slots": slots[:1]}
            else:
                send(s, {"id": 2, "op": "reserve", "ns": ns.name, "keys": [k]})
                r = read_reply(s)
                off, last = r["slots"][0][1], {"op": "commit", "res": r["res"]}
            c.host_array()[off:off + ns.block_bytes] = block_for(ns, k)
            faults.write_text("read=hang:30")
            send(s, {"id": 3, "op": "acquire", "ns": ns.name, "keys": [cold]})
            time.sleep(0.3)            # the acquire waits on the disk: the put comes in behind it
            send(s, {"id": 4, **last})
            time.sleep(0.3)
            s.close()
            time.sleep(0.3)
            faults.write_text("")      # the acquire ends; its reply has nobody to go to
            wait_for(lambda: c.lookup(ns, [k]) == 1, what="the pipelined put")
            assert_exact(c, ns, [k])
            wait_for(lambda: c.stats()["leases"] == 0 and c.stats()["staged_slots"] == 0
                     and c.stats()["reservations"] == 0, what="the gone client's lease and slots reclaimed")
    finally:
        faults.write_text("")
        if d.alive():
            assert d.stop() == 0
