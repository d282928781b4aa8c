"""The vLLM connector's worker half: the paged cache's layout, the copies between it and tier
slots, leases and reservations (`TierdConnector` in connectors/vllm.py combines it with the
scheduler half).

Loads: one `acquire`, a copy into the paged cache (by default layer by layer, each layer's
attention waiting for its own copy), and a confirmed `release`: a lease lost meanwhile is a
load error, never a silent success. Asynchronous loads run on a loader thread and are reported
through `get_finished`. Saves reserve their slots while the step's forward runs, copy the
completed tier blocks straight from the paged cache into the reserved shared-memory slots at
`wait_for_save`, and commit from a save thread. Every layer is copied through its own KV cache
group's block ids (connectors/vllm_groups.py); a part a group has no block for is skipped on a
load and zeros on a save.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from typing import Any

import torch

from tierd import threads
from tierd.errors import TierdError
from tierd.kernels.transfer import BlockTransfer, LoadJob, host_tensor
from tierd.namespace import Namespace

from . import vllm_layout
from .identity import Declined
from .link import STORE_ERRORS, acquire_for, drain_quietly, holding, load_unleased
from .vllm_base import timed
from .vllm_groups import KVGroups
from .vllm_meta import LoadSpec, SaveSpec

log = logging.getLogger("tierd.connectors.vllm")


class _Pending:
    """A reservation being asked for on the save thread, awaited at the end of the step."""

    __slots__ = ("spec", "ns", "bytes", "event", "res", "abandoned", "copied", "hold", "keys", "parent",
                 "token_ids", "state")

    def __init__(self, spec: SaveSpec, ns: Namespace, nbytes: int, keys: list[bytes], parent: bytes | None,
                 token_ids: list[int] | None, state: bool = False):
        self.spec, self.ns, self.bytes = spec, ns, nbytes
        self.keys, self.parent, self.token_ids = keys, parent, token_ids
        self.state = state       # the spec's recurrent state (else its KV blocks)
        self.event = threading.Event()
        self.res = None
        self.abandoned = False
        self.copied = None       # the device event after which the slots hold the bytes (None: they do)
        self.hold = contextlib.ExitStack()   # keeps the slots' connection while the copy runs


class _Loading:
    """A synchronous load whose copies run during the step's forward."""

    __slots__ = ("spec", "store", "lease", "loaded", "job", "hold", "t0", "tiers")

    def __init__(self, spec: LoadSpec, store, lease, loaded: int, job: LoadJob, hold, t0: float):
        self.spec, self.store, self.lease, self.loaded, self.job, self.hold, self.t0 = \
            spec, store, lease, loaded, job, hold, t0
        self.tiers = list(getattr(lease, "tiers", None) or ())    # where each block was found


class _Leases:
    """The leases of one load leased in parts (`WorkerHalf._acquire`), as one: the prefix of
    blocks they hold together, released (and confirmed) together."""

    def __init__(self, store, parts: list):
        self.store, self.parts = store, parts
        self.buffers = [b for p in parts for b in p.buffers]
        self.tiers = [t for p in parts for t in (p.tiers or ["host"] * len(p))]
        gpu = [getattr(p, "gpu_buffers", None) for p in parts]
        self.gpu_buffers = [b for g, p in zip(gpu, parts) for b in (g or [None] * len(p))] if any(gpu) else None

    def __len__(self) -> int:
        return len(self.buffers)

    def hold(self):
        """Every part's `holding`, entered together (none stays entered if one raises)."""
        with contextlib.ExitStack() as stack:
            for p in self.parts:
                stack.enter_context(holding(self.store, p))
            return stack.pop_all()

    def release(self, *, confirm: bool) -> None:
        """Release every part; with `confirm`, raise (LeaseError) if any was lost, after all
        were released."""
        lost = None
        for p in self.parts:
            try:
                self.store.release(p, confirm=confirm)
            except STORE_ERRORS as e:
                lost = lost or e
        if lost is not None:
            raise lost


class WorkerHalf:
    """Part of `TierdConnector`: the methods vLLM calls on a worker's connector."""

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]):
        if self.disabled:
            return
        if all(t.device.type == "cpu" for t in kv_caches.values()):
            # vLLM's CPU worker has bound this thread (its OpenMP compute thread) to its cores:
            # the connector's threads, started later, run beside them, not on them
            threads.keep_helpers_off_my_cores()
        try:
            rank, stage = self._worker_rank(), self._worker_stage()
        except Declined as e:
            return self._decline(str(e))
        # the namespace this worker reads and writes: its stage's and rank's, or (MLA) its
        # stage's for all ranks, which rank 0 alone writes (every rank holds the same latent rows)
        self._rank = stage * self.tp_keys + (0 if self.latent else rank)
        self._writer = rank == 0 or not self.latent
        ns = self.namespace("")
        groups = self.groups if self.groups.names else KVGroups.single(kv_caches)
        names = groups.names
        if len(names) != ns.num_layers:
            return self._decline(f"{len(names)} KV cache tensors for a {ns.num_layers}-layer namespace")
        absent = [n for n in names if n not in kv_caches]
        if absent:
            return self._decline(f"no KV cache tensor for layer {absent[0]} of the KV cache groups")
        layers = []
        try:
            for n in names:
                backend, isa = vllm_layout.backend_of(self._vllm_config, n)
                if self.latent:
                    layers.append((vllm_layout.latent_view(kv_caches[n], backend, self.block_size, ns.head_dim), None))
                else:
                    layers.append(vllm_layout.kv_views(kv_caches[n], backend, isa, self.block_size,
                                                       ns.num_kv_heads, ns.head_dim))
        except TierdError as e:
            return self._decline(str(e))
        k0 = layers[0][0]
        if k0.element_size() != ns.dtype_bytes:
            return self._decline(f"KV cache dtype {k0.dtype} does not match the namespace's {ns.kv_dtype}")
        if ns.kv_dtype.startswith("float8") and not ns.kv_scales:
            scales = self._layer_scales(names)
            if any(s != (1.0, 1.0) for s in scales):
                return self._decline("fp8 KV scales other than 1.0 that the namespace does not record")
        pages = []
        for n in groups.state_names:    # recurrent state: a page of state_bytes per block
            t = kv_caches.get(n)
            page = self._state_page(n, t, groups.state_bytes)
            if isinstance(page, str):
                return self._decline(page)
            pages.append(page)
        self._state_pages = pages
        self._layers = layers
        self._device = k0.device
        # copies between these views and tier slots: gather/scatter kernels on a GPU (on their own
        # streams, loads layer by layer), their references on CPU
        self._xfer = BlockTransfer([k for k, _ in layers], None if self.latent else [v for _, v in layers],
                                   self.ratio, layer_groups=groups.layer_group, stats=self.stats)
        self._layer_idx = {n: i for i, n in enumerate(names)}
        if self._xfer.cuda:
            # the in-place read check (a scatter from registered host memory, and a synchronize)
            # now, on this thread, before vLLM captures its CUDA graphs -- not in the warm-up
            # thread below, whose attach would otherwise run it during a capture
            self._xfer._decide_direct()
        # the daemon's connections now, off this thread: the first hit and the first save do not
        # pay for connecting, mapping the arena and faulting its pages in, nor (on a GPU) for
        # page-locking it
        pin = self._xfer.attach if self._xfer.pinning is not None else None
        own = self.start_namespaces([self._rank])    # registered then too, off this thread
        self.link.warm(pin, namespaces=own)
        if self.save_link is not self.link:
            self.save_link.warm(pin, namespaces=own if self._writer else ())

    @staticmethod
    def _state_page(name: str, t, nbytes: int):
        """The (blocks, nbytes) uint8 view of a state layer's cache (vLLM hands over the raw
        page of each block: its states one after another, padding after them), or why not."""
        if not isinstance(t, torch.Tensor):
            return f"state layer {name}: {type(t).__name__} where a tensor of pages was expected"
        try:
            flat = t.view(t.shape[0], -1).view(torch.uint8)
        except RuntimeError:
            return f"state layer {name}: pages of shape {tuple(t.shape)}, strides {t.stride()} are not runs of bytes"
        if flat.shape[1] < nbytes:
            return f"state layer {name}: pages of {flat.shape[1]} bytes for {nbytes} bytes of state"
        return flat[:, :nbytes]

    def _layer_scales(self, names: list[str]) -> list[tuple[float, float]]:
        ctx = getattr(getattr(self._vllm_config, "compilation_config", None), "static_forward_context", None) or {}
        out = []
        for n in names:
            layer = ctx.get(n)
            out.append((float(getattr(layer, "_k_scale_float", 1.0)), float(getattr(layer, "_v_scale_float", 1.0))))
        return out

    def _decline(self, reason: str) -> None:
        self.disabled = reason
        self._layers = []
        log.warning("tierd connector disabled: %s", reason)

    # -- loads --------------------------------------------------------------------------------
    @timed("hook_s")
    def start_load_kv(self, forward_context, **kwargs: Any) -> None:
        # (vLLM calls this before the forward in a step with synchronous loads, after it in
        # others: the waits of a forward are counted from one step's metadata to the next's)
        if not self.has_connector_metadata():
            return
        for spec in getattr(self._get_connector_metadata(), "loads", ()):
            if not spec.is_async:
                if not self._layers:     # declined here (the scheduler could not tell): recompute
                    with self._lock:
                        self._load_errors.update(spec.real_ids())
                    continue
                started = self._begin_load(spec)
                if isinstance(started, _Loading):
                    self._loading.append(started)
                    if not self._layerwise:
                        started.job.wait_all()
                else:
                    with self._lock:
                        self._load_errors.update(started)
                continue
            if not self._layers:     # declined: the request still has to be reported, as failed
                with self._lock:
                    self._done_loads[spec.req_id] = spec.real_ids()
                continue
            if self._loader is None:
                self._loader = threads.start(self._load_loop, name="tierd-vllm-loader")
            with self._lock:
                self._queued.add(spec.req_id)
            self._load_q.put(spec)

    def _load_loop(self) -> None:
        while True:
            spec = self._load_q.get()
            if spec is None:
                return
            with self._lock:
                cancelled = spec.req_id in self._cancelled
                self._cancelled.discard(spec.req_id)
            try:
                errors = set() if cancelled else self._load(spec)
            except Exception:  # noqa: BLE001 - never lose the report: vLLM would wait forever
                log.exception("tierd load of request %s failed", spec.req_id)
                errors = spec.real_ids()
            with self._lock:
                self._queued.discard(spec.req_id)
                self._cancelled.discard(spec.req_id)
                self._done_loads[spec.req_id] = errors

    def _load(self, spec: LoadSpec) -> set[int]:
        """Load `spec` to the end (the asynchronous path: its blocks are outside the batch);
        returns the block ids that could not be loaded (vLLM recomputes them)."""
        started = self._begin_load(spec)
        if not isinstance(started, _Loading):
            return started
        return self._end_load(started)

    def _begin_load(self, spec: LoadSpec) -> _Loading | set[int]:
        """Acquire the tier blocks of `spec` and start copying them into its vLLM blocks (on a
        GPU: on the load stream, layer by layer; HBM-tier copies on this device device-to-device).
        Returns the load in flight, or the block ids that cannot be loaded."""
        t0 = time.perf_counter()
        store = self.link.get()
        lease = None
        keys = spec.keys[self._rank]
        if spec.state_keys and (store is None or not self._load_state(store, spec)):
            store = None      # without the state at its end, the hit is not loaded at all
        if store is not None and self._xfer.streams is None and not spec.state_keys:
            done = self._load_unleased(store, spec, keys, t0)
            if done is not None:
                return done
        if store is not None:
            try:
                lease = self._acquire(store, spec, keys, t0)
                self.stats["load_acquire_s"] += time.perf_counter() - t0
                self.link.ok()
            except STORE_ERRORS as e:
                self.stats["load_failures"] += 1
                self.link.failed(e, "load")
        loaded = len(lease) if lease is not None else 0
        if loaded:
            hold = contextlib.ExitStack()
            try:    # the bytes count only if the lease holds from before the copy until its end
                hold.enter_context(lease.hold() if isinstance(lease, _Leases) else holding(store, lease))
                self._xfer.attach(store)
                ids = self._load_ids(spec, loaded)
                gpu = list(getattr(lease, "gpu_buffers", None) or ())[:loaded] or None
                t1 = time.perf_counter()
                job = self._xfer.load_layers(ids, lease.buffers[:loaded], gpu, layered=True)
                # queued only, on a GPU; load_s of a load made before the step also holds the
                # forward pass (its lease is released after it)
                self.stats["load_copy_s"] += time.perf_counter() - t1
                self.stats["hbm_hit_blocks"] += job.device_blocks
                return _Loading(spec, store, lease, loaded, job, hold, t0)
            except STORE_ERRORS as e:
                hold.close()
                self.stats["lost_leases"] += 1
                log.warning("tierd lease lost before a load (%s); the blocks are recomputed", e)
                loaded = 0
            except Exception:  # noqa: BLE001 - a failed copy must not reach vLLM: recompute
                log.exception("tierd: starting a load's copies failed; the blocks are recomputed")
                drain_quietly(self._xfer)
                hold.close()
                loaded = 0
        if lease is not None:
            self._release_quietly(store, lease)
        self.stats["load_s"] += time.perf_counter() - t0
        return self._missing(spec, loaded)

    ABANDON_PARTS = 8   # tier blocks a decided load leases at a time (tierd/costs.py)

    def _acquire(self, store, spec: LoadSpec, keys, t0: float):
        """The lease of `keys`. A decided load (a finite `spec.deadline_s`) leases them in parts;
        past its deadline it stops between two parts: the blocks leased stay, vLLM computes the
        rest (its `kv_load_failure_policy` "recompute"), and their tokens are counted as
        abandoned."""
        ns = self.namespace(spec.salt)
        if not spec.deadline_s < float("inf") or len(keys) <= self.ABANDON_PARTS:
            return acquire_for(store, ns, keys, self._device)
        parts: list = []
        try:
            for a in range(0, len(keys), self.ABANDON_PARTS):
                if parts and time.perf_counter() - t0 > spec.deadline_s:
                    left = len(keys) - a
                    self.stats["abandoned_tokens"] += left * self.block_tokens
                    model = self.link.cost_model()
                    if model is not None and self._rank == 0:
                        model.count(parts[-1].tiers[-1] if parts[-1].tiers else "disk",
                                    abandoned_tokens=left * self.block_tokens)
                    break
                part = acquire_for(store, ns, keys[a:a + self.ABANDON_PARTS], self._device)
                parts.append(part)
                if len(part) < len(keys[a:a + self.ABANDON_PARTS]):
                    break
        except BaseException:
            for p in parts:
                self._release_quietly(store, p)
            raise
        return parts[0] if len(parts) == 1 else _Leases(store, parts)

    def _load_unleased(self, store, spec: LoadSpec, keys, t0: float) -> set[int] | None:
        """A CPU load without a lease (the daemon's shared index shows the blocks ready in host
        RAM): copied into the request's blocks now, checked after. Returns the blocks to
        recompute, or None where the lease path must load (it then copies again over whatever
        was written here; vLLM reads nothing of a load before it is reported)."""
        def copy(views) -> None:
            self._xfer.load_layers(self._load_ids(spec, len(views)), views, None, layered=False)
        try:
            n = load_unleased(store, self.namespace(spec.salt), keys, copy)
        except Exception:  # noqa: BLE001 - a failed copy: the lease path loads (or recomputes)
            log.exception("tierd: a load without a lease failed; leasing the blocks instead")
            return None
        if n is None:
            return None
        self.link.ok()
        spent = time.perf_counter() - t0
        self._observe_load(spec, ["host"] * n, n, spent)
        self.stats["unleased_loads"] += 1
        self.stats["load_copy_s"] += spent      # the index read, the copies and their check
        self.stats["load_s"] += spent
        self.stats["loaded_bytes"] += n * self.namespace(spec.salt).block_bytes
        return self._missing(spec, n)

    def _load_state(self, store, spec: LoadSpec) -> bool:
        """Copy the recurrent state at the end of `spec`'s hit into its state blocks; False if
        it could not be (the whole load is then recomputed)."""
        try:
            lease = store.acquire(self.state_namespace(spec.salt), [spec.state_keys[self._rank]])
            self.link.ok()
        except STORE_ERRORS as e:
            self.stats["load_failures"] += 1
            self.link.failed(e, "load")
            return False
        if not len(lease):
            self.stats["state_load_misses"] += 1
            self._release_quietly(store, lease)
            return False
        try:
            with holding(store, lease):
                src = host_tensor(lease.buffers[0])
                for page, part in self._state_parts(spec.state_ids):
                    page.copy_(src[part])
            lease, held = None, lease
            store.release(held, confirm=True)     # the bytes count only if the lease held throughout
            return True
        except STORE_ERRORS as e:
            self.stats["lost_leases"] += 1
            log.warning("tierd lease lost during a state load (%s); the blocks are recomputed", e)
        except Exception:  # noqa: BLE001 - a failed copy must not reach vLLM: recompute
            log.exception("tierd: a state load's copy failed; the blocks are recomputed")
        if lease is not None:
            self._release_quietly(store, lease)
        return False

    def _state_parts(self, ids: list[list[int]]):
        """(vLLM page, its part of a state block) for each state layer and each of its group's
        blocks in `ids` (per state group): a state block is the state layers' pages in order."""
        n = self.groups.state_bytes
        for blocks, g in zip(ids, self.groups.states):
            for i in self.groups.groups[g].layers:
                for b in blocks:
                    yield self._state_pages[i][b], slice(i * n, (i + 1) * n)

    def _end_load(self, ld: _Loading, *, unsafe: bool = False) -> set[int]:
        """Wait for a load's copies, confirm its lease and end it; returns the blocks to recompute.
        `unsafe`: the forward may have read the blocks before they arrived (not every layer
        waited for its copy): all of them are recomputed."""
        loaded = ld.loaded
        try:
            ld.job.synchronize()
            lease, ld.lease = ld.lease, None
            if isinstance(lease, _Leases):
                lease.release(confirm=True)
            else:
                ld.store.release(lease, confirm=True)
        except STORE_ERRORS as e:
            self.stats["lost_leases"] += 1
            log.warning("tierd lease lost during a load (%s); the blocks are recomputed", e)
            loaded = 0
        except Exception:  # noqa: BLE001 - a failed copy must not reach vLLM: recompute
            log.exception("tierd: a load's copies failed; the blocks are recomputed")
            loaded = 0
        finally:
            ld.hold.close()
            if ld.lease is not None:
                self._release_quietly(ld.store, ld.lease)
            self.stats["load_s"] += time.perf_counter() - ld.t0
        if unsafe and ld.job.events:
            self.stats["loads_unordered"] += 1
            loaded = 0
        if loaded:
            self.stats["loaded_bytes"] += loaded * self.namespace(ld.spec.salt).block_bytes
            self._observe_load(ld.spec, ld.tiers, loaded, time.perf_counter() - ld.t0)
        return self._missing(ld.spec, loaded)

    def _missing(self, spec: LoadSpec, loaded: int) -> set[int]:
        """The vLLM blocks of `spec` past its first `loaded` tier blocks (vLLM recomputes them)."""
        missing = spec.real_ids((spec.first_tier + loaded) * self.ratio)
        if missing:
            self.stats["load_failures"] += 1
        return missing

    def _release_quietly(self, store, lease) -> None:
        try:
            if isinstance(lease, _Leases):
                lease.release(confirm=False)
            else:
                store.release(lease)
        except STORE_ERRORS:
            pass

    def _load_ids(self, spec: LoadSpec, loaded: int) -> torch.Tensor:
        """(loaded, groups, ratio) vLLM block per group and part of each leased tier block
        ((loaded, ratio) for one group); -1 for parts vLLM's own prefix cache already holds,
        past the request's blocks, or a group's null block."""
        groups = len(spec.block_ids)
        ids = torch.full((loaded, groups, self.ratio), -1, dtype=torch.long)
        last = spec.first_block + spec.num_blocks
        for j in range(loaded):
            for r in range(self.ratio):
                b = (spec.first_tier + j) * self.ratio + r
                if spec.first_block <= b < last:
                    for g in range(groups):
                        ids[j, g, r] = spec.block_ids[g][b - spec.first_block]
        return ids[:, 0] if groups == 1 else ids

    def wait_for_layer_load(self, layer_name: str) -> None:   # (per layer: not timed)
        """Before layer `layer_name`'s attention: the compute stream waits for that layer's copies
        (and no others). Asynchronous loads complete outside the batch."""
        self._waited.add(layer_name)
        if not self._loading or not self._layerwise:
            return
        i = self._layer_idx.get(layer_name)
        for ld in self._loading:
            if i is None:
                ld.job.wait_all()
            else:
                ld.job.wait_layer(i)

    def _finish_loads(self) -> None:
        """End this step's synchronous loads (after the forward was queued): their lease is
        confirmed once the copies have run; a lost one, or a forward that did not wait for
        every layer, reports the blocks for recomputation."""
        loading, self._loading = self._loading, []
        if not loading:
            return
        unsafe = self._layerwise and not self._waited >= self._layer_idx.keys()
        errors: set[int] = set()
        for ld in loading:
            errors |= self._end_load(ld, unsafe=unsafe)
        with self._lock:
            self._load_errors.update(errors)

    @timed("hook_s")
    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        self._finish_loads()
        with self._lock:
            # requests aborted before their load started: nothing is written, report them at once
            for req_id in finished_req_ids or ():
                if req_id in self._queued:
                    self._cancelled.add(req_id)
            done, self._done_loads = self._done_loads, {}
            for req_id, errors in done.items():
                if not errors:
                    continue
                if self.fail_whole and hasattr(super(), "get_transfer_results"):
                    # (a vLLM that asks get_transfer_results: without it, block ids are the only way)
                    self._failed_loads.add(req_id)  # vLLM recomputes the whole request
                else:
                    self._load_errors.update(errors)   # reported in this same step, before the request
        return None, (set(done) or None)

    def get_transfer_results(self, finished_req_ids: set[str]):
        """`get_finished`, and the asynchronous loads that failed as failed requests (how vLLM
        takes a failure back from a model with several KV cache groups: recomputed whole)."""
        results = super().get_transfer_results(finished_req_ids)
        with self._lock:
            failed, self._failed_loads = self._failed_loads, set()
        if failed:
            results.failed_recving = set(results.failed_recving or ()) | failed
        return results

    @timed("hook_s")
    def get_block_ids_with_load_errors(self) -> set[int]:
        self._finish_loads()
        with self._lock:
            errors, self._load_errors = self._load_errors, set()
        return errors

    # -- saves --------------------------------------------------------------------------------
    def _end_forward(self) -> None:
        """The last step's forward is over (a new step begins): loads wait per layer only while
        the last forward that asked for any layer asked for every one (a model whose attention
        never calls wait_for_layer_load gets its loads waited for as a whole, before the
        forward). A step that asked for none (no forward, a CUDA graph replayed whole) says
        nothing and changes nothing."""
        if self._waited:
            self._layerwise = bool(self._layer_idx) and self._waited >= self._layer_idx.keys()
            self._waited = set()

    def reset_capture_state(self) -> None:
        """vLLM, after capturing CUDA graphs: the capture's dummy forwards asked for layers
        that a replay of a whole graph will not ask for; forget them (no per-layer waits until a
        real forward asks for every layer)."""
        self._waited = set()
        self._layerwise = False

    # -- the cost model's measurements (tierd/costs.py) ------------------------------------------
    def _begin_forward_timing(self, meta) -> None:
        """(Rank 0.) Time this step's forward for the recompute estimate, where it computes a
        prefill and loads nothing before it (a load's copies would be counted as compute). On a
        GPU the forward is timed by events, read once they have passed (never a synchronize)."""
        self._resolve_forward_timings()
        self.link.cost_model()     # (exchanged with the daemon's when due, off this thread)
        terms = list(getattr(meta, "forward", None) or ())
        self._fwd = None
        if self._rank != 0 or getattr(meta, "loads", None) or not any(n > 1 for n, _ in terms):
            return
        if self._device.type == "cuda":
            start = torch.cuda.Event(enable_timing=True)
            start.record()
            self._fwd = (start, terms)
        else:
            self._fwd = (time.perf_counter(), terms)

    def _end_forward_timing(self) -> None:
        fwd, self._fwd = self._fwd, None
        if fwd is None:
            return
        start, terms = fwd
        if isinstance(start, float):
            self._observe_forward(terms, time.perf_counter() - start)
        else:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self._fwd_events.append((start, end, terms))

    def _resolve_forward_timings(self) -> None:
        while self._fwd_events and self._fwd_events[0][1].query():
            start, end, terms = self._fwd_events.pop(0)
            self._observe_forward(terms, start.elapsed_time(end) / 1e3)
        del self._fwd_events[:-64]    # (never more than a few steps behind)

    def _observe_forward(self, terms, seconds: float) -> None:
        model = self.link.cost_model()
        if model is not None:
            model.observe_forward(self.engine_key, terms, seconds)

    def _observe_load(self, spec: LoadSpec, tiers, loaded: int, seconds: float) -> None:
        """A load of `loaded` tier blocks from `tiers` (per block) took `seconds`: for the cost
        model (`CostModel.record_load`; rank 0 keeps the ledger)."""
        model = self.link.cost_model()
        if model is None or not loaded:
            return
        bt = self.block_tokens
        if model.record_load(self.engine_key, (tiers or ["host"])[:loaded],
                             loaded * self.namespace(spec.salt).block_bytes, loaded * bt, seconds,
                             first_tokens=spec.first_tier * bt, ledger=self._rank == 0):
            self.stats["slow_hits"] += 1

    @timed("hook_s")
    def bind_connector_metadata(self, connector_metadata) -> None:
        self._end_forward()
        super().bind_connector_metadata(connector_metadata)
        self._begin_forward_timing(connector_metadata)
        if self._rank == 0:      # (every worker gets it; counted once)
            self.stats["sched_s"] += getattr(connector_metadata, "sched_s", 0.0)
        saves = getattr(connector_metadata, "saves", None)
        if not saves or not self._layers or not self._writer:    # (MLA: rank 0 writes for all)
            return
        # Ask for the slots now, so the round trip overlaps this step's forward.
        for spec in saves:
            parts = []
            keys = spec.keys[self._rank]
            if keys:
                ns = self.namespace(spec.salt)
                parts.append(_Pending(spec, ns, len(keys) * ns.block_bytes, keys, spec.parents[self._rank],
                                      spec.token_ids))
            if spec.state_keys and self._state_pages:
                ns = self.state_namespace(spec.salt)
                parts.append(_Pending(spec, ns, ns.block_bytes, [spec.state_keys[self._rank]], None, None,
                                      state=True))
            for p in parts:
                if self.save_link.backing_off:
                    self.stats["stores_dropped"] += len(p.keys)
                    continue
                with self._lock:
                    if self._inflight + p.bytes > self.max_inflight_bytes:
                        self.stats["stores_dropped"] += len(p.keys)
                        continue
                    self._inflight += p.bytes
                self._step_saves.append(p)
                self._save_q.put(("reserve", p))
        if self._saver is None:
            self._saver = threads.start(self._save_loop, name="tierd-vllm-saver")

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata, **kwargs: Any) -> None:
        return  # whole tier blocks are copied out in wait_for_save, once every layer is written

    @timed("hook_s")
    def wait_for_save(self):
        self._end_forward_timing()
        self._finish_loads()
        pending, self._step_saves = self._step_saves, []
        if not pending:
            return
        t0 = time.perf_counter()
        try:
            self._wait_and_copy(pending)
        finally:
            self.stats["save_s"] += time.perf_counter() - t0

    def _wait_and_copy(self, pending: list[_Pending]) -> None:
        deadline = time.monotonic() + self.save_wait_s
        for p in pending:
            if not p.event.wait(max(0.0, deadline - time.monotonic())):
                with self._lock:
                    if not p.event.is_set():      # the save thread aborts it when it arrives
                        p.abandoned = True
                if p.abandoned:
                    self.stats["stores_dropped"] += len(p.keys)
                    self.save_link.failed(TimeoutError(f"no reservation within {self.save_wait_s * 1000:.0f} ms"),
                                          "store")
                    continue
            res = p.res
            if res is None:                        # the reservation failed (counted there)
                continue
            try:
                self._start_copy(res, p)
            except Exception:  # noqa: BLE001 - a failed copy must not reach vLLM
                log.exception("tierd: copying blocks into reserved slots failed")
                p.hold.close()
                self._save_q.put(("abort", p))
                continue
            self._save_q.put(("commit", p))       # after the copy's event, on the save thread

    def _start_copy(self, res, p: _Pending) -> None:
        """Start copying the reserved tier blocks of `p` from the paged cache straight into their
        slots (on a GPU: gather + D2H on the save stream, after this step's forward); the save
        thread commits once the copy's event has fired. The slots' connection is held until then."""
        p.hold.enter_context(holding(self.save_link.store, res))
        todo = [j for j, status in enumerate(res.status) if status == "reserved"]
        if not todo:
            return
        if p.state:           # a few pages: copied at once (the step's forward is done)
            dst = host_tensor(res.buffers[0])
            for page, part in self._state_parts([[b] for b in p.spec.state_ids]):
                dst[part].copy_(page)
            return
        self._xfer.attach(self.save_link.store)
        n = len(res.status)
        ids = torch.tensor([row[:n * self.ratio] for row in p.spec.block_ids], dtype=torch.long)
        ids = ids.view(len(p.spec.block_ids), n, self.ratio).permute(1, 0, 2)    # (n, groups, ratio)
        ids = ids[:, 0] if ids.shape[1] == 1 else ids
        p.copied = self._xfer.save_async(ids[todo], [res.buffers[j] for j in todo])

    def _save_loop(self) -> None:
        while True:
            item = self._save_q.get()
            if item is None:
                return
            op, p = item
            try:
                if op == "reserve":
                    self._reserve(p)
                elif op == "commit":
                    self._finish(p, commit=True)
                else:
                    self._finish(p, commit=False)
            except Exception:  # noqa: BLE001 - never let the save thread die
                log.exception("tierd save thread: unexpected error")

    def _reserve(self, p: _Pending) -> None:
        store = self.save_link.get()
        res = None
        n = len(p.keys)
        if store is None:
            self.stats["stores_dropped"] += n
        else:
            try:
                res = store.reserve(p.ns, p.keys, parent=p.parent, token_ids=p.token_ids)
                self.save_link.ok()
            except STORE_ERRORS as e:
                self.stats["store_failures"] += n
                self.save_link.failed(e, "store")
        with self._lock:
            p.res = res
            abandoned = p.abandoned
            p.event.set()
        if res is None or abandoned:
            if res is not None:
                self._abort(store, res)
            self._settle(p)

    def _finish(self, p: _Pending, commit: bool) -> None:
        store, res = self.save_link.store, p.res
        try:
            if commit and p.copied is not None:
                try:
                    self._xfer.streams.synchronize(p.copied)     # the slots hold the bytes now
                except Exception:  # noqa: BLE001 - a device error: the blocks are not stored
                    log.exception("tierd: a copy into reserved slots failed")
                    commit = False
            if not commit:
                self._abort(store, res)
            elif not res.num_reserved:
                self.stats["stores_present"] += len(res.keys)
                self._abort(store, res)           # nothing to make visible; close it
            else:
                try:
                    n = store.commit(res)
                    self.stats["stored_blocks"] += n
                    self.stats["stores_present"] += sum(s == "present" for s in res.status)
                    self.save_link.ok()
                except STORE_ERRORS as e:
                    self.stats["store_failures"] += res.num_reserved
                    self.save_link.failed(e, "store")
        finally:
            p.hold.close()
            self._settle(p)

    def _abort(self, store, res) -> None:
        try:
            store.abort(res)
        except STORE_ERRORS:
            pass

    def _settle(self, p: _Pending) -> None:
        with self._lock:
            self._inflight -= p.bytes

    def flush(self, timeout_s: float = 30.0) -> bool:
        """Wait until the save thread has committed everything handed to it (tests, shutdown)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            with self._lock:
                if not self._inflight and self._save_q.empty():
                    return True
            time.sleep(0.005)
        return False
