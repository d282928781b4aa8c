"""The bundled engine's connector to tierd: load cached prefixes before prefill, store filled
blocks after each step.

Owns the translation between the engine's paged cache (per layer K and V of shape
(num_blocks, block_size, kv_heads, head_dim)) and tier blocks ([layers, 2, block_tokens,
kv_heads, head_dim], a whole number of engine blocks). It must never fail a request: any store
error means the engine recomputes, and the failure is counted. Stores run on a background thread
behind a bounded queue; when the queue is full the block is dropped and counted, so decode never
waits for the store.
"""

from __future__ import annotations

import contextlib
import logging
import time

import numpy as np
import torch

from tierd.costs import Plan, primary_tier, slowest_tier
from tierd.costs import load_policy as costs_load_policy
from tierd.errors import TierdError
from tierd.kernels.transfer import BlockTransfer
from tierd.keys import extend_keys
from tierd.namespace import Namespace

from .link import STORE_ERRORS, PendingBytes, StoreLink, acquire_for, drain_quietly, holding

log = logging.getLogger("tierd.connectors.engine")


class EngineConnector:
    """Between one `tierd.engine.LLM` and one Store (`embedded://`, `unix://` URL or object)."""

    def __init__(self, store, namespace: Namespace, kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                 engine_block_size: int, *, max_pending_blocks: int = 64, retry_after_s: float = 1.0,
                 prefault: bool = True, load_policy: str | None = None):
        if namespace.block_tokens % engine_block_size:
            raise TierdError(f"tier block of {namespace.block_tokens} tokens is not a multiple of the "
                             f"engine's {engine_block_size}-token blocks")
        self.ns = namespace
        self.load_policy = costs_load_policy(load_policy)   # "decide" or "always" (tierd/costs.py)
        self.block_tokens = namespace.block_tokens
        self.ratio = namespace.block_tokens // engine_block_size
        self.engine_block_size = engine_block_size
        # `prefault`: a daemon's arena pages are mapped here ahead of the first copy (unix:// only);
        # the daemon's shared index is mapped for pipelined leases (`acquire_for`), lookups asked
        self.link = StoreLink(store, max_pending_blocks=max_pending_blocks, retry_after_s=retry_after_s,
                              prefault=prefault, read_index=True)
        self.stats = self.link.stats
        # copies between the caches and tier slots: gather/scatter kernels and their own streams
        # on a GPU (loads also from HBM-tier copies on this device), the references on CPU
        self.xfer = BlockTransfer([k for k, _ in kv_caches], [v for _, v in kv_caches], self.ratio,
                                  stats=self.stats)   # its page-locking and load paths counted here
        self.device = kv_caches[0][0].device
        if self.xfer.pinning is not None:
            # start page-locking the arena now (in the background, a chunk at a time: a second
            # or more per GiB), not in the first hit's TTFT
            store = self.link.get()
            try:
                if store is not None:
                    self.xfer.attach(store)
            except STORE_ERRORS as e:
                self.link.failed(e, "page-locking the arena")
        # a daemon's: connected, the namespace registered and the cost model exchanged off the
        # engine's thread, not in the first hit's load (1-2 ms of round trips there)
        self.link.warm(namespaces=[namespace])
        self.stats.setdefault("hbm_hit_blocks", 0)
        self.stats.setdefault("load_device_s", 0.0)    # loads' copies on the device (CUDA: timed by events)
        self._loading: list = []     # (seq, lease, job, hold or None) of loads whose copies may still run
        self.stats.setdefault("lost_leases", 0)
        for k in ("declined_tokens", "abandoned_tokens", "slow_hits", "probes"):
            self.stats.setdefault(k, 0)   # the cost model's decisions (tierd/costs.py)

    @property
    def store(self):
        return self.link.store

    # -- keys -------------------------------------------------------------------------------------
    def tier_keys(self, seq, n_blocks: int) -> list[bytes]:
        return extend_keys(seq.tier_keys, self.ns.root_key, seq.token_ids, self.block_tokens, n_blocks)

    # -- load before prefill ------------------------------------------------------------------------
    CHUNK_BLOCKS = 8   # a load from a tier below host RAM goes in parts this large: between two,
    #                    a load past its deadline is abandoned (the rest recomputed)

    def load(self, seq, block_manager) -> int:
        """Extend a just-admitted sequence's cached prefix with tier blocks: allocate engine
        blocks, copy the tier blocks in, advance num_computed. Returns the tokens loaded.

        Only the prefix the node's cost model (tierd/costs.py) predicts to load faster than it
        would be computed is loaded; a load that runs past its prediction by a margin stops
        between two parts, and the rest is computed."""
        # Every full block may be loaded; the last prompt token is then recomputed into its
        # (fresh, unshared) block, because its logits are needed.
        usable = seq.num_tokens // self.block_tokens
        first = seq.num_computed // self.block_tokens          # tier blocks the engine already has
        if usable <= first:
            return 0
        store = self.link.get()
        if store is None:
            return 0
        keys = self.tier_keys(seq, usable)[first:]
        self.stats["lookups"] += 1
        t0 = time.perf_counter()
        bt = self.block_tokens
        try:
            return self._load(store, seq, block_manager, keys, first, t0)
        finally:
            self.link.cost_model()   # its exchange with the daemon's, when due: after the load

    def _load(self, store, seq, block_manager, keys: list[bytes], first: int, t0: float) -> int:
        bt = self.block_tokens
        model = self.link.cost_model(exchange=False)
        if self.load_policy == "always":
            # every block found, in one part (no question asked first: the lease says where
            # each block was)
            plan = Plan(found=len(keys), blocks=len(keys), tiers=["host"] * len(keys), reason="always")
        else:
            try:
                tiers = [primary_tier(w) for w in store.where(self.ns, keys)]
                if "" in tiers:
                    # (`where` knows this node's tiers; a block only the remote tier holds is
                    # found by a lookup, which asks it: those continue the prefix, from "remote")
                    found = store.lookup(self.ns, keys)
                    tiers = [t or ("remote" if i < found else "") for i, t in enumerate(tiers)]
            except STORE_ERRORS as e:
                self.stats["load_failures"] += 1
                self.link.failed(e, "load")
                return 0
            plan = model.plan(self.ns.name, tiers, self.ns.block_bytes, bt, first_tokens=first * bt,
                              usable_tokens=seq.num_tokens - 1 - first * bt)
            for tier, n in plan.declined().items():
                model.count(tier, declined_tokens=n * bt)
                self.stats["declined_tokens"] += n * bt
            tier, run = plan.probe_run(keys)
            if run:
                self.link.probe(self.ns, run, tier, model)
        loaded, done, sources = 0, 0, []
        for tier, s, e in plan.runs():
            step = e - s if tier in ("gpu", "host") else self.CHUNK_BLOCKS
            for a in range(s, e, step):
                b = min(e, a + step)
                if done and time.perf_counter() - t0 > plan.deadline_s:
                    # past its deadline: what is loaded stays, the rest is computed
                    left = plan.blocks - done
                    model.count(tier, abandoned_tokens=left * bt)
                    self.stats["abandoned_tokens"] += left * bt
                    return self._loaded(seq, model, plan, loaded, sources, t0)
                t1 = time.perf_counter()
                got, found_in = self._load_part(store, seq, block_manager, first + a, keys[a:b])
                if found_in:
                    model.observe_transfer(slowest_tier(found_in), "load", len(found_in) * self.ns.block_bytes,
                                           time.perf_counter() - t1)
                loaded += got
                done += len(found_in)
                sources += found_in
                if len(found_in) < b - a:    # fewer than asked (evicted meanwhile, no room, a failure)
                    return self._loaded(seq, model, plan, loaded, sources, t0)
        return self._loaded(seq, model, plan, loaded, sources, t0)

    def _loaded(self, seq, model, plan, loaded: int, sources: list[str], t0: float) -> int:
        """The ledger of one load (`sources`: where each block loaded was found): tokens per
        tier, and a slow hit where it took longer than computing its tokens was estimated to."""
        took = time.perf_counter() - t0
        if sources:
            seq.tier_sources = sorted(set(sources))
            self.stats["hit_blocks"] += len(sources)
            self.stats["loaded_tokens"] += loaded
            self.stats["loaded_bytes"] += len(sources) * self.ns.block_bytes
            self.stats["load_s"] += took
            for t in set(sources):
                model.count(t, loads=1, loaded_tokens=sources.count(t) * self.block_tokens)
            if plan.reason == "model" and took > plan.recompute_s:
                model.count(slowest_tier(sources), slow_hits=1)
                self.stats["slow_hits"] += 1
        return loaded

    def _load_part(self, store, seq, block_manager, first: int, keys: list[bytes]) -> tuple[int, list[str]]:
        """Load `keys`, the tier blocks from `first` on: (tokens loaded, where each block loaded
        was found)."""
        try:
            lease = acquire_for(store, self.ns, keys, self.device)
        except STORE_ERRORS as e:
            self.stats["load_failures"] += 1
            self.link.failed(e, "load")
            return 0, []
        handed = ended = False
        hold = None
        try:
            n = len(lease)
            while n and not block_manager.can_allocate(seq, (first + n) * self.block_tokens - seq.num_computed):
                n -= 1
            if n == 0:
                return 0, []
            # the bytes count only if the lease holds from before the copy until its end: a
            # daemon connection lost meanwhile may have handed the slots to another writer (an
            # embedded store's slots cannot be lost: nothing to hold)
            if hasattr(store, "hold"):
                hold = contextlib.ExitStack()
                hold.enter_context(holding(store, lease))
            have = len(seq.block_table)                        # engine blocks already in place
            block_manager.allocate(seq, (first + n) * self.block_tokens - seq.num_computed)
            r, lo = self.ratio, first * self.ratio
            ids = np.array(seq.block_table[lo:lo + n * r], dtype=np.int64)
            ids[:max(0, have - lo)] = -1                        # -1: parts the engine already holds
            ids = ids.reshape(n, r)       # (numpy: a CPU load's C copy takes it as it is)
            self.xfer.attach(store)
            gpu = list(getattr(lease, "gpu_buffers", None) or ())[:n] or None
            job = self.xfer.load_layers(ids, lease.buffers[:n], gpu, layered=True)
            self.stats["hbm_hit_blocks"] += job.device_blocks
            if job.events:            # copying: the forward waits per layer, the lease ends after it
                self._loading.append((seq, lease, job, hold))
                handed = True
            else:                     # copied: confirm the lease held throughout
                self._confirm(store, lease)
                ended = True
            upto = min((first + n) * self.block_tokens, seq.num_tokens - 1)
            loaded = upto - seq.num_computed
            seq.num_computed = upto
            seq.tier_loaded = first + n
            return loaded, list(lease.tiers[:n])
        except STORE_ERRORS as e:     # the lease was lost: what was copied is not used
            self.stats["lost_leases"] += 1
            self.stats["load_failures"] += 1
            log.warning("tierd lease lost during a load (%s); the prefix is recomputed", e)
            return 0, []
        except Exception:  # noqa: BLE001 - a failed copy never fails the request: it recomputes
            log.exception("tierd: loading a cached prefix failed; recomputing it")
            self.stats["load_failures"] += 1
            drain_quietly(self.xfer)
            return 0, []
        finally:
            if not handed:
                if hold is not None:
                    hold.close()
                if not ended:
                    self._end_lease(lease)

    def observe_forward(self, batch, seconds: float) -> None:
        """A forward of the engine: (new tokens, cached tokens before them) per sequence, and
        its seconds, for the cost model's recompute estimate (tierd/costs.py)."""
        store = self.link.get()
        if store is not None:
            store.cost_model(sync=False).observe_forward(self.ns.name, batch, seconds)

    def _confirm(self, store, lease) -> None:
        """End `lease`, raising LeaseError if it was lost before now (a daemon's lease; an
        embedded store's cannot be lost)."""
        if hasattr(store, "hold"):
            store.release(lease, confirm=True)
        else:
            lease.__exit__(None, None, None)

    @property
    def loading(self) -> bool:
        """Whether loads are copying: the step's forward must call `wait_layer` per layer."""
        return bool(self._loading)

    def wait_layer(self, layer: int) -> None:
        """Before layer `layer` reads or writes the cache: wait for that layer's loaded blocks
        (on a device, the compute stream waits; later layers keep loading meanwhile)."""
        for _, _, job, _ in self._loading:
            job.wait_layer(layer)

    def finish_loads(self) -> list:
        """After the step's forward: wait for the loads' copies and confirm their leases. Returns
        the sequences whose lease was lost meanwhile: the forward may have read overwritten
        bytes, so the engine discards their step and recomputes them."""
        loading, self._loading = self._loading, []
        lost = []
        for seq, lease, job, hold in loading:
            try:
                job.wait_all()
                job.synchronize()
                took = job.device_seconds()
                if took is not None:
                    self.stats["load_device_s"] += took
                self._confirm(self.link.store, lease)
            except STORE_ERRORS as e:
                self.stats["lost_leases"] += 1
                self.stats["load_failures"] += 1
                log.warning("tierd lease lost during a load (%s); the sequence is recomputed", e)
                lost.append(seq)
            except Exception:  # noqa: BLE001 - a device error: recompute, never fail the request
                log.exception("tierd: a load's copies failed; the sequence is recomputed")
                self.stats["load_failures"] += 1
                lost.append(seq)
            finally:
                if hold is not None:
                    hold.close()
                self._end_lease(lease)
        return lost

    def _end_lease(self, lease) -> None:
        """End a lease if it is still open (no confirmation)."""
        try:
            lease.__exit__(None, None, None)
        except STORE_ERRORS:
            pass

    # -- store after each step ----------------------------------------------------------------------
    def save(self, seq) -> None:
        """Queue the tier blocks this sequence has filled since the last call (not those it
        loaded). Copies the bytes out of the engine cache now; never waits for the store."""
        full = seq.num_computed // self.block_tokens
        start = max(seq.tier_saved, seq.tier_loaded)
        if full <= start or self.link.backing_off:
            seq.tier_saved = max(seq.tier_saved, full)
            return
        keys = self.tier_keys(seq, full)
        todo = []
        for i in range(start, full):
            bids = seq.block_table[i * self.ratio:(i + 1) * self.ratio]
            if len(bids) < self.ratio or min(bids) < 0:        # sliding window freed part of it
                continue
            todo.append((i, bids))
        if todo:
            ids = torch.tensor([b for _, b in todo], dtype=torch.long)
            pin = self.device.type == "cuda"
            host = [torch.empty(self.xfer.block_bytes, dtype=torch.uint8, pin_memory=pin) for _ in todo]
            try:
                ready = self.xfer.save_async(ids, [h.numpy() for h in host])
            except Exception:  # noqa: BLE001 - a failed copy never fails the request: not stored
                log.exception("tierd: copying blocks out of the cache failed; they are not stored")
                self.stats["store_failures"] += len(todo)
                seq.tier_saved = full
                return
            bt = self.block_tokens
            for (i, _), h in zip(todo, host):
                block = h.numpy() if ready is None else PendingBytes(h.numpy(), ready, self.xfer.streams)
                self.link.submit(self.ns, keys[i], keys[i - 1] if i else None, block,
                                 seq.token_ids[i * bt:(i + 1) * bt])
        seq.tier_saved = full

    def flush(self, timeout_s: float = 30.0) -> None:
        """Wait until every queued store has been handed to the store (tests, shutdown)."""
        self.link.flush(timeout_s)

    def close(self) -> None:
        self.finish_loads()
        self.link.close()
        self.xfer.close()              # unpin the arena mapping
