"""The disk tier across restarts, crashes and damage: durable blocks come back bit-exact,
damaged ones are never served."""

import os
import random
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tierd import TieredStore
from tierd.errors import DiskDegradedError
from tierd.tiers.disk import CHECKPOINT_NAME

from .helpers import block_for, chain, make_ns, small_config, wait_for
from .writer_proc import config

ROOT = Path(__file__).resolve().parent.parent
SLOT_MAGIC = b"TIERDSLT"


def start_writer(d, mode, n):
    return subprocess.Popen([sys.executable, "-m", "tests.writer_proc", str(d), mode, str(n)],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def run_writer(d, mode, n):
    p = start_writer(d, mode, n)
    line = p.stdout.readline().strip()
    assert line in ("DONE", "SYNCED"), p.stderr.read()
    if line == "SYNCED":
        p.send_signal(signal.SIGKILL)
    p.wait(timeout=30)


def served_exact(store, ns, key) -> bool | None:
    """True: served and exact; None: not served; raises if served wrong."""
    got = store.get(ns, [key])
    if not got:
        return None
    assert np.array_equal(got[0], block_for(ns, key)), f"block {key.hex()} served with wrong bytes"
    return True


def find_slots(d: Path) -> dict[bytes, tuple[Path, int]]:
    """key -> (file, offset of its slot header), read straight from the documented format."""
    slots = {}
    for f in sorted(d.glob("slab-*.tds")):
        data = f.read_bytes()
        for off in range(0, len(data), 4096):
            if data[off:off + 8] == SLOT_MAGIC:
                slots[data[off + 32:off + 48]] = (f, off)
    return slots


def synced(cfg, ns, keys, blocks=None) -> None:
    """Store `keys` (their `block_for` content unless `blocks`), sync them to disk, close."""
    with TieredStore(cfg) as s:
        s.put(ns, keys, blocks if blocks is not None else [block_for(ns, k) for k in keys])
        assert s.sync() == len(keys)


def flip(f: Path, off: int, mask: int) -> None:
    """XOR the byte at `off` of file `f` with `mask`."""
    with open(f, "r+b") as fh:
        fh.seek(off)
        b = fh.read(1)
        fh.seek(off)
        fh.write(bytes([b[0] ^ mask]))


@pytest.mark.parametrize("mode", ["sync-close", "sync-kill"])
def test_synced_blocks_survive_reopen_in_a_new_process(tmp_path, mode):
    ns = make_ns()
    run_writer(tmp_path / "disk", mode, 30)
    with TieredStore(config(tmp_path / "disk")) as s:
        st = s.stats()["tiers"]["disk"]
        assert st["recovered_from"] == ("checkpoint" if mode == "sync-close" else "scan")
        assert st["blocks"] == 120
        for seed in range(30):
            keys = chain(ns, seed, 4)
            assert s.lookup(ns, keys) == 4
            assert all(served_exact(s, ns, k) for k in keys)
        assert s.stats()["tiers"]["disk"]["corrupt_dropped"] == 0


@pytest.mark.parametrize("path", ["checkpoint", "scan"])
def test_damaged_blocks_are_dropped_counted_and_never_served(tmp_path, path):
    ns = make_ns()
    d = tmp_path / "disk"
    run_writer(d, "sync-close", 30)
    keys = [k for seed in range(30) for k in chain(ns, seed, 4)]
    slots = find_slots(d)
    assert set(keys) <= set(slots)
    rnd = random.Random(7)
    payload_hit, header_hit = rnd.sample(keys[:60], 2)
    for key, where in ((payload_hit, 4096 + 1234), (header_hit, 40)):  # payload byte; key byte
        f, off = slots[key]
        with open(f, "r+b") as fh:
            fh.seek(off + where)
            b = fh.read(1)
            fh.seek(off + where)
            fh.write(bytes([b[0] ^ 0x5A]))
    # truncate the last file in the middle of the payload of its last slot
    last_file = max(f for f, _ in slots.values())
    tail_key, (f, tail_off) = max(((k, v) for k, v in slots.items() if v[0] == last_file),
                                  key=lambda kv: kv[1][1])
    os.truncate(f, tail_off + 4096 + 100)
    if path == "scan":
        (d / CHECKPOINT_NAME).unlink()
    damaged = {payload_hit, header_hit, tail_key}
    with TieredStore(config(d)) as s:
        served = {k: served_exact(s, ns, k) for k in keys}
        assert all(served[k] is None for k in damaged)
        assert all(served[k] for k in keys if k not in damaged)
        assert s.stats()["tiers"]["disk"]["corrupt_dropped"] >= len(damaged)
    # the file was given back its full size; the next open sees a healthy store
    with TieredStore(config(d)) as s:
        assert all(served_exact(s, ns, k) for k in keys if k not in damaged)


def test_killed_writer_leaves_only_intact_blocks(tmp_path):
    """SIGKILL a writer at random points of put bursts with constant demotion, several times
    over the same directory: every block acknowledged durable is served bit-exact, and no block
    is ever served with wrong bytes."""
    ns = make_ns()
    d = tmp_path / "disk"
    run_writer(d, "sync-close", 5)  # start from a clean store with a checkpoint
    rnd = random.Random(1)
    durable: set[int] = set(range(5))
    for round_ in range(5):
        p = start_writer(d, "burst", 200)
        want = rnd.randint(1, 6)
        seen = 0
        for line in p.stdout:
            if line.startswith("DURABLE"):
                durable.update(range(int(line.split()[1]) + 1))
                seen += 1
                if seen >= want:
                    break
            if line.startswith("IDLE"):
                break
        p.send_signal(signal.SIGKILL)
        p.wait(timeout=30)
        with TieredStore(config(d)) as s:
            assert s.stats()["tiers"]["disk"]["recovered_from"] == "scan"
            for seed in range(200):
                keys = chain(ns, seed, 4)
                results = [served_exact(s, ns, k) for k in keys]
                if seed in durable:
                    assert all(results), f"round {round_}: durable chain {seed} lost"


def test_a_flipped_byte_in_any_piece_of_a_large_payload_is_never_served(tmp_path):
    """A disk read hashes and copies a large block a piece at a time (FUSE_PIECE): a byte
    flipped in the first, a middle or the last (partial) piece of a payload drops that block
    and never serves it; the untouched block is exact."""
    from tierd.tiers.slot_header import FUSE_PIECE
    ns = make_ns(num_layers=4, num_kv_heads=8, head_dim=128, block_tokens=72)   # 1.125 MiB
    assert ns.block_bytes > 2 * FUSE_PIECE and ns.block_bytes % FUSE_PIECE
    cfg = small_config(tmp_path, host_bytes="32MiB", host_slab_bytes="8MiB", disk_bytes="64MiB",
                       disk_slab_bytes="8MiB", disk_file_bytes="32MiB")
    keys = chain(ns, 3, 4)
    synced(cfg, ns, keys)
    slots = find_slots(tmp_path / "disk")
    for key, where in ((keys[0], 100), (keys[1], FUSE_PIECE + 7), (keys[2], ns.block_bytes - 1)):
        f, off = slots[key]
        flip(f, off + 4096 + where, 0x01)
    with TieredStore(cfg) as s:
        assert [served_exact(s, ns, k) for k in keys] == [None, None, None, True]
        assert s.stats()["tiers"]["disk"]["corrupt_dropped"] == 3


def _read_calls() -> int:
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("syscr:"))


@pytest.mark.skipif(not os.path.exists("/proc/self/io"), reason="counts read calls through /proc/self/io")
def test_blocks_read_together_are_each_checked_alone(tmp_path):
    """Slots next to each other on disk are promoted in one read call, and each block in it is
    still checked on its own: a flipped payload byte and an overwritten header each drop their
    block only, and every neighbour read in the same call is served exact."""
    ns = make_ns(num_layers=2, num_kv_heads=2, head_dim=64, block_tokens=16)   # 16 KiB blocks
    cfg = small_config(tmp_path, host_bytes="8MiB", host_slab_bytes="2MiB", disk_bytes="16MiB",
                       disk_slab_bytes="4MiB", disk_file_bytes="16MiB")
    keys = chain(ns, 5, 12)
    synced(cfg, ns, keys)
    slots = find_slots(tmp_path / "disk")
    f, first = slots[keys[0]]
    stride = 4096 + ns.block_bytes
    assert [slots[k] for k in keys] == [(f, first + i * stride) for i in range(12)]   # one run on disk
    flip(f, first + 5 * stride + 4096 + 1000, 0x40)        # block 5: a payload byte
    with open(f, "r+b") as fh:
        fh.seek(first + 8 * stride + 32)                   # block 8: its header names another key
        fh.write(keys[0])
    with TieredStore(cfg) as s:
        before = _read_calls()
        with s.acquire(ns, keys) as lease:                 # every block planned, read at once
            assert len(lease) == 5                         # the longest exact prefix
            for buf, k in zip(lease.buffers, keys):
                assert np.array_equal(buf, block_for(ns, k))
        assert _read_calls() - before < 12                 # fewer calls than blocks
        assert s.stats()["tiers"]["disk"]["corrupt_dropped"] == 2
        assert [served_exact(s, ns, k) for k in keys] == [True] * 5 + [None, True, True, None] + [True] * 3


def _write_calls() -> int:
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("syscw:"))


@pytest.mark.skipif(not os.path.exists("/proc/self/io"), reason="counts write calls through /proc/self/io")
@pytest.mark.parametrize("n, block_tokens, io_threads", [(12, 16, 4), (56, 64, 1)],
                         ids=["one-run", "more-runs-than-threads"])   # 16 and 64 KiB blocks
@pytest.mark.parametrize("codec", ["none", "zstd"])
def test_blocks_synced_together_are_each_a_whole_slot_on_disk(tmp_path, codec, n, block_tokens, io_threads):
    """A sync writes slots that follow one another in a file in one call; each is still a whole
    slot of its own (header, payload, zeros after a compressed payload): after a restart that
    scans the headers (no checkpoint), every block is served exact, and a block damaged on
    disk is dropped alone. With more such calls than I/O threads, the runs are laid out on
    the pack threads while the I/O threads write (the same slots on disk)."""
    ns = make_ns(num_layers=2, num_kv_heads=2, head_dim=64, block_tokens=block_tokens)
    cfg = small_config(tmp_path, host_bytes="8MiB", host_slab_bytes="2MiB", disk_bytes="16MiB",
                       disk_slab_bytes="4MiB", disk_file_bytes="16MiB", disk_codec=codec,
                       disk_io_threads=io_threads)
    keys = chain(ns, 9, n)
    want = {k: block_for(ns, k) & 0x03 for k in keys}     # compressible

    def served(s, k):
        got = s.get(ns, [k])
        if not got:
            return None
        assert np.array_equal(got[0], want[k]), f"block {k.hex()} served with wrong bytes"
        return True
    with TieredStore(cfg) as s:
        s.put(ns, keys, [want[k] for k in keys])
        before = _write_calls()
        assert s.sync() == n
        calls = _write_calls() - before
        assert calls < n // 8 + 4                          # a call per MiB, not per block
        assert calls > io_threads or n == 12               # more runs than threads
    d = tmp_path / "disk"
    slots = find_slots(d)
    f, first = slots[keys[0]]
    stride = 4096 + ns.block_bytes
    assert [slots[k] for k in keys] == [(f, first + i * stride) for i in range(n)]
    if codec == "zstd":                                    # compressed: zeros up to the next slot
        data = f.read_bytes()
        tail = data[first + 3 * stride - 512:first + 3 * stride]
        assert tail == bytes(512)
    flip(f, first + 6 * stride + 4096 + 10, 0x21)          # block 6: a payload byte
    (d / CHECKPOINT_NAME).unlink()
    with TieredStore(cfg) as s:
        assert s.stats()["tiers"]["disk"]["recovered_from"] == "scan"
        assert [served(s, k) for k in keys] == [True] * 6 + [None] + [True] * (n - 7)


@pytest.mark.timeout(60, method="thread")   # a bounce buffer lost would hang the next sync
def test_a_sync_that_fails_while_runs_are_packed_loses_nothing_and_the_next_one_writes_all(tmp_path):
    """Writes failing while the pack threads lay out the next runs (more runs than I/O threads):
    the sync reports the disk degraded, no block is counted on disk, every bounce buffer comes
    back (the next sync would wait on one forever), and once the disk takes writes again the
    next sync writes every block, served exact after a restart."""
    faults = tmp_path / "faults"
    ns = make_ns(num_layers=2, num_kv_heads=2, head_dim=64, block_tokens=128)   # 128 KiB blocks
    cfg = dict(host_bytes="16MiB", host_slab_bytes="4MiB", disk_bytes="32MiB", disk_slab_bytes="16MiB",
               disk_file_bytes="32MiB", disk_io_threads=1)   # one slab: every write batch is 4 runs
    (warm,) = chain(ns, 12, 1)
    keys = chain(ns, 11, 60)
    with TieredStore(small_config(tmp_path, disk_fault_file=str(faults), **cfg)) as s:
        s.put(ns, [warm], [block_for(ns, warm)])
        assert s.sync() == 1        # its slab header and namespace record first: the blocks' writes fail
        s.put(ns, keys, [block_for(ns, k) for k in keys])
        faults.write_text("write=EIO")
        with pytest.raises(DiskDegradedError):
            s.sync()
        assert "disk" not in "".join(s.where(ns, keys))
        faults.write_text("")
        assert s.sync() == 60
    with TieredStore(small_config(tmp_path, **cfg)) as s:
        assert all(served_exact(s, ns, k) for k in keys)
        assert s.stats()["tiers"]["disk"]["corrupt_dropped"] == 0


def test_disk_io_buffers_are_given_back_once_unused_and_taken_again_when_io_resumes(tmp_path):
    """The disk tier's bounce buffers (a pipelined sync's, a promotion's reads) stay while I/O
    keeps coming and go back to the system once unused for `disk_buffer_idle_s`: the stats say
    so and the process's resident memory drops by them. The next promotion takes new ones and
    serves every block exact."""
    psutil = pytest.importorskip("psutil")
    ns = make_ns(num_layers=4, num_kv_heads=4, head_dim=128, block_tokens=256)   # 2 MiB blocks
    cfg = dict(host_bytes="64MiB", host_slab_bytes="16MiB", disk_bytes="128MiB", disk_slab_bytes="16MiB",
               disk_file_bytes="64MiB", disk_io_threads=2, disk_buffer_idle_s=1.0)
    keys = chain(ns, 21, 24)
    me = psutil.Process()

    def held(s) -> int:
        return s.stats()["tiers"]["disk"]["io_buffer_bytes"]

    def given_back(s) -> None:
        rss = me.memory_info().rss
        before = held(s)
        assert before >= ns.block_bytes
        wait_for(lambda: held(s) == 0, 15, "the idle I/O buffers given back")
        assert rss - me.memory_info().rss >= before // 2, "the buffers' memory stayed with the process"

    with TieredStore(small_config(tmp_path, **cfg)) as s:
        s.put(ns, keys, [block_for(ns, k) for k in keys])
        assert s.sync() == 24               # 24 runs on 2 I/O threads: the pipelined sync
        given_back(s)
    with TieredStore(small_config(tmp_path, **cfg)) as s:
        assert all(served_exact(s, ns, k) for k in keys)   # promoted from disk: read buffers
        given_back(s)
        s.put(ns, keys[:1], [block_for(ns, keys[0])])
        assert all(served_exact(s, ns, k) for k in keys)
