"""Runs a real vLLM engine (the offline `vllm.LLM` API) over batches of token-id prompts, with or
without `TierdConnector`, and writes what happened as JSON. Run in the vLLM environment
(`make vllm-env`) by tests/test_vllm_engine.py and benchmarks/vllm_ttft.py:

    python -m tests.vllm_engine SPEC.json

SPEC: {"model": DIR, "out": PATH, "connector": null | {kv_connector_extra_config...},
       "connector_module": the connector's module (tierd.connectors.vllm by default),
       "env": {environment variables for vLLM, set before it is imported},
       "connector_stats": bool (each batch's change in the worker connector's counters, through
                          vLLM's collective_rpc: tierd's load_s and loaded_bytes),
       "offload": null | {kv_connector_extra_config of vLLM's OffloadingConnector (tierd's
                  TierdOffloadingConnector where a secondary tier is tierd's)},
       "kv_transfer": null | {KVTransferConfig arguments} (another connector: a peer's, for
                      benchmarks/vllm_ttft.py --peers),
       "engine": {extra vllm.LLM arguments}, "loras": {name: dir},
       "batches": [{"name": ..., "prompts": [{"tokens": [...], "salt": s, "lora": name,
                    "max_tokens": n, "ignore_eos": bool, "kv_transfer_params": {...}}],
                    "pause": bool}]}

A batch with "pause" first writes OUT.ready-NAME and waits for OUT.go-NAME (so a test can stop,
kill or restart the daemon between batches). Per batch the output has each prompt's generated
token ids and num_cached_tokens, vLLM's own prefix-cache counters for the batch (external hits
are what the connector loaded), the batch's wall time and each request's time to first token.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path


def _counters(llm) -> dict[str, float]:
    out = {}
    for m in llm.get_metrics():
        if ("prefix_cache" in m.name or "preemption" in m.name) and hasattr(m, "value"):
            out[m.name.removeprefix("vllm:")] = float(m.value)
    return out


def _connector_stats(worker) -> dict:
    """The KV connector's counters in this worker (tierd's: load_s, loaded_bytes, ...), or {}."""
    from vllm.distributed.kv_transfer.kv_transfer_state import get_kv_transfer_group, has_kv_transfer_group
    if not has_kv_transfer_group():
        return {}
    stats = getattr(get_kv_transfer_group(), "stats", None)
    return {k: v for k, v in stats.items() if isinstance(v, (int, float))} if isinstance(stats, dict) else {}


def _summed(per_worker: list[dict]) -> dict:
    out: dict = {}
    for d in per_worker:
        for k, v in d.items():
            out[k] = out.get(k, 0) + v
    return out


def main(spec_path: str) -> int:
    spec = json.loads(Path(spec_path).read_text())
    os.environ.update(spec.get("env") or {})                      # before vLLM reads its settings
    os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "1")   # same threads with and without a connector
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")         # GiB
    if spec.get("connector_stats"):     # collective_rpc with a function (this harness's own, local)
        os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.inputs import TokensPrompt
    from vllm.lora.request import LoRARequest

    kw = dict(model=spec["model"], dtype="float32", enforce_eager=True, skip_tokenizer_init=True,
              max_model_len=2048, disable_log_stats=False, seed=0, gpu_memory_utilization=0.2)
    kw.update(spec.get("engine", {}))
    if spec.get("connector") is not None:
        kw["kv_transfer_config"] = KVTransferConfig(
            kv_connector="TierdConnector", kv_role="kv_both",
            kv_connector_module_path=spec.get("connector_module") or "tierd.connectors.vllm",
            kv_load_failure_policy="recompute", kv_connector_extra_config=spec["connector"])
    elif spec.get("kv_transfer") is not None:
        kw["kv_transfer_config"] = KVTransferConfig(**spec["kv_transfer"])
    elif spec.get("offload") is not None:
        # tierd's tier runs under TierdOffloadingConnector (vLLM's, telling the tier each request's
        # LoRA adapter); vLLM's own tiers under vLLM's OffloadingConnector
        tiers = spec["offload"].get("secondary_tiers") or ()
        ours = any(t.get("module_path") == "tierd.connectors.vllm_tier" for t in tiers)
        kw["kv_transfer_config"] = KVTransferConfig(
            kv_connector="TierdOffloadingConnector" if ours else "OffloadingConnector",
            kv_connector_module_path="tierd.connectors.vllm_tier" if ours else None,
            kv_role="kv_both", kv_connector_extra_config=spec["offload"])
    loras = spec.get("loras") or {}
    if loras:
        kw.update(enable_lora=True, max_lora_rank=8, max_loras=2)
    t0 = time.perf_counter()
    llm = LLM(**kw)
    result = {"startup_s": time.perf_counter() - t0, "vllm": __import__("vllm").__version__, "batches": []}
    lora_reqs = {name: LoRARequest(name, i + 1, path) for i, (name, path) in enumerate(sorted(loras.items()))}
    out = Path(spec["out"])
    for batch in spec["batches"]:
        if batch.get("pause"):
            Path(f"{out}.ready-{batch['name']}").write_text("")
            go = Path(f"{out}.go-{batch['name']}")
            while not go.exists():
                time.sleep(0.05)
        prompts, params, lreqs = [], [], []
        for p in batch["prompts"]:
            tp = TokensPrompt(prompt_token_ids=p["tokens"])
            if p.get("salt"):
                tp["cache_salt"] = p["salt"]
            prompts.append(tp)
            params.append(SamplingParams(max_tokens=p.get("max_tokens", 16), temperature=0.0, detokenize=False,
                                         ignore_eos=bool(p.get("ignore_eos", False)),
                                         extra_args={"kv_transfer_params": p["kv_transfer_params"]}
                                         if "kv_transfer_params" in p else None))
            lreqs.append(lora_reqs[p["lora"]] if p.get("lora") else None)
        before = _counters(llm)
        cbefore = _summed(llm.collective_rpc(_connector_stats)) if spec.get("connector_stats") else {}
        t = time.perf_counter()
        outs = llm.generate(prompts, params, lora_request=lreqs if loras else None, use_tqdm=False)
        wall = time.perf_counter() - t
        after = _counters(llm)
        cafter = _summed(llm.collective_rpc(_connector_stats)) if spec.get("connector_stats") else {}
        rows = []
        for o in outs:
            m = o.metrics
            ttft = None
            if m is not None and getattr(m, "first_token_latency", None) is not None:
                ttft = float(m.first_token_latency)
            rows.append({"tokens": list(o.outputs[0].token_ids), "num_cached_tokens": o.num_cached_tokens,
                         "ttft_s": ttft})
        result["batches"].append({"name": batch["name"], "wall_s": wall, "outputs": rows,
                                  "counters": {k: after.get(k, 0) - before.get(k, 0) for k in after},
                                  "connector": {k: cafter[k] - cbefore.get(k, 0) for k in cafter}})
        out.write_text(json.dumps(result))
    result["done"] = True
    out.write_text(json.dumps(result))
    print(json.dumps({"startup_s": result["startup_s"], "batches": len(result["batches"])}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
