"""The disk tier's directory and slab files: its lock, the geometry of files and slabs, the
superblocks, creating and opening the files, and where a slab or slot lies in them. Part of
`DiskTier`; the format is in docs/on-disk-format.md."""

from __future__ import annotations

import errno
import fcntl
import logging
import mmap
import os
import struct
import uuid
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..arena import SlabAllocator
from ..config import align_up, format_size
from ..errors import (
    CapacityError,
    DirectoryLockedError,
    DiskTierError,
    NotASlabFileError,
)
from .slot_header import _CSUM, FORMAT_VERSION, PAGE, _csum

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


HUGE_PAGE = 2 << 20
HUGE_FROM = 256 << 10


def io_buffer(nbytes: int) -> np.ndarray:
    """A page-aligned I/O buffer of at least `nbytes`, (n,) uint8, in private anonymous memory.
    From HUGE_FROM on, it is a whole number of 2 MiB pages, 2 MiB-aligned and advised to be
    backed by huge pages.

    The disk sees the buffer's physical memory: each physically contiguous stretch is one
    segment of a request, a request takes a bounded number of segments (254 on the CPU build
    VM's disk), so a buffer of scattered 4 KiB pages cuts one large read or write into several
    device requests, and more segments cost the device more per byte (docs/design-notes.md).
    With huge pages, every 2 MiB is one segment. (Python's `mmap.mmap(-1, n)` is shared
    anonymous memory, which huge pages back only where shared-memory huge pages are on.)"""
    n = max(PAGE, align_up(nbytes))
    if n < HUGE_FROM:
        return np.frombuffer(mmap.mmap(-1, n, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS), dtype=np.uint8)
    n = align_up(n, HUGE_PAGE)
    m = mmap.mmap(-1, n + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    buf = np.frombuffer(m, dtype=np.uint8)
    skip = -buf.__array_interface__["data"][0] % HUGE_PAGE
    try:
        m.madvise(mmap.MADV_HUGEPAGE, skip, n)
    except (AttributeError, OSError, ValueError):
        pass    # no huge pages here: still an aligned buffer
    return buf[skip:skip + n]


class SlabFiles:
    """Part of `DiskTier`: the directory, its lock and its slab files."""

    def _open_dir(self) -> None:
        p = self.path
        if os.path.islink(p):
            raise DiskTierError(
                f"disk tier: {p} is a symbolic link to {os.path.realpath(p)}; refusing to write "
                "slab files through it (set disk_path to the real directory)")
        try:
            if p.exists() and not p.is_dir():
                raise DiskTierError(f"disk tier: {p} exists and is not a directory; set disk_path to a directory")
            # what this start makes, removed again if it fails (`_remove_made`): the directories
            # it creates, the slab files it creates in one that existed
            self._made_dirs = [d for d in (p, *p.parents) if not d.exists()][::-1]
            self._made_files: list[Path] = []
            p.mkdir(parents=True, exist_ok=True)
        except DiskTierError:
            raise
        except OSError as e:
            raise DiskTierError(
                f"disk tier: cannot create {p} ({e.strerror}); set disk_path or fix permissions") from None
        try:
            if not (p / LOCK_NAME).exists():
                self._made_files.append(p / LOCK_NAME)
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

    def _existing_files(self) -> tuple[list[tuple[Path, tuple]], list[Path]]:
        """The slab files already here: (path, superblock) of slab-0000.tds, slab-0001.tds, ...
        up to the first missing one, all of one store and one slab size; and the files after
        such a gap (`_plan` drops them). Refuses a file tierd did not write."""
        named = {}
        for fp in self.path.glob("slab-*.tds"):
            num = fp.name[len("slab-"):-len(".tds")]
            if not num.isdigit():
                raise NotASlabFileError(
                    f"disk tier: {fp} is not a tierd slab file; move it away or set another disk_path")
            named[int(num)] = fp
        files: list[tuple[Path, tuple]] = []
        while len(files) in named:
            i = len(files)
            sb = self._read_super(named.pop(i), expect_index=i)
            if files and sb[5] != files[0][1][5]:
                raise NotASlabFileError(f"disk tier: {self.path / f'slab-{i:04d}.tds'} belongs to another tierd store")
            if files and sb[4] != files[0][1][4]:
                raise NotASlabFileError(
                    f"disk tier: {self.path / f'slab-{i:04d}.tds'} has slabs of {format_size(sb[4])}, "
                    f"slab-0000.tds of {format_size(files[0][1][4])}: a mixed directory")
            if sb[3] < 1 or sb[4] < 2 * PAGE or sb[4] % PAGE:
                raise NotASlabFileError(f"disk tier: {self.path / f'slab-{i:04d}.tds'}: superblock holds "
                                        f"{sb[3]} slabs of {sb[4]} bytes; the file is damaged")
            files.append((self.path / f"slab-{i:04d}.tds", sb))
        strays = [named[i] for i in sorted(named)]
        for fp in strays:   # after a gap: dropped, but only if it is this store's own
            sb = self._read_super(fp, expect_index=int(fp.name[5:-4]))
            if not files or sb[5] != files[0][1][5]:
                raise NotASlabFileError(
                    f"disk tier: {fp} belongs to another tierd store, or slab-0000.tds is missing; "
                    "move it away or empty the directory")
        return files, strays

    def _plan(self, capacity_bytes: int, slab_bytes: int, file_bytes: int) -> None:
        """Geometry: the number of slabs of each file (`file_slabs`), `num_slabs` in all, the
        files and their superblocks within capacity.

        A new directory gets files of `file_bytes` (the last one shorter). An existing one keeps
        its slab size and every file it has, untouched, as long as they fit: a larger capacity
        adds files after them (so every slab already there keeps its number, its place and its
        blocks), a smaller one drops the last files, whole, with their blocks (`_drop`) and fills
        what room is left with a shorter file."""
        if capacity_bytes < 3 * PAGE:
            raise CapacityError(f"disk tier: capacity of {capacity_bytes} bytes is too small (12 KiB minimum)")
        existing, strays = self._existing_files()
        counts, kept = [], 0
        if existing:  # an existing directory keeps its slab size and the files that fit
            slab_bytes_was = existing[0][1][4]
            counts = [sb[3] for _, sb in existing]
            while counts and sum(PAGE + c * slab_bytes_was for c in counts) > capacity_bytes:
                counts.pop()
            kept = len(counts)
        if kept:
            slab_bytes = slab_bytes_was
            spf = max(1, (file_bytes - PAGE) // slab_bytes)
            room = capacity_bytes - sum(PAGE + c * slab_bytes for c in counts)
            while room >= PAGE + slab_bytes:
                k = min(spf, (room - PAGE) // slab_bytes)
                counts.append(k)
                room -= PAGE + k * slab_bytes
        else:  # a new directory, or not one file of the old one fits: all made anew
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
            counts = [min(spf, n - i) for i in range(0, n, spf)]
        n = sum(counts)
        if n == 0:
            raise CapacityError(
                f"disk tier: capacity {format_size(capacity_bytes)} holds no slab of {format_size(slab_bytes)}")
        self.capacity_bytes = capacity_bytes
        self.slab_bytes = slab_bytes
        self.slabs_per_file = counts[0]   # of every file but the last, in a directory never resized
        self.file_slabs = counts
        self.num_slabs = n
        self.num_files = len(counts)
        # slab -> (file, offset in the file)
        self._slab_file = [i for i, c in enumerate(counts) for _ in range(c)]
        self._slab_off = [PAGE + j * slab_bytes for c in counts for j in range(c)]
        self._existing = existing[:kept]
        self._drop = [fp for fp, _ in existing[kept:]] + strays
        self.store_uuid = existing[0][1][5] if kept else None
        self.alloc = SlabAllocator(n, slab_bytes, slab_header_bytes=PAGE, capacity_bytes=capacity_bytes)
        # Superblocks are part of the capacity but hold no slot: count them as waste.
        self.alloc.capacity_bytes = capacity_bytes
        self.slab_gen = [0] * n

    def _file_slabs(self, i: int) -> int:
        return self.file_slabs[i]

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

    def _room_error(self, needed: int, free: int | None = None) -> DiskTierError:
        from ..arena import filesystem_type
        if free is None:
            try:
                st = os.statvfs(self.path)
                free = st.f_bavail * st.f_frsize
            except OSError:
                pass
        room = f"{format_size(free)} free" if free is not None else "free space unknown"
        grow = most = ""
        held = sum(self._file_size(i) for i in range(len(self._existing)))
        if held:
            grow = f" to grow the tier to {format_size(self.capacity_bytes)}"
        if free is not None:
            most = f" to at most {format_size(held + free)}"
        return DiskTierError(
            f"disk tier: cannot reserve {format_size(needed)} in {self.path} "
            f"({filesystem_type(str(self.path)) or 'unknown filesystem'}, {room}){grow}; lower disk.bytes "
            f"(--disk-bytes){most} or free space there")

    def _open_files(self) -> None:
        flags = os.O_RDWR | os.O_CLOEXEC | (os.O_DIRECT if self.direct_io else 0)
        kept = len(self._existing)
        # All the room first, or nothing: a half-created set of slab files would not match a
        # later, smaller disk.bytes. The files this start drops give their room back.
        needed = 0
        for i in range(self.num_files):
            fp = self.path / f"slab-{i:04d}.tds"
            have = fp.stat().st_blocks * 512 if i < kept else 0
            needed += max(0, self._file_size(i) - have)
        try:
            st = os.statvfs(self.path)
            free = st.f_bavail * st.f_frsize + sum(fp.stat().st_blocks * 512 for fp in self._drop)
        except OSError:
            free = None
        if free is not None and needed > free:
            raise self._room_error(needed, free)   # before the first byte is written or removed
        if self._drop:
            self._drop_files()
        store_uuid = self.store_uuid
        for i in range(self.num_files):
            fp = self.path / f"slab-{i:04d}.tds"
            if i >= kept:
                store_uuid = store_uuid or uuid.uuid4().bytes
                self._made_files.append(fp)
                self._create_file(fp, i, store_uuid)
            fd = os.open(fp, flags)
            self._fds.append(fd)
            want = self._file_size(i)
            if os.fstat(fd).st_size < want:  # truncated by someone: give the space back
                self._fallocate(fd, fp, want)
        self.store_uuid = store_uuid
        total = format_size(sum(map(self._file_size, range(self.num_files))))
        if self._drop:
            log.warning("disk tier: %s: removed %d slab files (%s) and the blocks in them, for disk.bytes %s; "
                        "the blocks in the %d files kept stay", self.path, len(self._drop),
                        ", ".join(fp.name for fp in self._drop), format_size(self.capacity_bytes), kept)
        if self._existing and self.num_files > kept:
            log.info("disk tier: %s grown to %s for disk.bytes %s: %d slab files added after the %d kept "
                     "with their blocks", self.path, total, format_size(self.capacity_bytes),
                     self.num_files - kept, kept)

    def _drop_files(self) -> None:
        """Remove the slab files a smaller disk.bytes leaves out, the last one first (so the
        files left are always slab-0000.tds up to some slab-NNNN.tds, whatever moment a crash
        comes), once the checkpoint, which may name their slabs, is gone."""
        ckpt = self.path / CHECKPOINT_NAME
        if ckpt.exists():
            ckpt.unlink()
            self._fsync_dir()
        for fp in sorted(self._drop, key=lambda f: int(f.name[5:-4]), reverse=True):
            try:
                fp.unlink()
            except FileNotFoundError:
                pass
            except OSError as e:
                raise DiskTierError(f"disk tier: cannot remove {fp} ({e.strerror}) to shrink the tier to "
                                    f"disk.bytes {format_size(self.capacity_bytes)}; fix permissions or raise "
                                    "disk.bytes") from None
            self._fsync_dir()

    def _remove_made(self) -> None:
        """A start that failed takes back what it made: the slab files (and lock file) it
        created, then the directories it created if nothing else is in them. Files that were
        there before it are never touched."""
        made_dirs = getattr(self, "_made_dirs", [])
        for f in reversed(getattr(self, "_made_files", [])):
            try:
                f.unlink()
            except FileNotFoundError:
                pass
            except OSError as e:
                log.warning("disk tier: cannot remove %s after a failed start: %s", f, e.strerror)
        if made_dirs:   # the disk directory itself is new: all in it is this start's
            for f in made_dirs[-1].iterdir() if made_dirs[-1].is_dir() else ():
                try:
                    f.unlink()
                except OSError:
                    pass
        for d in reversed(made_dirs):
            try:
                d.rmdir()
            except OSError:
                break

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

    def _slab_loc(self, slab: int) -> tuple[int, int]:
        if self._released:
            raise OSError(errno.EBADF, f"disk tier {self.path} is closed")
        return self._fds[self._slab_file[slab]], self._slab_off[slab]

    def _slot_loc(self, slot: int) -> tuple[int, int]:
        slab = SlabAllocator.slab_of(slot)
        fd, base = self._slab_loc(slab)
        return fd, base + (self.alloc.offset(slot) - slab * self.slab_bytes)
