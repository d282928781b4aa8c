"""The disk tier's block I/O, outside the store lock on slots the store has pinned: writing
blocks (one slot, or many in runs of adjacent slots, pipelined through pack threads), reading and
verifying them (one, or many in runs; pipelines and large slots in tierd/tiers/disk_pieces.py),
tombstones and `flush`, and the page-aligned buffers they go through. Part of `DiskTier` (tierd/tiers/disk.py), whose constructor declares what it uses:
the I/O and pack threads (`pool`, `_packers`, `io_threads`), the buffers (`_spare`, `_bounce`,
`_local`), the files (`_fds`, `_slot_loc`, `slab_gen`) and the calls in flight (`_io`, `faults`).
It never serves a slot whose header or checksum fails, and never touches the allocator.
"""

from __future__ import annotations

import contextlib
import errno
import mmap
import os
import threading
import time
from collections.abc import Sequence

import numpy as np

from .. import codec as _codec
from ..arena import SlabAllocator
from ..config import align_up
from .base import BlockMeta
from .disk_files import DiskEntry, _aligned, io_buffer
from .slot_header import PAGE, CorruptBlockError, _csum, copy_hashed, encode_block, pack_slot_header, unpack_slot_header

# Promotions read slots that lie one after another in a file in one call of up to RUN_BYTES
# (cut into an even share of twice the I/O threads above SPLIT_BYTES each, so that a thread
# reads its next share while the last one is checked), across gaps of up to READ_GAP_BYTES
# (read and not used); syncs write such slots in one call while it is under WRITE_RUN_BYTES
# (benchmarks/tiers.py; with huge-page bounce buffers a call of up to 4 MiB is one request to
# the disk: docs/design-notes.md)
RUN_BYTES = 8 << 20
SPLIT_BYTES = 512 << 10
READ_GAP_BYTES = 64 << 10
WRITE_RUN_BYTES = 2 << 20
# A sync of more runs than I/O threads packs runs (payload copied and checksummed, header laid
# out) on PACK_THREADS threads while the I/O threads keep writing: the copy no longer leaves the
# disk with fewer writes in flight (benchmarks/tiers.py)
PACK_THREADS = 2


class _Buffers:
    """Page-aligned I/O buffers kept for reuse (a fresh one costs a page fault per 4 KiB on first
    use): `take` hands out the smallest free buffer that is large enough (else the smallest makes
    way for a new one), `give` takes it back. With a `limit`, at most that many are out at once
    and `take` waits for one to come back (the pipelined sync's buffers, handed from the pack
    threads to the I/O threads). `trim` drops the buffers not taken for a while."""

    def __init__(self, limit: int | None = None):
        self._slots = threading.Semaphore(limit) if limit else None
        self._lock = threading.Lock()
        self._free: list[tuple[float, np.ndarray]] = []     # (when given back, buffer)
        self.nbytes = 0                                      # all buffers, free and out

    def take(self, nbytes: int) -> np.ndarray:
        if self._slots is not None:
            self._slots.acquire()
        try:
            with self._lock:
                order = sorted(range(len(self._free)), key=lambda j: self._free[j][1].nbytes)
                fits = [j for j in order if self._free[j][1].nbytes >= nbytes]
                if fits:
                    return self._free.pop(fits[0])[1]
                if order:
                    self.nbytes -= self._free.pop(order[0])[1].nbytes
                buf = io_buffer(nbytes)
                self.nbytes += buf.nbytes
                return buf
        except BaseException:
            if self._slots is not None:
                self._slots.release()
            raise

    def give(self, buf: np.ndarray) -> None:
        with self._lock:
            self._free.append((time.monotonic(), buf))
        if self._slots is not None:
            self._slots.release()

    @contextlib.contextmanager
    def held(self, nbytes: int):
        buf = self.take(nbytes)
        try:
            yield buf
        finally:
            self.give(buf)

    def trim(self, idle_s: float) -> int:
        """Drop the free buffers given back over `idle_s` ago (their memory goes back to the
        system once nothing refers to them); the bytes dropped."""
        cut = time.monotonic() - idle_s
        with self._lock:
            keep = [(t, b) for t, b in self._free if t > cut]
            dropped = sum(b.nbytes for t, b in self._free if t <= cut)
            self._free = keep
            self.nbytes -= dropped
        return dropped


class BlockIO:
    """Part of `DiskTier`: block reads and writes (no store lock held)."""

    def _page(self) -> mmap.mmap:
        p = getattr(self._local, "page", None)
        if p is None:
            p = self._local.page = _aligned(PAGE)
        return p

    def _staging(self, nbytes: int):
        """A page-aligned bounce buffer of at least `nbytes`, held for a `with` block.

        Every slot goes through one (a pipelined sync's through a `_bounce` buffer, the same
        kind of memory, `io_buffer`): a large request from the host arena's scattered 4 KiB
        pages reaches the disk as several small ones and ran at half the speed, a bounce
        through huge pages costs one memcpy, which is cheaper (docs/design-notes.md)."""
        return self._spare.held(nbytes)

    def trim_buffers(self) -> int:
        """Give back the I/O buffers unused for `buffer_idle_s`; the bytes given back."""
        return self._spare.trim(self.buffer_idle_s) + self._bounce.trim(self.buffer_idle_s)

    def write(self, slot: int, src: np.ndarray, meta: BlockMeta) -> DiskEntry:
        """Write one block from `src` (block_bytes,) uint8 as header page + payload (with the
        namespace's lossy codec where it has one), as `write_many` does. Not durable until
        `flush()`."""
        (got,) = self.write_many([(slot, src, meta)])
        if isinstance(got, BaseException):
            raise got
        return got

    def write_many(self, jobs: Sequence[tuple[int, np.ndarray, BlockMeta]]) -> list:
        """Write blocks (slot, source, meta) on the I/O threads: for each, its DiskEntry or the
        exception that failed it. Slots that follow one another in a file are written in one
        call of up to about WRITE_RUN_BYTES, each slot whole: header page, payload, and zeros to
        the slot's end where a codec made the payload shorter. With more such runs than I/O
        threads, or a slot large enough to go in pieces (tierd/tiers/disk_pieces.py), the pack
        threads lay runs and pieces out while the I/O threads write the ones before. Not
        durable until `flush()`."""
        out: list = [None] * len(jobs)
        if not jobs:
            return out
        locs = []
        for i, (slot, _, meta) in enumerate(jobs):
            fd, off = self._slot_loc(slot)
            locs.append((fd, off, self.slot_bytes_for(meta.block_bytes), i))
        runs = self._cut_runs(locs, gap=0, cap=WRITE_RUN_BYTES)
        if len(runs) > self.io_threads or any(len(r) == 1 and self._in_pieces(r[0][3]) for r in runs):
            self._write_pipelined(jobs, runs, out)
            return out

        def one(run: list[tuple[int, int, int, int]]) -> None:
            with self._staging(run[-1][2] + run[-1][3] - run[0][2]) as stg:
                try:
                    entries = self._pack_run(jobs, run, stg)
                except Exception as ex:  # noqa: BLE001 - every block of the run failed
                    for i, *_ in run:
                        out[i] = ex
                    return
                self._write_run(run, stg, entries, out)

        self._each_run(one, runs)
        return out

    def _write_pipelined(self, jobs: Sequence[tuple[int, np.ndarray, BlockMeta]], runs: list, out: list) -> None:
        """`write_many` of more runs than I/O threads, or of large slots: each run (each piece
        of a large slot) is packed into a bounce buffer on a pack thread and handed to the I/O
        threads, which keep `io_threads` writes in flight while the next are packed. Only pack
        threads wait for a buffer; the I/O threads never wait on anything but the disk. A large
        slot's header page is written here, once its pieces are."""
        def write(run: list, stg: np.ndarray, entries: list) -> None:
            try:
                self._write_run(run, stg, entries, out)
            finally:
                self._bounce.give(stg)

        def pack(run: list):
            if len(run) == 1 and self._in_pieces(run[0][3]):
                i, fd, off, _ = run[0]
                return self._pack_pieces(jobs[i], fd, off)
            stg = self._bounce.take(run[-1][2] + run[-1][3] - run[0][2])
            try:
                entries = self._pack_run(jobs, run, stg)
                return self.pool.submit(write, run, stg, entries)
            except BaseException as ex:
                self._bounce.give(stg)
                for i, *_ in run:
                    out[i] = ex
                return None

        packs = [(run, self._packers.submit(pack, run)) for run in runs]
        for run, f in packs:
            w = f.result()
            if isinstance(w, tuple):
                i, fd, off, _ = run[0]
                out[i] = self._finish_pieces(w, fd, off)
            elif w is not None:
                w.result()

    def _write_run(self, run: list, stg: np.ndarray, entries: list[tuple[int, DiskEntry]], out: list) -> None:
        """Write a packed run in one call, up to the end of its last slot's payload: each
        block's entry into `out`, or the error that failed them all."""
        start = run[0][2]
        try:
            self._pwrite(run[0][1], stg, run[-1][2] - start + PAGE + align_up(entries[-1][1].payload_len), start)
        except Exception as ex:  # noqa: BLE001 - every block of the run failed
            for i, *_ in run:
                out[i] = ex
            return
        for i, entry in entries:
            out[i] = entry

    def _pack_run(self, jobs: Sequence[tuple[int, np.ndarray, BlockMeta]], run: list,
                  stg: np.ndarray) -> list[tuple[int, DiskEntry]]:
        """Lay the slots of `run` out in `stg` as they lie in the file: header page, payload,
        and zeros to the slot's end where a codec made the payload shorter (nothing stale
        between slots written together). Returns (index in `jobs`, entry) for each."""
        start = run[0][2]
        entries = []
        for i, _, off, size in run:
            dst = stg[off - start:off - start + size]
            entry = self._pack_slot(jobs[i], dst)
            dst[PAGE + entry.payload_len:] = 0
            entries.append((i, entry))
        return entries

    def _each_run(self, fn, runs: list) -> None:
        """`fn(run)` for every run: on the I/O threads, or here for one run."""
        if len(runs) == 1:
            fn(runs[0])
        else:
            list(self.pool.map(fn, runs))

    def _pack_slot(self, job: tuple[int, np.ndarray, BlockMeta], dst: np.ndarray) -> DiskEntry:
        """Lay one block's slot out at the start of `dst` (at least the slot's extent): header
        page, then the payload (with its codec), checksummed as it is copied in."""
        _, src, meta = job
        codec, payload = encode_block(self.codec_name, self.zstd_level, src[:meta.block_bytes], meta.dtype_bytes,
                                      meta.lossy, meta.kv_dtype)
        payload_len = meta.block_bytes if codec == _codec.CODEC_NONE else len(payload)
        body = dst[PAGE:PAGE + payload_len]
        csum = copy_hashed(body, payload if codec == _codec.CODEC_NONE else np.frombuffer(payload, dtype=np.uint8))
        return self._lay_header(job, dst[:PAGE], codec, payload_len, csum)

    def _lay_header(self, job: tuple[int, np.ndarray, BlockMeta], page: np.ndarray, codec: int,
                    payload_len: int, csum: int) -> DiskEntry:
        """Lay a block's header page out in `page` (its payload's length and checksum); its entry."""
        slot, _, meta = job
        seq = meta.seq or self.next_seq()
        header = pack_slot_header(codec, meta.dtype_bytes, meta.ns_id, meta.key, meta.parent or b"", payload_len,
                                  meta.block_bytes, seq, self.slab_gen[SlabAllocator.slab_of(slot)], csum)
        page[:PAGE] = 0
        page[:len(header)] = np.frombuffer(header, dtype=np.uint8)
        return DiskEntry(slot, meta.ns_id, meta.key, seq, payload_len, meta.block_bytes, codec, meta.parent or b"")

    def _pwrite(self, fd: int, stg: np.ndarray, length: int, off: int) -> None:
        with self._io("write"):
            if self.faults:
                self.faults.check("write")
            n = os.pwrite(fd, memoryview(stg)[:length], off)
        if n != length:
            raise OSError(errno.EIO, f"short write to disk tier ({n} of {length} bytes)")

    def read(self, where: DiskEntry, dst: np.ndarray) -> None:
        self.read_block(where, dst)

    def read_block(self, e: DiskEntry, dst: np.ndarray) -> None:
        """Read and verify one block into `dst` (>= raw_len,) uint8, as `read_many` does.
        Raises CorruptBlockError if anything does not match the index entry."""
        errors = self.read_many([(e, dst)])
        if errors:
            raise errors[0]

    def read_many(self, items: Sequence[tuple[DiskEntry, np.ndarray]],
                  sums: list[int] | None = None) -> dict[int, BaseException]:
        """Read and verify blocks into their buffers on the I/O threads: {index in `items`:
        the error} for those that failed (each block is checked on its own); `sums[i]`, where
        given, gets the checksum of item i's bytes as they are in its buffer where the read
        verified it (a block stored raw), else -1 (left as it was if the read failed). Slots
        that lie one after another in a file are read in one call (up to RUN_BYTES, and split
        so that every thread gets two shares): this disk reads large requests several times
        faster than small ones (benchmarks/tiers.py); a large slot is read a piece at a time.
        More than one call is pipelined: the I/O threads only read, this thread checks each
        call's blocks as it lands (tierd/tiers/disk_pieces.py)."""
        errors: dict[int, BaseException] = {}
        if not items:
            return errors
        locs, large = [], []
        for i, (e, _) in enumerate(items):
            fd, off = self._slot_loc(e.slot)
            loc = (fd, off, PAGE + align_up(e.payload_len), i)
            (large if e.codec == _codec.CODEC_NONE and self._in_pieces(loc[2]) else locs).append(loc)
        cap = self._read_cap(sum(w for _, _, w, _ in locs + large))
        runs = self._cut_runs(locs, gap=READ_GAP_BYTES, cap=cap)
        if len(runs) == 1 and not large:
            self._read_run(items, runs[0], errors, sums)      # here: no pool hop for a small read
            return errors
        units = [(run[0][1], run[0][2], max(off + want for _, _, off, want in run) - run[0][2], run) for run in runs]
        for fd, off, want, i in large:
            units += self._large_pieces((i, fd, off, want))
        self._read_pipelined(items, sorted(units, key=lambda u: u[:2]), errors, sums)
        return errors

    def _read_cap(self, total: int) -> int:
        """The size of a read call for an acquire of `total` bytes: under RUN_BYTES, and under
        an even share of twice the I/O threads where that share is over SPLIT_BYTES (larger
        calls and all the threads make this disk read faster, and a second share per thread
        lets the checks of the first overlap the reads: benchmarks/tiers.py)."""
        return min(RUN_BYTES, max(SPLIT_BYTES, -(-total // (2 * self.io_threads))))

    def _read_run(self, items: Sequence[tuple[DiskEntry, np.ndarray]], run: list,
                  errors: dict[int, BaseException], sums: list[int] | None) -> None:
        """Read one run into a bounce buffer here, then check and copy each of its blocks."""
        fd, start = run[0][1], run[0][2]
        end = max(off + want for _, _, off, want in run)
        with self._staging(end - start) as stg:
            try:
                n = self._pread(fd, stg, end - start, start)
            except OSError as ex:
                for i, *_ in run:
                    errors[i] = ex
                return
            self._check_run(items, run, start, stg, n, errors, sums)

    @staticmethod
    def _cut_runs(locs: list[tuple[int, int, int, int]], gap: int, cap: int) -> list[list[tuple[int, int, int, int]]]:
        """(fd, offset, bytes, index) of each slot into runs of (index, fd, offset, bytes), in
        file order, each run's slots one after another in one file (at most `gap` bytes apart),
        a run taking slots while it is under `cap` bytes."""
        locs = sorted(locs)
        runs: list[list[tuple[int, int, int, int]]] = []
        for fd, off, want, i in locs:
            if runs:
                last = runs[-1]
                lfd, lstart = last[0][1], last[0][2]
                _, _, loff, lwant = last[-1]
                if lfd == fd and 0 <= off - (loff + lwant) <= gap and loff + lwant - lstart < cap:
                    last.append((i, fd, off, want))
                    continue
            runs.append([(i, fd, off, want)])
        return runs

    def _pread(self, fd: int, stg: np.ndarray, want: int, off: int) -> int:
        with self._io("read"):
            if self.faults:
                self.faults.check("read")
            return os.preadv(fd, [memoryview(stg)[:want]], off)

    def _check_slot(self, e: DiskEntry, stg: np.ndarray, n: int, dst: np.ndarray) -> int:
        """Verify the slot read into `stg` (`n` bytes of it read) against the index entry `e`
        and copy its payload into `dst`; CorruptBlockError where anything does not match.
        Returns the checksum (`_csum`) of the block's bytes as they now are in `dst` where the
        read verified it (a payload stored raw), else -1 (decoded from a codec)."""
        want = PAGE + align_up(e.payload_len)
        if n < PAGE + e.payload_len:
            raise CorruptBlockError(f"slot truncated ({n} of {want} bytes readable)")
        pcsum = self._check_header(e, stg[:PAGE])
        payload = stg[PAGE:PAGE + e.payload_len]
        if e.codec == _codec.CODEC_NONE:
            # hashed as copied into `dst`, a slot nobody reads before this returns (a LOADING
            # slot): bytes that fail the check are never served
            if copy_hashed(dst[:e.raw_len], payload) != pcsum:
                raise CorruptBlockError("payload checksum mismatch")
            return pcsum
        if _csum(payload) != pcsum:
            raise CorruptBlockError("payload checksum mismatch")
        try:
            _codec.decode(e.codec, payload, dst[:e.raw_len])
        except Exception as ex:  # zstd errors are not one class
            raise CorruptBlockError(f"payload does not decode: {ex}") from None
        return -1

    def _check_header(self, e: DiskEntry, page) -> int:
        """Verify a slot's header page against the index entry `e` (and its slab's generation):
        the payload checksum it records, or CorruptBlockError."""
        h = unpack_slot_header(page)
        if h is None:
            raise CorruptBlockError("slot header is gone")
        _, _, codec, _, _, ns_id, key, _, payload_len, raw_len, seq, gen, pcsum = h
        if (ns_id, key, seq, payload_len, raw_len, codec) != (
                e.ns_id, e.key, e.seq, e.payload_len, e.raw_len, e.codec):
            raise CorruptBlockError("slot header does not match the index (overwritten)")
        if gen != self.slab_gen[SlabAllocator.slab_of(e.slot)]:
            raise CorruptBlockError("slot belongs to an earlier use of its slab")
        return pcsum

    def tombstone(self, slot: int) -> None:
        """Zero a slot's header so a restart does not bring its block back (after flush)."""
        page = self._page()
        page[:] = b"\0" * PAGE
        fd, off = self._slot_loc(slot)
        with self._io("write"):
            if self.faults:
                self.faults.check("write")
            os.pwrite(fd, page, off)

    def flush(self) -> None:
        """Make every completed write durable."""
        with self._io("flush"):
            if self.faults:
                self.faults.check("flush")
            for fd in list(self._fds):
                os.fdatasync(fd)
