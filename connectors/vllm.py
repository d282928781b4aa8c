"""vLLM KV connector (V1 API) on tierd: prefix blocks load from tierd instead of being
prefilled, and filled blocks are offered to tierd after each step.

Load with::

    vllm serve MODEL --kv-transfer-config '{"kv_connector": "TierdConnector",
        "kv_connector_module_path": "tierd.connectors.vllm", "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"url": "unix:///run/tierd/tierd.sock"}}'

`kv_connector_extra_config` keys (all optional):

- ``url``: the Store URL (``unix:///run/tierd/tierd.sock`` by default, or ``$TIERD_URL``).
  ``embedded://...`` works only where vLLM's scheduler and worker share one process.
- ``block_tokens``: tokens per tier block (256 by default; a multiple of vLLM's block size).
- ``model``: an explicit model revision for the namespace instead of the model directory's
  fingerprint (needed when the model is a hub name rather than a local directory).
- ``max_pending_blocks``: stores queued before new ones are dropped (256 by default).
- ``namespace``: ``{num_layers, num_kv_heads, head_dim, kv_dtype, model}`` when the config has
  no model (tests and tools).

How it works. The scheduler side asks tierd how many leading tier blocks of a request's tokens
it holds (`lookup`) and claims those beyond vLLM's own prefix cache (the last token is always
left to compute). The worker side loads them synchronously in `start_load_kv` (one `acquire`,
then per layer an indexed copy into the paged cache) and, in `wait_for_save`, copies each tier
block that this step completed out of the paged cache and hands it to a background thread that
`put`s it; blocks are copied before the step ends, so vLLM may free them at once. A tier block
that cannot be loaded is reported through `get_block_ids_with_load_errors`, and vLLM recomputes
it under ``kv_load_failure_policy: "recompute"``. A daemon that is down means no hits and no
stores (with back-off), never a failed step.

Tier blocks use tierd's layout ``[layers, 2, block_tokens, kv_heads, head_dim]`` and keys from
`tierd.keys`, the same as the bundled engine, so both engines share blocks of the same model.
Only models whose layers all use full attention in one KV cache group are supported; for others
the connector logs why and does nothing.

Targets vLLM's V1 connector API as of vLLM 0.11 - 0.33 (checked against 0.33.0's base class).
vLLM is not a dependency: without it the module still imports (with a stand-in base class), so
its logic is tested everywhere.
"""

from __future__ import annotations

import enum
import logging
import os
import re
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from tierd.errors import NamespaceError, TierdError
from tierd.keys import extend_keys
from tierd.kernels.transfer import host_tensor
from tierd.namespace import DEFAULT_BLOCK_TOKENS, Namespace, canonical_dtype, model_fingerprint

from .link import STORE_ERRORS, StoreLink

try:  # vLLM is optional: the real base class where it is installed
    from vllm.distributed.kv_transfer.kv_connector.v1.base import (
        KVConnectorBase_V1,
        KVConnectorMetadata,
        KVConnectorRole,
    )
    HAVE_VLLM = True
except ImportError:
    HAVE_VLLM = False

    class KVConnectorRole(enum.Enum):  # type: ignore[no-redef]
        SCHEDULER = 0
        WORKER = 1

    class KVConnectorMetadata:  # type: ignore[no-redef]
        """Stand-in for vLLM's (empty) metadata base class."""

    class KVConnectorBase_V1:  # type: ignore[no-redef]
        """Stand-in for the part of vLLM's base class this connector relies on."""

        def __init__(self, vllm_config, role, kv_cache_config):
            self._connector_metadata = None
            self._vllm_config = vllm_config
            self._kv_transfer_config = vllm_config.kv_transfer_config
            self._kv_cache_config = kv_cache_config
            self._role = role

        @property
        def role(self):
            return self._role

        def bind_connector_metadata(self, connector_metadata) -> None:
            self._connector_metadata = connector_metadata

        def clear_connector_metadata(self) -> None:
            self._connector_metadata = None

        def _get_connector_metadata(self):
            assert self._connector_metadata is not None
            return self._connector_metadata

        def has_connector_metadata(self) -> bool:
            return self._connector_metadata is not None

log = logging.getLogger("tierd.connectors.vllm")

DEFAULT_URL = "unix:///run/tierd/tierd.sock"


# -- metadata (scheduler -> workers, pickled) -----------------------------------------------------
@dataclass
class LoadSpec:
    """Load tier blocks `keys` (the first is tier block `first_tier`) into vLLM blocks
    `block_ids`, which are the request's blocks `first_block` .. `first_block + len - 1`."""

    req_id: str
    salt: str
    keys: list[bytes]
    first_tier: int
    first_block: int
    block_ids: list[int]


@dataclass
class SaveSpec:
    """Store the vLLM blocks `block_ids` (one tier block, in order) under `key`."""

    salt: str
    key: bytes
    parent: bytes | None
    block_ids: list[int]


@dataclass
class TierdConnectorMetadata(KVConnectorMetadata):
    loads: list[LoadSpec] = field(default_factory=list)
    saves: list[SaveSpec] = field(default_factory=list)


@dataclass
class _Req:
    """Scheduler-side state of one request."""

    request: Any
    salt: str
    keys: list[bytes] = field(default_factory=list)
    block_ids: list[int] = field(default_factory=list)
    saved: int = 0            # leading tier blocks tierd holds or has been sent
    pending_load: int = 0     # external tokens to load in the next step


def _extra(kv_transfer_config, key: str, default):
    extra = getattr(kv_transfer_config, "kv_connector_extra_config", None) or {}
    return extra.get(key, default)


def _layer_index(name: str) -> tuple:
    """Sort key that orders 'model.layers.10.self_attn.attn' after '...layers.9...'."""
    return tuple(int(p) if p.isdigit() else p for p in re.split(r"(\d+)", name))


class TierdConnector(KVConnectorBase_V1):
    """vLLM `KVConnectorBase_V1` implementation backed by a tierd Store."""

    def __init__(self, vllm_config, role, kv_cache_config=None):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        ktc = self._kv_transfer_config
        self.block_size = int(vllm_config.cache_config.block_size)
        self.block_tokens = int(_extra(ktc, "block_tokens", DEFAULT_BLOCK_TOKENS))
        if self.block_tokens <= 0 or self.block_tokens % self.block_size:
            raise TierdError(f"tierd block_tokens={self.block_tokens} must be a positive multiple of "
                             f"vLLM's block_size={self.block_size}")
        self.ratio = self.block_tokens // self.block_size
        self.disabled = self._unsupported_reason(vllm_config, kv_cache_config)
        if self.disabled:
            log.warning("tierd connector disabled: %s", self.disabled)
        self._ns_args = self._namespace_args(vllm_config, ktc) if not self.disabled else {}
        self._namespaces: dict[str, Namespace] = {}
        url = _extra(ktc, "url", os.environ.get("TIERD_URL", DEFAULT_URL))
        self.link = StoreLink(_open(url), max_pending_blocks=int(_extra(ktc, "max_pending_blocks", 256)),
                              name="tierd-vllm-store")
        self.stats = self.link.stats
        if getattr(ktc, "kv_load_failure_policy", "recompute") != "recompute":
            log.warning("kv_load_failure_policy is %r: a tier block evicted between lookup and load "
                        "fails its request; set it to \"recompute\"",
                        getattr(ktc, "kv_load_failure_policy", None))
        # scheduler side
        self._reqs: dict[str, _Req] = {}
        self._hits: dict[str, int] = {}
        # worker side
        self._layers: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._load_errors: set[int] = set()

    # -- configuration ------------------------------------------------------------------------
    @staticmethod
    def _unsupported_reason(vllm_config, kv_cache_config) -> str:
        pc = getattr(vllm_config, "parallel_config", None)
        if pc is not None and getattr(pc, "pipeline_parallel_size", 1) > 1:
            return "pipeline parallelism is not supported"
        if getattr(vllm_config, "model_config", None) is not None and \
                getattr(vllm_config.model_config, "use_mla", False):
            return "MLA models are not supported"
        groups = getattr(kv_cache_config, "kv_cache_groups", None)
        if groups is not None:
            if len(groups) != 1:
                return f"{len(groups)} KV cache groups (hybrid model); only one full-attention group is supported"
            spec = type(groups[0].kv_cache_spec).__name__
            if spec != "FullAttentionSpec":
                return f"KV cache spec {spec}; only FullAttentionSpec is supported"
        return ""

    def _namespace_args(self, vllm_config, ktc) -> dict:
        explicit = _extra(ktc, "namespace", None)
        if explicit is not None:
            args = {k: explicit[k] for k in ("num_layers", "num_kv_heads", "head_dim", "kv_dtype")}
            args["model"] = str(explicit.get("model") or _extra(ktc, "model", "") or "")
            if not args["model"]:
                raise NamespaceError("kv_connector_extra_config.namespace needs a 'model' revision")
            args["tp_size"] = int(explicit.get("tp_size", 1))
            return args
        mc, pc, cc = vllm_config.model_config, vllm_config.parallel_config, vllm_config.cache_config
        revision = _extra(ktc, "model", None)
        if revision:
            model = str(revision)
        elif os.path.isdir(str(mc.model)):
            model = model_fingerprint(mc.model)
        else:
            model = f"{mc.model}@{getattr(mc, 'revision', None) or 'unpinned'}"
            log.warning("model %s is not a local directory: its namespace is its name and revision (%s); "
                        "set kv_connector_extra_config.model to a pinned revision", mc.model, model)
        cache_dtype = str(getattr(cc, "cache_dtype", "auto"))
        kv_dtype = canonical_dtype(mc.dtype if cache_dtype == "auto" else cache_dtype)
        return dict(model=model, num_layers=mc.get_num_layers(pc), num_kv_heads=mc.get_num_kv_heads(pc),
                    head_dim=mc.get_head_size(), kv_dtype=kv_dtype, tp_size=pc.tensor_parallel_size)

    def _tp_rank(self) -> int:
        if self.role != KVConnectorRole.WORKER or self._ns_args.get("tp_size", 1) == 1:
            return 0   # the scheduler looks up rank 0's blocks; other ranks report load errors
        try:
            from vllm.distributed.parallel_state import get_tensor_model_parallel_rank
            return get_tensor_model_parallel_rank()
        except Exception:  # vLLM not initialised (tools)
            return 0

    def namespace(self, salt: str | None = "") -> Namespace:
        salt = salt or ""
        ns = self._namespaces.get(salt)
        if ns is None:
            ns = Namespace(block_tokens=self.block_tokens, tp_rank=self._tp_rank(), cache_salt=salt,
                           **self._ns_args)
            self._namespaces[salt] = ns
        return ns

    # ==============================================================================================
    # Scheduler side
    # ==============================================================================================
    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int | None, bool]:
        if self.disabled:
            return 0, False
        tokens = request.all_token_ids
        n_full = len(tokens) // self.block_tokens
        if n_full * self.block_tokens <= num_computed_tokens:
            return 0, False
        store = self.link.get()
        if store is None:
            return 0, False
        salt = getattr(request, "cache_salt", None) or ""
        ns = self.namespace(salt)
        st = self._reqs.get(request.request_id)
        keys = st.keys if st is not None else []
        extend_keys(keys, ns.root_key, tokens, self.block_tokens, n_full)
        self.stats["lookups"] += 1
        try:
            n = store.lookup(ns, keys[:n_full])
        except STORE_ERRORS as e:
            self.link.failed(e, "lookup")
            return 0, False
        self.link.ok()
        if st is None:
            self._reqs[request.request_id] = _Req(request, salt, keys)
        self._hits[request.request_id] = n
        hit = min(n * self.block_tokens, len(tokens) - 1)   # the last token is always computed
        return max(0, hit - num_computed_tokens), False

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int):
        if self.disabled:
            return
        st = self._reqs.get(request.request_id)
        if st is None:
            st = self._reqs[request.request_id] = _Req(request, getattr(request, "cache_salt", None) or "")
        st.request = request
        st.saved = max(st.saved, self._hits.pop(request.request_id, 0))
        if num_external_tokens > 0:
            st.pending_load = num_external_tokens
            self.stats["hit_blocks"] += -(-num_external_tokens // self.block_tokens)
            self.stats["loaded_tokens"] += num_external_tokens

    def build_connector_meta(self, scheduler_output) -> KVConnectorMetadata:
        meta = TierdConnectorMetadata()
        if self.disabled:
            return meta
        scheduled = scheduler_output.num_scheduled_tokens
        for nr in scheduler_output.scheduled_new_reqs:
            st = self._reqs.get(nr.req_id)
            if st is None:
                continue
            st.block_ids = list(nr.block_ids[0]) if nr.block_ids else []
            self._plan(meta, nr.req_id, st, nr.num_computed_tokens, scheduled.get(nr.req_id, 0))
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            st = self._reqs.get(req_id)
            if st is None:
                continue
            new_ids = cached.new_block_ids[i]
            if req_id in getattr(cached, "resumed_req_ids", ()):
                st.block_ids = list(new_ids[0]) if new_ids else []
            elif new_ids:
                st.block_ids.extend(new_ids[0])
            self._plan(meta, req_id, st, cached.num_computed_tokens[i], scheduled.get(req_id, 0))
        for req_id in getattr(scheduler_output, "finished_req_ids", ()) or ():
            self._forget(req_id)
        return meta

    def _plan(self, meta: TierdConnectorMetadata, req_id: str, st: _Req, computed: int, scheduled: int) -> None:
        bt, bs = self.block_tokens, self.block_size
        tokens = st.request.all_token_ids
        ns = self.namespace(st.salt)
        if st.pending_load:
            start, end = computed - st.pending_load, computed
            st.pending_load = 0
            first_tier, last_tier = start // bt, -(-end // bt)
            first_block, last_block = start // bs, -(-end // bs)
            extend_keys(st.keys, ns.root_key, tokens, bt, last_tier)
            meta.loads.append(LoadSpec(req_id, st.salt, st.keys[first_tier:last_tier], first_tier,
                                       first_block, st.block_ids[first_block:last_block]))
        full = min(computed + scheduled, len(tokens)) // bt     # tier blocks whose KV exists after this step
        if full <= st.saved:
            return
        if self.link.backing_off:          # tierd is down: do not copy blocks nobody will take
            st.saved = full
            return
        extend_keys(st.keys, ns.root_key, tokens, bt, full)
        for j in range(st.saved, full):
            bids = st.block_ids[j * self.ratio:(j + 1) * self.ratio]
            if len(bids) < self.ratio:
                break
            meta.saves.append(SaveSpec(st.salt, st.keys[j], st.keys[j - 1] if j else None, bids))
        st.saved = full

    def _forget(self, req_id: str) -> None:
        self._reqs.pop(req_id, None)
        self._hits.pop(req_id, None)

    def request_finished(self, request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        # Blocks were copied out during the steps that filled them: vLLM may free them now.
        self._forget(request.request_id)
        return False, None

    # ==============================================================================================
    # Worker side
    # ==============================================================================================
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]):
        if self.disabled:
            return
        ns = self.namespace("")
        names = sorted(kv_caches, key=_layer_index)
        if len(names) != ns.num_layers:
            self.disabled = f"{len(names)} KV cache tensors for a {ns.num_layers}-layer namespace"
            log.warning("tierd connector disabled: %s", self.disabled)
            return
        try:
            self._layers = [self._split(kv_caches[n]) for n in names]
        except TierdError as e:
            self.disabled = str(e)
            log.warning("tierd connector disabled: %s", e)
            self._layers = []
            return
        self._dtype = self._layers[0][0].dtype
        self._device = self._layers[0][0].device
        if self._dtype.itemsize != ns.dtype_bytes:
            self.disabled = f"KV cache dtype {self._dtype} does not match the namespace's {ns.kv_dtype}"
            log.warning("tierd connector disabled: %s", self.disabled)
            self._layers = []

    def _split(self, t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(K, V) views of one layer's paged cache, each (num_blocks, block_size, kv_heads, head_dim)."""
        bs, h, d = self.block_size, self._ns_args["num_kv_heads"], self._ns_args["head_dim"]
        s = tuple(t.shape)
        if len(s) == 4 and s[1:] == (h, bs, 2 * d):          # (B, H, N, 2D): vLLM >= 0.2x standard view
            return t[..., :d].transpose(1, 2), t[..., d:].transpose(1, 2)
        if len(s) == 4 and s[1:] == (bs, h, 2 * d):          # (B, N, H, 2D)
            return t[..., :d], t[..., d:]
        if len(s) == 5 and s[0] == 2 and s[2:] == (bs, h, d):  # (2, B, N, H, D): flash-attn NHD
            return t[0], t[1]
        if len(s) == 5 and s[1] == 2 and s[2:] == (bs, h, d):  # (B, 2, N, H, D): flashinfer NHD
            return t[:, 0], t[:, 1]
        if len(s) == 5 and s[0] == 2 and s[2:] == (h, bs, d):  # (2, B, H, N, D): HND
            return t[0].transpose(1, 2), t[1].transpose(1, 2)
        if len(s) == 5 and s[1] == 2 and s[2:] == (h, bs, d):  # (B, 2, H, N, D): HND
            return t[:, 0].transpose(1, 2), t[:, 1].transpose(1, 2)
        raise TierdError(f"unknown paged KV cache layout {s} for block_size={bs}, kv_heads={h}, head_dim={d}")

    def _tier_view(self, buf) -> torch.Tensor:
        """A tier block (uint8 buffer) as (layers, 2, ratio, block_size, kv_heads, head_dim)."""
        ns = self.namespace("")
        return host_tensor(buf).view(self._dtype).view(ns.num_layers, 2, self.ratio, self.block_size,
                                        ns.num_kv_heads, ns.head_dim)

    def start_load_kv(self, forward_context, **kwargs: Any) -> None:
        if self.disabled or not self._layers or not self.has_connector_metadata():
            return
        meta = self._get_connector_metadata()
        for spec in getattr(meta, "loads", ()):
            self._load(spec)

    def _load(self, spec: LoadSpec) -> None:
        t0 = time.perf_counter()
        store = self.link.get()
        loaded = 0
        lease = None
        try:
            if store is not None:
                try:
                    lease = store.acquire(self.namespace(spec.salt), spec.keys)
                    loaded = len(lease)
                    self.link.ok()
                except STORE_ERRORS as e:
                    self.stats["load_failures"] += 1
                    self.link.failed(e, "load")
            last = spec.first_block + len(spec.block_ids)
            for j in range(loaded):
                tier = spec.first_tier + j
                lo = max(spec.first_block, tier * self.ratio)
                hi = min(last, (tier + 1) * self.ratio)
                if lo >= hi:
                    continue
                src = self._tier_view(lease.buffers[j])[:, :, lo - tier * self.ratio:hi - tier * self.ratio]
                src = src.to(self._device, non_blocking=True)
                dst = torch.tensor(spec.block_ids[lo - spec.first_block:hi - spec.first_block],
                                   dtype=torch.long, device=self._device)
                for layer, (k, v) in enumerate(self._layers):
                    k[dst] = src[layer, 0]
                    v[dst] = src[layer, 1]
            # blocks of tier blocks that were not there any more: vLLM recomputes them
            first_missing = (spec.first_tier + loaded) * self.ratio
            missing = spec.block_ids[max(0, first_missing - spec.first_block):]
            if missing:
                self._load_errors.update(missing)
                self.stats["load_failures"] += 1
            if loaded:
                self.stats["loaded_bytes"] += loaded * self.namespace(spec.salt).block_bytes
                if self._device.type == "cuda":
                    torch.cuda.current_stream(self._device).synchronize()  # the lease ends below
        finally:
            if lease is not None:
                try:
                    lease.__exit__(None, None, None)
                except STORE_ERRORS:
                    pass
            self.stats["load_s"] += time.perf_counter() - t0

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # loads complete inside start_load_kv

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata, **kwargs: Any) -> None:
        return  # whole tier blocks are copied out in wait_for_save, once every layer is written

    def wait_for_save(self):
        if self.disabled or not self._layers or not self.has_connector_metadata():
            return
        saves = getattr(self._get_connector_metadata(), "saves", ())
        if not saves:
            return
        if self.link.backing_off:
            self.stats["stores_dropped"] += len(saves)
            return
        ns = self.namespace("")
        shape = (ns.num_layers, 2, self.ratio, self.block_size, ns.num_kv_heads, ns.head_dim)
        for spec in saves:
            idx = torch.tensor(spec.block_ids, dtype=torch.long, device=self._device)
            block = torch.empty(shape, dtype=self._dtype, device=self._device)
            for layer, (k, v) in enumerate(self._layers):
                block[layer, 0] = k[idx]
                block[layer, 1] = v[idx]
            data = block.cpu().view(torch.uint8).numpy().reshape(-1)
            self.link.submit(self.namespace(spec.salt), spec.key, spec.parent, data)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        return None, None   # no asynchronous sends or receives outlive a step

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def shutdown(self):
        self.link.close()


# -- store sharing ------------------------------------------------------------------------------
_EMBEDDED: dict[str, Any] = {}


def _open(url: str):
    """Store for `url`: an embedded store is shared by every connector of this process, so the
    scheduler's lookups see the worker's stores when both run in one process."""
    if not url.startswith("embedded:"):
        return url   # opened lazily by StoreLink (and reopened after failures)
    if url not in _EMBEDDED:
        import tierd
        _EMBEDDED[url] = tierd.connect(url)
    return _EMBEDDED[url]
