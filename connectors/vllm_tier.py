"""tierd as a secondary tier of vLLM's own KV offloading (`OffloadingConnector` with its
tiering spec): vLLM keeps its GPU <-> CPU path and its CPU primary tier; tierd is the node-shared,
persistent tier below it. Chunks cascade from vLLM's CPU tier into tierd slots, and a tierd hit
is promoted back into the CPU tier.

Configure (vLLM 0.32): the connector is ``TierdOffloadingConnector`` (vLLM's ``OffloadingConnector``
that also tells the tier each request's LoRA adapter; see below), with this
`kv_connector_extra_config`::

    --kv-transfer-config '{"kv_connector": "TierdOffloadingConnector",
        "kv_connector_module_path": "tierd.connectors.vllm_tier", "kv_role": "kv_both",
        "kv_connector_extra_config": {
          "spec_name": "TierdTieringSpec", "spec_module_path": "tierd.connectors.vllm_tier",
          "cpu_bytes_to_use": 2147483648,
          "secondary_tiers": [{"type": "TierdTier", "module_path": "tierd.connectors.vllm_tier",
                               "url": "unix:///run/tierd/tierd.sock"}]}}'

Under vLLM's plain ``OffloadingConnector`` the tier refuses to start (a clear error at engine
start): vLLM's tiering API hands a secondary tier a request's id, never its LoRA adapter.

`TierdTieringSpec` is vLLM's tiering spec; on GPU hosts it uses vLLM's own CUDA copy worker, on
CPU-only hosts (where vLLM's worker refuses to start) a host-memory copy worker
(`HostCopyOffloadingWorker`). `HostCPUOffloadingSpec` is the same for vLLM's plain CPU offloading
(no tiers), used as the peer in benchmarks.

Tier options: ``url`` (the daemon, ``$TIERD_URL`` by default), ``model`` (an explicit model
revision instead of the weights' fingerprint; a model that is not a local directory is declined
without it), ``timeout_s`` (per request, 10). The engine is keyed as the KV connector keys it
(`connectors/identity.py`: weights, load-time quantization and overrides, the KV cache dtype);
what that cannot key declines the tier, with one line.

What a tierd block is here: one vLLM offload chunk, all ranks' pages, in vLLM's own paged
layout (on CPU: the attention backend's packing), so its namespace records that layout
(`Namespace.layout` = ``vllm-offload/...``) and never mixes with the canonical blocks of the
KV connector or the bundled engine. Keys are vLLM's offload keys (its block hash chain, which
covers tokens, multimodal inputs, prompt embeddings and cache salt by content, but a LoRA
adapter only by name and path) hashed to 16 bytes, with the request's LoRA adapter by content
(adapter_config.json and every weight file's SHA-256, as the KV connector keys it,
`connectors/identity.py`): tierd outlives engines and is shared by them, so an adapter
retrained in place must not find its predecessor's KV. vLLM's default sha256 chain is the same
in every process, so a restarted or second engine finds the chunks. A request whose adapter
cannot be hashed, or that the tier was not told about (a request the engine did not make, such
as a peer's), is neither served nor stored (logged once per reason).
All tier methods run on vLLM's scheduler thread and return at once: lookups, copies and
commits run on the tier's own threads, each with its own daemon connection.
"""

from __future__ import annotations

import hashlib
import logging
import os
import queue
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import torch
from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import OffloadingConnector
from vllm.platforms import current_platform
from vllm.v1.kv_offload.base import (
    CanonicalKVCaches,
    GPULoadStoreSpec,
    LoadStoreSpec,
    LookupResult,
    Medium,
    OffloadingWorker,
    OffloadKey,
    ReqContext,
    RequestOffloadingContext,
    ScheduleEndContext,
    TransferResult,
)
from vllm.v1.kv_offload.cpu.shared_offload_region import SharedOffloadRegion
from vllm.v1.kv_offload.cpu.spec import CPUOffloadingSpec
from vllm.v1.kv_offload.tiering.async_lookup import AsyncLookupManager
from vllm.v1.kv_offload.tiering.base import JobResult, SecondaryTierManager, TransferJob
from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

import tierd
from tierd.costs import load_policy as costs_load_policy
from tierd.costs import primary_tier
from tierd.errors import TierdError
from tierd.namespace import Namespace, read_model_config

from . import identity
from .identity import Declined, adapter_identity
from .link import DEFAULT_TIMEOUT_S, STORE_ERRORS, StoreLink, holding
from .vllm import _open

log = logging.getLogger("tierd.connectors.vllm_tier")


def tier_key(key: OffloadKey, adapter: bytes = b"") -> bytes:
    """The 16-byte tierd key of one vLLM offload key (block hash + KV group index) of a request
    with the LoRA adapter whose content identity is `adapter` (16 bytes; b"": the base model)."""
    if not adapter:
        return hashlib.blake2b(b"tierd-vllm-offload-v1\x00" + bytes(key), digest_size=16).digest()
    if len(adapter) != 16:
        raise ValueError("an adapter identity is 16 bytes")
    return hashlib.blake2b(b"tierd-vllm-offload-lora-v1\x00" + adapter + bytes(key), digest_size=16).digest()


@dataclass(frozen=True)
class RequestKeying:
    """What the tier keys one request's chunks with (kept in vLLM's `ReqContext`): `adapter` is
    its LoRA adapter's content identity (b"" for the base model); `declined` says why the tier
    neither serves nor stores the request ("" when it does)."""

    adapter: bytes = b""
    declined: str = ""


_NOT_TOLD = RequestKeying(declined="the tier was not told which LoRA adapter the request uses "
                                   "(a request the engine's TierdOffloadingConnector did not make)")
# request id -> keying, while TierdOffloadingConnector.on_new_request hands the request to vLLM's
# offloading (the tier's on_new_request runs inside that call, on the same thread)
_announced: dict[str, RequestKeying] = {}
_constructing = threading.local()      # depth of TierdOffloadingConnector constructions on this thread


def request_keying(request) -> RequestKeying:
    """The keying of a vLLM request: its LoRA adapter by content (`identity.adapter_identity`)."""
    lora = getattr(request, "lora_request", None)
    if lora is None:
        return RequestKeying()
    try:
        return RequestKeying(adapter=adapter_identity(lora))
    except (TierdError, OSError) as e:   # (identity.Declined: content that cannot be read)
        name = getattr(lora, "lora_name", None) or getattr(lora, "name", None)
        return RequestKeying(declined=f"LoRA adapter {name!r} cannot be keyed by its content ({e})")


def engine_key(vllm_config) -> str | None:
    """This engine in the node's cost model (tierd/costs.py): its weights' identity, KV cache
    dtype and tensor-parallel size (what its prefill costs depend on, with the hardware); None
    where the engine cannot be keyed."""
    try:
        ident = identity.identify(identity.from_vllm(vllm_config))
    except (Declined, TierdError, OSError, AttributeError):
        return None
    tp = int(getattr(getattr(vllm_config, "parallel_config", None), "tensor_parallel_size", 1) or 1)
    return f"vllm/{ident.model[:32]}/{ident.kv_dtype}/tp{tp}"


def _tier_url(vllm_config) -> str:
    """The daemon a tierd secondary tier of this engine's offloading config names."""
    extra = getattr(getattr(vllm_config, "kv_transfer_config", None), "kv_connector_extra_config", None) or {}
    for t in extra.get("secondary_tiers") or ():
        if isinstance(t, dict) and t.get("type") == "TierdTier" and t.get("url"):
            return str(t["url"])
    return os.environ.get("TIERD_URL", "unix:///run/tierd/tierd.sock")


class TierdOffloadingConnector(OffloadingConnector):
    """vLLM's `OffloadingConnector`, unchanged, except that it tells the tierd tier which LoRA
    adapter (by content) each request uses: vLLM's tiering API gives a secondary tier only the
    request's id, and vLLM's block hashes name an adapter by name and path; and that it times
    the engine's prefill forwards for the node's cost model (the tier's lookups decide with it)."""

    def __init__(self, vllm_config, role, kv_cache_config):
        depth, outer = getattr(_constructing, "depth", 0), getattr(_constructing, "vllm_config", None)
        # the tier keys the engine by its settings (`identity.from_vllm`), which vLLM's
        # offloading spec does not carry: it reads them here, during this construction
        _constructing.depth, _constructing.vllm_config = depth + 1, vllm_config
        try:
            super().__init__(vllm_config, role, kv_cache_config)
        finally:
            _constructing.depth, _constructing.vllm_config = depth, outer
        self._tierd_engine = engine_key(vllm_config)
        self._tierd_fwd = None
        self._tierd_link: StoreLink | None = None
        self._tierd_url = _tier_url(vllm_config)
        try:
            from vllm.distributed.parallel_state import get_tensor_model_parallel_rank
            self._tierd_rank0 = get_tensor_model_parallel_rank() == 0
        except Exception:  # noqa: BLE001 -- outside a vLLM worker (the scheduler, tools)
            self._tierd_rank0 = True

    # the forward's cost, for the tier's decisions (tierd/costs.py)
    def build_connector_meta(self, scheduler_output):
        meta = super().build_connector_meta(scheduler_output)
        try:
            scheduled = scheduler_output.num_scheduled_tokens
            cached = scheduler_output.scheduled_cached_reqs
            terms = [(scheduled.get(nr.req_id, 0), nr.num_computed_tokens) for nr in scheduler_output.scheduled_new_reqs]
            terms += [(scheduled.get(r, 0), cached.num_computed_tokens[i]) for i, r in enumerate(cached.req_ids)]
            meta.tierd_forward = terms
        except (AttributeError, TypeError, IndexError):
            pass   # another vLLM's scheduler output: no timing, nothing else changes
        return meta

    def bind_connector_metadata(self, connector_metadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        terms = getattr(connector_metadata, "tierd_forward", None) or ()
        # (a prefill's forward, on the CPU where its wall time is its cost; rank 0 reports)
        self._tierd_fwd = None
        if self._tierd_engine and self._tierd_rank0 and any(n > 1 for n, _ in terms) \
                and not current_platform.is_cuda_alike():
            self._tierd_fwd = (time.perf_counter(), list(terms))

    def wait_for_save(self):
        fwd, self._tierd_fwd = self._tierd_fwd, None
        if fwd is not None:
            spent = time.perf_counter() - fwd[0]
            try:
                if self._tierd_link is None:
                    self._tierd_link = StoreLink(_open(self._tierd_url), background_connect=True,
                                                 name="tierd-vllm-tier-costs")
                if self._tierd_link.get() is not None:
                    model = self._tierd_link.cost_model()
                    if model is not None:
                        model.observe_forward(self._tierd_engine, fwd[1], spent)
            except Exception as e:  # noqa: BLE001 -- a measurement never fails a step
                log.debug("tierd tier: a forward was not measured (%s)", e)
        return super().wait_for_save()

    def on_new_request(self, request) -> None:
        _announced[request.request_id] = request_keying(request)
        try:
            super().on_new_request(request)
        finally:
            _announced.pop(request.request_id, None)


def chunk_namespace(spec, model: str | None = None, vllm_config=None) -> Namespace:
    """The namespace of the chunks an offloading spec produces (see the module docstring), for
    the engine whose settings are `vllm_config` (the weights, load-time settings and KV cache
    dtype: `identity.from_vllm`, as the KV connector keys them); `Declined` for a model whose
    chunks it cannot key."""
    cfg = spec.config
    name = cfg.model.name
    if vllm_config is not None:
        settings = identity.from_vllm(vllm_config, revision=model)
    else:   # (tools) what the spec says: the model and its KV cache dtype
        settings = identity.EngineSettings(model=name, revision=str(model or ""), kv_cache_dtype=cfg.model.dtype)
    ident = identity.identify(settings)
    mc = read_model_config(name) if os.path.isdir(name) else {}
    heads = int(mc.get("num_attention_heads") or 1)
    kv_heads = int(mc.get("num_key_value_heads") or heads)
    head_dim = int(mc.get("head_dim") or int(mc.get("hidden_size") or heads) // heads)
    if len(cfg.groups) != 1:
        raise Declined(f"{len(cfg.groups)} KV cache groups (a hybrid model under vLLM's hybrid KV cache "
                       "manager): the tierd tier supports one; use TierdConnector for these models")
    group = cfg.groups[0]
    par = cfg.parallel
    copies = 1 if spec.replicated_layout else par.world_size
    per_rank_heads = max(1, kv_heads // max(1, par.tp_size))
    dtype = ident.kv_dtype
    isa = ""
    if current_platform.is_cpu():
        try:
            from vllm.v1.attention.backends.cpu_attn import _get_attn_isa
            isa = _get_attn_isa(getattr(torch, dtype), group.tokens_per_block, head_dim, cfg.model.dtype)
        except Exception:  # noqa: BLE001 - recorded as unknown: still a distinct layout
            isa = "unknown"
    layout = (f"vllm-offload-v1/{type(current_platform).__name__}/{cfg.kv_cache_layout}/{isa}/"
              f"bs{group.tokens_per_block}/bpc{cfg.cache.blocks_per_chunk}/copies{copies}")
    # context parallelism interleaves a chunk's tokens over ranks: the same bytes per chunk hold
    # another arrangement, so the chunks of one topology never serve another
    cp = (int(getattr(par, "dcp_size", 1) or 1), int(getattr(par, "pcp_size", 1) or 1))
    if cp != (1, 1):
        layout += f"/dcp{cp[0]}pcp{cp[1]}"
    ns = ident.namespace(num_layers=len(group.layer_names), num_kv_heads=per_rank_heads * copies,
                         head_dim=head_dim, block_tokens=group.tokens_per_block * cfg.cache.blocks_per_chunk,
                         layout=layout)
    used = spec.cpu_page_size_per_worker * copies
    if ns.block_bytes != used:
        raise Declined(f"a vLLM offload chunk holds {used} bytes, but its tierd namespace computes "
                       f"{ns.block_bytes}; this model's KV layout is not supported by the tierd tier")
    return ns


class _Lookups(AsyncLookupManager):
    def __init__(self, tier: "TierdTier"):
        super().__init__(tier_type=tier.tier_type)
        self._tier = tier

    def batch_lookup(self, keys: list[OffloadKey], req_context: ReqContext) -> Iterable[bool]:
        # `keys` are tier keys (adapter included): the tier asks its lookups by them
        store = self._tier._connect("lookup") if self._tier.ns is not None else None
        if store is None:
            return [False] * len(keys)
        try:
            found = store.where(self._tier.ns, [bytes(k) for k in keys])
            hit = [bool(t) for t in found]
            if self._tier.load_policy == "decide" and self._tier.engine_key and any(hit):
                hit = self._tier.decide(store, [bytes(k) for k in keys], found)
        except STORE_ERRORS as e:
            self._tier._failed("lookup", e)
            return [False] * len(keys)
        self._tier.stats["lookups"] += len(keys)
        return hit


class TierdTier(SecondaryTierManager):
    """A vLLM secondary tier backed by a tierd Store (daemon or embedded)."""

    medium: ClassVar[Medium] = Medium.STORAGE

    def __init__(self, offloading_spec, primary_kv_view: memoryview, tier_type: str,
                 backpressure_detector=None, url: str | None = None, model: str | None = None,
                 timeout_s: float = DEFAULT_TIMEOUT_S, locality: str | None = None,
                 load_policy: str | None = None, **unknown: Any):
        if not getattr(_constructing, "depth", 0):
            raise TierdError("the tierd tier runs under kv_connector \"TierdOffloadingConnector\" "
                             "(kv_connector_module_path \"tierd.connectors.vllm_tier\"), not vLLM's "
                             "OffloadingConnector: vLLM tells a secondary tier no request's LoRA adapter, and "
                             "tierd keys adapters by content (the rest of the configuration stays as it is)")
        super().__init__(offloading_spec, primary_kv_view, tier_type, backpressure_detector)
        if unknown:
            raise TierdError(f"unknown tierd tier options: {', '.join(sorted(unknown))}; "
                             "known: url, model, timeout_s, locality, load_policy")
        self.load_policy = costs_load_policy(load_policy)
        self.engine_key = engine_key(getattr(_constructing, "vllm_config", None))
        self.declined = ""
        try:
            self.ns = chunk_namespace(offloading_spec, model, getattr(_constructing, "vllm_config", None))
        except Declined as e:    # vLLM runs on, with its own tiers: one line says why not tierd's
            self.declined, self.ns = str(e), None
            log.warning("tierd tier declined: %s; it stores and serves nothing", e)
        url = url or os.environ.get("TIERD_URL", "unix:///run/tierd/tierd.sock")
        if url.startswith("unix:") and "timeout_s=" not in url:
            url += ("&" if "?" in url else "?") + f"timeout_s={timeout_s:g}"
        self._url = url
        self._timeout_s = float(timeout_s)
        # re-measures a tier the cost model declined, off the lookups' path (`decide`)
        self._probe_link = StoreLink(_open(url), name="tierd-vllm-tier")
        self._stores: dict[str, Any] = {}
        self._down_until = 0.0
        self._lock = threading.Lock()
        arr = np.frombuffer(primary_kv_view.cast("B") if primary_kv_view.ndim != 1 else primary_kv_view,
                            dtype=np.uint8)
        self._primary = arr
        self._row = self.block_size_bytes
        self._used = self.ns.block_bytes if self.ns is not None else 0
        self.stats = dict.fromkeys(("lookups", "stored", "present", "loaded", "load_missing", "failures",
                                    "declined_requests", "declined_chunks", "probes"), 0)
        self._probe_link.stats = self.stats      # (its probes counted here)
        self._jobs: queue.Queue = queue.Queue()
        self._done: queue.Queue = queue.Queue()
        self._pending = 0
        self._load_keys: dict[int, tuple[list[OffloadKey], list[bytes]]] = {}
        self._declines_logged: set[str] = set()
        self._stop = False
        self._thread = threading.Thread(target=self._loop, name="tierd-vllm-tier", daemon=True)
        self._thread.start()
        self._lookups = _Lookups(self)
        if self.ns is not None:
            log.info("tierd tier: namespace %s, %d-byte chunks (row %d)", self.ns.name, self._used, self._row)

    # -- load or recompute (tierd/costs.py) ---------------------------------------------------
    def decide(self, store, keys: list[bytes], found: list[str]) -> list[bool]:
        """Of the chunks found (`found`: `where`'s answer per key), those worth promoting: the
        leading ones the node's cost model predicts to load faster than the engine computes
        them (the others are reported absent: vLLM computes them). Declined tokens go in its
        ledger; a declined tier is re-measured off the request's path."""
        model = store.cost_model()
        plan = model.plan(self.engine_key, [primary_tier(w) for w in found], self._used, self.ns.block_tokens)
        for tier, n in plan.declined().items():
            model.count(tier, declined_tokens=n * self.ns.block_tokens)
            self.stats["declined_chunks"] += n
        tier, run = plan.probe_run(keys)
        if run:
            self._probe_link.probe(self.ns, run, tier, model)
        return [bool(w) and i < plan.blocks for i, w in enumerate(found)]

    # -- connections -------------------------------------------------------------------------
    def _connect(self, role: str):
        """The store for one thread role ("lookup" or "transfer"), or None while backing off."""
        if time.monotonic() < self._down_until:
            return None
        store = self._stores.get(role)
        if store is None:
            try:
                shared = _open(self._url)     # an embedded store is shared within the process
                store = self._stores[role] = tierd.connect(shared) if isinstance(shared, str) else shared
            except STORE_ERRORS as e:
                self._failed(role, e)
                return None
        return store

    def _failed(self, what: str, e: Exception) -> None:
        self.stats["failures"] += 1
        with self._lock:
            self._down_until = time.monotonic() + 1.0
        log.warning("tierd tier: %s failed (%s); retry in 1 s", what, e)

    # -- scheduler-thread API ----------------------------------------------------------------
    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        keying = _announced.get(req_context.req_id, _NOT_TOLD)
        req_context.set_state(keying)
        if keying.declined:
            self.stats["declined_requests"] += 1
            if keying.declined not in self._declines_logged:
                self._declines_logged.add(keying.declined)
                log.warning("tierd tier: a request is neither served nor stored: %s", keying.declined)
        return RequestOffloadingContext()

    @staticmethod
    def _keying(req_context: ReqContext | None) -> RequestKeying:
        keying = req_context.get_state(RequestKeying) if req_context is not None else None
        return keying if keying is not None else _NOT_TOLD

    def _tier_keys(self, keys, req_context: ReqContext | None) -> list[bytes] | None:
        """The request's tier keys of `keys`, or None when the request (or the model) is declined."""
        keying = self._keying(req_context)
        if keying.declined or self.ns is None:
            return None
        return [tier_key(k, keying.adapter) for k in keys]

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        tkeys = self._tier_keys((key,), req_context)
        if tkeys is None:
            return LookupResult.MISS
        found = self._lookups.lookup(OffloadKey(tkeys[0]), req_context)
        if found is None:
            return LookupResult.RETRY
        return LookupResult.HIT if found else LookupResult.MISS

    def submit_store(self, job_metadata: TransferJob) -> None:
        self._submit(job_metadata)

    def submit_load(self, job_metadata: TransferJob) -> None:
        self._submit(job_metadata, load=True)

    def _submit(self, job: TransferJob, load: bool = False) -> None:
        keys = list(job.keys)
        tkeys = self._tier_keys(keys, job.req_context)
        if load:
            self._load_keys[job.job_id] = (keys, tkeys or [])
        if tkeys is None:          # a declined request: nothing is read or written
            self._done.put((JobResult(job.job_id, False, transfer_bytes=0), 0))
            return
        with self._lock:
            self._pending += 1
        self._jobs.put((job, tkeys))

    def get_finished_jobs(self) -> Iterable[JobResult]:
        out = []
        while True:
            try:
                result, nbytes = self._done.get_nowait()
            except queue.Empty:
                break
            keys = self._load_keys.pop(result.job_id, None)
            if keys is not None and not result.success:
                ok = set(result.successful_keys or ())
                self._lookups.mark_miss([OffloadKey(t) for k, t in zip(*keys) if k not in ok])
            out.append(result)
        return out

    def has_pending_work(self) -> bool:
        return self._pending > 0

    def on_request_finished(self, req_context: ReqContext) -> None:
        self._lookups.cleanup(req_context.req_id)

    def on_schedule_end(self, context: ScheduleEndContext) -> None:
        self._lookups.flush()

    def drain_jobs(self) -> None:
        """Wait for the jobs submitted so far, at most a few request timeouts: each job's requests
        are bounded by `timeout_s`, but a wait on a tier is never unbounded (a job stuck past
        that is left to the transfer thread and reported when it ends)."""
        deadline = time.monotonic() + max(5.0, 3 * self._timeout_s)
        while self._pending:
            if time.monotonic() >= deadline:
                log.warning("tierd tier: %d transfer jobs still running after %.0f s; not waiting longer",
                            self._pending, max(5.0, 3 * self._timeout_s))
                return
            time.sleep(0.001)

    def shutdown(self) -> None:
        self.drain_jobs()
        self._stop = True
        self._jobs.put(None)
        self._thread.join(5)
        self._lookups.shutdown()
        self._probe_link.close()
        self._primary = None         # let vLLM unmap its region
        for store in self._stores.values():
            if hasattr(store, "hold"):        # a daemon connection of ours, not the shared embedded store
                try:
                    store.close()
                except STORE_ERRORS:
                    pass

    # -- the transfer thread -----------------------------------------------------------------
    def _rows(self, chunk_ids) -> list[np.ndarray]:
        return [self._primary[int(c) * self._row:int(c) * self._row + self._used] for c in chunk_ids]

    def _loop(self) -> None:
        while True:
            item = self._jobs.get()
            if item is None:
                return
            job, tkeys = item
            t0 = time.perf_counter()
            try:
                if job.is_promotion:
                    result = self._load(job, tkeys)
                else:
                    result = self._store(job, tkeys)
            except Exception:  # noqa: BLE001 - every job is reported, or vLLM waits forever
                log.exception("tierd tier: job %s failed", job.job_id)
                result = JobResult(job.job_id, False)
            result.transfer_time = time.perf_counter() - t0
            self._done.put((result, result.transfer_bytes or 0))
            with self._lock:
                self._pending -= 1

    def _store(self, job: TransferJob, keys: list[bytes]) -> JobResult:
        store = self._connect("transfer")
        if store is None:
            return JobResult(job.job_id, False)
        try:
            res = store.reserve(self.ns, keys)
        except STORE_ERRORS as e:
            self._failed("store", e)
            return JobResult(job.job_id, False)
        written = 0
        try:
            with holding(store, res):
                for status, buf, row in zip(res.status, res.buffers, self._rows(job.chunk_ids)):
                    if status == "reserved":
                        np.copyto(np.asarray(buf).reshape(-1), row)
                        written += 1
            if res.num_reserved:
                store.commit(res)
            else:
                store.abort(res)
        except STORE_ERRORS as e:
            self._failed("store", e)
            try:
                store.abort(res)
            except STORE_ERRORS:
                pass
            return JobResult(job.job_id, False)
        self.stats["stored"] += written
        self.stats["present"] += sum(s == "present" for s in res.status)
        return JobResult(job.job_id, True, transfer_bytes=written * self._used)

    def _observe(self, store, tiers: list[str], n: int, seconds: float) -> None:
        """A promotion of `n` chunks from `tiers` took `seconds`: for the cost model
        (`CostModel.record_load`)."""
        store.cost_model(sync=False).record_load(self.engine_key or "", tiers, n * self._used,
                                                 n * self.ns.block_tokens, seconds)

    def _load(self, job: TransferJob, tkeys: list[bytes]) -> JobResult:
        store = self._connect("transfer")
        keys = list(job.keys)
        if store is None:
            return JobResult(job.job_id, False)
        rows = self._rows(job.chunk_ids)
        ok: list[OffloadKey] = []
        i = 0
        try:
            # keys are independent chunks: lease the longest present run, then continue after a gap
            while i < len(keys):
                t0 = time.perf_counter()
                lease = store.acquire(self.ns, tkeys[i:], pipelined=True)   # confirmed below
                n = len(lease)
                try:
                    with holding(store, lease):
                        for j in range(n):
                            np.copyto(rows[i + j], np.asarray(lease.buffers[j]).reshape(-1))
                finally:
                    store.release(lease, confirm=True)   # raises if the lease was lost meanwhile
                if n:
                    self._observe(store, lease.tiers[:n], n, time.perf_counter() - t0)
                ok.extend(keys[i:i + n])
                i += n if n else 1
                if n == 0:
                    self.stats["load_missing"] += 1
        except STORE_ERRORS as e:
            self._failed("load", e)
        self.stats["loaded"] += len(ok)
        if len(ok) == len(keys):
            return JobResult(job.job_id, True, transfer_bytes=len(ok) * self._used)
        return JobResult(job.job_id, False, successful_keys=tuple(ok) or None,
                         transfer_bytes=len(ok) * self._used)


# -- the worker side: a host-memory copy worker for CPU-only hosts --------------------------------
class HostCopyOffloadingWorker(OffloadingWorker):
    """Copies KV blocks between vLLM's paged cache and its offload chunks with torch on the host,
    for platforms where vLLM's stock worker (CUDA streams, a CUDA copy kernel) cannot run.
    Copies complete inside `submit_*`; results are reported by the next `get_finished`."""

    def __init__(self, kv_caches: CanonicalKVCaches, blocks_per_chunk: int, num_chunks: int,
                 region: SharedOffloadRegion | None = None):
        self.bpc = blocks_per_chunk
        self.region = region
        self.refs = kv_caches.group_data_refs
        self.dev: list[torch.Tensor] = []
        self.host: list[torch.Tensor] = []
        for t in kv_caches.tensors:
            page = t.page_size_bytes
            dev = t.tensor.view(torch.int8).view(-1, page)
            if region is not None:
                host = region.create_next_worker_view(page * blocks_per_chunk)
            else:
                host = torch.zeros((num_chunks, page * blocks_per_chunk), dtype=torch.int8)
            self.dev.append(dev)
            self.host.append(host.view(host.shape[0], blocks_per_chunk, page))
        self._results: list[TransferResult] = []

    def _pairs(self, gpu: GPULoadStoreSpec, chunks: np.ndarray):
        """Per KV group: (device block ids, host chunk ids, sub-block within the chunk)."""
        off_b = off_c = 0
        for g, (size, first) in enumerate(zip(gpu.group_sizes, gpu.block_indices)):
            if size == 0:
                continue
            skip = int(first) % self.bpc
            n_chunks = -(-(size + skip) // self.bpc)
            pos = np.arange(skip, skip + size)
            blocks = gpu.block_ids[off_b:off_b + size]
            cids = chunks[off_c:off_c + n_chunks][pos // self.bpc]
            yield g, torch.from_numpy(blocks.astype(np.int64)), torch.from_numpy(cids.astype(np.int64)), \
                torch.from_numpy((pos % self.bpc).astype(np.int64))
            off_b += size
            off_c += n_chunks

    def _transfer(self, job_id: int, gpu: GPULoadStoreSpec, chunks: np.ndarray, store: bool) -> bool:
        t0 = time.perf_counter()
        nbytes = 0
        for g, blocks, cids, subs in self._pairs(gpu, chunks):
            for ref in self.refs[g]:
                dev, host = self.dev[ref.tensor_idx], self.host[ref.tensor_idx]
                page = ref.page_size_bytes
                if store:
                    host[cids, subs, :page] = dev[blocks, :page]
                else:
                    dev[blocks, :page] = host[cids, subs, :page]
                nbytes += len(blocks) * page
        self._results.append(TransferResult(job_id, True, nbytes, time.perf_counter() - t0))
        return True

    def submit_store(self, job_id: int, src_spec: GPULoadStoreSpec, dst_spec: LoadStoreSpec) -> bool:
        return self._transfer(job_id, src_spec, dst_spec.block_ids, store=True)

    def submit_load(self, job_id: int, src_spec: LoadStoreSpec, dst_spec: GPULoadStoreSpec,
                    expedited: bool = False) -> bool:
        # `expedited` (vLLM 0.33: a load to run ahead of queued ones): copies complete at once here
        return self._transfer(job_id, dst_spec, src_spec.block_ids, store=False)

    def get_finished(self) -> list[TransferResult]:
        out, self._results = self._results, []
        return out

    def wait(self, job_ids: set[int]) -> None:
        return   # copies complete when submitted

    def shutdown(self) -> None:
        self.dev, self.host = [], []     # drop the views before the region is unmapped
        if self.region is not None:
            self.region.cleanup()
            self.region = None


def _host_platform() -> bool:
    return not (current_platform.is_cuda_alike() or current_platform.is_xpu())


class TierdTieringSpec(TieringOffloadingSpec):
    """vLLM's tiering spec (CPU primary tier + secondary tiers such as `TierdTier`), with a host
    copy worker where vLLM's own needs CUDA."""

    def get_worker(self, kv_caches: CanonicalKVCaches) -> OffloadingWorker:
        if not _host_platform():
            return super().get_worker(kv_caches)
        if self._worker is None:
            rank = 0 if self.replicated_layout else self.config.parallel.rank
            region = SharedOffloadRegion(engine_id=self._engine_id, num_chunks=self.num_chunks, rank=rank,
                                         kv_bytes_per_chunk=self.kv_bytes_per_chunk,
                                         cpu_page_size=self.cpu_page_size_per_worker)
            self._worker = HostCopyOffloadingWorker(kv_caches, self.blocks_per_chunk, self.num_chunks, region)
        return self._worker


class HostCPUOffloadingSpec(CPUOffloadingSpec):
    """vLLM's plain CPU offloading, with a host copy worker where vLLM's own needs CUDA."""

    def get_worker(self, kv_caches: CanonicalKVCaches) -> OffloadingWorker:
        if not _host_platform():
            return super().get_worker(kv_caches)
        if self._worker is None:
            self._worker = HostCopyOffloadingWorker(kv_caches, self.blocks_per_chunk, self.num_chunks)
        return self._worker


__all__ = ["TierdTier", "TierdOffloadingConnector", "TierdTieringSpec", "HostCPUOffloadingSpec",
           "HostCopyOffloadingWorker", "RequestKeying", "chunk_namespace", "request_keying", "tier_key"]
