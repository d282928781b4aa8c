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


class BlockTransfer:
    def __init__(self, k_caches: Sequence[torch.Tensor], v_caches: Sequence[torch.Tensor], ratio: int):
        self.k, self.v, self.ratio = list(k_caches), list(v_caches), ratio
        self.device = self.k[0].device
        unit = self.k[0][0].numel() * self.k[0].element_size()
        self.block_bytes = 2 * len(self.k) * ratio * unit
        self.cuda = self.device.type == "cuda"
        self._registered: list[int] = []
        self._attached: set[int] = set()
        if self.cuda:
            self.d2h = torch.cuda.Stream(self.device)
            self.h2d = torch.cuda.Stream(self.device)

    # -- pinned host memory -----------------------------------------------------------------------
    def register_host(self, array: np.ndarray) -> bool:
        """Page-lock a host buffer (the shared arena) for async copies. False if CUDA refuses
        (copies then still work, synchronously)."""
        if not self.cuda:
            return False
        ptr, size = array.ctypes.data, array.nbytes
        rc = torch.cuda.cudart().cudaHostRegister(ptr, size, 0)
        ok = int(rc) == 0 if not isinstance(rc, tuple) else int(rc[0]) == 0
        if ok:
            self._registered.append(ptr)
        else:
            log.warning("cudaHostRegister of %d bytes failed (%s); host copies will not overlap", size, rc)
        return ok

    def attach(self, store) -> bool:
        """Page-lock `store`'s host arena (embedded or the daemon's, as mapped by the client) once,
        on CUDA only, so that copies to and from its slots are asynchronous. Done by store/load."""
        if not self.cuda or id(store) in self._attached:
            return False
        self._attached.add(id(store))
        array = getattr(store, "host_array", lambda: None)()
        return array is not None and self.register_host(array)

    def close(self) -> None:
        for ptr in self._registered:
            torch.cuda.cudart().cudaHostUnregister(ptr)
        self._registered.clear()

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
        self.attach(store)
        res = store.reserve(ns, keys, parent=parent)
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
        self.attach(store)
        lease = store.acquire(ns, keys)
        try:
            n = len(lease)
            if n:
                ev = self.scatter_from(block_ids[:n], lease.buffers[:n])
                if ev is not None:
                    ev.synchronize()         # the lease ends below; the copies must be done
            return n
        finally:
            lease.__exit__(None, None, None)
