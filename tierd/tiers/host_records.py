"""Host block records: what lets a restarted daemon re-adopt the blocks of its host arena.

The host arena holds raw blocks (clients copy into and out of its slots directly), so the blocks
cannot describe themselves as disk slots do. Their descriptions live in a second shared-memory
file beside the arena, one fixed-size record per 4 KiB page of the arena, at the index of the
block's first page: namespace id, key, parent key, length, a write sequence number, the xxh3-64
checksum of the block's bytes, and the record's own checksum. The file is sparse: only the pages
holding records take memory (one 4 KiB page per block of 128 KiB or more).

Rules (the store keeps them, `tierd/store/keeping.py`):

- A record is written only for a READY block, after its bytes were checksummed while it was
  pinned; it is cleared (its magic zeroed) before the block's slot is freed or the block is
  flushed. A valid record therefore always describes bytes a client committed.
- Writes to a tmpfs mapping survive the writer's death (SIGKILL included), not a reboot: a record
  is there for the next daemon or it is not; a torn one fails its checksum.
- The namespace descriptions the records name are in a third file (`.ns`, msgpack, replaced
  atomically), written before the first record of each namespace.
- The header names the arena file's identity (device, inode): records are only ever read
  against the arena they describe.

Format version 1; a file of another version, magic or arena is not read (its blocks are dropped).
"""

from __future__ import annotations

import fcntl
import mmap
import os
import struct
from dataclasses import dataclass

import msgpack
import numpy as np
import xxhash

from ..config import ALIGN
from ..errors import TierdError

MAGIC = b"TIERDHRF"          # the file
REC_MAGIC = b"TIERDHRB"      # one record
FORMAT_VERSION = 1
REC_BYTES = 128
FLAG_DECODED = 1             # the block's bytes were decoded from a lossy copy (write them exact)
# file header: magic, version, record size, arena capacity, arena st_dev, arena st_ino
_HEAD = struct.Struct("<8sHHIQQQ")
# record: magic, version, flags, pad, ns id, key, parent (zeros: none), length, seq, checksum
_REC = struct.Struct("<8sHHI16s16s16sQQQ")
_CSUM = struct.Struct("<Q")
_DATA_OFF = ALIGN            # records start after the header page
_ZERO16 = b"\0" * 16


class RecordsBusyError(TierdError):
    """Another live store holds these records (and so the arena beside them)."""

    code = "busy"


@dataclass(slots=True, frozen=True)
class HostRecord:
    offset: int          # of the block in the arena
    ns_id: bytes
    key: bytes
    parent: bytes | None
    length: int
    seq: int
    checksum: int
    flags: int


def checksum(view) -> int:
    """The checksum records carry: xxh3-64 of the block's bytes (releases the GIL)."""
    return xxhash.xxh3_64_intdigest(view)


def _pack(r: HostRecord) -> bytes:
    body = _REC.pack(REC_MAGIC, FORMAT_VERSION, r.flags, 0, r.ns_id, r.key, r.parent or _ZERO16,
                     r.length, r.seq, r.checksum)
    return body + _CSUM.pack(xxhash.xxh3_64_intdigest(body))


def pack(r: HostRecord) -> bytes:
    """A record as written in its slot of the records file (REC_BYTES)."""
    return _pack(r).ljust(REC_BYTES, b"\0")


def _unpack(raw: bytes, offset: int) -> HostRecord | None:
    """The record in `raw` (REC_BYTES), or None if empty, torn or of another version."""
    if raw[:8] != REC_MAGIC:
        return None
    (csum,) = _CSUM.unpack_from(raw, _REC.size)
    if xxhash.xxh3_64_intdigest(raw[:_REC.size]) != csum:
        return None
    _, ver, flags, _, ns_id, key, parent, length, seq, ck = _REC.unpack_from(raw)
    if ver != FORMAT_VERSION:
        return None
    return HostRecord(offset, ns_id, key, None if parent == _ZERO16 else parent, length, seq, ck, flags)


class HostRecords:
    """The records file of one host arena, mapped read-write. Record calls are memory writes
    into a tmpfs mapping (made under the store's lock); `remember_namespaces` writes a small
    file (made outside it)."""

    def __init__(self, path: str, capacity_bytes: int, arena_identity: tuple[int, int], *, mode: int = 0o600):
        self.path = path
        self.ns_path = path + ".ns"
        self.capacity_bytes = capacity_bytes
        self.namespaces: dict[bytes, dict] = {}
        self._nrec = capacity_bytes // ALIGN
        size = _DATA_OFF + self._nrec * REC_BYTES
        self.fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        try:
            os.fchmod(self.fd, mode)
            _lock(self.fd, path)
            os.ftruncate(self.fd, size)   # sparse: pages are reserved as records need them
            self._ready: set[int] = set()  # pages of the file reserved (see `reserve`)
            self.reserve_pages([0])
            self._mm = mmap.mmap(self.fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
            self._mm[:_HEAD.size] = _HEAD.pack(MAGIC, FORMAT_VERSION, REC_BYTES, 0, capacity_bytes,
                                               *arena_identity)
            if os.path.exists(self.ns_path):
                os.unlink(self.ns_path)
        except BaseException:
            os.close(self.fd)
            _unlink(path)
            raise

    def _at(self, offset: int) -> int:
        i = offset // ALIGN
        if offset % ALIGN or not 0 <= i < self._nrec:
            raise ValueError(f"host record: offset {offset} is not a page of the arena")
        return _DATA_OFF + i * REC_BYTES

    def reserve_pages(self, pages) -> None:
        """Reserve file pages (by index) before records are written into them: a page first
        touched through the mapping on a full tmpfs would kill the writer with SIGBUS; reserved
        here, a full tmpfs is an OSError instead. (No lock: a file call.)"""
        for p in sorted(set(pages) - self._ready):
            os.posix_fallocate(self.fd, p * ALIGN, ALIGN)
            self._ready.add(p)

    def prepare(self, offset: int) -> None:
        """Reserve the page the record of a block at `offset` goes in, as its slot is handed
        out, so that the block is recorded as soon as it is committed (a page once reserved
        stays so: this is one call per page of the file, ever). Best effort: on a full tmpfs the
        block is left to the keeper, which tries again and reports it."""
        page = self._at(offset) // ALIGN
        if page not in self._ready:
            try:
                self.reserve_pages((page,))
            except OSError:
                pass

    def pages_for(self, offsets) -> list[int]:
        """The file pages that records of blocks at these arena offsets go in."""
        return [self._at(o) // ALIGN for o in offsets]

    def write(self, r: HostRecord) -> bool:
        """Write a record; False (nothing written) if its page is not reserved."""
        return self.write_packed(r.offset, pack(r))

    def write_packed(self, offset: int, data: bytes) -> bool:
        """Write a record made by `pack` for the block at `offset` (packing is the costly part,
        done before the caller takes the store's lock); False if its page is not reserved."""
        at = self._at(offset)
        if at // ALIGN not in self._ready:
            return False
        self._mm[at:at + REC_BYTES] = data
        return True

    def clear(self, offset: int) -> None:
        """Forget the record of the block at `offset` (a no-op where there is none)."""
        at = self._at(offset)
        if at // ALIGN in self._ready and self._mm[at:at + 8] != b"\0" * 8:
            self._mm[at:at + 8] = b"\0" * 8

    def remember_namespaces(self, descs: dict[bytes, dict]) -> None:
        """Add namespace descriptions (atomic replace of the `.ns` file) before records name them."""
        known = {**self.namespaces, **descs}
        if known == self.namespaces:
            return
        tmp = self.ns_path + ".tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        try:
            os.write(fd, msgpack.packb(known, use_bin_type=True))
        finally:
            os.close(fd)
        os.rename(tmp, self.ns_path)
        self.namespaces = known

    def close(self, *, keep: bool) -> None:
        """Unmap; the files stay for the next daemon when `keep`, else they are removed."""
        if self.fd < 0:
            return
        self._mm.close()
        if not keep:
            _unlink(self.path)
            _unlink(self.ns_path)
        os.close(self.fd)
        self.fd = -1


def read_records(path: str, arena_fd: int) -> tuple[list[HostRecord], dict[bytes, dict], str]:
    """The valid records of a records file left by an earlier store, checked against the arena
    file open at `arena_fd`: (records, namespace descriptions, "" or why none can be used).
    Records with a bad checksum or pointing outside the arena are skipped. Raises
    RecordsBusyError if a live store holds the file."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        _lock(fd, path, shared=True)
        size = os.fstat(fd).st_size
        head = os.pread(fd, _HEAD.size, 0)
        if len(head) < _HEAD.size:
            return [], {}, "the records file is truncated"
        magic, ver, rec_bytes, _, capacity, dev, ino = _HEAD.unpack(head)
        if magic != MAGIC or ver != FORMAT_VERSION or rec_bytes != REC_BYTES:
            return [], {}, f"the records file has another format (version {ver})"
        ast = os.fstat(arena_fd)
        if (ast.st_dev, ast.st_ino) != (dev, ino):
            return [], {}, "the records file describes another arena file"
        if ast.st_size != capacity:
            return [], {}, f"the arena file is {ast.st_size} bytes, its records say {capacity}"
        out: list[HostRecord] = []
        for start, end in _data_extents(fd, _DATA_OFF, size):
            first = (start - _DATA_OFF) // REC_BYTES
            last = -(-(end - _DATA_OFF) // REC_BYTES)
            raw = os.pread(fd, (last - first) * REC_BYTES, _DATA_OFF + first * REC_BYTES)
            arr = np.frombuffer(raw, dtype=np.uint8)[:len(raw) // REC_BYTES * REC_BYTES].reshape(-1, REC_BYTES)
            magic_u64 = np.frombuffer(REC_MAGIC, dtype="<u8")[0]
            hits = np.nonzero(arr[:, :8].copy().view("<u8")[:, 0] == magic_u64)[0]
            for j in hits.tolist():
                off = (first + j) * ALIGN
                r = _unpack(raw[j * REC_BYTES:(j + 1) * REC_BYTES], off)
                if r is not None and r.length > 0 and off + r.length <= capacity:
                    out.append(r)
        descs: dict[bytes, dict] = {}
        try:
            with open(path + ".ns", "rb") as f:
                descs = {bytes(k): v for k, v in
                         msgpack.unpackb(f.read(), raw=False, strict_map_key=False).items()}
        except FileNotFoundError:
            pass
        except Exception:  # noqa: BLE001 -- names are lost, blocks are not
            descs = {}
        return out, descs, ""
    finally:
        os.close(fd)


def _data_extents(fd: int, start: int, end: int):
    """(start, end) byte ranges of `fd` holding data between `start` and `end` (holes skipped)."""
    pos = start
    while pos < end:
        try:
            data = os.lseek(fd, pos, os.SEEK_DATA)
        except OSError:   # ENXIO: no data past pos
            return
        if data >= end:
            return
        try:
            hole = os.lseek(fd, data, os.SEEK_HOLE)
        except OSError:
            hole = end
        yield data, min(hole, end)
        pos = hole


def _lock(fd: int, path: str, *, shared: bool = False) -> None:
    try:
        fcntl.flock(fd, (fcntl.LOCK_SH if shared else fcntl.LOCK_EX) | fcntl.LOCK_NB)
    except BlockingIOError:
        raise RecordsBusyError(f"{path} belongs to a live store; it cannot be re-adopted") from None


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


_libc = None


def punch_hole(fd: int, offset: int, length: int) -> None:
    """Give back the memory of a range of a tmpfs file (its size stays); best effort."""
    global _libc
    if length <= 0:
        return
    try:
        if _libc is None:
            import ctypes
            _libc = ctypes.CDLL(None, use_errno=True)
            _libc.fallocate.argtypes = (ctypes.c_int, ctypes.c_int, ctypes.c_long, ctypes.c_long)
        _libc.fallocate(fd, 0x02 | 0x01, offset, length)   # PUNCH_HOLE | KEEP_SIZE
    except (OSError, AttributeError):
        pass
