"""tierd's secondary tier of vLLM's offloading, with vLLM's own classes (its connector, spec,
tiering manager, requests, block hasher and offload keys) and no engine: how the tier keys LoRA
adapters (review S1). Run in the vLLM environment (`make vllm-env`) by tests/test_vllm_tier.py:
`python -m tests.vllm_tier_check`.

vLLM's block hashes name a LoRA adapter by name and path, and its tiering API gives a secondary
tier a request's id only. So the tier runs under `TierdOffloadingConnector`, which tells it each
request's adapter by content: an adapter retrained in place (same name, same path) must not find
the chunks of its predecessor; the same content finds them; a request the tier cannot key is
neither served nor stored; under vLLM's plain OffloadingConnector the tier refuses to start.
"""

from __future__ import annotations

import atexit
import logging
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

LAYERS, KV_HEADS, HEAD_DIM = 2, 2, 32


def main() -> int:
    from vllm.config import DeviceConfig, KVTransferConfig, ModelConfig, VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.lora.request import LoRARequest
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.kv_offload.base import LookupResult, ReqContext, ScheduleEndContext, make_offload_key
    from vllm.v1.kv_offload.tiering.base import TransferJob
    from vllm.v1.request import Request

    from tierd.connectors import vllm as tv
    from tierd.connectors import vllm_tier as vt
    from tierd.engine.random_model import write_random_lora, write_random_model
    from tierd.errors import TierdError

    tmp = Path(tempfile.mkdtemp(prefix="tierd-tier-check-"))
    atexit.register(shutil.rmtree, tmp, ignore_errors=True)   # also when a check fails
    model = write_random_model(tmp / "model", vocab_size=512, hidden_size=128, intermediate_size=256,
                               num_hidden_layers=LAYERS, num_attention_heads=4, num_key_value_heads=KV_HEADS,
                               head_dim=HEAD_DIM, max_position_embeddings=2048, seed=5)
    url = f"embedded://?host=16MiB&disk={tmp}/disk&disk_bytes=64MiB"
    extra = {"spec_name": "TierdTieringSpec", "spec_module_path": "tierd.connectors.vllm_tier",
             "cpu_bytes_to_use": 8 << 20, "block_size": 256,
             "secondary_tiers": [{"type": "TierdTier", "module_path": "tierd.connectors.vllm_tier", "url": url}]}

    def vllm_config(connector: str, module: str | None) -> VllmConfig:
        ktc = KVTransferConfig(kv_connector=connector, kv_connector_module_path=module, kv_role="kv_both",
                               kv_connector_extra_config=extra)
        mc = ModelConfig(model=str(model), dtype="float32", skip_tokenizer_init=True, max_model_len=1024)
        return VllmConfig(model_config=mc, device_config=DeviceConfig(device="cpu"), kv_transfer_config=ktc)

    config = vllm_config("TierdOffloadingConnector", "tierd.connectors.vllm_tier")
    bs = config.cache_config.block_size
    layers = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]
    kv_cache_config = KVCacheConfig(num_blocks=16, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(
        layer_names=layers, kv_cache_spec=FullAttentionSpec(block_size=bs, num_kv_heads=KV_HEADS,
                                                            head_size=HEAD_DIM, dtype=torch.float32))])

    # -- under vLLM's plain OffloadingConnector the tier refuses to start, saying what to use ---------
    try:
        KVConnectorFactory.create_connector(vllm_config("OffloadingConnector", None), KVConnectorRole.SCHEDULER,
                                            kv_cache_config)
    except TierdError as e:
        assert "TierdOffloadingConnector" in str(e), e
    else:
        raise AssertionError("the tierd tier started under vLLM's OffloadingConnector")

    # -- under TierdOffloadingConnector --------------------------------------------------------------
    conn = KVConnectorFactory.create_connector(config, KVConnectorRole.SCHEDULER, kv_cache_config)
    assert type(conn) is vt.TierdOffloadingConnector, type(conn)
    (tier,) = conn.connector_scheduler.manager.secondary_tiers
    assert isinstance(tier, vt.TierdTier)
    contexts: dict[str, ReqContext] = {}
    told = tier.on_new_request

    def recording(req_context):          # the tier's own method; only remembers the context
        contexts[req_context.req_id] = req_context
        return told(req_context)
    tier.on_new_request = recording

    init_none_hash(sha256)
    hasher = get_request_block_hasher(bs, sha256)
    tokens = list(range(1, 2 * bs + 1))
    adapter = write_random_lora(tmp / "lora", model, seed=1)
    retrained = write_random_lora(tmp / "lora-retrained", model, seed=2)
    broken = Path(shutil.copytree(adapter, tmp / "lora-broken"))
    (broken / "adapter_config.json").write_text("{not json")

    def request(rid: str, lora: LoRARequest | None) -> tuple[Request, ReqContext]:
        r = Request(request_id=rid, prompt_token_ids=tokens, sampling_params=SamplingParams(max_tokens=4),
                    pooling_params=None, lora_request=lora, block_hasher=hasher)
        conn.on_new_request(r)
        return r, contexts[rid]

    def key(r: Request):
        return make_offload_key(r.block_hashes[0], 0)     # the request's first chunk, as vLLM keys it

    row = tier._row

    def finished(job_id: int):
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            for res in tier.get_finished_jobs():
                if res.job_id == job_id:
                    return res
            time.sleep(0.01)
        raise AssertionError(f"tier job {job_id} never finished")

    jobs = iter(range(1000, 2000))

    def store(r, ctx, chunk: int, fill: int) -> bool:
        tier._primary[chunk * row:chunk * row + tier._used] = fill
        job = TransferJob(job_id=next(jobs), keys=[key(r)], chunk_ids=np.array([chunk]), is_promotion=False,
                          req_context=ctx)
        tier.submit_store(job)
        return finished(job.job_id).success

    def lookup(r, ctx) -> LookupResult:
        deadline = time.monotonic() + 60
        while True:
            res = tier.lookup(key(r), ctx)
            if res is not LookupResult.RETRY:
                return res
            assert time.monotonic() < deadline, "the tier's lookup never answered"
            tier.on_schedule_end(ScheduleEndContext(new_req_ids=(), preempted_req_ids=()))
            time.sleep(0.01)

    def load(r, ctx, chunk: int) -> bytes:
        tier._primary[chunk * row:chunk * row + tier._used] = 0
        job = TransferJob(job_id=next(jobs), keys=[key(r)], chunk_ids=np.array([chunk]), is_promotion=True,
                          req_context=ctx)
        tier.submit_load(job)
        assert finished(job.job_id).success
        return bytes(tier._primary[chunk * row:chunk * row + tier._used])

    def finish(*rs):
        for r, ctx in rs:
            tier.on_request_finished(ctx)

    # a LoRA request stores its chunk; another request with the same adapter content finds it
    lora_v1 = LoRARequest("adapter", 1, str(adapter))
    a1 = request("a1", lora_v1)
    assert store(*a1, chunk=0, fill=7)
    a2 = request("a2", LoRARequest("adapter", 1, str(adapter)))
    assert key(a1[0]) == key(a2[0])
    assert lookup(*a2) is LookupResult.HIT
    assert set(load(*a2, chunk=1)) == {7}
    # the base model's request with the same tokens: another vLLM key, and no hit
    base = request("base", None)
    assert key(base[0]) != key(a1[0]) and lookup(*base) is LookupResult.MISS
    finish(a1, a2, base)

    # the adapter is retrained in place and loaded again (a new adapter id, same name and path):
    # vLLM's key is the same, the content is not, so the old adapter's chunk is not served
    for f in retrained.iterdir():
        shutil.copyfile(f, adapter / f.name)
    a3 = request("a3", LoRARequest("adapter", 2, str(adapter)))
    assert key(a3[0]) == key(a1[0]), "vLLM's key covers the adapter's name and path only"
    assert lookup(*a3) is LookupResult.MISS
    assert store(*a3, chunk=2, fill=9)                  # its own chunk, under its own content
    finish(a3)                                          # (vLLM keeps a looked-up verdict while a request holds it)
    a4 = request("a4", LoRARequest("adapter", 2, str(adapter)))
    assert lookup(*a4) is LookupResult.HIT
    got = load(*a4, chunk=3)
    assert set(got) == {9}, (set(got), tier.stats)
    finish(a4)

    # an adapter whose content cannot be read as an adapter: neither served nor stored, logged once
    logged = []

    class Catch(logging.Handler):
        def emit(self, record):
            logged.append(record.getMessage())
    logging.getLogger("tierd.connectors.vllm_tier").addHandler(Catch())
    stored_before = tier.stats["stored"]
    b1 = request("b1", LoRARequest("broken", 3, str(broken)))
    assert not store(*b1, chunk=4, fill=5) and tier.stats["stored"] == stored_before
    assert lookup(*b1) is LookupResult.MISS
    b2 = request("b2", LoRARequest("broken", 3, str(broken)))
    assert lookup(*b2) is LookupResult.MISS
    assert len([m for m in logged if "'broken' cannot be keyed by its content" in m]) == 1, logged
    finish(b1, b2)

    # a request the engine did not announce (a peer's, through vLLM's ParentManager): declined
    peer = ReqContext(req_id="peer")
    tier.on_new_request(peer)
    assert tier.lookup(key(a4[0]), peer) is LookupResult.MISS
    tier.on_request_finished(peer)
    assert tier.stats["declined_requests"] == 3, tier.stats

    # load or recompute (tierd/costs.py): with the node's model saying that this engine computes
    # a chunk far faster than the host tier loads it, a chunk found is reported absent (vLLM
    # computes it) and counted as declined; once the tier is measured fast again, it is a hit
    assert tier.engine_key, "the tier cannot key this engine for the cost model"
    model = tier._connect("lookup").cost_model()
    for n in (64, 256, 1024):
        model.observe_forward(tier.engine_key, [(n, 0)], 1e-7 * n)
    for _ in range(3):
        model.observe_transfer("host", "load", tier._used, 5.0)
    tier.load_policy = "decide"
    d1 = request("d1", LoRARequest("adapter", 2, str(adapter)))
    assert lookup(*d1) is LookupResult.MISS, "a chunk that loads slower than it computes was reported a hit"
    assert tier.stats["declined_chunks"] >= 1, tier.stats
    assert model.ledger["host"]["declined_tokens"] >= tier.ns.block_tokens
    finish(d1)
    for _ in range(3):
        model.observe_transfer("host", "load", tier._used, 1e-6)
    d2 = request("d2", LoRARequest("adapter", 2, str(adapter)))
    assert lookup(*d2) is LookupResult.HIT
    assert set(load(*d2, chunk=5)) == {9}
    assert model.ledger["host"]["loaded_tokens"] >= tier.ns.block_tokens
    finish(d2)
    tier.load_policy = "always"

    conn.shutdown()

    # a hybrid model (a sliding-window group beside a full-attention one): the tier declines with
    # one line and stays inert, and vLLM's offloading starts and runs as without tierd
    from vllm.v1.kv_cache_interface import SlidingWindowSpec
    spec_kw = dict(block_size=bs, num_kv_heads=KV_HEADS, head_size=HEAD_DIM, dtype=torch.float32)
    hybrid = KVCacheConfig(num_blocks=16, kv_cache_tensors=[], kv_cache_groups=[
        KVCacheGroupSpec(layer_names=layers[0::2], kv_cache_spec=SlidingWindowSpec(sliding_window=bs, **spec_kw)),
        KVCacheGroupSpec(layer_names=layers[1::2], kv_cache_spec=FullAttentionSpec(**spec_kw))])
    logged.clear()
    try:
        conn = KVConnectorFactory.create_connector(config, KVConnectorRole.SCHEDULER, hybrid)
    except Exception as e:  # noqa: BLE001 - vLLM's own refusal is fine; the tier's would not be
        assert not isinstance(e, TierdError), f"the tierd tier kept vLLM from starting: {e}"
        hybrid_note = f"vLLM's offloading itself refuses a hybrid model here ({type(e).__name__})"
    else:
        (tier,) = conn.connector_scheduler.manager.secondary_tiers
        assert tier.ns is None and "KV cache groups" in tier.declined, tier.declined
        assert len([m for m in logged if "tierd tier declined" in m]) == 1, logged
        told = tier.on_new_request
        tier.on_new_request = recording
        r, ctx = request("h1", None)
        assert tier.lookup(key(r), ctx) is LookupResult.MISS
        job = TransferJob(job_id=next(jobs), keys=[key(r)], chunk_ids=np.array([0]), is_promotion=False,
                          req_context=ctx)
        tier.submit_store(job)
        assert not finished(job.job_id).success and tier.stats["stored"] == 0
        conn.shutdown()
        hybrid_note = "a hybrid model is declined, vLLM runs on"
    store_ = tv._EMBEDDED.pop(url, None)
    if store_ is not None:
        store_.close()
    shutil.rmtree(tmp, ignore_errors=True)
    print(f"vLLM secondary tier check: OK ({hybrid_note})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
