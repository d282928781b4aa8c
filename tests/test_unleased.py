"""Reads without a lease: a client copies blocks the shared index shows ready in host RAM straight
out of their slots, and keeps the copy only if no way it read was rewritten meanwhile (sequence
numbers, tierd/index.py). Never a wrong byte: not while other processes evict, demote, flush and
re-put under it, not after the daemon dies; every read is counted as a hit all the same."""

from __future__ import annotations

import os
import signal
import time

import numpy as np
import pytest

from tierd.client import Client, DaemonUnavailableError
from tierd.index import DISK, HOST, LEASE_FREE_READS, WAYS, SharedIndex

from .daemon import DaemonProc
from .helpers import block_for, chain, make_ns, put_chain
from .test_daemon import raw_conn, read_reply, send

pytestmark = pytest.mark.skipif(not LEASE_FREE_READS, reason="reads without a lease need x86-64's memory order")


def test_sequence_numbers_change_with_every_rewrite_of_a_way(tmp_path):
    path = str(tmp_path / "idx")
    w = SharedIndex.create(path, 1 << 20, instance=3)
    r = SharedIndex.open(path, instance=3)
    ns = make_ns()
    keys = chain(ns, 1, 5)
    assert r.host_run(ns.id, keys) is None                        # nothing there
    for i, k in enumerate(keys[:3]):
        w.set(ns.id, k, HOST, 4096 * (i + 1))
    n, final, ways, seqs, offsets = r.host_run(ns.id, keys)
    assert (n, final, list(offsets)) == (3, True, [4096, 8192, 12288])   # the next key is nowhere
    assert r.unchanged(ways, seqs)
    w.set(ns.id, keys[3], DISK)
    assert r.host_run(ns.id, keys)[:2] == (3, False)              # a lease would promote the 4th
    assert r.unchanged(ways, seqs)                                # another way: nothing changed
    w.set(ns.id, keys[3], 0)
    w.set_misses_final(False)                                     # a remote tier may have the 4th
    assert r.host_run(ns.id, keys)[:2] == (3, False)
    w.set_misses_final(True)

    # each kind of rewrite of a way read: the block's slot goes, moves, gains a disk copy
    for rewrite in (lambda: w.set(ns.id, keys[1], 0),
                    lambda: w.set(ns.id, keys[1], HOST, 65536),
                    lambda: w.set(ns.id, keys[1], HOST | DISK, 65536)):
        n, _, ways, seqs, _ = r.host_run(ns.id, keys)
        assert n == 3
        rewrite()
        assert not r.unchanged(ways, seqs)
        w.set(ns.id, keys[1], HOST, 8192)

    # a way freed and taken by another block in between: its number moved on, never back
    n, _, ways, seqs, _ = r.host_run(ns.id, keys)
    w.set(ns.id, keys[0], 0)
    other = None
    for seed in range(100_000):                                   # a key of the same bucket
        k = chain(ns, 10_000 + seed, 1)[0]
        if int.from_bytes(SharedIndex.tag(ns.id, k)[:8], "little") % w.num_buckets == ways[0] // WAYS:
            other = k
            break
    w.set(ns.id, other, HOST, 4096)
    assert int(r.seqs[ways[0]]) > int(seqs[0])
    assert not r.unchanged(ways, seqs)
    assert r.host_run(ns.id, keys) is None                        # the first key is gone

    # a way the daemon is rewriting right now (its number odd) is not read
    w.set(ns.id, keys[0], HOST, 4096)
    i = w._where[int.from_bytes(SharedIndex.tag(ns.id, keys[0]), "little")]
    w._seqs_mv[i] += 1
    assert r.host_run(ns.id, keys) is None
    w._seqs_mv[i] += 1
    assert r.host_run(ns.id, keys)[0] == 3
    w.set(ns.id, keys[0], HOST)                                   # no slot published: not read
    assert r.host_run(ns.id, keys) is None
    r.close()
    w.close()


def test_gets_without_a_lease_are_exact_and_counted_as_hits(daemon):
    ns = make_ns()
    keys = chain(ns, 3, 6)
    with Client(daemon.socket) as c:
        assert c._unleased_ok
        put_chain(c, ns, keys)
        assert c.lookup(ns, keys) == 6                            # the put is applied (its reply read)
        out = [np.zeros(ns.block_bytes, np.uint8) for _ in keys]
        got = c.get(ns, keys, out=out)
        assert len(got) == 6 and all(g is o for g, o in zip(got, out))
        assert all(np.array_equal(o, block_for(ns, k)) for o, k in zip(out, keys))
        tail = chain(ns, 4, 2)                                    # a prefix and a miss after it
        got = c.get(ns, keys[:4] + tail)
        assert [bytes(g) for g in got] == [bytes(block_for(ns, k)) for k in keys[:4]]
        assert c.unleased_reads == 2
        st = c.stats()["namespaces"][ns.name]                    # the reads are reported first
        assert (st["hits"], st["misses"]) == (10, 2)
        assert c.stats()["leases"] == 0

        # blocks on disk only: the lease promotes them (the index cannot serve them)
        c.sync()
        c.flush(tier="host")
        got = c.get(ns, keys)
        assert [bytes(g) for g in got] == [bytes(block_for(ns, k)) for k in keys]
        assert c.unleased_reads == 2
        assert c.get(ns, keys)[5].tobytes() == block_for(ns, keys[5]).tobytes()
        assert c.unleased_reads == 3                              # now ready in host RAM again
    with Client(daemon.socket, use_index=False) as c:             # no index: every get is leased
        assert len(c.get(ns, keys)) == 6 and c.unleased_reads == 0


def test_an_idle_readers_reads_reach_the_daemon_without_another_request(daemon):
    """Reads without a lease are reported in batches; a client that reads and then goes quiet
    must not keep them from the daemon (operators' stats, the blocks' recency for eviction)."""
    ns = make_ns()
    keys = chain(ns, 5, 3)
    with Client(daemon.socket) as writer, Client(daemon.socket) as reader, Client(daemon.socket) as watcher:
        put_chain(writer, ns, keys)
        assert writer.lookup(ns, keys) == 3
        assert len(reader.get(ns, keys)) == 3
        assert reader.unleased_reads == 1
        deadline = time.monotonic() + 10
        while (watcher.stats()["namespaces"][ns.name]["hits"] != 3   # the reader sends nothing more
               and time.monotonic() < deadline):
            time.sleep(0.02)
        assert watcher.stats()["namespaces"][ns.name]["hits"] == 3
        reporter = reader._hits_reporter
        assert reporter is not None and reporter.is_alive()
    reporter.join(5)
    assert not reporter.is_alive()                                # close ends it


def test_a_client_reads_its_own_writes_whether_leased_or_not(daemon):
    """A put's reply is read later (staged slots): until it is, a get that the index would cut
    short is leased, and the lease (sent after the put) sees the blocks."""
    ns = make_ns()
    with Client(daemon.socket) as c:
        for seed in range(20):
            keys = chain(ns, 100 + seed, 4)
            put_chain(c, ns, keys[:2])
            put_chain(c, ns, keys[2:], parent=keys[1])
            got = c.get(ns, keys)
            assert [bytes(g) for g in got] == [bytes(block_for(ns, k)) for k in keys], seed


@pytest.mark.slow
def test_reads_without_a_lease_are_exact_while_slots_are_reused(tmp_path):
    """Two reader processes get random chains of two sets of keys while the test flushes the
    host tier and puts one set, then the other, in turn: each set's blocks take the slots the
    other's just left, often while a reader copies them. Every block served is bit-exact; many
    gets needed no lease, and copies overtaken by a flush were discarded. (Without the check
    after the copy, this test fails: it serves the other set's bytes.)"""
    from .client_worker import run_flips
    flips, fields = run_flips(tmp_path, "read", 1500)
    verified = sum(f[1] for f in fields)
    unleased = sum(f[2] for f in fields)
    assert flips > 20 and verified > 1000 and unleased > 100, (flips, fields)


def test_a_dead_daemons_slots_are_not_read(tmp_path):
    ns = make_ns()
    keys = chain(ns, 7, 4)
    d = DaemonProc(tmp_path).start()
    try:
        c = Client(d.socket, retries=0)
        put_chain(c, ns, keys)
        assert c.lookup(ns, keys) == 4
        assert len(c.get(ns, keys)) == 4 and c.unleased_reads == 1
        os.kill(d.proc.pid, signal.SIGKILL)
        d.proc.wait(timeout=10)
        # its table and arena are still mapped here, unchanged — but the daemon is gone
        with pytest.raises(DaemonUnavailableError):
            c.get(ns, keys)
        assert c.unleased_reads == 1
        c.close()
    finally:
        d.stop()


def test_a_stalled_daemons_ready_blocks_are_still_read_and_exact(tmp_path):
    """A daemon stopped (SIGSTOP) past its heartbeat's freshness: reads of blocks it holds ready
    are still served, without waiting for it, and exact — nothing moves while it is stopped;
    its reads are reported once it runs again."""
    ns = make_ns()
    keys = chain(ns, 9, 4)
    d = DaemonProc(tmp_path).start()
    try:
        c = Client(d.socket, retries=0, timeout_s=5)
        put_chain(c, ns, keys)
        assert c.lookup(ns, keys) == 4
        os.kill(d.proc.pid, signal.SIGSTOP)
        try:
            time.sleep(0.3)                              # its table is no longer fresh
            assert not c._index.fresh()
            t0 = time.perf_counter()
            got = c.get(ns, keys)
            assert time.perf_counter() - t0 < 1.0          # not the 5 s request timeout
            assert [g.tobytes() for g in got] == [block_for(ns, k).tobytes() for k in keys]
            assert c.unleased_reads == 1
        finally:
            os.kill(d.proc.pid, signal.SIGCONT)
        deadline = time.monotonic() + 10
        while c.stats()["namespaces"][ns.name]["hits"] < 4 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert c.stats()["namespaces"][ns.name]["hits"] == 4
        c.close()
    finally:
        d.stop()


def test_reports_of_reads_are_checked_and_unanswered_when_asked(daemon):
    ns = make_ns()
    keys = chain(ns, 8, 2)
    with Client(daemon.socket) as c:
        put_chain(c, ns, keys)
    s = raw_conn(daemon.socket)
    send(s, {"id": 1, "op": "hello", "version": 1, "namespaces": [ns.to_dict()]})
    assert read_reply(s)["hits"] is True
    bad = [{"reads": "x"}, {"reads": [1]}, {"reads": [{"ns": ns.name, "keys": [b"short"], "asked": 1}]},
           {"reads": [{"ns": ns.name, "keys": keys, "asked": 1}]},          # fewer asked than read
           {"reads": [{"ns": ns.name, "keys": keys, "asked": True}]},
           {"reads": [{"ns": ns.name, "keys": keys * 3000, "asked": 6000}]},   # over the key limit
           {"reads": [{"ns": "nobody", "keys": keys, "asked": 2}]}]
    for i, fields in enumerate(bad):
        send(s, {"id": 10 + i, "op": "hits", "noreply": True, **fields})     # not answered ...
        send(s, {"id": 100 + i, "op": "hits", **fields})                     # ... or an error
        r = read_reply(s)
        assert r["id"] == 100 + i and "error" in r, r
    send(s, {"id": 200, "op": "hits", "noreply": True, "reads": [{"ns": ns.name, "keys": keys, "asked": 3}]})
    send(s, {"id": 201, "op": "stats"})
    r = read_reply(s)
    assert r["id"] == 201
    st = r["stats"]["namespaces"][ns.name]
    assert (st["hits"], st["misses"]) == (2, 1)                 # only the well-formed report
    s.close()
