"""A flush lasts: after `tierd flush` (all, one tier, one namespace) and a kill -9, no block
it dropped is ever served again — copies evicted from disk before the flush included (their
headers were still valid on disk) — while what it did not drop survives as synced."""

import time

import numpy as np
import pytest

from tierd import TieredStore
from tierd.client import Client

from .daemon import DaemonProc
from .helpers import block_for, chain, make_ns, small_config


def fill_disk_past_capacity(c, ns, n_prompts):
    """Put and sync prompt after prompt into a disk that holds fewer: the disk evicts."""
    keys = []
    for i in range(n_prompts):
        ks = chain(ns, 1000 + i, 20)
        c.put(ns, ks, [block_for(ns, k) for k in ks])
        c.sync()
        keys += ks
    return keys


def flush_during_a_sync(store, faults, ns, tier: str) -> list[bytes]:
    """Put 4 blocks, sync them with every disk write hanging, flush `tier` of `ns` while the
    writes are in flight (host copies pinned, sequence numbers taken), then let the writes
    land. Returns the 4 keys."""
    import threading
    (warm,) = chain(ns, 4, 1)   # its slab header and namespace record are on disk first
    store.put(ns, [warm], [block_for(ns, warm)])
    store.sync()
    keys = chain(ns, 3, 4)
    store.put(ns, keys, [block_for(ns, k) for k in keys])
    faults.write_text("write=hang:5")
    t = threading.Thread(target=store.sync)
    t.start()
    time.sleep(0.3)                       # the writes have their sequence numbers and hang
    store.flush(tier=tier, namespace=ns)
    faults.write_text("")
    t.join(10)
    return keys


def served(c, ns, keys):
    return sum(c.lookup(ns, [k]) for k in keys)


@pytest.mark.slow
@pytest.mark.parametrize("how", ["all", "disk", "namespace"])
def test_flushed_blocks_never_come_back_after_kill_9(tmp_path, how):
    d = DaemonProc(tmp_path, host_bytes="4MiB", disk_bytes="12MiB").start()
    a, b = make_ns(model="flushed"), make_ns(model="kept")
    try:
        with Client(d.socket) as c:
            flushed = fill_disk_past_capacity(c, a, 40)          # 800 blocks, the disk holds ~500
            st = c.stats()["tiers"]["disk"]
            assert st["evictions"] > 0, "the disk evicted nothing: the test exercises nothing"
            kept = chain(b, 7, 10) if how == "namespace" else []
            if kept:
                c.put(b, kept, [block_for(b, k) for k in kept])
                c.sync()
            if how == "namespace":
                c.flush(tier="all", namespace=a)
            else:
                c.flush(tier=how)
                if how == "disk":
                    c.flush(tier="host")   # host copies are not what this flush dropped
            assert served(c, a, flushed) == 0
        d.kill()
        d.start()
        with Client(d.socket) as c:
            assert served(c, a, flushed) == 0, "flushed blocks came back after kill -9"
            if kept:
                got = c.get(b, kept)
                assert len(got) == len(kept)
                assert all(np.array_equal(g, block_for(b, k)) for g, k in zip(got, kept))
            # the cache works as before: new puts of flushed keys are served and survive
            again = flushed[:20]
            c.put(a, again, [block_for(a, k) for k in again])
            c.sync()
        d.kill()
        d.start()
        with Client(d.socket) as c:
            got = c.get(a, again)
            assert len(got) == 20 and all(np.array_equal(g, block_for(a, k)) for g, k in zip(got, again))
    finally:
        if d.alive():
            assert d.stop() == 0


def test_a_write_in_flight_during_a_flush_is_not_kept_on_disk(tmp_path):
    """A copy whose write began before a flush of its namespace is dead: it never enters the
    index, and a restart does not bring it back."""
    store = TieredStore(small_config(tmp_path, disk_fault_file=str(tmp_path / "faults")))
    ns = make_ns()
    keys = flush_during_a_sync(store, tmp_path / "faults", ns, "disk")
    assert "disk" not in "".join(store.where(ns, keys))
    store.close()
    again = TieredStore(small_config(tmp_path))
    try:
        assert again.lookup(ns, keys) == 0
    finally:
        again.close()


def test_a_host_flush_during_a_write_down_leaves_the_block_on_disk_and_the_store_whole(tmp_path):
    """A flush of the host tier while blocks are being written down drops their host copies
    once the writes land, and keeps the blocks: served exact from disk, and the disk tier's
    eviction (which walks every indexed disk copy) still works after."""
    store = TieredStore(small_config(tmp_path, disk_fault_file=str(tmp_path / "faults")))
    try:
        ns = make_ns()
        keys = flush_during_a_sync(store, tmp_path / "faults", ns, "host")
        assert store.where(ns, keys) == ["disk"] * 4
        got = store.get(ns, keys)
        assert [g.tobytes() for g in got] == [block_for(ns, k).tobytes() for k in keys]
        more = [k for i in range(30) for k in chain(ns, 100 + i, 20)]   # 9 MiB through an 8 MiB disk
        for i in range(0, len(more), 20):
            store.put(ns, more[i:i + 20], [block_for(ns, k) for k in more[i:i + 20]])
            store.sync()
        assert store.stats()["tiers"]["disk"]["evictions"] > 0
        tail = more[-20:]
        assert [g.tobytes() for g in store.get(ns, tail)] == [block_for(ns, k).tobytes() for k in tail]
    finally:
        store.close()


def test_a_copy_read_while_flushed_rewritten_and_its_disk_lost_is_let_go_cleanly(tmp_path):
    """A block flushed while a read of its disk copy is in flight, then written again (the old
    record becomes an orphan), then its disk directory lost: when the read ends, the orphan's
    copy is let go with the lost tier, and the block written again is served exact."""
    import shutil
    import threading
    faults = tmp_path / "faults"
    store = TieredStore(small_config(tmp_path, disk_fault_file=str(faults), disk_stall_s=30.0))
    try:
        ns = make_ns()
        (key,) = chain(ns, 7, 1)
        store.put(ns, [key], [block_for(ns, key)])
        store.sync()
        store.flush(tier="host", namespace=ns)                # on disk only
        faults.write_text("read=hang:10")
        errors, got = [], []

        def read():
            try:
                got.append(store.get(ns, [key]))
            except Exception as e:  # noqa: BLE001 -- reported below
                errors.append(e)
        t = threading.Thread(target=read)
        t.start()
        time.sleep(0.3)                                       # its promotion read hangs
        store.flush(tier="all", namespace=ns)                 # both copies doomed, pinned
        store.put(ns, [key], [block_for(ns, key)])            # written again: the old one an orphan
        shutil.rmtree(tmp_path / "disk")                      # the disk directory is lost
        deadline = time.monotonic() + 10
        while "directory" not in store.stats()["tiers"]["disk"]["degraded"] and time.monotonic() < deadline:
            time.sleep(0.05)
        assert "directory" in store.stats()["tiers"]["disk"]["degraded"]
        faults.write_text("")
        t.join(15)
        assert not t.is_alive() and not errors, errors
        assert got and len(got[0]) == 0 or got[0][0].tobytes() == block_for(ns, key).tobytes()
        assert store.get(ns, [key])[0].tobytes() == block_for(ns, key).tobytes()
        assert store.stats()["leases"] == 0
    finally:
        faults.write_text("")
        store.close()


def test_a_damaged_flush_record_drops_every_disk_block(tmp_path):
    store = TieredStore(small_config(tmp_path))
    ns = make_ns()
    keys = chain(ns, 5, 4)
    store.put(ns, keys, [block_for(ns, k) for k in keys])
    store.flush(tier="disk", namespace=make_ns(model="other"))   # writes a flush record
    store.sync()
    store.close()
    rec = tmp_path / "disk" / "flushed.msgpack"
    rec.write_bytes(b"\x00" + rec.read_bytes()[1:])
    again = TieredStore(small_config(tmp_path))
    try:
        assert again.lookup(ns, keys) == 0
        again.put(ns, keys, [block_for(ns, k) for k in keys])
        again.sync()
    finally:
        again.close()
    third = TieredStore(small_config(tmp_path))
    try:
        assert third.lookup(ns, keys) == 4   # the fence replaced the record: new copies live
    finally:
        third.close()


def test_a_flush_drops_pinned_copies_as_their_pins_go_and_never_serves_them_meanwhile(tmp_path):
    """A block being read up from disk, or leased, when a flush comes: the flush drops it as
    soon as its pins go, and from the flush on nobody else is served it (b90e890 skipped such
    blocks, so a block the operator flushed could be served for as long as it stayed in RAM)."""
    import threading
    import time
    faults = tmp_path / "faults"
    store = TieredStore(small_config(tmp_path, disk_fault_file=str(faults), disk_stall_s=60.0))
    ns = make_ns()
    leased_keys = chain(ns, 7, 2)
    (reading,) = chain(ns, 8, 1)
    try:
        store.put(ns, [reading], [block_for(ns, reading)])
        store.sync()
        store.flush(tier="host")                            # on disk only: an acquire reads it
        store.put(ns, leased_keys, [block_for(ns, k) for k in leased_keys])
        lease = store.acquire(ns, leased_keys)
        faults.write_text("read=hang:10")
        got = {}
        t = threading.Thread(target=lambda: got.setdefault("n", len(store.acquire(ns, [reading]))))
        t.start()
        time.sleep(0.3)                                     # its read hangs
        assert store.flush(tier="all") == 3
        assert store.lookup(ns, leased_keys) == 0 and store.lookup(ns, [reading]) == 0
        assert len(store.acquire(ns, leased_keys)) == 0     # not served to anyone else
        for buf, k in zip(lease.buffers, leased_keys):      # the lease still reads its own bytes
            assert np.array_equal(buf, block_for(ns, k))
        faults.write_text("")
        t.join(10)
        assert got["n"] == 0, "a block flushed while it was read was served"
        store.release(lease)
        assert store.stats()["tiers"]["host"]["used_bytes"] == 0   # gone once unpinned
        assert store.where(ns, leased_keys + [reading]) == ["", "", ""]
    finally:
        store.close()


def test_a_block_flushed_while_leased_is_not_written_back_by_a_sync(store):
    """A flush drops a leased block for every new reader; its bytes live on for the lease only.
    A sync meanwhile must not write it to disk (it would come back, flushed, as a disk copy),
    and `where` must not report it (a new reader is not served it)."""
    ns = make_ns()
    keys = chain(ns, 7, 2)
    store.put(ns, keys, [block_for(ns, k) for k in keys])
    lease = store.acquire(ns, keys[:1])
    assert store.flush(tier="all") == 2
    assert store.where(ns, keys) == ["", ""] and store.lookup(ns, keys) == 0
    assert store.sync() == 0
    assert store.where(ns, keys) == ["", ""] and store.get(ns, keys) == []
    assert np.array_equal(lease.buffers[0], block_for(ns, keys[0]))   # the lease still reads its bytes
    store.release(lease)
    assert store.lookup(ns, keys) == 0 and store.stats()["tiers"]["disk"]["blocks"] == 0


@pytest.mark.parametrize("via", ["embedded", "daemon"])
def test_a_key_written_again_after_a_flush_dropped_it_while_pinned_is_stored(tmp_path, via):
    """A flush comes while blocks are pinned (a lease here; a daemon's record writer pins every
    new block for a moment), and their keys are written again at once: the new writes are
    stored and served, the lease reads its own bytes to its end, and its release frees the old
    slots only. (The writes found the doomed blocks "present" and skipped them; the doomed
    copies then went when their pins did: keys lost right after puts that said they were
    stored. The daemon benchmark's flush-then-put runs lost up to all 8 blocks of a put.)"""
    ns = make_ns()
    keys = chain(ns, 7, 3)
    old = [block_for(ns, k) for k in keys]
    new = [255 - b for b in old]                  # what a writer stores under the keys now
    d = DaemonProc(tmp_path, host_bytes="8MiB").start() if via == "daemon" else None
    store = Client(d.socket) if d is not None else TieredStore(small_config(tmp_path))
    try:
        store.put(ns, keys, old)
        lease = store.acquire(ns, keys[:2])
        assert len(lease) == 2
        store.flush(tier="host")
        assert store.lookup(ns, keys) == 0
        assert store.put(ns, keys, new) == 3
        assert store.lookup(ns, keys) == 3
        got = store.get(ns, keys)
        assert len(got) == 3 and all(np.array_equal(g, b) for g, b in zip(got, new))
        for buf, b in zip(lease.buffers, old):   # the lease still reads the bytes it leased
            assert np.array_equal(buf, b)
        used = store.stats()["tiers"]["host"]["used_bytes"]
        store.release(lease)
        # the old slots go back once nothing pins them: the lease, and in a daemon the writer of
        # the host tier's records, which pins each new block until its record is written
        deadline = time.monotonic() + 10
        while (after := store.stats()["tiers"]["host"]["used_bytes"]) >= used and time.monotonic() < deadline:
            time.sleep(0.01)
        assert after < used                           # the old slots went back, nothing else
        got = store.get(ns, keys)
        assert len(got) == 3 and all(np.array_equal(g, b) for g, b in zip(got, new))
        assert store.flush(tier="host") == 3 and store.lookup(ns, keys) == 0
    finally:
        store.close()
        if d is not None:
            assert d.stop() == 0


@pytest.mark.parametrize("pinned_by", ["disk read", "disk write"])
def test_a_key_written_again_after_a_flush_dropped_every_copy_during_io_is_stored(tmp_path, pinned_by):
    """A flush of every tier comes while a block's copies are pinned by I/O in flight — read up
    from disk for an acquire (its host copy LOADING, its disk copy pinned), or written down by a
    sync (its host copy pinned, its disk write in flight) — and its key is written again before
    the I/O ends: the put stores the new bytes, they are served, written down and survive a
    reopen, and the old copies' slots come back when the I/O ends. (Such a block kept its key
    until its pins went, so the put found it "present", stored nothing, and the key was gone
    a moment later.)"""
    import threading
    import time
    faults = tmp_path / "faults"
    cfg = dict(disk_fault_file=str(faults), disk_stall_s=60.0)
    store = TieredStore(small_config(tmp_path, **cfg))
    ns = make_ns()
    (key,) = chain(ns, 9, 1)
    old = block_for(ns, key)
    new = 255 - old
    try:
        store.put(ns, [key], [old])
        one_slot = store.stats()["tiers"]["host"]["used_bytes"]
        if pinned_by == "disk read":
            store.sync()
            store.flush(tier="host")                       # on disk only: an acquire reads it
            faults.write_text("read=hang:10")
            got = {}
            io = threading.Thread(target=lambda: got.setdefault("n", len(store.acquire(ns, [key]))))
        else:
            faults.write_text("write=hang:10")
            io = threading.Thread(target=store.sync)
        io.start()
        time.sleep(0.3)                                     # the I/O hangs
        assert io.is_alive()
        assert store.flush(tier="all") == 1
        assert store.lookup(ns, [key]) == 0
        assert store.put(ns, [key], [new]) == 1, "the put skipped a key whose copies a flush had dropped"
        assert store.where(ns, [key]) == ["host"]
        faults.write_text("")
        io.join(10)
        assert not io.is_alive()
        if pinned_by == "disk read":
            assert got["n"] == 0, "a block flushed while it was read was served"
        (g,) = store.get(ns, [key])
        assert np.array_equal(g, new)
        st = store.stats()["tiers"]
        assert st["host"]["blocks"] == 1 and st["disk"]["blocks"] == 0
        assert st["host"]["used_bytes"] == one_slot, "the old host slot was not given back"
        assert st["disk"]["used_bytes"] == 0, "the old disk slot was not given back"
        assert store.sync() == 1                            # the new copy goes down, once
        assert store.stats()["tiers"]["disk"]["blocks"] == 1
        store.flush(tier="host")
        (g,) = store.get(ns, [key])
        assert np.array_equal(g, new)
    finally:
        faults.write_text("")
        store.close()
    store = TieredStore(small_config(tmp_path, **cfg))     # reopened: the new bytes, only
    try:
        assert store.stats()["tiers"]["disk"]["blocks"] == 1
        (g,) = store.get(ns, [key])
        assert np.array_equal(g, new)
    finally:
        store.close()
