"""The slot header: how a block describes itself wherever it is stored outside RAM — a disk
slot and a remote value carry the same header (magic, format version, codec, namespace id, key,
parent key, payload and raw lengths, write sequence, slab generation, payload checksum, and the
header's own checksum) — and the block encoding both tiers share (a lossy or exact codec).

Pure functions over bytes: no I/O, no state. Format: docs/on-disk-format.md.
"""

from __future__ import annotations

import struct

import numpy as np
import xxhash

from .. import codec as _codec
from ..config import ALIGN
from ..errors import TierdError

FORMAT_VERSION = 1
PAGE = ALIGN
SLOT_MAGIC = b"TIERDSLT"
# slot header: magic, version, codec, dtype_bytes, pad, ns id, key, parent key (zeros: none),
# payload len, raw len, write sequence, slab generation, payload checksum (+ header checksum)
_SLOT = struct.Struct("<8sHBBI16s16s16sQQQQQ")
_CSUM = struct.Struct("<Q")


class CorruptBlockError(TierdError):
    """A slot failed verification (internal: the store drops and counts it)."""

    code = "corrupt"


def _csum(data) -> int:
    return xxhash.xxh3_64_intdigest(data)


# A block moved through a bounce buffer is copied and hashed a piece at a time: the hash reads
# each piece while the copy has just left it in the CPU's caches, so the block's bytes come
# from memory once instead of twice (a disk read or write of large blocks competes with the
# device's own transfers for memory bandwidth).
FUSE_PIECE = 256 << 10


def copy_hashed(dst: np.ndarray, src: np.ndarray, h=None) -> int:
    """dst[:] = src for (n,) uint8 arrays, and the checksum (`_csum`) of the bytes as they are
    in `dst`, each piece hashed right after it is copied (a disk read verifies what it will
    serve; a disk write records what it writes). With `h` (an `xxhash.xxh3_64` state), the
    bytes are added to it, for a block copied a part at a time, and its digest so far returned."""
    if h is None:
        h = xxhash.xxh3_64()
    for off in range(0, src.nbytes, FUSE_PIECE):
        b = dst[off:off + FUSE_PIECE]
        np.copyto(b, src[off:off + FUSE_PIECE])
        h.update(b)
    return h.intdigest()


def encode_block(codec_name: str, level: int, raw: np.ndarray, dtype_bytes: int, lossy: str,
                 kv_dtype: str) -> tuple[int, np.ndarray | bytes]:
    """(codec, payload) of a block for a tier that describes its contents (disk, remote): the
    namespace's lossy codec where it asked for one and the block takes it, else the tier's exact
    codec; stored raw when a codec would not make it smaller."""
    block_bytes = raw.size
    codec = _codec.choose_codec(codec_name, dtype_bytes, block_bytes, lossy)
    try:
        payload = _codec.encode(codec, raw, level, kv_dtype=kv_dtype, lossy=lossy) if codec else raw
    except ValueError:                 # NaN / infinity, or no whole groups: store it exactly
        codec = _codec.choose_codec(codec_name, dtype_bytes, block_bytes)
        payload = _codec.encode(codec, raw, level) if codec else raw
    if codec and len(payload) >= block_bytes:  # incompressible: store raw
        codec, payload = _codec.CODEC_NONE, raw
    return codec, payload


def pack_slot_header(codec: int, dtype_bytes: int, ns_id: bytes, key: bytes, parent: bytes,
                     payload_len: int, raw_len: int, seq: int, slab_gen: int,
                     payload_csum: int) -> bytes:
    body = _SLOT.pack(SLOT_MAGIC, FORMAT_VERSION, codec, dtype_bytes, 0, ns_id, key,
                      parent or b"\0" * 16, payload_len, raw_len, seq, slab_gen, payload_csum)
    return body + _CSUM.pack(_csum(body))


def unpack_slot_header(page) -> tuple | None:
    """Fields of a slot header, None for an empty slot; raises CorruptBlockError if damaged."""
    raw = bytes(page[:_SLOT.size + _CSUM.size])
    if len(raw) < _SLOT.size + _CSUM.size:
        return None
    if raw[:8] != SLOT_MAGIC:
        if raw[:8] == b"\0" * 8:
            return None
        raise CorruptBlockError("slot header magic is damaged")
    (csum,) = _CSUM.unpack_from(raw, _SLOT.size)
    if _csum(raw[:_SLOT.size]) != csum:
        raise CorruptBlockError("slot header checksum mismatch")
    fields = _SLOT.unpack_from(raw)
    if fields[1] != FORMAT_VERSION:
        raise CorruptBlockError(f"slot format version {fields[1]} is not {FORMAT_VERSION}")
    return fields
