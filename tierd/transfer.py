"""Moving block bytes between callers' buffers and tier slots.

On CPU hosts a transfer is a memcpy (numpy's copy releases the GIL, so copies of different
blocks run in parallel with the store's bookkeeping). This module owns the conversion of
whatever a caller hands us (bytes, numpy arrays, CPU torch tensors) into a flat uint8 view
and the checks that it matches the namespace; it never allocates slots.
"""

from __future__ import annotations

import numpy as np

from .errors import BlockError
from .tiers.slot_header import copy_hashed

# dtype names (numpy's and torch's str()) that are acceptable raw-byte carriers for any block.
_RAW_DTYPES = {"uint8", "int8", "torch.uint8", "torch.int8"}
_NP_DTYPES = {"float16": np.dtype(np.float16), "float32": np.dtype(np.float32)}


def _dtype_name(obj) -> str | None:
    dt = getattr(obj, "dtype", None)
    return None if dt is None else str(dt)


def as_u8(block, block_bytes: int, kv_dtype: str) -> np.ndarray:
    """A flat (block_bytes,) uint8 view of `block` (no copy when it is contiguous).

    Raises BlockError when the size is not `block_bytes` or the element type is neither the
    namespace's KV dtype nor raw bytes.
    """
    if isinstance(block, np.ndarray) and block.flags.c_contiguous and (
            block.dtype.itemsize == 1 or block.dtype == _NP_DTYPES.get(kv_dtype)):
        arr = block.reshape(-1).view(np.uint8)  # fast path: no dtype-name formatting
        if arr.nbytes != block_bytes:
            raise BlockError(f"block is {arr.nbytes} bytes; this namespace's blocks are {block_bytes} bytes")
        return arr
    dt = _dtype_name(block)
    if dt is not None and dt not in _RAW_DTYPES and dt.removeprefix("torch.") != kv_dtype:
        raise BlockError(f"block dtype {dt} does not match the namespace KV dtype {kv_dtype}")
    if type(block).__module__.startswith("torch"):
        if block.device.type != "cpu":
            raise BlockError(f"block is on {block.device}; the CPU path takes host tensors")
        t = block.detach().contiguous().reshape(-1)
        arr = t.view(__import__("torch").uint8).numpy()
    elif isinstance(block, np.ndarray):
        arr = np.ascontiguousarray(block).reshape(-1).view(np.uint8)
    else:
        try:
            arr = np.frombuffer(memoryview(block).cast("B"), dtype=np.uint8)
        except TypeError:
            raise BlockError(f"a block must be bytes-like, a numpy array or a CPU tensor, "
                             f"not {type(block).__name__}") from None
    if arr.nbytes != block_bytes:
        raise BlockError(f"block is {arr.nbytes} bytes; this namespace's blocks are {block_bytes} bytes")
    return arr


def address(a: np.ndarray) -> int:
    """The address of an array's first byte. (`a.ctypes.data` makes a helper object in Python
    code on every use: on a host hit's path, with the caches cold after a forward, its two
    slots' addresses took 80-110 µs that way.)"""
    return a.__array_interface__["data"][0]


def copy_block(dst: np.ndarray, src: np.ndarray) -> None:
    """dst[:] = src for (n,) uint8 arrays."""
    np.copyto(dst, src, casting="no")


def fill_reservation(store, res, views: list[np.ndarray], *, hashed: bool = False) -> None:
    """Copy `views[i]` into each reserved buffer of `res`; on any failure abort `res` (the
    slots go back) and re-raise. With `hashed`, each block is checksummed as it is copied
    (`res.checksums`, -1 where nothing was copied): a store that records its blocks for restarts
    then need not read them again. Shared by TieredStore.put and Client.put."""
    try:
        if not hashed:
            for dst, src in zip(res.buffers, views):
                if dst is not None:
                    copy_block(dst, src)
            return
        res.checksums = [copy_hashed(dst, src) if dst is not None else -1
                         for dst, src in zip(res.buffers, views)]
    except BaseException:
        store.abort(res)
        raise


def copy_out(lease, dsts: list[np.ndarray] | None, out) -> list:
    """What `get` returns from a lease: new arrays, or the caller's `out` buffers filled."""
    if dsts is None:
        return [np.array(v, copy=True) for v in lease.buffers]
    for dst, src in zip(dsts, lease.buffers):
        copy_block(dst, src)
    return list(out[:len(lease)])
