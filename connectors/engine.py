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

import time

import torch

from tierd.errors import TierdError
from tierd.kernels.transfer import host_tensor
from tierd.keys import extend_keys
from tierd.namespace import Namespace

from .link import STORE_ERRORS, StoreLink


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
        self.link = StoreLink(store, max_pending_blocks=max_pending_blocks, retry_after_s=retry_after_s)
        self.stats = self.link.stats
        # byte views of the caches: (num_blocks, bytes per engine block) per layer, K and V, on
        # the engine's device (host copies of tier blocks go to and from it)
        self._k = [k.view(torch.uint8).reshape(k.shape[0], -1) for k, _ in kv_caches]
        self._v = [v.view(torch.uint8).reshape(v.shape[0], -1) for _, v in kv_caches]
        self._per_block = self._k[0].shape[1]
        self.device = self._k[0].device

    @property
    def store(self):
        return self.link.store

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
        store = self.link.get()
        if store is None:
            return 0
        keys = self.tier_keys(seq, usable)[first:]
        self.stats["lookups"] += 1
        t0 = time.perf_counter()
        try:
            lease = store.acquire(self.ns, keys)
        except STORE_ERRORS as e:
            self.stats["load_failures"] += 1
            self.link.failed(e, "load")
            return 0
        self.link.ok()
        try:
            n = len(lease)
            while n and not block_manager.can_allocate(seq, (first + n) * self.block_tokens - seq.num_computed):
                n -= 1
            if n == 0:
                return 0
            have = len(seq.block_table)                        # engine blocks already in place
            block_manager.allocate(seq, (first + n) * self.block_tokens - seq.num_computed)
            for j in range(n):
                # one copy of the tier block to the engine's device; the lease ends after the loop
                tb = host_tensor(lease.buffers[j]).view(len(self._k), 2, self.ratio, self._per_block).to(self.device)
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
        for i in range(start, full):
            bids = seq.block_table[i * self.ratio:(i + 1) * self.ratio]
            if len(bids) < self.ratio or min(bids) < 0:        # sliding window freed part of it
                continue
            idx = torch.tensor(bids, device=self.device)
            block = torch.stack([torch.stack((self._k[layer][idx], self._v[layer][idx]))
                                 for layer in range(len(self._k))])     # (layers, 2, ratio, bytes)
            bt = self.block_tokens
            self.link.submit(self.ns, keys[i], keys[i - 1] if i else None, block.reshape(-1).cpu().numpy(),
                             seq.token_ids[i * bt:(i + 1) * bt])
        seq.tier_saved = full

    def flush(self, timeout_s: float = 30.0) -> None:
        """Wait until every queued store has been handed to the store (tests, shutdown)."""
        self.link.flush(timeout_s)

    def close(self) -> None:
        self.link.close()
