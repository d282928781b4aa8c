"""The shared lookup index: which blocks the daemon holds, readable by clients without a request.

A lookup ("how many leading blocks of this prompt are cached?") is asked for every request an
engine schedules, and its answer is advisory: by the time a load runs the blocks may be gone,
and the load (a lease) is what counts. So the daemon publishes the set of blocks it holds in a
shared-memory table, written only under the store lock, and clients answer lookups from it at
memory speed — no socket, no daemon wake-up. A request-based lookup remains for whatever the
table cannot answer.

Layout (one file beside the host arena, mode 0660, all little-endian):

  header (4096 bytes): magic "TIERDIDX", version u32, num_buckets u32, daemon instance u64,
                       disk_ok u8 (0 while the disk tier is stalled: disk-only blocks do not count),
                       misses_final u8 (0 with a remote tier: a miss here is asked of the daemon);
                       at byte 32, heartbeat u64: CLOCK_MONOTONIC ns, written by the daemon's event
                       loop every BEAT_S (a stopped or stuck daemon's table is not used: a lookup
                       then goes to the daemon, and meets the caller's deadline there);
                       at byte 40, evicted u64: CLOCK_MONOTONIC ns of the host tier's last
                       eviction of a block a reader could be copying (0: none yet), written under
                       the store lock (where `hello` says `evictions`: a quiet lease pins its
                       blocks only while evictions are recent, see docs/protocol.md)
  tags:   num_buckets x WAYS x 16 bytes   tag = key XOR namespace id (never all zero)
  states: num_buckets x WAYS bytes        bit 0: ready in host RAM, bit 1: on disk, bit 2: being
                                          loaded into host RAM; 0: the way is free
  overflow: num_buckets bytes             1: a block of this bucket found no free way (it is not
                                          in the table): a miss there must be asked of the daemon
  (padding to 8 bytes)
  offsets: num_buckets x WAYS x i64       the block's host slot (byte offset in the host arena)
                                          while bit 0 is set
  seqs:    num_buckets x WAYS x u64       the way's sequence number: odd while the daemon
                                          rewrites the way, and 2 more after every rewrite

A block lives in bucket `tag[0:8] mod num_buckets`, in one of its WAYS ways. Writers publish a
tag before its state and clear the state before the tag; a reader may see a state a few
microseconds old — never a tag that was not written (a torn tag matches no key).

Reads without a lease (`host_run` / `unchanged`, version 2). Every rewrite of a way — its
state, its slot, or the way going to another block — is bracketed by its sequence number
(made odd first, even again after), all under the store lock, and a block's way is rewritten
(its host bit cleared) in the same hold of the lock that gives its host slot back. Nothing
writes into a slot while a block that owns it is published ready, so a reader that saw a way's
number even and the same again after copying the slot — with a full fence between the copy
and the second read, and the daemon still connected — copied bytes that were the block's
throughout. Sound where stores are seen in order and loads are not reordered with loads (x86-64,
whose locked instructions are full fences); elsewhere clients lease every read.
"""

from __future__ import annotations

import mmap
import os
import platform
import struct
import threading
import time

import numpy as np

from .config import ALIGN

MAGIC = b"TIERDIDX"
VERSION = 2
WAYS = 4
HOST, DISK, LOADING = 1, 2, 4
_HEADER = struct.Struct("<8sIIQB")
_DISK_OK_AT = 8 + 4 + 4 + 8
_MISSES_FINAL_AT = _DISK_OK_AT + 1   # 0: a miss here may be a hit elsewhere (a remote tier): ask
_BEAT_AT = 32
_EVICTED_AT = 40
BEAT_S = 0.02          # the daemon's heartbeat period
FRESH_S = 0.1          # a table whose heartbeat is older is not trusted
_ZERO_TAG = bytes(16)
# Reads without a lease need a machine that keeps loads in order and stores in order (x86-64);
# elsewhere every read is leased.
LEASE_FREE_READS = platform.machine().lower() in ("x86_64", "amd64")
_fence = threading.Lock()    # acquiring it is a locked instruction: a full memory fence
_QQ = struct.Struct("<QQ")
_WHERE = ("", "host", "disk", "host+disk")     # `where`'s answer for the state bits HOST | DISK
# Lookups of at most this many keys read the table with plain integer reads: numpy's fixed cost
# per call (a dozen calls, each slow when cold after an engine's forward pass) is most of a
# few-key lookup (~400 us cold against ~40 us).
SMALL_KEYS = 16


def plan_buckets(capacity_bytes: int, typical_block_bytes: int = 256 << 10) -> int:
    """Buckets for a store of `capacity_bytes` (all tiers): room for twice the blocks of a
    typical size, a power of two between 1 Ki and 1 Mi buckets (4 Mi ways, 68 MiB). Blocks that
    find no room are not in the table; lookups of them are asked of the daemon."""
    want = max(1, 2 * capacity_bytes // typical_block_bytes // WAYS)
    n = 1024
    while n < want and n < (1 << 20):
        n *= 2
    return n


def _sizes(num_buckets: int) -> tuple[int, int, int, int, int, int]:
    """(tags, states, overflow, offsets, seqs, total): the table's parts' offsets and size."""
    tags_at = ALIGN
    states_at = tags_at + num_buckets * WAYS * 16
    overflow_at = states_at + num_buckets * WAYS
    offs_at = (overflow_at + num_buckets + 7) // 8 * 8
    seqs_at = offs_at + num_buckets * WAYS * 8
    total = (seqs_at + num_buckets * WAYS * 8 + ALIGN - 1) // ALIGN * ALIGN
    return tags_at, states_at, overflow_at, offs_at, seqs_at, total


class SharedIndex:
    """The table, as the daemon writes it (`create`) or a client reads it (`open`)."""

    def __init__(self, mm: mmap.mmap, num_buckets: int, path: str | None, owner: bool):
        self._mm = mm
        self.num_buckets = num_buckets
        self.path = path
        self._owner = owner
        tags_at, states_at, overflow_at, offs_at, seqs_at, total = _sizes(num_buckets)
        self.nbytes = total
        buf = np.frombuffer(mm, dtype=np.uint8)
        self._hdr = buf[:ALIGN]
        self.tags = buf[tags_at:states_at].view(np.uint64).reshape(num_buckets, WAYS, 2)
        self.states = buf[states_at:overflow_at].reshape(num_buckets, WAYS)
        self.overflow = buf[overflow_at:overflow_at + num_buckets]
        self.offsets = buf[offs_at:seqs_at].view(np.int64)            # flat: bucket * WAYS + way
        self.seqs = buf[seqs_at:seqs_at + num_buckets * WAYS * 8].view(np.uint64)
        self._mask = num_buckets - 1
        self._beat = buf[_BEAT_AT:_BEAT_AT + 8].view(np.uint64)
        # The writer works on plain memoryviews (a Python int index is ~20x cheaper than numpy's).
        mv = memoryview(mm)
        self._tags_mv = mv[tags_at:states_at]
        self._states_mv = mv[states_at:overflow_at]
        self._over_mv = mv[overflow_at:overflow_at + num_buckets]
        self._raw_mv = (mv[offs_at:seqs_at], mv[seqs_at:seqs_at + num_buckets * WAYS * 8])
        self._offs_mv = self._raw_mv[0].cast("q")
        self._seqs_mv = self._raw_mv[1].cast("Q")
        self._hdr_mv = mv[:ALIGN]
        self._beat_mv = mv[_BEAT_AT:_BEAT_AT + 8].cast("Q")
        self._evicted_mv = mv[_EVICTED_AT:_EVICTED_AT + 8].cast("Q")
        self._tags_q = self._tags_mv.cast("Q")          # way i's tag: [2i], [2i + 1]
        self._where: dict[int, int] = {}   # writer only: tag -> way index (bucket * WAYS + way)

    # -- daemon side ----------------------------------------------------------------------------
    @classmethod
    def create(cls, path: str, capacity_bytes: int, instance: int, mode: int = 0o660) -> "SharedIndex":
        num_buckets = plan_buckets(capacity_bytes)
        total = _sizes(num_buckets)[-1]
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        try:
            os.fchmod(fd, mode)
            os.ftruncate(fd, total)
            os.posix_fallocate(fd, 0, total)   # reserved like the arena: no SIGBUS later
            mm = mmap.mmap(fd, total, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(fd)
            os.unlink(path)
            raise
        os.close(fd)
        idx = cls(mm, num_buckets, path, owner=True)
        idx._hdr[:_HEADER.size] = np.frombuffer(_HEADER.pack(MAGIC, VERSION, num_buckets, instance, 1),
                                                dtype=np.uint8)
        idx.set_misses_final(True)
        return idx

    @staticmethod
    def tag(ns_id: bytes, key: bytes) -> bytes:
        return (int.from_bytes(ns_id, "little") ^ int.from_bytes(key, "little")).to_bytes(16, "little")

    def set(self, ns_id: bytes, key: bytes, state: int, offset: int = -1) -> None:
        """Publish a block's state (0: gone) and, with HOST, its host slot's offset. Called
        under the store lock only. Every rewrite of a way is bracketed by its sequence number
        (see the module's docstring)."""
        t = int.from_bytes(ns_id, "little") ^ int.from_bytes(key, "little")
        sm, seqs = self._states_mv, self._seqs_mv
        i = self._where.get(t)
        if i is not None:
            s = seqs[i]
            seqs[i] = s + 1                                   # being rewritten ...
            if state:
                self._offs_mv[i] = offset
                sm[i] = state
            else:
                sm[i] = 0                                     # invisible first ...
                self._tags_mv[i * 16:i * 16 + 16] = _ZERO_TAG  # ... then freed
                del self._where[t]
            seqs[i] = s + 2                                   # ... done
            return
        if not state:
            return
        b = t & self._mask
        if t == 0:
            self._over_mv[b] = 1
            return
        base = b * WAYS
        for i in range(base, base + WAYS):
            if sm[i] == 0:
                break
        else:
            self._over_mv[b] = 1                              # not in the table: readers ask the daemon
            return
        s = seqs[i]
        seqs[i] = s + 1
        self._tags_mv[i * 16:i * 16 + 16] = t.to_bytes(16, "little")   # the tag first ...
        self._offs_mv[i] = offset
        sm[i] = state                                                   # ... then visible
        seqs[i] = s + 2
        self._where[t] = i

    def beat(self) -> None:
        """The daemon's event loop is alive (called every BEAT_S)."""
        self._beat[0] = time.monotonic_ns()

    def fresh(self) -> bool:
        """The daemon beat within FRESH_S: its table is current."""
        return time.monotonic_ns() - self._beat_mv[0] < FRESH_S * 1e9

    def note_eviction(self) -> None:
        """(Store lock held.) The host tier evicted a block that was published ready: readers
        that copy without a daemon lease pin their blocks for a while (`evicted_within`)."""
        self._evicted_mv[0] = time.monotonic_ns()

    def evicted_within(self, seconds: float) -> bool:
        """Whether the host tier evicted a published block within the last `seconds` (inf:
        always true, 0: never)."""
        if seconds == float("inf"):
            return True
        at = self._evicted_mv[0]
        return at != 0 and time.monotonic_ns() - at < seconds * 1e9

    def set_misses_final(self, final: bool) -> None:
        self._hdr[_MISSES_FINAL_AT] = 1 if final else 0

    def set_disk_ok(self, ok: bool) -> None:
        self._hdr[_DISK_OK_AT] = 1 if ok else 0

    def close(self) -> None:
        self.tags = self.states = self.overflow = self._hdr = self._beat = None
        self.offsets = self.seqs = None
        for v in (self._beat_mv, self._evicted_mv, self._tags_q, self._tags_mv, self._states_mv, self._over_mv, self._offs_mv,
                  self._seqs_mv, self._hdr_mv, *self._raw_mv):
            v.release()
        try:
            self._mm.close()
        except BufferError:
            pass
        if self._owner and self.path:
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass

    # -- client side ----------------------------------------------------------------------------
    @classmethod
    def open(cls, path: str, instance: int) -> "SharedIndex | None":
        """Map a daemon's table read-only; None if it is not there or not that daemon's."""
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            return None
        try:
            size = os.fstat(fd).st_size
            if size < ALIGN:
                return None
            mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ)
        finally:
            os.close(fd)
        magic, version, num_buckets, inst, _ = _HEADER.unpack(mm[:_HEADER.size])
        if magic != MAGIC or version != VERSION or inst != instance or _sizes(num_buckets)[-1] > size:
            mm.close()
            return None
        return cls(mm, num_buckets, path, owner=False)

    def leading(self, ns_id: bytes, keys: list[bytes]) -> tuple[int, int] | None:
        """(leading keys present in any tier, leading keys in host RAM) — or None when the table
        cannot tell (a miss in a bucket that overflowed): then ask the daemon."""
        n = len(keys)
        if not n:
            return 0, 0
        if n <= SMALL_KEYS:
            return self._leading_small(ns_id, keys)
        state, buckets = self._lookup(ns_id, keys)
        if not self._hdr[_DISK_OK_AT]:
            state &= HOST | LOADING
        present = state != 0
        n_any = n if present.all() else int(np.argmin(present))
        if n_any < n and (self.overflow[buckets[n_any]] or not self._hdr[_MISSES_FINAL_AT]):
            return None
        host = (state & HOST) != 0
        n_host = n_any if host[:n_any].all() else int(np.argmin(host))
        return n_any, n_host

    def _leading_small(self, ns_id: bytes, keys: list[bytes]) -> tuple[int, int] | None:
        """`leading` for a few keys, in plain integer reads."""
        disk_ok, n_host = self._hdr_mv[_DISK_OK_AT], None
        for j, (_, _, b, first, state) in enumerate(self._match_small(ns_id, keys)):
            if not disk_ok:
                state &= HOST | LOADING
            if n_host is None and not state & HOST:
                n_host = j
            if not state:
                if self._over_mv[b] or not self._hdr_mv[_MISSES_FINAL_AT]:
                    return None
                return j, n_host
        return len(keys), len(keys) if n_host is None else n_host

    def _match_small(self, ns_id: bytes, keys: list[bytes]):
        """Per key: (its tag as two ints, its bucket, the first way holding the tag or -1, the
        state bits of the ways holding it)."""
        m0, m1 = _QQ.unpack(ns_id)
        tq, sm, mask = self._tags_q, self._states_mv, self._mask
        out = []
        for k in keys:
            k0, k1 = _QQ.unpack(k)
            t0, t1 = k0 ^ m0, k1 ^ m1
            b = t0 & mask
            first, state = -1, 0
            for i in range(b * WAYS, b * WAYS + WAYS):
                if tq[2 * i] == t0 and tq[2 * i + 1] == t1:
                    if first < 0:
                        first = i
                    state |= sm[i]
            out.append((t0, t1, b, first, state))
        return out

    def key_states(self, ns_id: bytes, keys: list[bytes]) -> np.ndarray:
        """Per key, its state bits in the table (HOST | DISK | LOADING; 0: not in the table,
        which may also mean a bucket that overflowed). A writer's hint: a key seen here is not
        written again; one not seen is written, and the daemon drops the copy if it has it."""
        if not keys:
            return np.zeros(0, dtype=np.uint8)
        if len(keys) <= SMALL_KEYS:
            return np.array([m[4] for m in self._match_small(ns_id, keys)], dtype=np.uint8)
        return self._lookup(ns_id, keys)[0]

    def where(self, ns_id: bytes, keys: list[bytes]) -> list[str] | None:
        """Per key, what the daemon's `where` answers ("host", "disk", "host+disk" or "": the
        copies a new reader would be served, this node's tiers only), from the state bits it
        publishes; None where the table cannot tell (a key not in it whose bucket overflowed)."""
        if not keys:
            return []
        if len(keys) <= SMALL_KEYS:
            out = []
            for _, _, b, first, state in self._match_small(ns_id, keys):
                if first < 0 and self._over_mv[b]:
                    return None
                out.append(_WHERE[state & (HOST | DISK)])
            return out
        state, buckets = self._lookup(ns_id, keys)
        if (self.overflow[buckets[state == 0]] != 0).any():
            return None   # (a free way holds no tag: state 0 is a key not in the table)
        return [_WHERE[s] for s in (state & (HOST | DISK)).tolist()]

    def host_run(self, ns_id: bytes, keys: list[bytes]):
        """A read without a lease, step 1 (see the module's docstring): for non-empty `keys`,
        (n, final, ways, seqs, offsets): the first n keys are ready in host RAM at `offsets`,
        their ways and sequence numbers to check with `unchanged` after copying; `final` when a
        lease would get no more than n either (n is all of them, or the next key is held in no
        tier, as far as a table with no overflow there and no remote tier behind it can tell).
        None when the table cannot serve even the first key. (`ways`, `seqs` and `offsets` are
        lists of ints.)"""
        n = len(keys)
        if n <= SMALL_KEYS:
            return self._host_run_small(ns_id, keys)
        tags, buckets, match = self._match(ns_id, keys)
        found = match.any(axis=1)
        ways = buckets * WAYS + match.argmax(axis=1)
        seqs = self.seqs[ways]                             # first, then what they guard
        again = self.tags.reshape(-1, 2)[ways]
        state = self.states.reshape(-1)[ways]
        offsets = self.offsets[ways]
        ok = (found & (again[:, 0] == tags[:, 0]) & (again[:, 1] == tags[:, 1])
              & ((state & HOST) != 0) & ((seqs & np.uint64(1)) == 0) & (offsets >= 0))
        m = n if ok.all() else int(np.argmin(ok))
        if m == 0:
            return None
        final = m == n or (not found[m] and not self.overflow[buckets[m]] and bool(self._hdr[_MISSES_FINAL_AT]))
        return m, final, ways[:m].tolist(), seqs[:m].tolist(), offsets[:m].tolist()

    def _host_run_small(self, ns_id: bytes, keys: list[bytes]):
        """`host_run` for a few keys, in plain integer reads (the same order: a way's sequence
        number first, then its tag again, its state and its slot)."""
        tq, sm, seqs_r, offs_r = self._tags_q, self._states_mv, self._seqs_mv, self._offs_mv
        ways, seqs, offsets = [], [], []
        found, b = False, 0
        for t0, t1, b, first, _ in self._match_small(ns_id, keys):
            found = first >= 0
            if not found:
                break
            seq = seqs_r[first]
            off = offs_r[first]
            if not (tq[2 * first] == t0 and tq[2 * first + 1] == t1 and sm[first] & HOST and not seq & 1
                    and off >= 0):
                break
            ways.append(first)
            seqs.append(seq)
            offsets.append(off)
        m = len(ways)
        if m == 0:
            return None
        final = m == len(keys) or (not found and not self._over_mv[b] and bool(self._hdr_mv[_MISSES_FINAL_AT]))
        return m, final, ways, seqs, offsets

    def unchanged(self, ways: list[int], seqs: list[int]) -> bool:
        """A read without a lease, step 2, after the copy: no way read has been rewritten since
        `host_run` (so the copied slots held those blocks throughout). Fenced first."""
        with _fence:
            pass
        seqs_r = self._seqs_mv
        return all(seqs_r[w] == s for w, s in zip(ways, seqs))

    def _lookup(self, ns_id: bytes, keys: list[bytes]) -> tuple[np.ndarray, np.ndarray]:
        """(per key its state bits, 0 where absent; per key its bucket) for non-empty `keys`."""
        _, buckets, match = self._match(ns_id, keys)
        return np.bitwise_or.reduce(np.where(match, self.states[buckets], 0), axis=1), buckets

    def _match(self, ns_id: bytes, keys: list[bytes]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(per key its tag as two u64, its bucket, which of the bucket's ways hold that tag)."""
        mask = np.frombuffer(ns_id, dtype=np.uint64)
        tags = np.frombuffer(b"".join(keys), dtype=np.uint64).reshape(len(keys), 2) ^ mask
        buckets = (tags[:, 0] & np.uint64(self._mask)).astype(np.intp)
        rows = self.tags[buckets]                          # (n, WAYS, 2)
        return tags, buckets, (rows[:, :, 0] == tags[:, 0:1]) & (rows[:, :, 1] == tags[:, 1:2])
