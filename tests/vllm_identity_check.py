"""The engine identity (connectors/identity.py) with vLLM's own configs, run in the vLLM
environment (`make vllm-env`) by tests/test_identity.py: `python -m tests.vllm_identity_check`.

- every vLLM setting that changes KV (`--quantization`, `hf_overrides` with rope overrides,
  `--kv-cache-dtype`, `--dtype`, `--load-format dummy`, another checkpoint) changes the identity
  `from_vllm` reads from a real `VllmConfig`, and settings that do not (seed, lengths, eager mode,
  served name, block size, memory) leave it;
- the KV connector and the secondary tier, made by vLLM's factory for a KV cache dtype tierd
  does not know (fp8_inc, fp8_ds_mla, nvfp4_ds_mla, turboquant_*), decline with one logged line
  each instead of raising into vLLM (review C3);
- a worker whose tensor-parallel rank vLLM cannot tell declines (review C5: rank 0 was assumed).
"""

from __future__ import annotations

import atexit
import logging
import shutil
import sys
import tempfile
from pathlib import Path

import torch

LAYERS, KV_HEADS, HEAD_DIM = 2, 2, 32
UNKNOWN_CACHE_DTYPES = ("fp8_inc", "fp8_ds_mla", "nvfp4_ds_mla", "turboquant_k8v4", "turboquant_4bit_nc")


class Lines(logging.Handler):
    """The warnings tierd logs, by message."""

    def __init__(self):
        super().__init__(logging.WARNING)
        self.lines: list[str] = []
        logging.getLogger("tierd").addHandler(self)

    def emit(self, record):
        self.lines.append(record.getMessage())


def main() -> int:
    from vllm.config import CacheConfig, DeviceConfig, KVTransferConfig, LoadConfig, ModelConfig, VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

    from tierd.connectors import identity
    from tierd.connectors import vllm as tv
    from tierd.engine.random_model import write_random_model

    tmp = Path(tempfile.mkdtemp(prefix="tierd-identity-check-"))
    atexit.register(shutil.rmtree, tmp, ignore_errors=True)
    shape = dict(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=LAYERS,
                 num_attention_heads=4, num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM, max_position_embeddings=2048)
    model = write_random_model(tmp / "model", seed=5, **shape)
    other = write_random_model(tmp / "other", seed=6, **shape)

    def vllm_config(model_dir=model, cache=None, load=None, ktc=None, **mc) -> VllmConfig:
        mc = ModelConfig(model=str(model_dir), skip_tokenizer_init=True, **{"max_model_len": 1024, **mc})
        return VllmConfig(model_config=mc, cache_config=CacheConfig(**(cache or {})), load_config=LoadConfig(**(load or {})),
                          device_config=DeviceConfig(device="cpu"), kv_transfer_config=ktc)

    def ident(config: VllmConfig):
        return identity.identify(identity.from_vllm(config))

    # -- the table, with vLLM's own configs ------------------------------------------------------------
    ref = ident(vllm_config())
    changes = {
        "--quantization fp8 on the checkpoint": vllm_config(quantization="fp8"),
        "hf_overrides: rope scaling": vllm_config(hf_overrides={"rope_scaling": {"rope_type": "linear", "factor": 2.0}}),
        "hf_overrides: rope parameters": vllm_config(hf_overrides={"rope_parameters": {"rope_type": "default",
                                                                                       "rope_theta": 20000.0}}),
        "--kv-cache-dtype fp8": vllm_config(cache={"cache_dtype": "fp8"}),
        "--kv-cache-dtype fp8_e5m2": vllm_config(cache={"cache_dtype": "fp8_e5m2"}),
        "--dtype float32": vllm_config(dtype="float32"),
        "--dtype float16": vllm_config(dtype="float16"),
        "--load-format dummy": vllm_config(load={"load_format": "dummy"}),
        "another checkpoint": vllm_config(model_dir=other),
    }
    seen = {"base": ref}
    for what, config in changes.items():
        got = ident(config)
        clash = [w for w, i in seen.items() if i == got]
        assert not clash, f"{what} keys like {clash}"
        seen[what] = got
    keeps = {
        "--seed": vllm_config(seed=7),
        "--max-model-len": vllm_config(max_model_len=512),
        "--enforce-eager": vllm_config(enforce_eager=True),
        "--served-model-name": vllm_config(served_model_name="alias"),
        "empty hf_overrides": vllm_config(hf_overrides={}),
        "--block-size": vllm_config(cache={"block_size": 64}),
        "--gpu-memory-utilization": vllm_config(cache={"gpu_memory_utilization": 0.5}),
        "--dtype as the engine resolves auto": vllm_config(dtype=str(vllm_config().model_config.dtype).removeprefix("torch.")),
        "--load-format safetensors": vllm_config(load={"load_format": "safetensors"}),
    }
    for what, config in keeps.items():
        assert ident(config) == ref, what
    try:
        ident(vllm_config(hf_overrides=lambda cfg: cfg))
    except identity.Declined as e:
        assert "function" in str(e), e
    else:
        raise AssertionError("hf_overrides given as a function was keyed")

    # -- the connector and the tier decline KV cache dtypes they do not know, one line each ------------
    url = f"embedded://?host=16MiB&disk={tmp}/disk&disk_bytes=64MiB"
    lines = Lines()
    bs = vllm_config().cache_config.block_size
    layers = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]
    kv_cache_config = KVCacheConfig(num_blocks=16, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(
        layer_names=layers, kv_cache_spec=FullAttentionSpec(block_size=bs, num_kv_heads=KV_HEADS,
                                                            head_size=HEAD_DIM, dtype=torch.bfloat16))])
    connector = KVTransferConfig(kv_connector="TierdConnector", kv_connector_module_path="tierd.connectors.vllm",
                                 kv_role="kv_both", kv_load_failure_policy="recompute",
                                 kv_connector_extra_config={"url": url})
    tier = KVTransferConfig(kv_connector="TierdOffloadingConnector",
                            kv_connector_module_path="tierd.connectors.vllm_tier", kv_role="kv_both",
                            kv_connector_extra_config={
                                "spec_name": "TierdTieringSpec", "spec_module_path": "tierd.connectors.vllm_tier",
                                "cpu_bytes_to_use": 8 << 20, "block_size": 256,
                                "secondary_tiers": [{"type": "TierdTier", "module_path": "tierd.connectors.vllm_tier",
                                                     "url": url}]})
    tier_notes = []
    for dtype in UNKNOWN_CACHE_DTYPES:
        config = vllm_config(ktc=connector)
        config.cache_config.cache_dtype = dtype      # (vLLM's own checks of the dtype are the platform's)
        for role in (KVConnectorRole.SCHEDULER, KVConnectorRole.WORKER):
            lines.lines.clear()
            c = KVConnectorFactory.create_connector(config, role, kv_cache_config)
            assert "KV cache dtype" in c.disabled and repr(dtype) in c.disabled, (dtype, c.disabled)
            assert len([m for m in lines.lines if "tierd connector disabled" in m]) == 1, lines.lines
            c.shutdown()
        config = vllm_config(ktc=tier)
        config.cache_config.cache_dtype = dtype
        lines.lines.clear()
        try:
            conn = KVConnectorFactory.create_connector(config, KVConnectorRole.SCHEDULER, kv_cache_config)
        except Exception as e:  # noqa: BLE001 - vLLM's own offloading may refuse the dtype; tierd must not
            from tierd.errors import TierdError
            assert not isinstance(e, TierdError), f"the tierd tier kept vLLM from starting: {e}"
            tier_notes.append(f"{dtype}: vLLM's offloading refuses it ({type(e).__name__})")
            continue
        (t,) = conn.connector_scheduler.manager.secondary_tiers
        assert t.ns is None and "KV cache dtype" in t.declined, (dtype, t.declined)
        assert len([m for m in lines.lines if "tierd tier declined" in m]) == 1, lines.lines
        conn.shutdown()
        tier_notes.append(f"{dtype}: declined")

    # the tier keys the engine as the connector does: one identity for both
    lines.lines.clear()
    conn = KVConnectorFactory.create_connector(vllm_config(ktc=tier, quantization="fp8"), KVConnectorRole.SCHEDULER,
                                               kv_cache_config)
    (t,) = conn.connector_scheduler.manager.secondary_tiers
    assert t.ns is not None and t.ns.model == ident(vllm_config(quantization="fp8")).model != ref.model, t.declined
    conn.shutdown()

    # -- a worker whose tensor-parallel rank vLLM cannot tell (its groups not set up) declines -----------
    config = vllm_config(ktc=connector)
    config.parallel_config.tensor_parallel_size = 2
    worker = KVConnectorFactory.create_connector(config, KVConnectorRole.WORKER, kv_cache_config)
    assert not worker.disabled, worker.disabled
    lines.lines.clear()
    caches = {n: torch.zeros(16, KV_HEADS // 2, bs, 2 * HEAD_DIM, dtype=torch.bfloat16) for n in layers}
    worker.register_kv_caches(caches)
    assert "tensor-parallel rank (of 2) is unknown" in worker.disabled, worker.disabled
    assert len([m for m in lines.lines if "tierd connector disabled" in m]) == 1, lines.lines
    worker.shutdown()

    store = tv._EMBEDDED.pop(url, None)
    if store is not None:
        store.close()
    print(f"vLLM identity check: OK ({len(changes)} settings change the namespace, {len(keeps)} do not; "
          f"tier: {'; '.join(tier_notes)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
