"""The remote tier on real Redis servers: two nodes (two daemons, or two stores) share one
standalone server or a 3-master Cluster; what one node stored is served byte-exact on the
other after the first is gone; a foreign, truncated or corrupt value is never served; a server
killed, paused or restarted degrades the tier and never a local hit, and it recovers by itself."""

from __future__ import annotations

import signal
import time

import os

import numpy as np
import pytest

import tierd
from tierd import TieredStore
from tierd.tiers.disk import CorruptBlockError
from tierd.tiers.remote import RemoteTier

from .daemon import SMALL_TOML, DaemonProc
from .helpers import block_for, chain, make_ns, wait_for
from .redis_servers import RedisCluster, RedisServer

redis = pytest.importorskip("redis")


def remote_stats(s) -> dict:
    return s.stats()["tiers"]["remote"]


def node(url: str, **kw) -> TieredStore:
    return TieredStore(host_bytes=8 << 20, host_slab_bytes=1 << 20, remote_url=url, remote_timeout_s=0.3, **kw)


def put(s, ns, keys):
    s.put(ns, keys, [block_for(ns, k) for k in keys])


def served_exact(s, ns, keys) -> int:
    got = s.get(ns, keys)
    for g, k in zip(got, keys):
        assert g.tobytes() == block_for(ns, k).tobytes(), "a remote block came back wrong"
    return len(got)


@pytest.fixture
def server(tmp_path):
    srv = RedisServer(tmp_path)
    yield srv
    srv.stop()


@pytest.fixture(params=["standalone", "cluster"])
def backend(request, tmp_path):
    """One standalone server, or a 3-master Cluster."""
    srv = RedisServer(tmp_path) if request.param == "standalone" else RedisCluster(tmp_path)
    yield srv
    srv.stop()


def ns_keys(port: int, ns) -> int:
    """Values of namespace `ns` on one server (the tier's own probe key is not one)."""
    return sum(1 for _ in redis.Redis(port=port).scan_iter(match=b"tierd:" + ns.id.hex().encode() + b":*"))


def total_keys(backend, ns) -> int:
    nodes = backend.nodes if isinstance(backend, RedisCluster) else [backend]
    return sum(ns_keys(n.port, ns) for n in nodes)


def test_two_daemons_share_a_prefix_through_the_remote_tier(tmp_path, backend):
    """Node A prefills; A's daemon goes away; node B serves the prefix byte-exact from Redis
    (a standalone server, or a Cluster whose masters each hold part of it)."""
    ns = make_ns()
    keys = chain(ns, 1, 8)
    server = backend
    toml = f'[remote]\nurl = "{server.url}"\n' + SMALL_TOML
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    a = DaemonProc(tmp_path / "a", toml=toml).start()
    try:
        with tierd.connect(a.url) as c:
            put(c, ns, keys)
            wait_for(lambda: remote_stats(c)["writes"] == 8 and remote_stats(c)["queue"] == 0, what="write-behind")
    finally:
        assert a.stop() == 0
    b = DaemonProc(tmp_path / "b", toml=toml).start()
    try:
        with tierd.connect(b.url) as c:
            assert c.lookup(ns, keys) == 8                       # asked: the index cannot know
            assert c.lookup_all([(ns, keys)], host=True) == [(8, 0)]
            assert served_exact(c, ns, keys) == 8
            st = remote_stats(c)
            assert st["hits"] == 8 and st["corrupt_dropped"] == 0
            import json
            import jsonschema
            from .daemon import ROOT
            jsonschema.validate(c.stats(), json.loads((ROOT / "docs" / "stats.schema.json").read_text()))
            assert c.where(ns, keys) == ["host"] * 8             # promoted to B's host RAM
            out = __import__("subprocess").run(
                [__import__("sys").executable, "-m", "tierd", "stats", "--socket", b.socket],
                capture_output=True, text=True, timeout=60)
            assert out.returncode == 0 and "remote redis" in out.stdout
            assert total_keys(backend, ns) == 8
            assert c.flush("remote", namespace=ns) == 8
        assert total_keys(backend, ns) == 0
    finally:
        assert b.stop() == 0


def test_sync_remote_hands_a_nodes_cache_to_the_fleet(tmp_path, server):
    """With write-behind off nothing reaches the server until `tierd sync --remote`, which sends
    every host block the server lacks and returns once they are there; another node then serves
    them byte-exact. A second push sends nothing; a plain sync waits for queued write-behind."""
    import subprocess
    import sys
    ns = make_ns()
    keys = chain(ns, 3, 12)
    (tmp_path / "a").mkdir()
    a = DaemonProc(tmp_path / "a", toml=f'[remote]\nurl = "{server.url}"\nwrite_behind = false\n' + SMALL_TOML).start()
    try:
        with tierd.connect(a.url) as c:
            put(c, ns, keys)
            assert ns_keys(server.port, ns) == 0 and remote_stats(c)["writes"] == 0
            out = subprocess.run([sys.executable, "-m", "tierd", "sync", "--remote", "--socket", a.socket],
                                 capture_output=True, text=True, timeout=60)
            assert out.returncode == 0, out.stderr
            assert "remote: 12 blocks sent" in out.stdout
            assert ns_keys(server.port, ns) == 12                 # there when the command returned
            assert c.push_remote() == (0, 0)                      # nothing left to send
    finally:
        assert a.stop() == 0
    with node(server.url) as b:
        assert served_exact(b, ns, keys) == 12
        more = chain(ns, 4, 40)
        put(b, ns, more)                                          # write-behind on (the default)
        b.sync()                                                  # waits for the queue
        assert b.remote_pending() == 0 and ns_keys(server.port, ns) == 52


def test_foreign_truncated_and_corrupt_values_are_never_served(server):
    ns = make_ns()
    keys = chain(ns, 2, 6)
    r = redis.Redis.from_url(server.url)
    with node(server.url) as a:
        put(a, ns, keys)
        wait_for(lambda: remote_stats(a)["writes"] == 6)
    rk = [RemoteTier.rkey(ns.id, k) for k in keys]
    good = r.hgetall(rk[1])
    r.hset(rk[1], b"p", good[b"p"][:-100])                     # truncated
    r.hset(rk[3], mapping=good)                                # another block's value
    bad = bytearray(r.hget(rk[4], b"p"))
    bad[-1] ^= 0xFF
    r.hset(rk[4], b"p", bytes(bad))                            # one payload bit flipped
    r.delete(rk[5])
    r.set(rk[5], b"not a tierd value")                         # a foreign value of another type
    with node(server.url) as b:
        assert served_exact(b, ns, keys[:1]) == 1
        assert served_exact(b, ns, keys[1:3]) == 0             # the truncated one stops the prefix
        assert served_exact(b, ns, keys[2:3]) == 1
        assert served_exact(b, ns, keys[3:4]) == 0
        assert served_exact(b, ns, keys[4:5]) == 0
        assert served_exact(b, ns, keys[5:6]) == 0
        st = remote_stats(b)
        assert st["corrupt_dropped"] == 4 and st["hits"] == 2
    # never deleted: the tier is shared, and a value one node cannot verify is not its to remove
    assert all(r.exists(rk[i]) for i in (1, 3, 4, 5))


def test_a_value_claiming_a_huge_payload_costs_no_more_memory_than_a_block(server):
    """On b90e890 a self-consistent value whose header claimed 256 MiB made the reader
    allocate 256 MiB to read a 16 KiB block."""
    import tracemalloc
    from tierd.tiers.disk import _csum, pack_slot_header
    ns = make_ns()
    (k,) = chain(ns, 9, 1)
    big = b"\0" * (64 << 20)
    header = pack_slot_header(0, ns.dtype_bytes, ns.id, k, b"", len(big), ns.block_bytes, 0, 0, _csum(big))
    r = redis.Redis.from_url(server.url)
    r.hset(RemoteTier.rkey(ns.id, k), mapping={b"h": header, b"p": big})
    del big
    for direct in (True, False):
        with node(server.url) as b:
            b.remote.direct_reads = direct
            tracemalloc.start()
            try:
                assert b.get(ns, [k]) == []
                peak = tracemalloc.get_traced_memory()[1]
            finally:
                tracemalloc.stop()
            assert peak < 8 * ns.block_bytes + (1 << 20), f"{peak} bytes to refuse one value"
            assert remote_stats(b)["corrupt_dropped"] == 1


def test_server_errors_degrade_the_tier_and_never_delete_a_value(server):
    """-NOPERM (and -LOADING, -BUSY, -MASTERDOWN: the server's state, not the value's) was
    counted as a corrupt value on b90e890, and the keys were deleted from the shared tier."""
    ns = make_ns()
    keys = chain(ns, 8, 4)
    with node(server.url) as a:
        put(a, ns, keys)
        wait_for(lambda: remote_stats(a)["writes"] == 4)
    r = redis.Redis.from_url(server.url)
    r.execute_command("ACL", "SETUSER", "noread", "on", ">pw", "~*", "+@all", "-hmget", "-hstrlen")
    limited = server.url.replace("redis://", "redis://noread:pw@")
    with node(limited) as b:
        assert b.get(ns, keys) == []
        st = remote_stats(b)
        assert st["corrupt_dropped"] == 0 and st["errors"] >= 1 and st["degraded"]
    assert all(r.exists(RemoteTier.rkey(ns.id, k)) for k in keys)
    with node(server.url) as c:                    # the values are intact for everyone else
        assert served_exact(c, ns, keys) == 4


@pytest.mark.parametrize("direct", [True, False], ids=["direct-reads", "redis-py-reads"])
def test_one_batch_of_every_kind_of_value_reads_right_and_leaves_the_connection_in_step(server, direct):
    """fetch_many's replies, read straight into host RAM (or through redis-py), in one pipeline:
    raw and zstd values land byte-exact; absent keys are misses; damaged values are errors whose
    bytes never count as loaded; and the same connection serves the next batch correctly."""
    import numpy as np

    from tierd.tiers.base import BlockMeta
    ns_id, n = b"N" * 16, 64 << 10
    rng = np.random.default_rng(7)
    blocks = [rng.integers(0, 256, n, dtype=np.uint8) for _ in range(4)]
    blocks.append(np.repeat(np.arange(n // 64, dtype=np.uint16), 32).view(np.uint8))  # compressible
    keys = [bytes([i]) * 16 for i in range(13)]
    raw_t = RemoteTier(server.url)
    zstd_t = RemoteTier(server.url, codec="zstd")
    for i, b in enumerate(blocks):
        (zstd_t if i == 4 else raw_t).write(None, b, BlockMeta(ns_id, keys[i], None, n, 2))
    r = redis.Redis.from_url(server.url)
    rk = [RemoteTier.rkey(ns_id, k) for k in keys]
    assert len(r.hget(rk[4], b"p")) < n // 4                    # stored compressed
    good = r.hgetall(rk[0])
    r.hset(rk[5], mapping={b"h": good[b"h"], b"p": good[b"p"][:-1]})        # truncated
    r.hset(rk[6], mapping=good)                                             # another block's value
    flipped = bytearray(good[b"p"])
    flipped[n // 2] ^= 1
    hdr = r.hget(rk[1], b"h")
    r.hset(rk[7], mapping={b"h": raw_t.encode(blocks[1], BlockMeta(ns_id, keys[7], None, n, 2))[0],
                           b"p": bytes(flipped)})                           # payload bit flipped
    r.set(rk[8], b"not a tierd value")                                      # another type
    r.hset(rk[9], b"h", hdr)                                                # header only
    r.hset(rk[10], mapping={b"h": b"\xff" * 40, b"p": good[b"p"]})          # header garbage
    # keys[11]: absent; keys[12]: a header field far too long to be one, and a payload
    r.hset(rk[12], mapping={b"h": good[b"h"] + b"\0" * (200 << 10), b"p": good[b"p"]})
    t = RemoteTier(server.url)
    t.direct_reads = direct
    if direct:                             # nothing may fall back to redis-py's reads
        t.get_many = lambda *a: pytest.fail("the direct path fell back to redis-py")
    for _ in range(2):                     # the second round reuses the pooled connection
        dsts = [np.zeros(n, np.uint8) for _ in keys]
        out = t.fetch_many(ns_id, keys, dsts)
        for i in range(5):
            assert out[i] is None and np.array_equal(dsts[i], blocks[i]), i
        for i in (*range(5, 11), 12):
            assert isinstance(out[i], CorruptBlockError), (i, out[i])
        assert isinstance(out[11], KeyError)
    assert t.fetch_many(ns_id, [], []) == []


@pytest.mark.parametrize("direct", [True, False], ids=["direct-reads", "redis-py-reads"])
def test_a_lossy_value_never_answers_for_an_exact_namespace(server, direct):
    """A lossy namespace's blocks go to the server compressed and come back close; a value
    carrying a lossy codec under an exact namespace's key (a forgery, or a bug) is dropped and
    never served."""
    import numpy as np

    from tierd.tiers.base import BlockMeta
    exact, lossy = make_ns(), make_ns(tier_codec="fp8")
    rng = np.random.default_rng(11)
    data = (rng.standard_normal(exact.block_bytes // 2)).astype(np.float16).view(np.uint8)
    t = RemoteTier(server.url)
    t.direct_reads = direct
    k_exact, k_lossy = chain(exact, 1, 1)[0], chain(lossy, 1, 1)[0]
    t.write(None, data, BlockMeta(lossy.id, k_lossy, None, lossy.block_bytes, 2, "fp8", "float16"))
    t.write(None, data, BlockMeta(exact.id, k_exact, None, exact.block_bytes, 2, "fp8", "float16"))  # forged
    assert len(redis.Redis.from_url(server.url).hget(RemoteTier.rkey(lossy.id, k_lossy), b"p")) < 0.6 * len(data)
    out = np.zeros_like(data)
    assert t.fetch_many(lossy.id, [k_lossy], [out], lossy_ok=True) == [None]
    d, o = data.view(np.float16).astype(np.float32), out.view(np.float16).astype(np.float32)
    assert 0 < np.abs(o - d).max() <= np.abs(d).max() / 16
    (err,) = t.fetch_many(exact.id, [k_exact], [np.zeros_like(data)])
    assert isinstance(err, CorruptBlockError) and "lossy" in str(err)
    with node(server.url) as b:                   # through a store: dropped, counted, a miss
        assert b.get(exact, [k_exact]) == []
        assert remote_stats(b)["corrupt_dropped"] == 1
        got = b.get(lossy, [k_lossy])
        assert len(got) == 1 and np.array_equal(got[0], out)


def test_a_paused_killed_or_restarted_server_degrades_the_tier_and_never_a_local_hit(server):
    ns = make_ns()
    local, remote_only = chain(ns, 3, 4), chain(ns, 4, 4)
    with node(server.url) as a:
        put(a, ns, remote_only)
        wait_for(lambda: remote_stats(a)["writes"] == 4)
    with node(server.url) as b:
        put(b, ns, local)
        server.signal(signal.SIGSTOP)
        try:
            t0 = time.monotonic()
            assert b.lookup(ns, remote_only) == 0              # a timeout is a miss ...
            assert time.monotonic() - t0 < 2.0                 # ... bounded by the remote timeout
            t0 = time.monotonic()
            for _ in range(50):
                assert served_exact(b, ns, local) == 4          # local hits do not wait for the server
            assert time.monotonic() - t0 < 2.0
            assert remote_stats(b)["degraded"]
            put(b, ns, chain(ns, 5, 2))                          # puts go on; their write-behind is dropped
        finally:
            server.signal(signal.SIGCONT)
        wait_for(lambda: remote_stats(b)["degraded"] == "", what="recovery after the pause", timeout_s=15)
        assert b.lookup(ns, remote_only) == 4
        server.kill()
        assert served_exact(b, ns, local) == 4
        wait_for(lambda: b.lookup(ns, chain(ns, 6, 2)) == 0 and remote_stats(b)["degraded"], what="degraded")
        server.start()                                          # an empty server: the values are gone
        wait_for(lambda: remote_stats(b)["degraded"] == "", what="recovery after the restart", timeout_s=15)
        put(b, ns, chain(ns, 7, 2))
        r = redis.Redis.from_url(server.url)
        wait_for(lambda: len(list(r.scan_iter(match=b"tierd:" + ns.id.hex().encode() + b":*"))) >= 2,
                 what="writes resume")
        st = remote_stats(b)
        assert st["degraded_episodes"] >= 2 and st["errors"] >= 2


@pytest.mark.slow
def test_a_cluster_spreads_blocks_over_its_masters_and_serves_them(tmp_path):
    cluster = RedisCluster(tmp_path)
    try:
        ns = make_ns()
        keys = [k for s in range(6) for k in chain(ns, 100 + s, 8)]
        with node(cluster.url) as a:
            put(a, ns, keys)
            wait_for(lambda: remote_stats(a)["writes"] == len(keys), what="write-behind to the cluster")
            assert remote_stats(a)["cluster"]
        sizes = [ns_keys(n.port, ns) for n in cluster.nodes]
        assert sum(sizes) == len(keys) and all(sizes), sizes      # every master holds some
        with node(cluster.url) as b:
            for s in range(6):
                chunk = keys[8 * s:8 * s + 8]
                assert b.lookup(ns, chunk) == 8
                assert served_exact(b, ns, chunk) == 8
            assert b.flush("remote", namespace=ns) == len(keys)
        assert sum(ns_keys(n.port, ns) for n in cluster.nodes) == 0
    finally:
        cluster.stop()


@pytest.mark.slow
def test_a_cluster_master_failing_over_never_serves_wrong_bytes(tmp_path):
    """A master of a Cluster with replicas is killed mid-traffic: while the replica takes over,
    blocks are served exact or missed, never wrong; then the tier recovers by itself, serves what
    was replicated and takes new writes."""
    cluster = RedisCluster(tmp_path, replicas=1)
    try:
        ns = make_ns()
        chains = [chain(ns, 200 + s, 6) for s in range(8)]
        with node(cluster.url) as a:
            for keys in chains:
                put(a, ns, keys)
            wait_for(lambda: remote_stats(a)["writes"] == 48, what="write-behind to the cluster")
        def replicated(m) -> bool:
            info = redis.Redis(port=m.port).info("replication")
            offs = [v["offset"] for k, v in info.items() if k.startswith("slave") and isinstance(v, dict)]
            return bool(offs) and min(offs) >= info["master_repl_offset"]
        for m in cluster.masters():                       # the replicas have caught up
            wait_for(lambda: replicated(m), what="replication", timeout_s=20)
        victim = cluster.masters()[0]
        with node(cluster.url) as b:
            victim.kill()
            deadline = time.monotonic() + 60
            served = 0
            while time.monotonic() < deadline:            # traffic while the replica takes over
                for keys in chains:
                    served += served_exact(b, ns, keys)   # exact or a miss: never wrong
                survivor = next(n for n in cluster.nodes if n.proc.poll() is None)
                if cluster.wait_ok(survivor, 0.2) and not remote_stats(b)["degraded"]:
                    break
            assert cluster.wait_ok(survivor, 30)
            wait_for(lambda: not remote_stats(b)["degraded"], what="recovery after failover", timeout_s=30)
            b.flush("host")
            for keys in chains:
                assert served_exact(b, ns, keys) == 6     # replicated: all of it, exact
            fresh = chain(ns, 300, 6)
            put(b, ns, fresh)
            wait_for(lambda: remote_stats(b)["writes"] >= 6, what="writes after failover")
        with node(cluster.url) as c:
            assert served_exact(c, ns, fresh) == 6
    finally:
        cluster.stop()


def test_flushing_the_remote_tier_publishes_its_removals_and_snapshots_list_remote_blocks(server, tmp_path):
    """`tierd flush --tier remote` deletes only block values (not the probe key, which b90e890
    counted as a block), and routers hear of it: BlockRemoved events with the remote tier's
    medium; a snapshot lists what the remote tier holds (b90e890 published neither)."""
    import time
    import msgpack
    from .test_events import Subscriber, free_port
    ns = make_ns()
    keys = chain(ns, 12, 5)
    addr = f"tcp://127.0.0.1:{free_port()}"
    toml = f'events_addr = "{addr}"\n[remote]\nurl = "{server.url}"\n' + SMALL_TOML
    d = DaemonProc(tmp_path, toml=toml).start()
    r = redis.Redis.from_url(server.url)
    try:
        with tierd.connect(d.url) as c:
            put(c, ns, keys)
            wait_for(lambda: remote_stats(c)["writes"] == 5, what="write-behind")
            wait_for(lambda: r.exists(b"tierd:probe"), what="the probe key")
            # every live event so far has gone out (to nobody) before the subscriber connects:
            # what it gets of the remote tier is the snapshot's (on a loaded machine the
            # publisher could otherwise send the live BlockStored events after it connected)
            published = []

            def settled():
                published.append(c.stats()["daemon"]["events_published"])
                return len(published) > 3 and published[-1] >= 10 and published[-1] == published[-4]
            wait_for(settled, what="the live events to go out")
            sub = Subscriber(addr)                 # subscribes now: gets a snapshot
            time.sleep(1.0)

            def remote_events(kind):
                return [k for f in sub.drain() for e in msgpack.unpackb(f[2], raw=False)[1]
                        if e["type"] == kind and e.get("medium") == "STORAGE" and e.get("locality") == "REMOTE"
                        for k in e["block_hashes"]]
            assert sorted(wait_for(lambda: remote_events("BlockStored"), what="snapshot")) == sorted(keys)
            assert c.flush(tier="remote") == 5    # the probe key is not a block
            assert sorted(wait_for(lambda: remote_events("BlockRemoved"), what="removals")) == sorted(keys)
            assert r.exists(b"tierd:probe")
            sub.close()
    finally:
        assert d.stop() == 0


def test_with_a_fleet_key_a_planted_or_unsigned_value_is_never_served(server, tmp_path):
    """S9: anyone who can write tierd:* keys could plant KV every node served (a value's
    checksum is xxh3, which anyone can compute). With a fleet key, a value carries a MAC over
    header and payload; a value without a valid one is dropped (never deleted), both read paths."""
    key_file = tmp_path / "fleet.key"
    key_file.write_text(os.urandom(32).hex())
    key_file.chmod(0o600)
    ns = make_ns()
    keys = chain(ns, 13, 4)
    with node(server.url, remote_fleet_key_file=str(key_file)) as a:
        put(a, ns, keys)
        wait_for(lambda: remote_stats(a)["writes"] == 4)
    r = redis.Redis.from_url(server.url)
    rk = [RemoteTier.rkey(ns.id, k) for k in keys]
    # an attacker without the key: a self-consistent forged value (valid header and checksum)
    from tierd.tiers.disk import _csum, pack_slot_header
    forged = np.full(ns.block_bytes, 7, np.uint8).tobytes()
    header = pack_slot_header(0, ns.dtype_bytes, ns.id, keys[1], keys[0], len(forged), ns.block_bytes, 0, 0,
                              _csum(forged))
    r.hset(rk[1], mapping={b"h": header, b"p": forged})          # the old MAC no longer matches
    r.hdel(rk[2], b"m")                                          # an unsigned value
    for direct in (True, False):
        with node(server.url, remote_fleet_key_file=str(key_file)) as b:
            b.remote.direct_reads = direct
            assert served_exact(b, ns, keys) == 1                # only the intact first block
            assert served_exact(b, ns, keys[3:]) == 1            # signed and intact: served
            assert remote_stats(b)["corrupt_dropped"] >= 1
    with node(server.url) as c:                                  # a node without the key ...
        assert len(c.get(ns, keys[1:2])) == 1                    # ... cannot tell (documented)
    assert r.exists(rk[1]) and r.exists(rk[2])                   # dropped, never deleted
    key_file.chmod(0o644)
    with pytest.raises(Exception, match="may be read by other users"):
        node(server.url, remote_fleet_key_file=str(key_file))


def test_the_memory_of_the_server_stays_bounded_and_forgets_in_order():
    """S8: b90e890 remembered one entry per block written behind and trimmed only inside
    lookups, by a full scan; the memory now trims at every insert, oldest first."""
    from tierd.tiers.remote import RemoteMemory
    m = RemoteMemory(known_s=30.0, absent_s=1.0, max_entries=1000)
    for i in range(50_000):
        m.note_had(i.to_bytes(32, "little"), now=100.0)
    assert len(m) == 1000
    assert m.had((49_999).to_bytes(32, "little"), 100.0) and not m.had((0).to_bytes(32, "little"), 100.0)
    m.note_lacked(b"x" * 32, now=100.0)
    assert m.lacked(b"x" * 32, 100.5) and not m.lacked(b"x" * 32, 101.5)   # expires
    m.note_had(b"y" * 32, now=200.0)             # inserts after expiry drop the expired ones
    m.note_lacked(b"z" * 32, now=200.0)
    assert len(m) == 2
