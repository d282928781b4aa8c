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
            assert c.stats()["tiers"]["disk"]["demotions"] > 0           # both tiers were exercised
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
