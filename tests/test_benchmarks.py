"""The benchmarks that need no engine and no GPU run to the end with `--quick`, write their
figures in the one JSON shape DESIGN.md gives, and leave nothing behind. (A benchmark that no
longer runs hides a regression as surely as a wrong figure: the remote tier's once stopped at
a constant the store had moved.) The engine benchmarks run in their own tests and in `make bench`."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

# name -> what it needs beside the package (None: nothing)
CHEAP = {"recovery": None, "kv_waste": None, "routing": None, "remote": "redis-server", "load": None}


def _leftovers() -> set[str]:
    """Paths benchmarks create (their prefixes) in the temporary directory and /dev/shm."""
    out = set()
    for d in ("/tmp", "/dev/shm"):
        if os.path.isdir(d):
            out |= {os.path.join(d, n) for n in os.listdir(d) if n.startswith("tierd-")}
    return out


@pytest.mark.timeout(240)
@pytest.mark.parametrize("name", sorted(CHEAP))
def test_a_quick_benchmark_runs_writes_the_shared_json_shape_and_leaves_nothing(name, tmp_path):
    if CHEAP[name] == "redis-server":
        from .redis_servers import redis_binary
        redis_binary()                     # skips (or fails where redis is required) without one
    before = _leftovers()
    out = tmp_path / f"{name}.json"
    p = subprocess.run([sys.executable, "-m", f"benchmarks.{name}", "--quick", "--json", str(out)],
                       cwd=ROOT, capture_output=True, text=True, timeout=220)
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
    left = _leftovers() - before
    assert not left, f"benchmarks.{name} left {sorted(left)}"
