"""`sync` means written: a sync returns only once every block committed before it is on disk,
a flush under way included (it waits for the flush, then writes what the flush left), and
fails, naming what is not written, when the disk cannot take them — in the store and in
`tierd sync`, with or without a terminal. Blocks committed while a flush runs are not the
flush's to drop. And with no disk tier the demoter is not woken for passes that do nothing."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time

import pytest

from tierd import TieredStore
from tierd.client import Client

from .daemon import ROOT, DaemonProc
from .helpers import block_for, chain, make_ns, run_on_terminal, small_config


def small_ns(model: str):
    """4 KiB blocks: one page each, so a small tier holds many."""
    return make_ns(model=model, num_layers=1, num_kv_heads=1, head_dim=64)


class PacedStore(TieredStore):
    """The store, with one thread's walks (`flush`'s, below) paced as on a store of 40,000
    blocks: a few blocks per hold of the lock, so puts and a sync surely come while it runs.
    Every other walk (a sync's plan) goes at its usual pace."""

    slow_thread = None

    @property
    def SCAN_CHUNK(self):
        return 2 if threading.current_thread() is self.slow_thread else TieredStore.SCAN_CHUNK

    @property
    def SCAN_YIELD_S(self):
        return 0.005 if threading.current_thread() is self.slow_thread else TieredStore.SCAN_YIELD_S


def reserve_filled(store, ns, keys):
    """A reservation of `keys`, written (each key's `block_for`) and not yet committed."""
    res = store.reserve(ns, keys)
    assert res.status == ["reserved"] * len(keys)
    for k, buf in zip(keys, res.buffers):
        buf[:] = block_for(ns, k)
    return res


def flush_on_a_thread(store: PacedStore, ns, first: bytes, **kw) -> threading.Thread:
    """Start `store.flush(**kw)` on a slow-walking thread; return once its walk has begun
    (the copies of `first`, the oldest block of `ns`, changed)."""
    was = store.where(ns, [first])
    t = threading.Thread(target=store.flush, kwargs=kw)
    store.slow_thread = t
    t.start()
    deadline = time.monotonic() + 10
    while store.where(ns, [first]) == was and time.monotonic() < deadline:
        time.sleep(0.001)
    assert store.where(ns, [first]) != was, "the flush did not begin"
    return t


def _config(path: str):
    # host_dirty_ratio 1.0: the demoter never writes a block down ahead on its own, so what is
    # on disk after the kill is what the sync (or an eviction) wrote
    return small_config(None, disk_path=path, host_bytes="4MiB", disk_bytes="16MiB",
                        disk_file_bytes="16MiB", host_dirty_ratio=1.0)


def _worker(path: str, tier: str, scope: str) -> None:
    """(In a child process, killed with SIGKILL once it has printed its line.) Fill a store,
    start a flush of `tier` ("all" or "disk") of namespace X (`scope` "ns") or of every
    namespace ("every") on a thread, put blocks while its walk runs, sync, report, and wait
    for the kill."""
    store = PacedStore(_config(path))
    x, y = small_ns("X"), small_ns("Y")
    flushed = [k for i in range(10) for k in chain(x, 100 + i, 60)]    # 600 blocks of X, synced
    for i in range(0, len(flushed), 60):
        store.put(x, flushed[i:i + 60], [block_for(x, k) for k in flushed[i:i + 60]])
        store.sync()
    before = chain(x, 7, 8) + chain(y, 7, 8)     # committed before the flush, host RAM only
    for ns, ks in ((x, before[:8]), (y, before[8:])):
        store.put(ns, ks, [block_for(ns, k) for k in ks])
    late = reserve_filled(store, x, chain(x, 6, 4))   # reserved before the flush, the walk's last
    t = flush_on_a_thread(store, x, flushed[0], tier=tier, namespace=x if scope == "ns" else None)
    assert store.commit(late) == 4                # committed while the flush's walk runs
    after = chain(x, 8, 4) + chain(y, 8, 4)      # committed while the flush's walk runs
    for ns, ks in ((x, after[:4]), (y, after[4:])):
        assert store.put(ns, ks, [block_for(ns, k) for k in ks]) == 4
    running = t.is_alive()
    error = ""
    try:
        written = store.sync()
    except Exception as e:  # noqa: BLE001 -- reported to the test
        written, error = -1, f"{type(e).__name__}: {e}"
    print(json.dumps({"flush_running_at_sync": running, "written": written, "error": error}), flush=True)
    time.sleep(120)


def _run_and_kill(tmp_path, tier: str, scope: str) -> dict:
    disk = str(tmp_path / "disk")
    code = f"from tests.test_sync_flush import _worker; _worker({disk!r}, {tier!r}, {scope!r})"
    p = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    try:
        line = p.stdout.readline()
        assert line, f"the worker died: {p.stderr.read()[-3000:]}"
        return json.loads(line)
    finally:
        p.send_signal(signal.SIGKILL)       # kill -9: no close, no checkpoint, host RAM gone
        p.wait(30)


@pytest.mark.parametrize("tier,scope", [("all", "ns"), ("all", "every"), ("disk", "ns")])
def test_a_sync_during_a_flush_writes_every_block_committed_before_it(tmp_path, tier, scope):
    """A sync while a flush walks (a namespace's or every one's): every block committed before
    the sync that the flush did not drop — committed after the flush began, or (a disk flush)
    before it, its host copy kept — is on disk once the sync returns, and survives a kill -9.
    (The sync skipped every block of a scope being flushed and returned success: 0 written,
    the blocks in host RAM only, lost by the kill.)"""
    r = _run_and_kill(tmp_path, tier, scope)
    assert r["flush_running_at_sync"], "the flush was over before the sync: the test exercises nothing"
    assert not r["error"], r["error"]
    x, y = small_ns("X"), small_ns("Y")
    before, after = chain(x, 7, 8) + chain(y, 7, 8), chain(x, 6, 4) + chain(x, 8, 4) + chain(y, 8, 4)
    flushed = [k for i in range(10) for k in chain(x, 100 + i, 60)]
    store = TieredStore(_config(str(tmp_path / "disk")))   # from its disk only
    try:
        # committed after the flush began (reserved before it, or after): not dropped by it,
        # and synced
        assert store.where(x, after[:8]) == ["disk"] * 8
        assert store.where(y, after[8:]) == ["disk"] * 4
        # committed before it: what the flush did not drop is synced
        kept_x = tier == "disk"               # a disk flush keeps host copies
        kept_y = scope == "ns"                # a flush of X keeps Y's blocks
        assert store.where(x, before[:8]) == (["disk"] * 8 if kept_x else [""] * 8)
        assert store.where(y, before[8:]) == (["disk"] * 8 if kept_y else [""] * 8)
        # what the flush dropped stays dropped (a disk flush keeps host copies: synced again)
        assert store.lookup(x, flushed[:60]) == (60 if kept_x else 0)
        for ns, ks in ((x, after[:8]), (y, after[8:])) + (((x, before[:8]),) if kept_x else ()):
            got = store.get(ns, ks)
            assert [g.tobytes() for g in got] == [block_for(ns, k).tobytes() for k in ks]
    finally:
        store.close()


def test_a_flush_keeps_blocks_committed_while_it_runs_in_host_ram(tmp_path):
    """A flush of host RAM drops what was there when it began, not the blocks committed while
    its walk runs: new puts, and blocks reserved before it and committed while it runs (its
    walk reached them committed, and dropped them)."""
    store = PacedStore(_config(str(tmp_path / "disk")))
    try:
        x = small_ns("X")
        old = [k for i in range(6) for k in chain(x, 100 + i, 60)]
        for i in range(0, len(old), 60):
            store.put(x, old[i:i + 60], [block_for(x, k) for k in old[i:i + 60]])
        late = reserve_filled(store, x, chain(x, 8, 4))   # the walk reaches them last
        t = flush_on_a_thread(store, x, old[0], tier="host", namespace=x)
        assert store.commit(late) == 4
        new = chain(x, 9, 4)
        assert store.put(x, new, [block_for(x, k) for k in new]) == 4
        assert t.is_alive(), "the flush was over: the test exercises nothing"
        t.join(30)
        assert store.lookup(x, old) == 0
        assert store.where(x, late.keys + new) == ["host"] * 8
        got = store.get(x, late.keys + new)
        assert [g.tobytes() for g in got] == [block_for(x, k).tobytes() for k in late.keys + new]
    finally:
        store.close()


@pytest.mark.parametrize("terminal", [False, True])
def test_tierd_sync_fails_when_the_disk_cannot_take_the_blocks(tmp_path, terminal):
    """A disk tier smaller than the host's dirty blocks: `tierd sync` (the preStop hook runs it
    with no terminal) exits non-zero with one line saying how many blocks are in host RAM
    only, with or without a terminal. (It printed "synced: N blocks written to disk durably"
    and exited 0, though the disk had evicted most of what it wrote; on a terminal it went on
    writing and evicting for ever.) Then, with room (some blocks flushed), it succeeds."""
    d = DaemonProc(tmp_path, host_bytes="8MiB", disk_bytes="4MiB").start()
    ns = make_ns()        # 16 KiB blocks: the host holds ~500, the disk ~200
    try:
        keys = [k for i in range(20) for k in chain(ns, 10 + i, 20)]      # 400 blocks
        with Client(d.socket) as c:
            for i in range(0, len(keys), 20):
                c.put(ns, keys[i:i + 20], [block_for(ns, k) for k in keys[i:i + 20]])
            assert c.where(ns, keys).count("host") >= 300, "the host tier kept too few: the test exercises nothing"
        args = ["sync", "--socket", d.socket]
        if terminal:
            rc, out = run_on_terminal(args)
            err = out.strip().splitlines()[-1] if out.strip() else ""
        else:
            r = subprocess.run([sys.executable, "-m", "tierd", *args], cwd=ROOT, capture_output=True,
                               text=True, timeout=120, stdin=subprocess.DEVNULL)
            rc, out, err = r.returncode, r.stdout, r.stderr.strip()
            assert len(r.stderr.strip().splitlines()) == 1, r.stderr
        assert rc not in (0, None), f"exit {rc}: {out!r}"
        assert "synced:" not in out
        assert err.startswith("tierd sync:") and "blocks are in host RAM only" in err, err
        assert "no room" in err, err
        # with room for them it succeeds, and its output is as before
        with Client(d.socket) as c:
            c.flush(tier="all")
            few = chain(ns, 99, 5)
            c.put(ns, few, [block_for(ns, k) for k in few])
        r = subprocess.run([sys.executable, "-m", "tierd", *args], cwd=ROOT, capture_output=True,
                           text=True, timeout=120, stdin=subprocess.DEVNULL)
        assert r.returncode == 0 and "synced: 5 blocks written to disk durably" in r.stdout, r
        with Client(d.socket) as c:
            assert c.where(ns, few) == ["host+disk"] * 5
    finally:
        if d.alive():
            assert d.stop() == 0


def test_with_no_disk_tier_puts_into_a_full_host_tier_wake_no_demoter_pass(tmp_path):
    """No disk tier: the demoter has nothing to do (an allocation drops the coldest block
    itself), so a put past the host's high watermark does not wake it for a pass. (Each
    commit woke it: thousands of empty passes for thousands of puts.)"""
    store = TieredStore(small_config(None, demotion_interval_s=60.0))   # 1 MiB: 64 blocks
    passes = []
    lock = threading.Lock()
    real = store._demote_pass

    def counted():
        with lock:
            passes.append(1)
        return real()
    store._demote_pass = counted
    try:
        ns = make_ns()
        keys = [k for i in range(100) for k in chain(ns, i, 20)]     # 2,000 blocks through 64 slots
        for k in keys:
            store.put(ns, [k], [block_for(ns, k)])
        time.sleep(0.2)                       # a woken demoter runs its pass
        st = store.stats()["tiers"]["host"]
        assert st["evictions"] > 1500 and st["used_bytes"] > 0.9 * st["capacity_bytes"]
        assert len(passes) <= 1, f"{len(passes)} demoter passes for {len(keys)} puts"
    finally:
        store.close()
