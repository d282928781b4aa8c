"""Conformance of `tierd.connectors.vllm.TierdConnector` with the installed vLLM.

Run in an environment where vLLM is installed (`make vllm-env`; test_vllm_connector.py runs it):
`python -m tests.vllm_check`. Checks, against vLLM's own code: the connector subclasses vLLM's
`KVConnectorBase_V1` and leaves no abstract method; every method it overrides keeps the base
class's parameters; vLLM's factory loads it from `kv_connector_module_path`; and the scenarios of
tests/vllm_driver.py pass with vLLM's real configs, requests, block lists and scheduler outputs.
"""

from __future__ import annotations

import inspect
import pickle
import sys
import tempfile

import torch


def main() -> int:
    import vllm
    from vllm.config import DeviceConfig, KVTransferConfig, VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, KVConnectorRole
    from vllm.sampling_params import SamplingParams
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.kv_cache_utils import KVCacheBlock
    from vllm.v1.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.request import Request

    from tierd.connectors import vllm as tv

    from . import vllm_driver as drv

    # -- the class itself -----------------------------------------------------------------------
    assert tv.HAVE_VLLM, "tierd.connectors.vllm did not pick up vLLM's base class"
    checked = same_signatures(tv.TierdConnector, KVConnectorBase_V1)
    # vLLM keeps its hybrid KV cache manager on only for SupportsHMA connectors
    from vllm.distributed.kv_transfer.kv_connector.v1 import SupportsHMA
    checked += same_signatures(tv.TierdConnector, SupportsHMA)
    assert "request_finished_all_groups" in checked
    missing = {"get_num_new_matched_tokens", "update_state_after_alloc", "build_connector_meta",
               "request_finished", "register_kv_caches", "start_load_kv", "wait_for_layer_load",
               "save_kv_layer", "wait_for_save", "get_finished"} - set(checked)
    assert not missing, f"not overridden: {missing}"

    # -- loaded by vLLM's factory from kv_connector_module_path, with vLLM's configs -------------
    tmp = tempfile.mkdtemp()
    url = f"embedded://?host=16MiB&disk={tmp}/disk&disk_bytes=64MiB"
    layers = [f"model.layers.{i}.self_attn.attn" for i in range(drv.LAYERS)]
    ktc = KVTransferConfig(kv_connector="TierdConnector", kv_connector_module_path="tierd.connectors.vllm",
                           kv_role="kv_both", kv_load_failure_policy="recompute",
                           kv_connector_extra_config=drv.extra_config(url))
    config = VllmConfig(device_config=DeviceConfig(device="cpu"), kv_transfer_config=ktc)
    config.cache_config.block_size = drv.BLOCK_SIZE
    spec = FullAttentionSpec(block_size=drv.BLOCK_SIZE, num_kv_heads=drv.KV_HEADS, head_size=drv.HEAD_DIM,
                             dtype=torch.float16)
    kv_cache_config = KVCacheConfig(num_blocks=drv.NUM_BLOCKS, kv_cache_tensors=[],
                                    kv_cache_groups=[KVCacheGroupSpec(layer_names=layers, kv_cache_spec=spec)])
    # per layer its attention backend, as the worker's forward context names it (vLLM's own
    # FlashAttentionBackend where it imports here)
    config.compilation_config.static_forward_context.update(drv.forward_context("BHN2D", layers))
    sched = KVConnectorFactory.create_connector(config, KVConnectorRole.SCHEDULER, kv_cache_config)
    worker = KVConnectorFactory.create_connector(config, KVConnectorRole.WORKER, kv_cache_config)
    assert type(sched).__name__ == "TierdConnector" and not sched.disabled, sched.disabled
    # a best-effort cache: vLLM keeps a preempted request's output (its base asks a kv_both
    # connector for reliable delivery), and hits are reported by tier in vLLM's own terms
    if hasattr(KVConnectorBase_V1, "requires_kv_delivery"):
        assert KVConnectorBase_V1.requires_kv_delivery.fget(sched) is True
        assert sched.requires_kv_delivery is False
    try:
        from vllm.v1.metrics.cache_hit_source import CacheHitSource
    except ImportError:
        pass
    else:
        from tierd.connectors import vllm_base
        assert vllm_base.CacheHitSource is CacheHitSource
    worker.register_kv_caches(drv.paged_caches("BHN2D"))
    assert not worker.disabled, worker.disabled

    class VllmObjects(drv.Objects):
        def request(self, req_id, tokens, salt=None):
            return Request(request_id=req_id, prompt_token_ids=list(tokens),
                           sampling_params=SamplingParams(max_tokens=16), pooling_params=None, cache_salt=salt)

        def blocks(self, block_ids):
            return KVCacheBlocks(blocks=([KVCacheBlock(block_id=b) for b in block_ids],))

        def append_token(self, request, token):
            request.append_output_token_ids(token)

        def output(self, new, cached=(), finished=frozenset()):
            new_reqs = []
            for r, b, c, _ in new:
                r.num_computed_tokens = c
                new_reqs.append(NewRequestData.from_request(r, (list(b),)))
            cached_reqs = CachedRequestData(
                req_ids=[c[0] for c in cached], resumed_req_ids=set(), new_token_ids=[[] for _ in cached],
                all_token_ids={}, new_block_ids=[(list(c[1]),) if c[1] else None for c in cached],
                num_computed_tokens=[c[2] for c in cached], num_output_tokens=[1 for _ in cached])
            sched_tokens = {r.request_id: s for r, _, _, s in new} | {c[0]: c[3] for c in cached}
            return SchedulerOutput(
                scheduled_new_reqs=new_reqs, scheduled_cached_reqs=cached_reqs,
                num_scheduled_tokens=sched_tokens, total_num_scheduled_tokens=sum(sched_tokens.values()),
                scheduled_spec_decode_tokens={}, scheduled_encoder_inputs={}, finished_req_ids=set(finished),
                free_encoder_mm_hashes=[])

    objs = VllmObjects()
    # metadata crosses to the workers pickled
    r = objs.request("P", list(range(70)))
    drv.admit(sched, objs, r, 0, list(range(5)))
    meta = sched.build_connector_meta(objs.output([(r, range(5), 0, 70)]))
    assert [len(k) for k in pickle.loads(pickle.dumps(meta)).saves[0].keys] == [2]
    sched.request_finished(r, list(range(5)))

    store = tv._EMBEDDED[url]
    drv.run_roundtrip(sched, worker, objs, store)
    drv.run_load_error(sched, worker, objs, store)
    worker.shutdown()
    sched.shutdown()
    check_hybrid(config, layers, objs, store)
    check_state(url, layers, objs, store)
    store.close()
    check_declines(ktc, kv_cache_config, layers)
    tier_checked = check_secondary_tier()
    print(f"vLLM connector conformance: OK (vLLM {vllm.__version__}, torch {torch.__version__}; "
          f"checked {len(checked)} overridden methods: {', '.join(sorted(checked))}; "
          f"secondary tier: {tier_checked})")
    return 0


def check_hybrid(config, layers, objs, store) -> None:
    """vLLM's hybrid KV cache manager, with its own classes: its KVCacheConfig of a sliding-
    window group and a full-attention group, per-group block tables with the null block, the
    live table it offers connectors, and request_finished_all_groups (drv.run_hybrid)."""
    import torch
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
        SlidingWindowSpec,
    )

    from . import vllm_driver as drv

    common = dict(block_size=drv.BLOCK_SIZE, num_kv_heads=drv.KV_HEADS, head_size=drv.HEAD_DIM, dtype=torch.float16)
    groups = [KVCacheGroupSpec(layer_names=[layers[i] for i in drv.SLIDING_LAYERS],
                               kv_cache_spec=SlidingWindowSpec(sliding_window=drv.WINDOW, **common)),
              KVCacheGroupSpec(layer_names=[layers[i] for i in drv.FULL_LAYERS], kv_cache_spec=FullAttentionSpec(**common))]
    kv_cache_config = KVCacheConfig(num_blocks=drv.NUM_BLOCKS, kv_cache_tensors=[], kv_cache_groups=groups)
    sched, worker = vllm_pair(config, kv_cache_config, drv.hybrid_paged_caches())
    drv.run_hybrid(sched, worker, vllm_group_objects(objs), store)
    worker.shutdown()
    sched.shutdown()


def vllm_pair(config, kv_cache_config, caches):
    """A scheduler's and a worker's connector made by vLLM's factory for `kv_cache_config`, the
    worker given `caches`; neither declines."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    sched = KVConnectorFactory.create_connector(config, KVConnectorRole.SCHEDULER, kv_cache_config)
    worker = KVConnectorFactory.create_connector(config, KVConnectorRole.WORKER, kv_cache_config)
    assert not sched.disabled and not worker.disabled, (sched.disabled, worker.disabled)
    worker.register_kv_caches(caches)
    assert not worker.disabled, worker.disabled
    return sched, worker


def vllm_group_objects(objs):
    """drv.GroupObjects built of vLLM's own classes (block tables, scheduler outputs, the live
    table it offers connectors)."""
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.kv_cache_utils import KVCacheBlock
    from vllm.v1.core.sched.output import CachedRequestData, KVConnectorBlockState, NewRequestData, SchedulerOutput

    from . import vllm_driver as drv

    class VllmGroupObjects(drv.GroupObjects):
        request = type(objs).request

        def blocks(self, table):
            return KVCacheBlocks(blocks=tuple([KVCacheBlock(block_id=b) for b in row] for row in table))

        def live_output(self, new, cached=(), live=None):
            live = {k: tuple(list(r) for r in v) for k, v in (live or {}).items()}
            new_reqs = []
            for r, t, c, _ in new:
                r.num_computed_tokens = c
                new_reqs.append(NewRequestData.from_request(r, tuple(list(x) for x in t)))
            cached_reqs = CachedRequestData(
                req_ids=[c[0] for c in cached], resumed_req_ids=set(), new_token_ids=[[] for _ in cached],
                all_token_ids={}, new_block_ids=[tuple(list(x) for x in c[1]) if c[1] else None for c in cached],
                num_computed_tokens=[c[2] for c in cached], num_output_tokens=[1 for _ in cached])
            sched_tokens = {r.request_id: s for r, _, _, s in new} | {c[0]: c[3] for c in cached}
            return SchedulerOutput(
                scheduled_new_reqs=new_reqs, scheduled_cached_reqs=cached_reqs,
                num_scheduled_tokens=sched_tokens, total_num_scheduled_tokens=sum(sched_tokens.values()),
                scheduled_spec_decode_tokens={}, scheduled_encoder_inputs={}, finished_req_ids=set(),
                free_encoder_mm_hashes=[],
                kv_connector_block_state=KVConnectorBlockState(req_ids=set(live), resolve_block_ids=live.__getitem__,
                                                               boundary_state_offloads={}))

    return VllmGroupObjects()


def check_state(url, layers, objs, store) -> None:
    """Recurrent state beside attention, with vLLM's own classes: its MambaSpec groups in
    "align" mode (a state group per linear-attention layer) and an attention group
    (drv.run_state); the failed load reported as a failed request through vLLM's
    KVConnectorTransferResults."""
    import torch
    from vllm.config import DeviceConfig, KVTransferConfig, VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorTransferResults
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, MambaSpec

    from . import vllm_driver as drv

    extra = {k: v for k, v in drv.extra_config(url).items() if k != "block_tokens"}
    ktc = KVTransferConfig(kv_connector="TierdConnector", kv_connector_module_path="tierd.connectors.vllm",
                           kv_role="kv_both", kv_load_failure_policy="recompute", kv_connector_extra_config=extra)
    config = VllmConfig(device_config=DeviceConfig(device="cpu"), kv_transfer_config=ktc)
    config.cache_config.block_size = drv.BLOCK_SIZE
    config.compilation_config.static_forward_context.update(drv.forward_context("BHN2D", layers))
    state = MambaSpec(block_size=drv.BLOCK_SIZE, shapes=drv.STATE_SHAPES, dtypes=drv.STATE_DTYPES,
                      mamba_cache_mode="align")
    full = FullAttentionSpec(block_size=drv.BLOCK_SIZE, num_kv_heads=drv.KV_HEADS, head_size=drv.HEAD_DIM,
                             dtype=torch.float16)
    groups = [KVCacheGroupSpec(layer_names=[layers[i]], kv_cache_spec=state) for i in drv.STATE_LAYERS]
    groups.append(KVCacheGroupSpec(layer_names=[layers[drv.ATTN_LAYER]], kv_cache_spec=full))
    kv_cache_config = KVCacheConfig(num_blocks=drv.NUM_BLOCKS, kv_cache_tensors=[], kv_cache_groups=groups)
    sched, worker = vllm_pair(config, kv_cache_config, drv.state_paged_caches())
    assert isinstance(worker.get_transfer_results(set()), KVConnectorTransferResults)
    drv.run_state(sched, worker, vllm_group_objects(objs), store)
    worker.shutdown()
    sched.shutdown()


def check_declines(ktc, kv_cache_config, layers) -> None:
    """What the connector declines, with vLLM's own configs and backend classes: context
    parallelism (review S2), and a cache whose backend is not one it lists (review S12)."""
    from types import SimpleNamespace

    from vllm.config import DeviceConfig, VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from tierd.connectors import vllm_layout

    from . import vllm_driver as drv

    for attr in ("decode_context_parallel_size", "prefill_context_parallel_size"):
        assert hasattr(vllm_parallel_config(), attr), f"vLLM's ParallelConfig has no {attr}"
        config = VllmConfig(device_config=DeviceConfig(device="cpu"), kv_transfer_config=ktc)
        config.cache_config.block_size = drv.BLOCK_SIZE
        setattr(config.parallel_config, attr, 2)
        for role in (KVConnectorRole.SCHEDULER, KVConnectorRole.WORKER):
            c = KVConnectorFactory.create_connector(config, role, kv_cache_config)
            assert f"({attr}=2) is not supported" in c.disabled, (attr, c.disabled)
            c.shutdown()

    # vLLM's ROCm AITER flash attention answers to FLASH_ATTN too: known by its module, declined
    try:
        from vllm.v1.attention.backends.rocm_aiter_fa import AiterFlashAttentionBackend
    except Exception:  # noqa: BLE001 - not importable in this build: the stand-in test covers it
        return
    cfg = SimpleNamespace(compilation_config=SimpleNamespace(static_forward_context={
        n: SimpleNamespace(attn_backend=AiterFlashAttentionBackend) for n in layers}))
    name, _ = vllm_layout.backend_of(cfg, layers[0])
    assert AiterFlashAttentionBackend.get_name() == "FLASH_ATTN" and name != "FLASH_ATTN", name
    flash = drv.backend_class("FLASH_ATTN")
    assert isinstance(flash, type) and not flash.__name__.startswith("StandIn"), flash


def vllm_parallel_config():
    from vllm.config import ParallelConfig
    return ParallelConfig()


def check_secondary_tier() -> str:
    """The secondary tier and its specs against this vLLM's tiering API: no abstract method left,
    every overridden method with the base class's parameters."""
    from vllm.v1.kv_offload.base import OffloadingWorker
    from vllm.v1.kv_offload.tiering.base import SecondaryTierManager
    from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

    from tierd.connectors import vllm_tier as vt

    from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import OffloadingConnector

    n = sum(len(same_signatures(ours, base)) for ours, base in (
        (vt.TierdTier, SecondaryTierManager), (vt.HostCopyOffloadingWorker, OffloadingWorker),
        (vt.TierdTieringSpec, TieringOffloadingSpec), (vt.TierdOffloadingConnector, OffloadingConnector)))
    ours = list(inspect.signature(vt.TierdOffloadingConnector.__init__).parameters)
    theirs = list(inspect.signature(OffloadingConnector.__init__).parameters)
    assert ours == theirs, (ours, theirs)       # vLLM's factory constructs it as it does vLLM's
    return f"{n} overridden methods"


def same_signatures(ours: type, base: type) -> list[str]:
    """`ours` subclasses `base`, leaves no abstract method, and every public method it overrides
    takes the base's parameters (names and kinds, in order); parameters beyond them must have
    defaults (so one class serves vLLM releases that added a parameter). Returns the names checked."""
    assert issubclass(ours, base), (ours, base)
    assert not ours.__abstractmethods__, (ours, ours.__abstractmethods__)
    checked = []
    # the class and the halves it is made of (tierd's own classes in its MRO; the nearest wins)
    members: dict = {}
    for klass in reversed(ours.__mro__):
        if klass.__module__.startswith("tierd."):
            members.update(vars(klass))
    for name, member in members.items():
        theirs = getattr(base, name, None)
        if name.startswith("_") or not callable(member) or theirs is None:
            continue
        params = list(inspect.signature(member).parameters.values())
        a = [(p.name, p.kind) for p in params]
        b = [(p.name, p.kind) for p in inspect.signature(theirs).parameters.values()]
        extra = params[len(b):]
        assert a[:len(b)] == b and all(p.default is not inspect.Parameter.empty for p in extra), \
            f"{ours.__name__}.{name}: {a} does not take vLLM's {b}"
        checked.append(name)
    return checked


if __name__ == "__main__":
    sys.exit(main())
