"""SGLang HiCache storage backend on tierd: SGLang's hierarchical cache (GPU, host, storage)
keeps its third tier in a tierd daemon, shared by every engine process of a node.

Launch SGLang with::

    python -m sglang.launch_server --model-path MODEL --enable-hierarchical-cache \\
        --hicache-storage-backend dynamic \\
        --hicache-storage-backend-extra-config '{"backend_name": "tierd",
            "module_path": "tierd.connectors.sglang", "class_name": "TierdStorage",
            "interface_v1": 1, "url": "unix:///run/tierd/tierd.sock"}'

Extra-config keys (besides SGLang's own, all optional):

- ``url``: the Store URL (``unix:///run/tierd/tierd.sock`` by default, or ``$TIERD_URL``).
- ``interface_v1``: ``1`` (recommended) selects SGLang's zero-copy calls: pages are copied
  straight between SGLang's host pool and the daemon's shared-memory slots. Without it SGLang
  uses the generic calls (a flat page tensor per key), whose byte order differs: the two never
  share a namespace.
- ``model``: an explicit model revision for the namespace instead of the weights' fingerprint
  (needed when the model is a hub name rather than a local directory).
- ``draft_model``: the same for a speculative draft model whose layers the host pool holds.
- ``fingerprint``: ``"full"`` (default: every weight byte) or ``"sampled"``.
- ``lookup_deadline_ms``: a lookup waits at most this long (100 by default); one that does not
  answer counts as a miss and starts a back-off, during which lookups do not ask at all.
- ``lookup_index``: answer lookups from the daemon's shared index (off by default, as in the
  vLLM connector: an index answer can outlive a daemon stall by 100 ms).
- ``timeout_s``: loads and stores to a daemon (1 by default, under SGLang's prefetch deadline of
  1 s + 0.25 s per 1,024 tokens).
- ``load_policy``: ``"decide"`` (default, or ``$TIERD_LOAD_POLICY``) reports as a hit only the
  pages worth loading (below); ``"always"`` every page found.

Hits worth loading. SGLang asks `batch_exists` how many leading pages storage holds before it
prefetches them; the backend answers with the longest prefix of them whose load, tier by tier, the
node's cost model (tierd/costs.py) predicts to finish before recomputing it would. Pages in host
RAM followed by pages on a slow disk: the head is reported and loaded, the tail computed. The
tokens declined go in the model's ledger, and a declined tier is re-measured now and then by
loading a few of its pages off the request's path. The model learns from this engine too: every
load (tier, bytes, seconds; a "slow hit" where it took longer than computing its tokens), and
every prefill forward of the scheduler, timed through tierd's SGLang plugin (below). Deciding
changes no byte and no token: a page is loaded whole or computed.

Identity. SGLang's page keys chain the token ids and the request's `extra_key`/`cache_salt`, but
name no model, rank, dtype or layout; the namespace adds them, from the engine's server arguments
through the identity every integration uses (`connectors/identity.py`): the model's weight
fingerprint with its load-time settings (`--quantization`, `--modelopt-quant`,
`--json-model-override-args`, an explicit `--dtype`, dummy weights) and the draft model whose layers
the host pool holds, the KV cache dtype (the pool's; mxfp8 and fp4 caches are declined) and where
fp8 scales come from (the checkpoint, `--quantization-param-path`), the page layout and byte
order, page size, layers (a pipeline stage's range), KV heads and head size as this rank holds
them, tensor-parallel rank and size, and context-parallel splits. LoRA engines are declined with
one logged line: SGLang names an adapter in its page keys by name and path, and its storage calls
tell a backend no page's adapter, so the content of an adapter cannot be keyed. A tier key is `blake2b(namespace root || SGLang key)`, so keys
of two namespaces never meet. MLA models keep one latent row per token, the same on every rank:
one namespace for all ranks, written by SGLang's writer rank, read by every rank.

Failures are misses: a daemon that is down, stalled or restarting makes lookups answer 0 and
loads and stores answer False (SGLang recomputes), never an exception into SGLang and never a
wait past `timeout_s`. Hybrid models' extra pools (Mamba state, SWA windows) are declined with
one logged line: their v2 calls report no hit and store nothing.

The plugin. tierd's SGLang plugin (entry point `sglang.srt.plugins`, loaded by SGLang in every
process where tierd is installed) hooks two things. Shutdown: SGLang's `Engine.shutdown` kills its
scheduler processes without waiting for their storage writes; the plugin makes it first wait until
every scheduler has no host or storage write pending (at most ``$TIERD_SGLANG_DRAIN_S`` seconds,
30 by default). Forwards: the scheduler's `run_batch` of a prefill (extend or mixed) batch that
loads nothing from SGLang's host pool is timed, as wall time on a CPU and by CUDA events read once
they have passed on a GPU (never a synchronize), for the recompute estimate of every backend of
the process.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import threading
import time
import weakref
from collections.abc import Sequence
from typing import Any

import numpy as np

from tierd.costs import primary_tier
from tierd.costs import load_policy as costs_load_policy
from tierd.errors import LeaseError
from tierd.namespace import Namespace, read_model_config
from tierd.transfer import address

from . import identity
from .link import DEFAULT_URL, STORE_ERRORS, StoreLink, holding, open_store

try:  # SGLang is optional: its base class where it is installed, a stand-in where it is not
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorage, PoolTransferResult
    HAVE_SGLANG = True
except ImportError:
    HAVE_SGLANG = False

    class HiCacheStorage:  # type: ignore[no-redef]
        """Stand-in for SGLang's storage base class (its registration hooks)."""

        def register_mem_pool_host(self, mem_pool_host):
            self.mem_pool_host = mem_pool_host

        def register_mem_host_pool_v2(self, host_pool, host_pool_name):
            if not hasattr(self, "registered_pools"):
                self.registered_pools = {}
            self.registered_pools[host_pool_name] = host_pool

        def on_host_pools_registered(self) -> None:
            pass

    class PoolTransferResult:  # type: ignore[no-redef]
        """Stand-in for SGLang's per-pool hit report."""

        def __init__(self, kv_hit_pages: int, extra_pool_hit_pages: dict):
            self.kv_hit_pages, self.extra_pool_hit_pages = kv_hit_pages, extra_pool_hit_pages

__all__ = ["HAVE_SGLANG", "TierdStorage", "sglang_plugin", "tier_keys"]

log = logging.getLogger("tierd.connectors.sglang")

_KEY_DOMAIN = b"tierd/sglang-page/v1\x00"
STAT_NAMES = ("lookups", "hit_pages", "loaded_pages", "load_failures", "stored_pages", "stores_present",
              "store_failures", "lost_leases", "lookup_failures", "declined_pages", "slow_hits", "probes")
# Every backend of this (scheduler) process, for the forward timings of the plugin's hook.
_BACKENDS: weakref.WeakSet = weakref.WeakSet()


def tier_keys(root: bytes, keys: Sequence[str]) -> list[bytes]:
    """tierd's 16-byte keys for SGLang page keys in the namespace whose root key is `root`."""
    head = _KEY_DOMAIN + root
    return [hashlib.blake2b(head + str(k).encode(), digest_size=16).digest() for k in keys]


class _Disabled(Exception):
    """This backend cannot serve the engine's layout: every call is a miss."""


def _pool_geometry(pool, is_mla: bool, zero_copy: bool) -> dict[str, Any]:
    """The host pool's page geometry as namespace fields: how one page's bytes are ordered in
    a tier block. Raises _Disabled for a pool whose bytes this backend does not know."""
    layout = str(getattr(pool, "layout", ""))
    dtype = str(pool.dtype)
    page = int(pool.page_size)
    layers = int(pool.layer_num)
    if is_mla:
        dim = getattr(pool, "kv_cache_dim", None)
        if dim is None or type(pool).__name__ != "MLATokenToKVPoolHost":
            raise _Disabled(f"MLA host pool {type(pool).__name__} is not a plain latent pool")
        heads, head_dim, planes = 1, int(dim), 1
    else:
        if type(pool).__name__ != "MHATokenToKVPoolHost":
            raise _Disabled(f"host pool {type(pool).__name__} (quantized or packed pages) is not supported")
        heads, head_dim, planes = int(pool.head_num), int(pool.head_dim), 2
    # The zero-copy calls on a layer_first pool give, per page and layer, a K run then a V run
    # (MLA: one latent run): [layers, 2, page, heads, dim] (MLA [layers, page, latent]), tierd's
    # own block layout. Any other pool layout or call path orders bytes otherwise: named.
    canonical = zero_copy and layout == "layer_first"
    if layout not in ("layer_first", "page_first", "page_first_direct", "page_head") or \
            (is_mla and layout == "page_head"):
        raise _Disabled(f"host pool layout {layout!r} is not supported")
    return dict(kv_dtype=dtype, num_layers=layers, num_kv_heads=heads, head_dim=head_dim, block_tokens=page,
                planes=planes, layout="" if canonical else f"sglang:{'v1' if zero_copy else 'flat'}:{layout}")


class TierdStorage(HiCacheStorage):
    """SGLang HiCache storage backend whose pages live in tierd (see the module docstring)."""

    def __init__(self, storage_config, kwargs: dict | None = None):
        self.config = storage_config
        extra = dict(getattr(storage_config, "extra_config", None) or {})
        self.zero_copy = bool(int(extra.get("interface_v1", 0) or 0))
        self.is_mla = bool(getattr(storage_config, "is_mla_model", False))
        self.ns: Namespace | None = None
        self.root = b""
        self.block_bytes = 0
        self.disabled: str | None = None
        self.stats = dict.fromkeys(STAT_NAMES, 0)
        self._stats_lock = threading.Lock()
        self._warned: set[str] = set()
        self.load_policy = costs_load_policy(extra.get("load_policy"))   # "decide" or "always"
        # Every rank decides and loads for itself, and the node's ledger counts each request's
        # tokens once: the first rank of the tensor-parallel group counts them.
        self._counts_ledger = int(getattr(storage_config, "tp_rank", 0) or 0) == 0
        url = str(extra.get("url") or os.environ.get("TIERD_URL", DEFAULT_URL))
        self.url = url
        timeout_s = float(extra.get("timeout_s", 1.0))
        deadline_s = float(extra.get("lookup_deadline_ms", 100)) / 1e3
        store = open_store(url)
        # Lookups, loads and stores each on their own connection: a timeout on one (which
        # gives its connection up) never drops the slots another holds.
        self.lookup_link = StoreLink(store, timeout_s=deadline_s, retries=0, background_connect=True,
                                     name="tierd-sglang-lookup", use_index=bool(extra.get("lookup_index", False)))
        prefault = bool(extra.get("prefault", True))    # map the arena's pages before the first copy
        self.load_link = StoreLink(store, timeout_s=timeout_s, retries=0, background_connect=True,
                                   name="tierd-sglang-load", prefault=prefault, read_index=True)  # pipelined leases
        self.save_link = StoreLink(store, timeout_s=timeout_s, retries=0, background_connect=True,
                                   name="tierd-sglang-save", prefault=prefault)
        self._extra = extra
        _BACKENDS.add(self)

    def register_mem_pool_host(self, mem_pool_host) -> None:
        super().register_mem_pool_host(mem_pool_host)
        if self.disabled is None:
            try:
                self.ns = self._namespace(mem_pool_host)
                self.root = self.ns.root_key
                self.block_bytes = self.ns.block_bytes
            except (_Disabled, identity.Declined) as e:
                self.disabled = str(e)
            except Exception as e:  # noqa: BLE001 -- never fail SGLang's start-up over the cache
                self.disabled = f"cannot describe the host pool ({type(e).__name__}: {e})"
        if self.disabled:
            log.warning("tierd storage backend disabled (every lookup is a miss): %s", self.disabled)
        else:
            log.info("tierd storage backend: namespace %s (%s), %d bytes a page, %s",
                     self.ns.name, self.ns.layout or "layer_first", self.block_bytes, self.url)
            # connect now, each link, with the daemon knowing the namespace: the first request's
            # lookup, load and save then pay for neither
            self.lookup_link.warm(namespaces=[self.ns], wait=True)
            for link in (self.load_link, self.save_link):
                link.warm(namespaces=[self.ns])

    def register_mem_host_pool_v2(self, host_pool, host_pool_name) -> None:
        super().register_mem_host_pool_v2(host_pool, host_pool_name)
        if str(host_pool_name) not in ("kv", "PoolName.KV"):
            self._warn_once("v2", f"tierd storage backend: the hybrid model's {host_pool_name} pool is not "
                                  "cached (its v2 calls report no hit and store nothing)")

    def _namespace(self, pool) -> Namespace:
        cfg, extra = self.config, self._extra
        geo = _pool_geometry(pool, self.is_mla, self.zero_copy)
        if int(getattr(cfg, "dcp_size", 1) or 1) > 1:
            raise _Disabled("decode context parallelism (page shards per rank) is not supported")
        if int(getattr(cfg, "attn_cp_size", 1) or 1) > 1:
            raise _Disabled("attention context parallelism is not supported")
        # the pool's layers past the target model's are a draft model's (SGLang packs them in)
        draft_layers = int(pool.layer_num) - int(getattr(pool, "target_layer_num", None) or pool.layer_num)
        settings = identity.from_sglang(engine_server_args(), getattr(cfg, "model_name", None),
                                        revision=extra.get("model"),
                                        fingerprint=str(extra.get("fingerprint", "full")),
                                        draft_layers=max(0, draft_layers), draft_revision=extra.get("draft_model"))
        # the KV cache dtype is the pool's (the cache's, not the model's), checked against the settings
        ident = identity.identify(settings, kv_dtype=str(geo.pop("kv_dtype")))
        tp_rank, tp_size = int(cfg.tp_rank), int(cfg.tp_size)
        if self.is_mla:
            tp_rank, tp_size = 0, 1    # the same latent rows on every rank: one namespace
        layers = ""
        pp_size = int(getattr(cfg, "pp_size", 1) or 1)
        start, end = int(getattr(pool, "start_layer", 0) or 0), int(getattr(pool, "end_layer", 0) or 0)
        if pp_size > 1:
            total = _total_layers(settings.model)
            if end - start != geo["num_layers"] or not 0 <= start < end <= total:
                raise _Disabled(f"pipeline stage layers {start}..{end} of {total} do not match the pool's "
                                f"{geo['num_layers']}")
            layers = f"{start}-{end}/{total}"
        return ident.namespace(tp_rank=tp_rank, tp_size=tp_size, layers=layers, **geo)

    # -- helpers ---------------------------------------------------------------------------------
    def _warn_once(self, what: str, msg: str) -> None:
        if what not in self._warned:
            self._warned.add(what)
            log.warning(msg)

    def _count(self, **kw: int) -> None:
        with self._stats_lock:
            for k, v in kw.items():
                self.stats[k] += v

    def _keys(self, keys: Sequence[str]) -> list[bytes]:
        return tier_keys(self.root, keys)

    def _parent(self, extra_info) -> bytes | None:
        prefix = getattr(extra_info, "prefix_keys", None) if extra_info is not None else None
        return self._keys(prefix[-1:])[0] if prefix else None

    def _page_runs(self, host_indices, n: int) -> list[list[tuple[int, int]]] | None:
        """Per page, its (address, bytes) runs in the host pool, in tier-block order."""
        ptrs, sizes = self.mem_pool_host.get_page_buffer_meta(host_indices)
        if not n or len(ptrs) % n:
            return None
        per = len(ptrs) // n
        runs = [list(zip(ptrs[i * per:(i + 1) * per], sizes[i * per:(i + 1) * per])) for i in range(n)]
        if any(sum(s for _, s in r) != self.block_bytes for r in runs):
            self._warn_once("sizes", "tierd storage backend: the host pool's page runs do not add up to a "
                                     f"tier block ({self.block_bytes} bytes); pages are not cached")
            return None
        return runs

    # -- lookups ---------------------------------------------------------------------------------
    def batch_exists(self, keys: list[str], extra_info=None) -> int:
        """How many leading pages of `keys` to report as hits (0 on any failure): with the
        "decide" load policy those of the pages tierd holds worth loading (`_decide`), else all
        it holds. SGLang asks once per batch of at most 128 pages, each batch's `prefix_keys`
        naming the pages before it."""
        if self.disabled or self.ns is None or not keys:
            return 0
        link = self.lookup_link
        store = link.get()
        if store is None:
            return 0
        tkeys = self._keys(keys)
        try:
            n = int(store.lookup(self.ns, tkeys))
            where = store.where(self.ns, tkeys[:n]) if n and self.load_policy == "decide" else None
        except STORE_ERRORS as e:
            link.failed(e, "lookup")
            self._count(lookups=1, lookup_failures=1)
            return 0
        link.ok()
        if where is not None:
            n = self._decide(tkeys[:n], where, extra_info)
        self._count(lookups=1, hit_pages=n)
        return n

    def _decide(self, tkeys: list[bytes], where: list[str], extra_info) -> int:
        """Of the pages found (`tkeys`, `where` they are), the leading ones whose load the cost
        model predicts to beat computing them; the tokens of the others go in its ledger as
        declined, and a declined tier is probed when due (on the load link, off this thread)."""
        model = self.lookup_link.cost_model()
        if model is None:
            return len(tkeys)
        bt = self.ns.block_tokens
        # `where` names host and disk copies: a page the lookup found in neither is remote
        tiers = [primary_tier(w) or "remote" for w in where[:len(tkeys)]]
        prefix = getattr(extra_info, "prefix_keys", None) if extra_info is not None else None
        plan = model.plan(self.ns.name, tiers, self.block_bytes, bt, first_tokens=len(prefix or ()) * bt)
        for tier, pages in plan.declined().items():
            if self._counts_ledger:
                model.count(tier, declined_tokens=pages * bt)
            self._count(declined_pages=pages)
        tier, run = plan.probe_run(tkeys)
        if run and self.load_link.probe(self.ns, run, tier, model):     # (on a thread of its own)
            self._count(probes=1)
        return min(len(tkeys), plan.blocks)

    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    def batch_exists_v2(self, keys, pool_transfers=None, extra_info=None):
        """Hybrid models: their extra pools are not cached, so nothing is a hit."""
        self._warn_once("v2", "tierd storage backend: hybrid models' extra pools are not cached (no hit)")
        return PoolTransferResult(0, {name: 0 for name in _pool_names(pool_transfers or ())})

    # -- loads -----------------------------------------------------------------------------------
    def _load(self, keys: list[str], copy, extra_info=None) -> int | None:
        """Lease the leading present pages of `keys` and `copy(i, slot)` each into SGLang's
        memory: how many pages arrived whole under a lease that held, None on a failure (then
        none counts). The load's time goes in the cost model (`_observe_load`)."""
        store = self.load_link.get()
        if store is None:
            return None
        got = 0
        t0 = time.perf_counter()
        try:
            lease = store.acquire(self.ns, self._keys(keys), pipelined=True)   # confirmed below
            try:
                with holding(store, lease):
                    for i, buf in enumerate(lease.buffers):
                        copy(i, buf)
                        got += 1
            finally:
                store.release(lease, confirm=True)   # LeaseError: the bytes may be torn, none count
        except LeaseError as e:
            self._count(lost_leases=1, load_failures=1)
            log.warning("tierd load lost its lease (%s); %d pages are recomputed", e, len(keys))
            return None
        except STORE_ERRORS as e:
            self.load_link.failed(e, "load")
            self._count(load_failures=1)
            return None
        self.load_link.ok()
        self._count(loaded_pages=got)
        if got:
            prefix = getattr(extra_info, "prefix_keys", None) if extra_info is not None else None
            self._observe_load(list(lease.tiers[:got]), got, time.perf_counter() - t0,
                               len(prefix or ()) * self.ns.block_tokens)
        return got

    def _observe_load(self, tiers: list[str], pages: int, seconds: float, first_tokens: int) -> None:
        """A load of `pages` pages (from `tiers`, per page) after `first_tokens` took `seconds`:
        for the cost model (`CostModel.record_load`; the first rank keeps the ledger)."""
        model = self.load_link.cost_model()
        if model is None:
            return
        if model.record_load(self.ns.name, tiers, pages * self.block_bytes, pages * self.ns.block_tokens, seconds,
                             first_tokens=first_tokens, ledger=self._counts_ledger):
            self._count(slow_hits=1)

    def batch_get_v1(self, keys: list[str], host_indices, extra_info=None) -> list[bool]:
        """Copy the leading present pages of `keys` from leased slots straight into SGLang's host
        pool at `host_indices`; True for each page that arrived whole under a lease that held."""
        n = len(keys)
        if self.disabled or self.ns is None or not n:
            return [False] * n
        runs = self._page_runs(host_indices, n)
        if runs is None:
            return [False] * n

        def copy(i, buf):
            base, off = address(buf), 0
            for addr, size in runs[i]:
                ctypes.memmove(addr, base + off, size)
                off += size
        got = self._load(keys, copy, extra_info) or 0
        return [True] * got + [False] * (n - got)

    # -- stores ----------------------------------------------------------------------------------
    def batch_set_v1(self, keys: list[str], host_indices, extra_info=None) -> list[bool]:
        """Copy pages from SGLang's host pool straight into reserved slots and commit them; True
        for pages stored now or already present."""
        n = len(keys)
        if self.disabled or self.ns is None or not n:
            return [False] * n
        runs = self._page_runs(host_indices, n)
        store = self.save_link.get() if runs is not None else None
        if store is None:
            return [False] * n
        res = None
        try:
            res = store.reserve(self.ns, self._keys(keys), parent=self._parent(extra_info))
            with holding(store, res):
                for status, buf, page in zip(res.status, res.buffers, runs):
                    if status != "reserved":
                        continue
                    base, off = address(buf), 0
                    for addr, size in page:
                        ctypes.memmove(base + off, addr, size)
                        off += size
            stored = store.commit(res)
        except STORE_ERRORS as e:
            if res is not None:
                try:
                    store.abort(res)
                except STORE_ERRORS:
                    pass
            self.save_link.failed(e, "store")
            self._count(store_failures=1)
            return [False] * n
        self.save_link.ok()
        whole = stored == res.num_reserved      # else some reserved page was not committed
        ok = [s == "present" or (s == "reserved" and whole) for s in res.status]
        self._count(stored_pages=stored, stores_present=sum(s == "present" for s in res.status))
        return ok + [False] * (n - len(ok))

    def batch_set_v2(self, transfers, extra_info=None) -> dict[str, list[bool]]:
        self._warn_once("v2", "tierd storage backend: hybrid models' extra pools are not cached (nothing stored)")
        return _none_done(transfers)

    def batch_get_v2(self, transfers, extra_info=None) -> dict[str, list[bool]]:
        return _none_done(transfers)

    # -- the generic calls (SGLang without interface_v1): one flat page tensor per key ----------
    def get(self, key: str, target_location=None, target_sizes=None):
        out = self.batch_get([key], [target_location] if target_location is not None else None)
        return out[0] if out else None

    def batch_get(self, keys: list[str], target_locations=None, target_sizes=None) -> list:
        """Fill each of `target_locations` (flat page tensors) with its page; the tensor, or None
        from the first page not held on."""
        n = len(keys)
        if self.disabled or self.ns is None or not n or target_locations is None:
            return [None] * n
        dsts = [_as_bytes(t, self.block_bytes) for t in target_locations]
        if any(d is None for d in dsts):
            self._warn_once("flat", "tierd storage backend: a target page is not a contiguous tensor of "
                                    f"{self.block_bytes} bytes; not loaded")
            return [None] * n
        got = self._load(keys, lambda i, buf: np.copyto(dsts[i], buf, casting="no")) or 0
        return [target_locations[i] if i < got else None for i in range(n)]

    def set(self, key: str, value=None, target_location=None, target_sizes=None) -> bool:
        return self.batch_set([key], [value])

    def batch_set(self, keys: list[str], values=None, target_locations=None, target_sizes=None) -> bool:
        """Store flat page tensors; True when every page is stored or already held."""
        n = len(keys)
        if self.disabled or self.ns is None or not n or values is None or len(values) != n:
            return False
        srcs = [_as_bytes(v, self.block_bytes) for v in values]
        if any(s is None for s in srcs):
            self._warn_once("flat", "tierd storage backend: a page is not a contiguous tensor of "
                                    f"{self.block_bytes} bytes; not stored")
            return False
        store = self.save_link.get()
        if store is None:
            return False
        try:
            stored = store.put(self.ns, self._keys(keys), srcs)
        except STORE_ERRORS as e:
            self.save_link.failed(e, "store")
            self._count(store_failures=1)
            return False
        self.save_link.ok()
        self._count(stored_pages=stored)
        return True

    # -- the recompute estimate ---------------------------------------------------------------------
    def observe_forward(self, batch, seconds: float) -> None:
        """A prefill forward of this process's engine: (new tokens, cached tokens before them)
        per request, and its seconds (from the plugin's `run_batch` hook). Recorded in the lookup
        link's replica of the cost model, which `_decide` reads, and then exchanged with the
        daemon's off this thread."""
        store = self.lookup_link.store
        if self.disabled or self.ns is None or store is None:
            return
        store.cost_model(sync=False).observe_forward(self.ns.name, batch, seconds)
        self.lookup_link.cost_model()     # (starts the exchange when it is due)

    # -- lifecycle -------------------------------------------------------------------------------
    def clear(self) -> None:
        """SGLang's `clear`: tierd's pages are shared with other engines, so nothing is deleted
        (`tierd flush` does that for an operator)."""

    def get_stats(self):
        return None

    def close(self) -> None:
        for link in (self.lookup_link, self.load_link, self.save_link):
            try:
                link.close()
            except Exception:  # noqa: BLE001
                log.debug("closing a tierd link failed", exc_info=True)


def _pool_names(transfers) -> list[str]:
    return [str(getattr(t, "name", "")) for t in transfers]


def _none_done(transfers) -> dict[str, list[bool]]:
    """A v2 call's answer for pools this backend does not cache: no page of any pool done."""
    return {name: [False] * len(getattr(t, "keys", None) or ()) for name, t in zip(_pool_names(transfers), transfers)}


def _as_bytes(t, nbytes: int) -> np.ndarray | None:
    """A torch tensor or array as a flat uint8 view of exactly `nbytes`, or None."""
    try:
        import torch
        if isinstance(t, torch.Tensor):
            if t.device.type != "cpu" or not t.is_contiguous():
                return None
            a = t.view(-1).view(torch.uint8).numpy()
        else:
            a = np.asarray(t).reshape(-1).view(np.uint8)
    except (TypeError, ValueError, RuntimeError):
        return None
    return a if a.nbytes == nbytes else None


def engine_server_args():
    """SGLang's server arguments in this (scheduler) process, where the storage backend is
    made; None without SGLang (tools, tests). An SGLang that does not publish them cannot say
    what its engine loaded (quantization, overrides, LoRA, draft model): `identity.Declined`."""
    if not HAVE_SGLANG:
        return None
    try:
        from sglang.srt.runtime_context import get_server_args
        return get_server_args()
    except Exception as e:  # noqa: BLE001 - another SGLang version, or not published yet
        raise identity.Declined(f"SGLang's server arguments are not available ({type(e).__name__}: {e}): "
                                "the settings that change KV cannot be checked") from None


def _total_layers(model_dir: str) -> int:
    cfg = read_model_config(model_dir)
    return int(cfg.get("num_hidden_layers") or cfg.get("n_layer") or cfg.get("num_layers"))


# -- SGLang plugin: an engine's shutdown waits for its storage writes --------------------------
DRAIN_RPC = "tierd_storage_pending"
DRAIN_DEFAULT_S = 30.0
DRAIN_SETTLE_S = 0.05


def sglang_plugin() -> None:
    """SGLang general plugin (entry point `sglang.srt.plugins`, loaded by SGLang in each of its
    processes): `Engine.shutdown` first waits for the schedulers' pending host and storage
    writes, at most $TIERD_SGLANG_DRAIN_S seconds (30; 0 turns the wait off), and only for an
    engine whose storage backend is this module's; the schedulers' prefill forwards are timed
    for the backends' cost model (`_run_batch_hook`). Set TIERD_SGLANG_PLUGIN=0 to load
    nothing."""
    if os.environ.get("TIERD_SGLANG_PLUGIN", "1") == "0":
        return
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType
    HookRegistry.register("sglang.srt.entrypoints.engine.Engine.shutdown", _shutdown_hook, HookType.AROUND)
    HookRegistry.register("sglang.srt.managers.scheduler.Scheduler.handle_rpc_request", _rpc_hook,
                          HookType.AROUND)
    HookRegistry.register("sglang.srt.managers.scheduler.Scheduler.run_batch", _run_batch_hook, HookType.AROUND)


# -- the plugin's forward timings: the recompute estimate ------------------------------------------
TIMED_MODES = ("EXTEND", "MIXED")   # prefill batches (mixed: with decodes); not a verify or a split
FORWARD_EVENTS_KEPT = 64            # CUDA timings waiting to be read (never more than a few steps)
_forward_events: list = []          # (start, end, terms) of CUDA forwards, oldest first


def _run_batch_hook(original, self, batch, *args, **kwargs):
    """(In each scheduler, around `Scheduler.run_batch`.) Time a prefill batch for the cost
    model of every backend of this process. Nothing here raises into SGLang, and without a
    backend of this module nothing is done."""
    timing = _begin_forward(self, batch) if _BACKENDS else None
    result = original(self, batch, *args, **kwargs)
    if timing is not None:
        _end_forward(timing)
    return result


def _begin_forward(scheduler, batch):
    """What `_end_forward` needs to time this batch's forward, or None where it is not timed:
    not a prefill, or one that also waits for pages loaded from SGLang's host pool (their copies
    would count as compute), a pipeline stage (one of several forwards in flight), or a device
    whose work cannot be timed without a synchronize."""
    try:
        _read_forward_events()
        mode = getattr(getattr(batch, "forward_mode", None), "name", "")
        if mode not in TIMED_MODES or getattr(batch, "hicache_consumer_index", -1) >= 0:
            return None
        if int(getattr(getattr(scheduler, "pp_group", None), "world_size", 1) or 1) > 1:
            return None
        terms = [(int(n), int(k)) for n, k in zip(batch.extend_lens or (), batch.prefix_lens or ())]
        if not terms:
            return None
        device = str(getattr(scheduler, "device", "cpu"))
        if device == "cpu":
            return time.perf_counter(), None, terms
        if not device.startswith("cuda"):
            return None
        import torch
        # the forward runs on the scheduler's forward stream when it overlaps, else on the
        # current one; an event there passes once the work queued before it has run
        stream = None
        if getattr(scheduler, "enable_overlap", False):
            stream = getattr(scheduler, "forward_stream", None)
            if stream is None:
                return None
        start = torch.cuda.Event(enable_timing=True)
        start.record(stream)
        return start, stream, terms
    except Exception:  # noqa: BLE001 -- a measurement: never SGLang's error
        log.debug("tierd: a forward was not timed", exc_info=True)
        return None


def _end_forward(timing) -> None:
    start, stream, terms = timing
    try:
        if isinstance(start, float):
            _observe_forward(terms, time.perf_counter() - start)
            return
        import torch
        end = torch.cuda.Event(enable_timing=True)
        end.record(stream)
        _forward_events.append((start, end, terms))
        del _forward_events[:-FORWARD_EVENTS_KEPT]
    except Exception:  # noqa: BLE001
        log.debug("tierd: a forward was not timed", exc_info=True)


def _read_forward_events() -> None:
    """Observe the CUDA forwards whose end event has passed (`query`: no wait)."""
    while _forward_events and _forward_events[0][1].query():
        start, end, terms = _forward_events.pop(0)
        _observe_forward(terms, start.elapsed_time(end) / 1e3)


def _observe_forward(terms, seconds: float) -> None:
    for backend in list(_BACKENDS):
        try:
            backend.observe_forward(terms, seconds)
        except Exception:  # noqa: BLE001
            log.debug("tierd: a forward timing was not recorded", exc_info=True)


def pending_writes(scheduler) -> int:
    """Host write-throughs and storage backups one scheduler has issued and not yet seen end,
    plus one while it is settling (see `_settling`)."""
    cache = getattr(scheduler, "tree_cache", None)
    n = sum(len(getattr(cache, name, None) or ()) for name in ("ongoing_write_through", "ongoing_backup"))
    queue = getattr(getattr(cache, "cache_controller", None), "backup_queue", None)
    n += queue.qsize() if queue is not None else 0
    return n + _settling(scheduler)


def _settling(scheduler) -> bool:
    """No request running or waiting, yet the scheduler is not idle by its own measure: the
    last batch's results are still being processed, so the writes of what it caches may be
    yet to be issued. (A scheduler still running requests is not waited for: a shutdown then
    ends them.)"""
    idle = getattr(scheduler, "is_fully_idle", None)
    if not callable(idle):
        return False
    running = getattr(scheduler, "running_batch", None)
    if (running is not None and not running.is_empty()) or len(getattr(scheduler, "waiting_queue", None) or ()):
        return False
    return not idle()


def _rpc_hook(original, self, recv_req):
    """(In each scheduler.) Answer DRAIN_RPC: success only when no rank of this scheduler's
    tensor-parallel group has a write pending."""
    if getattr(recv_req, "method", None) != DRAIN_RPC:
        return original(self, recv_req)
    from sglang.srt.managers.io_struct import RpcReqOutput
    try:
        import torch
        import torch.distributed as dist
        n = torch.tensor([pending_writes(self)], dtype=torch.int64)
        group = getattr(getattr(self, "tp_group", None), "cpu_group", None)
        if group is not None and dist.is_initialized() and dist.get_world_size(group) > 1:
            dist.all_reduce(n, op=dist.ReduceOp.MAX, group=group)   # every rank gets the same RPC
        pending = int(n.item())
    except Exception as e:  # noqa: BLE001 -- an answer the engine can act on, never a dead loop
        return RpcReqOutput(success=True, message=f"tierd: pending writes unknown ({e})")
    return RpcReqOutput(success=pending == 0, message=f"{pending} writes pending")


def _shutdown_hook(original, self, *args, **kwargs):
    try:
        drain_engine(self)
    except Exception:  # noqa: BLE001 -- shutdown goes on whatever the wait met
        log.exception("tierd: waiting for the engine's storage writes failed")
    return original(self, *args, **kwargs)


def drain_engine(engine, timeout_s: float | None = None, *, any_backend: bool = False) -> bool | None:
    """Wait until `engine`'s schedulers have no host or storage write pending: True when they
    drained, False on timeout, None when the engine does not use this backend (unless
    `any_backend`: then any storage backend) or does not own its schedulers. Called by
    `Engine.shutdown` through the plugin."""
    if getattr(engine, "_tierd_drained", False) or getattr(engine, "_attached", False):
        return None
    args = getattr(engine, "server_args", None)
    extra = str(getattr(args, "hicache_storage_backend_extra_config", "") or "")
    ours = "tierd.connectors.sglang" in extra or (any_backend and getattr(args, "hicache_storage_backend", None))
    if not ours or getattr(engine, "send_to_rpc", None) is None:
        return None
    engine._tierd_drained = True
    if timeout_s is None:
        timeout_s = float(os.environ.get("TIERD_SGLANG_DRAIN_S", DRAIN_DEFAULT_S))
    if timeout_s <= 0:
        return None
    import zmq
    from sglang.srt.entrypoints import engine as engine_mod
    from sglang.srt.managers.io_struct import RpcReqInput
    deadline = time.monotonic() + timeout_s
    start = time.monotonic()
    # Drained means two answers in a row, DRAIN_SETTLE_S apart, with nothing pending: a write
    # the scheduler issues a step after a request's output went out is seen by the second.
    polls, first, quiet = 0, None, 0
    while True:
        polls += 1
        sock = engine.send_to_rpc
        engine_mod.sock_send(sock, RpcReqInput(method=DRAIN_RPC, parameters=None))
        # a scheduler that died never answers: wait for the reply no longer than the deadline
        if not sock.poll(max(1, int((deadline - time.monotonic()) * 1000)), zmq.POLLIN):
            log.warning("tierd: the engine's schedulers did not answer within %.0f s; shutting down", timeout_s)
            return False
        reply = engine_mod.sock_recv(sock, flags=zmq.BLOCKY)
        message = getattr(reply, "message", "")
        first = message if first is None else first
        quiet = quiet + 1 if getattr(reply, "success", False) else 0
        # (what the wait met, for whoever shut the engine down: tests and benchmarks report it)
        engine.tierd_drain = {"drained": quiet >= 2, "s": time.monotonic() - start, "polls": polls,
                              "first": first, "last": message}
        if quiet >= 2:
            log.info("tierd: the engine's storage writes drained in %.2f s", time.monotonic() - start)
            return True
        if time.monotonic() >= deadline:
            log.warning("tierd: shutting down with storage writes still pending after %.0f s (%s)",
                        timeout_s, message)
            return False
        time.sleep(DRAIN_SETTLE_S)
