"""The engine loads cached prefixes from tierd instead of recomputing: embedded and through the
daemon, from host and from disk, across restarts; and never fails because of tierd."""

import json
import subprocess
import sys

import pytest
import torch

pytest.importorskip("transformers")

from tierd import TieredStore  # noqa: E402
from tierd.engine import LLM, SamplingParams  # noqa: E402
from tierd.engine.random_model import write_random_model  # noqa: E402

from .daemon import ROOT, DaemonProc  # noqa: E402

G = SamplingParams(temperature=0, max_tokens=8, logprobs=0)
PROMPT = list(range(1, 200))  # 3 full tier blocks of 64 tokens


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_random_model(tmp_path_factory.mktemp("m") / "llama", seed=0)


@pytest.fixture(scope="module")
def cold(model_dir):
    return LLM(model_dir, kv_cache_bytes="8MiB", enable_prefix_caching=False).generate(
        prompt_token_ids=PROMPT, sampling_params=G)[0]


@pytest.fixture
def filled(model_dir):
    """An embedded store holding PROMPT's blocks, stored by an engine that has since closed."""
    store = TieredStore(host_bytes="64MiB")
    run(model_dir, store)
    yield store
    store.close()


def lps(out):
    c = out.outputs[0]
    return [c.logprobs[i][t].logprob for i, t in enumerate(c.token_ids)]


def run(model_dir, store, prompt=PROMPT, **kw):
    llm = LLM(model_dir, kv_cache_bytes="8MiB", kv_store=store, kv_block_tokens=64, **kw)
    try:
        out = llm.generate(prompt_token_ids=prompt, sampling_params=G)[0]
        llm.connector.flush()
        return out, llm.kv_connector_stats()
    finally:
        llm.close()


def assert_same(a, b):
    """Same tokens, and logprobs within 1e-3. A hit computes only the prompt's tail (other
    matmul shapes than a cold prefill of the whole prompt), which moves fp32 logprobs by up to
    about 1e-4 (1.08e-4 seen in CI with exact KV); a wrong KV block moves them by far more."""
    assert a.outputs[0].token_ids == b.outputs[0].token_ids
    assert max(abs(x - y) for x, y in zip(lps(a), lps(b))) < 1e-3


def test_embedded_hits_from_host_and_from_disk_match_the_cold_run(model_dir, cold, tmp_path):
    store = TieredStore(host_bytes="64MiB", disk_path=str(tmp_path / "d"), disk_bytes="64MiB",
                        disk_slab_bytes="4MiB")
    try:
        first, st = run(model_dir, store)
        assert first.num_cached_tokens == 0 and st["stored_blocks"] == 3
        host, st = run(model_dir, store)  # a new engine: its own prefix cache is empty
        assert host.num_cached_tokens == 192 and host.metrics["tier_sources"] == ["host"]
        assert_same(host, cold)
        store.sync()
        store.flush(tier="host")
        disk, _ = run(model_dir, store)
        assert disk.num_cached_tokens == 192 and disk.metrics["tier_sources"] == ["disk"]
        assert_same(disk, cold)
        # decode steps through the static buffers a CUDA graph captures: a hit's first step
        # (loads in flight) runs the forward, its decodes the static step
        graphs, _ = run(model_dir, store, cuda_graphs=True)
        assert graphs.num_cached_tokens == 192
        assert_same(graphs, cold)
    finally:
        store.close()


@pytest.mark.parametrize("through", ["embedded", "daemon"])
def test_a_cpu_host_hit_is_one_lease_and_one_copy_per_plane(model_dir, cold, tmp_path, monkeypatch, through):
    """The work of a host hit's load on the CPU, counted: one lease (through the daemon, a
    pipelined one, answered at its release), one C copy call per plane for every layer at once
    (no per-layer or per-block Python loop), and the outputs equal the cold run's. Through the
    daemon, the engine's thread never exchanges the cost model (a round trip, and it held the
    connection the load uses): a thread of the link's does, on a connection of its own, but
    for the engine's last measurements at its close."""
    import threading
    from tierd.client import Client
    from tierd.kernels import native
    if not native.available():
        pytest.skip(f"no C copy here: {native.why_not()}")
    d = DaemonProc(tmp_path).start() if through == "daemon" else None
    store = TieredStore(host_bytes="64MiB") if d is None else d.url
    copies, c_calls = [], []
    plan_copy = native.CopyPlan.copy

    def counted_copy(self, block_ids, slots, *, to_slots, **kw):
        if not to_slots:
            copies.append(tuple(block_ids.shape))
            items = self._items

            def counted_items(*a):
                rows = items(*a)
                c_calls.extend(rows[:, 1].tolist())                  # layers per C copy call
                return rows
            self._items = counted_items
            try:
                return plan_copy(self, block_ids, slots, to_slots=to_slots, **kw)
            finally:
                del self._items
        return plan_copy(self, block_ids, slots, to_slots=to_slots, **kw)
    leases = []
    acquire = (TieredStore if d is None else Client).acquire

    loaders = []

    def counted_acquire(self, ns, keys, **kw):
        loaders.append(self)
        lease = acquire(self, ns, keys, **kw)
        leases.append((len(lease), getattr(lease, "_pending", None) is not None))
        return lease
    ops = []
    call = Client._call

    def counted_call(self, op, **kw):
        ops.append((op, threading.current_thread() is threading.main_thread(), self))
        return call(self, op, **kw)
    try:
        run(model_dir, store)                                    # fills the store
        monkeypatch.setattr(native.CopyPlan, "copy", counted_copy)
        monkeypatch.setattr(TieredStore if d is None else Client, "acquire", counted_acquire)
        monkeypatch.setattr(Client, "_call", counted_call)
        hit, st = run(model_dir, store)
        mine = [op for op, main, _ in ops if main]
        assert "costs" not in mine[:-1], mine                   # (the last: the engine's close)
        if d is not None:                                        # exchanged off the engine's thread,
            exchanges = [c for op, main, c in ops if op == "costs" and not main]
            assert exchanges and not any(c is loaders[0] for c in exchanges)   # not on the load's connection
        assert hit.num_cached_tokens == 192 and hit.metrics["tier_sources"] == ["host"]
        assert_same(hit, cold)
        assert leases == [(3, d is not None)]                  # one lease of the 3 tier blocks
        assert copies == [(3, 4)]                               # one copy: 3 tier blocks of 4 engine blocks
        layers = json.loads((model_dir / "config.json").read_text())["num_hidden_layers"]
        assert c_calls == [layers, layers]                      # K, then V: every layer in one call
        assert st["lost_leases"] == 0 and st["load_failures"] == 0
    finally:
        if d is None:
            store.close()
        elif d.alive():
            assert d.stop() == 0


def test_hbm_tier_hits_on_the_engines_device_load_device_to_device_and_match(model_dir, cold):
    """An HBM tier on the engine's device ("cpu" here, the same code as on CUDA): its copies are
    read instead of the host copies, and the outputs equal the cold run."""
    store = TieredStore(host_bytes="64MiB", gpu_bytes="8MiB", gpu_slab_bytes="2MiB", gpu_device="cpu",
                        gpu_admit_hits=0)
    try:
        run(model_dir, store)
        out, st = run(model_dir, store)
        assert out.num_cached_tokens == 192 and st["hbm_hit_blocks"] == 3
        assert_same(out, cold)
        assert store.stats()["tiers"]["gpu"]["blocks"] == 3
    finally:
        store.close()


def test_a_hit_loads_layer_by_layer_while_the_forward_runs(model_dir, cold, filled):
    """The engine's forward waits for each layer's loaded blocks just before that layer (a
    stand-in for CUDA streams that copies only when waited for): layer 1's copy has not run when
    layer 0 computes, and the outputs equal the cold run."""
    from tierd.kernels.transfer import BlockTransfer

    from .helpers import LazyStreams
    llm = LLM(model_dir, kv_cache_bytes="8MiB", kv_store=filled, kv_block_tokens=64)
    conn = llm.connector
    sx = LazyStreams(eager_compute=True)
    conn.xfer = BlockTransfer(conn.xfer.k, conn.xfer.v, conn.ratio, streams=sx)
    copies_run = []
    wait = conn.wait_layer

    def watched(layer):
        wait(layer)
        copies_run.append(sum(s.done for s in sx.streams[1:]))
    conn.wait_layer = watched
    out = llm.generate(prompt_token_ids=PROMPT, sampling_params=G)[0]
    assert out.num_cached_tokens == 192
    assert_same(out, cold)
    assert len(copies_run) == 2 and copies_run[0] < copies_run[1]     # layer 1 loaded after layer 0
    assert filled.stats()["leases"] == 0                              # ended after the forward
    llm.close()


def test_a_device_error_while_loading_or_saving_means_recompute_not_a_failed_request(model_dir, cold, filled):
    llm = LLM(model_dir, kv_cache_bytes="8MiB", kv_store=filled, kv_block_tokens=64)

    def device_error(*a, **k):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")
    llm.connector.xfer.load_layers = device_error          # what a broken device would do
    llm.connector.xfer.save_async = device_error
    out = llm.generate(prompt_token_ids=PROMPT, sampling_params=G)[0]
    st = llm.kv_connector_stats()
    assert out.num_cached_tokens == 0 and st["load_failures"] == 1 and st["store_failures"] == 3
    assert_same(out, cold)
    assert filled.stats()["leases"] == 0
    llm.close()


def test_no_hit_after_a_weight_change_or_with_another_cache_salt(model_dir, tmp_path):
    store = TieredStore(host_bytes="64MiB")
    try:
        run(model_dir, store)
        salted, _ = run(model_dir, store, cache_salt="tenant-b")
        assert salted.num_cached_tokens == 0
        tuned = write_random_model(tmp_path / "tuned", seed=0, weight_std=0.081)  # same shapes
        other, _ = run(tuned, store)
        assert other.num_cached_tokens == 0
        again, _ = run(model_dir, store)
        assert again.num_cached_tokens == 192
    finally:
        store.close()


def test_through_the_daemon_across_engine_and_daemon_restarts(model_dir, cold, tmp_path):
    d = DaemonProc(tmp_path).start()
    try:
        # engine 1 in its own process stores the prefix
        r = subprocess.run([sys.executable, "-m", "tests.engine_proc", str(model_dir), d.url, "199"],
                           cwd=ROOT, capture_output=True, text=True, timeout=300)
        assert r.returncode == 0 and r.stdout.startswith("OK"), r.stderr[-2000:]
        # engine 2, another process (this one), hits it in the daemon's host tier
        hit, st = run(model_dir, d.url)
        assert hit.num_cached_tokens == 192 and hit.metrics["tier_sources"] == ["host"]
        assert_same(hit, cold)
        assert r.stdout.split()[1] == ",".join(map(str, cold.outputs[0].token_ids))
        # the daemon is killed after a sync and restarted: the blocks are host blocks again
        # (re-adopted, re-verified); with the host tier flushed, they come back from disk
        from tierd.client import Client
        with Client(d.socket) as c:
            assert c.sync() >= 0
        d.kill()
        d.start()
        after, _ = run(model_dir, d.url)
        assert after.num_cached_tokens == 192 and after.metrics["tier_sources"] == ["host"]
        assert_same(after, cold)
        with Client(d.socket) as c:
            assert c.flush(tier="host") > 0
        d.kill()
        d.start()
        after, _ = run(model_dir, d.url)
        assert after.num_cached_tokens == 192 and after.metrics["tier_sources"] == ["disk"]
        assert_same(after, cold)
    finally:
        if d.alive():
            assert d.stop() == 0


def test_a_lease_lost_while_the_forward_reads_loaded_blocks_discards_that_step_and_recomputes(
        model_dir, cold, tmp_path):
    """The daemon restarts while a hit's copies are in flight (a stand-in for streams that
    copies only when the forward waits) and its old slots are overwritten: the lease is not
    confirmed, so the engine throws that step away and recomputes; the outputs equal the cold
    run. Using what was copied would have given other outputs."""
    import ctypes

    import numpy as np

    from tierd.kernels.transfer import BlockTransfer

    from .helpers import LazyStreams
    d = DaemonProc(tmp_path).start()
    try:
        run(model_dir, d.url)
        llm = LLM(model_dir, kv_cache_bytes="8MiB", kv_store=d.url, kv_block_tokens=64)
        conn = llm.connector
        conn.xfer = BlockTransfer(conn.xfer.k, conn.xfer.v, conn.ratio, streams=LazyStreams(eager_compute=True))
        wait = conn.wait_layer
        overwritten = []

        def restart_and_overwrite(layer):
            if not overwritten:
                d.kill()
                d.start()
                for _, lease, _, _ in conn._loading:          # another writer takes the old slots
                    for buf in lease.buffers:
                        ctypes.memset(buf.ctypes.data, 0x3C, buf.nbytes)
                        overwritten.append(bool((np.asarray(buf) == 0x3C).all()))
            wait(layer)
        conn.wait_layer = restart_and_overwrite
        out = llm.generate(prompt_token_ids=PROMPT, sampling_params=G)[0]
        st = llm.kv_connector_stats()
        assert overwritten and all(overwritten) and st["lost_leases"] == 1
        assert_same(out, cold)
        llm.close()
    finally:
        if d.alive():
            d.stop()


def test_daemon_killed_mid_generation_requests_finish_by_recomputing(model_dir, tmp_path):
    d = DaemonProc(tmp_path).start()
    prompts = [list(range(i, i + 150)) for i in range(1, 6)]
    params = SamplingParams(temperature=0, max_tokens=80, logprobs=0)
    ref = LLM(model_dir, kv_cache_bytes="8MiB").generate(prompt_token_ids=prompts, sampling_params=params)
    llm = LLM(model_dir, kv_cache_bytes="8MiB", kv_store=d.url, kv_block_tokens=64)
    try:
        ids = [llm.add_request(prompt_token_ids=p, params=params) for p in prompts]
        done = {}
        for _ in range(5):
            for o in llm.step():
                done[o.request_id] = o
        d.kill()
        while llm.has_unfinished_requests():
            for o in llm.step():
                done[o.request_id] = o
        # a new request after the crash also completes (recomputed)
        late = llm.generate(prompt_token_ids=prompts[0], sampling_params=params)[0]
        st = llm.kv_connector_stats()
    finally:
        llm.close()
    for rid, r in zip(ids, ref):
        assert done[rid].outputs[0].token_ids == r.outputs[0].token_ids
    assert late.outputs[0].token_ids == ref[0].outputs[0].token_ids
    assert st["store_failures"] + st["load_failures"] + st["unavailable"] + st["stores_dropped"] > 0


def test_no_daemon_at_all_means_plain_recompute(model_dir, cold, tmp_path):
    out, st = run(model_dir, f"unix://{tmp_path}/nobody-here.sock")
    assert out.num_cached_tokens == 0 and st["unavailable"] >= 1
    assert_same(out, cold)


def test_the_engines_stores_carry_their_tokens_into_the_daemons_kv_events(model_dir, tmp_path):
    """A router's indexer computes its own keys from token ids: every block the engine stores
    is published with exactly the prompt tokens it holds, in chain order."""
    msgpack = pytest.importorskip("msgpack")
    from .test_events import Subscriber, free_port
    addr = f"tcp://127.0.0.1:{free_port()}"
    d = DaemonProc(tmp_path, toml=f'events_addr = "{addr}"\nevents_token_ids = true\n').start()
    sub = Subscriber(addr)
    try:
        import time
        time.sleep(0.5)                      # the subscription reaches the daemon
        out, st = run(model_dir, d.url)
        assert st["stored_blocks"] == 3
        stored = [e for f in sub.drain() for e in msgpack.unpackb(f[2], raw=False)[1]
                  if e["type"] == "BlockStored" and e["medium"] == "CPU"]
        assert [e["token_ids"] for e in stored] == [PROMPT[i * 64:(i + 1) * 64] for i in range(3)]
        assert [e["parent_block_hash"] for e in stored[1:]] == [e["block_hashes"][0] for e in stored[:2]]
    finally:
        sub.close()
        assert d.stop() == 0


def test_a_lossy_tier_codec_serves_close_kv_from_disk_and_host_hits_stay_exact(model_dir, cold, tmp_path):
    """kv_tier_codec="int4": blocks demoted to disk come back quantized (the run stays close to
    the cold one), blocks still in host RAM come back exact."""
    store = TieredStore(host_bytes="64MiB", disk_path=str(tmp_path / "d"), disk_bytes="64MiB",
                        disk_slab_bytes="4MiB")
    try:
        first, _ = run(model_dir, store, kv_tier_codec="int4")
        host, _ = run(model_dir, store, kv_tier_codec="int4")
        assert host.metrics["tier_sources"] == ["host"]
        assert_same(host, cold)
        store.sync()
        store.flush("host")
        disk, _ = run(model_dir, store, kv_tier_codec="int4")
        assert disk.num_cached_tokens == 192 and disk.metrics["tier_sources"] == ["disk"]
        # the first token rests on the loaded KV alone (later ones follow diverging greedy paths)
        assert 0 < abs(lps(disk)[0] - lps(cold)[0]) < 0.2
        exact, _ = run(model_dir, store)            # the exact namespace has none of these blocks
        assert exact.num_cached_tokens == 0
    finally:
        store.close()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("hbm", [False, True])
def test_gpu_engine_hits_on_cuda_match_the_cold_run(model_dir, hbm):
    """The engine on CUDA: a prefix loaded from host RAM (H2D on the load stream) or from the HBM
    tier (device to device) gives the outputs of recomputing it."""
    kw = dict(device="cuda", dtype="float16")
    cold_gpu = LLM(model_dir, kv_cache_bytes="8MiB", enable_prefix_caching=False, **kw).generate(
        prompt_token_ids=PROMPT, sampling_params=G)[0]
    extra = dict(gpu_bytes="8MiB", gpu_slab_bytes="2MiB", gpu_device="cuda", gpu_admit_hits=0) if hbm else {}
    store = TieredStore(host_bytes="64MiB", **extra)
    try:
        run(model_dir, store, **kw)
        out, st = run(model_dir, store, **kw)
        assert out.num_cached_tokens == 192 and st["hbm_hit_blocks"] == (3 if hbm else 0)
        assert st["load_device_s"] > 0          # the copies' device time, between CUDA events
        assert out.outputs[0].token_ids == cold_gpu.outputs[0].token_ids
        assert max(abs(x - y) for x, y in zip(lps(out), lps(cold_gpu))) < 1e-2
    finally:
        store.close()
