"""`tierd size` against what the vLLM connector stores, with vLLM's own configs; run in the vLLM
environment (`make vllm-env`) by tests/test_size.py: `python -m tests.vllm_size_check`.

For each model and tensor-parallel size below, a real `VllmConfig` (vLLM's ModelConfig over a
random-weight checkpoint written here, ParallelConfig(tensor_parallel_size=N): building the
config needs no process group) goes through the connector's own code:

- the scheduler connector, made by vLLM's factory, computes the namespace arguments
  (`TierdConnector._namespace_args`: `get_num_kv_heads(parallel_config)`, `get_head_size()`,
  `use_mla`) and names the namespace of every key rank (`TierdConnector.namespace`);
- one worker connector per tensor-parallel rank (vLLM's rank query answering that rank, as it
  does inside a worker) registers a paged cache of the shape vLLM allocates on that rank, and so
  picks its own namespace and whether it writes (`register_kv_caches`: MLA's rank 0 alone).

Compared with `tierd.cli.kv_plan(read_model_config(model), tp=N)`:

- `Namespace.block_bytes / block_tokens` of each writing worker's namespace, and the page bytes
  per token of the KV cache spec vLLM allocates on one rank (FullAttentionSpec /
  MLAAttentionSpec from the same model config), with `bytes_per_token_rank`;
- the number of distinct namespaces the workers write (ranks that store their own copy) with
  `copies`;
- the connector's default tier block (256 tokens rounded up to vLLM's block size) with
  kv_plan's default `block_tokens`.

MLA, honestly: vLLM 0.32's CPU build does set `model_config.use_mla` for the DeepSeek-V2-like
config (checked below; its MLA head size is kv_lora_rank + qk_rope_head_dim), so the latent
path of `_namespace_args` runs on vLLM's own decision. But the connector declines MLA on vLLM's
CPU platform (`TierdConnector._mla_declined`; asserted below), so here it stores nothing for an
MLA model. What it stores where that decline is lifted is checked with tests/vllm_mutant.py's
`cpu_mla` mutation (the same class with `_mla_declined` returning "", as it does off CPU) and
vLLM's CPU_MLA cache layout, the one latent backend the connector knows
(`vllm_layout.LATENT_BACKENDS`).

Prints one JSON line (`{"ok": ..., "cases": [...]}`); exits 1 on any mismatch.
"""

from __future__ import annotations

import atexit
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import torch

LLAMA = dict(vocab_size=512, hidden_size=256, intermediate_size=256, num_hidden_layers=3, num_attention_heads=8,
             num_key_value_heads=4, head_dim=32, max_position_embeddings=2048)
# DeepSeek-V2-Lite-like attention (kv_lora_rank 512 + rope 64: the only latent size vLLM's CPU
# MLA runs), a small MoE around it
MLA = dict(vocab_size=512, hidden_size=256, intermediate_size=256, num_hidden_layers=3, num_attention_heads=4,
           num_key_value_heads=4, max_position_embeddings=4096, kv_lora_rank=512, qk_rope_head_dim=64,
           qk_nope_head_dim=32, v_head_dim=32, q_lora_rank=None, n_routed_experts=4, num_experts_per_tok=2,
           moe_intermediate_size=64, n_shared_experts=1, first_k_dense_replace=1, n_group=1, topk_group=1)
# (case, model, tensor-parallel size); "llama-tp8" has more ranks than KV heads (4): one head
# per rank, each replicated on two ranks
CASES = [("llama", "llama", 1), ("llama-tp2", "llama", 2), ("llama-tp8", "llama", 8),
         ("mla", "mla", 1), ("mla-tp2", "mla", 2)]
NUM_BLOCKS = 4


def main() -> int:
    t0 = time.monotonic()
    from vllm.config import CacheConfig, DeviceConfig, KVTransferConfig, ModelConfig, ParallelConfig, VllmConfig
    from vllm.distributed import parallel_state
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, MLAAttentionSpec

    from tierd.cli import kv_plan
    from tierd.connectors import vllm as tv
    from tierd.engine.random_model import write_random_model
    from tierd.namespace import read_model_config

    from . import vllm_driver as drv

    tmp = Path(tempfile.mkdtemp(prefix="tierd-size-check-"))
    atexit.register(shutil.rmtree, tmp, ignore_errors=True)
    models = {"llama": write_random_model(tmp / "llama", seed=1, dtype="bfloat16", **LLAMA),
              "mla": write_random_model(tmp / "dsv2", architecture="deepseek_v2", seed=2, dtype="bfloat16", **MLA)}
    url = f"embedded://?host=64MiB&disk={tmp}/disk&disk_bytes=64MiB"
    results, notes, ok = [], [], True

    def ktc(module: str = "tierd.connectors.vllm", **extra) -> KVTransferConfig:
        return KVTransferConfig(kv_connector="TierdConnector", kv_connector_module_path=module, kv_role="kv_both",
                                kv_load_failure_policy="recompute", kv_connector_extra_config={"url": url, **extra})

    def vllm_config(model: str, tp: int, transfer: KVTransferConfig) -> VllmConfig:
        mc = ModelConfig(model=str(models[model]), skip_tokenizer_init=True, max_model_len=1024)
        return VllmConfig(model_config=mc, parallel_config=ParallelConfig(tensor_parallel_size=tp),
                          cache_config=CacheConfig(), device_config=DeviceConfig(device="cpu"),
                          kv_transfer_config=transfer)

    rank_query = parallel_state.get_tensor_model_parallel_rank
    for case, model, tp in CASES:
        config = vllm_config(model, tp, ktc())
        mc, pc = config.model_config, config.parallel_config
        bs = int(config.cache_config.block_size)
        mla = bool(mc.use_mla)
        assert mla == (model == "mla"), f"{case}: vLLM's use_mla is {mla}"
        layers = [f"model.layers.{i}.self_attn.{'mla_attn' if mla else 'attn'}" for i in range(mc.get_num_layers(pc))]
        heads, head_size = mc.get_num_kv_heads(pc), mc.get_head_size()
        if mla:
            spec = MLAAttentionSpec(block_size=bs, num_kv_heads=1, head_size=head_size, dtype=mc.dtype)
            backend, isa = "CPU_MLA", None
        else:
            spec = FullAttentionSpec(block_size=bs, num_kv_heads=heads, head_size=head_size, dtype=mc.dtype)
            backend, isa = "CPU_ATTN", "vec"
        kv_cache_config = KVCacheConfig(num_blocks=NUM_BLOCKS, kv_cache_tensors=[], kv_cache_groups=[
            KVCacheGroupSpec(layer_names=layers, kv_cache_spec=spec)])
        if mla:
            # the connector as it runs on this build: MLA declined, nothing stored
            sched = KVConnectorFactory.create_connector(config, KVConnectorRole.SCHEDULER, kv_cache_config)
            assert "MLA on vLLM's CPU build" in sched.disabled, sched.disabled
            sched.shutdown()
            config = vllm_config(model, tp, ktc("tests.vllm_mutant", mutation="cpu_mla"))
            notes.append(f"{case}: the connector declines MLA on vLLM's CPU build (stores nothing); compared with "
                         "that decline lifted (tests/vllm_mutant.py cpu_mla)")
        config.compilation_config.static_forward_context.update(
            {n: SimpleNamespace(attn_backend=drv.backend_class(backend), isa=isa) for n in layers})
        sched = KVConnectorFactory.create_connector(config, KVConnectorRole.SCHEDULER, kv_cache_config)
        assert not sched.disabled, f"{case}: {sched.disabled}"
        sched_ns = [sched.namespace("", rank=r) for r in range(sched.key_ranks)]

        workers = []
        try:
            for r in range(tp):
                parallel_state.get_tensor_model_parallel_rank = lambda r=r: r    # as inside rank r's worker
                w = KVConnectorFactory.create_connector(config, KVConnectorRole.WORKER, kv_cache_config)
                workers.append(w)
                shape = (NUM_BLOCKS, bs, head_size) if mla else (NUM_BLOCKS, heads, bs, 2 * head_size)
                w.register_kv_caches({n: torch.zeros(shape, dtype=mc.dtype) for n in layers})
                assert not w.disabled, f"{case} rank {r}: {w.disabled}"
                assert w.namespace("") == sched_ns[w._rank], f"{case} rank {r}: the worker's namespace is not " \
                                                              "the scheduler's for its rank"
        finally:
            parallel_state.get_tensor_model_parallel_rank = rank_query
        written = {}
        for w in workers:
            if w._writer:
                ns = w.namespace("")
                written[ns.id] = ns
        ns_bytes = sorted({ns.block_bytes / ns.block_tokens for ns in written.values()})
        plan = kv_plan(read_model_config(models[model]), tp=tp)
        got = {"bytes_per_token_rank": ns_bytes[0] if len(ns_bytes) == 1 else ns_bytes,
               "copies": len(written), "block_tokens": sched.block_tokens,
               "vllm_page_bytes_per_token": spec.page_size_bytes * len(layers) / bs}
        want = {"bytes_per_token_rank": plan["bytes_per_token_rank"], "copies": plan["copies"],
                "block_tokens": plan["block_tokens"], "vllm_page_bytes_per_token": plan["bytes_per_token_rank"]}
        mismatches = {k: {"connector" if k != "vllm_page_bytes_per_token" else "vllm": got[k], "kv_plan": want[k]}
                      for k in got if got[k] != want[k]}
        ok &= not mismatches
        any_ns = next(iter(written.values()))
        results.append({"case": case, "tp": tp, "use_mla": mla, "vllm_block_size": bs,
                        "vllm": {"num_kv_heads": heads, "head_size": head_size, "layers": len(layers),
                                 "dtype": str(mc.dtype).removeprefix("torch.")},
                        "connector": {**got, "tp_size": any_ns.tp_size, "planes": any_ns.planes,
                                      "num_kv_heads": any_ns.num_kv_heads, "head_dim": any_ns.head_dim,
                                      "kv_dtype": any_ns.kv_dtype, "writers": sum(w._writer for w in workers)},
                        "kv_plan": {k: plan[k] for k in ("layout", "kv_heads_per_rank", "head_dim", "planes", "dtype",
                                                         "bytes_per_token_rank", "copies", "block_tokens")},
                        "ok": not mismatches, "mismatches": mismatches})
        for w in (*workers, sched):
            w.shutdown()
    store = tv._EMBEDDED.pop(url, None)
    if store is not None:
        store.close()
    print(json.dumps({"ok": ok, "cases": results, "notes": notes, "seconds": round(time.monotonic() - t0, 1)}))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
