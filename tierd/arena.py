"""Arenas and the slab allocator that carves them.

`SlabAllocator` divides an arena into equal slabs and each slab into equal slots of one slot
size (a slab class, memcached-style): no per-block allocation, no external fragmentation; the
waste is the slab tails, slab headers and the arena tail, and it is reported. `SharedArena` is
the host tier's memory: one shared-memory file (memfd or /dev/shm) mapped once.
Neither class knows about blocks, keys or policy.
"""

from __future__ import annotations

import errno
import fcntl
import heapq
import mmap
import os
from dataclasses import dataclass

import numpy as np

from .config import ALIGN, align_up
from .errors import CapacityError, ConfigError
from .instance import same_file

_SLOT_BITS = 24  # slot id = slab << 24 | index within slab


@dataclass(slots=True)
class _SlabClass:
    slot_bytes: int
    slots_per_slab: int
    slabs: list[int]
    free: list[int]  # heap of free slot ids: the lowest offset goes first, so disk writes stay sequential


class SlabAllocator:
    """Slots of 4096-aligned sizes in `num_slabs` slabs of `slab_bytes`.

    Invariant: a slab is either free (in `free_slabs`, class 0) or belongs to exactly one
    class, and each of its slots is either in that class's free list or in use.
    """

    def __init__(self, num_slabs: int, slab_bytes: int, *, slab_header_bytes: int = 0,
                 capacity_bytes: int | None = None):
        if num_slabs < 1:
            raise CapacityError("an arena needs at least one slab")
        self.num_slabs = num_slabs
        self.slab_bytes = slab_bytes
        self.slab_header_bytes = slab_header_bytes
        self.capacity_bytes = capacity_bytes if capacity_bytes is not None else num_slabs * slab_bytes
        self.slab_class = [0] * num_slabs      # slot_bytes of each slab, 0 = free
        self.slab_used = [0] * num_slabs       # slots in use per slab
        self.free_slabs = list(range(num_slabs - 1, -1, -1))
        self.classes: dict[int, _SlabClass] = {}
        self.used_bytes = 0

    @property
    def usable_slab_bytes(self) -> int:
        return self.slab_bytes - self.slab_header_bytes

    def check_slot_bytes(self, slot_bytes: int, what: str) -> None:
        if slot_bytes % ALIGN or slot_bytes <= 0:
            raise ConfigError(f"{what}: slot size {slot_bytes} is not a positive multiple of 4096")
        if slot_bytes > self.usable_slab_bytes:
            raise CapacityError(
                f"{what}: a slot of {slot_bytes} bytes does not fit in a slab of "
                f"{self.usable_slab_bytes} usable bytes; raise the tier's slab_bytes (and capacity)")

    def _class(self, slot_bytes: int) -> _SlabClass:
        c = self.classes.get(slot_bytes)
        if c is None:
            c = _SlabClass(slot_bytes, self.usable_slab_bytes // slot_bytes, [], [])
            self.classes[slot_bytes] = c
        return c

    # -- slot ids --------------------------------------------------------------------------
    @staticmethod
    def slab_of(slot_id: int) -> int:
        return slot_id >> _SLOT_BITS

    def offset(self, slot_id: int) -> int:
        slab, idx = slot_id >> _SLOT_BITS, slot_id & ((1 << _SLOT_BITS) - 1)
        return slab * self.slab_bytes + self.slab_header_bytes + idx * self.slab_class[slab]

    def slot_bytes_of(self, slot_id: int) -> int:
        return self.slab_class[slot_id >> _SLOT_BITS]

    def slots_of_slab(self, slab: int) -> range:
        n = self.usable_slab_bytes // self.slab_class[slab] if self.slab_class[slab] else 0
        return range(slab << _SLOT_BITS, (slab << _SLOT_BITS) + n)

    # -- allocation ------------------------------------------------------------------------
    def assign_slab(self, slab: int, slot_bytes: int) -> None:
        """Give free slab `slab` to class `slot_bytes`; all its slots become free."""
        if self.slab_class[slab]:
            raise RuntimeError(f"slab {slab} is already assigned")
        self.free_slabs.remove(slab)
        c = self._class(slot_bytes)
        self.slab_class[slab] = slot_bytes
        c.slabs.append(slab)
        base = slab << _SLOT_BITS
        c.free.extend(range(base, base + c.slots_per_slab))
        heapq.heapify(c.free)

    def alloc(self, slot_bytes: int) -> int | None:
        """A free slot of `slot_bytes`, taking a free slab if the class is full; None if neither."""
        c = self._class(slot_bytes)
        if not c.free:
            if not self.free_slabs:
                return None
            self.assign_slab(self.free_slabs[-1], slot_bytes)
        slot = heapq.heappop(c.free)
        self._mark(slot, +1)
        return slot

    def take_many(self, slot_ids) -> None:
        """Mark specific free slots used (recovery); one pass over the free lists."""
        taken = set(slot_ids)
        for slot in taken:
            self._mark(slot, +1)
        for c in self.classes.values():
            c.free = [s for s in c.free if s not in taken]
            heapq.heapify(c.free)

    def free(self, slot_id: int) -> None:
        slab = slot_id >> _SLOT_BITS
        c = self.classes[self.slab_class[slab]]
        heapq.heappush(c.free, slot_id)
        self._mark(slot_id, -1)

    def _mark(self, slot_id: int, delta: int) -> None:
        slab = slot_id >> _SLOT_BITS
        self.slab_used[slab] += delta
        self.used_bytes += delta * self.slab_class[slab]

    def release_slab(self, slab: int) -> None:
        """Return an empty slab to the free pool (slab reassignment)."""
        if self.slab_used[slab]:
            raise RuntimeError(f"slab {slab} still has {self.slab_used[slab]} slots in use")
        c = self.classes[self.slab_class[slab]]
        c.slabs.remove(slab)
        lo, hi = slab << _SLOT_BITS, (slab + 1) << _SLOT_BITS
        c.free = [s for s in c.free if not lo <= s < hi]
        heapq.heapify(c.free)
        self.slab_class[slab] = 0
        self.free_slabs.append(slab)

    def empty_slab_elsewhere(self, slot_bytes: int) -> int | None:
        """An assigned slab of another class with no slot in use, or None."""
        for slot_b, c in self.classes.items():
            if slot_b == slot_bytes:
                continue
            for slab in c.slabs:
                if self.slab_used[slab] == 0:
                    return slab
        return None

    # -- accounting ------------------------------------------------------------------------
    def free_slot_count(self, slot_bytes: int) -> int:
        c = self.classes.get(slot_bytes)
        per_slab = self.usable_slab_bytes // slot_bytes
        return (len(c.free) if c else 0) + len(self.free_slabs) * per_slab

    def waste_bytes(self) -> int:
        """Bytes that can never hold a slot: slab tails and headers of assigned slabs, the
        headers of free slabs, and the arena tail that forms no slab."""
        waste = self.capacity_bytes - self.num_slabs * self.slab_bytes
        waste += self.num_slabs * self.slab_header_bytes
        for c in self.classes.values():
            waste += len(c.slabs) * (self.usable_slab_bytes - c.slots_per_slab * c.slot_bytes)
        return waste


def plan_slabs(capacity_bytes: int, slab_bytes: int, what: str) -> tuple[int, int]:
    """(num_slabs, slab_bytes) for an arena of `capacity_bytes`; a slab larger than the whole
    arena shrinks to it."""
    if capacity_bytes < 2 * ALIGN:
        raise CapacityError(f"{what}: capacity of {capacity_bytes} bytes is smaller than the 8 KiB minimum")
    slab_bytes = min(slab_bytes, capacity_bytes // ALIGN * ALIGN)
    return capacity_bytes // slab_bytes, slab_bytes


class SharedArena:
    """A shared-memory file of exactly `capacity_bytes`, mapped read-write.

    Backed by a memfd (anonymous, gone when the last user closes it) or by a file under a
    directory such as /dev/shm (mode 0600) that other processes can map by path. Pages are
    allocated by the kernel on first touch, so a large, mostly empty arena costs nothing.
    """

    def __init__(self, capacity_bytes: int, *, path: str | None = None, name: str = "tierd-host",
                 mode: int = 0o600, reserve: bool | None = None, setting: str = "host.bytes (--host-bytes)"):
        if mode & 0o007:
            raise ConfigError(f"host arena mode {mode:o} would let any user read the cache; use 0600 or 0660")
        if capacity_bytes <= 0 or capacity_bytes % ALIGN:
            raise CapacityError(f"host arena size {capacity_bytes} must be a positive multiple of 4096")
        self.capacity_bytes = capacity_bytes
        self.path = path
        if path is None:
            self.fd = os.memfd_create(name, os.MFD_CLOEXEC)
        else:
            self.fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
            # a shared lock from the first instant the file exists, for as long as this arena
            # lives: `tierd clean` (tierd.leftovers) never removes a locked arena, so not one of
            # a daemon still starting up either (before its own lock on it, a disk scan may run)
            fcntl.flock(self.fd, fcntl.LOCK_SH)
        try:
            if path is not None:
                os.fchmod(self.fd, mode)  # not subject to the umask
            os.ftruncate(self.fd, capacity_bytes)
            if reserve if reserve is not None else path is not None:
                self._reserve(setting)
            self._mmap = mmap.mmap(self.fd, capacity_bytes, mmap.MAP_SHARED,
                                   mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(self.fd)
            if path is not None:
                os.unlink(path)
            raise
        try:  # huge pages where the host allows them for shmem (shmem_enabled=advise)
            self._mmap.madvise(mmap.MADV_HUGEPAGE)
        except (AttributeError, OSError):
            pass
        self.array = np.frombuffer(self._mmap, dtype=np.uint8)  # (capacity_bytes,)
        self.readonly = self.array.view()      # the same, read-only: its slices are leased views
        self.readonly.flags.writeable = False

    def _reserve(self, setting: str) -> None:
        """Allocate every page of the file now. A sparse shared-memory file is filled page by
        page on first touch, and when its filesystem (a tmpfs: /dev/shm is 64 MiB in a default
        container) runs out, the touching process — the daemon or an engine copying into a slot
        — dies of SIGBUS. Reserved, the arena can never fault; if the room is not there, the
        arena is refused now, with the reason."""
        try:
            os.posix_fallocate(self.fd, 0, self.capacity_bytes)
        except OSError as e:
            where = os.path.dirname(os.path.abspath(self.path)) if self.path else "shared memory"
            free = fs = None
            try:
                st = os.statvfs(where)
                free = st.f_bavail * st.f_frsize
            except OSError:
                pass
            if self.path:
                fs = filesystem_type(where)
            from .config import format_size
            room = f"{format_size(free)} free" if free is not None else "free space unknown"
            if e.errno in (errno.ENOSPC, errno.ENOMEM, errno.EFBIG):
                raise CapacityError(
                    f"host tier: cannot reserve {format_size(self.capacity_bytes)} for the shared-memory arena "
                    f"in {where} ({fs or 'unknown filesystem'}, {room}); lower {setting} or give that "
                    f"filesystem more room (e.g. a larger /dev/shm: docker run --shm-size)") from None
            raise CapacityError(f"host tier: cannot reserve the shared-memory arena in {where}: {e.strerror}") from None

    def reserve_now(self, setting: str = "host.bytes (--host-bytes)") -> None:
        """Reserve the whole file now (an arena made with `reserve=False` while blocks of an
        earlier arena were copied into it: the two never take their full size at once)."""
        self._reserve(setting)

    def identity(self) -> tuple[int, int]:
        """(st_dev, st_ino) of the arena's file: a client that maps it by path checks it is
        this file, not one another daemon put at the same path."""
        st = os.fstat(self.fd)
        return st.st_dev, st.st_ino

    def view(self, offset: int, length: int) -> np.ndarray:
        """A writable (length,) uint8 view of the arena at `offset`."""
        return self.array[offset:offset + length]

    def close(self, *, keep: bool = False) -> None:
        """Unmap and close; the file is removed unless `keep` (a host tier that keeps its
        blocks for the next daemon)."""
        if self.fd < 0:
            return
        self.array = self.readonly = None
        try:
            self._mmap.close()
        except BufferError:
            pass  # a caller still holds a view; the mapping goes when the last view does
        if self.path is not None and not keep:
            # only our own file: a path that names another file now is not ours to remove
            if same_file(self.fd, self.path):
                try:
                    os.unlink(self.path)
                except FileNotFoundError:
                    pass
        os.close(self.fd)
        self.fd = -1


def filesystem_type(path: str) -> str | None:
    """The type of the filesystem holding `path` (from /proc/self/mounts), or None."""
    path = os.path.realpath(path)
    best, fstype = "", None
    try:
        with open("/proc/self/mounts") as f:
            for line in f:
                parts = line.split()
                if len(parts) >= 3:
                    mnt = parts[1].replace("\\040", " ")
                    if (path == mnt or path.startswith(mnt.rstrip("/") + "/")) and len(mnt) >= len(best):
                        best, fstype = mnt, parts[2]
    except OSError:
        return None
    return fstype


def slot_bytes_for(block_bytes: int) -> int:
    """Host slot size of a block: its byte size rounded up to 4096."""
    return align_up(block_bytes)
