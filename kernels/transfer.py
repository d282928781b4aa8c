"""Block transfers between an engine's paged caches and tier slots in the host arena (or the
HBM tier), on their own CUDA streams.

`BlockTransfer(k_caches, v_caches, ratio)`:

- `save_async(block_ids, buffers)`: on a dedicated stream that first waits for the compute
  stream (the forward wrote the blocks), gather every layer of the blocks into device staging
  in one launch and copy it into the (page-locked) host slots; the compute stream waits for the
  gather only (later work may reuse the blocks once they are gathered), not for the host copy;
  returns the CUDA event after which the slots hold the bytes: commit only after it.
- `load_layers(block_ids, buffers, device_buffers=, layered=)`: on a load stream that first
  waits for the compute stream (its work may still read or write the blocks), copy the slots
  up and scatter them; with `layered`, layer by layer with one event each, so the compute
  stream waits for layer i only (`job.wait_layer(i)`) and layer i + 1 loads while layer i
  computes. Tier blocks held in device memory (`device_buffers`, the HBM tier's leased copies on
  the engine's device) are scattered device-to-device, with no host copy. The leased buffers
  may be released once `job.synchronize()` has returned.
- `store(store, ns, keys, block_ids)` / `load(store, ns, keys, block_ids)`: the same with a Store
  (reserve, gather, commit / acquire, scatter, release).

Host memory is page-locked by `attach(store)` (the arena) in chunks of at most
`pinning.PIN_CHUNK_BYTES`, on a background thread (kernels/pinning.py): attach returns at once,
and a tier block in a chunk not (yet) registered is copied up through a staging buffer, never
read in place. `stats` counts what was pinned or failed and which path each load's blocks took.

On CPU the same calls copy at once (the kernels' references) and return no events. The stream
work goes through a `streams` object (`CudaStreams` on a CUDA device); tests give a CPU stand-in
that runs queued work only when something waits for it, so a missing wait shows as missing
bytes.

Engine caches: lists of K and V views (num_blocks, block_size, kv_heads, head_dim) with
head_dim contiguous (contiguous per layer, or views of one tensor in another layout);
`block_ids` (n, ratio): the engine blocks of each tier block, -1 for a part not to copy (a load
leaves that part of the engine's block as it is; a save writes zeros there, so a slot never
keeps another block's bytes).

Layer groups (an engine with several KV cache groups, e.g. vLLM's hybrid manager: sliding-window
and full-attention layers, each group with block ids of its own from one pool, layers of
different groups aliasing the same memory): `BlockTransfer(..., layer_groups=[g0, g1, ...])`
names each layer's group, and `block_ids` is then (n, groups, ratio): layer l is copied through
`block_ids[:, layer_groups[l]]`.

Latent caches (MLA: one row of kv_lora_rank + rope dims per token, the same on every rank):
`BlockTransfer(latents, None, ratio)`, each view (num_blocks, block_size, 1, latent); a tier
block is then [layers, 1, block_tokens, 1, latent] (a namespace with `planes=1`).
"""

from __future__ import annotations

import logging
import threading
import warnings
from collections.abc import Sequence

import numpy as np
import torch

from . import gather_blocks, native, ops, reference, scatter_blocks
from . import pinning as host_pinning
from .loader import available
from .pinning import _PINS, CudaHostPinning, HostPins  # noqa: F401 -- _PINS: the process's pins, for tests

log = logging.getLogger("tierd.kernels")


def host_tensor(buf) -> torch.Tensor:
    """A flat uint8 CPU tensor over a host buffer (a slot or lease view), without a copy. Lease
    views are read-only; torch warns about that, and callers only read them."""
    arr = np.asarray(buf).reshape(-1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(arr)


class CudaStreams:
    """What a transfer asks of a device: streams, work queued on them, events. Work queued with
    `run` allocates its device memory on that stream, so freeing it needs no record_stream."""

    def __init__(self, device: torch.device):
        self.device = device

    def stream(self):
        return torch.cuda.Stream(self.device)

    def current(self):
        return torch.cuda.current_stream(self.device)

    def run(self, stream, fn) -> None:
        with torch.cuda.stream(stream):
            fn()

    def record(self, stream):
        ev = torch.cuda.Event()
        ev.record(stream)
        return ev

    def timer(self, stream):
        """An event that times: a load's device time runs from one to the next."""
        ev = torch.cuda.Event(enable_timing=True)
        ev.record(stream)
        return ev

    def wait(self, stream, event) -> None:
        stream.wait_event(event)

    def synchronize(self, event) -> None:
        event.synchronize()


class LoadJob:
    """Tier blocks being copied into the engine's caches: `wait_layer(i)` makes the compute
    stream wait for layer i; `wait_all()` for every layer; `synchronize()` waits on the host
    until every copy has run (then the leased buffers may go). On CPU everything is already done."""

    def __init__(self, streams=None, events: Sequence | None = None, layered: bool = False,
                 device_blocks: int = 0, timers: tuple | None = None):
        self.streams, self.events, self.layered = streams, list(events or ()), layered
        self.device_blocks = device_blocks     # tier blocks copied device-to-device (HBM tier)
        self.timers = timers                   # (start, end) timing events on the load stream

    def device_seconds(self) -> float | None:
        """The load's time on the device, from its first copy or launch to its last (after
        `synchronize`); None where it was not timed (the CPU, a stand-in)."""
        if not self.timers:
            return None
        return self.timers[0].elapsed_time(self.timers[1]) / 1e3

    def wait_layer(self, layer: int) -> None:
        if self.events:
            self.streams.wait(self.streams.current(), self.events[layer if self.layered else -1])

    def wait_all(self) -> None:
        if self.events:
            self.streams.wait(self.streams.current(), self.events[-1])

    def synchronize(self) -> None:
        if self.events:
            self.streams.synchronize(self.events[-1])


class BlockTransfer:
    def __init__(self, k_caches: Sequence[torch.Tensor], v_caches: Sequence[torch.Tensor] | None, ratio: int,
                 *, pinning=None, streams=None, layer_groups: Sequence[int] | None = None,
                 direct: bool | None = None, launcher=None, stats: dict | None = None,
                 pin_chunk_bytes: int | None = None):
        # v_caches None: latent caches (MLA's: a row per token), one plane per layer in a tier block
        self.k, self.ratio = list(k_caches), ratio
        self.v = None if v_caches is None else list(v_caches)
        self.planes = 1 if self.v is None else 2
        if layer_groups is not None:
            layer_groups = [int(g) for g in layer_groups]
            if len(layer_groups) != len(self.k) or min(layer_groups) < 0:
                raise ValueError(f"layer_groups names {len(layer_groups)} layers' groups for {len(self.k)} layers")
            if len(set(layer_groups)) == 1 and layer_groups[0] == 0:
                layer_groups = None      # one group: (n, 1, ratio) ids are taken as (n, ratio)
        self.layer_groups = layer_groups
        self.device = self.k[0].device
        k0 = self.k[0]
        unit = k0[0].numel() * k0.element_size()
        self.layers = len(self.k)
        self.layer_bytes = self.planes * ratio * unit   # one layer's K and V (or latent) in a tier block
        self.block_bytes = self.layers * self.layer_bytes
        self.cuda = self.device.type == "cuda"
        # who page-locks host memory: the CUDA runtime on a CUDA device, nobody on CPU (a test
        # may pass a stand-in to watch what would be pinned)
        self.pinning = pinning if pinning is not None else (CudaHostPinning() if self.cuda else None)
        self._pin_lock = threading.Lock()              # loads and saves attach from several threads
        # facts of this transfer for the connector's stats (pass its dict: they show there too):
        # the arena's page-locking (host_pinning.STAT_KEYS), and the host tier blocks each load read
        # in place (load_direct_blocks) or copied up through a staging buffer (load_staged_blocks)
        self.stats = stats if stats is not None else {}
        for k in ("load_direct_blocks", "load_staged_blocks"):
            self.stats.setdefault(k, 0)
        # the host ranges page-locked: chunk by chunk (<= pin_chunk_bytes), in the background
        self._pins = HostPins(self.pinning, self._pin_lock, self.drain, self.stats,
                              host_pinning.PIN_CHUNK_BYTES if pin_chunk_bytes is None else pin_chunk_bytes,
                              on_thread=(lambda: torch.cuda.set_device(self.device)) if self.cuda else None)
        # streams: CUDA's on a CUDA device; none on CPU (copies run at once), or a test's stand-in
        self.streams = streams if streams is not None else (CudaStreams(self.device) if self.cuda else None)
        # loads straight from the registered arena (no staging copy): None decides at the first
        # load on CUDA by a check on this device (`_direct_usable`); False never. Only where the
        # CUDA runtime itself registered the ranges (a stand-in's "pinned" memory is not mapped)
        real = streams is None and isinstance(self.pinning, CudaHostPinning)
        # launches of the copy kernel: CuPy's on CUDA; `launcher` (tests) runs them elsewhere, as
        # the kernel's semantics on CPU addresses, and then `direct` is taken as given
        self._launcher = launcher
        self._geometry_ok: bool | None = None
        self._direct = direct if (self.cuda and real or launcher is not None) and layer_groups is None else False
        self.direct_reason = "" if self._direct is None else ("on" if self._direct else "off")
        self._plan = None
        # the copy kernels (the C copy on CPU, CUDA's built by NVRTC) are built and checked now,
        # once per process and device, not in the first save or load (the first hit's TTFT)
        kernels = [op.use_kernel(self.device) for op in (gather_blocks, scatter_blocks)]
        if self.device.type == "cpu":
            # where the C copy passed, the caches' geometry is checked once here, not at every copy
            if all(kernels):
                try:
                    self._plan = native.CopyPlan(self.k, self.v, layer_groups=layer_groups)
                except ValueError:
                    pass     # caches the C copy does not take: the ops decide per call
        elif self.cuda and all(kernels):
            # the layers' cache addresses on the device: uploaded (with a wait) once now, not in a hit
            ops._cache_ptrs(self.device, tuple(c.data_ptr() for c in self.k))
            ops._cache_ptrs(self.device, tuple(c.data_ptr() for c in (self.v or self.k)))
        if self.streams is not None:
            self.d2h = self.streams.stream()
            self.h2d = self.streams.stream()

    # -- pinned host memory -----------------------------------------------------------------------
    def register_host(self, array: np.ndarray, tag=None) -> bool:
        """Page-lock a host buffer now, in the caller's thread (chunk by chunk). False if some of
        it cannot be (copies from that part are staged). `tag` names the mapping behind the range."""
        if self.pinning is None:
            return False
        with self._pin_lock:
            return self._pins.register_now(array.ctypes.data, array.nbytes, tag)

    def attach(self, store) -> bool:
        """Page-lock `store`'s host arena (embedded, or the daemon's as the client maps it) once
        per mapping, so that copies to and from its slots are asynchronous, and loads may read it
        in place. Returns at once: the arena is registered in chunks on a background thread
        (`wait_pinned`), and until a chunk is, loads from it are staged. A client re-maps the
        arena after a daemon restart: the old range's chunks are unregistered (after the copies
        queued from them; its pages are gone) and the new one's registered. Done by store/load.
        Returns False where there is nothing to page-lock, or a chunk of the arena failed to."""
        if self.pinning is None:
            return False
        array = getattr(store, "host_array", lambda: None)()
        if array is None:
            return False
        with self._pin_lock:
            # a mapping is its range and its generation: a re-mapped arena may come back at the
            # same address with other pages behind it
            ok = self._pins.attach(id(store), array.ctypes.data, array.nbytes,
                                   getattr(store, "arena_generation", 0))
        if self.cuda:
            self._decide_direct()    # when a connector starts, not at the first hit
        return ok

    def wait_pinned(self, timeout_s: float | None = None) -> bool:
        """Wait until every chunk of the attached ranges is registered or has failed (at most
        `timeout_s`); whether all of them are registered."""
        with self._pin_lock:
            return self._pins.wait(timeout_s)

    def pin_failures(self) -> list[tuple[int, int, int, str]]:
        """The chunks that failed to register: (range address, offset, size, error)."""
        with self._pin_lock:
            return list(self._pins.failures)

    def drain(self) -> None:
        """Wait on the host for every copy queued on this transfer's streams (after a failed
        load: nothing it queued lands later in blocks that are recomputed)."""
        if self.streams is not None:
            for stream in (self.d2h, self.h2d):
                self.streams.synchronize(self.streams.record(stream))

    def close(self) -> None:
        """Wait for the copies queued, unregister every chunk registered, and stop registering."""
        with self._pin_lock:
            self.drain()
            worker = self._pins.release_all()
        if worker is not None and worker is not threading.current_thread():
            worker.join()            # it unregisters the chunk it was registering, if any

    # -- block ids per layer group ----------------------------------------------------------------
    def _flat_ids(self, block_ids):
        """`block_ids` (a tensor, or on the CPU a numpy array: see `load_layers`) as the copies
        take them: (n, ratio) where the layers form one group."""
        if block_ids.ndim == 3 and self.layer_groups is None:
            if block_ids.shape[1] != 1:
                raise ValueError(f"block ids for {block_ids.shape[1]} groups, and the layers form one")
            return block_ids[:, 0]
        if self.layer_groups is not None and (block_ids.ndim != 3 or block_ids.shape[1] <= max(self.layer_groups)):
            raise ValueError(f"block ids of shape {tuple(block_ids.shape)} for layers in "
                             f"{max(self.layer_groups) + 1} groups: (n, groups, ratio) expected")
        return block_ids

    def _layer_ids(self, block_ids: torch.Tensor, layer: int) -> torch.Tensor:
        return block_ids if self.layer_groups is None else block_ids[:, self.layer_groups[layer]]

    def _copy(self, fn, block_ids: torch.Tensor, slots: Sequence[torch.Tensor], layers: Sequence[int] | None = None,
              whole: bool = True) -> None:
        """`fn` (gather_blocks / scatter_blocks) over `layers` (all by default): in one call when
        every layer uses the same ids, else layer by layer, each through its group's ids.
        `whole`: `slots` hold every layer (else the one layer of `layers`)."""
        if layers is None and self._planned(fn, block_ids, slots):
            return
        layers = range(self.layers) if layers is None else layers
        v = self.v
        if self.layer_groups is None:
            ks, vs = [self.k[i] for i in layers], None if v is None else [v[i] for i in layers]
            if len(ks) == self.layers or not whole:
                fn(ks, vs, block_ids, slots)
                return
        lb = self.layer_bytes
        for i in layers:
            part = [s[i * lb:(i + 1) * lb] for s in slots] if whole else slots
            fn([self.k[i]], None if v is None else [v[i]], self._layer_ids(block_ids, i), part)

    def _planned(self, fn, block_ids: torch.Tensor, slots: Sequence) -> bool:
        """Every layer's copy through the C copy's plan of these caches (CPU), where there is one
        and the op still uses the C copy; False if not done (the op decides, and raises what the
        reference does). `slots`: tensors, or the store's numpy buffers as they are."""
        plan = self._plan
        if plan is None or fn.status(self.device) != "kernel":
            return False
        try:
            plan.copy(block_ids, slots, to_slots=fn is gather_blocks)
            return True
        except ValueError:
            return False

    def _zero_skipped(self, block_ids: torch.Tensor, slots: Sequence[torch.Tensor]) -> None:
        """Zeros in the parts of `slots` (host, whole tier blocks) that no engine block fills."""
        if not bool((block_ids < 0).any()):
            return
        unit = self.layer_bytes // (self.planes * self.ratio)
        for i in range(self.layers):
            ids = self._layer_ids(block_ids, i)
            for t, r in (ids < 0).nonzero().tolist():
                for kv in range(self.planes):
                    lo = i * self.layer_bytes + (kv * self.ratio + r) * unit
                    slots[t][lo:lo + unit].zero_()

    # -- the two directions -----------------------------------------------------------------------
    def save_async(self, block_ids: torch.Tensor, buffers: Sequence[np.ndarray]):
        """Start copying engine blocks into host buffers (one per tier block). Returns the event
        after which they hold the bytes (None on CPU: they already do). The compute stream waits
        for the gather (a device-to-device copy) only, not for the copy to the host: work queued
        later may reuse the blocks."""
        block_ids = self._flat_ids(block_ids)
        sx = self.streams
        if sx is None and not bool((block_ids < 0).any()) and self._planned(gather_blocks, block_ids, buffers):
            return None
        host = [host_tensor(b) for b in buffers]
        if sx is None:
            self._zero_skipped(block_ids, host)
            self._copy(gather_blocks, block_ids, host)
            return None
        staging: list = []
        skipped = bool((block_ids < 0).any())

        def gather():
            alloc = torch.zeros if skipped else torch.empty      # skipped parts go down as zeros
            buf = alloc((len(host), self.block_bytes), dtype=torch.uint8, device=self.device)
            self._copy(gather_blocks, block_ids, list(buf))
            staging[:] = [buf]

        def copy_down():
            for i, h in enumerate(host):
                h.copy_(staging[0][i], non_blocking=True)
        with self._pin_lock:         # queued whole: an arena re-mapped meanwhile waits for it
            sx.wait(self.d2h, sx.record(sx.current()))  # the forward wrote the blocks
            sx.run(self.d2h, gather)
            sx.wait(sx.current(), sx.record(self.d2h))  # freed blocks may be reused by later work
            sx.run(self.d2h, copy_down)
            return sx.record(self.d2h)

    def gather_into(self, block_ids: torch.Tensor, buffers: Sequence[np.ndarray]) -> None:
        """Copy engine blocks into host buffers; returns when they are there."""
        done = self.save_async(block_ids, buffers)
        if done is not None:
            self.streams.synchronize(done)

    def load_layers(self, block_ids, buffers: Sequence, device_buffers: Sequence | None = None,
                    *, layered: bool = True) -> LoadJob:
        """Start copying tier blocks into engine blocks: `buffers[t]` a host buffer, or
        `device_buffers[t]` (when given and not None) a copy on the engine's device, copied
        device-to-device. With `layered`, one event per layer. The compute stream waits for
        nothing yet: `job.wait_layer(i)` / `job.wait_all()`. `block_ids` a tensor, or an int64
        numpy array (a CPU load: the C copy takes it as it is)."""
        n = len(buffers)
        block_ids = self._flat_ids(block_ids)
        if self.streams is None and not device_buffers and self._planned(scatter_blocks, block_ids, buffers):
            return LoadJob(device_blocks=0)
        if isinstance(block_ids, np.ndarray):
            block_ids = torch.from_numpy(block_ids)
        srcs: list = []
        up = []                                       # host tier blocks (to copy up, or read there)
        for t in range(n):
            d = device_buffers[t] if device_buffers is not None and t < len(device_buffers) else None
            if d is not None and d.device == self.device:
                srcs.append(d.reshape(-1))
            else:
                srcs.append(host_tensor(buffers[t]))
                up.append(t)
        sx = self.streams
        if sx is None:
            self._copy(scatter_blocks, block_ids, srcs)
            return LoadJob(device_blocks=n - len(up))
        if n and self._addressed(block_ids):
            return self._load_addressed(block_ids, srcs, up, layered)
        staging: list = []
        events = []
        host = set(up)

        def copy_up(lo: int, size: int):
            def work():
                # allocated on the load stream, used only there: freed after its last use
                buf = torch.empty((len(up), size), dtype=torch.uint8, device=self.device)
                for j, i in enumerate(up):
                    buf[j].copy_(srcs[i][lo:lo + size], non_blocking=True)
                staging[:] = [buf]
            return work

        def scatter(layer: int | None):
            def work():
                slots, j = [], 0
                lo, size = (0, self.block_bytes) if layer is None else (layer * self.layer_bytes, self.layer_bytes)
                for t, src in enumerate(srcs):
                    if t not in host:
                        slots.append(src[lo:lo + size])
                    else:
                        slots.append(staging[0][j])
                        j += 1
                self._copy(scatter_blocks, block_ids, slots, None if layer is None else [layer],
                           whole=layer is None)
            return work

        timer = getattr(sx, "timer", None)
        with self._pin_lock:         # queued whole: an arena re-mapped meanwhile waits for it
            self.stats["load_staged_blocks"] += len(up)
            sx.wait(self.h2d, sx.record(sx.current()))   # queued compute may still use these blocks
            start = timer(self.h2d) if timer else None
            if not layered:
                if up:
                    sx.run(self.h2d, copy_up(0, self.block_bytes))
                sx.run(self.h2d, scatter(None))
                events.append(sx.record(self.h2d))
            else:
                for layer in range(self.layers):
                    if up:
                        sx.run(self.h2d, copy_up(layer * self.layer_bytes, self.layer_bytes))
                    sx.run(self.h2d, scatter(layer))
                    events.append(sx.record(self.h2d))
            end = timer(self.h2d) if timer else None
        return LoadJob(sx, events, layered, device_blocks=n - len(up), timers=(start, end) if timer else None)

    # -- loads through one scatter over the tier blocks' addresses ------------------------------------
    def _addressed(self, block_ids: torch.Tensor) -> bool:
        """Whether this load goes through `ops.scatter_from_host`: the copy kernel in use on this
        device (or a test's launcher), caches in a layout it takes, one layer group, ids on the
        host (read without waiting for the device)."""
        if block_ids.device.type != "cpu" or self.layer_groups is not None:
            return False
        if self._launcher is None and not (self.cuda and scatter_blocks.use_kernel(self.device)):
            return False
        if self._geometry_ok is None:
            try:
                ops._geometry(self.k, self.v)
                self._geometry_ok = True
            except ValueError:
                self._geometry_ok = False
        return self._geometry_ok

    def _reads_host(self, src: torch.Tensor) -> bool:
        """Whether the device reads this host tier block where it is: a whole block inside
        chunks this transfer has registered (not one pending or failed: that memory is pageable),
        and the path checked on this device (at its first use)."""
        if self._direct is False:
            return False
        a, bb = src.data_ptr(), self.block_bytes
        if src.numel() < bb or not self._pins.covers(a, bb):
            return False
        return self._decide_direct()

    def _decide_direct(self) -> bool:
        """Whether loads read the registered arena in place: checked on the device once (`_direct_usable`)."""
        if self._direct is None:
            self._direct, self.direct_reason = self._direct_usable()
            log.info("tierd transfer on %s: loads straight from the registered arena: %s", self.device,
                     self.direct_reason)
        return self._direct

    def _direct_usable(self) -> tuple[bool, str]:
        """Run the direct path once on this device: random bytes in host memory registered as the
        arena is, scattered into scratch caches of this transfer's geometry, must equal what the
        torch reference writes. (Its launches, uploads and layout are checked on the CPU:
        tests/test_direct_scatter.py.)"""
        if not available():
            return False, "off: the CUDA kernels are not available"
        try:
            ops._geometry(self.k, self.v)
        except ValueError as e:
            return False, f"off: {e}"
        try:
            import cupy
            dev = self.device.index if self.device.index is not None else torch.cuda.current_device()
            if cupy.cuda.runtime.deviceGetAttribute(91, dev) != 1:   # cudaDevAttrCanUseHostPointerForRegisteredMem
                return False, "off: the device cannot read registered host memory at its host address"
            k0, r = self.k[0], self.ratio
            shape = (2 * r, *k0.shape[1:])
            ks = [torch.zeros(shape, dtype=k0.dtype, device=self.device) for _ in range(2)]
            vs = None if self.v is None else [torch.zeros_like(c) for c in ks]
            bb = 2 * self.planes * r * k0[0].numel() * k0.element_size()
            host = np.random.default_rng(0).integers(0, 256, 2 * bb, dtype=np.uint8)
            pin = CudaHostPinning()
            if not pin.register(host.ctypes.data, host.nbytes, tag="direct-check"):
                return False, "off: host memory could not be registered"
            try:
                ids = torch.arange(2 * r, dtype=torch.int64).view(2, r).flip(1)
                ops.scatter_from_host(ks, vs, ids, [host.ctypes.data, host.ctypes.data + bb], layered=True)
                torch.cuda.synchronize(self.device)
                want_k = [torch.zeros(shape, dtype=k0.dtype) for _ in range(2)]
                want_v = None if vs is None else [torch.zeros_like(c) for c in want_k]
                reference.scatter_blocks(want_k, want_v, ids, [torch.from_numpy(host[:bb]), torch.from_numpy(host[bb:])])
                same = all(torch.equal(a.cpu().view(torch.uint8), b.view(torch.uint8))
                           for a, b in zip(ks + (vs or []), want_k + (want_v or [])))
            finally:
                pin.unregister(host.ctypes.data, tag="direct-check")
        except Exception as e:  # noqa: BLE001 -- the staged copies serve instead
            return False, f"off: its check raised {e!r}"
        return (True, "on (checked on this device)") if same else (False, "off: its check read other bytes")

    LOAD_CHUNKS = 4     # layer-by-layer loads copy staged blocks up in this many ranges of layers

    def _load_addressed(self, block_ids: torch.Tensor, srcs: Sequence[torch.Tensor], up: Sequence[int],
                        layered: bool) -> LoadJob:
        """One upload of the ids and every tier block's address, then one scatter launch per
        layer (or one for all): blocks on the device (the HBM tier's) and in registered host
        memory the device reads are read where they are; the others are copied up into one
        staging buffer, a range of layers at a time (at most `LOAD_CHUNKS` copies per block),
        each range before the launches of its layers, so the first layer's compute waits for
        its range only. Copies, uploads and launches do not grow with layers x blocks."""
        sx, events = self.streams, []
        staged: list[int] = []       # the host blocks not read in place: decided under the lock
        lb, layers = self.layer_bytes, self.layers
        parts = min(layers, self.LOAD_CHUNKS) if layered else 1
        ends = {layers * c // parts: layers * (c + 1) // parts for c in range(parts)}   # first layer -> end
        held: dict = {}

        def upload():
            # allocated on the load stream, used only there: freed after the last launch
            buf = torch.empty((len(staged), self.block_bytes), dtype=torch.uint8, device=self.device) \
                if staged else None
            addrs = [s.data_ptr() for s in srcs]
            for j, i in enumerate(staged):
                addrs[i] = buf[j].data_ptr()
            held["buf"] = buf
            held["scatter"] = ops.AddressScatter(self.k, self.v, block_ids, addrs, layered=layered,
                                                 launch_fn=self._launcher)

        def launch(layer: int | None):
            def work():
                buf, end = held["buf"], ends.get(layer or 0)
                if end is not None:       # the first layer of a range: its part of each staged block up
                    lo, hi = (layer or 0) * lb, end * lb
                    for j, i in enumerate(staged):
                        buf[j, lo:hi].copy_(srcs[i][lo:hi], non_blocking=True)
                held["scatter"].launch(layer)
                if layer is None or layer == layers - 1:
                    held.clear()
            return work
        timer = getattr(sx, "timer", None)
        with self._pin_lock:         # queued whole: an arena re-mapped meanwhile waits for it
            # read in place only from chunks registered now (none is unregistered before these
            # copies have run: unregistering drains first, under this lock)
            staged[:] = [i for i in up if not self._reads_host(srcs[i])]
            self.stats["load_staged_blocks"] += len(staged)
            self.stats["load_direct_blocks"] += len(up) - len(staged)
            sx.wait(self.h2d, sx.record(sx.current()))   # queued compute may still use these blocks
            start = timer(self.h2d) if timer else None
            sx.run(self.h2d, upload)
            for layer in (range(layers) if layered else (None,)):
                sx.run(self.h2d, launch(layer))
                events.append(sx.record(self.h2d))
            end = timer(self.h2d) if timer else None
        return LoadJob(sx, events, layered, device_blocks=len(srcs) - len(up),
                       timers=(start, end) if timer else None)

    def scatter_from(self, block_ids: torch.Tensor, buffers: Sequence[np.ndarray]):
        """Copy host buffers into engine blocks, all layers at once. On a device the compute
        stream waits for the copies; returns the event after which the buffers may be released
        (None on CPU)."""
        job = self.load_layers(block_ids, buffers, layered=False)
        job.wait_all()
        return job.events[-1] if job.events else None

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
        """Acquire the leading present blocks, scatter them, release. Returns how many; LeaseError
        when the lease was lost during the copies (a daemon restart: the blocks scattered are
        not to be used)."""
        lease = store.acquire(ns, keys)
        with lease:                  # its end confirms it: LeaseError if it was lost meanwhile
            self.attach(store)       # after the acquire: a reconnect there re-maps the arena
            n = len(lease)
            if n:
                gpu = getattr(lease, "gpu_buffers", None) or None
                job = self.load_layers(block_ids[:n], lease.buffers[:n], gpu, layered=False)
                job.wait_all()
                job.synchronize()            # the lease ends below; the copies must be done
        return n
