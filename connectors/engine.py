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

import logging
import queue
import threading
import time

import numpy as np
import torch

import tierd
from tierd.errors import TierdError
from tierd.keys import extend_keys
from tierd.namespace import Namespace

log = logging.getLogger("tierd.connectors.engine")

_STORE_ERRORS = (TierdError, OSError, ConnectionError)


class EngineConnector:
    """Between one `tierd.engine.LLM` and one Store (`embedded://`, `unix://` URL or object)."""

    def __init__(self, store, namespace: Namespace, kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                 engine_block_size: int, *, max_pending_blocks: int = 64, retry_after_s: float = 1.0):
        if namespace.block_tokens % engine_block_size:
            raise TierdError(f"tier block of {namespace.block_tokens} tokens is not a multiple of the "
                             f"engine's {engine_block_size}-token blocks")
        self.ns = namespace
        self.block_tokens = namespace.block_tokens
        self.ratio = namespace.block_tokens // engine_block_size
        self.engine_block_size = engine_block_size
        self._url = store if isinstance(store, str) else None
        self.store = None if isinstance(store, str) else store
        self._owns_store = isinstance(store, str)
        # byte views of the caches: (num_blocks, bytes per engine block) per layer, K and V
        self._k = [k.view(torch.uint8).numpy().reshape(k.shape[0], -1) for k, _ in kv_caches]
        self._v = [v.view(torch.uint8).numpy().reshape(v.shape[0], -1) for _, v in kv_caches]
        self._per_block = self._k[0].shape[1]
        self.stats = dict.fromkeys(("lookups", "hit_blocks", "loaded_tokens", "load_failures",
                                    "stored_blocks", "store_failures", "stores_dropped", "unavailable",
                                    "load_s", "loaded_bytes"), 0)
        self._retry_after_s = retry_after_s
        self._down_until = 0.0
        self._backoff = retry_after_s
        self._lock = threading.Lock()
        self._queue: queue.Queue = queue.Queue(maxsize=max_pending_blocks)
        self._pending = 0  # blocks queued or being stored
        self._stop = False
        self._worker = threading.Thread(target=self._store_loop, name="tierd-kv-store", daemon=True)
        self._worker.start()

    # -- the store, with back-off while it is unavailable ------------------------------------------
    def _get_store(self):
        if time.monotonic() < self._down_until:
            return None
        if self.store is None:
            try:
                self.store = tierd.connect(self._url)
            except _STORE_ERRORS as e:
                self._failed(e, "connect")
                return None
        return self.store

    def _failed(self, e: Exception, what: str) -> None:
        with self._lock:
            self.stats["unavailable"] += 1
            self._down_until = time.monotonic() + self._backoff
            self._backoff = min(self._backoff * 2, 30.0)
        log.warning("tierd store unavailable during %s (%s); recomputing, retry in %.1fs", what, e, self._backoff)

    def _ok(self) -> None:
        self._backoff = self._retry_after_s

    # -- keys -------------------------------------------------------------------------------------
    def tier_keys(self, seq, n_blocks: int) -> list[bytes]:
        return extend_keys(seq.tier_keys, self.ns.root_key, seq.token_ids, self.block_tokens, n_blocks)

    # -- load before prefill ------------------------------------------------------------------------
    def load(self, seq, block_manager) -> int:
        """Extend a just-admitted sequence's cached prefix with tier blocks: allocate engine
        blocks, copy the tier blocks in, advance num_computed. Returns the tokens loaded."""
        # Every full block may be loaded; the last prompt token is then recomputed into its
        # (fresh, unshared) block, because its logits are needed.
        usable = seq.num_tokens // self.block_tokens
        first = seq.num_computed // self.block_tokens          # tier blocks the engine already has
        if usable <= first:
            return 0
        store = self._get_store()
        if store is None:
            return 0
        keys = self.tier_keys(seq, usable)[first:]
        self.stats["lookups"] += 1
        t0 = time.perf_counter()
        try:
            lease = store.acquire(self.ns, keys)
        except _STORE_ERRORS as e:
            self.stats["load_failures"] += 1
            self._failed(e, "load")
            return 0
        self._ok()
        try:
            n = len(lease)
            while n and not block_manager.can_allocate(seq, (first + n) * self.block_tokens - seq.num_computed):
                n -= 1
            if n == 0:
                return 0
            have = len(seq.block_table)                        # engine blocks already in place
            block_manager.allocate(seq, (first + n) * self.block_tokens - seq.num_computed)
            for j in range(n):
                tb = np.asarray(lease.buffers[j]).reshape(len(self._k), 2, self.ratio, self._per_block)
                base = (first + j) * self.ratio
                e0 = max(0, have - base)                        # engine blocks still to fill
                bids = seq.block_table[base + e0:base + self.ratio]
                if bids and bids[-1] - bids[0] == len(bids) - 1 and bids == list(range(bids[0], bids[-1] + 1)):
                    rows = slice(bids[0], bids[-1] + 1)         # contiguous: plain memcpy per layer
                else:
                    rows = bids
                for layer in range(len(self._k)):
                    self._k[layer][rows] = tb[layer, 0, e0:]
                    self._v[layer][rows] = tb[layer, 1, e0:]
            upto = min((first + n) * self.block_tokens, seq.num_tokens - 1)
            loaded = upto - seq.num_computed
            seq.num_computed = upto
            seq.tier_loaded = first + n
            seq.tier_sources = sorted(set(lease.tiers[:n]))
            self.stats["hit_blocks"] += n
            self.stats["loaded_tokens"] += loaded
            self.stats["loaded_bytes"] += n * self.ns.block_bytes
            self.stats["load_s"] += time.perf_counter() - t0
            return loaded
        finally:
            try:
                lease.__exit__(None, None, None)
            except _STORE_ERRORS:
                pass

    # -- store after each step ----------------------------------------------------------------------
    def save(self, seq) -> None:
        """Queue the tier blocks this sequence has filled since the last call (not those it
        loaded). Copies the bytes out of the engine cache now; never waits for the store."""
        full = seq.num_computed // self.block_tokens
        start = max(seq.tier_saved, seq.tier_loaded)
        if full <= start or time.monotonic() < self._down_until:
            seq.tier_saved = max(seq.tier_saved, full)
            return
        keys = self.tier_keys(seq, full)
        for i in range(start, full):
            bids = seq.block_table[i * self.ratio:(i + 1) * self.ratio]
            if len(bids) < self.ratio or min(bids) < 0:        # sliding window freed part of it
                continue
            block = np.empty((len(self._k), 2, self.ratio, self._per_block), dtype=np.uint8)
            for layer in range(len(self._k)):
                block[layer, 0] = self._k[layer][bids]
                block[layer, 1] = self._v[layer][bids]
            with self._lock:
                try:
                    self._queue.put_nowait((keys[i], keys[i - 1] if i else None, block.reshape(-1)))
                    self._pending += 1
                except queue.Full:
                    self.stats["stores_dropped"] += 1
        seq.tier_saved = full

    def _store_loop(self) -> None:
        while not self._stop:
            try:
                item = self._queue.get(timeout=0.1)
            except queue.Empty:
                continue
            batch = [item]
            while len(batch) < 16:
                try:
                    batch.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            try:
                self._put_batch(batch)
            finally:
                with self._lock:
                    self._pending -= len(batch)

    def _put_batch(self, batch) -> None:
        store = self._get_store()
        if store is None:
            self.stats["stores_dropped"] += len(batch)
            return
        # consecutive blocks of one chain go in one put
        runs, run = [], [batch[0]]
        for it in batch[1:]:
            if it[1] == run[-1][0]:
                run.append(it)
            else:
                runs.append(run)
                run = [it]
        runs.append(run)
        for run in runs:
            try:
                store.put(self.ns, [k for k, _, _ in run], [b for _, _, b in run], parent=run[0][1])
                self.stats["stored_blocks"] += len(run)
                self._ok()
            except _STORE_ERRORS as e:
                self.stats["store_failures"] += len(run)
                self._failed(e, "store")
                return

    def flush(self, timeout_s: float = 30.0) -> None:
        """Wait until every queued store has been handed to the store (tests, shutdown)."""
        deadline = time.monotonic() + timeout_s
        while self._pending and time.monotonic() < deadline:
            time.sleep(0.005)

    def close(self) -> None:
        self.flush(5.0)
        self._stop = True
        self._worker.join(5)
        if self._owns_store and self.store is not None:
            try:
                self.store.close()
            except _STORE_ERRORS:
                pass
