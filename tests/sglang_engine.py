"""Runs a real SGLang engine (the offline `sglang.Engine` API, on a CPU through the test-only glue
in tests/sglang_cpu/) over batches of token-id prompts, with tierd's storage backend, SGLang's
own file backend or none, and writes what happened as JSON. Run in the SGLang environment
(`make sglang-env`) by tests/test_sglang.py and benchmarks/sglang_ttft.py:

    python -m tests.sglang_engine SPEC.json

SPEC: {"model": DIR, "out": PATH,
       "storage": null | "tierd" | "file",
       "hicache": true: the hierarchical cache on without a storage backend,
       "tierd": {extra-config keys for tierd's backend: url, ...},
       "file_dir": DIR (SGLang's file backend),
       "engine": {extra sglang.Engine arguments (tp_size, ...)},
       "env": {environment variables, set before SGLang is imported},
       "drain": true (default) | false: shutdown waits for storage writes (tierd's plugin),
       "drain_any": true: wait for them whatever the storage backend (a peer's, in benchmarks),
       "batches": [{"name": ..., "prompts": [{"tokens": [...], "max_tokens": n, "salt": s}],
                    "pause": bool, "one_by_one": bool}]}

A batch with "pause" first writes OUT.ready-NAME and waits for OUT.go-NAME (so a test can stop
or restart the daemon between batches). "one_by_one" sends its prompts one at a time (each
request's time to first token is then its own). Per batch the output has each prompt's
generated token ids, its cached tokens (a fresh engine's are storage hits) and wall time.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path


def shm_entries() -> set[str]:
    try:
        return set(os.listdir("/dev/shm"))
    except OSError:
        return set()


def drop_leaked_shm(before: set[str]) -> None:
    """SGLang leaves a semaphore and a `sglang_loads_*` file in /dev/shm per engine; remove the
    new ones no live process holds."""
    import psutil
    held = set()
    for p in psutil.process_iter():
        try:
            held.update(m.path for m in p.memory_maps())
        except (psutil.Error, OSError):
            pass
    for name in shm_entries() - before:
        path = f"/dev/shm/{name}"
        if name.startswith(("sglang_", "sgl_shm_", "sem.mp-")) and path not in held:
            try:
                os.unlink(path)
            except OSError:
                pass


def engine_args(spec: dict) -> dict:
    kw = dict(model_path=spec["model"], device="cpu", attention_backend="torch_native",
              disable_cuda_graph=True, page_size=16, skip_tokenizer_init=True, dtype="float32",
              max_total_tokens=8192, mem_fraction_static=0.05, random_seed=0, log_level="warning",
              )
    storage = spec.get("storage")
    if storage or spec.get("hicache"):
        kw.update(enable_hierarchical_cache=True, hicache_io_backend="direct", hicache_mem_layout="layer_first",
                  hicache_size=1)
    if storage:
        extra = {"prefetch_threshold": 16}
        if storage == "tierd":
            extra.update({"backend_name": "tierd", "module_path": "tierd.connectors.sglang",
                          "class_name": "TierdStorage", "interface_v1": 1})
            extra.update(spec.get("tierd") or {})
            backend = "dynamic"
        else:
            backend = storage
        kw.update(hicache_storage_backend=backend, hicache_storage_backend_extra_config=json.dumps(extra),
                  hicache_storage_prefetch_policy="wait_complete")
    kw.update(spec.get("engine") or {})
    return kw


def main(spec_path: str) -> int:
    spec = json.loads(Path(spec_path).read_text())
    os.environ.setdefault("SGLANG_USE_CPU_ENGINE", "1")
    os.environ.update(spec.get("env") or {})
    if spec.get("file_dir"):
        os.environ["SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR"] = spec["file_dir"]
    if not spec.get("drain", True):
        os.environ["TIERD_SGLANG_DRAIN_S"] = "0"
    if int((spec.get("engine") or {}).get("tp_size", 1)) > 1:
        os.environ.setdefault("SGLANG_CPU_OMP_THREADS_BIND", "0|1")
    import sglang as sgl

    out_path = Path(spec["out"])
    shm = shm_entries()
    result: dict = {"batches": []}
    t0 = time.perf_counter()
    engine = sgl.Engine(**engine_args(spec))
    result["start_s"] = time.perf_counter() - t0
    try:
        for batch in spec["batches"]:
            if batch.get("pause"):
                ready = Path(f"{out_path}.ready-{batch['name']}")
                go = Path(f"{out_path}.go-{batch['name']}")
                ready.write_text("")
                while not go.exists():
                    time.sleep(0.05)
            prompts = batch["prompts"]
            groups = [[p] for p in prompts] if batch.get("one_by_one") else [prompts]
            rows, t_batch = [], time.perf_counter()
            for group in groups:
                t = time.perf_counter()
                kwargs = {}
                if any(p.get("salt") for p in group):
                    kwargs["cache_salt"] = [p.get("salt") or "" for p in group]
                outs = engine.generate(
                    input_ids=[p["tokens"] for p in group],
                    sampling_params=[{"max_new_tokens": p.get("max_tokens", 8), "temperature": 0.0,
                                      "ignore_eos": True} for p in group], **kwargs)
                dt = time.perf_counter() - t
                for o in outs:
                    meta = o.get("meta_info", {})
                    rows.append({"tokens": list(o["output_ids"]), "cached": int(meta.get("cached_tokens", 0)),
                                 "cached_details": meta.get("cached_tokens_details"), "time_s": dt})
            result["batches"].append({"name": batch["name"], "outputs": rows,
                                      "wall_s": time.perf_counter() - t_batch})
            out_path.write_text(json.dumps(result))
    finally:
        t = time.perf_counter()
        if spec.get("drain_any"):
            from tierd.connectors.sglang import drain_engine
            drain_engine(engine, any_backend=True)
        engine.shutdown()
        result["shutdown_s"] = time.perf_counter() - t
        result["drain"] = getattr(engine, "tierd_drain", None)   # what tierd's shutdown wait met
        out_path.write_text(json.dumps(result))
        drop_leaked_shm(shm)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
