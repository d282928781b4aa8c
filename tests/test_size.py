"""`tierd size` (tierd/cli.py `kv_plan`, `cmd_size`): the KV bytes per token it prints are what
the connectors store, and the tier sizes it plans with are the daemon's own settings.

The numbers of real models by hand (Llama-3-70B-like, DeepSeek-V2-like), through the command
itself; then the same plan against the vLLM connector's own namespaces with vLLM's configs
(tests/vllm_size_check.py, in the vLLM environment)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tierd.config import DEFAULT_CONFIG_PATH, ServeConfig, parse_size, total_ram_bytes

from . import vllm_wait
from .test_vllm_connector import ROOT, required_vllm_python

GiB = 1 << 30
# Llama-3-70B: 80 layers, 64 query heads, 8 KV heads of 128, bf16
LLAMA_70B = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 8192,
             "intermediate_size": 28672, "num_hidden_layers": 80, "num_attention_heads": 64, "num_key_value_heads": 8,
             "torch_dtype": "bfloat16", "max_position_embeddings": 8192, "rope_theta": 500000.0}
LLAMA_70B_PER_TOKEN = 80 * 2 * 8 * 128 * 2          # 327,680
# DeepSeek-V2: 60 layers, a latent row of kv_lora_rank 512 + rope 64 per token; its 128 "KV heads"
# and head dims are the decompressed attention's, not what the cache holds
DEEPSEEK_V2 = {"architectures": ["DeepseekV2ForCausalLM"], "model_type": "deepseek_v2", "hidden_size": 5120,
               "num_hidden_layers": 60, "num_attention_heads": 128, "num_key_value_heads": 128, "kv_lora_rank": 512,
               "q_lora_rank": 1536, "qk_rope_head_dim": 64, "qk_nope_head_dim": 128, "v_head_dim": 128,
               "torch_dtype": "bfloat16", "max_position_embeddings": 163840}
DEEPSEEK_V2_PER_TOKEN = 60 * (512 + 64) * 2         # 69,120


def model_dir(root: Path, name: str, config: dict) -> Path:
    d = root / name
    d.mkdir()
    (d / "config.json").write_text(json.dumps(config))
    return d


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("size-models")
    return {"llama70b": model_dir(root, "llama70b", LLAMA_70B), "dsv2": model_dir(root, "dsv2", DEEPSEEK_V2)}


@pytest.fixture(scope="module")
def daemon_config(tmp_path_factory) -> Path:
    f = tmp_path_factory.mktemp("size-config") / "tierd.toml"
    f.write_text('[host]\nbytes = "1GiB"\n\n[disk]\nbytes = "2GiB"\n')
    return f


def size(model: Path, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    """`python -m tierd size --model MODEL ARGS`, with no TIERD_* setting from this environment
    (they are the daemon's settings too: a developer's own would change the tiers)."""
    base = {k: v for k, v in os.environ.items() if not k.startswith("TIERD_")}
    base["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), base.get("PYTHONPATH")]))
    return subprocess.run([sys.executable, "-m", "tierd", "size", "--model", str(model), *args], capture_output=True,
                          text=True, timeout=120, env={**base, **(env or {})}, cwd=ROOT)


def size_json(model: Path, *args: str, env: dict | None = None) -> dict:
    r = size(model, *args, "--json", env=env)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def tiers(out: dict) -> dict:
    return {t["tier"]: t for t in out["tiers"]}


def test_a_llama_70b_like_model_at_tp1(models, daemon_config):
    out = size_json(models["llama70b"], "--config", str(daemon_config))
    assert (out["layout"], out["kv_heads"], out["kv_heads_per_rank"], out["head_dim"], out["planes"]) == \
        ("gqa", 8, 8, 128, 2)
    assert out["bytes_per_token_rank"] == out["bytes_per_token"] == LLAMA_70B_PER_TOKEN == 327_680
    assert out["copies"] == 1
    assert out["block_bytes"] == 327_680 * 256
    for t in out["tiers"]:
        assert t["tokens"] == t["blocks"] * 256


def test_tp2_each_rank_stores_half_the_heads_and_a_token_takes_a_block_slot_per_rank(models, daemon_config):
    out = size_json(models["llama70b"], "--tp", "2", "--config", str(daemon_config))
    assert out["kv_heads_per_rank"] == 4
    assert out["bytes_per_token_rank"] == 163_840 and out["copies"] == 2
    assert out["bytes_per_token"] == 327_680        # both ranks' shares: what a token costs a tier
    assert out["block_bytes"] == 163_840 * 256      # a tier block is one rank's namespace
    by = tiers(out)
    assert by["host"]["capacity_bytes"] == GiB and by["disk"]["capacity_bytes"] == 2 * GiB
    for t in by.values():
        assert t["blocks"] > 0 and t["blocks"] * out["block_bytes"] <= t["capacity_bytes"], t
        assert t["tokens"] == t["blocks"] * 256 // 2, t


def test_tp16_replicates_one_kv_head_per_rank(models):
    out = size_json(models["llama70b"], "--tp", "16", "--host-bytes", "1GiB")
    assert out["kv_heads_per_rank"] == 1
    assert out["bytes_per_token_rank"] == 80 * 2 * 1 * 128 * 2 == 40_960
    assert out["copies"] == 16                      # every rank keys its own namespace (tp_rank)
    text = size(models["llama70b"], "--tp", "16", "--host-bytes", "1GiB")
    assert text.returncode == 0 and "1 KV heads per rank of TP 16 (replicated)" in text.stdout, text.stdout


def test_a_tp_that_neither_splits_nor_replicates_the_kv_heads_is_refused(models):
    r = size(models["llama70b"], "--tp", "3", "--json")
    assert r.returncode == 1
    assert r.stdout == ""
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    assert lines[0].startswith("tierd size: --tp 3 ") and "8 KV heads" in lines[0], lines[0]


@pytest.mark.parametrize("tp", [1, 2, 8])
def test_an_mla_model_stores_one_latent_row_per_token_once_at_any_tp(models, tp):
    out = size_json(models["dsv2"], "--tp", str(tp), "--host-bytes", "1GiB")
    assert (out["layout"], out["head_dim"], out["planes"], out["kv_heads_per_rank"]) == ("mla", 576, 1, 1)
    assert out["bytes_per_token_rank"] == out["bytes_per_token"] == DEEPSEEK_V2_PER_TOKEN == 69_120
    assert out["copies"] == 1
    assert out["block_bytes"] == 69_120 * 256
    for t in out["tiers"]:
        assert t["tokens"] == t["blocks"] * 256, t


def test_the_tier_sizes_are_the_daemons_config_file(models, daemon_config):
    by = tiers(size_json(models["llama70b"], "--config", str(daemon_config)))
    assert by["host"]["capacity_bytes"] == GiB and by["disk"]["capacity_bytes"] == 2 * GiB
    assert by["host"]["source"] == by["disk"]["source"] == f"file {daemon_config}"


def defaults() -> tuple[int, int]:
    store = ServeConfig().store
    return (parse_size(store.host_bytes, total=total_ram_bytes(), what="host"),
            parse_size(store.disk_bytes, what="disk"))


def test_without_settings_the_tier_sizes_are_the_daemons_defaults(models, tmp_path):
    host, disk = defaults()
    empty = tmp_path / "empty.toml"
    empty.write_text("")
    runs = {"an empty config file": ["--config", str(empty)]}
    if not os.path.exists(DEFAULT_CONFIG_PATH):      # (else `tierd serve` would read that file too)
        runs["no config at all"] = []
    for what, args in runs.items():
        by = tiers(size_json(models["llama70b"], *args))
        assert (by["host"]["capacity_bytes"], by["disk"]["capacity_bytes"]) == (host, disk), what
        assert by["host"]["source"] == by["disk"]["source"] == "default", what


def test_the_daemons_environment_and_the_command_line_override_the_file(models, daemon_config):
    by = tiers(size_json(models["llama70b"], "--config", str(daemon_config), "--host-bytes", "512MiB",
                         env={"TIERD_DISK_BYTES": "3GiB"}))
    assert (by["host"]["capacity_bytes"], by["host"]["source"]) == (512 << 20, "command line")
    assert (by["disk"]["capacity_bytes"], by["disk"]["source"]) == (3 * GiB, "environment")


@pytest.mark.slow
@pytest.mark.timeout(vllm_wait.SCRIPT_S + 120)
def test_size_matches_what_the_vllm_connector_stores(tmp_path):
    """With vLLM's own configs, for a Llama-like model at TP 1, 2 and 8 (replicated heads) and a
    DeepSeek-V2-like MLA model at TP 1 and 2: the bytes per token of the namespace each
    tensor-parallel rank's connector writes, and how many ranks write their own, are kv_plan's
    (tests/vllm_size_check.py; its docstring says what is checked for MLA on the CPU build)."""
    py = required_vllm_python("cpu-build")
    env = dict(os.environ, PYTHONPATH=str(ROOT), VLLM_LOGGING_LEVEL="WARNING", TMPDIR=str(tmp_path))
    r = vllm_wait.run_script([py, "-m", "tests.vllm_size_check"], "tests/vllm_size_check.py in the vLLM environment",
                             cwd=ROOT, env=env)
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("{")]
    assert lines, f"no result line (exit {r.returncode}):\n{r.stdout[-3000:]}{r.stderr[-5000:]}"
    res = json.loads(lines[-1])
    bad = [c for c in res["cases"] if not c["ok"]]
    assert not bad, "tierd size disagrees with the vLLM connector:\n" + "\n".join(
        f"{c['case']} (TP {c['tp']}): {c['mismatches']}" for c in bad)
    assert r.returncode == 0 and res["ok"], r.stdout[-3000:] + r.stderr[-5000:]
    assert {c["case"] for c in res["cases"]} == {"llama", "llama-tp2", "llama-tp8", "mla", "mla-tp2"}
    print(json.dumps(res), file=sys.stderr)
