"""Never slower than recompute, in a real vLLM (its CPU build, `make vllm-env`) with tierd's KV
connector against a real `tierd serve` whose disk tier's reads are slowed (disk.fault_file's
hang), then healed. The connector's lookups report as a hit only what the node's cost model
(tierd/costs.py) predicts to load faster than vLLM computes it: after the first slow hits the
disk is declined (vLLM computes those prompts: no external hit, the same tokens), and once the
disk heals (re-measured off the request's path) its prefixes load again.

The model computes far more per token than the other vLLM tests' (a 512-wide MLP of 2,048 over
the same 2 KiB of KV per token): a prompt's recompute is tens of times a healed disk's load and a
tenth of a slowed one's, so that neither decision hangs on a loaded machine's noise (with the
end-to-end model a healed load was 2x faster than computing, and one slow sample under CI's
load declined the disk again).

The prompts are stored by the bundled engine (its blocks and vLLM's share a namespace: the same
checkpoint, dtype and block size), which also seeds the recompute estimate with its probe; the
vLLM engine refines it from its own forwards. The reference tokens come from the same vLLM
engine at the end, with the tier off for those requests (`kv_transfer_params`).
"""

from __future__ import annotations

import json
import random
import shutil
import time
from pathlib import Path

import pytest

from . import vllm_wait
from .daemon import DaemonProc
from .test_vllm_connector import required_vllm_python
from .test_vllm_engine import BLOCK_TOKENS, TOML, _finish, _start

pytestmark = [pytest.mark.slow, pytest.mark.timeout(vllm_wait.BUDGET_S + 600)]

SLOW, HEALED = 4, 8          # requests on the slowed disk, then on the healed one
HANG_S = 1.5                 # every disk read, slowed: tens of recomputes of these prompts
ENGINE = {"max_num_batched_tokens": 1024, "max_model_len": 1024, "enable_prefix_caching": False,
          "max_num_seqs": 4}


def decide_model(path: Path) -> Path:
    """A random-weight checkpoint whose forward costs ~15 M multiply-adds a token for 2 KiB of
    KV (4 layers, one KV head of 64): computing a 512-token prefix takes ~0.1 s on 2 cores."""
    from tierd.engine.random_model import write_random_model
    return write_random_model(path, vocab_size=512, hidden_size=512, intermediate_size=2048, num_hidden_layers=4,
                              num_attention_heads=8, num_key_value_heads=1, head_dim=64,
                              max_position_embeddings=4096, seed=7)


def _prompts() -> dict[str, list[int]]:
    rng = random.Random(29)
    return {f"D{i}": [rng.randrange(1, 500) for _ in range(2 * BLOCK_TOKENS + 88)] for i in range(SLOW + HEALED)}


PROMPTS = _prompts()
NAMES = list(PROMPTS)


def _batch(name: str, key: str, *, pause: bool = True, tier: bool = True) -> dict:
    p = {"tokens": PROMPTS[key], "max_tokens": 8, "key": key}
    if not tier:
        p["kv_transfer_params"] = {"tierd": False}
    return {"name": name, "prompts": [p], "pause": pause}


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    py = required_vllm_python()
    import tierd
    from tierd.engine import LLM, SamplingParams

    tmp = tmp_path_factory.mktemp("vllm-decide")
    model = decide_model(tmp / "model")
    faults = tmp / "faults"
    (tmp / "d").mkdir()
    daemon = DaemonProc(tmp / "d", host_bytes="64MiB", disk_bytes="256MiB",
                        toml=TOML + f'fault_file = "{faults}"\nstall_s = 600\n').start(timeout_s=120)
    url = daemon.url
    out: dict = {}
    try:
        # the bundled engine stores every prompt (and seeds the recompute estimate)
        llm = LLM(model, dtype="float32", kv_store=url, kv_block_tokens=BLOCK_TOKENS, kv_load_policy="decide")
        for key in NAMES:
            llm.generate(prompt_token_ids=PROMPTS[key], sampling_params=SamplingParams(max_tokens=1))
        llm.close()
        batches = ([_batch(f"slow{i}", NAMES[i]) for i in range(SLOW)]
                   + [_batch(f"healed{i}", NAMES[SLOW + i]) for i in range(HEALED)]
                   + [_batch(f"ref{i}", k, pause=False, tier=False) for i, k in enumerate(NAMES)])
        spec = tmp / "v.spec.json"
        spec.write_text(json.dumps({"model": str(model), "out": str(tmp / "v.json"), "engine": ENGINE, "loras": {},
                                    "batches": batches,
                                    "connector": {"url": url, "block_tokens": BLOCK_TOKENS, "lookup_deadline_ms": 500,
                                                  "load_policy": "decide"}}))
        budget = vllm_wait.Budget(what="the vLLM engine of test_vllm_decide.py")
        proc = _start(py, spec, tmp / "v.log")
        res = tmp / "v.json"
        with tierd.connect(url) as ctl:
            for b in batches:
                if not b["pause"]:
                    break
                ready = Path(f"{res}.ready-{b['name']}")
                vllm_wait.until(ready.exists, proc, f"vLLM engine: waiting for it to reach batch {b['name']!r}",
                                tmp / "v.log", out=res, budget=budget)
                if b["name"] == "slow0":
                    faults.write_text(f"read=hang:{HANG_S}")
                elif b["name"] == "healed0":
                    faults.write_text("")
                ctl.sync()
                ctl.flush(tier="host")          # every prefix from disk alone
                time.sleep(1.2)                 # (measurements reach the node's model; probes run)
                Path(f"{res}.go-{b['name']}").write_text("")
            out["v"] = _finish(proc, spec, tmp / "v.log", budget)
            out["stats"] = ctl.stats()
        yield out
    finally:
        faults.write_text("")
        if daemon.alive():
            daemon.stop()
        shutil.rmtree(tmp, ignore_errors=True)


def _by_name(run) -> dict:
    return {b["name"]: b for b in run["v"]["batches"]}


def _external(b: dict) -> float:
    return b["counters"].get("external_prefix_cache_hits", 0)


def test_a_slowed_disk_is_declined_and_a_healed_one_loaded_again_with_identical_tokens(run):
    b = _by_name(run)
    for i, key in enumerate(NAMES):
        name = f"slow{i}" if i < SLOW else f"healed{i - SLOW}"
        assert b[name]["outputs"][0]["tokens"] == b[f"ref{i}"]["outputs"][0]["tokens"], name
        assert _external(b[f"ref{i}"]) == 0
    slow = [_external(b[f"slow{i}"]) for i in range(SLOW)]
    healed = [_external(b[f"healed{i}"]) for i in range(HEALED)]
    costs = run["stats"]["costs"]
    seen = (f"slowed disk: {slow}; healed: {healed}; the node's estimates: disk load "
            f"{costs['transfers']['disk/load']}, recompute {costs['recompute']}")
    print("\nexternal hits, " + seen)
    assert slow[-2:] == [0, 0], seen                    # declined once the disk was measured slow
    assert healed[-1] == 2 * BLOCK_TOKENS, seen          # loaded again once it healed
    ledger = costs["ledger"]["disk"]
    assert ledger["declined_tokens"] >= 2 * 2 * BLOCK_TOKENS, ledger
    assert ledger["loaded_tokens"] >= 2 * BLOCK_TOKENS, ledger
