"""The disk tier: preallocated slab files with self-describing slots and a crash-safe index.

Owns the files under one directory: their layout (docs/on-disk-format.md), aligned I/O,
checksums, and rebuilding the index at open. It never serves a slot whose header or payload
checksum fails; it never decides what to evict (the store does). All methods that touch the
allocator run under the store's lock; `write`, `write_many`, `read_block` and `read_many` run
outside it, on slots the store has pinned.

`DiskTier` is this module (opening, the slab allocator's side, I/O calls in flight, closing,
probes) and its parts: the directory and slab files (tierd/tiers/disk_files.py), what survives a
restart (tierd/tiers/disk_recovery.py), block reads and writes (tierd/tiers/disk_io.py) and their
pipelines, large slots a piece at a time (tierd/tiers/disk_pieces.py); its failpoints for fault
tests are tierd/tiers/disk_faults.py.

File layout: `slab-NNNN.tds` = superblock (4 KiB) + slabs; slab = slab header (4 KiB) + slots;
slot = slot header (4 KiB page, first bytes used) + payload (4 KiB-aligned).
"""

from __future__ import annotations

import contextlib
import errno
import itertools
import logging
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import msgpack

from ..config import align_up, format_size
from .base import Tier
from .disk_files import (_SLAB, _SUPER, ALL_NAMESPACES, CHECKPOINT_NAME, FENCES_NAME, FILE_MAGIC, LOCK_NAME,  # noqa: F401
                         NAMESPACES_NAME, SLAB_MAGIC, DiskEntry, SlabFiles, _aligned)
from .disk_faults import FaultInjector
from .disk_pieces import PIECE_BYTES, PieceIO  # noqa: F401
from .disk_io import (PACK_THREADS, READ_GAP_BYTES, RUN_BYTES, SPLIT_BYTES, WRITE_RUN_BYTES,  # noqa: F401
                      BlockIO, _Buffers)
from .disk_recovery import Recovery
# the slot header is shared with the remote tier (re-exported here for the disk format's users)
from .slot_header import (_CSUM, FORMAT_VERSION, PAGE, CorruptBlockError, _csum, copy_hashed,  # noqa: F401
                          encode_block, pack_slot_header, unpack_slot_header)

log = logging.getLogger("tierd.disk")


class DiskTier(SlabFiles, Recovery, BlockIO, PieceIO, Tier):
    name = "disk"

    def __init__(self, path: str, capacity_bytes: int, slab_bytes: int, file_bytes: int, *,
                 direct_io: bool = True, codec: str = "none", zstd_level: int = 1,
                 io_threads: int = 4, fault_file: str = "", buffer_idle_s: float = 30.0):
        self.path = Path(path)
        self.faults = FaultInjector(fault_file) if fault_file else None
        self._inflight: dict[int, tuple[str, float]] = {}   # I/O under way: token -> (op, start)
        self._tokens = itertools.count()
        # Invariant: no I/O call starts once the files are let go, and they are closed only when
        # no call is under way (a late write to a closed fd number could land in a file that
        # reused it)
        self._io_cond = threading.Condition(threading.Lock())
        self._released = False
        # Slab headers decided under the store lock and written outside it, before the blocks
        # that depend on them (see take_pending_headers).
        self.pending_headers: dict[int, tuple[int, int]] = {}
        self.codec_name = codec
        self.zstd_level = zstd_level
        self._lock_fd = -1
        self._fds: list[int] = []
        self._closed = False
        self._open_dir()
        try:
            self._plan(capacity_bytes, slab_bytes, file_bytes)
            self.direct_io = direct_io and self._probe_direct()
            self._local = threading.local()
            self.corrupt_at_open = 0
            self.recovered: list[DiskEntry] = []
            self.recovered_from = "new"
            self._open_files()
            st = os.stat(self.path)
            self._dir_id = (st.st_dev, st.st_ino)
            self.namespaces = self._load_namespaces()
            self._fence_lock = threading.Lock()
            self.fences = self._load_fences()
            self._recover(io_threads)
            # the size as resolved (disk.bytes may be a share of the filesystem), where it is
            log.info("disk tier %s: %s (disk.bytes) in %d slab files, %d slabs of %s; %d blocks (index: %s)%s",
                     self.path, format_size(capacity_bytes), self.num_files, self.num_slabs,
                     format_size(self.slab_bytes), len(self.recovered), self.recovered_from,
                     ", O_DIRECT" if self.direct_io else ", buffered I/O")
            self.io_threads = io_threads
            self.pool = ThreadPoolExecutor(io_threads, thread_name_prefix="tierd-disk")
            self._packers = ThreadPoolExecutor(PACK_THREADS, thread_name_prefix="tierd-disk-pack")
            self._bounce = _Buffers(io_threads + PACK_THREADS)   # the pipelined sync's
            self._spare = _Buffers()                  # every other read and write's
            # buffers unused this long go back to the system (`trim_buffers`, which the store's
            # maintainer calls): a sync keeps io_threads + PACK_THREADS of a run or a piece
            # (up to WRITE_RUN_BYTES or PIECE_BYTES, in whole 2 MiB huge pages), a promotion
            # one per read queued (up to READ_AHEAD x io_threads) of a run or a piece
            self.buffer_idle_s = buffer_idle_s
        except BaseException:
            self._remove_made()   # first: the lock is still held
            self._release_fds()
            raise


    @staticmethod
    def slot_bytes_for(block_bytes: int) -> int:
        """Disk slot of a block: header page + payload rounded up to 4 KiB."""
        return PAGE + align_up(block_bytes)

    # -- I/O in flight --------------------------------------------------------------------------
    @contextlib.contextmanager
    def _io(self, op: str):
        """Track one I/O call, so that a stalled disk is noticed while the call still hangs."""
        with self._io_cond:
            if self._released:
                raise OSError(errno.EBADF, f"disk tier {self.path} is closed")
            token = next(self._tokens)
            self._inflight[token] = (op, time.monotonic())
        try:
            yield
        finally:
            with self._io_cond:
                del self._inflight[token]
                if not self._inflight:
                    self._io_cond.notify_all()

    def oldest_io(self) -> tuple[str, float] | None:
        """(op, seconds) of the longest-running I/O call now under way, or None."""
        items = list(self._inflight.values())
        if not items:
            return None
        op, t0 = min(items, key=lambda x: x[1])
        return op, time.monotonic() - t0

    # -- slabs -----------------------------------------------------------------------------
    def _write_slab_header(self, slab: int, slot_bytes: int, gen: int) -> None:
        page = self._page()
        page[:] = b"\0" * PAGE
        body = _SLAB.pack(SLAB_MAGIC, FORMAT_VERSION, 0, slot_bytes, gen)
        page[:_SLAB.size + _CSUM.size] = body + _CSUM.pack(_csum(body))
        fd, off = self._slab_loc(slab)
        with self._io("write"):
            if self.faults:
                self.faults.check("write")
            os.pwrite(fd, page, off)

    def alloc_slot(self, slot_bytes: int) -> int | None:
        """A free slot, taking a free slab if needed (its header is queued in
        `pending_headers`, written by `write_headers` before any block of it); None when full.
        No I/O: called under the store lock."""
        c = self.alloc.classes.get(slot_bytes)
        if (c is None or not c.free) and self.alloc.free_slabs:
            slab = self.alloc.free_slabs[-1]
            gen = self.next_seq()
            self.pending_headers[slab] = (slot_bytes, gen)
            self.slab_gen[slab] = gen
            self.alloc.assign_slab(slab, slot_bytes)
        return self.alloc.alloc(slot_bytes)

    def free_slot(self, slot: int) -> None:
        self.alloc.free(slot)

    def release_slab(self, slab: int) -> None:
        """Return an empty slab to the free pool; its header (class 0, a new generation, so
        that no earlier slot of it is ever recovered) is queued like a new slab's."""
        self.alloc.release_slab(slab)
        self.pending_headers[slab] = (0, self.next_seq())

    def take_pending_headers(self) -> dict[int, tuple[int, int]]:
        """The queued slab headers (store lock held); write them with `write_headers`."""
        pending, self.pending_headers = self.pending_headers, {}
        return pending

    def write_headers(self, pending: dict[int, tuple[int, int]]) -> None:
        """Write queued slab headers (no lock). On failure they are queued again, unless a
        newer header for the slab was queued meanwhile."""
        done = []
        try:
            for slab, (slot_bytes, gen) in pending.items():
                self._write_slab_header(slab, slot_bytes, gen)
                done.append(slab)
        except BaseException:
            for slab, hdr in pending.items():
                if slab not in done:
                    self.pending_headers.setdefault(slab, hdr)
            raise

    def next_seq(self) -> int:
        return next(self._seq)

    # -- closing -----------------------------------------------------------------------------
    def close(self, entries: list[DiskEntry] | None) -> None:
        """Flush, and if `entries` (the complete index) is given write a checkpoint so the
        next open skips the scan."""
        if self._closed:
            return
        self._closed = True
        self._packers.shutdown(wait=True)
        self.pool.shutdown(wait=True)
        try:
            if self.pending_headers:
                self.write_headers(self.take_pending_headers())
            self.flush()
            if entries is not None:
                slabs = [(s, self.alloc.slab_class[s], self.slab_gen[s])
                         for s in range(self.num_slabs) if self.alloc.slab_class[s]]
                body = msgpack.packb({
                    "version": FORMAT_VERSION, "uuid": self.store_uuid, "slabs": slabs,
                    "files": list(self.file_slabs),   # the geometry it describes (slabs of each file)
                    "entries": [(e.slot, e.ns_id, e.key, e.seq, e.payload_len, e.raw_len, e.codec,
                                 e.parent) for e in entries]}, use_bin_type=True)
                self._atomic_write(CHECKPOINT_NAME, body + _CSUM.pack(_csum(body)))
        finally:
            self._release_fds()

    RELEASE_WAIT_S = 10.0

    def _release_fds(self) -> None:
        """Close the files once no I/O call is under way (new ones are refused from now on);
        files still in use by a call that hangs are left open (their numbers must not be reused
        under it) and go with the process."""
        with self._io_cond:
            self._released = True
            deadline = time.monotonic() + self.RELEASE_WAIT_S
            while self._inflight and time.monotonic() < deadline:
                self._io_cond.wait(0.1)
            busy = bool(self._inflight)
        if busy:
            log.error("disk tier: an I/O call on %s has not returned; its files stay open", self.path)
        else:
            for fd in self._fds:
                os.close(fd)
        self._fds = []
        if self._lock_fd >= 0:
            os.close(self._lock_fd)  # closing releases the flock
            self._lock_fd = -1

    @property
    def closed(self) -> bool:
        """Closed or abandoned: no I/O may go to it any more."""
        return self._closed

    def check_present(self) -> None:
        """Raise OSError if the directory was removed or replaced, or a slab file unlinked: the
        writes would then land in files nobody will ever open again."""
        try:
            st = os.stat(self.path)
        except OSError as e:
            raise OSError(e.errno, f"disk directory {self.path} is gone") from None
        if (st.st_dev, st.st_ino) != self._dir_id:
            raise OSError(errno.ENOENT, f"disk directory {self.path} was replaced")
        for fd in self._fds:
            if os.fstat(fd).st_nlink == 0:
                raise OSError(errno.ENOENT, f"a slab file in {self.path} was deleted")

    def probe(self) -> None:
        """Raise OSError unless the disk takes a small durable write now: a file created,
        written, fsynced, read back and removed in the directory, and every slab file synced."""
        self.check_present()
        with self._io("probe"):
            self._probe()

    def _probe(self) -> None:
        if self.faults:
            for op in ("write", "flush", "meta", "read"):
                self.faults.check(op)
        p = self.path / ".probe"
        fd = os.open(p, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        try:
            os.write(fd, b"\0" * PAGE)
            os.fsync(fd)
            if len(os.pread(fd, PAGE, 0)) != PAGE:
                raise OSError(errno.EIO, "probe file reads back short")
        finally:
            os.close(fd)
            try:
                os.unlink(p)
            except OSError:
                pass
        for fd in self._fds:
            os.fdatasync(fd)

    def mark_closed(self) -> None:
        """No new I/O may go to this tier (its directory is gone); `abandon` then lets go."""
        self._closed = True

    def abandon(self) -> None:
        """Let go of a directory that vanished: close everything, write nothing."""
        self._closed = True
        self._packers.shutdown(wait=True)
        self.pool.shutdown(wait=True)
        self._release_fds()

    def usage(self) -> dict:
        return {**super().usage(), "path": str(self.path), "direct_io": self.direct_io,
                "codec": self.codec_name, "recovered_from": self.recovered_from,
                "io_buffer_bytes": self._spare.nbytes + self._bounce.nbytes}
