"""Block transfers between an engine's per-layer paged caches and tier slots in the host arena.

`BlockTransfer.store(store, ns, keys, block_ids)` reserves slots, gathers the engine blocks into
them and commits; `load(store, ns, keys, block_ids)` acquires, scatters and releases. On a CUDA
device a store gathers every block of every layer into a device staging buffer in one kernel
launch, copies it to the (pinned, registered) host slots on a dedicated stream and waits on a
CUDA event before committing; a load copies the slots to staging on another stream, scatters in
one launch, and the engine's compute stream waits on the load's event, so attention never reads a
block before it has arrived. On CPU the same steps run with memcpy (the kernels' references).

Engine caches: lists of K and V tensors (num_blocks, block_size, kv_heads, head_dim), contiguous;
`block_ids` (n, ratio): the engine blocks of each tier block, -1 for a part not to copy.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Sequence

import numpy as np
import torch

from . import gather_blocks, scatter_blocks

log = logging.getLogger("tierd.kernels")


def host_tensor(buf) -> torch.Tensor:
    """A flat uint8 CPU tensor over a host buffer (a slot or lease view), without a copy. Lease
    views are read-only; torch warns about that, and callers only read them."""
    arr = np.asarray(buf).reshape(-1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(arr)


class CudaHostPinning:
    """Page-locking through the CUDA runtime (cudaHostRegister / cudaHostUnregister)."""

    def register(self, ptr: int, size: int) -> bool:
        rc = torch.cuda.cudart().cudaHostRegister(ptr, size, 0)
        ok = int(rc) == 0 if not isinstance(rc, tuple) else int(rc[0]) == 0
        if not ok:
            log.warning("cudaHostRegister of %d bytes failed (%s); host copies will not overlap", size, rc)
        return ok

    def unregister(self, ptr: int) -> None:
        torch.cuda.cudart().cudaHostUnregister(ptr)


class BlockTransfer:
    def __init__(self, k_caches: Sequence[torch.Tensor], v_caches: Sequence[torch.Tensor], ratio: int,
                 *, pinning=None):
        self.k, self.v, self.ratio = list(k_caches), list(v_caches), ratio
        self.device = self.k[0].device
        unit = self.k[0][0].numel() * self.k[0].element_size()
        self.block_bytes = 2 * len(self.k) * ratio * unit
        self.cuda = self.device.type == "cuda"
        # who page-locks host memory: the CUDA runtime on a CUDA device, nobody on CPU (a test
        # may pass a stand-in to watch what would be pinned)
        self.pinning = pinning if pinning is not None else (CudaHostPinning() if self.cuda else None)
        self._pinned: dict[int, int] = {}              # registered host ranges: ptr -> size
        self._mapping: dict[int, tuple[int, int, int]] = {}  # id(store) -> arena range, generation
        if self.cuda:
            self.d2h = torch.cuda.Stream(self.device)
            self.h2d = torch.cuda.Stream(self.device)

    # -- pinned host memory -----------------------------------------------------------------------
    def register_host(self, array: np.ndarray) -> bool:
        """Page-lock a host buffer (the shared arena) for async copies. False if it cannot be
        (copies then still work, synchronously)."""
        if self.pinning is None:
            return False
        ptr, size = array.ctypes.data, array.nbytes
        if self._pinned.get(ptr) == size:
            return True
        ok = self.pinning.register(ptr, size)
        if ok:
            self._pinned[ptr] = size
        return ok

    def attach(self, store) -> bool:
        """Page-lock `store`'s host arena (embedded, or the daemon's as the client maps it) once
        per mapping, so that copies to and from its slots are asynchronous. A client re-maps the
        arena after a daemon restart: the old range is unregistered (its pages are gone) and the
        new one registered. Done by store/load. Returns whether the current arena is pinned."""
        if self.pinning is None:
            return False
        array = getattr(store, "host_array", lambda: None)()
        if array is None:
            return False
        # a mapping is its range and its generation: a re-mapped arena may come back at the
        # same address with other pages behind it
        now = (array.ctypes.data, array.nbytes, getattr(store, "arena_generation", 0))
        old = self._mapping.get(id(store))
        if old == now:
            return self._pinned.get(now[0]) == now[1]
        if old is not None and self._pinned.get(old[0]) == old[1] and \
                old[:2] not in (m[:2] for k, m in self._mapping.items() if k != id(store)):
            self.pinning.unregister(old[0])
            del self._pinned[old[0]]
        self._mapping[id(store)] = now
        return self.register_host(array)

    def close(self) -> None:
        for ptr in list(self._pinned):
            self.pinning.unregister(ptr)
        self._pinned.clear()
        self._mapping.clear()

    # -- the two directions -----------------------------------------------------------------------
    def gather_into(self, block_ids: torch.Tensor, buffers: Sequence[np.ndarray]) -> None:
        """Copy engine blocks into host buffers (one per tier block); returns when they are there."""
        host = [host_tensor(b) for b in buffers]
        if not self.cuda:
            gather_blocks(self.k, self.v, block_ids, host)
            return
        staging = torch.empty((len(buffers), self.block_bytes), dtype=torch.uint8, device=self.device)
        self.d2h.wait_stream(torch.cuda.current_stream(self.device))   # the forward wrote the blocks
        with torch.cuda.stream(self.d2h):
            gather_blocks(self.k, self.v, block_ids, list(staging))
            for i, h in enumerate(host):
                h.copy_(staging[i], non_blocking=True)
            done = torch.cuda.Event()
            done.record(self.d2h)
        staging.record_stream(self.d2h)
        done.synchronize()   # the slots are committed next: the bytes must be in them

    def scatter_from(self, block_ids: torch.Tensor, buffers: Sequence[np.ndarray]) -> torch.cuda.Event | None:
        """Copy host buffers into engine blocks. On CUDA returns the event the compute stream
        already waits on (the buffers may be released once it has fired: `event.synchronize()`)."""
        host = [host_tensor(b) for b in buffers]
        if not self.cuda:
            scatter_blocks(self.k, self.v, block_ids, host)
            return None
        staging = torch.empty((len(buffers), self.block_bytes), dtype=torch.uint8, device=self.device)
        # the staging memory was allocated on the compute stream, and the engine blocks the
        # scatter writes may still be read or written by work queued there: wait for it first
        self.h2d.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.h2d):
            for i, h in enumerate(host):
                staging[i].copy_(h, non_blocking=True)
            scatter_blocks(self.k, self.v, block_ids, list(staging))
            done = torch.cuda.Event()
            done.record(self.h2d)
        staging.record_stream(self.h2d)
        torch.cuda.current_stream(self.device).wait_event(done)
        return done

    # -- with a Store -------------------------------------------------------------------------------
    def store(self, store, ns, keys: Sequence[bytes], block_ids: torch.Tensor, *, parent: bytes | None = None) -> int:
        """Reserve, gather, commit. Returns the number of blocks newly stored."""
        res = store.reserve(ns, keys, parent=parent)
        self.attach(store)           # after the reserve: a reconnect there re-maps the arena
        try:
            todo = [i for i, s in enumerate(res.status) if s == "reserved"]
            if todo:
                self.gather_into(block_ids[todo], [res.buffers[i] for i in todo])
        except BaseException:
            store.abort(res)
            raise
        store.commit(res)
        return len(todo)

    def load(self, store, ns, keys: Sequence[bytes], block_ids: torch.Tensor) -> int:
        """Acquire the leading present blocks, scatter them, release. Returns how many."""
        lease = store.acquire(ns, keys)
        try:
            self.attach(store)       # after the acquire: a reconnect there re-maps the arena
            n = len(lease)
            if n:
                ev = self.scatter_from(block_ids[:n], lease.buffers[:n])
                if ev is not None:
                    ev.synchronize()         # the lease ends below; the copies must be done
            return n
        finally:
            lease.__exit__(None, None, None)
