"""The shared lookup index: clients answer lookups from the daemon's table without a request,
and the answer is the daemon's own — through puts, evictions, demotion to disk, promotion,
flushes, a stalled disk, a stopped daemon and a restart."""

from __future__ import annotations

import os
import random
import signal
import time

import pytest

import tierd
from tierd.client import Client
from tierd.index import DISK, HOST, WAYS, SharedIndex

from .daemon import SMALL_TOML, DaemonProc
from .helpers import block_for, chain, make_ns


def test_the_table_publishes_and_forgets_blocks(tmp_path):
    path = str(tmp_path / "idx")
    w = SharedIndex.create(path, 1 << 20, instance=7)
    r = SharedIndex.open(path, instance=7)
    assert SharedIndex.open(path, instance=8) is None          # another daemon's table
    ns = make_ns()
    keys = chain(ns, 1, 5)
    assert r.leading(ns.id, keys) == (0, 0)
    for k in keys[:3]:
        w.set(ns.id, k, HOST)
    w.set(ns.id, keys[3], DISK)
    assert r.leading(ns.id, keys) == (4, 3)
    assert r.leading(make_ns(model="other").id, keys) == (0, 0)   # the namespace is in the tag
    w.set(ns.id, keys[1], 0)
    assert r.leading(ns.id, keys) == (1, 1)
    w.set(ns.id, keys[1], HOST | DISK)
    w.set_disk_ok(False)                                          # a stalled disk: host only
    assert r.leading(ns.id, keys) == (3, 3)
    w.set_disk_ok(True)
    assert r.leading(ns.id, keys) == (4, 3)
    assert not r.fresh()
    w.beat()
    assert r.fresh()
    r.close()
    w.close()
    assert not os.path.exists(path)


def test_a_full_bucket_sends_the_reader_to_the_daemon(tmp_path):
    w = SharedIndex.create(str(tmp_path / "idx"), 1 << 20, instance=1)
    ns = make_ns()
    # keys that all fall in one bucket: one more than it has ways
    by_bucket: dict[int, list[bytes]] = {}
    seed = 0
    while True:
        k = chain(ns, seed, 1)[0]
        seed += 1
        b = int.from_bytes(SharedIndex.tag(ns.id, k)[:8], "little") % w.num_buckets
        by_bucket.setdefault(b, []).append(k)
        if len(by_bucket[b]) == WAYS + 1:
            same = by_bucket[b]
            break
    for k in same:
        w.set(ns.id, k, HOST)
    found = [w.leading(ns.id, [k]) for k in same]
    assert found[:WAYS] == [(1, 1)] * WAYS
    assert found[WAYS] is None                                    # not in the table: ask the daemon
    w.set(ns.id, same[0], 0)
    assert w.leading(ns.id, [same[0]]) is None                    # a miss in an overflowed bucket
    w.close()


@pytest.mark.slow
def test_index_answers_are_the_daemons_answers(tmp_path):
    d = DaemonProc(tmp_path).start()
    ns = make_ns()
    rng = random.Random(5)
    try:
        with Client(d.socket) as c, Client(d.socket, use_index=False) as ask:
            assert c._index is not None and ask._index is None
            chains = [chain(ns, s, 8) for s in range(40)]
            for step in range(300):
                keys = rng.choice(chains)
                op = rng.random()
                if op < 0.45:
                    n = rng.randint(1, 8)
                    c.put(ns, keys[:n], [block_for(ns, k) for k in keys[:n]])
                    assert c.lookup(ns, keys[:n]) == n                # a put is seen at once
                elif op < 0.6:
                    got = c.get(ns, keys)
                    assert [g.tobytes() for g in got] == [block_for(ns, k).tobytes() for k in keys[:len(got)]]
                elif op < 0.7:
                    c.sync(max_blocks=20)
                elif op < 0.78:
                    c.flush(rng.choice(["host", "disk"]))
                for q in rng.sample(chains, 4):
                    want = ask.lookup_all([(ns, q)], host=True)[0]
                    assert c.lookup_all([(ns, q)], host=True)[0] == want, step
                    assert c.lookup(ns, q) == want[0], step
                    assert c.where(ns, q) == ask.where(ns, q), step
            assert c.stats()["tiers"]["disk"]["demotions"] > 0           # both tiers were exercised
            asked = c.stats()["daemon"]["requests"]
            for q in chains[:5]:
                c.where(ns, q)                                           # from the table: no request
            assert c.stats()["daemon"]["requests"] == asked + 1          # (this stats call)
    finally:
        assert d.stop() == 0


def test_a_stopped_or_restarted_daemons_table_is_not_used(tmp_path):
    # host.keep off: the restarted daemon starts with no host blocks, so an answer from the old
    # daemon's table would show
    d = DaemonProc(tmp_path, toml=SMALL_TOML.replace('slab_bytes = "1MiB"', 'slab_bytes = "1MiB"\nkeep = false', 1)).start()
    ns = make_ns()
    keys = chain(ns, 3, 4)
    c = Client(d.socket, timeout_s=0.5, retries=1)
    try:
        c.put(ns, keys, [block_for(ns, k) for k in keys])
        assert c.lookup(ns, keys) == 4
        d.signal(signal.SIGSTOP)
        try:
            time.sleep(0.3)                                  # the heartbeat goes stale
            with pytest.raises(tierd.client.DaemonUnavailableError):
                c.lookup(ns, keys)                           # asked: the stopped daemon times out
        finally:
            d.signal(signal.SIGCONT)
        assert c.lookup(ns, keys) == 4                       # reconnected; the table again
        d.kill()
        d.start()                                            # a new daemon: host blocks are gone
        assert c.lookup(ns, keys) == 0
        assert c._index is not None and c.lookup(ns, keys) == 0
        c.put(ns, keys[:2], [block_for(ns, k) for k in keys[:2]])
        assert c.lookup(ns, keys) == 2
    finally:
        c.close()
        assert d.stop() == 0


def test_few_key_reads_answer_as_the_vectorised_ones(tmp_path, monkeypatch):
    """Lookups, `where` and reads without a lease of up to SMALL_KEYS keys read the table with
    plain integer reads; on the same table they answer exactly what the numpy path does: states,
    overflowed buckets, a stalled disk, ways being rewritten, no remote tier or one."""
    import tierd.index as ix
    w = SharedIndex.create(str(tmp_path / "idx"), 1 << 16, instance=2)     # few buckets: overflows
    r = SharedIndex.open(str(tmp_path / "idx"), instance=2)
    ns = make_ns()
    rng = random.Random(3)
    chains = [chain(ns, s, 12) for s in range(300)]
    for keys in chains:
        for k in keys:
            if rng.random() < 0.8:
                w.set(ns.id, k, rng.choice([HOST, DISK, HOST | DISK, 4]),
                      offset=rng.randrange(0, 1 << 30, 4096))
    for i in rng.sample(range(len(w._seqs_mv)), 20):
        w._seqs_mv[i] += 1                                                  # ways mid-rewrite
    assert any(r.overflow)
    checked = 0
    for disk_ok in (True, False):
        for final in (True, False):
            w.set_disk_ok(disk_ok)
            w.set_misses_final(final)
            for keys in chains:
                n = rng.randint(1, 12)
                small = (r.leading(ns.id, keys[:n]), r.host_run(ns.id, keys[:n]), r.where(ns.id, keys[:n]))
                monkeypatch.setattr(ix, "SMALL_KEYS", 0)
                big = (r.leading(ns.id, keys[:n]), r.host_run(ns.id, keys[:n]), r.where(ns.id, keys[:n]))
                monkeypatch.setattr(ix, "SMALL_KEYS", 16)
                assert small == big, keys[:n]
                if big[1] is not None:
                    assert r.unchanged(*small[1][2:4])
                    checked += 1
    assert checked > 100
    r.close()
    w.close()
