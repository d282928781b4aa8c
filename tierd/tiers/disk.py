"""The disk tier: preallocated slab files with self-describing slots and a crash-safe index.

Owns the files under one directory: their layout (docs/on-disk-format.md), aligned I/O,
checksums, and rebuilding the index at open. It never serves a slot whose header or payload
checksum fails; it never decides what to evict (the store does). All methods that touch the
allocator run under the store's lock; `write_block`/`read_block` run outside it, on slots the
store has pinned.

File layout: `slab-NNNN.tds` = superblock (4 KiB) + slabs; slab = slab header (4 KiB) + slots;
slot = slot header (4 KiB page, first bytes used) + payload (4 KiB-aligned).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import itertools
import logging
import mmap
import os
import struct
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import msgpack
import numpy as np

from .. import codec as _codec
from ..arena import SlabAllocator
from ..config import align_up, format_size
from ..errors import (CapacityError, ConfigError, DirectoryLockedError, DiskTierError,
                      NotASlabFileError)
from .base import BlockMeta, Tier
# the slot header is shared with the remote tier (re-exported here for the disk format's users)
from .slot_header import (_CSUM, FORMAT_VERSION, PAGE, CorruptBlockError, _csum, encode_block,  # noqa: F401
                          pack_slot_header, unpack_slot_header)

log = logging.getLogger("tierd.disk")

FILE_MAGIC = b"TIERDFIL"
SLAB_MAGIC = b"TIERDSLB"
# superblock: magic, version, file index, slabs in this file, slab bytes, store uuid, checksum
_SUPER = struct.Struct("<8sHHIQ16s")
# slab header: magic, version, pad, slot bytes (0: free), generation (+ checksum)
_SLAB = struct.Struct("<8sHHQQ")
LOCK_NAME = "LOCK"
CHECKPOINT_NAME = "index.ckpt"
NAMESPACES_NAME = "namespaces.msgpack"
FENCES_NAME = "flushed.msgpack"
ALL_NAMESPACES = b""   # the fence key of a flush of every namespace


@dataclass(slots=True)
class DiskEntry:
    """Where one block lives on disk and how to verify it."""

    slot: int
    ns_id: bytes
    key: bytes
    seq: int
    payload_len: int
    raw_len: int
    codec: int
    parent: bytes = b""


def _aligned(nbytes: int) -> mmap.mmap:
    """Page-aligned anonymous buffer (O_DIRECT needs aligned memory)."""
    return mmap.mmap(-1, max(PAGE, align_up(nbytes)))


class FaultInjector:
    """Failpoints under the disk tier, for fault tests (`disk.fault_file`; off by default).

    The control file holds `op=FAULT` pairs, e.g. `write=EIO read=EIO flush=ENOSPC`, `all=EROFS`,
    or `write=hang:30` (the call blocks for up to 30 s, as a dying disk or a lost NFS server
    would; it returns early, successfully, as soon as the fault is removed). Ops: write, read,
    flush, meta (namespace and checkpoint files). An empty or missing file means no faults. It is
    re-read when its mtime changes, so a test (or an operator rehearsing an incident) flips
    faults on and off while the daemon runs."""

    OPS = ("write", "read", "flush", "meta")

    def __init__(self, path: str):
        self.path = path
        self._stamp = None
        self._faults: dict[str, tuple[str, float]] = {}

    def _current(self, op: str) -> tuple[str, float] | None:
        try:
            st = os.stat(self.path)
            stamp = (st.st_mtime_ns, st.st_size)
        except FileNotFoundError:
            stamp = None
        if stamp != self._stamp:
            # the faults before the stamp: an I/O thread that sees the new stamp must also see
            # the new faults (parallel reads check at once)
            self._faults = self._parse() if stamp is not None else {}
            self._stamp = stamp
        return self._faults.get(op) or self._faults.get("all")

    def check(self, op: str) -> None:
        fault = self._current(op)
        if fault is None:
            return
        kind, value = fault
        if kind == "errno":
            raise OSError(int(value), f"{os.strerror(int(value))} (injected by {self.path})")
        end = time.monotonic() + value        # a hang: until it ends or is lifted
        while time.monotonic() < end:
            time.sleep(0.02)
            now = self._current(op)
            if now is None or now[0] != "hang":
                return

    def _parse(self) -> dict[str, tuple[str, float]]:
        faults = {}
        try:
            text = Path(self.path).read_text()
        except OSError:
            return {}
        for item in text.split():
            op, _, name = item.partition("=")
            if op not in self.OPS and op != "all":
                continue
            name = name.strip()
            if name.lower().startswith("hang:"):
                try:
                    faults[op] = ("hang", float(name[5:]))
                except ValueError:
                    pass
                continue
            code = getattr(errno, name.upper(), None)
            if isinstance(code, int):
                faults[op] = ("errno", code)
        return faults


class DiskTier(Tier):
    name = "disk"

    def __init__(self, path: str, capacity_bytes: int, slab_bytes: int, file_bytes: int, *,
                 direct_io: bool = True, codec: str = "none", zstd_level: int = 1,
                 io_threads: int = 4, fault_file: str = ""):
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
            self.pool = ThreadPoolExecutor(io_threads, thread_name_prefix="tierd-disk")
        except BaseException:
            self._release_fds()
            raise

    # -- opening ---------------------------------------------------------------------------
    def _open_dir(self) -> None:
        p = self.path
        if os.path.islink(p):
            raise DiskTierError(
                f"disk tier: {p} is a symbolic link to {os.path.realpath(p)}; refusing to write "
                "slab files through it (set disk_path to the real directory)")
        try:
            if p.exists() and not p.is_dir():
                raise DiskTierError(f"disk tier: {p} exists and is not a directory; set disk_path to a directory")
            p.mkdir(parents=True, exist_ok=True)
        except DiskTierError:
            raise
        except OSError as e:
            raise DiskTierError(
                f"disk tier: cannot create {p} ({e.strerror}); set disk_path or fix permissions") from None
        try:
            self._lock_fd = os.open(p / LOCK_NAME, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        except OSError as e:
            raise DiskTierError(
                f"disk tier: {p} is not writable (uid {os.getuid()}: {e.strerror}); "
                "set disk_path or fix permissions") from None
        try:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(self._lock_fd, 64, 0).decode(errors="replace").strip() or "?"
            os.close(self._lock_fd)
            self._lock_fd = -1
            raise DirectoryLockedError(
                f"disk tier: {p} is in use by another tierd store (pid {holder}); "
                "stop it or give this store another disk_path") from None
        os.ftruncate(self._lock_fd, 0)
        os.pwrite(self._lock_fd, f"{os.getpid()}\n".encode(), 0)

    def _plan(self, capacity_bytes: int, slab_bytes: int, file_bytes: int) -> None:
        """Geometry: files of `slabs_per_file` slabs, `num_slabs` in all, within capacity."""
        existing = sorted(self.path.glob("slab-*.tds"))
        if capacity_bytes < 3 * PAGE:
            raise CapacityError(f"disk tier: capacity of {capacity_bytes} bytes is too small (12 KiB minimum)")
        if existing:  # an existing directory keeps its geometry
            sb0 = self._read_super(existing[0], expect_index=0)
            slab_bytes = sb0[4]
            spf = sb0[3] if len(existing) > 1 else max(sb0[3], (file_bytes - PAGE) // slab_bytes)
        else:
            slab_bytes = min(slab_bytes, (capacity_bytes - PAGE) // PAGE * PAGE)
            spf = max(1, (file_bytes - PAGE) // slab_bytes)
            n = capacity_bytes // slab_bytes
            if n and n * slab_bytes + -(-n // spf) * PAGE > capacity_bytes:
                # the superblocks do not fit beside n whole slabs: shrink the slabs a little
                # rather than lose one
                slab_bytes -= align_up(-(-(-(-n // spf) * PAGE) // n))
                spf = max(1, (file_bytes - PAGE) // slab_bytes)
        n = capacity_bytes // slab_bytes
        while n > 0 and n * slab_bytes + -(-n // spf) * PAGE > capacity_bytes:
            n -= 1
        if n == 0:
            raise CapacityError(
                f"disk tier: capacity {format_size(capacity_bytes)} holds no slab of {format_size(slab_bytes)}")
        self.capacity_bytes = capacity_bytes
        self.slab_bytes = slab_bytes
        self.slabs_per_file = spf
        self.num_slabs = n
        self.num_files = -(-n // spf)
        if existing and len(existing) > self.num_files:
            raise ConfigError(
                f"disk tier: {self.path} holds {len(existing)} slab files but disk_bytes "
                f"{format_size(capacity_bytes)} allows {self.num_files}; raise disk_bytes or empty the directory")
        self.alloc = SlabAllocator(n, slab_bytes, slab_header_bytes=PAGE, capacity_bytes=capacity_bytes)
        # Superblocks are part of the capacity but hold no slot: count them as waste.
        self.alloc.capacity_bytes = capacity_bytes
        self.slab_gen = [0] * n

    def _file_slabs(self, i: int) -> int:
        return min(self.slabs_per_file, self.num_slabs - i * self.slabs_per_file)

    def _file_size(self, i: int) -> int:
        return PAGE + self._file_slabs(i) * self.slab_bytes

    def _probe_direct(self) -> bool:
        probe = self.path / ".odirect-probe"
        try:
            fd = os.open(probe, os.O_RDWR | os.O_CREAT | os.O_DIRECT | os.O_CLOEXEC, 0o600)
        except OSError:
            log.info("disk tier: %s does not allow O_DIRECT; using buffered I/O + fdatasync", self.path)
            return False
        os.close(fd)
        os.unlink(probe)
        return True

    def _read_super(self, file: Path, expect_index: int) -> tuple:
        try:
            with open(file, "rb") as f:
                raw = f.read(_SUPER.size + _CSUM.size)
        except OSError as e:
            raise DiskTierError(f"disk tier: cannot read {file} ({e.strerror})") from None
        if len(raw) < _SUPER.size + _CSUM.size or raw[:8] != FILE_MAGIC:
            raise NotASlabFileError(
                f"disk tier: {file} is not a tierd slab file; move it away or set another disk_path")
        (csum,) = _CSUM.unpack_from(raw, _SUPER.size)
        fields = _SUPER.unpack_from(raw)
        if _csum(raw[:_SUPER.size]) != csum:
            raise NotASlabFileError(f"disk tier: {file}: superblock checksum mismatch; the file is damaged")
        if fields[1] != FORMAT_VERSION:
            raise NotASlabFileError(
                f"disk tier: {file} has format version {fields[1]}, this tierd reads {FORMAT_VERSION}")
        if fields[2] != expect_index:
            raise NotASlabFileError(f"disk tier: {file} says it is file {fields[2]}, expected {expect_index}")
        return fields

    def _room_error(self, needed: int) -> DiskTierError:
        from ..arena import filesystem_type
        try:
            st = os.statvfs(self.path)
            room = f"{format_size(st.f_bavail * st.f_frsize)} free"
        except OSError:
            room = "free space unknown"
        return DiskTierError(
            f"disk tier: cannot reserve {format_size(needed)} in {self.path} "
            f"({filesystem_type(str(self.path)) or 'unknown filesystem'}, {room}); lower disk.bytes "
            "(--disk-bytes) or free space there")

    def _open_files(self) -> None:
        flags = os.O_RDWR | os.O_CLOEXEC | (os.O_DIRECT if self.direct_io else 0)
        # All the room first, or nothing: a half-created set of slab files would not match a
        # later, smaller disk.bytes.
        needed = 0
        for i in range(self.num_files):
            fp = self.path / f"slab-{i:04d}.tds"
            have = fp.stat().st_blocks * 512 if fp.exists() else 0
            needed += max(0, self._file_size(i) - have)
        try:
            st = os.statvfs(self.path)
            if needed > st.f_bavail * st.f_frsize:
                raise self._room_error(needed)
        except OSError:
            pass
        store_uuid = None
        for i in range(self.num_files):
            fp = self.path / f"slab-{i:04d}.tds"
            if fp.exists():
                sb = self._read_super(fp, expect_index=i)
                if sb[4] != self.slab_bytes or sb[3] != self._file_slabs(i):
                    raise ConfigError(
                        f"disk tier: {fp} was created with {sb[3]} slabs of {format_size(sb[4])}; "
                        "use the same disk settings or empty the directory")
                if store_uuid is None:
                    store_uuid = sb[5]
                elif sb[5] != store_uuid:
                    raise NotASlabFileError(f"disk tier: {fp} belongs to another tierd store")
            else:
                store_uuid = store_uuid or uuid.uuid4().bytes
                self._create_file(fp, i, store_uuid)
            fd = os.open(fp, flags)
            self._fds.append(fd)
            want = self._file_size(i)
            if os.fstat(fd).st_size < want:  # truncated by someone: give the space back
                self._fallocate(fd, fp, want)
        self.store_uuid = store_uuid

    def _fallocate(self, fd: int, fp: Path, size: int) -> None:
        try:
            os.posix_fallocate(fd, 0, size)
        except OSError as e:
            if e.errno == errno.ENOSPC:
                raise self._room_error(size) from None
            raise DiskTierError(f"disk tier: cannot allocate {fp}: {e.strerror}") from None

    def _create_file(self, fp: Path, index: int, store_uuid: bytes) -> None:
        tmp = fp.with_suffix(".tmp")
        fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        try:
            self._fallocate(fd, fp, self._file_size(index))
            body = _SUPER.pack(FILE_MAGIC, FORMAT_VERSION, index, self._file_slabs(index),
                               self.slab_bytes, store_uuid)
            os.pwrite(fd, body + _CSUM.pack(_csum(body)), 0)
            os.fdatasync(fd)
        except BaseException:
            os.close(fd)
            os.unlink(tmp)
            raise
        os.close(fd)
        os.rename(tmp, fp)
        self._fsync_dir()

    def _fsync_dir(self) -> None:
        dfd = os.open(self.path, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)

    # -- locations -------------------------------------------------------------------------
    def _slab_loc(self, slab: int) -> tuple[int, int]:
        if self._released:
            raise OSError(errno.EBADF, f"disk tier {self.path} is closed")
        return self._fds[slab // self.slabs_per_file], PAGE + (slab % self.slabs_per_file) * self.slab_bytes

    def _slot_loc(self, slot: int) -> tuple[int, int]:
        slab = SlabAllocator.slab_of(slot)
        fd, base = self._slab_loc(slab)
        return fd, base + (self.alloc.offset(slot) - slab * self.slab_bytes)

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

    # -- block I/O (outside the store lock) ---------------------------------------------------
    def _page(self) -> mmap.mmap:
        p = getattr(self._local, "page", None)
        if p is None:
            p = self._local.page = _aligned(PAGE)
        return p

    def _staging(self, nbytes: int) -> np.ndarray:
        """This thread's page-aligned bounce buffer of at least `nbytes`.

        Every slot goes through it: O_DIRECT to and from shared-memory (shmem) pages runs at
        less than half the speed of anonymous memory here (benchmarks/tiers.py), and a
        bounce through anonymous memory costs one memcpy, which is cheaper."""
        s = getattr(self._local, "staging", None)
        if s is None or s.nbytes < nbytes:
            s = self._local.staging = np.frombuffer(_aligned(nbytes), dtype=np.uint8)
        return s

    def write_block(self, slot: int, ns_id: bytes, key: bytes, parent: bytes | None,
                    src: np.ndarray, block_bytes: int, dtype_bytes: int, *, lossy: str = "",
                    kv_dtype: str = "") -> DiskEntry:
        """Write one block from `src` (block_bytes,) uint8 as header page + payload in one
        aligned write (with the namespace's lossy codec where it has one). Not durable until
        `flush()`."""
        seq = self.next_seq()
        raw = src[:block_bytes]
        codec, payload = encode_block(self.codec_name, self.zstd_level, raw, dtype_bytes, lossy, kv_dtype)
        payload_len = block_bytes if codec == _codec.CODEC_NONE else len(payload)
        length = PAGE + align_up(payload_len)
        stg = self._staging(length)
        body = stg[PAGE:PAGE + payload_len]
        body[:] = payload if codec == _codec.CODEC_NONE else np.frombuffer(payload, dtype=np.uint8)
        header = pack_slot_header(codec, dtype_bytes, ns_id, key, parent or b"", payload_len,
                                  block_bytes, seq, self.slab_gen[SlabAllocator.slab_of(slot)],
                                  _csum(body))
        stg[:PAGE] = 0
        stg[:len(header)] = np.frombuffer(header, dtype=np.uint8)
        fd, off = self._slot_loc(slot)
        with self._io("write"):
            if self.faults:
                self.faults.check("write")
            n = os.pwrite(fd, memoryview(stg)[:length], off)
        if n != length:
            raise OSError(errno.EIO, f"short write to disk tier ({n} of {length} bytes)")
        return DiskEntry(slot, ns_id, key, seq, payload_len, block_bytes, codec, parent or b"")

    def write(self, slot: int, src: np.ndarray, meta: BlockMeta) -> DiskEntry:
        return self.write_block(slot, meta.ns_id, meta.key, meta.parent, src, meta.block_bytes,
                                meta.dtype_bytes, lossy=meta.lossy, kv_dtype=meta.kv_dtype)

    def read(self, where: DiskEntry, dst: np.ndarray) -> None:
        self.read_block(where, dst)

    def read_block(self, e: DiskEntry, dst: np.ndarray) -> None:
        """Read and verify one block into `dst` (>= raw_len,) uint8.
        Raises CorruptBlockError if anything does not match the index entry."""
        fd, off = self._slot_loc(e.slot)
        want = PAGE + align_up(e.payload_len)
        stg = self._staging(want)
        with self._io("read"):
            if self.faults:
                self.faults.check("read")
            n = os.preadv(fd, [memoryview(stg)[:want]], off)
        if n < PAGE + e.payload_len:
            raise CorruptBlockError(f"slot truncated ({n} of {want} bytes readable)")
        h = unpack_slot_header(stg[:PAGE])
        if h is None:
            raise CorruptBlockError("slot header is gone")
        _, _, codec, _, _, ns_id, key, _, payload_len, raw_len, seq, gen, pcsum = h
        if (ns_id, key, seq, payload_len, raw_len, codec) != (
                e.ns_id, e.key, e.seq, e.payload_len, e.raw_len, e.codec):
            raise CorruptBlockError("slot header does not match the index (overwritten)")
        if gen != self.slab_gen[SlabAllocator.slab_of(e.slot)]:
            raise CorruptBlockError("slot belongs to an earlier use of its slab")
        payload = stg[PAGE:PAGE + e.payload_len]
        if _csum(payload) != pcsum:
            raise CorruptBlockError("payload checksum mismatch")
        if e.codec == _codec.CODEC_NONE:
            dst[:e.raw_len] = payload
            return
        try:
            _codec.decode(e.codec, payload, dst[:e.raw_len])
        except Exception as ex:  # zstd errors are not one class
            raise CorruptBlockError(f"payload does not decode: {ex}") from None

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

    # -- namespaces --------------------------------------------------------------------------
    def _load_namespaces(self) -> dict[bytes, dict]:
        p = self.path / NAMESPACES_NAME
        try:
            data = msgpack.unpackb(p.read_bytes(), raw=False, strict_map_key=False)
            return {bytes(k): v for k, v in data.items()}
        except FileNotFoundError:
            return {}
        except Exception:
            log.warning("disk tier: %s is unreadable; namespace names are lost (blocks are not)", p)
            return {}

    def remember_namespace(self, ns_id: bytes, desc: dict) -> None:
        """Persist a namespace description (atomic replace) the first time it reaches disk."""
        if self.namespaces.get(ns_id) == desc:
            return
        known = {**self.namespaces, ns_id: desc}
        self._atomic_write(NAMESPACES_NAME, msgpack.packb(known, use_bin_type=True))
        self.namespaces = known   # only once it is on disk

    def _atomic_write(self, name: str, data: bytes) -> None:
        with self._io("meta"):
            if self.faults:
                self.faults.check("meta")
            tmp = self.path / (name + ".tmp")
            with open(tmp, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.chmod(tmp, 0o600)
            os.rename(tmp, self.path / name)
            self._fsync_dir()

    # -- flush fences --------------------------------------------------------------------------
    # A flush drops blocks from the index at once, but copies evicted earlier left valid headers
    # behind, and any header could outlive the flush in a crash. So a flush records a fence:
    # every copy of the namespace (or of all, key ALL_NAMESPACES) written with a sequence
    # number below it is dead — at recovery and in the settle of writes in flight. Fences only
    # grow, and sequence numbers continue above every fence after a restart.
    def _load_fences(self) -> dict[bytes, int]:
        p = self.path / FENCES_NAME
        try:
            raw = p.read_bytes()
        except FileNotFoundError:
            return {}
        try:
            body, (csum,) = raw[:-8], _CSUM.unpack(raw[-8:])
            if _csum(body) != csum:
                raise ValueError("checksum mismatch")
            return {bytes(k): int(v) for k, v in msgpack.unpackb(body, raw=False, strict_map_key=False).items()}
        except Exception as e:
            # without its fences, flushed blocks could be served again: trust no copy at all
            log.error("disk tier: %s (the record of flushes) is damaged (%s); every block on disk is "
                      "dropped", p, e)
            return {ALL_NAMESPACES: 1 << 62}

    def set_fence(self, ns_id: bytes | None) -> int:
        """(Store lock held; memory only.) Every copy of `ns_id` (None: of every namespace)
        written before now is dead from now on. Returns the fence; `save_fences` makes it
        durable."""
        seq = self.next_seq()
        key = ALL_NAMESPACES if ns_id is None else ns_id
        self.fences = {**self.fences, key: max(self.fences.get(key, 0), seq)}
        return seq

    def save_fences(self) -> None:
        """(No lock.) Write the fences durably (atomic replace, fsync)."""
        with self._fence_lock:    # one writer of the file at a time; the newest fences win
            body = msgpack.packb(self.fences, use_bin_type=True)
            self._atomic_write(FENCES_NAME, body + _CSUM.pack(_csum(body)))

    def fenced(self, ns_id: bytes, seq: int) -> bool:
        """A copy of `ns_id` written with `seq` is below a flush's fence: never serve it."""
        f = self.fences
        return bool(f) and seq < max(f.get(ns_id, 0), f.get(ALL_NAMESPACES, 0))

    # -- recovery ----------------------------------------------------------------------------
    def _recover(self, io_threads: int) -> None:
        ckpt = self.path / CHECKPOINT_NAME
        entries = None
        if ckpt.exists():
            entries = self._load_checkpoint(ckpt)
            # From here on the files change; a stale checkpoint must never be trusted.
            ckpt.unlink()
            self._fsync_dir()
        if entries is None:
            entries = self._scan(io_threads)
            self.recovered_from = "scan" if any(self.alloc.slab_class) or entries else "new"
        else:
            self.recovered_from = "checkpoint"
        best: dict[bytes, DiskEntry] = {}
        for e in entries:
            if self.fenced(e.ns_id, e.seq):
                continue    # flushed: its slot is free for reuse
            k = e.ns_id + e.key
            old = best.get(k)
            if old is None or e.seq > old.seq:
                best[k] = e
        self.alloc.take_many(e.slot for e in best.values())
        self.recovered = list(best.values())
        if self.fences.get(ALL_NAMESPACES) == 1 << 62:   # damaged record: one real fence above all
            self.fences = {ALL_NAMESPACES: max([0, *(e.seq for e in entries), *self.slab_gen]) + 1}
            self.save_fences()
        top = max([0, *(e.seq for e in entries), *self.slab_gen, *self.fences.values()])
        self._seq = itertools.count(top + 1)

    def _load_checkpoint(self, ckpt: Path) -> list[DiskEntry] | None:
        try:
            raw = ckpt.read_bytes()
            body, (csum,) = raw[:-8], _CSUM.unpack(raw[-8:])
            if _csum(body) != csum:
                raise ValueError("checksum")
            d = msgpack.unpackb(body, raw=False)
            if d["version"] != FORMAT_VERSION or d["uuid"] != self.store_uuid:
                raise ValueError("version or store")
            for slab, slot_bytes, gen in d["slabs"]:
                self.alloc.assign_slab(slab, slot_bytes)
                self.slab_gen[slab] = gen
            return [DiskEntry(*row) for row in d["entries"]]
        except Exception as ex:
            log.warning("disk tier: checkpoint unusable (%s); scanning slot headers", ex)
            self.alloc = SlabAllocator(self.num_slabs, self.slab_bytes, slab_header_bytes=PAGE,
                                       capacity_bytes=self.capacity_bytes)
            self.slab_gen = [0] * self.num_slabs
            return None

    def _scan(self, io_threads: int) -> list[DiskEntry]:
        """Rebuild the index from slab and slot headers (header checksums verified here,
        payload checksums at every read)."""
        def scan_slab(slab: int) -> tuple[int, int, int, list[DiskEntry], int]:
            fd, base = self._slab_loc(slab)
            buf = _aligned(PAGE)
            if os.preadv(fd, [buf], base) < PAGE:
                return slab, 0, 0, [], 0
            (csum,) = _CSUM.unpack_from(buf, _SLAB.size)
            magic, ver, _, slot_bytes, gen = _SLAB.unpack_from(buf)
            if (magic != SLAB_MAGIC or ver != FORMAT_VERSION or _csum(bytes(buf[:_SLAB.size])) != csum
                    or slot_bytes == 0 or slot_bytes % PAGE or slot_bytes > self.slab_bytes - PAGE):
                return slab, 0, 0, [], 0
            found, bad = [], 0
            file_size = os.fstat(fd).st_size
            for i in range((self.slab_bytes - PAGE) // slot_bytes):
                off = base + PAGE + i * slot_bytes
                if os.preadv(fd, [buf], off) < PAGE:
                    break
                try:
                    h = unpack_slot_header(buf)
                except CorruptBlockError:
                    bad += 1
                    continue
                if h is None or h[11] != gen:
                    continue  # empty, or left over from an earlier use of this slab
                _, _, codec, _, _, ns_id, key, parent, payload_len, raw_len, seq, _, _ = h
                if payload_len > slot_bytes - PAGE or raw_len > slot_bytes - PAGE or \
                        off + PAGE + payload_len > file_size:
                    bad += 1
                    continue
                slot = (slab << 24) | i
                parent = b"" if parent == b"\0" * 16 else parent
                found.append(DiskEntry(slot, ns_id, key, seq, payload_len, raw_len, codec, parent))
            return slab, slot_bytes, gen, found, bad

        entries: list[DiskEntry] = []
        with ThreadPoolExecutor(io_threads) as pool:
            for slab, slot_bytes, gen, found, bad in pool.map(scan_slab, range(self.num_slabs)):
                self.corrupt_at_open += bad
                if slot_bytes:
                    self.alloc.assign_slab(slab, slot_bytes)
                    self.slab_gen[slab] = gen
                    entries.extend(found)
        if self.corrupt_at_open:
            log.warning("disk tier: %d damaged slots dropped at open", self.corrupt_at_open)
        return entries

    # -- closing -----------------------------------------------------------------------------
    def close(self, entries: list[DiskEntry] | None) -> None:
        """Flush, and if `entries` (the complete index) is given write a checkpoint so the
        next open skips the scan."""
        if self._closed:
            return
        self._closed = True
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
        self.pool.shutdown(wait=True)
        self._release_fds()

    def usage(self) -> dict:
        return {**super().usage(), "path": str(self.path), "direct_io": self.direct_io,
                "codec": self.codec_name, "recovered_from": self.recovered_from}
