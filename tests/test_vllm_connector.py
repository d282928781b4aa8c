"""The vLLM connector, driven through vLLM's call sequence with stand-in vLLM objects (real
tierd stores and daemons). The same scenarios run against vLLM's own classes in
tests/vllm_check.py where vLLM is installed (see test_conformance_with_the_installed_vllm)."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import tierd
from tierd.connectors import vllm as tv
from tierd.errors import TierdError

from . import vllm_driver as drv
from .helpers import ENGINES_OFF, engines_off
from . import vllm_wait

ROOT = Path(__file__).resolve().parent.parent


def config(url: str, layout: str = "BHN2D", parallel: dict | None = None, **extra) -> SimpleNamespace:
    """A stand-in VllmConfig: the connector's extra config, and per layer the attention backend
    that reads `layout` (tests/vllm_driver.py LAYOUTS)."""
    ktc = SimpleNamespace(kv_connector="TierdConnector", kv_connector_module_path="tierd.connectors.vllm",
                          kv_role="kv_both", kv_load_failure_policy="recompute",
                          kv_connector_extra_config=drv.extra_config(url) | extra)
    pc = dict(pipeline_parallel_size=1, tensor_parallel_size=1, decode_context_parallel_size=1,
              prefill_context_parallel_size=1) | (parallel or {})
    return SimpleNamespace(kv_transfer_config=ktc, cache_config=SimpleNamespace(block_size=drv.BLOCK_SIZE),
                           parallel_config=SimpleNamespace(**pc), model_config=None,
                           compilation_config=SimpleNamespace(static_forward_context=drv.forward_context(layout)))


def pair(url: str, layout: str = "BHN2D", **extra):
    sched = tv.TierdConnector(config(url, layout, **extra), tv.KVConnectorRole.SCHEDULER, None)
    worker = tv.TierdConnector(config(url, layout, **extra), tv.KVConnectorRole.WORKER, None)
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


@pytest.mark.parametrize("layout,load_async", [("BHN2D", True), ("BNH2D", False), ("HBN2D", "auto"),
                                               ("CPU", False)])
def test_roundtrip_embedded_every_layout(embedded_url, layout, load_async):
    sched, worker = pair(embedded_url, layout, load_async=load_async)
    drv.run_roundtrip(sched, worker, drv.Objects(), tv._EMBEDDED[embedded_url])
    assert sched.stats["hit_blocks"] > 0 and worker.stats["loaded_bytes"] > 0
    worker.shutdown()
    sched.shutdown()


@pytest.mark.parametrize("load_async", [True, False, "auto"])
def test_roundtrip_and_load_errors_through_the_daemon(daemon, load_async):
    # separate connections, as vLLM's scheduler and worker processes have
    sched, worker = pair(daemon.url, load_async=load_async)
    with tierd.connect(daemon.url) as admin:
        drv.run_roundtrip(sched, worker, drv.Objects(), admin)
        assert worker.stats["unleased_loads"] > 0    # CPU loads read ready blocks without a lease
        drv.run_load_error(sched, worker, drv.Objects(), admin)
        worker.shutdown()
        sched.shutdown()
        assert admin.stats()["reservations"] == 0      # every reservation committed or aborted


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2,
                    reason="needs two CPUs this process may use")
def test_the_connectors_threads_keep_off_the_cores_of_vllms_cpu_compute_thread(daemon):
    """vLLM's CPU worker binds its compute thread to its cores before it registers the KV caches;
    the connector's threads (the saver, the loader, the clients' prefault and hits reporter) then
    run on the process's other CPUs, not beside the forward pass."""
    import threading
    from tierd import threads
    everything = os.sched_getaffinity(0)
    compute = {min(everything)}
    earlier = {t.ident for t in threading.enumerate()}   # (other tests' clients in this process)
    os.sched_setaffinity(0, compute)             # as vLLM's OpenMP binding leaves its thread
    try:
        sched, worker = pair(daemon.url, "CPU", load_async=False)
        with tierd.connect(daemon.url) as admin:
            drv.run_roundtrip(sched, worker, drv.Objects(), admin)
        helpers = [t for t in threading.enumerate() if t.ident not in earlier
                   and t.name.startswith(("tierd-vllm", "tierd-prefault", "tierd-hits"))]
        names = sorted(t.name for t in helpers)
        assert "tierd-vllm-saver" in names and any(n.startswith("tierd-hits") for n in names), names
        for t in helpers:
            assert not os.sched_getaffinity(t.native_id) & compute, t.name
        assert os.sched_getaffinity(0) == compute    # the compute thread itself stays where vLLM put it
        worker.shutdown()
        sched.shutdown()
    finally:
        os.sched_setaffinity(0, everything)
        assert threads.keep_helpers_off_my_cores() is None     # unbound again: helpers go anywhere


def test_a_load_without_a_lease_whose_blocks_move_during_the_copy_is_leased_and_copied_again(daemon):
    """The worker copies a hit straight out of the daemon's slots, then checks the shared index:
    blocks that left their slots meanwhile (a flush here) make it lease them (promoted from
    disk) and copy again, before vLLM reads anything; the request gets the stored bytes."""
    sched, worker = pair(daemon.url, load_async=False)
    objs = drv.Objects()
    torch.manual_seed(3)
    prompt = torch.randint(0, 32000, (100,)).tolist()
    with tierd.connect(daemon.url) as admin:
        a = objs.request("A", prompt)
        assert drv.admit(sched, objs, a, 0, list(range(7)), worker) == 0
        drv.step(sched, worker, objs, objs.output([(a, range(7), 0, 100)]))
        assert worker.flush(30)
        sched.request_finished(a, list(range(7)))
        stored = {i: drv.block_kv(worker, i) for i in range(6)}
        assert admin.sync() == 3
        real, moved = worker._xfer.load_layers, []

        def load_layers(*args, **kw):
            job = real(*args, **kw)
            if not moved:
                moved.append(admin.flush(tier="host"))   # the blocks leave their slots mid-load
            return job
        worker._xfer.load_layers = load_layers
        b = objs.request("B", prompt[:96] + [7] * 24)
        assert drv.admit(sched, objs, b, 0, list(range(10, 18)), worker) == 96
        drv.step(sched, worker, objs, objs.output([(b, range(10, 18), 96, 24)]))
        assert moved == [3]
        for i in range(6):
            assert torch.equal(drv.block_kv(worker, 10 + i), stored[i]), i
        assert objs.take_errors() == set()
        assert worker.stats["unleased_loads"] == 0 and worker.link.store.unleased_discarded == 1
        sched.request_finished(b, list(range(10, 18)))
        worker.shutdown()
        sched.shutdown()


def test_blocks_are_shared_with_the_bundled_engine_layout(embedded_url):
    """The tier block holds [layers, 2, tokens, kv_heads, head_dim], the bundled engine's layout."""
    sched, worker = pair(embedded_url, "BNH2D")
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
    # the scheduler saw the daemon down, so it planned no copies for the worker (whose only
    # attempts were its two connections' at registration)
    assert worker.stats["stores_dropped"] == 0 and worker.stats["unavailable"] <= 2


def test_bad_configuration_is_refused_or_disables_with_a_reason(embedded_url):
    with pytest.raises(TierdError, match="multiple of vLLM's block_size"):
        tv.TierdConnector(config(embedded_url, block_tokens=40), tv.KVConnectorRole.WORKER, None)
    worker = tv.TierdConnector(config(embedded_url), tv.KVConnectorRole.WORKER, None)
    worker.register_kv_caches({"model.layers.0.attn": torch.zeros(8, 3, 16, 16, dtype=torch.float16)})
    assert "tensors for a 4-layer namespace" in worker.disabled
    worker = tv.TierdConnector(config(embedded_url), tv.KVConnectorRole.WORKER, None)
    worker.register_kv_caches({n: torch.zeros(8, 3, 16, 16, dtype=torch.float16) for n in drv.layer_names()})
    assert "FLASH_ATTN KV cache of shape (8, 3, 16, 16)" in worker.disabled
    mamba = type("MambaSpec", (), {"block_size": 16})()
    hybrid = SimpleNamespace(kv_cache_groups=[SimpleNamespace(kv_cache_spec=mamba, layer_names=["a"])] * 2)
    c = tv.TierdConnector(config(embedded_url), tv.KVConnectorRole.SCHEDULER, hybrid)
    assert "'none' cache mode keeps no state at block boundaries" in c.disabled   # no prefix caching
    assert c.get_num_new_matched_tokens(drv.Objects().request("A", list(range(64))), 0) == (0, False)


@pytest.mark.parametrize("attr", ["decode_context_parallel_size", "prefill_context_parallel_size"])
def test_context_parallelism_is_declined_with_a_reason(embedded_url, attr):
    """Review S2: context parallelism shards a sequence's KV over ranks, so a rank's block is not a
    run of consecutive tokens; on b90e890 the connector keyed and copied such blocks anyway."""
    sched = tv.TierdConnector(config(embedded_url, parallel={attr: 2}), tv.KVConnectorRole.SCHEDULER, None)
    worker = tv.TierdConnector(config(embedded_url, parallel={attr: 2}), tv.KVConnectorRole.WORKER, None)
    for c in (sched, worker):
        assert c.disabled == f"{attr.split('_')[0]} context parallelism ({attr}=2) is not supported"
    worker.register_kv_caches(drv.paged_caches())
    assert worker._layers == []
    objs = drv.Objects()
    r = objs.request("A", list(range(100)))
    assert sched.get_num_new_matched_tokens(r, 0) == (0, False)
    meta = sched.build_connector_meta(objs.output([(r, range(7), 0, 100)]))
    assert meta.loads == [] and meta.saves == []
    store = tv._EMBEDDED[embedded_url]
    assert store.stats()["reservations"] == 0
    for c in (worker, sched):
        c.shutdown()


def test_layer_order_is_numeric():
    names = [f"model.layers.{i}.self_attn.attn" for i in (10, 2, 1, 0)]
    assert sorted(names, key=tv._layer_index)[-1] == "model.layers.10.self_attn.attn"


VLLM_ENVS = {"cpu-build": ".venv-vllm", "latest": ".venv-vllm-latest"}


def vllm_python(env: str = "cpu-build") -> str | None:
    """The Python of a vLLM environment `make vllm-env` builds ($TEST_VLLM_PYTHON overrides the
    CPU build's)."""
    if engines_off():
        return None
    if env == "cpu-build" and os.environ.get("TEST_VLLM_PYTHON"):
        return os.environ["TEST_VLLM_PYTHON"]
    py = ROOT / VLLM_ENVS[env] / "bin" / "python"
    return str(py) if py.exists() else None


def required_vllm_python(env: str = "cpu-build") -> str:
    """`vllm_python(env)`, or the test fails (where the environment is part of the suite:
    TEST_REQUIRE_VLLM, as in CI) or is skipped."""
    py = vllm_python(env)
    if py is None:
        if engines_off():
            pytest.skip(ENGINES_OFF)
        if os.environ.get("TEST_REQUIRE_VLLM"):
            pytest.fail(f"the vLLM environment {VLLM_ENVS[env]} is part of this suite here, and it is missing")
        pytest.skip(f"no {VLLM_ENVS[env]} environment; `make vllm-env` builds it")
    return py


@pytest.mark.parametrize("env", sorted(VLLM_ENVS))
@pytest.mark.timeout(vllm_wait.SCRIPT_S + 120)
def test_conformance_with_the_installed_vllm(tmp_path, env):
    """vLLM's real base class, factory, configs, requests and scheduler outputs, in both vLLM
    environments (`make vllm-env` builds them; CI builds them and fails if it cannot)."""
    py = required_vllm_python(env)
    env_vars = dict(os.environ, PYTHONPATH=str(ROOT), VLLM_LOGGING_LEVEL="WARNING", TMPDIR=str(tmp_path))
    r = vllm_wait.run_script([py, "-m", "tests.vllm_check"], f"tests/vllm_check.py in {VLLM_ENVS[env]}", cwd=ROOT,
                             env=env_vars)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-5000:]
    assert "vLLM connector conformance: OK" in r.stdout
    print(r.stdout.strip().splitlines()[-1], file=sys.stderr)


def _stored(sched, worker, objs, prompt, rid="A"):
    """Request `rid` over `prompt` runs its prefill; its full tier blocks are in tierd after."""
    r = objs.request(rid, prompt)
    nb = -(-len(prompt) // drv.BLOCK_SIZE)
    drv.admit(sched, objs, r, 0, list(range(nb)), worker)
    drv.step(sched, worker, objs.output([(r, range(nb), 0, len(prompt))]))
    assert worker.flush(30)
    return r


def step_workers(sched, workers, out, flush: bool = True) -> None:
    """One engine step with several workers (tensor-parallel ranks, pipeline stages): the same
    metadata to each, each loads and saves; no load errors; then (`flush`) every save is in."""
    meta = sched.build_connector_meta(out)
    for w in workers:
        w.bind_connector_metadata(meta)
        w.start_load_kv(None)
        w.wait_for_save()
        w.get_finished(set())
        assert w.get_block_ids_with_load_errors() == set()
        w.clear_connector_metadata()
    if flush:
        for w in workers:
            assert w.flush(30)


# -- tensor parallelism ---------------------------------------------------------------------------
def _tp(url, rank=None, **extra):
    ns = dict(drv.extra_config(url)["namespace"], tp_size=2)
    if rank is not None:
        ns["tp_rank"] = rank
    role = tv.KVConnectorRole.SCHEDULER if rank is None else tv.KVConnectorRole.WORKER
    c = tv.TierdConnector(config(url, namespace=ns, load_async=False, **extra), role, None)
    if rank is not None:
        c.register_kv_caches(drv.paged_caches(seed=10 + rank))
        assert not c.disabled, c.disabled
    return c


def test_every_tensor_parallel_rank_counts_and_a_missing_rank_heals(daemon):
    sched, workers = _tp(daemon.url), [_tp(daemon.url, r) for r in (0, 1)]

    def step(out):
        step_workers(sched, workers, out)

    objs = drv.Objects()
    prompt = list(range(1, 71))                       # two full tier blocks of 32 tokens
    a = objs.request("A", prompt)
    assert drv.admit(sched, objs, a, 0, list(range(5))) == 0
    step(objs.output([(a, range(5), 0, 70)]))
    sched.request_finished(a, list(range(5)))
    nss = [w.namespace("") for w in workers]
    assert nss[0].id != nss[1].id                     # one namespace per rank, on one daemon
    with tierd.connect(daemon.url) as admin:
        keys = [ns.block_keys(prompt) for ns in nss]
        assert [admin.lookup(ns, k) for ns, k in zip(nss, keys)] == [2, 2]
        assert admin.lookup_all(list(zip(nss, keys))) == [2, 2]
        admin.flush(namespace=nss[1])                 # rank 1 loses its blocks (evicted, flushed)
        assert admin.lookup_all(list(zip(nss, keys))) == [2, 0]

        # no false hit: the prefix is not held by every rank, so nothing is claimed ...
        b = objs.request("B", prompt)
        assert drv.admit(sched, objs, b, 0, list(range(10, 15))) == 0
        # ... the request computes, and its blocks are saved again: rank 1 stores, rank 0 has them
        step(objs.output([(b, range(10, 15), 0, 70)]))
        sched.request_finished(b, list(range(10, 15)))
        assert admin.lookup_all(list(zip(nss, keys))) == [2, 2]
        assert workers[0].stats["stores_present"] >= 2 and workers[1].stats["stored_blocks"] >= 4

        # healed: the next request loads on both ranks, each its own rank's bytes (rank 0 kept
        # A's blocks, 0-3; rank 1 has B's, 10-13)
        c = objs.request("C", prompt)
        assert drv.admit(sched, objs, c, 0, list(range(20, 25))) == 64
        step(objs.output([(c, range(20, 25), 64, 6)]))
        for w, src in zip(workers, (0, 10)):
            for i in range(4):
                assert torch.equal(drv.block_kv(w, 20 + i), drv.block_kv(w, src + i))
        assert admin.stats()["reservations"] == 0
    for w in [*workers, sched]:
        w.shutdown()


def test_the_connectors_time_in_the_engines_hooks_is_counted_once_on_the_workers(daemon):
    """What the connector costs a step: the scheduler half's time in its hooks (lookups,
    planning) goes to the workers with each step's metadata and is counted once (rank 0),
    beside the workers' own time in theirs; a benchmark reads both from the workers."""
    sched, workers = _tp(daemon.url), [_tp(daemon.url, r) for r in (0, 1)]
    objs = drv.Objects()
    prompt = list(range(1, 71))
    a = objs.request("A", prompt)
    assert drv.admit(sched, objs, a, 0, list(range(5))) == 0
    assert sched.stats["sched_s"] > 0                 # the lookup
    step_workers(sched, workers, objs.output([(a, range(5), 0, 70)]))
    sched.request_finished(a, list(range(5)))
    assert sched._sched_sent > 0
    assert workers[0].stats["sched_s"] == pytest.approx(sched._sched_sent) and workers[1].stats["sched_s"] == 0
    step_workers(sched, workers, objs.output([]))     # the last build's own time goes with the next
    assert workers[0].stats["sched_s"] == pytest.approx(sched._sched_sent)
    assert sched._sched_sent == pytest.approx(sched.stats["sched_s"], abs=1e-3)
    assert all(w.stats["hook_s"] >= w.stats["save_s"] > 0 for w in workers)   # the save is in a hook
    for w in [*workers, sched]:
        w.shutdown()


def test_a_worker_connects_when_it_registers_its_caches_and_a_down_daemon_costs_nothing(daemon, tmp_path):
    """The worker's load and save connections are made when vLLM registers its KV caches, off
    vLLM's thread, so that a fresh engine's first hit does not pay for connecting and mapping
    the arena (some 20-40 ms measured in a fresh vLLM's first load); against a daemon that is
    not there, registering neither waits nor raises, and the first step recomputes."""
    from .helpers import wait_for
    sched, worker = pair(daemon.url)
    wait_for(lambda: worker.link.store is not None and worker.save_link.store is not None,
             what="the worker's connections")
    with tierd.connect(daemon.url) as admin:
        pids = [c["pid"] for c in admin.stats()["daemon"]["client_list"]]
        assert pids.count(os.getpid()) >= 4      # the scheduler's, the worker's two, this one
        drv.run_roundtrip(sched, worker, drv.Objects(), admin)
    assert worker.stats["loaded_bytes"] > 0
    for c in (worker, sched):
        c.shutdown()
    gone = f"unix://{tmp_path}/nobody/tierd.sock"
    sched, worker = pair(gone)               # registers at once; the connects fail off its thread
    wait_for(lambda: worker.link.backing_off and worker.save_link.backing_off, what="the failed connects")
    objs = drv.Objects()
    r = objs.request("A", list(range(1, 71)))
    assert drv.admit(sched, objs, r, 0, list(range(5)), worker) == 0
    for c in (worker, sched):
        c.shutdown()


# -- a stalled daemon costs the scheduler at most the deadline -----------------------------------
@pytest.mark.parametrize("tp", [1, 2])
def test_the_daemon_knows_the_namespaces_before_the_first_request(daemon, tp):
    """At start the scheduler's link registers the namespaces of requests without a cache salt,
    every key rank's, and each worker's links its own: the first request's lookup (50 ms
    deadline by default) pays for no registration round trip, which under a starting engine's
    load could outlast it and miss the hit."""
    import time

    import tierd
    sched = _tp(daemon.url) if tp == 2 else tv.TierdConnector(config(daemon.url), tv.KVConnectorRole.SCHEDULER, None)
    want = {sched.namespace("", r).name for r in range(sched.key_ranks)}
    assert len(want) == tp
    with tierd.connect(daemon.url) as c:
        deadline = time.monotonic() + 10
        while set(c.stats()["namespaces"]) != want:
            assert set(c.stats()["namespaces"]) <= want
            assert time.monotonic() < deadline, "the scheduler's link never registered its namespaces"
            time.sleep(0.02)
        sched.shutdown()
    if tp == 1:
        worker = tv.TierdConnector(config(daemon.url), tv.KVConnectorRole.WORKER, None)
        worker.register_kv_caches(drv.paged_caches("BHN2D"))
        deadline = time.monotonic() + 10
        while not all(link.store is not None and sched.namespace("").name in link.store._namespaces
                      for link in (worker.link, worker.save_link)):
            assert time.monotonic() < deadline, "the worker's links never registered its namespace"
            time.sleep(0.02)
        worker.shutdown()


def test_lookups_keep_their_deadline_on_a_stalled_daemon_and_recover(daemon):
    import signal
    import time
    sched, worker = pair(daemon.url, lookup_deadline_ms=50)
    objs = drv.Objects()
    prompt = list(range(1, 101))
    _stored(sched, worker, objs, prompt)
    daemon.signal(signal.SIGSTOP)
    try:
        times = []
        for i in range(20):
            r = objs.request(f"S{i}", prompt)
            t0 = time.perf_counter()
            assert sched.get_num_new_matched_tokens(r, 0) == (0, False)
            times.append(time.perf_counter() - t0)
        assert max(times) < 0.05 + 0.1, times          # never more than the deadline (+ scheduling slack)
        assert sorted(times)[-2] < 0.01, times          # one timeout; then the breaker answers at once
        assert sched.stats["lookup_timeouts"] == 1
    finally:
        daemon.signal(signal.SIGCONT)
    deadline = time.monotonic() + 40                    # back-off over, the link reconnects by itself
    while time.monotonic() < deadline:
        if sched.get_num_new_matched_tokens(objs.request("late", prompt), 0)[0] == 96:
            break
        time.sleep(0.2)
    else:
        pytest.fail("the scheduler never found tierd's blocks again after the stall")
    worker.shutdown()
    sched.shutdown()


# -- keys: what changes KV for the same tokens ------------------------------------------------
def _store_and_lookup(sched, worker, objs, first, others):
    """Store request `first`, then the hit (tokens) each of `others` would get."""
    n = len(first.all_token_ids)
    nb = -(-n // drv.BLOCK_SIZE)
    drv.admit(sched, objs, first, 0, list(range(nb)), worker)
    drv.step(sched, worker, objs.output([(first, range(nb), 0, n)]))
    assert worker.flush(30)
    sched.request_finished(first, list(range(nb)))
    out = []
    for r in others:
        out.append(sched.get_num_new_matched_tokens(r, 0)[0])
        sched.request_finished(r, [])
    return out


def test_lora_adapters_are_keyed_by_content(embedded_url, tmp_path):
    import shutil
    from tierd.engine.random_model import write_random_lora, write_random_model
    base = write_random_model(tmp_path / "base")
    a = write_random_lora(tmp_path / "a", base, seed=1)
    b = write_random_lora(tmp_path / "b", base, seed=2)
    a_copy = Path(shutil.copytree(a, tmp_path / "a-copy"))
    sched, worker = pair(embedded_url)
    objs = drv.Objects()
    prompt = list(range(1, 101))

    def req(rid, path, name):
        r = objs.request(rid, prompt)
        r.lora_request = None if path is None else SimpleNamespace(lora_name=name, lora_path=str(path), lora_int_id=1)
        return r

    hits = _store_and_lookup(sched, worker, objs, req("A", a, "a"),
                             [req("B", b, "a"), req("plain", None, ""), req("A2", a_copy, "renamed")])
    # another adapter (even under the same name) and no adapter: no hit; the same adapter's
    # content under another name and path: the hit
    assert hits == [0, 0, 96]


def test_multimodal_inputs_and_prompt_embeddings_are_in_the_keys(embedded_url):
    sched, worker = pair(embedded_url)
    objs = drv.Objects()
    prompt = list(range(1, 101))                   # tier blocks [0,32) [32,64) [64,96)

    def req(rid, mm=(), embeds=None, tokens=prompt):
        r = objs.request(rid, tokens)
        r.mm_features = [SimpleNamespace(identifier=i, mm_position=SimpleNamespace(offset=o, length=n))
                         for i, o, n in mm]
        r.prompt_embeds = embeds
        return r

    hits = _store_and_lookup(sched, worker, objs, req("img", mm=[("cat", 40, 10)]), [
        req("same", mm=[("cat", 40, 10)]),         # the same image at the same place: all of it
        req("other", mm=[("dog", 40, 10)]),        # another image: only the block before it
        req("moved", mm=[("cat", 70, 10)]),        # the image elsewhere: the blocks before both
        req("none"),                               # no image at all: the first block only
    ])
    assert hits == [96, 32, 32, 32]
    emb, other = torch.randn(100, 8), list(range(200, 300))
    hits = _store_and_lookup(sched, worker, objs, req("e1", embeds=emb, tokens=other), [
        req("e-same", embeds=emb.clone(), tokens=other), req("e-other", embeds=emb + 1e-3, tokens=other),
        req("e-none", tokens=other)])
    assert hits == [96, 0, 0]


def test_a_request_chooses_whether_the_tier_loads_and_stores_it(embedded_url):
    """`kv_transfer_params={"tierd": ...}`: store false leaves nothing in the tier, load false
    neither looks up nor loads, and a wish that cannot be read means neither (a mistyped "store":
    false must not store a private prompt); other connectors' params are not ours."""
    sched, worker = pair(embedded_url)
    objs = drv.Objects()
    prompt = list(range(1, 101))

    def req(rid, params):
        r = objs.request(rid, prompt)
        r.kv_transfer_params = params
        return r

    private = req("private", {"tierd": {"store": False}})
    drv.admit(sched, objs, private, 0, list(range(7)), worker)
    drv.step(sched, worker, objs.output([(private, range(7), 0, 100)]))
    assert worker.flush(30)
    assert worker.stats["stored_blocks"] == 0
    assert sched.get_num_new_matched_tokens(req("after", None), 0)[0] == 0
    _stored(sched, worker, objs, prompt, rid="public")
    assert worker.stats["stored_blocks"] == 3
    lookups = sched.stats["lookups"]
    wishes = [{"tierd": {"load": False}}, {"tierd": False}, {"tierd": {"lod": False}}, {"tierd": "no"},
              {"tierd": {"load": 0}}, [("tierd", False)],
              None, {}, {"tierd": True}, {"tierd": {"store": False}}, {"do_remote_prefill": False}]
    hits = [sched.get_num_new_matched_tokens(req(f"r{i}", w), 0)[0] for i, w in enumerate(wishes)]
    assert hits == [0] * 6 + [96] * 5
    assert sched.stats["lookups"] == lookups + 5
    assert sched.stats["requests_not_keyed"] == 4
    assert sched.stats["requests_opted_out"] == 4      # private, load false, false, store false
    worker.shutdown()
    sched.shutdown()


# -- saves: bounded, and straight into the slots ---------------------------------------------
def test_saves_past_the_in_flight_cap_are_dropped_before_any_copy(daemon):
    sched, worker = pair(daemon.url, max_inflight_bytes=1)   # smaller than one block
    objs = drv.Objects()
    r = objs.request("A", list(range(100)))
    drv.admit(sched, objs, r, 0, list(range(7)), worker)
    drv.step(sched, worker, objs.output([(r, range(7), 0, 100)]))
    assert worker.flush(10)
    assert worker.stats["stores_dropped"] == 3 and worker.stats["stored_blocks"] == 0
    with tierd.connect(daemon.url) as admin:
        st = admin.stats()
        assert st["reservations"] == 0
    worker.shutdown()
    sched.shutdown()


def test_a_stalled_daemon_costs_a_save_at_most_the_wait(daemon):
    import signal
    import time
    sched, worker = pair(daemon.url, save_wait_ms=50)
    objs = drv.Objects()
    r = objs.request("A", list(range(100)))
    drv.admit(sched, objs, r, 0, list(range(7)), worker)
    daemon.signal(signal.SIGSTOP)
    try:
        t0 = time.perf_counter()
        drv.step(sched, worker, objs.output([(r, range(7), 0, 100)]))
        assert time.perf_counter() - t0 < 0.05 + 1.0     # the wait, not the 10 s request timeout
        assert worker.stats["stores_dropped"] == 3
        assert worker.save_link.backing_off           # later steps drop at once
    finally:
        daemon.signal(signal.SIGCONT)
    worker.shutdown()
    sched.shutdown()


def test_another_model_or_layout_never_hits(embedded_url):
    """Blocks are found only under the namespace they were written in: another model revision,
    KV dtype or tier block size finds nothing."""
    sched, worker = pair(embedded_url)
    objs = drv.Objects()
    prompt = list(range(1, 101))
    _stored(sched, worker, objs, prompt)
    assert sched.get_num_new_matched_tokens(objs.request("same", prompt), 0)[0] == 96
    base = drv.extra_config(embedded_url)["namespace"]
    for change in ({"model": "another-model"}, {"kv_dtype": "bfloat16"}):
        other = tv.TierdConnector(config(embedded_url, namespace=dict(base, **change)),
                                  tv.KVConnectorRole.SCHEDULER, None)
        assert other.get_num_new_matched_tokens(objs.request("x", prompt), 0) == (0, False), change
    other = tv.TierdConnector(config(embedded_url, block_tokens=64), tv.KVConnectorRole.SCHEDULER, None)
    assert other.get_num_new_matched_tokens(objs.request("y", prompt), 0) == (0, False)
    worker.shutdown()
    sched.shutdown()


def test_auto_loads_asynchronously_what_needs_the_disk_or_is_large(daemon):
    sched, worker = pair(daemon.url)                       # load_async "auto" (the default)
    objs = drv.Objects()
    prompt = list(range(1, 101))
    _stored(sched, worker, objs, prompt)
    # in host RAM and small: copied before the step
    b = objs.request("B", prompt)
    assert sched.get_num_new_matched_tokens(b, 0) == (96, False)
    # vLLM's metrics: where the hit's tokens come from (the lookup asked)
    assert {k.value: v for k, v in sched.get_external_cache_hit_sources(b, 96).items()} == {"host": 96}
    assert sched.requires_kv_delivery is False    # a best-effort cache: preempted output is kept
    big = tv.TierdConnector(config(daemon.url, async_min_bytes=1), tv.KVConnectorRole.SCHEDULER, None)
    assert big.get_num_new_matched_tokens(objs.request("C", prompt), 0) == (96, True)
    with tierd.connect(daemon.url) as admin:
        admin.sync()
        admin.flush(tier="host")                           # now only on disk
        ns = worker.namespace("")
        assert admin.lookup_all([(ns, ns.block_keys(prompt))], host=True) == [(3, 0)]
    # a promotion from disk: outside the batch
    d = objs.request("D", prompt)
    assert sched.get_num_new_matched_tokens(d, 0) == (96, True)
    assert {k.value: v for k, v in sched.get_external_cache_hit_sources(d, 96).items()} == {"external_unspecified": 96}
    sched.update_state_after_alloc(d, objs.blocks(list(range(10, 17))), 96)
    import time
    done, deadline = set(), time.monotonic() + 30
    while "D" not in done and time.monotonic() < deadline:
        done |= drv.step(sched, worker, objs, objs.output([]))
        time.sleep(0.001)
    assert done == {"D"} and objs.take_errors() == set(), worker.stats
    for i in range(6):
        assert torch.equal(drv.block_kv(worker, 10 + i), drv.block_kv(worker, i))
    for c in (big, worker, sched):
        c.shutdown()


# -- copies on streams, layer by layer (a CPU stand-in for CUDA streams) -------------------------------
def _stored_then_lazy(url, *, skip_layer: int | None = None):
    """Store a 70-token prompt, then set the worker's transfer on a stand-in for CUDA streams that
    runs queued copies only when waited for. Returns (sched, worker, objs, streams, stored)."""
    from tierd.kernels.transfer import BlockTransfer
    from tests.helpers import LazyStreams
    sched, worker = pair(url, "HBN2D", load_async=False)
    objs = drv.Objects()
    prompt = list(range(1, 71))
    a = objs.request("A", prompt)
    assert drv.admit(sched, objs, a, 0, list(range(5))) == 0
    drv.step(sched, worker, objs.output([(a, range(5), 0, 70)]))      # every layer waited for
    assert worker.flush(30)
    sched.request_finished(a, list(range(5)))
    stored = {i: drv.block_kv(worker, i) for i in range(4)}
    sx = LazyStreams()
    worker._xfer = BlockTransfer(worker._xfer.k, worker._xfer.v, worker.ratio, streams=sx)
    return sched, worker, objs, sx, stored, prompt


def _layer(worker, layer: int, block: int) -> torch.Tensor:
    k, v = worker._layers[layer]
    return torch.stack([k[block], v[block]])


def test_a_load_is_copied_layer_by_layer_and_each_layer_waits_only_for_its_own_copy(embedded_url):
    sched, worker, objs, sx, stored, prompt = _stored_then_lazy(embedded_url)
    b = objs.request("B", prompt)
    blocks = list(range(10, 15))
    assert drv.admit(sched, objs, b, 0, blocks) == 64
    worker.bind_connector_metadata(sched.build_connector_meta(objs.output([(b, blocks, 64, 6)])))
    worker.start_load_kv(None)
    store = tv._EMBEDDED[embedded_url]
    assert store.stats()["leases"] == 1                      # held while the copies run
    for layer in range(drv.LAYERS):
        worker.wait_for_layer_load(f"model.layers.{layer}.self_attn.attn")
        sx.settle()                                          # the forward up to this layer's attention
        for i in range(4):
            assert torch.equal(_layer(worker, layer, 10 + i), stored[i][layer])
        if layer + 1 < drv.LAYERS:                           # later layers still on their way
            assert not torch.equal(_layer(worker, layer + 1, 10), stored[0][layer + 1])
    worker.wait_for_save()
    assert worker.get_block_ids_with_load_errors() == set()
    assert store.stats()["leases"] == 0                      # released once the copies had run
    assert worker.stats["loads_unordered"] == 0
    worker.shutdown()
    sched.shutdown()


def _step_loads_after_forward(sched, worker, objs, *, waits: bool = True) -> None:
    """One step without synchronous loads as vLLM 0.33 runs it: the forward (asking for every
    layer, or, a CUDA graph replayed whole, for none), then start_load_kv, then the rest."""
    worker.bind_connector_metadata(sched.build_connector_meta(objs.output([])))
    if waits:
        for layer in range(drv.LAYERS):
            worker.wait_for_layer_load(f"model.layers.{layer}.self_attn.attn")
    worker.start_load_kv(None)
    worker.wait_for_save()
    worker.get_finished(set())
    assert worker.get_block_ids_with_load_errors() == set()
    worker.clear_connector_metadata()


def _load_step_is_layerwise(sched, worker, objs, sx, stored, prompt, rid: str, first: int) -> bool:
    """A step with a synchronous load of 4 blocks into `first`..: whether its copies wait per
    layer (after layer 0's wait, layer 1 not there yet) rather than all before the forward.
    The bytes are exact and no load fails either way."""
    r = objs.request(rid, prompt)
    blocks = list(range(first, first + 5))
    assert drv.admit(sched, objs, r, 0, blocks) == 64
    worker.bind_connector_metadata(sched.build_connector_meta(objs.output([(r, blocks, 64, 6)])))
    worker.start_load_kv(None)
    worker.wait_for_layer_load("model.layers.0.self_attn.attn")
    sx.settle()
    layerwise = not torch.equal(_layer(worker, 1, first), stored[0][1])
    for layer in range(1, drv.LAYERS):
        worker.wait_for_layer_load(f"model.layers.{layer}.self_attn.attn")
    sx.settle()
    worker.wait_for_save()
    worker.get_finished(set())
    assert worker.get_block_ids_with_load_errors() == set()
    assert all(torch.equal(drv.block_kv(worker, first + i), stored[i]) for i in range(4))
    worker.clear_connector_metadata()
    return layerwise


def test_loads_stay_layer_by_layer_when_vllm_starts_loads_after_the_forward(embedded_url):
    """vLLM 0.33 calls start_load_kv after the forward in steps without synchronous loads: the
    waits that forward asked for still count, so the next load step still copies layer by layer
    (C6). A step that asks for no layer (a CUDA graph replayed whole) changes nothing; after a
    CUDA-graph capture (reset_capture_state) its dummy forwards' waits are forgotten: the next
    load is waited for as a whole, until a real forward has asked for every layer again."""
    sched, worker, objs, sx, stored, prompt = _stored_then_lazy(embedded_url)
    _step_loads_after_forward(sched, worker, objs)
    assert _load_step_is_layerwise(sched, worker, objs, sx, stored, prompt, "B", 10)
    _step_loads_after_forward(sched, worker, objs, waits=False)
    assert _load_step_is_layerwise(sched, worker, objs, sx, stored, prompt, "C", 20)
    worker.reset_capture_state()
    assert not _load_step_is_layerwise(sched, worker, objs, sx, stored, prompt, "D", 30)
    _step_loads_after_forward(sched, worker, objs)
    assert _load_step_is_layerwise(sched, worker, objs, sx, stored, prompt, "E", 40)
    worker.shutdown()
    sched.shutdown()


def test_a_forward_that_skips_a_layers_wait_gets_its_loaded_blocks_recomputed(embedded_url):
    """On a GPU the attention of a layer that did not wait could read blocks before they arrive:
    those loads are reported as failed, so vLLM recomputes them instead of trusting them."""
    sched, worker, objs, sx, stored, prompt = _stored_then_lazy(embedded_url)
    b = objs.request("B", prompt)
    blocks = list(range(10, 15))
    drv.admit(sched, objs, b, 0, blocks)
    worker.bind_connector_metadata(sched.build_connector_meta(objs.output([(b, blocks, 64, 6)])))
    worker.start_load_kv(None)
    for layer in range(drv.LAYERS - 1):                      # the last layer never asks
        worker.wait_for_layer_load(f"model.layers.{layer}.self_attn.attn")
    worker.wait_for_save()
    assert worker.get_block_ids_with_load_errors() == set(blocks[:4])
    assert worker.stats["loads_unordered"] == 1
    # the next load step does not trust per-layer waits: its forward waits for the whole load
    worker.clear_connector_metadata()
    c = objs.request("C", prompt)
    blocks = list(range(20, 25))
    drv.admit(sched, objs, c, 0, blocks)
    worker.bind_connector_metadata(sched.build_connector_meta(objs.output([(c, blocks, 64, 6)])))
    worker.start_load_kv(None)
    sx.settle()                                              # before any layer asks
    assert all(torch.equal(drv.block_kv(worker, 20 + i), stored[i]) for i in range(4))
    worker.wait_for_save()
    assert worker.get_block_ids_with_load_errors() == set()
    worker.shutdown()
    sched.shutdown()


def test_a_save_commits_only_after_its_copy_has_run(embedded_url):
    from tierd.kernels.transfer import BlockTransfer
    from tests.helpers import LazyStreams
    sched, worker = pair(embedded_url, "CPU", load_async=False)
    sx = LazyStreams()
    worker._xfer = BlockTransfer(worker._xfer.k, worker._xfer.v, worker.ratio, streams=sx)
    objs = drv.Objects()
    a = objs.request("A", list(range(1, 40)))
    drv.admit(sched, objs, a, 0, [0, 1, 2])
    worker.bind_connector_metadata(sched.build_connector_meta(objs.output([(a, [0, 1, 2], 0, 39)])))
    worker.start_load_kv(None)
    sx.run(sx.compute, lambda: [k[1].fill_(2.0) for k, _ in worker._layers])   # the forward writes block 1
    worker.wait_for_save()
    assert worker.flush(30)
    store = tv._EMBEDDED[embedded_url]
    ns = worker.namespace("")
    (block,) = store.get(ns, ns.block_keys(list(range(1, 40)))[:1])
    t = torch.from_numpy(block).view(torch.float16).view(ns.block_shape)
    assert bool((t[:, 0, 16:] == 2.0).all())                 # the write queued before the copy
    assert torch.equal(t[0, 1, :16], worker._layers[0][1][0])
    worker.shutdown()
    sched.shutdown()


def test_hbm_tier_copies_on_the_engines_device_are_loaded_device_to_device(tmp_path):
    url = f"embedded://?host=16MiB&gpu=1MiB&gpu_slab=256KiB&gpu_device=cpu&gpu_admit_hits=0&disk={tmp_path}/d&disk_bytes=64MiB"
    try:
        sched, worker = pair(url, "BNH2D", load_async=False)
        drv.run_roundtrip(sched, worker, drv.Objects(), tv._EMBEDDED[url])
        assert worker.stats["hbm_hit_blocks"] > 0
        assert tv._EMBEDDED[url].stats()["tiers"]["gpu"]["blocks"] > 0
        worker.shutdown()
        sched.shutdown()
    finally:
        store = tv._EMBEDDED.pop(url, None)
        if store is not None:
            store.close()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("layout", sorted(set(drv.LAYOUTS) - {"CPU"}))   # the CPU backend's own on CPU
def test_gpu_roundtrip_on_cuda_caches(embedded_url, layout):
    """vLLM's GPU cache layouts on a CUDA device: saves through the save stream, layer-by-layer
    loads through the load stream; the bytes loaded equal the bytes stored."""
    sched = tv.TierdConnector(config(embedded_url, layout, load_async=False), tv.KVConnectorRole.SCHEDULER, None)
    worker = tv.TierdConnector(config(embedded_url, layout, load_async=False), tv.KVConnectorRole.WORKER, None)
    worker.register_kv_caches({n: t.cuda() for n, t in drv.paged_caches(layout).items()})
    assert not worker.disabled and worker._device.type == "cuda"
    drv.run_roundtrip(sched, worker, drv.Objects(), tv._EMBEDDED[embedded_url])
    assert worker.stats["loads_unordered"] == 0
    worker.shutdown()
    sched.shutdown()


def test_a_device_error_while_loading_is_reported_for_recompute_not_raised(embedded_url):
    sched, worker, objs, sx, stored, prompt = _stored_then_lazy(embedded_url)

    def device_error(*a, **k):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")
    worker._xfer.load_layers = device_error
    b = objs.request("B", prompt)
    blocks = list(range(10, 15))
    drv.admit(sched, objs, b, 0, blocks)
    drv.step(sched, worker, objs, objs.output([(b, blocks, 64, 6)]))       # no exception reaches vLLM
    assert objs.take_errors() == set(blocks[:4])
    assert tv._EMBEDDED[embedded_url].stats()["leases"] == 0
    worker.shutdown()
    sched.shutdown()


# -- hybrid models (vLLM's hybrid KV cache manager) ------------------------------------------------
def test_hybrid_groups_are_copied_through_their_own_block_ids(embedded_url):
    """Sliding-window and full-attention layers with block ids per group from one pool and
    aliased memory: each layer goes through its group's ids, null blocks are skipped, a
    window's freed blocks are stored as zeros, never as another request's bytes."""
    groups = drv.hybrid_kv_cache_config()
    sched = tv.TierdConnector(config(embedded_url), tv.KVConnectorRole.SCHEDULER, groups)
    worker = tv.TierdConnector(config(embedded_url), tv.KVConnectorRole.WORKER, groups)
    assert not sched.disabled and not worker.disabled, (sched.disabled, worker.disabled)
    assert isinstance(sched, tv.SupportsHMA)
    worker.register_kv_caches(drv.hybrid_paged_caches())
    assert not worker.disabled, worker.disabled
    try:
        drv.run_hybrid(sched, worker, drv.GroupObjects(), tv._EMBEDDED[embedded_url])
    finally:
        worker.shutdown()
        sched.shutdown()


def test_the_group_structure_is_part_of_the_namespace(embedded_url):
    """The same model cached with the hybrid manager on (windows kept, zeros outside them) and
    off (one group, every token kept) never shares blocks."""
    hybrid = tv.TierdConnector(config(embedded_url), tv.KVConnectorRole.SCHEDULER, drv.hybrid_kv_cache_config())
    one = SimpleNamespace(kv_cache_groups=[SimpleNamespace(
        kv_cache_spec=type("FullAttentionSpec", (), {"block_size": drv.BLOCK_SIZE, "sliding_window": drv.WINDOW})(),
        layer_names=drv.layer_names())])
    plain = tv.TierdConnector(config(embedded_url), tv.KVConnectorRole.SCHEDULER, one)
    unknown = tv.TierdConnector(config(embedded_url), tv.KVConnectorRole.SCHEDULER, None)
    assert hybrid.namespace("").id != plain.namespace("").id
    assert plain.namespace("").id == unknown.namespace("").id      # every token kept: the same bytes
    for c in (hybrid, plain, unknown):
        c.shutdown()


def test_a_sliding_model_without_vllms_live_block_table_saves_nothing(embedded_url):
    """A table kept from step outputs may name blocks a window has freed (and vLLM has given to
    another request): without vLLM's live table, a model with windows stores nothing."""
    groups = drv.hybrid_kv_cache_config()
    sched = tv.TierdConnector(config(embedded_url), tv.KVConnectorRole.SCHEDULER, groups)
    objs = drv.GroupObjects()
    a = objs.request("HC", list(range(64)))
    table = ([1, 2, 3, 4], [5, 6, 7, 8])
    drv.admit(sched, objs, a, 0, table)
    out = objs.live_output([(a, table, 0, 64)])
    out.kv_connector_block_state = None
    assert sched.build_connector_meta(out).saves == []
    assert sched.stats["stores_skipped"] == 2
    sched.shutdown()


# -- MLA: one latent row per token, the same on every tensor-parallel rank -------------------------
LATENT = 576      # DeepSeek's kv_lora_rank 512 + rope 64, the only size vLLM's CPU MLA runs


def test_mla_latent_rows_are_stored_once_by_rank_0_and_loaded_by_every_rank(embedded_url):
    """Two tensor-parallel workers of an MLA model (vLLM's CPU_MLA cache: a row per token):
    one namespace for both, rank 0 alone writes, both load; a tier block is
    [layers, block_tokens, latent], token-major per layer."""
    def cfg(rank):
        c = config(embedded_url)
        ns = c.kv_transfer_config.kv_connector_extra_config["namespace"]
        c.kv_transfer_config.kv_connector_extra_config["namespace"] = dict(
            ns, num_kv_heads=1, head_dim=LATENT, planes=1, tp_rank=rank)
        c.compilation_config.static_forward_context = {
            n: SimpleNamespace(attn_backend=drv.backend_class("CPU_MLA"), isa=None) for n in drv.layer_names()}
        return c

    g = torch.Generator().manual_seed(4)
    sched = tv.TierdConnector(cfg(0), tv.KVConnectorRole.SCHEDULER, None)
    workers = [tv.TierdConnector(cfg(r), tv.KVConnectorRole.WORKER, None) for r in (0, 1)]
    caches = [{n: torch.randn((drv.NUM_BLOCKS, drv.BLOCK_SIZE, LATENT), generator=g).half() for n in drv.layer_names()}
              for _ in workers]
    for w, c in zip(workers, caches):
        w.register_kv_caches(c)
        assert not w.disabled, w.disabled
    assert sched.key_ranks == 1 and sched.namespace("").planes == 1

    def step(out):
        step_workers(sched, workers, out, flush=False)

    objs = drv.Objects()
    prompt = torch.randint(0, 32000, (100,), generator=g).tolist()
    a = objs.request("MA", prompt)
    assert drv.admit(sched, objs, a, 0, list(range(7))) == 0
    step(objs.output([(a, range(7), 0, 100)]))
    for w in workers:
        assert w.flush(30)
    assert workers[0].stats["stored_blocks"] == 3 and workers[1].stats.get("stored_blocks", 0) == 0
    sched.request_finished_all_groups(a, (list(range(7)),))
    ns = workers[0].namespace("")
    store = tv._EMBEDDED[embedded_url]
    (block,) = store.get(ns, ns.block_keys(prompt[:96])[1:2])
    rows = torch.from_numpy(block).view(torch.float16).view(drv.LAYERS, drv.BLOCK_TOKENS, LATENT)
    for i, n in enumerate(drv.layer_names()):
        assert torch.equal(rows[i], torch.cat([caches[0][n][2], caches[0][n][3]]))
    # a fresh request with the prefix: both ranks load rank 0's rows into blocks 10..15
    b = objs.request("MB", prompt[:96] + [5] * 8)
    assert drv.admit(sched, objs, b, 0, list(range(10, 17))) == 96
    step(objs.output([(b, range(10, 17), 96, 8)]))
    for c in caches:
        for n in drv.layer_names():
            assert torch.equal(c[n][10:16], caches[0][n][0:6]), n
    for w in (*workers, sched):
        w.shutdown()


# -- pipeline parallelism: each stage its layers, a hit only where every stage holds it ------------
def test_pipeline_stages_store_their_own_layers_and_a_hit_needs_every_stage(daemon):
    names = drv.layer_names()

    def conn(stage=None):
        ns = dict(drv.extra_config(daemon.url)["namespace"], pp_size=2)
        if stage is not None:
            ns["pp_rank"] = stage
        role = tv.KVConnectorRole.SCHEDULER if stage is None else tv.KVConnectorRole.WORKER
        c = tv.TierdConnector(config(daemon.url, namespace=ns, load_async=False), role, None)
        if stage is not None:       # a stage's worker gets its own layers only (global names)
            caches = drv.paged_caches(seed=20 + stage)
            c.register_kv_caches({n: caches[n] for n in names[2 * stage:2 * stage + 2]})
            assert not c.disabled, c.disabled
        return c

    sched, stages = conn(), [conn(0), conn(1)]
    assert sched.stages == [(0, 2), (2, 4)] and sched.key_ranks == 2

    def step(out):
        step_workers(sched, stages, out)

    objs = drv.Objects()
    prompt = list(range(1, 71))
    a = objs.request("PA", prompt)
    assert drv.admit(sched, objs, a, 0, list(range(5))) == 0
    step(objs.output([(a, range(5), 0, 70)]))
    sched.request_finished(a, list(range(5)))
    nss = [w.namespace("") for w in stages]
    assert [ns.layers for ns in nss] == ["0-2/4", "2-4/4"] and nss[0].id != nss[1].id
    assert nss == [sched.namespace("", 0), sched.namespace("", 1)]    # the scheduler keys every stage
    # a fresh request loads both stages' layers into its blocks
    b = objs.request("PB", prompt[:64] + [9] * 6)
    assert drv.admit(sched, objs, b, 0, list(range(10, 15))) == 64
    step(objs.output([(b, range(10, 15), 64, 6)]))
    for w in stages:
        for k, v in w._layers:
            assert torch.equal(k[10:14], k[0:4]) and torch.equal(v[10:14], v[0:4])
    sched.request_finished(b, list(range(10, 15)))
    with tierd.connect(daemon.url) as admin:
        admin.flush(namespace=nss[1])                     # stage 1 loses its blocks
        c = objs.request("PC", prompt)
        assert drv.admit(sched, objs, c, 0, list(range(20, 25))) == 0    # stage 0's alone: no hit
        sched.request_finished(c, list(range(20, 25)))
    for w in (*stages, sched):
        w.shutdown()


def test_pipeline_parallelism_with_sliding_windows_is_declined(embedded_url):
    ns = dict(drv.extra_config(embedded_url)["namespace"], pp_size=2)
    c = tv.TierdConnector(config(embedded_url, namespace=ns), tv.KVConnectorRole.SCHEDULER,
                          drv.hybrid_kv_cache_config())
    assert "pipeline parallelism with several KV cache groups" in c.disabled
    c.shutdown()


# -- recurrent state (Mamba, linear attention) ---------------------------------------------------
def _state_pair(url: str, mode: str = "align", **extra):
    groups, extra = drv.state_kv_cache_config(mode), {"block_tokens": None} | extra
    sched = tv.TierdConnector(config(url, **extra), tv.KVConnectorRole.SCHEDULER, groups)
    worker = tv.TierdConnector(config(url, **extra), tv.KVConnectorRole.WORKER, groups)
    return sched, worker


def test_recurrent_state_is_saved_where_a_step_ends_on_a_block_and_loaded_with_the_hit(embedded_url):
    sched, worker = _state_pair(embedded_url)
    worker.register_kv_caches(drv.state_paged_caches())
    assert not worker.disabled and not sched.disabled, (worker.disabled, sched.disabled)
    assert worker.block_tokens == drv.BLOCK_SIZE       # states exist at engine-block boundaries only
    try:
        drv.run_state(sched, worker, drv.GroupObjects(), tv._EMBEDDED[embedded_url])
    finally:
        worker.shutdown()
        sched.shutdown()


def test_recurrent_state_namespaces_keep_layouts_and_models_apart(embedded_url):
    sched, _ = _state_pair(embedded_url)
    kv, state = sched.namespace(""), sched.state_namespace("")
    assert kv.num_layers == 1 and "state:3" in kv.attention          # the attention layer alone
    assert state.id != kv.id and "bfloat16[3, 8]" in state.state and "float32[2, 4, 4]" in state.state
    other = drv.state_kv_cache_config()
    for g in other.kv_cache_groups[:3]:
        g.kv_cache_spec.dtypes = (torch.float32, torch.float32)      # another state dtype
    s2 = tv.TierdConnector(config(embedded_url, block_tokens=None), tv.KVConnectorRole.SCHEDULER, other)
    assert s2.state_namespace("").id != state.id
    assert sched.state_namespace("salt").id != state.id
    plain, _ = pair(embedded_url)
    assert plain.namespace("").id not in (kv.id, state.id)


def test_recurrent_state_without_block_states_or_with_other_tier_blocks_is_declined(embedded_url):
    sched, worker = _state_pair(embedded_url, mode="none")      # vLLM's prefix caching off
    assert "keeps no state at block boundaries" in sched.disabled
    sched, _ = _state_pair(embedded_url, block_tokens=2 * drv.BLOCK_SIZE)
    assert "leave block_tokens unset" in sched.disabled
    worker = tv.TierdConnector(config(embedded_url, block_tokens=None), tv.KVConnectorRole.WORKER,
                               drv.state_kv_cache_config())
    caches = drv.state_paged_caches()
    caches[drv.layer_names()[0]] = caches[drv.layer_names()[0]][..., :8]   # a page shorter than its states
    worker.register_kv_caches(caches)
    assert "bytes of state" in worker.disabled


# -- what cannot be keyed never raises into vLLM (connectors/identity.py) ------------------------
def test_an_adapter_whose_files_vanish_while_hashed_declines_its_request_not_the_engine(embedded_url, tmp_path):
    """Review C4: the first request with a new adapter hashes its files on vLLM's scheduler
    thread; on 792e2b3 an OSError there (the adapter directory being replaced: a weight file
    already gone) escaped into vLLM's EngineCore. Now that request is not cached, and the
    engine's other requests are."""
    import os
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text('{"r": 8}')
    os.symlink(tmp_path / "gone.safetensors", adapter / "adapter_model.safetensors")
    sched, worker = pair(embedded_url)
    objs = drv.Objects()
    prompt = list(range(1, 101))
    r = objs.request("lora", prompt)
    r.lora_request = SimpleNamespace(lora_name="a", lora_path=str(adapter), lora_int_id=3)
    assert sched.get_num_new_matched_tokens(r, 0) == (0, False)
    sched.update_state_after_alloc(r, objs.blocks(list(range(7))), 0)
    assert sched.stats["requests_not_keyed"] == 1
    sched.request_finished(r, [])
    assert _store_and_lookup(sched, worker, objs, objs.request("A", prompt), [objs.request("B", prompt)]) == [96]
    worker.shutdown()
    sched.shutdown()


def test_a_worker_whose_rank_or_stage_is_unknown_declines_instead_of_guessing(embedded_url):
    """Review C5: with several tensor-parallel ranks, a worker whose rank vLLM cannot tell took
    rank 0's namespace on 792e2b3 (every rank then reads rank 0's head shards); a pipeline stage
    it could not tell raised. Both decline now: the worker copies nothing, and a load the
    scheduler promised it is reported for recompute."""
    for change in ({"tp_size": 2}, {"pp_size": 2}):
        ns = dict(drv.extra_config(embedded_url)["namespace"], **change)
        worker = tv.TierdConnector(config(embedded_url, namespace=ns, load_async=False), tv.KVConnectorRole.WORKER, None)
        worker.register_kv_caches(drv.paged_caches())
        what = "tensor-parallel rank" if "tp_size" in change else "pipeline stage"
        assert f"{what} (of 2) is unknown" in worker.disabled, worker.disabled
        assert worker._layers == []
        meta = tv.TierdConnectorMetadata()
        meta.loads.append(tv.LoadSpec("r", "", [[b"k" * 16]], 0, 0, [[1, 2]], False))
        worker.bind_connector_metadata(meta)
        worker.start_load_kv(None)
        assert worker.get_block_ids_with_load_errors() == {1, 2}
        worker.clear_connector_metadata()
        worker.shutdown()


def test_a_decided_load_past_its_deadline_stops_between_parts_and_vllm_computes_the_rest(embedded_url):
    """A load the cost model decided carries its deadline (tierd/costs.py); the worker leases
    it in parts of 8 tier blocks and, past the deadline, stops between two: the blocks loaded
    hold the stored bytes, the rest are reported for vLLM to compute (its "recompute" policy)
    and counted as abandoned. (The deadline here is already past when the first part is in.)"""
    sched, worker = pair(embedded_url, load_async=False)
    objs = drv.Objects()
    torch.manual_seed(3)
    prompt = torch.randint(0, 32000, (12 * drv.BLOCK_TOKENS + 5,)).tolist()
    nb = -(-len(prompt) // drv.BLOCK_SIZE)
    a = objs.request("A", prompt)
    drv.admit(sched, objs, a, 0, list(range(nb)), worker)
    drv.step(sched, worker, objs, objs.output([(a, range(nb), 0, len(prompt))]))
    assert worker.flush(30)
    sched.request_finished(a, list(range(nb)))
    b = objs.request("B", prompt)
    ext, is_async = sched.get_num_new_matched_tokens(b, 0)
    assert ext == 12 * drv.BLOCK_TOKENS and not is_async
    ids = list(range(30, 30 + nb))
    sched.update_state_after_alloc(b, objs.blocks(ids), ext)
    (spec,) = sched._loads
    spec.deadline_s = 0.0
    drv.step(sched, worker, objs, objs.output([(b, ids, ext, len(prompt) - ext)]))
    ratio = drv.BLOCK_TOKENS // drv.BLOCK_SIZE
    assert objs.take_errors() == set(ids[8 * ratio:12 * ratio])      # the last 4 tier blocks
    assert worker.stats["abandoned_tokens"] == 4 * drv.BLOCK_TOKENS
    for layer in range(drv.LAYERS):
        for i in range(8 * ratio):
            assert torch.equal(drv.layer_block(worker, layer, ids[i]), drv.layer_block(worker, layer, i))
    sched.request_finished(b, ids)
    worker.shutdown()
    sched.shutdown()
