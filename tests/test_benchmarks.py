"""The benchmarks that need no engine and no GPU run to the end with `--quick`, write their
figures in the one JSON shape DESIGN.md gives, and leave nothing behind. (A benchmark that no
longer runs hides a regression as surely as a wrong figure: the remote tier's once stopped at
a constant the store had moved.) The engine benchmarks run in their own tests and in `make bench`."""

import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

# name -> what it needs beside the package (None: nothing)
CHEAP = {"recovery": None, "kv_waste": None, "routing": None, "remote": "redis-server", "load": None}


def _run_alone(argv: list[str], timeout: float) -> tuple[subprocess.CompletedProcess, set[str]]:
    """Run a benchmark with a temporary directory of its own (TMPDIR); returns its result and what
    it left behind: paths it made (`tierd-*`) in that directory, and arena directories of its
    daemons in /dev/shm (`tierd-bench-*`). Other tests running beside it (CI runs the engine tests beside the rest)
    make files of their own in /tmp: they are not this benchmark's."""
    def shm() -> set[str]:
        if not os.path.isdir("/dev/shm"):
            return set()
        return {os.path.join("/dev/shm", n) for n in os.listdir("/dev/shm") if n.startswith("tierd-bench-")}

    before = shm()
    tmp = tempfile.mkdtemp(prefix="tb-")          # short: the daemons' socket paths go under it
    try:
        p = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                           env={**os.environ, "TMPDIR": tmp})
        left = {os.path.join(tmp, n) for n in os.listdir(tmp) if n.startswith("tierd-")} | (shm() - before)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return p, left


@pytest.mark.timeout(240)
@pytest.mark.parametrize("name", sorted(CHEAP))
def test_a_quick_benchmark_runs_writes_the_shared_json_shape_and_leaves_nothing(name, tmp_path):
    if CHEAP[name] == "redis-server":
        from .redis_servers import redis_binary
        redis_binary()                     # skips (or fails where redis is required) without one
    out = tmp_path / f"{name}.json"
    p, left = _run_alone([sys.executable, "-m", f"benchmarks.{name}", "--quick", "--json", str(out)], 220)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-4000:]
    doc = json.loads(out.read_text())
    assert doc["benchmark"] == name
    assert set(doc["machine"]) >= {"cpus", "ram_bytes", "torch", "python", "gpu"}
    assert doc["results"], "no figures"
    for r in doc["results"]:
        assert set(r) == {"name", "params", "value", "unit", "reference", "ratio"}, r
        assert set(r["reference"]) == {"name", "value"}, r
        assert isinstance(r["params"], dict) and r["name"] and r["unit"] and r["reference"]["name"]
        v, ref = r["value"], r["reference"]["value"]
        assert math.isfinite(v) and math.isfinite(ref), r
        if ref and v and math.isfinite(r["ratio"]):   # the ratio is value over reference, either way up
            assert min(abs(r["ratio"] - v / ref), abs(r["ratio"] - ref / v)) <= 1e-9 * max(1.0, abs(r["ratio"])), r
    assert "ratio" in p.stdout                          # the printed table
    assert not left, f"benchmarks.{name} left {sorted(left)}"


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_node_pool_quick_serves_the_trace_in_every_configuration_with_recompute_tokens(tmp_path):
    """benchmarks/node_pool.py --quick end to end (about 3 minutes on 2 cores): real vLLM engines
    (`make vllm-env`) behind a shared tierd daemon, tierd per engine, vLLM's offloading per
    engine and no offloading; every figure in the one JSON shape, every configuration's greedy
    tokens equal to recompute's, the restart measured, nothing left behind. Not performance."""
    from .test_vllm_connector import required_vllm_python
    required_vllm_python()                      # skips without .venv-vllm (fails with TEST_REQUIRE_VLLM)
    out = tmp_path / "node_pool.json"
    p, left = _run_alone([sys.executable, "-m", "benchmarks.node_pool", "--quick", "--json", str(out)], 840)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-4000:]
    doc = json.loads(out.read_text())
    assert doc["benchmark"] == "node_pool" and set(doc["machine"]) >= {"cpus", "ram_bytes", "torch", "python", "gpu"}
    by_name = {r["name"]: r for r in doc["results"]}
    for r in doc["results"]:
        assert set(r) == {"name", "params", "value", "unit", "reference", "ratio"}, r
        assert set(r["reference"]) == {"name", "value"}, r
        assert math.isfinite(r["value"]) and math.isfinite(r["reference"]["value"]), r
    ran = [c for c in ("no offloading", "shared tierd daemon", "tierd per engine (embedded)",
                       "vLLM CPU offloading per engine") if f"{c}: could not run on this machine" not in by_name]
    assert ran[:3] == ["no offloading", "shared tierd daemon", "tierd per engine (embedded)"], ran   # always run
    for c in ran:
        hit = by_name[f"{c}: prefix hit rate (engine cache + pool)"]
        assert 0 <= hit["value"] <= hit["reference"]["value"] <= 1, hit     # never above the trace's ceiling
        assert {f"{c}: TTFT p50", f"{c}: TTFT p90", f"{c}: throughput"} <= set(by_name)
        assert any(n.startswith(f"{c}: restarted engine's hit rate") for n in by_name), c
        if c != "no offloading":
            assert by_name[f"{c}: greedy tokens equal recompute's"]["value"] == 1.0, c
    assert by_name["shared tierd daemon: prefix hit rate (engine cache + pool)"]["params"]["pool_hit_rate"] > 0
    assert "ratio" in p.stdout
    assert not left, f"benchmarks.node_pool left {sorted(left)}"


def test_the_gpu_check_summary_exits_non_zero_on_a_missed_or_missing_goal(tmp_path):
    """benchmarks/gpu_summary.py (the GPU check's last screen) reads the figures the GPU parts
    wrote: every goal met exits 0; one missed, or a figure a goal needs missing (a part stopped
    by its time limit), exits 1 and says which."""
    def row(name, params, ratio, reference="recompute TTFT ms"):
        return {"name": name, "params": params, "value": 1.0, "unit": "ms", "reference_name": reference,
                "reference_value": ratio, "ratio": ratio}
    good = [row("TTFT host hit", {"prompt_tokens": 2048, "cached_tokens": 2047}, 6.0),
            row("TTFT host hit", {"prompt_tokens": 8192, "cached_tokens": 8191}, 12.0),
            row("recompute TTFT", {"prompt_tokens": 2048}, 0.7, "floor ms"),
            row("load part of host hit, device time", {}, 0.9, "floor ms"),
            row("paged decode triton", {}, 0.95, "fused SDPA on dense KV"),
            row("TTFT slowed disk, decide", {"prompt_tokens": 2048}, 0.95)]

    def summary(rows):
        (tmp_path / "gpu_ttft.json").write_text(json.dumps({"results": rows}))
        return subprocess.run([sys.executable, "-m", "benchmarks.gpu_summary", str(tmp_path)], cwd=ROOT,
                              capture_output=True, text=True)
    p = summary(good)
    assert p.returncode == 0, p.stdout
    # a 2K host hit declined (computed: as fast as recompute) meets its goal; a slow one does not
    declined = [row("TTFT host hit", {"prompt_tokens": 2048, "cached_tokens": 0}, 1.0)] + good[1:]
    assert summary(declined).returncode == 0
    slow = [row("TTFT host hit", {"prompt_tokens": 2048, "cached_tokens": 2047}, 0.85)] + good[1:]
    p = summary(slow)
    assert p.returncode == 1 and "MISSED" in p.stdout and "2K host hit" in p.stdout
    p = summary(good[:-1])
    assert p.returncode == 1 and "MISSING" in p.stdout and "slowed disk" in p.stdout
