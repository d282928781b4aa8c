"""The real-vLLM fixtures' limits: they fit a loaded machine and, when one runs out, the failure
names what was waited for and shows the engine's last log lines. On b90e890 the engines' module
fixture ran under pytest's 300 s default and failed with a bare timeout on a loaded 2-core
machine."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from . import test_vllm_engine, vllm_wait

ENGINE = ("import sys, time\n"
          "print('INFO engine: loading weights', flush=True)\n"
          "print('INFO engine: KV cache of 12 blocks', flush=True)\n"
          "time.sleep(120)\n")


def _engine(tmp_path, code=ENGINE):
    log = tmp_path / "p1.log"
    return subprocess.Popen([sys.executable, "-c", code], stdout=open(log, "wb"), stderr=subprocess.STDOUT), log


def test_an_engine_past_its_limit_fails_naming_it_its_progress_and_its_log(tmp_path):
    proc, log = _engine(tmp_path)
    out = tmp_path / "p1.json"
    out.write_text(json.dumps({"startup_s": 21.4, "batches": [{"name": "repeat"}, {"name": "shared"}]}))
    with pytest.raises(vllm_wait.TimeLimit) as e:
        vllm_wait.wait(proc, "vLLM engine p1 (running its batches)", log, limit_s=2, out=out)
    msg = str(e.value)
    assert msg.startswith("vLLM engine p1 (running its batches): still running after 2 s")
    assert "TIERD_TEST_VLLM_ENGINE_S=2 s" in msg
    assert "it started in 21 s and finished the batches ['repeat', 'shared']" in msg
    assert msg.rstrip().endswith("INFO engine: loading weights\nINFO engine: KV cache of 12 blocks")
    assert proc.poll() is not None                       # killed, not left behind


def test_an_engine_that_never_started_and_a_spent_budget_say_so(tmp_path):
    proc, log = _engine(tmp_path)
    budget = vllm_wait.Budget(seconds=1, what="the engines of this test")
    with pytest.raises(vllm_wait.TimeLimit) as e:
        vllm_wait.until(lambda: False, proc, "vLLM engine p2: waiting for it to reach batch 'stall'", log,
                        out=tmp_path / "absent.json", budget=budget)
    msg = str(e.value)
    assert "waiting for it to reach batch 'stall': not after" in msg
    assert "of the 1 s for the engines of this test (TIERD_TEST_VLLM_BUDGET_S)" in msg
    assert "it had not finished starting" in msg and "KV cache of 12 blocks" in msg
    assert proc.poll() is not None


def test_an_engine_that_exits_while_waited_for_fails_with_its_log(tmp_path):
    proc, log = _engine(tmp_path, "print('RuntimeError: CPU offloading is not supported', flush=True)\n"
                                  "raise SystemExit(3)")
    with pytest.raises(AssertionError, match=r"(?s)the engine exited \(3\) first.*CPU offloading is not supported"):
        vllm_wait.until(lambda: False, proc, "vLLM engine p2: waiting for it to reach batch 'kill'", log)


def test_a_check_script_past_its_limit_shows_its_output():
    with pytest.raises(vllm_wait.TimeLimit, match=r"(?s)tests/vllm_check.py: still running after 1 s.*importing vllm"):
        vllm_wait.run_script([sys.executable, "-c", "import time; print('importing vllm', flush=True); time.sleep(60)"],
                             "tests/vllm_check.py", limit_s=1)


def test_the_engine_module_runs_under_limits_that_fit_a_loaded_machine():
    """pytest's own limit for the engines' module sits above their budget (so vllm_wait's message,
    not a bare pytest-timeout, reports a slow machine), and the limits are far above what the
    engines take on an idle 2-core machine (~3 minutes for the whole module)."""
    (timeout,) = [m for m in test_vllm_engine.pytestmark if m.name == "timeout"]
    assert timeout.args[0] > vllm_wait.BUDGET_S
    defaults = {"TIERD_TEST_VLLM_BUDGET_S": (vllm_wait.BUDGET_S, 3600),
                "TIERD_TEST_VLLM_ENGINE_S": (vllm_wait.ENGINE_S, 900),
                "TIERD_TEST_VLLM_SCRIPT_S": (vllm_wait.SCRIPT_S, 600)}
    for var, (value, least) in defaults.items():
        assert var in os.environ or value >= least, var     # an operator's own limit is theirs
