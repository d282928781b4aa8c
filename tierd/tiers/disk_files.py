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

from ..arena import SlabAllocator
from ..config import align_up, format_size
from ..errors import (
    CapacityError,
    ConfigError,
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
            free = st.f_bavail * st.f_frsize
        except OSError:
            free = None
        if free is not None and needed > free:
            raise self._room_error(needed)   # before the first byte is written
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
                self._made_files.append(fp)
                self._create_file(fp, i, store_uuid)
            fd = os.open(fp, flags)
            self._fds.append(fd)
            want = self._file_size(i)
            if os.fstat(fd).st_size < want:  # truncated by someone: give the space back
                self._fallocate(fd, fp, want)
        self.store_uuid = store_uuid

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
        return self._fds[slab // self.slabs_per_file], PAGE + (slab % self.slabs_per_file) * self.slab_bytes

    def _slot_loc(self, slot: int) -> tuple[int, int]:
        slab = SlabAllocator.slab_of(slot)
        fd, base = self._slab_loc(slab)
        return fd, base + (self.alloc.offset(slot) - slab * self.slab_bytes)
