"""The model families beyond full attention in a real vLLM (vLLM's CPU build, `make vllm-env`)
with TierdConnector and a real `tierd serve`, each engine in its own process
(tests/vllm_engine.py). Tiny random-weight checkpoints are written here.

- gpt-oss-like (sliding-window and full-attention layers alternating, MoE): with vLLM's hybrid
  KV cache manager on (the connector is `SupportsHMA`: a group per kind, block ids per group,
  the groups aliasing one another's memory) and off (one full-attention group);
- Mistral-like (a window on every layer): one sliding-window group, its blocks freed as they
  leave the window.

Engines (fp32, greedy, vLLM's own prefix cache off so hits are tierd's alone, a token budget
below the prompt length so prefills are chunked and windows free blocks mid-prompt):
- G1, hybrid manager on: stores A and B while generating (an empty tier: its tokens are
  recompute's);
- G2, hybrid manager off: A finds nothing of G1's (another group structure, another namespace),
  generates recompute's tokens and stores A its own way; a second request for A loads it;
- G3, hybrid manager on, a fresh process: loads A and B from G1's blocks;
- GX, hybrid manager on, a connector whose layers take the other group's block ids (a mutant,
  tests/vllm_mutant.py): must not give recompute's tokens, or the test could not see that
  mistake;
- M1 / M2: Mistral-like, M1 stores, a fresh M2 loads;
- DeepSeek-V2-like (dense + MoE layers) and DeepSeek-V3-like (q_lora, noaux_tc routing), MLA
  with the real latent size (512 + 64; vLLM's CPU build runs no other). vLLM's CPU build computes
  other tokens over an MLA prefix it did not compute itself — measured with the latent rows byte
  for byte what the storing engine held — so the connector declines MLA there: D0 / D1 (without
  / with the connector) show the model runs, declined with one line, with the tokens it gives
  alone; E1 that V3 runs declined. X1 / X2 check the latent path end to end with the decline lifted
  (tests/vllm_mutant.py `cpu_mla`): X1 stores, a fresh X2 loads, and the rows X2's cache holds
  after the load are the rows X1's cache held (whole prompts per step: no chunked prefill with
  MLA on CPU);
- P1 / P2: Llama-like with pipeline parallelism (2 stages, a worker process each): each stage
  stores its own layers under its own namespace, a fresh P2 loads both;
- Q1 / Q2: Qwen3-Next-like (three linear-attention layers and one full-attention layer, MoE,
  bf16, vLLM's prefix caching on: its "align" mode keeps the state at block boundaries): Q1
  stores (the attention KV, and the state where a step ended on a block), a fresh Q2 loads
  both; QX, a mutant that does not restore the state, gives other tokens;
- K1: Granite-4-like (Mamba2 + attention), which vLLM's CPU build runs only with prefix caching
  off: declined with one line, and the engine generates.
"""

from __future__ import annotations

import json
import random
import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from . import vllm_wait
from .daemon import DaemonProc
from .test_vllm_connector import required_vllm_python
from .test_vllm_engine import DEADLINE_MS, TOML, _run   # (a late answer on a loaded machine is not a miss)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(vllm_wait.BUDGET_S + 600)]

BLOCK_TOKENS = 256
WINDOW = 128            # vLLM's CPU blocks are 128 tokens: a window of one block, a tier block of two
# MLA: no chunked prefill on CPU, and vLLM's reference CPU MLA backend on every machine (on a
# CPU with AMX it would pick its AMX backend, which takes bf16 weights only)
WHOLE = {"max_num_batched_tokens": 1024, "attention_backend": "CPU_MLA"}
ENGINE = {"max_num_batched_tokens": 256, "max_model_len": 1024, "enable_prefix_caching": False,
          "max_num_seqs": 4}


def _prompts():
    rng = random.Random(23)
    prompts = {k: [rng.randrange(1, 500) for _ in range(600)] for k in ("A", "B", "C")}
    prompts["D"] = [rng.randrange(1, 500) for _ in range(500)]   # tier block 1 completes in decode
    prompts["C2"] = prompts["A"][:300] + [rng.randrange(1, 500) for _ in range(300)]   # A's first 300
    return prompts


PROMPTS = _prompts()


def batch(name, *keys, max_tokens=16, tokens=None):
    return {"name": name, "prompts": [{"tokens": tokens if tokens is not None else PROMPTS[k],
                                       "max_tokens": max_tokens, "key": k} for k in keys]}


def _spec(tmp: Path, name: str, model: Path, batches: list, url: str | None, hybrid: bool = True,
          module: str = "tierd.connectors.vllm", engine: dict | None = None, env: dict | None = None,
          **connector) -> Path:
    engine = dict(ENGINE, disable_hybrid_kv_cache_manager=not hybrid, **(engine or {}))
    spec = {"model": str(model), "out": str(tmp / f"{name}.json"), "engine": engine, "batches": batches,
            "env": env or {},
            # saves wait up to 5 s for their slots: on a loaded machine a dropped save would
            # change the exact hits these tests count (the 50 ms default is tested without engines)
            "connector": None if url is None else {"url": url, "block_tokens": BLOCK_TOKENS,
                                                   "lookup_deadline_ms": DEADLINE_MS, "save_wait_ms": 5000,
                                                   **connector},
            "connector_module": module}
    path = tmp / f"{name}.spec.json"
    path.write_text(json.dumps(spec))
    return path


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    py = required_vllm_python()
    from tierd.engine.random_model import write_random_model

    tmp = tmp_path_factory.mktemp("vllm-models")
    small = dict(vocab_size=512, hidden_size=128, num_hidden_layers=4, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=32, max_position_embeddings=4096, sliding_window=WINDOW)
    gptoss = write_random_model(tmp / "gptoss", architecture="gpt_oss", intermediate_size=128,
                                num_local_experts=4, num_experts_per_tok=2, seed=5,
                                layer_types=["sliding_attention", "full_attention"] * 2, **small)
    mistral = write_random_model(tmp / "mistral", architecture="mistral", intermediate_size=256, seed=6, **small)
    qnext = write_random_model(tmp / "qnext", architecture="qwen3_next", vocab_size=512, hidden_size=256,
                               intermediate_size=256, num_hidden_layers=4, num_attention_heads=4,
                               num_key_value_heads=2, head_dim=64, max_position_embeddings=4096, seed=7,
                               layer_types=["linear_attention"] * 3 + ["full_attention"],
                               linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=64,
                               linear_value_head_dim=64, linear_conv_kernel_dim=4, num_experts=4,
                               num_experts_per_tok=2, moe_intermediate_size=128,
                               shared_expert_intermediate_size=128,
                               # a slow decay: the state after 512 tokens still steers the tokens
                               # generated 88 tokens on (with random A_log it fades in ~30 tokens,
                               # and a missing state would go unseen)
                               fill={"A_log": -6.0})
    granite = write_random_model(tmp / "granite", architecture="granite_hybrid", vocab_size=512, hidden_size=128,
                                 intermediate_size=256, num_hidden_layers=4, num_attention_heads=4,
                                 num_key_value_heads=2, max_position_embeddings=4096, seed=11,
                                 layer_types=["linear_attention"] * 3 + ["attention"], mamba_n_heads=8,
                                 mamba_d_head=32, mamba_d_state=16, mamba_n_groups=1, mamba_chunk_size=64,
                                 num_local_experts=4, num_experts_per_tok=2, shared_intermediate_size=128)
    budget = vllm_wait.Budget(what="the vLLM engines of test_vllm_models.py")
    shm_before = set(Path("/dev/shm").glob("vllm_*")) if Path("/dev/shm").is_dir() else set()
    (tmp / "d").mkdir()
    daemon = DaemonProc(tmp / "d", host_bytes="64MiB", disk_bytes="256MiB", toml=TOML).start(timeout_s=120)
    url = daemon.url
    out: dict = {}

    mla = dict(vocab_size=512, hidden_size=256, intermediate_size=256, num_hidden_layers=3,
               num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=4096, kv_lora_rank=512,
               qk_rope_head_dim=64, qk_nope_head_dim=32, v_head_dim=32, n_routed_experts=4,
               num_experts_per_tok=2, moe_intermediate_size=64, n_shared_experts=1, first_k_dense_replace=1)
    dsv2 = write_random_model(tmp / "dsv2", architecture="deepseek_v2", q_lora_rank=None, n_group=1, topk_group=1,
                              seed=8, **mla)
    dsv3 = write_random_model(tmp / "dsv3", architecture="deepseek_v3", q_lora_rank=64, n_group=1, topk_group=1,
                              topk_method="noaux_tc", seed=9, **mla)
    llama = write_random_model(tmp / "llama", vocab_size=512, hidden_size=128, intermediate_size=256,
                               num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                               max_position_embeddings=4096, seed=10)

    def run(name, model, batches, connect=True, lane=0, env=None, **kw):
        # an engine's one OpenMP thread on its lane's core: the two lanes below do not share one
        env = {"VLLM_CPU_OMP_THREADS_BIND": str(lane), **(env or {})}
        out[name] = _run(py, _spec(tmp, name, model, batches, url if connect else None, env=env, **kw),
                         tmp / f"{name}.log", budget)
        out[name]["log"] = (tmp / f"{name}.log").read_text(errors="replace")

    def windows_and_mla():
        run("g1", gptoss, [batch("store", "A", "B"), batch("decode", "D", max_tokens=24)])
        # D and the tokens G1 generated: tier block 1 (tokens 256-511) was completed by a decode
        # step, when the window had freed its first half: its sliding layers hold zeros there
        (gen,) = _tokens(out["g1"], "decode")
        d2 = PROMPTS["D"] + gen + [7] * 8
        run("g2", gptoss, [batch("cross", "A"), batch("again", "A"), batch("decoded", "D2", tokens=d2)],
            hybrid=False)
        run("g3", gptoss, [batch("load", "A", "B"), batch("decoded", "D2", tokens=d2)])
        run("gx", gptoss, [batch("load", "A")], module="tests.vllm_mutant", mutation="swap_groups")
        run("m1", mistral, [batch("store", "A", "C")])
        run("m2", mistral, [batch("load", "A", "C")])
        run("d0", dsv2, [batch("plain", "A")], connect=False, engine=WHOLE)
        run("d1", dsv2, [batch("plain", "A")], engine=WHOLE)
        run("e1", dsv3, [batch("plain", "A")], engine=WHOLE)

    def latent_stages_and_state():
        lane = 1
        dump = tmp / "latent-rows"
        dump.mkdir()
        lifted = dict(engine=WHOLE, module="tests.vllm_mutant", mutation="cpu_mla", dump=str(dump))
        run("x1", dsv2, [batch("store", "A", "B")], lane=lane, **lifted)
        run("x2", dsv2, [batch("load", "A", "B")], lane=lane, **lifted)
        out["latent_rows"] = _latent_rows(dump)
        # two stages on two cores, a worker each; vLLM's CPU runner needs its warm-up (no
        # enforce_eager) for a second stage, and a dynamo trace without inductor keeps it short
        pp = dict(engine={"pipeline_parallel_size": 2, "enforce_eager": False,
                          "compilation_config": {"mode": 2, "backend": "eager"}},
                  env={"VLLM_CPU_OMP_THREADS_BIND": "0|1"})
        run("p1", llama, [batch("store", "A", "B")], **pp)
        run("p2", llama, [batch("load", "A", "B")], **pp)
        # vLLM's CPU linear attention (GDN) runs in bf16 only; its prefix caching puts the
        # state in "align" mode (kept at block boundaries), which the connector needs
        qeng = {"dtype": "bfloat16", "enable_prefix_caching": True}
        # the state is kept at vLLM's block boundaries, whose size vLLM derives from the machine
        # (256 tokens on some CPUs, 128 on others): tier blocks of one engine block, as the
        # connector asks (block_tokens unset); the counts below hold for either size
        qconn = dict(engine=qeng, block_tokens=None, lane=lane)
        c_salted = {"name": "ref", "prompts": [{"tokens": PROMPTS["C2"], "max_tokens": 16, "salt": "ref"}]}
        run("q1", qnext, [c_salted, batch("store", "A", "B")], **qconn)
        # C2 first: its 256-token hit is the tier's, not vLLM's own cache's
        run("q2", qnext, [batch("partial", "C2"), batch("load", "A", "B")], **qconn)
        run("qx", qnext, [batch("load", "A")], module="tests.vllm_mutant", mutation="no_state", **qconn)
        # Granite-4-like (Mamba2 + attention): vLLM's CPU build fails in its own Mamba2 kernel with
        # prefix caching on (connector or not); with it off there is no state to cache
        run("k1", granite, [batch("plain", "A")], engine={"enable_prefix_caching": False}, lane=lane)

    try:
        # Two lanes of engines side by side, one per core (each chain of a store and the fresh
        # engines that load it stays in one lane, in order; the lanes' models, and so their
        # namespaces, differ)
        with ThreadPoolExecutor(2) as lanes:
            for f in [lanes.submit(windows_and_mla), lanes.submit(latent_stages_and_state)]:
                f.result()
        out["stats"] = _stats(url)
        yield out
    finally:
        daemon.stop()
        shutil.rmtree(tmp, ignore_errors=True)     # checkpoints, slab files: the disk is shared
        # vLLM's pipeline stages leave their shared-memory channels behind when an engine exits
        for f in set(Path("/dev/shm").glob("vllm_*")) - shm_before:
            f.unlink(missing_ok=True)


def _latent_rows(dump: Path) -> dict:
    """{"save" / "load": {vLLM block id (in its process): per layer its latent rows}}."""
    import torch
    rows: dict = {"save": {}, "load": {}}
    for f in sorted(dump.glob("*.pt")):
        d = torch.load(f)
        for j, b in enumerate(d["ids"]):
            rows[f.name.split("-")[0]][b] = [layer[j] for layer in d["rows"]]
    return rows


def _stats(url: str) -> dict:
    import tierd
    with tierd.connect(url) as c:
        return c.stats()


def _batch(run: dict, name: str) -> dict:
    (b,) = [b for b in run["batches"] if b["name"] == name]
    return b


def _tokens(run: dict, name: str) -> list[list[int]]:
    return [o["tokens"] for o in _batch(run, name)["outputs"]]


def _external(run: dict, name: str) -> float:
    return _batch(run, name)["counters"].get("external_prefix_cache_hits", 0)


def test_gpt_oss_like_with_the_hybrid_manager_loads_another_engines_prefixes(runs):
    g1, g3 = runs["g1"], runs["g3"]
    assert _external(g1, "store") == 0
    assert _external(g3, "load") == 2 * 2 * BLOCK_TOKENS        # A and B: two tier blocks each
    assert _tokens(g3, "load") == _tokens(g1, "store")
    attention = [ns["description"].get("attention", "") for ns in runs["stats"]["namespaces"].values()]
    assert any(a.startswith("vllm-groups-v1/") for a in attention), attention


def test_a_block_completed_in_decode_after_its_window_moved_on_serves_its_tail(runs):
    """G1 stored tier block 1 of D (tokens 256-511) in the decode step of token 511, when vLLM
    had freed the sliding layers' block of tokens 256-383: they are zeros in the tier. A hit of
    512 tokens reads, of those layers, only tokens 385-511: G3 gets recompute's tokens (G2's)."""
    assert _external(runs["g3"], "decoded") == 2 * BLOCK_TOKENS
    assert _tokens(runs["g3"], "decoded") == _tokens(runs["g2"], "decoded")


def test_gpt_oss_like_without_the_hybrid_manager_never_shares_the_hybrid_blocks(runs):
    g1, g2 = runs["g1"], runs["g2"]
    assert _external(g2, "cross") == 0                          # another group structure: no hit
    assert _tokens(g2, "cross") == _tokens(g1, "store")[:1]
    assert _external(g2, "again") == 2 * BLOCK_TOKENS           # its own blocks, every token kept
    assert _tokens(g2, "again") == _tokens(g1, "store")[:1]


def test_a_wrong_group_mapping_gives_other_tokens(runs):
    """The mutant loads the same blocks with each layer through the other group's ids: if these
    tests could not tell, they would pass a connector that corrupts the cache."""
    gx, g1 = runs["gx"], runs["g1"]
    assert _external(gx, "load") == 2 * BLOCK_TOKENS
    assert _tokens(gx, "load") != _tokens(g1, "store")[:1]


def test_mistral_like_all_layer_window_loads_another_engines_prefixes(runs):
    m1, m2 = runs["m1"], runs["m2"]
    assert _external(m1, "store") == 0
    assert _external(m2, "load") == 2 * 2 * BLOCK_TOKENS
    assert _tokens(m2, "load") == _tokens(m1, "store")


def test_qwen3_next_like_loads_another_engines_prefixes_with_their_recurrent_state(runs):
    """Q2 (fresh) loads 256 tokens of C2 (it shares 300 tokens with A: the state Q1's first
    256-token chunk of A ended on), then 512 of A and of B — the attention layer's KV and the
    linear-attention layers' state after token 512 — with the tokens of Q1, which computed them
    all. (vLLM 0.32 keeps none of C2's loaded prefix in its own cache for A: all 512 are loaded.)"""
    q1, q2 = runs["q1"], runs["q2"]
    assert _tokens(q2, "partial") == _tokens(q1, "ref")
    assert _external(q2, "partial") == 256
    assert _tokens(q2, "load") == _tokens(q1, "store")
    assert [o["num_cached_tokens"] for o in _batch(q2, "load")["outputs"]] == [512, 512]
    assert _external(q2, "load") >= 256 + 512
    assert "tierd connector disabled" not in q2["log"]


def test_a_hit_without_its_recurrent_state_gives_other_tokens(runs):
    """QX loads A's attention KV but not its state (a mutant): other tokens, so the test above
    would see a state that is not restored."""
    qx = runs["qx"]
    assert _external(qx, "load") == 512
    assert _tokens(qx, "load") != _tokens(runs["q1"], "store")[:1]


def test_granite_4_like_without_prefix_caching_runs_declined_with_one_line(runs):
    """vLLM's CPU build runs Granite-4-like (Mamba2) models only with prefix caching off, which
    keeps no state at block boundaries: the connector declines with one line per process."""
    k1 = runs["k1"]
    declined = [line for line in k1["log"].splitlines() if "tierd connector disabled" in line]
    assert declined and all("keeps no state at block boundaries" in line for line in declined), declined
    assert _external(k1, "plain") == 0 and len(_tokens(k1, "plain")[0]) == 16


@pytest.mark.parametrize("alone,connected", [("d0", "d1"), (None, "e1")])
def test_mla_on_vllms_cpu_build_runs_declined_with_one_line(runs, alone, connected):
    declined = [line for line in runs[connected]["log"].splitlines() if "tierd connector disabled" in line]
    assert declined and all("MLA on vLLM's CPU build" in line for line in declined), declined
    assert _external(runs[connected], "plain") == 0
    assert len(_tokens(runs[connected], "plain")[0]) == 16
    if alone is not None:     # (one model suffices to show the tokens are its own: engines cost minutes)
        assert _tokens(runs[connected], "plain") == _tokens(runs[alone], "plain")


def test_mla_latent_rows_reach_a_fresh_engine_byte_for_byte(runs):
    """X1 stored A and B (600 tokens each: two tier blocks of 256); X2, a fresh process, loaded
    them into its own blocks: the rows there are X1's rows, every layer, every token."""
    assert _external(runs["x2"], "load") == 2 * 2 * BLOCK_TOKENS
    import hashlib

    def digests(blocks: dict) -> set:     # a vLLM block's rows, every layer (ids differ by process)
        return {hashlib.sha256(b"".join(r.numpy().tobytes() for r in rows)).hexdigest() for rows in blocks.values()}
    saved, loaded = digests(runs["latent_rows"]["save"]), digests(runs["latent_rows"]["load"])
    assert len(saved) == len(loaded) == 2 * 2 * BLOCK_TOKENS // 16, (len(saved), len(loaded))
    assert loaded == saved
    described = [ns["description"] for ns in runs["stats"]["namespaces"].values()]
    assert any(d.get("planes") == 1 and d.get("head_dim") == 576 and d.get("num_kv_heads") == 1
               for d in described), described


def test_pipeline_stages_each_store_their_layers_and_a_fresh_engine_loads_both(runs):
    p1, p2 = runs["p1"], runs["p2"]
    assert _external(p1, "store") == 0
    assert _external(p2, "load") == 2 * 2 * BLOCK_TOKENS
    assert _tokens(p2, "load") == _tokens(p1, "store")
    layers = sorted(ns["description"].get("layers", "") for ns in runs["stats"]["namespaces"].values())
    assert "0-2/4" in layers and "2-4/4" in layers, layers
