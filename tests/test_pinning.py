"""Page-locking the arena never stalls an engine and never lies (kernels/pinning.py): `attach`
returns at once whatever the arena's size, its chunks (at most `pin_chunk_bytes` each) are
registered one after another on a background thread, a load reads a tier block in place only
where its chunk is registered (until then, or where registration failed, it is copied up through
a staging buffer), a failed chunk is logged with its range and counted, and a re-attach or close
unregisters every chunk registered. Checked on the CPU with stand-ins: page-locking that records
(and sleeps, or waits to be let go), streams that run work when waited for, and a launcher that
runs the copy kernel's semantics on the real addresses and checks that each address it reads from
is registered or a staging buffer -- never pageable arena memory. Arenas of several GiB are
sparse files: no memory behind them."""

from __future__ import annotations

import ctypes
import logging
import mmap
import threading
import time

import numpy as np
import pytest
import torch

from tierd.kernels import reference
from tierd.kernels.pinning import PAGE
from tierd.kernels.transfer import BlockTransfer

from .helpers import LazyStreams
from .test_direct_scatter import run_scatter_kernel
from .test_load_counts import build

GiB = 1 << 30
RATIO = 2


class Pinning:
    """A stand-in for the CUDA runtime's page-locking: what is registered (never twice, never
    a range overlapping another), in which thread; `seconds_per_gib` of sleep per registration;
    `gated`: each registration waits for `let_go()`; chunks at `fail` offsets from a range's
    start are refused (or raise, with `raises`)."""

    def __init__(self, seconds_per_gib: float = 0.0, gated: bool = False, fail=(), raises: bool = False):
        self.seconds_per_gib, self.fail, self.raises = seconds_per_gib, set(fail), raises
        self.gate = threading.Semaphore(0) if gated else None
        self.pinned: dict[int, int] = {}
        self.calls: list[tuple[str, int, int]] = []
        self.threads: set[str] = set()
        self.base = None                    # the arena's address: `fail` offsets are from it
        self.lock = threading.Lock()
        self.registering = 0                # registrations under way now

    def let_go(self, n: int = 1) -> None:
        for _ in range(n):
            self.gate.release()

    def register(self, ptr, size, tag=None):
        with self.lock:
            self.registering += 1
        try:
            self.threads.add(threading.current_thread().name)
            if self.gate is not None:
                assert self.gate.acquire(timeout=10), "never let go"
            time.sleep(self.seconds_per_gib * size / GiB)
            with self.lock:
                assert not any(p < ptr + size and ptr < p + s for p, s in self.pinned.items()), "registered twice"
                self.calls.append(("register", ptr, size))
                if self.base is not None and ptr - self.base in self.fail:
                    if self.raises:
                        raise RuntimeError("cudaHostRegister: out of memory (2)")
                    return False
                self.pinned[ptr] = size
                return True
        finally:
            with self.lock:
                self.registering -= 1

    def unregister(self, ptr, tag=None):
        with self.lock:
            assert ptr in self.pinned, "unregistered a range that was not registered"
            del self.pinned[ptr]
            self.calls.append(("unregister", ptr, 0))

    def covers(self, ptr, size) -> bool:
        with self.lock:
            return any(p <= ptr and ptr + size <= p + s for p, s in self.pinned.items())


class Store:
    """What `attach` asks of a store: its host arena, and the generation of its mapping."""

    def __init__(self, array):
        self.array, self.arena_generation = array, 0

    def host_array(self):
        return self.array


def anonymous(nbytes: int) -> np.ndarray:
    """A page-aligned, writable host buffer (an arena mapping)."""
    return np.frombuffer(mmap.mmap(-1, nbytes), dtype=np.uint8)


def sparse(tmp_path, nbytes: int, name: str = "arena") -> np.ndarray:
    """An arena of `nbytes` virtual size, with no memory behind it until written."""
    path = tmp_path / name
    with open(path, "wb") as f:
        f.truncate(nbytes)
    return np.memmap(path, dtype=np.uint8, mode="r+", shape=(nbytes,))


def transfer(pin: Pinning, chunk_bytes: int, layers: int = 2, nb: int = 24):
    """A transfer of CPU caches with stand-in streams and a launcher that runs the copy kernel,
    checking first that every arena block it reads lies in registered memory."""
    ks, vs = build(layers, nb)
    arenas: list[tuple[int, int]] = []      # (ptr, size) of the arenas: reads there must be pinned
    reads = {"in_place": 0}

    def launcher(device, source, name, grid, block, args):
        table, n_tier, ratio = int(args[2]), int(args[3]), int(args[4])
        nbytes = grid[1] // xfer.planes * xfer.layer_bytes      # the layers this launch reads
        for t in range(n_tier):
            addr = ctypes.c_uint64.from_address(table + 8 * (n_tier * ratio + t)).value
            if any(p <= addr < p + s for p, s in arenas):
                assert pin.covers(addr, nbytes), f"read pageable arena memory at {addr:#x} in place"
                reads["in_place"] += 1          # (per launch: once per layer in a layered load)
        run_scatter_kernel(device, source, name, grid, block, args)
    xfer = BlockTransfer(ks, vs, RATIO, pinning=pin, streams=LazyStreams(), launcher=launcher, direct=True,
                         pin_chunk_bytes=chunk_bytes)
    xfer.arenas, xfer.reads = arenas, reads
    return xfer


def fill(arena: np.ndarray, offsets, block_bytes: int, seed: int) -> list[np.ndarray]:
    """Random bytes in the tier blocks at `offsets` of the arena; their views."""
    rng = np.random.default_rng(seed)
    views = []
    for off in offsets:
        arena[off:off + block_bytes] = rng.integers(0, 256, block_bytes, dtype=np.uint8)
        views.append(arena[off:off + block_bytes])
    return views


def load_and_check(xfer: BlockTransfer, buffers, seed: int) -> tuple[int, int]:
    """Load `buffers` into random engine blocks (layer by layer); the caches must then hold
    what the torch reference puts there. Returns (blocks read in place, blocks staged)."""
    before = (xfer.stats["load_direct_blocks"], xfer.stats["load_staged_blocks"])
    g = torch.Generator().manual_seed(seed)
    ids = torch.randperm(xfer.k[0].shape[0], generator=g)[:len(buffers) * RATIO].view(len(buffers), RATIO)
    want_k = [k.clone() for k in xfer.k]
    want_v = [v.clone() for v in xfer.v]
    reference.scatter_blocks(want_k, want_v, ids, [torch.from_numpy(np.array(b)) for b in buffers])
    job = xfer.load_layers(ids, buffers, layered=True)
    for i in range(xfer.layers):
        job.wait_layer(i)
    job.synchronize()
    for got, want in zip(xfer.k + xfer.v, want_k + want_v):
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
    return (xfer.stats["load_direct_blocks"] - before[0], xfer.stats["load_staged_blocks"] - before[1])


def wait_for(cond, timeout_s: float = 10.0) -> None:
    end = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < end, "timed out"
        time.sleep(0.002)


def test_attach_returns_at_once_whatever_the_arenas_size_and_chunks_register_in_the_background(tmp_path):
    """One second per GiB (scaled down here to a quarter) is what cudaHostRegister costs on a
    real GPU: attach must not pay it. Arenas of 2 and 8 GiB (virtual) in 1-GiB chunks."""
    timings = {}
    for size in (2 * GiB, 8 * GiB):
        pin = Pinning(seconds_per_gib=0.25)
        xfer = transfer(pin, chunk_bytes=GiB)
        arena = sparse(tmp_path, size, f"arena-{size}")
        pin.base = arena.ctypes.data
        xfer.arenas.append((arena.ctypes.data, size))
        blocks = fill(arena, [0, size // 2 + 3 * xfer.block_bytes, size - xfer.block_bytes], xfer.block_bytes, 1)
        store = Store(arena)
        t0 = time.perf_counter()
        assert xfer.attach(store)
        timings[size] = time.perf_counter() - t0
        # nothing registered yet, everything pending: these loads are staged, with the right bytes
        assert xfer.stats["pinned_bytes"] < size and xfer.stats["pin_pending_bytes"] > 0
        assert load_and_check(xfer, blocks, 2)[1] >= 2
        # chunk by chunk: pinned_bytes grows a chunk at a time while the caller goes on
        seen = set()
        while not xfer.wait_pinned(timeout_s=0.01):
            seen.add(xfer.stats["pinned_bytes"])
        assert len(seen) >= 2 and all(b % GiB == 0 for b in seen)
        assert xfer.stats["pinned_bytes"] == size and xfer.stats["pin_pending_bytes"] == 0
        regs = [c for c in pin.calls if c[0] == "register"]
        assert [(p - arena.ctypes.data, s) for _, p, s in regs] == [(k * GiB, GiB) for k in range(size // GiB)]
        assert pin.threads == {"tierd-pin"}                   # never in the caller's thread
        assert load_and_check(xfer, blocks, 3) == (3, 0)     # registered: read in place
        assert xfer.reads["in_place"] == 3 * xfer.layers
        xfer.close()
        assert pin.pinned == {}
    registration_s = 0.25 * 2
    assert max(timings.values()) < min(0.1, registration_s / 4), timings


@pytest.mark.parametrize("layered_chunks", [1, 3])
def test_loads_from_a_chunk_not_yet_registered_are_staged_and_read_in_place_once_it_is(layered_chunks):
    """Per block: a block whose chunk is registered is read where it lies, one whose chunk is
    still pending is copied up; the bytes are the same either way."""
    pin = Pinning(gated=True)
    xfer = transfer(pin, chunk_bytes=PAGE * layered_chunks)
    chunk = PAGE * layered_chunks
    arena = anonymous(4 * chunk)
    pin.base = arena.ctypes.data
    xfer.arenas.append((arena.ctypes.data, arena.nbytes))
    bb = xfer.block_bytes
    blocks = fill(arena, [0, chunk + bb, 3 * chunk - bb], bb, 4)     # in chunks 0, 1 and 2
    assert xfer.attach(Store(arena))
    assert xfer.stats["pin_pending_bytes"] == 4 * chunk and xfer.stats["pinned_bytes"] == 0
    wait_for(lambda: pin.registering == 1)                 # chunk 0 under way, not done
    assert load_and_check(xfer, blocks, 5) == (0, 3)
    pin.let_go()                                           # chunk 0 registered
    wait_for(lambda: xfer.stats["pinned_bytes"] == chunk)
    assert load_and_check(xfer, blocks, 6) == (1, 2)
    pin.let_go()                                           # chunk 1 too
    wait_for(lambda: xfer.stats["pinned_bytes"] == 2 * chunk)
    assert load_and_check(xfer, blocks, 7) == (2, 1)
    pin.let_go(2)
    assert xfer.wait_pinned(timeout_s=10)
    assert load_and_check(xfer, blocks, 8) == (3, 0)
    assert xfer.reads["in_place"] == 6 * xfer.layers
    xfer.close()
    assert pin.pinned == {}


@pytest.mark.parametrize("raises", [False, True])
def test_a_chunk_that_fails_to_register_is_logged_counted_and_its_loads_stay_staged(raises, caplog):
    pin = Pinning(fail={PAGE}, raises=raises)
    xfer = transfer(pin, chunk_bytes=PAGE)
    arena = anonymous(3 * PAGE)
    pin.base = arena.ctypes.data
    xfer.arenas.append((arena.ctypes.data, arena.nbytes))
    bb = xfer.block_bytes
    blocks = fill(arena, [0, PAGE, 2 * PAGE - bb, 2 * PAGE], bb, 9)   # chunk 0, 1, 1, 2
    with caplog.at_level(logging.WARNING, logger="tierd.kernels"):
        xfer.attach(Store(arena))
        assert not xfer.wait_pinned(timeout_s=10)          # settled, not all of it pinned
    failed = [r for r in caplog.records if "page-locking" in r.getMessage()]
    assert len(failed) == 1                                # logged once, with its range
    assert f"[{PAGE}, {2 * PAGE})" in failed[0].getMessage()
    assert ("out of memory" if raises else "refused") in failed[0].getMessage()
    assert [f[:3] for f in xfer.pin_failures()] == [(arena.ctypes.data, PAGE, PAGE)]
    assert {k: xfer.stats[k] for k in ("pinned_bytes", "pin_pending_bytes", "pin_failed_chunks", "pin_failed_bytes")} \
        == {"pinned_bytes": 2 * PAGE, "pin_pending_bytes": 0, "pin_failed_chunks": 1, "pin_failed_bytes": PAGE}
    for seed in (10, 11):                                  # its blocks stay staged, load after load
        assert load_and_check(xfer, blocks, seed) == (2, 2)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="tierd.kernels"):
        load_and_check(xfer, blocks, 12)
    assert not caplog.records                              # not logged again
    xfer.close()
    assert pin.pinned == {}
    assert xfer.stats["pinned_bytes"] == 0 and xfer.stats["pin_failed_chunks"] == 0


def test_attach_reports_a_failed_chunk():
    pin = Pinning(fail={0})
    xfer = transfer(pin, chunk_bytes=PAGE)
    arena = anonymous(2 * PAGE)
    pin.base = arena.ctypes.data
    store = Store(arena)
    assert xfer.attach(store)                               # under way: not known yet
    xfer.wait_pinned(timeout_s=10)
    assert not xfer.attach(store)                           # the same mapping: a chunk of it failed
    assert pin.calls == [("register", arena.ctypes.data, PAGE), ("register", arena.ctypes.data + PAGE, PAGE)]
    xfer.close()


@pytest.mark.parametrize("where", ["elsewhere", "same address"])
def test_a_re_attach_unregisters_the_old_mapping_chunk_by_chunk_even_one_being_registered(where):
    """A daemon restart re-maps the arena (elsewhere, or at the same address with other pages):
    the old chunks registered are unregistered at the re-attach, the one being registered as
    soon as it is, the ones pending never are; the new arena's chunks are registered; close()
    leaves nothing registered and no thread running."""
    pin = Pinning(gated=True)
    xfer = transfer(pin, chunk_bytes=PAGE)
    old = anonymous(3 * PAGE)
    pin.base = old.ctypes.data
    bb = xfer.block_bytes
    store = Store(old)
    xfer.arenas.append((old.ctypes.data, old.nbytes))
    old_blocks = fill(old, [0, PAGE], bb, 13)
    assert xfer.attach(store)
    pin.let_go()                                             # chunk 0 registered
    wait_for(lambda: xfer.stats["pinned_bytes"] == PAGE and pin.registering == 1)   # chunk 1 under way
    assert load_and_check(xfer, old_blocks, 14) == (1, 1)
    new = old if where == "same address" else anonymous(3 * PAGE)
    store.array, store.arena_generation = new, 1
    xfer.arenas.append((new.ctypes.data, new.nbytes))
    new_blocks = fill(new, [PAGE + bb, 2 * PAGE], bb, 15)
    assert xfer.attach(store)                               # at once, chunk 1 still under way
    assert pin.calls[-1] == ("unregister", old.ctypes.data, 0)
    assert old.ctypes.data not in pin.pinned
    assert xfer.stats["pinned_bytes"] == 0 and xfer.stats["pin_pending_bytes"] == 3 * PAGE
    assert load_and_check(xfer, new_blocks, 16) == (0, 2)   # nothing of the new one registered yet
    pin.let_go(4)                                            # old chunk 1 ends; new chunks 0, 1, 2
    assert xfer.wait_pinned(timeout_s=10)
    regs = [(op, p - old.ctypes.data) for op, p, _ in pin.calls]
    o = new.ctypes.data - old.ctypes.data
    # (a registration is recorded as it ends) old chunk 0 unregistered at the re-attach, old
    # chunk 1 as soon as it came back, old chunk 2 never registered; the new arena's chunks after
    assert regs == [("register", 0), ("unregister", 0), ("register", PAGE), ("unregister", PAGE),
                    ("register", o), ("register", o + PAGE), ("register", o + 2 * PAGE)]
    assert pin.pinned == {new.ctypes.data + k * PAGE: PAGE for k in range(3)}
    assert xfer.stats["pinned_bytes"] == 3 * PAGE
    assert load_and_check(xfer, new_blocks, 17) == (2, 0)
    xfer.close()
    assert pin.pinned == {} and xfer.stats["pinned_bytes"] == 0
    assert not any(t.name == "tierd-pin" for t in threading.enumerate())


def test_close_while_a_chunk_is_being_registered_waits_for_it_and_unregisters_it():
    pin = Pinning(gated=True)
    xfer = transfer(pin, chunk_bytes=PAGE)
    arena = anonymous(4 * PAGE)
    xfer.attach(Store(arena))
    pin.let_go()
    wait_for(lambda: xfer.stats["pinned_bytes"] == PAGE and pin.registering == 1)
    threading.Timer(0.1, pin.let_go).start()                # chunk 1 comes back during close()
    xfer.close()
    assert pin.pinned == {}
    assert [op for op, _, _ in pin.calls] == ["register", "unregister", "register", "unregister"]
    assert not any(t.name == "tierd-pin" for t in threading.enumerate())
    assert xfer.stats["pin_pending_bytes"] == 0 and xfer.stats["pinned_bytes"] == 0


def test_register_host_pins_in_chunks_in_the_callers_thread_and_stats_reach_the_given_dict():
    pin, stats = Pinning(), {"hbm_hit_blocks": 0}
    ks, vs = build(2, 8)
    xfer = BlockTransfer(ks, vs, RATIO, pinning=pin, streams=LazyStreams(), pin_chunk_bytes=PAGE, stats=stats)
    arena = anonymous(3 * PAGE)
    assert xfer.register_host(arena)
    assert pin.threads == {threading.current_thread().name}
    assert sorted(pin.pinned.items()) == [(arena.ctypes.data + k * PAGE, PAGE) for k in range(3)]
    assert stats["pinned_bytes"] == 3 * PAGE and stats["hbm_hit_blocks"] == 0
    assert {"load_direct_blocks", "load_staged_blocks", "pin_failed_chunks", "pin_failed_bytes",
            "pin_pending_bytes"} <= set(stats)
    xfer.close()
    assert pin.pinned == {} and stats["pinned_bytes"] == 0


def test_chunks_never_exceed_the_chunk_size_and_fall_on_pages():
    from tierd.kernels.pinning import _Arena
    for ptr in (0x10000, 0x10000 + 100):
        for size in (1, PAGE, 5 * PAGE - 7, 9 * PAGE):
            a = _Arena(ptr, size, None, 2 * PAGE)
            spans = [(ptr + o, s) for o, s, _ in a.chunks]
            assert sum(s for _, s in spans) == size and all(0 < s <= 2 * PAGE for _, s in spans)
            assert all(p % PAGE == 0 for p, _ in spans[1:])
            assert all(p + s == q for (p, s), (q, _) in zip(spans, spans[1:]))
