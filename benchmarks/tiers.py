"""How close do the host and disk tiers come to their physical floors?

For blocks of 64 KiB, 1 MiB and 16 MiB:
  host put / get GB/s        beside numpy memcpy of the same bytes in the same run
  disk write / read GB/s     beside raw O_DIRECT pwrite / pread of the same work on the same
                             filesystem: one aligned request per block of tierd's size (header
                             page + block) at tierd's slot offsets, writes ending in one
                             fdatasync, reads 8 blocks per call as the tierd side asks for them,
                             on a pool of io_threads threads (the same threads as tierd, which
                             joins slots next to each other on disk into larger requests: the
                             floor, goal >= 0.8 for blocks of 1 MiB and
                             more); also beside the best of 1, io_threads and 2 x io_threads
                             threads, and beside fio at its best setting (io_uring and libaio,
                             1 or 4 jobs, queue depth 1 to 32, same request size and
                             filesystem) where fio is installed (`make bench` installs it)
and the zstd codec on synthetic KV-like fp16 data: compression ratio, and compress / decompress
GB/s on one core beside the raw disk write floor (above 1x: the codec does not slow the disk).

    python -m benchmarks.tiers [--json PATH] [--quick] [--dir DIR] [--io-threads N]
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from tierd import Namespace, TieredStore
from tierd import codec as tcodec
from tierd.config import MiB, format_size
from tierd.tiers.disk_files import io_buffer

from .common import Result, best_of, parse_args, report

KiB = 1024
PAGE = 4 * KiB
READ_BATCH = 8  # blocks per acquire on the tierd side, per read call on the raw side


def namespace_for(block_bytes: int) -> Namespace:
    # the bench model's layout (8 layers, 4 KV heads of 64, fp16): 8 KiB per token
    return Namespace(model="bench-tiers", kv_dtype="float16", num_layers=8, num_kv_heads=4,
                     head_dim=64, block_tokens=block_bytes // (8 * KiB))


def kv_like(nbytes: int, seed: int = 0) -> np.ndarray:
    """Synthetic fp16 K/V: normal values with log-uniform per-channel scales and two outlier
    channels (x20), as reported for real key caches. (nbytes,) uint8."""
    rng = np.random.default_rng(seed)
    n = nbytes // 2
    channels = 64
    scale = np.exp(rng.uniform(np.log(0.05), np.log(2.0), channels)).astype(np.float32)
    scale[rng.choice(channels, 2, replace=False)] *= 20
    vals = rng.standard_normal((n // channels, channels), dtype=np.float32) * scale
    return vals.astype(np.float16).reshape(-1).view(np.uint8)


def gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9


def bench_host(ns: Namespace, n_blocks: int, batch: int, repeats: int) -> list[Result]:
    """tierd put/get and memcpy of the same bytes, measured alternately, best of each."""
    bb = ns.block_bytes
    total = n_blocks * bb
    src = [kv_like(bb, seed=i) for i in range(4)]
    keys = [k for i in range(n_blocks) for k in ns.block_keys(np.full(ns.block_tokens, i))]
    batches = [list(range(i, min(i + batch, n_blocks))) for i in range(0, n_blocks, batch)]
    params = {"block": format_size(bb), "blocks": n_blocks, "batch": batch}
    dst = np.empty(total, dtype=np.uint8)
    dst[:] = 1  # fault the pages in
    flat = np.empty(total, dtype=np.uint8)
    flat[:] = 2
    with TieredStore(host_bytes=total + 64 * MiB, host_slab_bytes=max(64 * MiB, 2 * bb),
                     host_high_watermark=1.0, host_low_watermark=1.0) as store:
        def put_all():
            for b in batches:
                store.put(ns, [keys[i] for i in b], [src[i % 4] for i in b])

        def get_all():
            # what an engine does: lease, copy into its own buffers, release
            for b in batches:
                with store.acquire(ns, [keys[i] for i in b]) as lease:
                    for i, buf in zip(b, lease.buffers):
                        np.copyto(dst[i * bb:(i + 1) * bb], buf)

        def memcpy_in():
            for i in range(n_blocks):
                np.copyto(dst[i * bb:(i + 1) * bb], src[i % 4])

        def memcpy_out():
            for i in range(n_blocks):
                np.copyto(dst[i * bb:(i + 1) * bb], flat[i * bb:(i + 1) * bb])

        put_all()  # fault the arena's pages in, as in a long-running store
        t_put = t_get = m_in = m_out = float("inf")
        for _ in range(repeats):
            store.flush(tier="host")
            t_put = min(t_put, timed(put_all))
            m_in = min(m_in, timed(memcpy_in))
            t_get = min(t_get, timed(get_all))
            m_out = min(m_out, timed(memcpy_out))
        get_all()
        assert np.array_equal(dst[:bb], src[0]) and np.array_equal(dst[-bb:], src[(n_blocks - 1) % 4])
    return [Result("host put", params, gbps(total, t_put), "GB/s", "memcpy GB/s", gbps(total, m_in),
                   note="put = validate, reserve slots, memcpy into the shared arena, commit"),
            Result("host get", params, gbps(total, t_get), "GB/s", "memcpy GB/s", gbps(total, m_out),
                   note="get = acquire lease, copy each block into the caller's buffer, release")]


class RawDirect:
    """The floor: tierd's disk work with nothing of tierd in it, at a chosen parallelism.

    Each block is one O_DIRECT pwrite / pread of tierd's request size (a 4 KiB header page
    plus the block rounded up to 4 KiB) at tierd's slot offsets (slots of that size back to
    back in slabs of `slab_bytes`, a header page before each slab and one before the first),
    from a buffer per thread of the memory tierd's bounce buffers are made of (`io_buffer`:
    huge pages where the buffer is large, so that a request is as few segments as the disk
    can take: the best this disk does, not a buffer it reads slower into), on a
    preallocated, pre-written file of the same filesystem. `write(t)` writes every block on
    t threads (t requests in flight), then one fdatasync; `read(t)` reads them READ_BATCH
    blocks per call, each call's blocks on t threads, as tierd's acquire of READ_BATCH keys.
    t = 1 runs on the calling thread (no pool hop)."""

    def __init__(self, path: str, block_bytes: int, n_blocks: int, slab_bytes: int,
                 threads: list[int], direct: bool = True):
        self.req = PAGE + -(-block_bytes // PAGE) * PAGE
        per_slab = (slab_bytes - PAGE) // self.req
        self.offsets = [PAGE + (i // per_slab) * slab_bytes + PAGE + (i % per_slab) * self.req
                        for i in range(n_blocks)]
        self.batches = [self.offsets[i:i + READ_BATCH] for i in range(0, n_blocks, READ_BATCH)]
        self.path = path
        self.pattern = kv_like(self.req).tobytes()
        self._local = threading.local()
        self.pools = {t: ThreadPoolExecutor(t, thread_name_prefix="raw-direct") for t in threads if t > 1}
        self.fd = os.open(path, os.O_RDWR | os.O_CREAT | (os.O_DIRECT if direct else 0), 0o600)
        os.posix_fallocate(self.fd, 0, self.offsets[-1] + self.req)
        for t in threads:   # converts the unwritten extents, starts every thread and buffer
            self.write(t)

    def _buf(self) -> np.ndarray:
        b = getattr(self._local, "buf", None)
        if b is None:
            b = self._local.buf = io_buffer(self.req)[:self.req]
            b[:] = np.frombuffer(self.pattern, dtype=np.uint8)
        return b

    def _pwrite(self, off: int) -> None:
        if os.pwrite(self.fd, self._buf(), off) != self.req:
            raise OSError("short raw write")

    def _pread(self, off: int) -> None:
        if os.preadv(self.fd, [self._buf()], off) != self.req:
            raise OSError("short raw read")

    def write(self, threads: int) -> None:
        if threads == 1:
            for off in self.offsets:
                self._pwrite(off)
        else:
            list(self.pools[threads].map(self._pwrite, self.offsets))
        os.fdatasync(self.fd)

    def read(self, threads: int) -> None:
        if threads == 1:
            for off in self.offsets:
                self._pread(off)
            return
        pool = self.pools[threads]
        for batch in self.batches:
            list(pool.map(self._pread, batch))

    def close(self) -> None:
        for pool in self.pools.values():
            pool.shutdown()
        os.close(self.fd)
        os.unlink(self.path)


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def bench_disk(ns: Namespace, n_blocks: int, repeats: int, where: str, io_threads: int) -> list[Result]:
    """tierd and the raw floor measured alternately (A/B/A/B...), best of each: the disk's
    speed drifts on shared machines, alternation keeps both sides under the same drift. The
    raw side runs at 1, io_threads and 2 x io_threads threads in every round; the floor is
    the best of them, so tierd is set against the best this disk does on the same requests."""
    bb = ns.block_bytes
    total = n_blocks * bb
    params = {"block": format_size(bb), "blocks": n_blocks, "io_threads": io_threads}
    keys = [k for i in range(n_blocks) for k in ns.block_keys(np.full(ns.block_tokens, i))]
    src = [kv_like(bb, seed=i) for i in range(4)]
    settings = sorted({1, io_threads, 2 * io_threads})
    d = tempfile.mkdtemp(prefix="tierd-bench-", dir=where)
    raw = None
    try:
        slab = max(256 * MiB, 4 * (bb + 4 * KiB) + 4 * KiB)
        disk_bytes = n_blocks * (bb + 4 * KiB) + 2 * slab + 64 * MiB
        with TieredStore(host_bytes=total + 64 * MiB, host_slab_bytes=max(64 * MiB, 2 * bb),
                         host_high_watermark=1.0, host_low_watermark=1.0,
                         disk_path=d, disk_bytes=disk_bytes, disk_slab_bytes=slab,
                         disk_file_bytes=max(4 << 30, slab + 4 * KiB),
                         disk_io_threads=io_threads) as store:
            direct = store.disk.direct_io
            for i in range(0, n_blocks, 8):
                store.put(ns, keys[i:i + 8], [src[j % 4] for j in range(i, min(i + 8, n_blocks))])
            store.sync()  # first write converts the file's unwritten extents; not measured
            raw = RawDirect(os.path.join(d, "raw.bin"), bb, n_blocks, store.disk.slab_bytes,
                            settings, direct=direct)

            def tierd_read():
                for i in range(0, n_blocks, READ_BATCH):
                    with store.acquire(ns, keys[i:i + READ_BATCH]) as lease:
                        assert len(lease) == min(READ_BATCH, n_blocks - i)

            def tierd_write():
                if store.sync() != n_blocks:
                    raise RuntimeError("sync wrote fewer blocks than stored")

            t_w = t_r = float("inf")
            r_w = dict.fromkeys(settings, float("inf"))
            r_r = dict.fromkeys(settings, float("inf"))
            for _ in range(repeats):
                store.flush(tier="disk")
                t_w = min(t_w, timed(tierd_write))
                for t in settings:
                    r_w[t] = min(r_w[t], timed(lambda: raw.write(t)))
                store.flush(tier="host")
                t_r = min(t_r, timed(tierd_read))
                for t in settings:
                    r_r[t] = min(r_r[t], timed(lambda: raw.read(t)))
            assert store.stats()["tiers"]["disk"]["corrupt_dropped"] == 0
        # fio on the same filesystem and request size (reads first: they lay the file out)
        fio_r = fio_best(d, raw.req, total, "read") if direct else None
        fio_w = fio_best(d, raw.req, total, "write") if direct else None
    finally:
        if raw is not None:
            raw.close()
        shutil.rmtree(d, ignore_errors=True)
    best_w, best_r = min(r_w, key=r_w.get), min(r_r, key=r_r.get)

    def by_threads(r: dict) -> str:
        return ", ".join(f"{t}: {gbps(total, r[t]):.3f}" for t in settings)

    note = ("" if direct else "filesystem refused O_DIRECT: tierd and raw used buffered I/O + fdatasync; "
            "reads may come from the page cache. ")
    goal = "goal >= 0.8; " if bb >= MiB else ""
    out = [Result("disk write (sync)", {**params, "floor_threads": io_threads}, gbps(total, t_w), "GB/s",
                  "raw O_DIRECT pwrite GB/s, same threads", gbps(total, r_w[io_threads]),
                  note=note + goal + "write = sync(): checksum, header page and payload per block, slots "
                  "next to each other in one aligned write of up to 2 MiB, a block over 2 MiB in 2 MiB "
                  "pieces and its header page last, laid out in huge-page bounce buffers on 2 pack "
                  f"threads while {io_threads} I/O threads write, then fdatasync; raw = one write per "
                  f"block and fdatasync on {io_threads} threads"),
           Result("disk read (promote)", {**params, "floor_threads": io_threads}, gbps(total, t_r), "GB/s",
                  "raw O_DIRECT pread GB/s, same threads", gbps(total, r_r[io_threads]),
                  note=note + goal + f"read = acquire of blocks on disk only ({READ_BATCH} per call): "
                  f"pread of slots next to each other in one call (up to 8 MiB, an even share of twice "
                  f"the threads; a block over 2 MiB in 2 MiB pieces) on {io_threads} I/O threads into "
                  f"bounce buffers, each block's header and checksum verified and copied into its host "
                  f"slot as the reads land; raw = one pread per block on {io_threads} threads"),
           Result("disk write (sync) vs the best raw setting", {**params, "floor_threads": best_w},
                  gbps(total, t_w), "GB/s", "raw O_DIRECT pwrite GB/s, best threads", gbps(total, r_w[best_w]),
                  note=f"raw GB/s by threads {{{by_threads(r_w)}}}"),
           Result("disk read (promote) vs the best raw setting", {**params, "floor_threads": best_r},
                  gbps(total, t_r), "GB/s", "raw O_DIRECT pread GB/s, best threads", gbps(total, r_r[best_r]),
                  note=f"raw GB/s by threads {{{by_threads(r_r)}}}")]
    for what, t, fio in (("write (sync)", t_w, fio_w), ("read (promote)", t_r, fio_r)):
        if fio is not None:
            out.append(Result(f"disk {what} vs fio", {**params, "fio": fio[1]}, gbps(total, t), "GB/s",
                              "fio at its best setting GB/s", fio[0] / 1e9,
                              note="moonshot >= 0.95; fio's write figure leaves out its final fsync"))
    return out


FIO_SETTINGS = [(1, 1), (1, 8), (1, 32), (4, 1), (4, 8)]   # (jobs, queue depth)


def fio_best(d: str, req: int, total: int, rw: str) -> tuple[float, str] | None:
    """fio's best bandwidth (bytes/s) and its setting for O_DIRECT requests of `req` bytes over
    `total` bytes of a file in `d`, or None without fio. Reads run first (fio lays the file out
    then), so writes overwrite written blocks, as tierd's and the raw side's do."""
    exe = shutil.which("fio")
    if exe is None:
        return None
    path = os.path.join(d, "fio.bin")
    best = None
    for engine in ("io_uring", "libaio"):
        for jobs, depth in FIO_SETTINGS:
            per = max(req, total // jobs // req * req)
            argv = [exe, "--name=tierd-floor", f"--filename={path}", f"--rw={rw}", f"--bs={req}",
                    f"--size={per}", f"--offset_increment={per}", f"--numjobs={jobs}", f"--iodepth={depth}",
                    f"--ioengine={engine}", "--direct=1", "--thread", "--group_reporting",
                    "--output-format=json", *(["--end_fsync=1"] if rw == "write" else [])]
            p = subprocess.run(argv, capture_output=True, text=True, timeout=300)
            if p.returncode != 0:
                break       # this engine is not available here
            try:
                bw = float(json.loads(p.stdout[p.stdout.index("{"):])["jobs"][0][rw]["bw_bytes"])
            except (ValueError, KeyError, IndexError):
                continue
            if best is None or bw > best[0]:
                best = (bw, f"{engine}, {jobs} job(s), iodepth {depth}")
    if os.path.exists(path):
        os.unlink(path)
    return best


def bench_codec(nbytes: int, disk_write_gbps: float) -> list[Result]:
    data = kv_like(nbytes, seed=3)
    out = np.empty_like(data)
    results = []
    for label, codec_id, level in (("zstd-1 + shuffle", tcodec.CODEC_ZSTD_SHUFFLE2, 1),
                                   ("zstd-1", tcodec.CODEC_ZSTD, 1),
                                   ("zstd-3 + shuffle", tcodec.CODEC_ZSTD_SHUFFLE2, 3)):
        # (loop variables bound as defaults: the lambdas run inside this iteration only)
        payload = tcodec.encode(codec_id, data, level)
        t_c = best_of(lambda: tcodec.encode(codec_id, data, level), 3)
        t_d = best_of(lambda: tcodec.decode(codec_id, payload, out), 3)
        assert np.array_equal(out, data)
        params = {"codec": label, "data": f"synthetic fp16 KV, {format_size(nbytes)}"}
        results += [
            Result("zstd ratio", params, nbytes / len(payload), "x", "uncompressed", 1.0),
            Result("zstd compress", params, gbps(nbytes, t_c), "GB/s per core", "raw disk write GB/s",
                   disk_write_gbps),
            Result("zstd decompress", params, gbps(nbytes, t_d), "GB/s per core", "raw disk write GB/s",
                   disk_write_gbps)]
    return results


def main() -> None:
    def extra(ap):
        ap.add_argument("--dir", default=tempfile.gettempdir(), help="filesystem to test the disk tier on")
        ap.add_argument("--io-threads", type=int, default=4, help="disk I/O threads of the store (default 4)")

    args = parse_args(__doc__.splitlines()[0], extra=extra)
    quick = args.quick
    total = (64 if quick else 512) * MiB
    repeats = 3 if quick else 5
    results: list[Result] = []
    for bb in (64 * KiB, 1 * MiB, 16 * MiB):
        ns = namespace_for(bb)
        n = max(4, total // bb)
        results += bench_host(ns, n, batch=8, repeats=repeats)
        results += bench_disk(ns, n, repeats=repeats, where=args.dir, io_threads=args.io_threads)
    raw_1m = next(r.reference_value for r in results
                  if r.name.startswith("disk write") and r.params["block"] == "1MiB")
    results += bench_codec((4 if quick else 16) * MiB, raw_1m)
    report("tiers", results, args.json)


if __name__ == "__main__":
    main()
