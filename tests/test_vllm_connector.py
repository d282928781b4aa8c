"""The vLLM connector, driven through vLLM's call sequence with stand-in vLLM objects (real
tierd stores and daemons). The same scenarios run against vLLM's own classes in
tests/vllm_check.py where vLLM is installed (see test_conformance_with_the_installed_vllm)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import tierd
from tierd.connectors import vllm as tv
from tierd.errors import TierdError

from . import vllm_driver as drv

ROOT = Path(__file__).resolve().parent.parent


def config(url: str, **extra) -> SimpleNamespace:
    ktc = SimpleNamespace(kv_connector="TierdConnector", kv_connector_module_path="tierd.connectors.vllm",
                          kv_role="kv_both", kv_load_failure_policy="recompute",
                          kv_connector_extra_config=drv.extra_config(url) | extra)
    return SimpleNamespace(kv_transfer_config=ktc, cache_config=SimpleNamespace(block_size=drv.BLOCK_SIZE),
                           parallel_config=SimpleNamespace(pipeline_parallel_size=1, tensor_parallel_size=1),
                           model_config=None)


def pair(url: str, layout: str = "BHN2D", **extra):
    sched = tv.TierdConnector(config(url, **extra), tv.KVConnectorRole.SCHEDULER, None)
    worker = tv.TierdConnector(config(url, **extra), tv.KVConnectorRole.WORKER, None)
    worker.register_kv_caches(drv.paged_caches(layout))
    assert not worker.disabled, worker.disabled
    return sched, worker


@pytest.fixture
def embedded_url(tmp_path):
    url = f"embedded://?host=16MiB&disk={tmp_path}/disk&disk_bytes=64MiB"
    yield url
    store = tv._EMBEDDED.pop(url, None)
    if store is not None:
        store.close()


@pytest.mark.parametrize("layout,load_async", [("BHN2D", True), ("2BNHD", False), ("B2NHD", True),
                                               ("2BHND", False)])
def test_roundtrip_embedded_every_layout(embedded_url, layout, load_async):
    sched, worker = pair(embedded_url, layout, load_async=load_async)
    drv.run_roundtrip(sched, worker, drv.Objects(), tv._EMBEDDED[embedded_url])
    assert sched.stats["hit_blocks"] > 0 and worker.stats["loaded_bytes"] > 0
    worker.shutdown()
    sched.shutdown()


@pytest.mark.parametrize("load_async", [True, False])
def test_roundtrip_and_load_errors_through_the_daemon(daemon, load_async):
    # separate connections, as vLLM's scheduler and worker processes have
    sched, worker = pair(daemon.url, load_async=load_async)
    with tierd.connect(daemon.url) as admin:
        drv.run_roundtrip(sched, worker, drv.Objects(), admin)
        drv.run_load_error(sched, worker, drv.Objects(), admin)
        worker.shutdown()
        sched.shutdown()
        assert admin.stats()["reservations"] == 0      # every reservation committed or aborted


def test_blocks_are_shared_with_the_bundled_engine_layout(embedded_url):
    """The tier block holds [layers, 2, tokens, kv_heads, head_dim], the bundled engine's layout."""
    sched, worker = pair(embedded_url, "2BNHD")
    objs = drv.Objects()
    prompt = list(range(1, 40))
    r = objs.request("X", prompt)
    drv.admit(sched, objs, r, 0, [5, 9, 2])
    drv.step(sched, worker, objs.output([(r, [5, 9, 2], 0, 39)]))
    assert worker.flush(30)
    store = tv._EMBEDDED[embedded_url]
    ns = worker.namespace("")
    (block,) = store.get(ns, ns.block_keys(prompt)[:1])
    t = torch.from_numpy(block).view(torch.float16).view(ns.block_shape)
    for layer, (k, v) in enumerate(worker._layers):
        assert torch.equal(t[layer, 0], torch.cat([k[5], k[9]]))
        assert torch.equal(t[layer, 1], torch.cat([v[5], v[9]]))


def test_daemon_down_means_no_hits_no_stores_and_no_exceptions(tmp_path):
    url = f"unix://{tmp_path}/absent.sock"
    sched, worker = pair(url)
    objs = drv.Objects()
    r = objs.request("A", list(range(100)))
    assert drv.admit(sched, objs, r, 0, list(range(7))) == 0
    drv.step(sched, worker, objs.output([(r, range(7), 0, 100)]))
    assert worker.flush(10)
    assert sched.stats["unavailable"] >= 1
    assert worker.stats["stored_blocks"] == 0
    # the scheduler saw the daemon down, so it planned no copies for the worker
    assert worker.stats["unavailable"] + worker.stats["stores_dropped"] == 0


def test_bad_configuration_is_refused_or_disables_with_a_reason(embedded_url):
    with pytest.raises(TierdError, match="multiple of vLLM's block_size"):
        tv.TierdConnector(config(embedded_url, block_tokens=40), tv.KVConnectorRole.WORKER, None)
    worker = tv.TierdConnector(config(embedded_url), tv.KVConnectorRole.WORKER, None)
    worker.register_kv_caches({"model.layers.0.attn": torch.zeros(8, 3, 16, 16, dtype=torch.float16)})
    assert "tensors for a 4-layer namespace" in worker.disabled
    worker = tv.TierdConnector(config(embedded_url), tv.KVConnectorRole.WORKER, None)
    worker.register_kv_caches({f"l.{i}": torch.zeros(8, 3, 16, 16, dtype=torch.float16) for i in range(4)})
    assert "unknown paged KV cache layout" in worker.disabled
    hybrid = SimpleNamespace(kv_cache_groups=[SimpleNamespace(kv_cache_spec=object())] * 2)
    c = tv.TierdConnector(config(embedded_url), tv.KVConnectorRole.SCHEDULER, hybrid)
    assert "hybrid" in c.disabled
    assert c.get_num_new_matched_tokens(drv.Objects().request("A", list(range(64))), 0) == (0, False)


def test_layer_order_is_numeric():
    names = [f"model.layers.{i}.self_attn.attn" for i in (10, 2, 1, 0)]
    assert sorted(names, key=tv._layer_index)[-1] == "model.layers.10.self_attn.attn"


VLLM_ENVS = {"cpu-build": ".venv-vllm", "latest": ".venv-vllm-latest"}


def vllm_python(env: str = "cpu-build") -> str | None:
    """The Python of a vLLM environment `make vllm-env` builds ($TEST_VLLM_PYTHON overrides the
    CPU build's)."""
    if env == "cpu-build" and os.environ.get("TEST_VLLM_PYTHON"):
        return os.environ["TEST_VLLM_PYTHON"]
    py = ROOT / VLLM_ENVS[env] / "bin" / "python"
    return str(py) if py.exists() else None


@pytest.mark.parametrize("env", sorted(VLLM_ENVS))
def test_conformance_with_the_installed_vllm(tmp_path, env):
    """vLLM's real base class, factory, configs, requests and scheduler outputs, in both vLLM
    environments (`make vllm-env` builds them; CI builds them and fails if it cannot)."""
    py = vllm_python(env)
    if py is None:
        pytest.skip(f"no {VLLM_ENVS[env]} environment; `make vllm-env` builds it")
    env_vars = dict(os.environ, PYTHONPATH=str(ROOT), VLLM_LOGGING_LEVEL="WARNING", TMPDIR=str(tmp_path))
    r = subprocess.run([py, "-m", "tests.vllm_check"], cwd=ROOT, env=env_vars, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-5000:]
    assert "vLLM connector conformance: OK" in r.stdout
    print(r.stdout.strip().splitlines()[-1], file=sys.stderr)
