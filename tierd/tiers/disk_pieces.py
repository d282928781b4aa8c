"""The disk tier's read pipeline, and large slots moved a piece at a time. Part of `DiskTier`
(tierd/tiers/disk.py); `write_many` and `read_many` (tierd/tiers/disk_io.py) hand them over.

A promotion of more than one read call: the I/O threads only read (READ_AHEAD x io_threads calls
queued at most), and the calling thread checks each call's blocks as it lands, in file order, so
the disk has reads in flight while blocks are checked and copied into their slots.

A block whose payload is over PIECE_BYTES is written and read in pieces of PIECE_BYTES (a
remainder under a piece joined to the last one), so that copying and checksumming one piece runs
while the disk moves the one before: a whole block at a time, the copy and checksum of a block
cannot overlap its own transfer, and with a few large blocks there is little else to overlap.
A write: a pack thread copies and hashes each payload piece into a bounce buffer and hands it to
the I/O threads; the header page, which holds the payload's checksum, is written last, by the
caller, once every payload piece is written: a slot whose payload write failed never gets a
header. A read: the first piece holds the header page,
checked first; each piece is copied into the block's buffer and hashed as it lands; the block is
served only once the whole payload's checksum matches (its buffer is a LOADING slot nobody reads
before). Nothing here returns while a read or write it started is under way.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Sequence

import numpy as np
import xxhash

from .. import codec as _codec
from ..config import align_up
from .base import BlockMeta
from .disk_files import DiskEntry
from .slot_header import PAGE, CorruptBlockError, copy_hashed, encode_block

# Larger payloads go a piece of this size at a time: a piece in a huge-page buffer (`io_buffer`)
# is one request of up to 4 MiB to the disk (benchmarks/tiers.py; docs/design-notes.md)
PIECE_BYTES = 2 << 20
# Read calls queued at most (in flight, or waiting for a thread), as a multiple of the I/O
# threads: when the reads in flight land together, the next ones start at once, and the disk is
# not left without requests while the calling thread checks what landed
READ_AHEAD = 2


def _cuts(nbytes: int) -> list[tuple[int, int]]:
    """(offset, bytes) of the pieces of `nbytes`: PIECE_BYTES each, a remainder under a piece
    joined to the last one (no small request at the end)."""
    starts = list(range(0, nbytes - PIECE_BYTES + 1, PIECE_BYTES)) or [0]
    return [(a, (starts[k + 1] if k + 1 < len(starts) else nbytes) - a) for k, a in enumerate(starts)]


def _wait_all(futures) -> None:
    concurrent.futures.wait([f for f in futures if f is not None])


class PieceIO:
    """Part of `DiskTier`: writes and reads of large slots a piece at a time (no store lock)."""

    @staticmethod
    def _in_pieces(slot_bytes: int) -> bool:
        """Whether a slot of `slot_bytes` (header page included) is moved a piece at a time."""
        return slot_bytes - PAGE > PIECE_BYTES

    # -- writes ---------------------------------------------------------------------------------
    def _pack_pieces(self, job: tuple[int, np.ndarray, BlockMeta], fd: int, off: int) -> tuple:
        """(Pack thread.) Encode one block, copy and hash its payload into bounce buffers a
        piece at a time, each handed to the I/O threads as soon as it is laid out, then lay
        its header page out. Returns (futures of the piece writes, header page, entry, error):
        the caller waits for the pieces and writes the header (`_finish_pieces`)."""
        slot, src, meta = job
        futs: list = []
        page = None
        try:
            codec, payload = encode_block(self.codec_name, self.zstd_level, src[:meta.block_bytes],
                                          meta.dtype_bytes, meta.lossy, meta.kv_dtype)
            if codec != _codec.CODEC_NONE:
                payload = np.frombuffer(payload, dtype=np.uint8)
            n = payload.nbytes
            h = xxhash.xxh3_64()
            for a, size in _cuts(align_up(n)):
                stg = self._bounce.take(size)
                try:
                    used = min(size, n - a)
                    copy_hashed(stg[:used], payload[a:a + used], h)
                    stg[used:size] = 0
                    futs.append(self.pool.submit(self._write_piece, fd, stg, size, off + PAGE + a))
                except BaseException:
                    self._bounce.give(stg)
                    raise
            page = self._spare.take(PAGE)
            entry = self._lay_header(job, page, codec, n, h.intdigest())
            return futs, page, entry, None
        except BaseException as ex:  # noqa: BLE001 - the block failed; its pieces are waited for
            if page is not None:
                self._spare.give(page)
            return futs, None, None, ex

    def _write_piece(self, fd: int, stg: np.ndarray, size: int, off: int) -> None:
        try:
            self._pwrite(fd, stg, size, off)
        finally:
            self._bounce.give(stg)

    def _finish_pieces(self, packed: tuple, fd: int, off: int):
        """Wait for a large slot's payload pieces, then write its header page: its entry, or
        the error that failed it."""
        futs, page, entry, error = packed
        try:
            for f in futs:
                try:
                    f.result()
                except Exception as ex:  # noqa: BLE001 - the first error fails the block
                    error = error or ex
            if error is None:
                try:
                    self._pwrite(fd, page, PAGE, off)   # the header last: its payload is written
                except Exception as ex:  # noqa: BLE001
                    error = ex
            return entry if error is None else error
        finally:
            _wait_all(futs)
            if page is not None:
                self._spare.give(page)

    # -- reads ----------------------------------------------------------------------------------
    def _read_pipelined(self, items: Sequence[tuple[DiskEntry, np.ndarray]], units: list,
                        errors: dict[int, BaseException], sums: list[int] | None) -> None:
        """Read `units` on the I/O threads, up to READ_AHEAD x io_threads queued, and check each
        here as it lands, in file order: a run of whole slots, (fd, offset, bytes, run), each
        block of it checked and copied into its buffer (`_check_slot`); or a piece of a large
        raw slot, (fd, offset, bytes, slot), the slot (index in `items`, fd, offset, bytes to
        read) checked a piece at a time (`_check_piece`). The I/O threads only read, so the disk has
        io_threads requests in flight while this thread checks and copies what came in. A
        failed read or check fails those blocks only."""
        futs: list = [None] * len(units)
        ahead = READ_AHEAD * self.io_threads
        state: dict[int, tuple] = {}            # large slot (index in `items`) -> (hash, checksum)
        failed: dict[int, BaseException] = {}   # large slots failed so far
        used = set()                            # units whose buffer was handed back here
        try:
            for j in range(min(ahead, len(units))):
                futs[j] = self.pool.submit(self._read_piece, *units[j][:3])
            for j, (_, p_off, size, what) in enumerate(units):
                if j + ahead < len(units):
                    futs[j + ahead] = self.pool.submit(self._read_piece, *units[j + ahead][:3])
                try:
                    stg, n = futs[j].result()
                except OSError as ex:
                    if isinstance(what, list):
                        for i, *_ in what:
                            errors[i] = ex
                    else:
                        failed.setdefault(what[0], ex)
                    continue
                used.add(j)
                try:
                    if isinstance(what, list):
                        self._check_run(items, what, p_off, stg, n, errors, sums)
                    else:
                        self._check_large(items, what, p_off, size, stg, n, state, failed, sums)
                finally:
                    self._spare.give(stg)
        finally:
            _wait_all(futs)
            for j, f in enumerate(futs):    # buffers of units read but not looked at (an error)
                if f is not None and j not in used and f.exception() is None:
                    self._spare.give(f.result()[0])
        errors.update(failed)

    def _check_run(self, items, run: list, start: int, stg: np.ndarray, n: int,
                   errors: dict[int, BaseException], sums: list[int] | None) -> None:
        """Check each block of a run read into `stg` (`n` bytes from file offset `start`)."""
        for i, _, off, _ in run:
            e, dst = items[i]
            rel = off - start
            try:
                csum = self._check_slot(e, stg[rel:], max(0, n - rel), dst)
            except (CorruptBlockError, OSError) as ex:
                errors[i] = ex
            else:
                if sums is not None:
                    sums[i] = csum

    def _check_large(self, items, slot: tuple, p_off: int, size: int, stg: np.ndarray, n: int,
                     state: dict, failed: dict, sums: list[int] | None) -> None:
        """Check one piece of a large raw slot; at its last piece, the whole payload's checksum."""
        i, _, off, want = slot
        if i in failed:
            return
        try:
            state[i] = self._check_piece(items[i], off, p_off, size, stg, n, state.get(i))
            if p_off + size == off + want:          # the slot's last piece
                h, pcsum = state[i]
                if h.intdigest() != pcsum:
                    raise CorruptBlockError("payload checksum mismatch")
                if sums is not None:
                    sums[i] = pcsum
        except (CorruptBlockError, OSError) as ex:
            failed[i] = ex

    def _large_pieces(self, slot: tuple) -> list[tuple]:
        """A large slot (index, fd, offset, bytes to read) as read units (fd, offset, bytes,
        slot), the first holding the header page."""
        _, fd, off, want = slot
        return [(fd, off + a, size, slot) for a, size in _cuts(want)]

    def _read_piece(self, fd: int, off: int, size: int) -> tuple[np.ndarray, int]:
        stg = self._spare.take(size)
        try:
            return stg, self._pread(fd, stg, size, off)
        except BaseException:
            self._spare.give(stg)
            raise

    def _check_piece(self, item: tuple[DiskEntry, np.ndarray], off: int, p_off: int, size: int,
                     stg: np.ndarray, n: int, state):
        """Check one piece (file offset `p_off`, `n` of its `size` bytes read into `stg`) of the
        slot at `off`: the header where it holds it, then its part of the payload copied into
        the block's buffer and added to the hash. Returns (hash state, payload checksum)."""
        e, dst = item
        end = off + PAGE + e.payload_len              # what must be readable
        if p_off + n < min(p_off + size, end):
            raise CorruptBlockError(f"slot truncated ({p_off + n - off} of {PAGE + align_up(e.payload_len)} "
                                    f"bytes readable)")
        if p_off == off:
            state = (xxhash.xxh3_64(), self._check_header(e, stg[:PAGE]))
        a, b = max(p_off, off + PAGE), min(p_off + size, end)
        if a < b:
            copy_hashed(dst[a - off - PAGE:b - off - PAGE], stg[a - p_off:b - p_off], state[0])
        return state
