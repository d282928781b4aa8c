"""A real vLLM engine (vLLM's CPU build, `make vllm-env`) running TierdConnector against a real
`tierd serve`, each engine in its own process (tests/vllm_engine.py).

One module-wide run does the work, so the suite starts three engines, not one per case:
- P0: vLLM without the connector: the reference tokens of every batch below;
- P1: vLLM with the connector and an empty daemon: stores blocks while generating;
- the bundled engine stores one prompt and loads one that P1 stored (cross-engine);
- P2: a fresh vLLM process with the connector: loads what P1 and the bundled engine stored, then
  runs batches while the test stalls (SIGSTOP), kills and restarts the daemon;
- S1, S2: tierd as the secondary tier of vLLM's own offloading: S1 stores, a fresh S2 loads; one
  LoRA adapter is retrained in place between them (same name and path, new weights);
- P3: a vLLM with the connector on the same checkpoint, told one load-time setting that changes
  KV (`hf_overrides` of the rope parameters): it shares nothing with the engines before it.
Every engine runs the same batches in the same order (fp32, greedy), with vLLM's own prefix cache
off (hits are tierd's alone), a token budget below the prompt length (chunked prefill) and a KV
cache small enough to force preemption. Each engine's time is limited (tests/vllm_wait.py: a
limit that fits a loaded 2-core machine, and an error naming the engine, its progress and its
log's last lines).
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest

from . import vllm_wait
from .daemon import DaemonProc
from .test_vllm_connector import ROOT, required_vllm_python

# pytest's own limit sits above the engines' budget, so a slow machine gets vllm_wait's message
pytestmark = [pytest.mark.slow, pytest.mark.timeout(vllm_wait.BUDGET_S + 600)]

BLOCK_TOKENS = 256
# The lookup deadline of these engines. Above the 50 ms default: on two cores shared by an engine,
# its worker, the daemon and pytest, a healthy daemon's answer can be late by tens of milliseconds
# now and then, and a missed deadline (correctly) costs that request its hit, which would make the
# exact hit counts below flaky. The 50 ms bound itself is tested without engines
# (test_vllm_connector.py::test_lookups_keep_their_deadline_on_a_stalled_daemon_and_recover).
DEADLINE_MS = 500
ENGINE = {"max_num_batched_tokens": 256, "num_gpu_blocks_override": 12, "max_model_len": 1024,
          "enable_prefix_caching": False,
          "max_num_seqs": 8}
TOML = """
[host]
slab_bytes = "4MiB"
[disk]
slab_bytes = "4MiB"
file_bytes = "64MiB"
"""


def _prompts():
    rng = random.Random(11)

    def toks(n):
        return [rng.randrange(1, 500) for _ in range(n)]

    shared = toks(2 * BLOCK_TOKENS)
    p = {"R1": toks(600), "R2": toks(600), "X": toks(600), "Y": toks(600), "Z": toks(600),
         "F1": toks(600), "F2": toks(600), "F3": toks(600)}
    p.update({f"S{i}": shared + toks(100) for i in range(4)})
    p.update({f"P{i}": toks(600) for i in range(4)})
    p.update({"O1": toks(600), "O2": toks(600)})
    return p


PROMPTS = _prompts()


def batch(name, *items, pause=False, max_tokens=16):
    """items: prompt name, or (prompt name, {"salt": ..., "lora": ...})."""
    prompts = []
    for it in items:
        key, opts = (it, {}) if isinstance(it, str) else it
        prompts.append({"tokens": PROMPTS[key], "max_tokens": max_tokens, "key": key, **opts})
    return {"name": name, "prompts": prompts, "pause": pause}


P1_BATCHES = [
    batch("repeat", "R1", ("R2", {"salt": "tenant-a"})),
    batch("shared", "S0", "S1", "S2", "S3"),
    batch("preempt", "P0", "P1", "P2", "P3", max_tokens=160),
    batch("lora", "X", ("X", {"lora": "A"})),
    batch("z", "Z"),
    batch("private", ("O1", {"kv_transfer_params": {"tierd": {"store": False}}}), "O2"),
]
P2_BATCHES = [
    batch("repeat", "R1", ("R2", {"salt": "tenant-a"})),
    batch("shared", "S0", "S1", "S2", "S3"),
    batch("preempt", "P0", "P1", "P2", "P3", max_tokens=160),
    batch("salt", ("R1", {"salt": "tenant-b"})),
    batch("lora_b", ("X", {"lora": "B"})),
    batch("lora_a", ("X", {"lora": "A"})),
    batch("cross", "Y"),
    # each request's own say (kv_transfer_params): O1 was not stored, O2 was
    batch("opt_unstored", "O1"),
    batch("opt_no_load", ("O2", {"kv_transfer_params": {"tierd": {"load": False}}})),
    batch("opt_unreadable", ("O2", {"kv_transfer_params": {"tierd": {"lod": False}}})),
    batch("opt_load", ("O2", {"kv_transfer_params": {"tierd": {"store": False}}})),
    batch("stall", "F1", "R1", pause=True),
    batch("kill", "F2", ("R2", {"salt": "tenant-a"}), pause=True),
    batch("restart", "F3", "R1", pause=True),
]
# the secondary tier: S1 stores X with adapter A and Z with adapter B; then A is retrained in
# place; a fresh S2 must find Z with B (unchanged) and must not find X with the new A
S1_BATCHES = [batch("repeat", "R1", ("R2", {"salt": "tenant-a"})),
              batch("tier_lora", ("X", {"lora": "A"}), ("Z", {"lora": "B"}))]
S2_BATCHES = [batch("repeat", "R1", ("R2", {"salt": "tenant-a"})),
              batch("tier_lora_b", ("Z", {"lora": "B"})),
              batch("tier_lora_a", ("X", {"lora": "A"}))]
# P3: the prompts P1 and P2 stored, on an engine whose rope_theta is overridden at load
P3_BATCHES = [batch("repeat", "R1", ("R2", {"salt": "tenant-a"})), batch("s0", "S0")]
# (the checkpoint's config has rope_parameters {rope_theta: 10000, rope_type: default})
P3_ENGINE = {**ENGINE, "hf_overrides": {"rope_parameters": {"rope_theta": 100000.0, "rope_type": "default"}}}
# P0's references for them (the retrained A's weights are the adapter A2 there)
REF_BATCHES = [batch("tier_lora_b", ("Z", {"lora": "B"})), batch("tier_lora_a", ("X", {"lora": "A2"}))]


def _spec(tmp: Path, name: str, model: Path, loras: dict, batches: list, url: str | None,
          tier: bool = False, **connector) -> Path:
    spec = {"model": str(model), "out": str(tmp / f"{name}.json"), "engine": ENGINE, "loras": loras,
            "batches": batches,
            "connector": None if url is None or tier else {"url": url, "block_tokens": BLOCK_TOKENS,
                                                           "lookup_deadline_ms": DEADLINE_MS, **connector}}
    if tier:   # vLLM's own offloading, tierd as its secondary tier
        # chunks of two vLLM blocks: the host-copy worker's sub-block placement is exercised
        spec["offload"] = {"spec_name": "TierdTieringSpec", "spec_module_path": "tierd.connectors.vllm_tier",
                           "cpu_bytes_to_use": 32 << 20, "block_size": BLOCK_TOKENS,
                           "secondary_tiers": [{"type": "TierdTier", "module_path": "tierd.connectors.vllm_tier",
                                                "url": url}]}
    path = tmp / f"{name}.spec.json"
    path.write_text(json.dumps(spec))
    return path


def _start(py: str, spec: Path, log: Path) -> subprocess.Popen:
    # TMPDIR: vLLM's IPC sockets land in the test's directory and go with it
    env = dict(os.environ, PYTHONPATH=str(ROOT), VLLM_LOGGING_LEVEL="WARNING", TMPDIR=str(spec.parent))
    return subprocess.Popen([py, "-m", "tests.vllm_engine", str(spec)], cwd=ROOT, env=env,
                            stdout=open(log, "wb"), stderr=subprocess.STDOUT)


def _finish(proc: subprocess.Popen, spec: Path, log: Path, budget: vllm_wait.Budget) -> dict:
    out = Path(json.loads(spec.read_text())["out"])
    rc = vllm_wait.wait(proc, f"vLLM engine {spec.name.split('.')[0]} (running its batches)", log, out=out,
                        budget=budget)
    assert rc == 0, f"vLLM engine failed ({rc}):\n" + log.read_text()[-6000:]
    return json.loads(out.read_text())


def _run(py: str, spec: Path, log: Path, budget: vllm_wait.Budget) -> dict:
    return _finish(_start(py, spec, log), spec, log, budget)


def _retrain_in_place(adapter: Path, new_weights: Path) -> None:
    """The adapter at `adapter` gets `new_weights`' files: same name and path, other content."""
    for f in new_weights.iterdir():
        shutil.copyfile(f, adapter / f.name)


def e2e_model(path: Path) -> Path:
    """The random-weight checkpoint the vLLM end-to-end tests run (fp32 on a CPU in seconds)."""
    from tierd.engine.random_model import write_random_model
    return write_random_model(path, vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                              num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                              max_position_embeddings=4096, seed=5)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    py = required_vllm_python()
    from tierd.engine import LLM, SamplingParams
    from tierd.engine.random_model import write_random_lora

    tmp = tmp_path_factory.mktemp("vllm-e2e")
    model = e2e_model(tmp / "model")
    loras = {"A": str(write_random_lora(tmp / "lora-a", model, seed=1)),
             "B": str(write_random_lora(tmp / "lora-b", model, seed=2)),
             "A2": str(write_random_lora(tmp / "lora-a2", model, seed=3))}   # A retrained
    budget = vllm_wait.Budget(what="the vLLM engines of test_vllm_engine.py")
    (tmp / "d").mkdir()
    daemon = DaemonProc(tmp / "d", host_bytes="64MiB", disk_bytes="256MiB", toml=TOML).start(timeout_s=120)
    url = daemon.url
    out: dict = {"daemon": daemon, "url": url}
    try:
        # P0 (reference) runs while nothing else does; then P1 stores
        out["p0"] = _run(py, _spec(tmp, "p0", model, loras, P1_BATCHES + [dict(b, pause=False) for b in P2_BATCHES]
                                   + REF_BATCHES, None), tmp / "p0.log", budget)
        out["p1"] = _run(py, _spec(tmp, "p1", model, loras, P1_BATCHES, url), tmp / "p1.log", budget)
        out["stats_p1"] = _stats(url)

        # the bundled engine: stores Y; loads Z, which vLLM stored
        sp = SamplingParams(max_tokens=16, temperature=0.0)
        plain = LLM(model, dtype="float32")
        out["engine_z_alone"] = plain.generate(prompt_token_ids=PROMPTS["Z"], sampling_params=sp)[0]
        with_tierd = LLM(model, dtype="float32", kv_store=url, kv_block_tokens=BLOCK_TOKENS)
        out["engine_z"] = with_tierd.generate(prompt_token_ids=PROMPTS["Z"], sampling_params=sp)[0]
        out["engine_y"] = with_tierd.generate(prompt_token_ids=PROMPTS["Y"], sampling_params=sp)[0]
        with_tierd.close()

        # P2: a fresh vLLM process; the daemon is stalled, killed and restarted under it
        # P1 loads as "auto" picks (small host-RAM hits: before the step); P2 always through
        # vLLM's asynchronous path
        spec = _spec(tmp, "p2", model, loras, P2_BATCHES, url, load_async=True)
        proc = _start(py, spec, tmp / "p2.log")
        res = Path(json.loads(spec.read_text())["out"])

        def at(name):
            ready = Path(f"{res}.ready-{name}")
            vllm_wait.until(ready.exists, proc, f"vLLM engine p2: waiting for it to reach batch {name!r}",
                            tmp / "p2.log", out=res, budget=budget)
            return Path(f"{res}.go-{name}")

        go = at("stall")
        out["stats_p2"] = _stats(url)
        daemon.signal(signal.SIGSTOP)
        go.write_text("")
        go = at("kill")
        daemon.signal(signal.SIGCONT)
        go.write_text("")
        time.sleep(0.05)
        daemon.kill()                                  # mid-batch
        go = at("restart")
        daemon.start(timeout_s=120)                    # same disk, new arena and socket
        go.write_text("")
        out["p2"] = _finish(proc, spec, tmp / "p2.log", budget)

        # tierd as the secondary tier of vLLM's own offloading: S1 cascades chunks into tierd, a
        # fresh S2 (empty CPU tier) promotes them back; between them adapter A is retrained in place
        out["s1"] = _run(py, _spec(tmp, "s1", model, loras, S1_BATCHES, url, tier=True), tmp / "s1.log", budget)
        _retrain_in_place(tmp / "lora-a", tmp / "lora-a2")
        out["s2"] = _run(py, _spec(tmp, "s2", model, loras, S2_BATCHES, url, tier=True), tmp / "s2.log", budget)
        out["stats_s2"] = _stats(url)

        spec = _spec(tmp, "p3", model, {}, P3_BATCHES, url)
        spec.write_text(json.dumps(dict(json.loads(spec.read_text()), engine=P3_ENGINE)))
        out["p3"] = _run(py, spec, tmp / "p3.log", budget)
        out["stats_p3"] = _stats(url)
        yield out
    finally:
        if daemon.alive():
            daemon.signal(signal.SIGCONT)
            daemon.stop()
        shutil.rmtree(tmp, ignore_errors=True)     # checkpoints, slab files: the disk is shared


def _stats(url: str) -> dict:
    import tierd
    with tierd.connect(url) as c:
        return c.stats()


def _batches(run: dict) -> dict[str, dict]:
    return {b["name"]: b for b in run["batches"]}


def _expected(runs, run: str, name: str) -> list[list[int]]:
    """P0's tokens for the batch `name` of run P1 or P2 (P0 ran P1's batches, then P2's)."""
    p0 = runs["p0"]["batches"]
    i = [b["name"] for b in P1_BATCHES].index(name) if run == "p1" else \
        len(P1_BATCHES) + [b["name"] for b in P2_BATCHES].index(name)
    assert p0[i]["name"] == name
    return [o["tokens"] for o in p0[i]["outputs"]]


def _reference(runs, name: str) -> list[list[int]]:
    """P0's tokens for one of REF_BATCHES (names P0 runs once)."""
    (b,) = [b for b in runs["p0"]["batches"] if b["name"] == name]
    return [o["tokens"] for o in b["outputs"]]


def _tokens(run: dict, name: str) -> list[list[int]]:
    return [o["tokens"] for o in _batches(run)[name]["outputs"]]


def _external(run: dict, name: str) -> float:
    return _batches(run)[name]["counters"].get("external_prefix_cache_hits", 0)


def test_a_fresh_engine_loads_prefixes_another_stored_with_identical_tokens(runs):
    # P1 ran with an empty tier: every batch's tokens equal vLLM's alone
    for b in P1_BATCHES:
        assert _tokens(runs["p1"], b["name"]) == _expected(runs, "p1", b["name"]), b["name"]
    # a second engine process re-running the prompts loads two tier blocks (512 tokens) each
    assert _external(runs["p2"], "repeat") == 2 * 2 * BLOCK_TOKENS
    assert _tokens(runs["p2"], "repeat") == _expected(runs, "p2", "repeat")
    print(f"\nvLLM {runs['p2']['vllm']}: repeat batch external hits {_external(runs['p2'], 'repeat'):.0f} tokens")


def test_b_preemption_with_a_small_kv_cache(runs):
    # the batch does not fit the KV cache: vLLM preempts (with and without tierd) and recomputes
    for run in ("p1", "p2"):
        assert _batches(runs[run])["preempt"]["counters"].get("num_preemptions", 0) > 0, run
    assert _tokens(runs["p1"], "preempt") == _expected(runs, "p1", "preempt")
    assert _tokens(runs["p2"], "preempt") == _expected(runs, "p2", "preempt")
    assert _external(runs["p2"], "preempt") >= 4 * 2 * BLOCK_TOKENS


def test_c_chunked_prefill_of_prompts_longer_than_the_token_budget(runs):
    # every prompt (600 tokens) exceeds max_num_batched_tokens (256): stored in chunks, loaded whole
    assert ENGINE["max_num_batched_tokens"] < len(PROMPTS["R1"])
    assert _tokens(runs["p1"], "repeat") == _expected(runs, "p1", "repeat")
    assert _external(runs["p2"], "repeat") > 0


def test_d_a_batch_sharing_a_prefix(runs):
    assert _external(runs["p2"], "shared") >= 4 * 2 * BLOCK_TOKENS
    assert _tokens(runs["p2"], "shared") == _expected(runs, "p2", "shared")


def test_requests_choose_what_the_tier_does_with_them(runs):
    # P1 ran O1 with "store": false: a fresh engine finds nothing of it; O2 was stored: found
    # only where the request lets the tier load (not with "load": false, nor with a wish that
    # cannot be read), and loaded by a request that only declines to store
    for name, hit in (("opt_unstored", 0), ("opt_no_load", 0), ("opt_unreadable", 0), ("opt_load", 2 * BLOCK_TOKENS)):
        assert _external(runs["p2"], name) == hit, name
        assert _tokens(runs["p2"], name) == _expected(runs, "p2", name), name
    assert _tokens(runs["p1"], "private") == _expected(runs, "p1", "private")


def test_e_cache_salt_isolation(runs):
    # R1 was stored without a salt and R2 with "tenant-a": R1 under "tenant-b" finds nothing
    assert _external(runs["p2"], "salt") == 0
    assert _tokens(runs["p2"], "salt") == _expected(runs, "p2", "salt")


def test_f_lora_adapters_never_share_kv(runs):
    # P1 stored X plain and X with adapter A; adapter B must not find either
    assert _external(runs["p2"], "lora_b") == 0
    assert _external(runs["p2"], "lora_a") == 2 * BLOCK_TOKENS
    assert _tokens(runs["p2"], "lora_b") == _expected(runs, "p2", "lora_b")
    assert _tokens(runs["p2"], "lora_a") == _expected(runs, "p2", "lora_a")
    assert _tokens(runs["p2"], "lora_a") != _tokens(runs["p2"], "lora_b")   # the adapters do differ


def test_g_daemon_stalled_killed_and_restarted_mid_run(runs):
    for name in ("stall", "kill", "restart"):
        assert _tokens(runs["p2"], name) == _expected(runs, "p2", name), name
    # a stalled daemon costs a request at most the lookup deadline (once per back-off period), and
    # saves give up after their wait
    p0 = runs["p0"]["batches"][len(P1_BATCHES) + [b["name"] for b in P2_BATCHES].index("stall")]
    extra = _batches(runs["p2"])["stall"]["wall_s"] - p0["wall_s"]
    print(f"\nstalled daemon: batch {_batches(runs['p2'])['stall']['wall_s']:.3f} s vs "
          f"{p0['wall_s']:.3f} s without tierd")
    assert extra < 2 * 2 * DEADLINE_MS / 1000 + 1.0


def test_cross_engine_blocks_give_each_engine_its_own_tokens(runs):
    """vLLM's CPU backend and the bundled engine store KV in different layouts; the connector
    converts, so each engine loading the other's blocks gets its own greedy tokens."""
    z, alone = runs["engine_z"], runs["engine_z_alone"]
    assert z.num_cached_tokens >= 2 * BLOCK_TOKENS - 16, "the bundled engine did not load vLLM's blocks"
    assert list(z.outputs[0].token_ids) == list(alone.outputs[0].token_ids)
    assert _external(runs["p2"], "cross") == 2 * BLOCK_TOKENS
    assert _tokens(runs["p2"], "cross") == _expected(runs, "p2", "cross")


def test_tierd_as_vllm_secondary_tier(runs):
    expected = _expected(runs, "p1", "repeat")
    assert _tokens(runs["s1"], "repeat") == expected
    # a fresh engine: vLLM's CPU tier is empty, the chunks come from tierd (2 of 256 tokens per prompt)
    assert _external(runs["s2"], "repeat") == 2 * 512
    assert _tokens(runs["s2"], "repeat") == expected
    layouts = [ns["description"].get("layout", "") for ns in runs["stats_s2"]["namespaces"].values()]
    assert any(lay.startswith("vllm-offload-v1/") for lay in layouts), layouts   # its own namespace


def test_the_secondary_tier_keys_lora_adapters_by_content(runs):
    """Review S1: vLLM's block hash names a LoRA adapter by name and path; on b90e890 the tier
    keyed chunks by it alone, so an adapter retrained in place got its predecessor's KV."""
    # S1 stored X with the first A and Z with B (P0's tokens for X with A are in its "lora" batch)
    assert _tokens(runs["s1"], "tier_lora") == [_expected(runs, "p1", "lora")[1], _reference(runs, "tier_lora_b")[0]]
    # the unchanged adapter B: its chunks come from tierd (a fresh engine, an empty CPU tier)
    assert _external(runs["s2"], "tier_lora_b") == 512
    assert _tokens(runs["s2"], "tier_lora_b") == _reference(runs, "tier_lora_b")
    # A under the same name and path, retrained: nothing of the old A is served
    assert _external(runs["s2"], "tier_lora_a") == 0
    assert _tokens(runs["s2"], "tier_lora_a") == _reference(runs, "tier_lora_a")


def test_an_engine_with_a_load_time_override_shares_nothing(runs):
    """Same checkpoint, same prompts, one setting applied at load that changes K (rope_theta):
    the engines before it stored these prefixes, and it must find none of them."""
    p3, p2 = runs["p3"], runs["p2"]
    assert _external(p2, "repeat") > 0, "the engine without the override did hit: the test shows nothing"
    for name in ("repeat", "s0"):   # (one request per prompt: no hit on its own stores)
        assert _external(p3, name) == 0, f"{name}: KV computed with another rope_theta was served"
    # the connector was on, storing under a namespace of its own
    before, after = runs["stats_s2"]["namespaces"], runs["stats_p3"]["namespaces"]
    new = [ns for name, ns in after.items() if name not in before]
    assert new and sum(ns["puts"] for ns in new) > 0, "the overridden engine stored nothing: was it declined?"
    # and what it computed is its own: the same prompts give other tokens than the checkpoint's
    assert _tokens(p3, "repeat") != _expected(runs, "p2", "repeat")
