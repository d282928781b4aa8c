"""Disk tier recovery time against its size: reopening after a clean close (index from the
checkpoint) and after a crash (index rebuilt by scanning every slot header), beside the floor of
a scan: reading one header page per stored block with plain preads, in the same run.

    python -m benchmarks.recovery [--json PATH] [--quick]
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from tierd import Namespace, TieredStore

from .common import Result, parse_args, report


def fill(path: str, disk_bytes: int, ns: Namespace) -> int:
    s = TieredStore(host_bytes="64MiB", disk_path=path, disk_bytes=disk_bytes, disk_admit_min_hits=0)
    n = int(disk_bytes * 0.8) // (ns.block_bytes + 4096)
    block = np.random.default_rng(0).integers(0, 256, ns.block_bytes, dtype=np.uint8)
    toks = np.arange(n * ns.block_tokens) % 30000
    keys = ns.block_keys(toks)
    for i in range(0, n, 64):
        s.put(ns, keys[i:i + 64], [block] * len(keys[i:i + 64]))
        s.sync()
    s.close()
    return n


def reopen(path: str, disk_bytes: int) -> tuple[float, str, int]:
    t0 = time.perf_counter()
    s = TieredStore(host_bytes="64MiB", disk_path=path, disk_bytes=disk_bytes)
    dt = time.perf_counter() - t0
    st = s.stats()["tiers"]["disk"]
    s.close()
    return dt, st["recovered_from"], st["blocks"]


def header_floor(path: str, n: int, stride: int) -> float:
    """Seconds to pread one 4 KiB page every `stride` bytes, n times, across the slab files."""
    files = sorted(Path(path).glob("slab-*.tds"))
    fds = [os.open(f, os.O_RDONLY) for f in files]
    try:
        sizes = [os.fstat(fd).st_size for fd in fds]
        t0 = time.perf_counter()
        done, fi, off = 0, 0, 4096
        while done < n and fi < len(fds):
            if off + 4096 > sizes[fi]:
                fi, off = fi + 1, 4096
                continue
            os.pread(fds[fi], 4096, off)
            off += stride
            done += 1
        return time.perf_counter() - t0
    finally:
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
    ns = Namespace("recovery-bench", "float16", 8, 4, 128, block_tokens=64)   # 512 KiB blocks
    sizes = [64 << 20, 256 << 20] if args.quick else [256 << 20, 1 << 30, 4 << 30]
    results = []
    for size in sizes:
        work = tempfile.mkdtemp(prefix="tierd-recovery-", dir=os.environ.get("TIERD_BENCH_DIR"))
        path = os.path.join(work, "disk")
        try:
            n = fill(path, size, ns)
            drop_caches()
            t_ckpt, how, blocks = reopen(path, size)
            assert how == "checkpoint" and blocks == n, (how, blocks, n)
            os.unlink(os.path.join(path, "index.ckpt"))        # as after a crash
            drop_caches()
            t_scan, how, blocks = reopen(path, size)
            assert how == "scan" and blocks == n, (how, blocks, n)
            drop_caches()
            floor = header_floor(path, n, ns.block_bytes + 4096)
            p = {"disk_MiB": size >> 20, "blocks": n}
            results.append(Result("reopen after a crash (scan)", p, t_scan, "s", "pread one header page per block",
                                  floor, higher_is_better=False))
            results.append(Result("reopen after a clean close (checkpoint)", p, t_ckpt, "s", "scan", t_scan,
                                  higher_is_better=False))
        finally:
            shutil.rmtree(work, ignore_errors=True)
    report("recovery", results, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
