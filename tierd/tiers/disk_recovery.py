"""What survives a restart of the disk tier: namespace descriptions, flush fences, the index
checkpoint written at a clean close, and the scan of slot headers that rebuilds the index
otherwise. Part of `DiskTier`.

Flush fences: a flush drops blocks from the index at once, but copies evicted earlier left valid
headers behind, and any header could outlive the flush in a crash. So a flush records a fence:
every copy of the namespace (or of all, key ALL_NAMESPACES) written with a sequence number below
it is dead — at recovery and in the settle of writes in flight. Fences only grow, and sequence
numbers continue above every fence after a restart."""

from __future__ import annotations

import itertools
import logging
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import msgpack

from ..arena import SlabAllocator
from .disk_files import (
    _SLAB,
    ALL_NAMESPACES,
    CHECKPOINT_NAME,
    FENCES_NAME,
    NAMESPACES_NAME,
    SLAB_MAGIC,
    DiskEntry,
    _aligned,
)
from .slot_header import (
    _CSUM,
    FORMAT_VERSION,
    PAGE,
    CorruptBlockError,
    _csum,
    unpack_slot_header,
)

log = logging.getLogger("tierd.disk")


class Recovery:
    """Part of `DiskTier`: what survives a restart."""

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
            # Written for the files as they were at the last close. Trusted only for files this
            # start found and kept as they were: it may add files after them (a larger
            # disk.bytes, or a file gone missing made anew: their slabs are free), never
            # changes one it kept, and removes the checkpoint before it drops any
            # (`_drop_files`). A checkpoint of an earlier release has no "files": then every
            # slab it names must lie in the files kept.
            kept = self.file_slabs[:len(self._existing)]
            files = d.get("files")
            if files is not None and (len(files) > len(kept) or list(files) != kept[:len(files)]):
                raise ValueError(f"written for slab files of {list(files)} slabs, found {kept}")
            n = sum(kept)
            if any(not 0 <= slab < n for slab, _, _ in d["slabs"]) or \
                    any(not 0 <= SlabAllocator.slab_of(row[0]) < n for row in d["entries"]):
                raise ValueError(f"names slabs beyond the {n} of the slab files found")
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
