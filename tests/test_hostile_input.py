"""Hostile and degenerate input is refused at once and leaves nothing stuck: repeated keys,
a failure between an acquire's plan and its settle, a store closing under a waiting acquire."""

import threading
import time

import numpy as np
import pytest

from tierd import TieredStore
from tierd.errors import KeyFormatError, StoreClosedError

from .helpers import block_for, chain, make_ns, small_config
from .test_daemon import raw_conn, read_reply, send


def disk_only(store, ns, keys):
    store.put(ns, keys, [block_for(ns, k) for k in keys])
    store.sync()
    store.flush(tier="host")
    assert store.where(ns, keys) == ["disk"] * len(keys)


def nothing_pinned(store):
    st = store.stats()
    return st["leases"] == 0 and st["reservations"] == 0


def test_repeated_keys_are_refused_by_every_store_operation(store):
    ns = make_ns()
    (k,) = chain(ns, 1, 1)
    disk_only(store, ns, [k])
    for call in (lambda: store.acquire(ns, [k, k]), lambda: store.get(ns, [k, k]),
                 lambda: store.lookup(ns, [k, k]), lambda: store.reserve(ns, [k, k]),
                 lambda: store.put(ns, [k, k], [block_for(ns, k)] * 2)):
        t0 = time.monotonic()
        with pytest.raises(KeyFormatError, match="appears twice"):
            call()
        assert time.monotonic() - t0 < 2.0
    got = store.get(ns, [k])                  # nothing was left LOADING or pinned
    assert np.array_equal(got[0], block_for(ns, k))
    assert nothing_pinned(store)


def test_repeated_keys_of_a_disk_only_block_are_refused_by_the_daemon_at_once(daemon):
    """On b90e890, acquire([k, k]) of a disk-only block waited for itself forever and every
    later acquire of k hung with it."""
    from tierd.client import Client
    ns = make_ns()
    (k,) = chain(ns, 2, 1)
    with Client(daemon.socket) as c:
        c.put(ns, [k], [block_for(ns, k)])
        c.sync()
        c.flush(tier="host")
    s = raw_conn(daemon.socket)
    send(s, {"id": 1, "op": "hello", "version": 1, "namespaces": [ns.to_dict()]})
    assert read_reply(s)["ok"]
    t0 = time.monotonic()
    send(s, {"id": 2, "op": "acquire", "ns": ns.name, "keys": [k, k]})
    r = read_reply(s)
    assert r["error"]["code"] == "bad_key" and "appears twice" in r["error"]["message"]
    assert time.monotonic() - t0 < 3.0
    for op in ("reserve", "lookup", "lookup_all"):
        msg = {"id": 3, "op": op, "ns": ns.name, "keys": [k, k]}
        if op == "lookup_all":
            msg = {"id": 3, "op": op, "queries": [{"ns": ns.name, "keys": [k, k]}]}
        send(s, msg)
        assert read_reply(s)["error"]["code"] == "bad_key"
    s.close()
    with Client(daemon.socket, timeout_s=5) as c:   # k is served as before, to everyone
        assert np.array_equal(c.get(ns, [k])[0], block_for(ns, k))


def test_a_failure_between_plan_and_settle_leaves_no_block_loading(tmp_path, monkeypatch):
    """An unexpected error while promoting (a bug, memory) fails that acquire only: its
    blocks go back to a stable state, and the next acquire serves them."""
    store = TieredStore(small_config(tmp_path))
    try:
        ns = make_ns()
        keys = chain(ns, 3, 3)
        disk_only(store, ns, keys)
        real = store.disk.read_many

        def broken(items, sums=None):   # a fault injected at the disk tier's boundary
            raise RuntimeError("injected: not an OSError")
        monkeypatch.setattr(store.disk, "read_many", broken)
        with pytest.raises(RuntimeError, match="injected"):
            store.acquire(ns, keys)
        monkeypatch.setattr(store.disk, "read_many", real)
        t0 = time.monotonic()
        got = store.get(ns, keys)
        assert time.monotonic() - t0 < 3.0
        assert [np.array_equal(g, block_for(ns, k)) for g, k in zip(got, keys)] == [True] * 3
        assert nothing_pinned(store)
        assert store.flush(tier="all") == 3       # no pin left behind: everything can go
    finally:
        store.close()


def test_closing_the_store_ends_an_acquire_waiting_on_a_promotion(tmp_path):
    faults = tmp_path / "faults"
    store = TieredStore(small_config(tmp_path, disk_fault_file=str(faults), disk_stall_s=60.0))
    ns = make_ns()
    (k,) = chain(ns, 4, 1)
    disk_only(store, ns, [k])
    faults.write_text("read=hang:30")
    outcome = {}

    def promote():
        try:
            outcome["first"] = len(store.acquire(ns, [k]))
        except Exception as e:  # noqa: BLE001
            outcome["first"] = type(e).__name__

    def wait_on_it():
        try:
            store.acquire(ns, [k])
            outcome["second"] = "served"
        except StoreClosedError:
            outcome["second"] = "closed"

    t1 = threading.Thread(target=promote)
    t1.start()
    time.sleep(0.3)                          # the promotion hangs on the disk read
    t2 = threading.Thread(target=wait_on_it)
    t2.start()
    time.sleep(0.3)
    closer = threading.Thread(target=store.close)
    closer.start()
    t2.join(5)
    assert not t2.is_alive(), "an acquire kept waiting on a closed store"
    assert outcome["second"] == "closed"
    faults.write_text("")
    t1.join(30)
    closer.join(30)


def test_an_inline_acquire_or_reserve_that_would_need_io_changes_nothing(tmp_path):
    """S3: the daemon serves quick acquires and reserves on its event loop thread; one that lost
    a race since its quick check (its block went to disk, the host filled) is refused inline
    (WouldBlock, nothing pinned) and runs on a worker thread instead, never reading the disk or
    waiting on the loop."""
    from tierd.store import WouldBlock
    store = TieredStore(small_config(tmp_path))
    try:
        ns = make_ns()
        keys = chain(ns, 6, 3)
        disk_only(store, ns, keys[1:])
        store.put(ns, keys[:1], [block_for(ns, keys[0])])
        with pytest.raises(WouldBlock):
            store.acquire(ns, keys, inline=True)
        assert nothing_pinned(store) and store.where(ns, keys[1:]) == ["disk", "disk"]
        with store.acquire(ns, keys[:1], inline=True) as lease:   # READY in RAM: served inline
            assert len(lease) == 1
        room = store.host.alloc.free_slot_count(store._ns(ns).host_slot_bytes)
        many = chain(ns, 7, room + 1)
        with pytest.raises(WouldBlock):
            store.reserve(ns, many, inline=True)
        assert nothing_pinned(store)
        assert len(store.get(ns, keys)) == 3            # the worker-thread path promotes as before
    finally:
        store.close()
