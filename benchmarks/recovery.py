"""Disk tier recovery time against its size: reopening after a clean close (index from the
checkpoint) and after a crash (index rebuilt by scanning every slot header), beside the floor of
a scan in the same run: reading the pages tierd's scan reads (every slab's header page, and the
header page of every slot of each slab in use), 4 KiB per read, O_DIRECT when tierd uses it,
one task per slab on as many threads as tierd's scan (disk_io_threads), and also serially; the
faster of the two is the floor (params floor_threads says which).

    python -m benchmarks.recovery [--json PATH] [--quick]
"""

from __future__ import annotations

import mmap
import os
import shutil
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from tierd import Namespace, TieredStore

from .common import Result, parse_args, report

PAGE = 4096


@dataclass
class Geometry:
    """What the floor needs to read the pages tierd's scan reads, taken from the store that
    wrote them (read only)."""
    slab_bytes: int
    slabs_per_file: int
    num_slabs: int
    direct_io: bool
    io_threads: int


def fill(path: str, disk_bytes: int, ns: Namespace) -> tuple[int, Geometry]:
    s = TieredStore(host_bytes="64MiB", disk_path=path, disk_bytes=disk_bytes, disk_admit_min_hits=0)
    n = int(disk_bytes * 0.8) // (ns.block_bytes + 4096)
    block = np.random.default_rng(0).integers(0, 256, ns.block_bytes, dtype=np.uint8)
    toks = np.arange(n * ns.block_tokens) % 30000
    keys = ns.block_keys(toks)
    for i in range(0, n, 64):
        s.put(ns, keys[i:i + 64], [block] * len(keys[i:i + 64]))
        s.sync()
    d = s.disk
    geo = Geometry(d.slab_bytes, d.slabs_per_file, d.num_slabs, d.direct_io, s.config.disk_io_threads)
    s.close()
    return n, geo


def reopen(path: str, disk_bytes: int) -> tuple[float, str, int]:
    t0 = time.perf_counter()
    s = TieredStore(host_bytes="64MiB", disk_path=path, disk_bytes=disk_bytes)
    dt = time.perf_counter() - t0
    st = s.stats()["tiers"]["disk"]
    s.close()
    return dt, st["recovered_from"], st["blocks"]


def header_floor(path: str, geo: Geometry, slot_bytes: int, threads: int) -> tuple[float, int]:
    """(seconds, pages) to read what tierd's scan reads, as it reads it: one task per slab, in
    slab order, on `threads` threads (1: the calling thread); a task reads its slab's header
    page and, if that page is not blank (the slab is in use), the header page of each of the
    slab's slots of `slot_bytes`. One 4 KiB preadv per page into a page-aligned buffer, on
    files opened O_DIRECT when tierd's are. Nothing is parsed: only the reads are timed."""
    files = sorted(Path(path).glob("slab-*.tds"))
    fds = [os.open(f, os.O_RDONLY | (os.O_DIRECT if geo.direct_io else 0)) for f in files]
    per_slab = (geo.slab_bytes - PAGE) // slot_bytes
    blank = bytes(PAGE)

    def scan_slab(slab: int) -> int:
        fd = fds[slab // geo.slabs_per_file]
        base = PAGE + (slab % geo.slabs_per_file) * geo.slab_bytes
        buf = mmap.mmap(-1, PAGE)
        if os.preadv(fd, [buf], base) < PAGE or buf[:] == blank:
            return 1
        for i in range(per_slab):
            if os.preadv(fd, [buf], base + PAGE + i * slot_bytes) < PAGE:
                return 1 + i
        return 1 + per_slab

    pool = ThreadPoolExecutor(threads) if threads > 1 else None
    try:
        t0 = time.perf_counter()
        if pool is None:
            pages = sum(scan_slab(slab) for slab in range(geo.num_slabs))
        else:
            pages = sum(pool.map(scan_slab, range(geo.num_slabs)))
        return time.perf_counter() - t0, pages
    finally:
        if pool is not None:
            pool.shutdown()
        for fd in fds:
            os.close(fd)


def drop_caches() -> None:
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
    except OSError:
        pass   # not root: the page cache stays warm for every side alike


def main() -> int:
    args = parse_args(__doc__.splitlines()[0])
    ns = Namespace("recovery-bench", "float16", 8, 4, 128, block_tokens=64)   # 1 MiB blocks
    sizes = [64 << 20, 256 << 20] if args.quick else [256 << 20, 1 << 30, 4 << 30]
    results = []
    for size in sizes:
        work = tempfile.mkdtemp(prefix="tierd-recovery-", dir=os.environ.get("TIERD_BENCH_DIR"))
        path = os.path.join(work, "disk")
        try:
            n, geo = fill(path, size, ns)
            drop_caches()
            t_ckpt, how, blocks = reopen(path, size)
            assert how == "checkpoint" and blocks == n, (how, blocks, n)
            os.unlink(os.path.join(path, "index.ckpt"))        # as after a crash
            drop_caches()
            t_scan, how, blocks = reopen(path, size)
            assert how == "scan" and blocks == n, (how, blocks, n)
            floors = {}
            for threads in sorted({1, geo.io_threads}):   # serial, and tierd's parallelism
                drop_caches()
                floors[threads], pages = header_floor(path, geo, ns.block_bytes + PAGE, threads)
                assert pages >= n + geo.num_slabs, (pages, n, geo.num_slabs)
            best = min(floors, key=floors.get)
            p = {"disk_MiB": size >> 20, "blocks": n}
            results.append(Result("reopen after a crash (scan)", {**p, "floor_threads": best}, t_scan, "s",
                                  "pread the scan's header pages", floors[best], higher_is_better=False,
                                  note=f"{pages} header pages on {geo.num_slabs} slabs; floor seconds by "
                                  "threads {" + ", ".join(f"{t}: {v:.4f}" for t, v in floors.items())
                                  + "}, the best is the floor"))
            results.append(Result("reopen after a clean close (checkpoint)", p, t_ckpt, "s", "scan", t_scan,
                                  higher_is_better=False))
        finally:
            shutil.rmtree(work, ignore_errors=True)
    report("recovery", results, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
