"""Deterministic chained block keys: the one function that names a block, for the tiers and
for the engine's prefix cache alike.

    key_{-1} = H(root)                       root: the namespace identity (see Namespace.root_key)
    key_i    = H(key_{i-1} || token ids of block i as little-endian int32 || extra_i)
    H        = blake2b with a 16-byte digest

Only full blocks have keys. The encoding is unambiguous because the parent (16 bytes) and the
tokens (4 * block_tokens bytes) have fixed lengths; `extra` is what remains. Never Python's
`hash()`, never a random seed: the same input gives the same key in any process, on any host,
after any restart. tests/test_keys.py pins golden values; changing the format is a format
version change (FORMAT_VERSION below, also in the disk header).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from typing import Union

import numpy as np

from .errors import KeyFormatError

KEY_BYTES = 16
FORMAT_VERSION = 1
_ROOT_DOMAIN = b"tierd/key-root/v1\x00"

TokenIds = Union[Sequence[int], np.ndarray]
Extra = Union[bytes, None, Sequence[Union[bytes, None]]]


def _h(data: bytes) -> bytes:
    return hashlib.blake2b(data, digest_size=KEY_BYTES).digest()


def root_key(identity: bytes | str) -> bytes:
    """key_{-1}: the seed of every chain of one namespace (16 bytes)."""
    if isinstance(identity, str):
        identity = identity.encode()
    return _h(_ROOT_DOMAIN + bytes(identity))


def _tokens_le32(token_ids: TokenIds) -> np.ndarray:
    arr = np.asarray(token_ids)
    if arr.ndim != 1:
        raise KeyFormatError(f"token ids must be one-dimensional, got shape {arr.shape}")
    if arr.size and arr.dtype.kind not in "iu":
        raise KeyFormatError(f"token ids must be integers, got dtype {arr.dtype}")
    if arr.size and (int(arr.min()) < 0 or int(arr.max()) > 0x7FFFFFFF):
        raise KeyFormatError("token ids must lie in [0, 2**31 - 1]")
    return arr.astype("<i4", copy=False)


def next_key(parent: bytes, block_token_ids: TokenIds, extra: bytes | None = None) -> bytes:
    """The key of one full block given its parent key."""
    if len(parent) != KEY_BYTES:
        raise KeyFormatError(f"parent key must be {KEY_BYTES} bytes, got {len(parent)}")
    return _h(bytes(parent) + _tokens_le32(block_token_ids).tobytes() + (extra or b""))


def block_keys(
    root: bytes,
    token_ids: TokenIds,
    block_tokens: int,
    *,
    parent: bytes | None = None,
    extra: Extra = None,
) -> list[bytes]:
    """Keys of every full block of `token_ids`, chained from `parent` (default: `root`).

    `root` is the namespace's root key (`Namespace.root_key`), or any 16-byte seed.
    `parent` continues a chain: the key of the block just before `token_ids[0]`.
    `extra` is bytes for every block, or one entry (bytes or None) per full block — for
    whatever besides the tokens determines the KV (LoRA adapter, image hashes).
    A trailing partial block gets no key.
    """
    if len(root) != KEY_BYTES:
        raise KeyFormatError(f"root must be a {KEY_BYTES}-byte key, got {len(root)} bytes")
    if not isinstance(block_tokens, (int, np.integer)) or block_tokens <= 0:
        raise KeyFormatError(f"block_tokens must be a positive integer, got {block_tokens!r}")
    toks = _tokens_le32(token_ids)
    n_full = toks.size // block_tokens
    if extra is None or isinstance(extra, (bytes, bytearray, memoryview)):
        extras: Sequence[bytes | None] = [bytes(extra) if extra else None] * n_full
    else:
        extras = list(extra)
        if len(extras) < n_full:
            raise KeyFormatError(f"extra has {len(extras)} entries for {n_full} full blocks")
    raw = toks[: n_full * block_tokens].tobytes()
    stride = 4 * block_tokens
    key = bytes(parent) if parent is not None else bytes(root)
    if len(key) != KEY_BYTES:
        raise KeyFormatError(f"parent key must be {KEY_BYTES} bytes, got {len(key)}")
    keys = []
    for i in range(n_full):
        key = _h(key + raw[i * stride:(i + 1) * stride] + (extras[i] or b""))
        keys.append(key)
    return keys


def extend_keys(keys: list[bytes], root: bytes, token_ids: Sequence[int], block_tokens: int,
                n_blocks: int, extra: Callable[[int], bytes | None] | None = None) -> list[bytes]:
    """Extend `keys` (the keys of the first len(keys) full blocks of `token_ids`) in place to
    the first `n_blocks` full blocks, hashing only the new blocks. `extra(i)` gives block i's
    extra bytes (see `block_keys`). Returns `keys`."""
    have = len(keys)
    if n_blocks > have:
        ex = None if extra is None else [extra(i) for i in range(have, n_blocks)]
        keys.extend(block_keys(root, token_ids[have * block_tokens:n_blocks * block_tokens], block_tokens,
                               parent=keys[-1] if keys else None, extra=ex))
    return keys


_BYTES, _KEY_LEN = {bytes}, {KEY_BYTES}


def well_formed(keys: Sequence) -> bool:
    """Every key is a 16-byte `bytes` (C loops only: the hot path of every request)."""
    return not keys or (set(map(type, keys)) == _BYTES and set(map(len, keys)) == _KEY_LEN)


def checksums_ok(sums, n: int) -> bool:
    """Whether `sums` is a writer's list of block checksums for `n` blocks: one 64-bit value
    (xxh3-64 of the block's bytes) or -1 (none given) per block. Checked wherever such a list
    comes in (a daemon's request, an embedded commit or put), before anything is stored."""
    return isinstance(sums, (list, tuple)) and len(sums) == n and all(type(c) is int and -1 <= c < 1 << 64 for c in sums)


def check_keys(keys: Sequence[bytes]) -> list[bytes]:
    """Validate a list of keys (16 bytes each, none repeated) and return them as `bytes`."""
    if well_formed(keys):   # the common case, checked in C loops
        out = list(keys)
    else:
        out = []
        for k in keys:
            if not isinstance(k, (bytes, bytearray, memoryview)) or len(k) != KEY_BYTES:
                raise KeyFormatError(f"a key must be {KEY_BYTES} bytes, got {k!r:.60}")
            out.append(bytes(k))
    if len(set(out)) != len(out):
        seen = set()
        for i, k in enumerate(out):
            if k in seen:
                raise KeyFormatError(f"key {k.hex()} appears twice (again at position {i}); a prefix chain "
                                     "never repeats a key (each one hashes the one before), so a request "
                                     "may name each key once")
            seen.add(k)
    return out
