"""tierd's SGLang storage backend (`tierd.connectors.sglang.TierdStorage`) against a real daemon,
without SGLang: host pools here are stand-ins that lay out pages and answer
`get_page_buffer_meta` as SGLang 0.5.23's `MHATokenToKVPoolHost` / `MLATokenToKVPoolHost` do
(read from its wheel). Real SGLang engines run in tests/test_sglang.py.
"""

from __future__ import annotations

import random
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from tierd.connectors.sglang import TierdStorage, tier_keys
from tierd.engine.random_model import write_random_model

from .daemon import DaemonProc

PAGE, LAYERS, HEADS, DIM = 16, 3, 2, 8


class MHATokenToKVPoolHost:
    """SGLang's MHA host pool as its storage backends see it (same class name, same meta)."""

    def __init__(self, layout="layer_first", size=256, dtype=torch.float32, layers=LAYERS, seed=0):
        self.layout, self.size, self.dtype, self.page_size = layout, size, dtype, PAGE
        self.layer_num, self.head_num, self.head_dim = layers, HEADS, DIM
        self.start_layer, self.end_layer = 0, layers
        dims = {"layer_first": (2, layers, size, HEADS, DIM), "page_first": (2, size, layers, HEADS, DIM)}[layout]
        g = torch.Generator().manual_seed(seed)
        self.kv_buffer = torch.randn(dims, generator=g).to(dtype)

    def get_page_buffer_meta(self, indices):
        ptrs, isz = [], self.dtype.itemsize
        base = self.kv_buffer.data_ptr()
        v_off = self.layer_num * self.size * self.head_num * self.head_dim * isz
        idx = indices.tolist()
        if self.layout == "layer_first":
            for i in range(0, len(idx), self.page_size):
                for layer in range(self.layer_num):
                    k = base + idx[i] * self.head_num * self.head_dim * isz + layer * self.size * self.head_num * self.head_dim * isz
                    ptrs += [k, k + v_off]
            size = isz * self.page_size * self.head_num * self.head_dim
        else:
            for i in range(0, len(idx), self.page_size):
                k = base + idx[i] * self.layer_num * self.head_num * self.head_dim * isz
                ptrs += [k, k + v_off]
            size = self.layer_num * isz * self.page_size * self.head_num * self.head_dim
        return ptrs, [size] * len(ptrs)

    def page(self, start):
        """One page's bytes, whatever the layout (for comparisons)."""
        if self.layout == "layer_first":
            return self.kv_buffer[:, :, start:start + PAGE].clone()
        return self.kv_buffer[:, start:start + PAGE].clone()


class MLATokenToKVPoolHost:
    """SGLang's MLA host pool (layer_first): one latent row per token and layer."""

    def __init__(self, size=256, latent=24, seed=0):
        self.layout, self.size, self.dtype, self.page_size = "layer_first", size, torch.float32, PAGE
        self.layer_num, self.kv_cache_dim = LAYERS, latent
        self.start_layer, self.end_layer = 0, LAYERS
        self.kv_buffer = torch.randn((LAYERS, size, 1, latent), generator=torch.Generator().manual_seed(seed))

    def get_page_buffer_meta(self, indices):
        idx, isz, base = indices.tolist(), 4, self.kv_buffer.data_ptr()
        ptrs = [base + idx[i] * self.kv_cache_dim * isz + layer * self.size * self.kv_cache_dim * isz
                for i in range(0, len(idx), PAGE) for layer in range(self.layer_num)]
        return ptrs, [PAGE * self.kv_cache_dim * isz] * len(ptrs)

    def page(self, start):
        return self.kv_buffer[:, start:start + PAGE].clone()


class PackedPool(MHATokenToKVPoolHost):
    """A host pool whose pages this backend does not know (a quantized or packed one)."""


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("sglang-models")
    a = write_random_model(root / "a", num_hidden_layers=LAYERS, seed=0)
    b = write_random_model(root / "b", num_hidden_layers=LAYERS, seed=1)   # same shapes, other weights
    return str(a), str(b)


@pytest.fixture
def daemon(tmp_path):
    d = DaemonProc(tmp_path, host_bytes="32MiB").start()
    yield d
    if d.alive():
        d.stop()


def config(model, url, *, tp_rank=0, tp_size=1, mla=False, v1=True, **extra):
    return SimpleNamespace(tp_rank=tp_rank, tp_size=tp_size, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
                           is_mla_model=mla, is_storage_writer=not mla or tp_rank == 0, model_name=model,
                           dcp_size=1, dcp_rank=0, is_page_first_layout=False,
                           extra_config={"url": url, "interface_v1": int(v1), **extra})


def backend(pool, model, url, **kw) -> TierdStorage:
    b = TierdStorage(config(model, url, **kw))
    b.register_mem_pool_host(pool)
    b.on_host_pools_registered()
    return b


def keys(n, seed=0):
    rng = random.Random(seed)
    return ["%064x" % rng.getrandbits(256) for _ in range(n)]


def pages(*starts):
    return torch.cat([torch.arange(s, s + PAGE, dtype=torch.int64) for s in starts])


@pytest.mark.parametrize("layout", ["layer_first", "page_first"])
def test_pages_round_trip_between_two_engines_bytes_equal(daemon, models, layout):
    """Engine A stores pages from its host pool; engine B (another backend, another pool, other
    host slots) finds and loads them: every byte equal, the pages after the stored run untouched."""
    a_pool, b_pool = MHATokenToKVPoolHost(layout, seed=1), MHATokenToKVPoolHost(layout, seed=2)
    a, b = backend(a_pool, models[0], daemon.url), backend(b_pool, models[0], daemon.url)
    ks = keys(5)
    assert a.batch_set_v1(ks[:4], pages(0, 32, 48, 96)) == [True] * 4
    assert a.batch_set_v1(ks[:4], pages(0, 32, 48, 96)) == [True] * 4      # already held: still True
    assert b.batch_exists(ks) == 4
    untouched = b_pool.page(224)
    assert b.batch_get_v1(ks, pages(16, 64, 128, 160, 224)) == [True] * 4 + [False]
    for src, dst in zip((0, 32, 48, 96), (16, 64, 128, 160)):
        assert torch.equal(a_pool.page(src), b_pool.page(dst))
    assert torch.equal(b_pool.page(224), untouched)
    assert b.stats["loaded_pages"] == 4 and a.stats["stored_pages"] == 4 and a.stats["stores_present"] == 4


def test_layer_first_pages_are_tierd_canonical_blocks(daemon, models):
    """A layer_first page on the zero-copy path is [layers, 2, page, heads, dim]: the layout of
    every tierd block, so the namespace says so (no private layout) and a client reads it as such."""
    pool = MHATokenToKVPoolHost("layer_first", seed=3)
    b = backend(pool, models[0], daemon.url)
    assert b.ns.layout == "" and b.ns.block_shape == (LAYERS, 2, PAGE, HEADS, DIM)
    ks = keys(1, seed=9)
    assert b.batch_set_v1(ks, pages(32)) == [True]
    import tierd
    with tierd.connect(daemon.url) as c:
        (blk,) = c.get(b.ns, tier_keys(b.ns.root_key, ks))
    got = torch.from_numpy(blk.view("float32").reshape(LAYERS, 2, PAGE, HEADS, DIM).copy())
    assert torch.equal(got, pool.kv_buffer[:, :, 32:32 + PAGE].permute(1, 0, 2, 3, 4))


def test_no_page_is_served_across_identities(daemon, models):
    """The same SGLang keys under another model's weights, another tensor-parallel rank or size,
    another host layout, the generic (flat page) calls or another KV dtype never hit."""
    a = backend(MHATokenToKVPoolHost(seed=1), models[0], daemon.url)
    ks = keys(3, seed=5)
    assert a.batch_set_v1(ks, pages(0, 16, 32)) == [True] * 3
    others = {
        "other weights": backend(MHATokenToKVPoolHost(), models[1], daemon.url),
        "tp rank 1 of 2": backend(MHATokenToKVPoolHost(), models[0], daemon.url, tp_rank=1, tp_size=2),
        "tp rank 0 of 2": backend(MHATokenToKVPoolHost(), models[0], daemon.url, tp_rank=0, tp_size=2),
        "page_first": backend(MHATokenToKVPoolHost("page_first"), models[0], daemon.url),
        "flat pages": backend(MHATokenToKVPoolHost(), models[0], daemon.url, v1=False),
        "bf16": backend(MHATokenToKVPoolHost(dtype=torch.bfloat16), models[0], daemon.url),
    }
    names = {a.ns.name}
    for what, o in others.items():
        assert o.batch_exists(ks) == 0, what
        names.add(o.ns.name)
    assert len(names) == len(others) + 1
    assert backend(MHATokenToKVPoolHost(), models[0], daemon.url).batch_exists(ks) == 3   # the control


def test_mla_one_namespace_for_every_rank(daemon, models):
    """MLA: every rank holds the same latent rows, so rank 0 (SGLang's writer) stores and rank 1
    reads the same pages; a latent namespace never meets an MHA one."""
    r0_pool, r1_pool = MLATokenToKVPoolHost(seed=1), MLATokenToKVPoolHost(seed=2)
    r0 = backend(r0_pool, models[0], daemon.url, mla=True, tp_rank=0, tp_size=2)
    r1 = backend(r1_pool, models[0], daemon.url, mla=True, tp_rank=1, tp_size=2)
    assert r0.ns == r1.ns and r0.ns.planes == 1
    ks = keys(2, seed=7)
    assert r0.batch_set_v1(ks, pages(0, 16)) == [True, True]
    assert r1.batch_exists(ks) == 2
    assert r1.batch_get_v1(ks, pages(64, 80)) == [True, True]
    assert torch.equal(r1_pool.page(64), r0_pool.page(0)) and torch.equal(r1_pool.page(80), r0_pool.page(16))


def test_generic_calls_round_trip_flat_pages(daemon, models):
    """Without interface_v1 SGLang hands flat page tensors: set/batch_set/get/batch_get/exists."""
    pool = MHATokenToKVPoolHost()
    b = backend(pool, models[0], daemon.url, v1=False)
    n = b.block_bytes // 4
    vals = [torch.randn(n) for _ in range(3)]
    ks = keys(3, seed=11)
    assert b.batch_set(ks[:2], vals[:2]) and b.set(ks[2], vals[2])
    assert b.exists(ks[1]) and not b.exists(keys(1, seed=99)[0]) and b.batch_exists(ks) == 3
    outs = [torch.zeros(n) for _ in range(4)]
    got = b.batch_get(ks + keys(1, seed=98), outs)
    assert all(g is o for g, o in zip(got[:3], outs)) and got[3] is None
    assert all(torch.equal(v, o) for v, o in zip(vals, outs[:3]))
    one = torch.zeros(n)
    assert b.get(ks[0], one) is one and torch.equal(one, vals[0])
    assert not b.batch_set(ks[:1], [torch.zeros(n + 1)])                  # not a page: refused, nothing stored
    assert b.batch_get(ks[:1], [torch.zeros(n - 1)]) == [None]


def test_bad_input_is_a_miss_never_an_exception(daemon, models):
    pool = MHATokenToKVPoolHost()
    b = backend(pool, models[0], daemon.url)
    ks = keys(2, seed=13)
    assert b.batch_set_v1(ks, pages(0)) == [False, False]                   # 2 keys, 1 page of indices
    assert b.batch_exists(ks) == 0
    assert b.batch_set_v1([], pages(0)[:0]) == [] and b.batch_exists([]) == 0
    odd = ["", "not hex", "é" * 40, "0" * 10_000]
    assert b.batch_set_v1(odd, pages(0, 16, 32, 48)) == [True] * 4
    assert b.batch_exists(odd) == 4


def test_unsupported_pools_and_hybrid_pools_are_declined(daemon, models, caplog):
    b = backend(PackedPool(), models[0], daemon.url)
    assert b.disabled and "PackedPool" in b.disabled
    ks = keys(1)
    assert b.batch_exists(ks) == 0 and b.batch_set_v1(ks, pages(0)) == [False]
    assert b.batch_get_v1(ks, pages(0)) == [False]
    ok = backend(MHATokenToKVPoolHost(), models[0], daemon.url)
    ok.register_mem_host_pool_v2(MHATokenToKVPoolHost(), "mamba")
    ok.register_mem_host_pool_v2(MHATokenToKVPoolHost(), "swa")
    t = SimpleNamespace(name="mamba", keys=ks)
    assert ok.batch_set_v2([t]) == {"mamba": [False]} and ok.batch_get_v2([t]) == {"mamba": [False]}
    assert ok.batch_exists_v2(ks, [t]).kv_hit_pages == 0
    assert sum("not cached" in r.getMessage() for r in caplog.records) == 1   # one line, not one per call
    gone = TierdStorage(config("no/such/model", daemon.url))
    gone.register_mem_pool_host(MHATokenToKVPoolHost())
    assert "not a local directory" in gone.disabled


def test_a_stopped_daemon_means_misses_within_the_timeout_then_recovery(tmp_path, models):
    """Daemon killed mid-run: lookups, loads and stores answer 0 / False (no exception) and none
    waits past its timeout; a restarted daemon is used again after the back-off."""
    d = DaemonProc(tmp_path, host_bytes="32MiB").start()
    try:
        pool = MHATokenToKVPoolHost()
        b = backend(pool, models[0], d.url, timeout_s=0.5)
        ks = keys(2, seed=21)
        assert b.batch_set_v1(ks, pages(0, 16)) == [True, True]
        d.kill()
        t = time.monotonic()
        assert b.batch_exists(ks) == 0
        assert b.batch_get_v1(ks, pages(32, 48)) == [False, False]
        assert b.batch_set_v1(keys(2, seed=22), pages(32, 48)) == [False, False]
        assert time.monotonic() - t < 3.0
        d.start()
        deadline = time.monotonic() + 40
        # each of the three links (store, lookup, load) reconnects on its own, in the background,
        # and answers a miss until it is up: wait until all three are back
        while b.batch_set_v1(ks, pages(0, 16)) != [True, True]:
            assert time.monotonic() < deadline, "the store link never came back to the restarted daemon"
            time.sleep(0.2)
        while b.batch_exists(ks) != 2:
            assert time.monotonic() < deadline, "the lookup link never came back to the restarted daemon"
            time.sleep(0.2)
        while b.batch_get_v1(ks, pages(64, 80)) != [True, True]:
            assert time.monotonic() < deadline, "the load link never came back to the restarted daemon"
            time.sleep(0.2)
        assert torch.equal(pool.page(64), pool.page(0)) and torch.equal(pool.page(80), pool.page(16))
    finally:
        if d.alive():
            d.stop()


def test_a_daemon_that_was_never_there_costs_nothing(tmp_path, models):
    b = backend(MHATokenToKVPoolHost(), models[0], f"unix://{Path(tmp_path) / 'none.sock'}")
    t = time.monotonic()
    for _ in range(20):
        assert b.batch_exists(keys(2)) == 0
        assert b.batch_set_v1(keys(1), pages(0)) == [False]
    assert time.monotonic() - t < 3.0


def test_the_daemon_knows_the_namespace_once_the_pool_is_registered_before_any_request(daemon, models):
    """SGLang registers its host pool at start: from then on the backend's links connect and
    have the daemon know the namespace, so the first request's lookup, load and save pay for
    no registration round trip (which could outlast a lookup's deadline under load)."""
    import tierd
    pool = MHATokenToKVPoolHost()
    b = backend(pool, models[0], daemon.url)
    links = (b.lookup_link, b.load_link, b.save_link)
    with tierd.connect(daemon.url) as c:
        deadline = time.monotonic() + 10
        while not (b.ns.name in c.stats()["namespaces"]
                   and all(link.store is not None and b.ns.name in link.store._namespaces for link in links)):
            assert time.monotonic() < deadline, "the backend's links never registered the namespace"
            time.sleep(0.02)
        assert list(c.stats()["namespaces"]) == [b.ns.name]
    ks = keys(2, seed=41)
    assert b.batch_set_v1(ks, pages(0, 16)) == [True, True] and b.batch_exists(ks) == 2
    assert b.batch_get_v1(ks, pages(32, 48)) == [True, True]
    assert torch.equal(pool.page(32), pool.page(0)) and torch.equal(pool.page(48), pool.page(16))


def test_a_stalled_daemon_costs_a_call_at_most_its_timeout(tmp_path, models):
    """A daemon that stops answering (SIGSTOP): a lookup is a miss after its deadline, a load
    fails after its timeout (or is read, checked, out of the daemon's shared index), a store
    fails after it or succeeds at once (its link holds staged slots: then the blocks are stored
    when the daemon resumes), nothing raises; once it answers again, so do they."""
    import signal
    d = DaemonProc(tmp_path, host_bytes="32MiB").start()
    try:
        pool = MHATokenToKVPoolHost()
        b = backend(pool, models[0], d.url, timeout_s=0.5, lookup_deadline_ms=100)
        ks = keys(2, seed=31)
        assert b.batch_set_v1(ks, pages(0, 16)) == [True, True] and b.batch_exists(ks) == 2
        d.signal(signal.SIGSTOP)
        try:
            t = time.monotonic()
            assert b.batch_exists(ks) == 0
            assert time.monotonic() - t < 0.6
            t = time.monotonic()
            got = b.batch_get_v1(ks, pages(32, 48))
            assert time.monotonic() - t < 1.5
            # a load fails within its timeout, or it is read out of the daemon's shared index
            # without a round trip (its link warmed up at start: connected, namespace known) and
            # checked there: then its bytes are exact
            assert got in ([False, False], [True, True])
            if got == [True, True]:
                assert torch.equal(pool.page(32), pool.page(0)) and torch.equal(pool.page(48), pool.page(16))
            t = time.monotonic()
            stalled = keys(2, seed=32)
            stored = b.batch_set_v1(stalled, pages(32, 48))
            assert stored in ([False, False], [True, True])
            assert time.monotonic() - t < 1.5
        finally:
            d.signal(signal.SIGCONT)
        deadline = time.monotonic() + 40
        while b.batch_exists(ks) != 2 or b.batch_get_v1(ks, pages(64, 80)) != [True, True]:
            assert time.monotonic() < deadline, "the backend never came back to the resumed daemon"
            time.sleep(0.2)
        assert torch.equal(pool.page(64), pool.page(0)) and torch.equal(pool.page(80), pool.page(16))
        if stored == [True, True]:   # reported stored during the stall: stored, exact
            assert b.batch_get_v1(stalled, pages(96, 112)) == [True, True]
            assert torch.equal(pool.page(96), pool.page(32)) and torch.equal(pool.page(112), pool.page(48))
    finally:
        if d.alive():
            d.stop()


# -- the engine's settings (connectors/identity.py) ----------------------------------------------
def server_args(model, **kw):
    """SGLang's server arguments as the backend reads them (field names of SGLang 0.5.23's
    ServerArgs), defaults but for `kw`."""
    return SimpleNamespace(**{"model_path": model, "dtype": "auto", "kv_cache_dtype": "auto", "quantization": None,
                              "json_model_override_args": "{}", "load_format": "auto", "enable_lora": None,
                              "lora_paths": None, "modelopt_quant": None, "quantization_param_path": None,
                              "speculative_algorithm": None, "speculative_draft_model_path": None,
                              "speculative_draft_load_format": None, **kw})


def DraftPool(**kw) -> MHATokenToKVPoolHost:
    """A host pool that holds a draft model's layer after the target's (SGLang packs them in)."""
    pool = MHATokenToKVPoolHost(layers=LAYERS + 1, **kw)
    pool.target_layer_num = LAYERS
    return pool


def test_load_time_settings_and_draft_models_key_apart(daemon, models, monkeypatch):
    """Review C1, C8: two engines on one model directory that differ in --quantization,
    --json-model-override-args or the draft model whose layers the pool holds share no page;
    engines with the same settings do (on 792e2b3 every one of them hit)."""
    from tierd.connectors import sglang as ts
    args = {"plain": server_args(models[0]),
            "fp8 quantization": server_args(models[0], quantization="fp8"),
            "rope override": server_args(models[0], json_model_override_args='{"rope_scaling": {"factor": 2.0}}'),
            "eagle draft a": server_args(models[0], speculative_algorithm="EAGLE", speculative_draft_model_path=models[1]),
            "eagle draft b": server_args(models[0], speculative_algorithm="EAGLE", speculative_draft_model_path=models[0])}

    def engine(what, **kw):
        monkeypatch.setattr(ts, "engine_server_args", lambda: args[what], raising=False)
        pool = DraftPool(**kw) if what.startswith("eagle") else MHATokenToKVPoolHost(**kw)
        b = backend(pool, models[0], daemon.url)
        assert not b.disabled, b.disabled
        return b
    ks = keys(2, seed=41)
    for what in args:
        assert engine(what, seed=1).batch_set_v1(ks, pages(0, 16)) == [True, True]
    names = set()
    for what in args:
        b = engine(what, seed=2)
        names.add(b.ns.name)
        assert b.batch_exists(ks) == 2, what            # its own pages
    assert len(names) == len(args)
    fresh = keys(2, seed=42)
    assert engine("plain").batch_set_v1(fresh, pages(0, 16)) == [True, True]
    for what in set(args) - {"plain"}:
        assert engine(what).batch_exists(fresh) == 0, what


def test_lora_engines_unknown_kv_dtypes_and_unnamed_drafts_are_declined_with_one_line(daemon, models, monkeypatch,
                                                                                      caplog):
    """Review C2: SGLang keys a LoRA adapter's pages by its name and path, and its storage calls
    name no page's adapter, so an engine with LoRA is not cached (an adapter retrained in place
    would be served its predecessor's KV); KV cache formats tierd does not know and a draft
    model the pool holds but nothing names are declined too. SGLang runs on: every call a miss."""
    from tierd.connectors import sglang as ts
    cases = [(server_args(models[0], enable_lora=True), MHATokenToKVPoolHost(), "LoRA"),
             (server_args(models[0], lora_paths=["a=/adapters/a"]), MHATokenToKVPoolHost(), "LoRA"),
             (server_args(models[0], kv_cache_dtype="mxfp8"), MHATokenToKVPoolHost(dtype=torch.float8_e4m3fn),
              "KV cache dtype 'mxfp8'"),
             (server_args(models[0], speculative_algorithm="EAGLE"), DraftPool(), "no draft model is named")]
    for sa, pool, reason in cases:
        monkeypatch.setattr(ts, "engine_server_args", lambda sa=sa: sa, raising=False)
        caplog.clear()
        b = backend(pool, models[0], daemon.url)
        assert b.disabled and reason in b.disabled, b.disabled
        assert sum("disabled" in r.getMessage() for r in caplog.records) == 1
        ks = keys(1, seed=43)
        assert b.batch_exists(ks) == 0 and b.batch_set_v1(ks, pages(0)) == [False]


# -- hits worth loading (tierd/costs.py) -----------------------------------------------------------
def measure(model, engine, block_bytes, *, disk_s=None, token_s=1e-4):
    """Feed `model` what an engine and a load would have measured: forwards of `engine` at
    `token_s` a token, and with `disk_s` the disk's loads of 4 pages taking that long."""
    for _ in range(3):
        for n in (16, 64, 256, 1024):
            model.observe_forward(engine, [(n, 0)], 1e-6 + n * token_s)
        if disk_s is not None:
            model.observe_transfer("disk", "load", 4 * block_bytes, disk_s)


def until(what, check, timeout_s=10.0):
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


def replica_knows(b, c, *, disk=False):
    """Whether the backend's lookup replica has the recompute fit for its namespace (and the
    disk's loads) that client `c` measured: asked again, each replica exchanges with the daemon's
    model when due (every 0.5 s)."""
    c.cost_model()
    m = b.lookup_link.cost_model()
    return m.has_recompute(b.ns.name) and (not disk or m.transfers[("disk", "load")].n >= 3)


def test_decide_reports_the_host_head_and_declines_a_slow_disk_tail(daemon, models):
    """Six pages on disk only, the first two read back into host RAM; the disk measured far
    slower than recomputing a page: with "decide" the existence check reports the host head (2),
    the declined tail goes in the backend's stats and the daemon's ledger, and the disk is probed
    (which reads the tail into host RAM: then all six are worth loading). "always" reports all
    six throughout; a page is never reported that is not held."""
    import tierd
    from tierd.costs import primary_tier
    from tierd.errors import ConfigError
    pool = MHATokenToKVPoolHost(seed=4)
    decide = backend(pool, models[0], daemon.url, load_policy="decide")
    always = backend(MHATokenToKVPoolHost(), models[0], daemon.url, load_policy="always")
    assert decide.load_policy == "decide" and always.load_policy == "always"
    with pytest.raises(ConfigError):
        backend(MHATokenToKVPoolHost(), models[0], daemon.url, load_policy="sometimes")
    ks = keys(6, seed=51)
    assert decide.batch_set_v1(ks, pages(0, 16, 32, 48, 64, 80)) == [True] * 6
    tk = tier_keys(decide.ns.root_key, ks)
    with tierd.connect(daemon.url) as c:
        c.sync()
        c.flush(tier="host")
        assert c.where(decide.ns, tk) == ["disk"] * 6
        c.release(c.acquire(decide.ns, tk[:2]))                        # the head read back into host RAM
        assert [primary_tier(w) for w in c.where(decide.ns, tk)] == ["host"] * 2 + ["disk"] * 4
        measure(c.cost_model(), decide.ns.name, decide.block_bytes, disk_s=0.5)
        until("the backend's replica never got the daemon's model", lambda: replica_knows(decide, c, disk=True))
        assert always.batch_exists(ks) == 6
        assert decide.batch_exists(ks + keys(2, seed=52)) == 2
        assert decide.stats["hit_pages"] == 2 and decide.stats["declined_pages"] == 4
        # the ledger reaches the daemon with the replica's next exchange
        until("the declined tokens never reached the daemon's ledger",
              lambda: decide.lookup_link.cost_model() is not None
              and c.stats()["costs"]["ledger"]["disk"]["declined_tokens"] >= 4 * PAGE)
        # the probe read the declined pages (into host RAM, as any load does): now all load
        until("the disk was never probed", lambda: decide.load_link.stats.get("probes", 0) >= 1)
        assert decide.stats["probes"] == 1
        assert [primary_tier(w) for w in c.where(decide.ns, tk)] == ["host"] * 6
    assert decide.batch_exists(ks) == 6 and always.batch_exists(ks) == 6
    assert decide.batch_get_v1(ks, pages(96, 112, 128, 144, 160, 176)) == [True] * 6
    for src, dst in zip((0, 16, 32, 48, 64, 80), (96, 112, 128, 144, 160, 176)):
        assert torch.equal(pool.page(src), pool.page(dst))


def test_decide_reports_every_page_in_host_ram_and_loads_feed_the_model(daemon, models):
    """Pages in host RAM load far faster than they compute: all are reported, none declined.
    Their loads go in the model: the host tier's transfer estimate and the ledger's loaded
    tokens (the daemon's, after an exchange), through both the zero-copy and the generic calls;
    a load that took longer than computing its tokens was estimated to is a slow hit (the
    generic calls' namespace, measured to compute a token in a nanosecond)."""
    import tierd
    b = backend(MHATokenToKVPoolHost(seed=5), models[0], daemon.url, load_policy="decide")
    flat = backend(MHATokenToKVPoolHost(), models[0], daemon.url, v1=False, load_policy="decide")
    ks = keys(4, seed=61)
    assert b.batch_set_v1(ks, pages(0, 16, 32, 48)) == [True] * 4
    with tierd.connect(daemon.url) as c:
        measure(c.cost_model(), b.ns.name, b.block_bytes, disk_s=0.5, token_s=1e-3)
        measure(c.cost_model(), flat.ns.name, flat.block_bytes, token_s=1e-9)
        until("the backend's replica never got the daemon's model", lambda: replica_knows(b, c, disk=True))
        until("the generic backend's load link never connected", lambda: flat.load_link.get() is not None)
        until("the generic backend's load replica never got the daemon's model",
              lambda: flat.load_link.cost_model().has_recompute(flat.ns.name))
        prefix = SimpleNamespace(prefix_keys=keys(3, seed=62))          # (pages before these: 48 tokens)
        assert b.batch_exists(ks, prefix) == 4 and b.stats["declined_pages"] == 0
        assert b.batch_get_v1(ks, pages(64, 80, 96, 112), prefix) == [True] * 4
        vals = [torch.randn(flat.block_bytes // 4) for _ in range(2)]
        fk = keys(2, seed=63)
        assert flat.batch_set(fk, vals)
        outs = [torch.zeros_like(v) for v in vals]
        assert flat.batch_get(fk, outs) == outs and all(torch.equal(v, o) for v, o in zip(vals, outs))
        assert b.load_link.cost_model().transfers[("host", "load")].n >= 1
        assert b.stats["slow_hits"] == 0 and flat.stats["slow_hits"] == 1
        until("the loads never reached the daemon's ledger",
              lambda: b.load_link.cost_model() is not None and flat.load_link.cost_model() is not None
              and c.stats()["costs"]["ledger"]["host"]["loaded_tokens"] >= 6 * PAGE)
        ledger = c.stats()["costs"]["ledger"]["host"]
        assert ledger["loads"] >= 2 and ledger["slow_hits"] >= 1


def test_the_plugin_times_prefill_batches_for_every_backend(daemon, models):
    """The `run_batch` hook: a prefill batch (extend or mixed) that loads nothing from the host
    pool is timed into every backend's recompute estimate; decodes and batches with a host
    load are not; SGLang's own result and exceptions pass through, and a batch the hook cannot
    read never raises."""
    from tierd.connectors import sglang as ts
    b = backend(MHATokenToKVPoolHost(), models[0], daemon.url)
    until("the lookup link never connected", lambda: b.lookup_link.store is not None)
    sched = SimpleNamespace(device="cpu", enable_overlap=False)

    def batch(mode, extend=(64, 1), prefix=(0, 100), load=-1):
        return SimpleNamespace(forward_mode=SimpleNamespace(name=mode), extend_lens=list(extend),
                               prefix_lens=list(prefix), hicache_consumer_index=load)

    def forward(s, bt, *args, **kwargs):
        time.sleep(0.002)
        return ("result", args, kwargs)
    assert ts._run_batch_hook(forward, sched, batch("EXTEND"), 1, k=2) == ("result", (1,), {"k": 2})
    ts._run_batch_hook(forward, sched, batch("MIXED"))
    for skipped in (batch("DECODE"), batch("TARGET_VERIFY"), batch("EXTEND", load=0),
                    SimpleNamespace(forward_mode=None), batch("EXTEND", extend=(), prefix=())):
        assert ts._run_batch_hook(forward, sched, skipped)[0] == "result"
    broken = SimpleNamespace(forward_mode=SimpleNamespace(name="EXTEND"), extend_lens=None, prefix_lens=[0])
    assert ts._run_batch_hook(forward, sched, broken)[0] == "result"

    def failing(s, bt):
        raise ValueError("SGLang's own error")
    with pytest.raises(ValueError, match="SGLang's own error"):
        ts._run_batch_hook(failing, sched, batch("EXTEND"))
    import tierd
    with tierd.connect(daemon.url) as c:
        def measured():
            b.lookup_link.cost_model()        # (exchanges the replica with the daemon's when due)
            return c.stats()["costs"]["recompute"].get(b.ns.name, {}).get("measured", 0)
        until("the forwards never reached the daemon's model", lambda: measured() >= 2)
        time.sleep(0.6)
        assert measured() == 2                # the extend and the mixed batch (not the one that failed)


def test_the_plugin_times_gpu_forwards_by_events_read_once_passed(daemon, models, monkeypatch):
    """On a GPU a prefill batch is timed by a pair of CUDA events on the stream its forward runs
    on (the forward stream when the scheduler overlaps), read at a later batch once the end event
    has passed: never a synchronize. (Stand-in events: the test needs no GPU.)"""
    from tierd.connectors import sglang as ts

    class Event:
        made: list = []

        def __init__(self, enable_timing=False):
            self.passed, self.stream = False, "unrecorded"
            Event.made.append(self)

        def record(self, stream=None):
            self.stream = stream

        def query(self):
            return self.passed

        def elapsed_time(self, end):
            return 5.0                       # milliseconds

        def synchronize(self):
            raise AssertionError("a forward timing waited for the GPU")
    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(ts, "_forward_events", [])
    b = backend(MHATokenToKVPoolHost(), models[0], daemon.url)
    until("the lookup link never connected", lambda: b.lookup_link.store is not None)
    extend = SimpleNamespace(forward_mode=SimpleNamespace(name="EXTEND"), extend_lens=[32], prefix_lens=[16],
                             hicache_consumer_index=-1)
    decode = SimpleNamespace(forward_mode=SimpleNamespace(name="DECODE"))

    def forward(s, bt):
        return "result"
    overlap = SimpleNamespace(device="cuda", enable_overlap=True, forward_stream="forward stream")
    assert ts._run_batch_hook(forward, overlap, extend) == "result"
    assert [e.stream for e in Event.made] == ["forward stream"] * 2 and len(ts._forward_events) == 1
    assert ts._run_batch_hook(forward, overlap, decode) == "result" and len(ts._forward_events) == 1   # not passed
    for e in Event.made:
        e.passed = True
    plain = SimpleNamespace(device="cuda:0", enable_overlap=False)
    assert ts._run_batch_hook(forward, plain, extend) == "result"     # reads the first, times this one
    assert [e.stream for e in Event.made[2:]] == [None, None] and len(ts._forward_events) == 1
    fit = b.lookup_link.store.cost_model(sync=False).recompute.get(b.ns.name)
    assert fit is not None and fit.n >= 1
    for untimed in (SimpleNamespace(device="npu"), SimpleNamespace(device="cuda", enable_overlap=True)):
        assert ts._run_batch_hook(forward, untimed, extend) == "result"
    assert len(Event.made) == 4
