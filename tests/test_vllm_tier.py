"""tierd as the secondary tier of vLLM's offloading, with vLLM's own classes (no engine): LoRA
adapters keyed by content (review S1: on b90e890 the tier keyed chunks by vLLM's block hash, which
names an adapter by name and path, so an adapter retrained in place got its predecessor's KV).
The scenario is tests/vllm_tier_check.py, run in the vLLM environment; tests/test_vllm_engine.py
runs the same with real engines."""

from __future__ import annotations

import os

import pytest

from . import vllm_wait
from .test_vllm_connector import ROOT, VLLM_ENVS, vllm_python


@pytest.mark.slow
@pytest.mark.timeout(vllm_wait.SCRIPT_S + 120)
def test_the_secondary_tier_keys_lora_adapters_by_content_with_vllms_classes(tmp_path):
    py = vllm_python("cpu-build")
    if py is None:
        if os.environ.get("TEST_REQUIRE_VLLM"):
            pytest.fail(f"the vLLM environment {VLLM_ENVS['cpu-build']} is part of this suite here, and it is missing")
        pytest.skip(f"no {VLLM_ENVS['cpu-build']} environment; `make vllm-env` builds it")
    env = dict(os.environ, PYTHONPATH=str(ROOT), VLLM_LOGGING_LEVEL="WARNING", TMPDIR=str(tmp_path))
    shm = "/dev/shm" if os.path.isdir("/dev/shm") else None
    before = set(os.listdir(shm)) if shm else set()
    try:
        r = vllm_wait.run_script([py, "-m", "tests.vllm_tier_check"], "tests/vllm_tier_check.py in the vLLM "
                                 "environment", cwd=ROOT, env=env)
    finally:
        # vLLM's offload region of a check that failed before its shutdown (the process is gone)
        for name in set(os.listdir(shm)) - before if shm else ():
            if name.startswith("vllm_offload_"):
                os.unlink(os.path.join(shm, name))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-5000:]
    assert "vLLM secondary tier check: OK" in r.stdout
