"""TieredStore behaviour: round trips, zero-copy forms, policy under pressure, bad input."""

import os
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
import torch

import tierd
from tierd import TieredStore
from tierd.errors import (BlockError, CapacityError, ConfigError, DirectoryLockedError,
                          DiskTierError, KeyFormatError, LeaseError, NotASlabFileError,
                          StoreClosedError, UnknownNamespaceError)

from .helpers import assert_exact, block_for, chain, make_ns, put_chain, small_config, wait_for




# -- round trips ------------------------------------------------------------------------------

@pytest.mark.parametrize("with_disk", [False, True])
def test_round_trip_bit_exact_for_several_namespaces(tmp_path, with_disk):
    spaces = [make_ns(), make_ns(kv_dtype="bfloat16", num_layers=3, model="other"),
              make_ns(kv_dtype="float32", head_dim=24, num_kv_heads=1)]  # 6144 B: not 4 KiB-aligned
    with TieredStore(small_config(tmp_path if with_disk else None, host_bytes="4MiB")) as s:
        chains = {ns: chain(ns, seed=i, n_blocks=12) for i, ns in enumerate(spaces)}
        for ns, keys in chains.items():
            assert put_chain(s, ns, keys) == len(keys)
        for ns, keys in chains.items():
            assert s.lookup(ns, keys) == len(keys)
            assert_exact(s, ns, keys)
        if with_disk:
            assert s.sync() == sum(map(len, chains.values()))
            assert s.flush(tier="host") == 36
            for ns, keys in chains.items():
                assert set(s.where(ns, keys)) == {"disk"}
                assert_exact(s, ns, keys)  # promoted from disk


def test_blocks_of_two_namespaces_never_mix(host_store):
    a, b = make_ns(model="a"), make_ns(model="b")
    keys = chain(a, 0, 4)
    put_chain(host_store, a, keys)
    assert host_store.lookup(b, keys) == 0  # same key bytes, other namespace
    assert host_store.get(b, keys) == []


def test_put_accepts_numpy_torch_bytes_and_refuses_wrong_size_or_dtype(host_store, ns):
    keys = chain(ns, 1, 4)
    ref = [block_for(ns, k) for k in keys]
    t = torch.from_numpy(ref[1].copy()).view(torch.float16).reshape(ns.block_shape)
    assert host_store.put(ns, keys[:3], [ref[0].view(np.float16), t, bytes(ref[2])]) == 3
    assert_exact(host_store, ns, keys[:3])
    before = host_store.stats()
    with pytest.raises(BlockError, match="bytes"):
        host_store.put(ns, [keys[3]], [ref[3][:-1]])
    with pytest.raises(BlockError, match="dtype"):
        host_store.put(ns, [keys[3]], [ref[3].view(np.float32)])
    with pytest.raises(BlockError, match="dtype"):
        host_store.put(ns, [keys[3]], [torch.zeros(ns.block_bytes // 2, dtype=torch.bfloat16)])
    with pytest.raises(KeyFormatError):
        host_store.put(ns, [b"short"], [ref[3]])
    after = host_store.stats()
    assert after["tiers"]["host"]["used_bytes"] == before["tiers"]["host"]["used_bytes"]
    assert host_store.lookup(ns, keys) == 3


def test_get_into_caller_buffers(host_store, ns):
    keys = chain(ns, 21, 3)
    put_chain(host_store, ns, keys)
    out = [torch.empty(ns.block_shape, dtype=torch.float16) for _ in range(4)]
    got = host_store.get(ns, keys + chain(ns, 22, 1), out=out)
    assert len(got) == 3 and got[0] is out[0]
    for k, t in zip(keys, got):
        assert np.array_equal(t.view(torch.uint8).reshape(-1).numpy(), block_for(ns, k))
    with pytest.raises(BlockError):
        host_store.get(ns, keys, out=[torch.empty(3)] * 3)


def test_put_skips_present_keys(host_store, ns):
    keys = chain(ns, 2, 6)
    assert put_chain(host_store, ns, keys[:4]) == 4
    assert put_chain(host_store, ns, keys) == 2


def test_lookup_counts_leading_hits_only(host_store, ns):
    keys = chain(ns, 3, 6)
    put_chain(host_store, ns, keys[:2])
    put_chain(host_store, ns, keys[3:])
    assert host_store.lookup(ns, keys) == 2
    assert len(host_store.get(ns, keys)) == 2


# -- zero-copy forms ----------------------------------------------------------------------------

def test_reserve_commit_makes_blocks_visible_only_at_commit(host_store, ns):
    keys = chain(ns, 4, 5)
    put_chain(host_store, ns, keys[:1])
    res = host_store.reserve(ns, keys)
    assert res.status == ["present"] + ["reserved"] * 4
    for k, buf in zip(keys, res.buffers):
        if buf is not None:
            buf[:] = block_for(ns, k)
    assert host_store.lookup(ns, keys) == 1
    assert host_store.commit(res) == 4
    assert_exact(host_store, ns, keys)
    with pytest.raises(LeaseError):
        host_store.commit(res)


def test_abort_gives_slots_back(host_store, ns):
    used = host_store.stats()["tiers"]["host"]["used_bytes"]
    res = host_store.reserve(ns, chain(ns, 5, 8))
    assert host_store.stats()["tiers"]["host"]["used_bytes"] > used
    host_store.abort(res)
    assert host_store.stats()["tiers"]["host"]["used_bytes"] == used
    assert host_store.lookup(ns, res.keys) == 0


def test_lease_gives_read_only_exact_views_and_releases_once(host_store, ns):
    keys = chain(ns, 6, 3)
    put_chain(host_store, ns, keys)
    lease = host_store.acquire(ns, keys)
    assert len(lease) == 3 and lease.tiers == ["host"] * 3
    for k, v in zip(keys, lease.buffers):
        assert np.array_equal(v, block_for(ns, k))
        with pytest.raises(ValueError):
            v[0] = 1
    assert host_store.stats()["leases"] == 1
    host_store.release(lease)
    with pytest.raises(LeaseError):
        host_store.release(lease)
    assert host_store.stats()["leases"] == 0


def test_drop_owner_releases_everything_a_client_held(host_store, ns):
    keys = chain(ns, 7, 4)
    put_chain(host_store, ns, keys[:2])
    host_store.acquire(ns, keys[:2], owner="conn-1")
    host_store.reserve(ns, keys[2:], owner="conn-1")
    assert host_store.drop_owner("conn-1") == (1, 1)
    st = host_store.stats()
    assert st["leases"] == 0 and st["reservations"] == 0
    assert host_store.lookup(ns, keys) == 2


# -- policy under pressure -----------------------------------------------------------------------

def test_leased_blocks_survive_pressure(ns):
    with TieredStore(small_config(None)) as s:  # 1 MiB host, 16 KiB blocks: 64 slots, no disk
        hot = chain(ns, 10, 4)
        put_chain(s, ns, hot)
        lease = s.acquire(ns, hot)
        for seed in range(200):
            put_chain(s, ns, chain(ns, 1000 + seed, 1))
        assert s.stats()["tiers"]["host"]["evictions"] > 100
        for k, v in zip(hot, lease.buffers):
            assert np.array_equal(v, block_for(ns, k))
        assert s.where(ns, hot) == ["host"] * 4
        s.release(lease)


def test_pressure_demotes_to_disk_then_evicts_in_lru_order(tmp_path, ns):
    with TieredStore(small_config(tmp_path)) as s:
        singles = [chain(ns, 2000 + i, 1)[0] for i in range(600)]
        for k in singles:
            put_chain(s, ns, [k])
        st = s.stats()["tiers"]
        assert st["host"]["used_bytes"] <= st["host"]["capacity_bytes"]
        assert st["disk"]["demotions"] > 0 and st["disk"]["evictions"] > 0
        # once blocks with no disk copy pass host_dirty_ratio (0.2) of the host, the demoter
        # writes the oldest down (to half of it) and rests; host RAM stays full of clean blocks
        deadline = time.monotonic() + 10
        while s.stats()["tiers"]["host"]["dirty_bytes"] > 0.2 * (1 << 20) and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.2)
        host = s.stats()["tiers"]["host"]
        assert host["dirty_bytes"] <= 0.2 * (1 << 20) and host["used_bytes"] > 0.9 * (1 << 20)
        where = s.where(ns, singles)
        order = {"": 0, "disk": 1, "host+disk": 2, "host": 2}
        ranks = [order[w] for w in where]
        # Older blocks go first. Host RAM is written down ahead of eviction (it stays full of
        # clean blocks), so a block whose write was in flight when its turn came is skipped
        # for a newer one, never more than one write batch of them.
        late = [i for i, r in enumerate(ranks) if r > min(ranks[i:])]
        assert len(late) <= s.WRITE_BATCH, f"older blocks must be demoted/evicted before newer ones: {late}"
        assert ranks[0] == 0 and ranks[-1] == 2
        on_disk = [k for k, w in zip(singles, where) if w == "disk"]
        in_host = [k for k, w in zip(singles, where) if "host" in w]
        for k in in_host[-5:] + on_disk[-3:]:
            assert_exact(s, ns, [k])


def test_without_a_disk_tier_host_ram_stays_full_and_a_put_on_the_event_loop_takes_the_coldest_slot(ns):
    """With no disk tier an eviction is a drop (no I/O): host RAM is not emptied down to the
    low watermark ahead of need (that only loses cached blocks), and a put on the daemon's event
    loop (inline) takes the coldest block's slot at once instead of answering WouldBlock."""
    cap = 1 << 20
    with TieredStore(small_config(None)) as s:
        keys = [chain(ns, 5000 + i, 1)[0] for i in range(200)]     # 3 MiB through a 1 MiB host
        for k in keys:
            put_chain(s, ns, [k])
        time.sleep(0.3)                                             # (several demoter periods)
        host = s.stats()["tiers"]["host"]
        assert host["used_bytes"] == cap, "host RAM was emptied ahead of need"
        where = s.where(ns, keys)
        assert not any(where[:-64]) and all("host" in w for w in where[-64:])
        fresh = [chain(ns, 9100 + i, 1)[0] for i in range(4)]
        res = s.reserve(ns, fresh, inline=True)
        assert res.status == ["reserved"] * 4
        for k, v in zip(fresh, res.buffers):
            v[:] = block_for(ns, k)
        s.commit(res)
        assert_exact(s, ns, fresh + keys[-60:])                     # the 4 coldest made room
        assert s.lookup(ns, keys[-64:-60]) == 0


def test_host_ram_stays_full_of_clean_blocks_and_neither_a_put_nor_a_promotion_waits_for_a_write(tmp_path, ns):
    """Past the high watermark the demoter writes blocks down ahead of eviction instead of
    emptying host RAM: the host tier stays full of cached blocks, and the room a promotion or
    a put needs is taken from clean blocks (their disk copies stay), with no write on the way."""
    cap = 1 << 20
    with TieredStore(small_config(tmp_path)) as s:
        keys = [chain(ns, 3000 + i, 1)[0] for i in range(200)]     # 3 MiB through a 1 MiB host
        for k in keys:
            put_chain(s, ns, [k])
        wait_for(lambda: s.stats()["tiers"]["host"]["dirty_bytes"] <= 0.2 * cap, what="the demoter to rest")
        settled = [-1]

        def resting() -> bool:   # its last write batch has landed: no write for a while
            time.sleep(0.2)
            n, settled[0] = settled[0], s.stats()["tiers"]["disk"]["demotions"]
            return n == settled[0]
        wait_for(resting, what="the demoter's writes to end")
        host, disk = s.stats()["tiers"]["host"], s.stats()["tiers"]["disk"]
        assert host["used_bytes"] >= 0.95 * cap, "host RAM was emptied instead of kept full of clean blocks"
        assert host["clean_bytes"] + host["dirty_bytes"] == host["used_bytes"]
        where = s.where(ns, keys)
        on_disk = [k for k, w in zip(keys, where) if w == "disk"]
        in_host = [k for k, w in zip(keys, where) if "host" in w]
        assert len(on_disk) > 60 and len(in_host) > 40
        writes = disk["demotions"]
        # promotions: every slot they take is a clean block's (no free slot is left)
        for k in on_disk[-40:]:
            assert_exact(s, ns, [k])
        after = s.stats()["tiers"]
        assert after["disk"]["promotions"] >= 40 and after["host"]["evictions"] > host["evictions"]
        assert after["disk"]["demotions"] == writes, "a promotion waited for a block to be written down"
        # a put on the daemon's event loop (inline) finds room the same way: no WouldBlock
        fresh = [chain(ns, 9000 + i, 1)[0] for i in range(4)]
        res = s.reserve(ns, fresh, inline=True)
        assert res.status == ["reserved"] * 4
        # (counted before the commit: the four dirty blocks it adds may, rightly, wake the
        # demoter to write older ones ahead)
        assert s.stats()["tiers"]["disk"]["demotions"] == writes, "the put's room waited for a write"
        for k, v in zip(fresh, res.buffers):
            v[:] = block_for(ns, k)
        s.commit(res)
        assert_exact(s, ns, fresh)
        # whatever left host RAM is still served exact, from disk
        for k in in_host[:10] + on_disk[:10]:
            assert_exact(s, ns, [k])


def test_an_inline_reserve_that_would_need_a_write_changes_nothing_and_says_so(tmp_path, ns):
    """On the daemon's event loop a reserve may only drop clean blocks: when the coldest block
    has no disk copy (here the SSD admission filter kept it from being written ahead), it
    raises WouldBlock having written nothing, and the worker's reserve then does the rest."""
    from tierd.store import WouldBlock
    cfg = small_config(tmp_path, disk_admit_min_hits=1, host_high_watermark=1.0, host_low_watermark=1.0)
    with TieredStore(cfg) as s:
        keys = [chain(ns, 5000 + i, 1)[0] for i in range(100)]   # 1.6 MiB through a 1 MiB host
        for k in keys:
            put_chain(s, ns, [k])
        assert s.host.alloc.free_slot_count(16384) == 0
        coldest = next(k for k, w in zip(keys, s.where(ns, keys)) if w == "host")
        before = s.stats()["tiers"]
        with pytest.raises(WouldBlock):
            s.reserve(ns, [coldest, chain(ns, 9999, 1)[0]], inline=True)
        after = s.stats()["tiers"]
        assert after["disk"]["demotions"] == before["disk"]["demotions"]
        assert s.stats()["reservations"] == 0
        res = s.reserve(ns, [coldest, chain(ns, 9999, 1)[0]])      # the worker's way
        assert res.status[1] == "reserved"
        s.abort(res)


def test_a_disk_smaller_than_host_ram_is_not_rewritten_over_and_over(tmp_path, ns):
    """Writing host blocks down ahead of eviction stops once their copies fill half the disk:
    past that, each write would evict another host block's copy, to be written again later."""
    cfg = small_config(tmp_path, host_bytes="2MiB", disk_bytes="1MiB", disk_slab_bytes="256KiB",
                       disk_file_bytes="1MiB")
    with TieredStore(cfg) as s:
        keys = [chain(ns, 4000 + i, 1)[0] for i in range(150)]     # 2.3 MiB
        for k in keys:
            put_chain(s, ns, [k])
        time.sleep(0.5)                                           # the demoter's passes settle
        before = s.stats()["tiers"]
        time.sleep(1.0)                                           # ~20 more passes, nothing put
        after = s.stats()["tiers"]
        assert after["disk"]["demotions"] == before["disk"]["demotions"], "the disk is rewritten while idle"
        assert after["host"]["clean_bytes"] <= 0.5 * (1 << 20) + 64 * 1024
        # each block written down at most once (without the bound: 259 writes of 150 blocks)
        assert before["disk"]["demotions"] <= len(keys)
        where = s.where(ns, keys)
        assert sum(1 for w in where if w) > 100
        assert_exact(s, ns, [k for k, w in zip(keys, where) if w][-20:])


@pytest.mark.parametrize("policy", ["lru", "s3fifo"])
@pytest.mark.parametrize("one_put_per_block", [False, True])
def test_descendants_are_evicted_before_ancestors(ns, policy, one_put_per_block):
    with TieredStore(small_config(None, eviction_policy=policy)) as s:
        keys = chain(ns, 11, 40)
        if one_put_per_block:
            for i, k in enumerate(keys):
                put_chain(s, ns, [k], parent=keys[i - 1] if i else None)
        else:
            put_chain(s, ns, keys)
        for seed in range(50):
            put_chain(s, ns, chain(ns, 3000 + seed, 1))
        present = [w == "host" for w in s.where(ns, keys)]
        assert not all(present), "the test must cause evictions in the chain"
        n = present.index(False) if False in present else len(present)
        assert present == [True] * n + [False] * (len(keys) - n), "a chain keeps a prefix, never a gap"


def test_hit_on_disk_promotes_to_host_and_keeps_the_disk_copy(store, ns):
    keys = chain(ns, 12, 8)
    put_chain(store, ns, keys)
    store.sync()
    store.flush(tier="host")
    assert store.where(ns, keys) == ["disk"] * 8
    lease = store.acquire(ns, keys)
    assert lease.tiers == ["disk"] * 8
    store.release(lease)
    assert store.where(ns, keys) == ["host+disk"] * 8
    assert store.stats()["tiers"]["disk"]["promotions"] == 8
    assert store.flush(tier="host") == 8
    assert_exact(store, ns, keys)


def test_admission_filter_keeps_one_off_blocks_off_the_ssd(tmp_path, ns):
    with TieredStore(small_config(tmp_path, disk_admit_min_hits=2)) as s:
        hot = chain(ns, 13, 4)
        put_chain(s, ns, hot)
        s.get(ns, hot)
        s.get(ns, hot)
        cold = [chain(ns, 4000 + i, 1)[0] for i in range(150)]
        for k in cold:
            put_chain(s, ns, [k])
        st = s.stats()["tiers"]["disk"]
        assert st["admission_rejected"] > 0
        assert all("disk" not in w for w in s.where(ns, cold[:20]))
        assert all(w for w in s.where(ns, hot))


def test_flush_by_tier_and_namespace(store):
    a, b = make_ns(model="a"), make_ns(model="b")
    ka, kb = chain(a, 1, 5), chain(b, 2, 5)
    put_chain(store, a, ka)
    put_chain(store, b, kb)
    store.sync()
    assert store.flush(tier="disk", namespace=a.name) == 5
    assert store.where(a, ka) == ["host"] * 5 and store.where(b, kb) == ["host+disk"] * 5
    assert store.flush(namespace=b) == 5
    assert store.lookup(b, kb) == 0 and store.lookup(a, ka) == 5
    with pytest.raises(UnknownNamespaceError):
        store.flush(namespace="0123456789abcdef")
    with pytest.raises(tierd.TierdError):
        store.flush(tier="tape")


def test_flushed_disk_blocks_do_not_come_back_after_reopen(tmp_path, ns):
    cfg = small_config(tmp_path)
    keys = chain(ns, 14, 6)
    with TieredStore(cfg) as s:
        put_chain(s, ns, keys)
        s.sync()
        s.flush(tier="all")
    os.unlink(tmp_path / "disk" / "index.ckpt")  # force the header scan
    with TieredStore(cfg) as s:
        assert s.lookup(ns, keys) == 0


def test_capacity_bounds_hold_under_pressure(tmp_path, ns):
    cfg = small_config(tmp_path)
    with TieredStore(cfg) as s:
        assert os.fstat(s.host.arena.fd).st_size == 1 << 20
        for i in range(400):
            put_chain(s, ns, chain(ns, 5000 + i, 2))
            if i % 50 == 0:
                st = s.stats()["tiers"]
                for t in ("host", "disk"):
                    assert st[t]["used_bytes"] <= st[t]["capacity_bytes"]
        s.sync()
        files = list((tmp_path / "disk").glob("slab-*.tds"))
        assert sum(f.stat().st_size for f in files) <= 8 << 20
        assert sum(f.stat().st_blocks * 512 for f in files) <= 8 << 20


def test_stats_report_tiers_and_namespaces(store, ns):
    keys = chain(ns, 15, 4)
    put_chain(store, ns, keys)
    store.get(ns, keys + chain(ns, 16, 2))
    st = store.stats()
    for tier in ("host", "disk"):
        for field in ("capacity_bytes", "used_bytes", "free_bytes", "blocks", "evictions",
                      "demotions", "promotions", "bytes_in", "bytes_out", "waste_bytes",
                      "waste_ratio", "corrupt_dropped"):
            assert field in st["tiers"][tier]
    n = st["namespaces"][ns.name]
    assert (n["hits"], n["misses"], n["puts"], n["host_blocks"]) == (4, 2, 4, 4)
    assert n["hit_rate"] == pytest.approx(4 / 6)
    assert 0 <= st["tiers"]["host"]["waste_ratio"] < 1


@pytest.mark.parametrize("codec", ["none", "zstd"])
def test_disk_codecs_round_trip(tmp_path, codec):
    ns = make_ns()
    with TieredStore(small_config(tmp_path, disk_codec=codec)) as s:
        keys = chain(ns, 17, 6)
        # KV-like fp16 data (compressible exponents) and random bytes (incompressible)
        rng = np.random.default_rng(0)
        blocks = [rng.standard_normal(ns.block_bytes // 2).astype(np.float16) for _ in keys[:3]]
        blocks += [block_for(ns, k) for k in keys[3:]]
        s.put(ns, keys, blocks)
        s.sync()
        s.flush(tier="host")
        got = s.get(ns, keys)
        assert all(np.array_equal(g, np.asarray(b).view(np.uint8)) for g, b in zip(got, blocks))


# -- bad input and set-up errors -----------------------------------------------------------------

def test_capacity_smaller_than_one_block_is_refused_without_partial_state(host_store):
    big = make_ns(num_layers=64, head_dim=128, num_kv_heads=8, block_tokens=64)  # 16 MiB blocks
    with pytest.raises(CapacityError, match="raise host_bytes"):
        host_store.put(big, chain(big, 0, 1), [np.zeros(big.block_bytes, np.uint8)])
    assert host_store.stats()["namespaces"] == {}


def test_block_larger_than_a_slab_is_refused_with_advice():
    ns = make_ns(num_layers=16)  # 128 KiB blocks
    with TieredStore(small_config(None, host_slab_bytes="64KiB")) as s:
        with pytest.raises(CapacityError, match="slab_bytes"):
            s.register(ns)


def test_disk_tier_smaller_than_one_block_is_refused(tmp_path):
    ns = make_ns(num_layers=64)  # 1 MiB blocks
    with TieredStore(small_config(tmp_path, host_bytes="4MiB", host_slab_bytes="2MiB",
                                  disk_bytes="512KiB")) as s:
        with pytest.raises(CapacityError, match="disk tier"):
            s.register(ns)
        assert s.stats()["namespaces"] == {}


def test_buffered_io_mode_round_trips(tmp_path, ns):
    """Buffered I/O + fdatasync: the mode used where the filesystem refuses O_DIRECT (the
    probe at open picks it by itself) or where the operator turns O_DIRECT off."""
    with TieredStore(small_config(tmp_path, disk_direct_io=False)) as s:
        assert s.stats()["tiers"]["disk"]["direct_io"] is False
        keys = chain(ns, 30, 4)
        put_chain(s, ns, keys)
        s.sync()
        s.flush(tier="host")
        assert_exact(s, ns, keys)


def test_unknown_namespace_name_is_refused(host_store):
    with pytest.raises(UnknownNamespaceError, match="unknown namespace"):
        host_store.lookup("feedfacefeedface", [b"k" * 16])
    with pytest.raises(TypeError):
        host_store.lookup(42, [b"k" * 16])


def test_disk_path_that_is_a_file_is_refused(tmp_path):
    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(DiskTierError, match="not a directory"):
        TieredStore(small_config(None, disk_path=str(f)))


def test_unwritable_disk_path_is_refused(tmp_path):
    d = tmp_path / "ro"
    d.mkdir()
    d.chmod(0o555)
    code = (
        "import os, sys\n"
        "from tierd import TieredStore\nfrom tierd.errors import DiskTierError\n"
        "if os.getuid() == 0: os.setgid(65534); os.setuid(65534)\n"
        "try:\n"
        f"    TieredStore(host_bytes='1MiB', disk_path={str(d / 'cache')!r}, disk_bytes='4MiB')\n"
        "except DiskTierError as e:\n    print('REFUSED', e); sys.exit(0)\n"
        "sys.exit(1)\n")
    tmp_path.chmod(0o755)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       cwd=os.path.dirname(os.path.dirname(__file__)))
    assert r.returncode == 0, r.stderr
    assert "REFUSED" in r.stdout and "permissions" in r.stdout


def test_a_file_that_is_not_a_slab_file_is_refused(tmp_path):
    d = tmp_path / "disk"
    d.mkdir()
    (d / "slab-0000.tds").write_bytes(b"definitely not tierd" * 1000)
    with pytest.raises(NotASlabFileError, match="not a tierd slab file"):
        TieredStore(small_config(tmp_path))
    # the refusal left nothing locked or half-open: after fixing, the store opens
    (d / "slab-0000.tds").unlink()
    TieredStore(small_config(tmp_path)).close()


def test_two_stores_cannot_open_one_directory(tmp_path):
    with TieredStore(small_config(tmp_path)):
        with pytest.raises(DirectoryLockedError, match="in use by another tierd store"):
            TieredStore(small_config(tmp_path))
    TieredStore(small_config(tmp_path)).close()


def test_a_smaller_disk_bytes_makes_the_tier_fit_it(tmp_path):
    """Lowering disk_bytes drops the last slab files (here all: not one fits) and opens within
    the new size (tests/test_disk_grow.py covers keeping the blocks of the files that fit)."""
    TieredStore(small_config(tmp_path)).close()
    with TieredStore(small_config(tmp_path, disk_bytes="2MiB")) as s:
        assert s.stats()["tiers"]["disk"]["capacity_bytes"] == 2 << 20
    assert sum(f.stat().st_size for f in (tmp_path / "disk").glob("slab-*.tds")) <= 2 << 20


def test_closed_store_refuses_work(ns):
    s = TieredStore(small_config(None))
    s.close()
    with pytest.raises(StoreClosedError):
        s.lookup(ns, chain(ns, 0, 1))


def test_connect_embedded_url(tmp_path, ns):
    s = tierd.connect(f"embedded://?host=2MiB&host_slab=256KiB&disk={tmp_path}/d&disk_bytes=8MiB"
                      "&disk_slab=1MiB&policy=s3fifo&codec=zstd")
    try:
        assert isinstance(s, TieredStore) and s.config.eviction_policy == "s3fifo"
        keys = chain(ns, 1, 3)
        put_chain(s, ns, keys)
        assert_exact(s, ns, keys)
    finally:
        s.close()
    with pytest.raises(ConfigError, match="unknown parameter"):
        tierd.connect("embedded://?hots=1GiB")
    with pytest.raises(ConfigError, match="unknown scheme"):
        tierd.connect("redis://x")


# -- concurrency ----------------------------------------------------------------------------------

@pytest.mark.slow
def test_eight_threads_mixed_ops_lose_and_corrupt_nothing(tmp_path):
    ns = make_ns()
    cfg = small_config(tmp_path, host_bytes="2MiB", disk_bytes="32MiB", disk_file_bytes="8MiB")
    errors, stop = [], threading.Event()
    with TieredStore(cfg) as s:
        def worker(tid):
            rng = np.random.default_rng(tid)
            try:
                for it in range(150):
                    keys = chain(ns, int(rng.integers(0, 60)), int(rng.integers(1, 6)))
                    op = rng.integers(0, 10)
                    if op < 4:
                        put_chain(s, ns, keys)
                    elif op < 8:
                        got = s.get(ns, keys)
                        for k, g in zip(keys, got):
                            if not np.array_equal(g, block_for(ns, k)):
                                errors.append(f"thread {tid}: wrong bytes for {k.hex()}")
                    elif op < 9:
                        n = s.lookup(ns, keys)
                        assert 0 <= n <= len(keys)
                    else:
                        s.flush(tier=["host", "disk", "all"][it % 3]) if rng.random() < 0.2 else s.sync()
            except Exception as e:  # noqa: BLE001 - reported below
                errors.append(f"thread {tid}: {e!r}")

        threads = [threading.Thread(target=worker, args=(t,)) for t in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=240)
        stop.set()
        assert not any(t.is_alive() for t in threads), "deadlock"
        assert errors == []
        st = s.stats()
        assert st["leases"] == 0 and st["reservations"] == 0
        # a committed block is served until policy evicts it: put then get in one thread
        keys = chain(ns, 999, 5)
        put_chain(s, ns, keys)
        assert_exact(s, ns, keys)
