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
- The namespace descriptions the records name are in a third file (`.ns`), a log of entries
  appended by memory writes into its mapping, like the records (so the store writes a new
  namespace's entry under its lock, at the commit of its first block), each before the first
  record that names it. The log's room is reserved ahead (`NS_ROOM_BYTES` at open, as much
  again when it runs out; a page at a time on a nearly full tmpfs) and the file is sparse
  beyond it. An entry is checksummed: a torn
  last entry is dropped alone. A `.ns` file of the earlier format (one msgpack map, replaced
  atomically) is still read.
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

NS_MAGIC = b"TIERDHNS"       # the namespace log (`.ns`)
NS_VERSION = 1
NS_FILE_BYTES = 64 << 20     # the log's size (sparse): some hundred thousand namespaces
NS_ROOM_BYTES = 256 << 10    # room reserved at a time (about a thousand descriptions)
NS_ENTRY_MAX = 1 << 20       # a description larger than this is not logged (its blocks are not kept)
# log header: magic, version, padding; entry: payload length (0: end of the log), padding,
# xxh3-64 of the payload, then the payload (msgpack [namespace id, description]), 8-aligned
_NS_HEAD = struct.Struct("<8sHHI")
_NS_ENT = struct.Struct("<IIQ")


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
    """The records file of one host arena and its namespace log, both mapped read-write.
    Record and namespace calls are memory writes into tmpfs mappings, made under the store's
    lock (which also orders the log's appends); the file calls that reserve their pages
    (`reserve_pages`, `prepare`, and the log's growth by `NS_ROOM_BYTES` once per some thousand
    namespaces) are one `posix_fallocate` each, about 2 µs a page on tmpfs: cheaper than the
    page fault a first write into an unreserved page costs."""

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
            self._open_ns_log()
        except BaseException:
            if getattr(self, "_mm", None) is not None:
                self._mm.close()
            os.close(self.fd)
            _unlink(path)
            _unlink(self.ns_path)
            raise

    def _open_ns_log(self) -> None:
        """A fresh namespace log: sparse, its first room reserved, mapped whole. Mode 0600
        whatever the arena's: descriptions hold cache salts (tenants' secrets), and only the
        daemon reads them."""
        _unlink(self.ns_path)
        self._ns_fd = os.open(self.ns_path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        try:
            os.ftruncate(self._ns_fd, NS_FILE_BYTES)
            self._ns_mm = mmap.mmap(self._ns_fd, NS_FILE_BYTES, mmap.MAP_SHARED,
                                    mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(self._ns_fd)
            raise
        self._ns_room = 0                          # bytes of the log reserved (its header goes in first)
        self._ns_end = _NS_HEAD.size               # where the next entry goes
        self._grow_ns_log(_NS_HEAD.size)           # (a full tmpfs: later, as namespaces come)

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

    def note_namespace(self, ns_id: bytes, desc: dict) -> bool:
        """Put a namespace's description on file (before any record names it): an entry
        appended to the namespace log, a memory write. (The store's lock held: it orders the
        appends.) True when the namespace is on file; False when the log has no room left (a
        full tmpfs, or a full log), and then nothing was written. A known namespace costs a
        dict look-up; an empty description never replaces a known one, a new one is appended
        (the later entry wins when the log is read)."""
        known = self.namespaces.get(ns_id)
        if known is not None:
            if known is desc or not desc:
                return True
            if known == desc:
                self.namespaces[ns_id] = desc   # (the caller's own dict: found by identity next time)
                return True
        payload = msgpack.packb([ns_id, desc], use_bin_type=True)
        if len(payload) > NS_ENTRY_MAX:
            return False
        at = self._ns_end
        end = at + _NS_ENT.size + (len(payload) + 7) // 8 * 8
        if end > self._ns_room and not self._grow_ns_log(end):
            return False
        mm = self._ns_mm
        mm[at + _NS_ENT.size:at + _NS_ENT.size + len(payload)] = payload
        mm[at:at + _NS_ENT.size] = _NS_ENT.pack(len(payload), 0, xxhash.xxh3_64_intdigest(payload))
        self._ns_end = end
        self.namespaces[ns_id] = desc
        return True

    def _grow_ns_log(self, end: int) -> bool:
        """Reserve the log's room up to at least `end`, NS_ROOM_BYTES at a time (once per some
        thousand namespaces), or only the pages `end` needs where the tmpfs has no more. False
        when the tmpfs or the log is full."""
        if end > NS_FILE_BYTES:
            return False
        for step in (NS_ROOM_BYTES, ALIGN):
            room = min(NS_FILE_BYTES, (end + step - 1) // step * step)
            try:
                os.posix_fallocate(self._ns_fd, self._ns_room, room - self._ns_room)
            except OSError:
                continue
            if self._ns_room == 0:    # the first page reserved: the header
                self._ns_mm[:_NS_HEAD.size] = _NS_HEAD.pack(NS_MAGIC, NS_VERSION, 0, 0)
            self._ns_room = room
            return True
        return False

    def close(self, *, keep: bool) -> None:
        """Unmap; the files stay for the next daemon when `keep`, else they are removed."""
        if self.fd < 0:
            return
        self._mm.close()
        self._ns_mm.close()
        if not keep:
            _unlink(self.path)
            _unlink(self.ns_path)
        os.close(self.fd)
        os.close(self._ns_fd)
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
        return out, read_namespaces(path + ".ns"), ""
    finally:
        os.close(fd)


def read_namespaces(ns_path: str) -> dict[bytes, dict]:
    """The namespace descriptions of a namespace file (a log, or the earlier format's one
    msgpack map); {} where there is none or it cannot be read (names are lost, blocks are not:
    a block whose namespace has no description is adopted as its namespace's, known from disk
    or registered later)."""
    try:
        fd = os.open(ns_path, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return {}
    try:
        head = os.pread(fd, _NS_HEAD.size, 0)
        size = os.fstat(fd).st_size
        if head[:8] == b"\0" * 8:     # a log that never had room (a full tmpfs)
            return {}
        if head[:8] != NS_MAGIC:      # the earlier format: one msgpack map
            if size > NS_FILE_BYTES:
                return {}
            try:
                raw = os.pread(fd, size, 0)
                return {bytes(k): v for k, v in
                        msgpack.unpackb(raw, raw=False, strict_map_key=False).items()}
            except Exception:  # noqa: BLE001
                return {}
        if _NS_HEAD.unpack(head)[1] != NS_VERSION:
            return {}
        return _read_ns_log(fd, size)
    finally:
        os.close(fd)


def _read_ns_log(fd: int, size: int) -> dict[bytes, dict]:
    """The entries of a namespace log up to its end (a zero length) or its first torn entry."""
    out: dict[bytes, dict] = {}
    pos = _NS_HEAD.size
    buf, buf_at = b"", pos               # read ahead in 64 KiB pieces
    while True:
        if pos + _NS_ENT.size > buf_at + len(buf):
            buf, buf_at = os.pread(fd, max(64 << 10, _NS_ENT.size), pos), pos
        if pos + _NS_ENT.size > buf_at + len(buf):
            break
        n, _, csum = _NS_ENT.unpack_from(buf, pos - buf_at)
        if n == 0 or n > NS_ENTRY_MAX or pos + _NS_ENT.size + n > size:
            break
        start = pos + _NS_ENT.size
        if start + n > buf_at + len(buf):
            buf, buf_at = os.pread(fd, max(64 << 10, _NS_ENT.size + n), pos), pos
        payload = buf[start - buf_at:start - buf_at + n]
        if len(payload) != n or xxhash.xxh3_64_intdigest(payload) != csum:
            break                        # torn: the last entry being written when it died
        try:
            ns_id, desc = msgpack.unpackb(payload, raw=False, strict_map_key=False)
            out[bytes(ns_id)] = desc
        except Exception:  # noqa: BLE001 -- a checksummed entry of another shape: skipped
            pass
        pos = start + (n + 7) // 8 * 8
    return out


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
