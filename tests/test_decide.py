"""Never slower than recompute (tierd/costs.py): the bundled engine loads a cached prefix only
while loading it is predicted to beat computing it. A disk tier whose reads take several
recomputes' time is declined after the first slow hit (tokens identical: the prefix is computed
instead), and loaded again once it heals; a head in host RAM is loaded while its slow tail is
computed. Embedded and through a real daemon. Timings are the benchmarks' (benchmarks.ttft
--slow-tier); here the decisions and the tokens are asserted."""

import random
import time

import pytest

pytest.importorskip("transformers")

from tierd import TieredStore  # noqa: E402
from tierd.engine import LLM, SamplingParams  # noqa: E402
from tierd.engine.random_model import write_random_model  # noqa: E402

from .daemon import DaemonProc  # noqa: E402

G = SamplingParams(temperature=0, max_tokens=4)
BT = 64                    # tier block tokens
N = 8 * BT + 1             # a prompt: 8 tier blocks and the last token


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_random_model(tmp_path_factory.mktemp("m") / "llama", seed=0)


def prompts(seed: int, n: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1, 500) for _ in range(N)] for _ in range(n)]


def engine(model_dir, store, **kw):
    kw.setdefault("kv_load_policy", "decide")
    return LLM(model_dir, kv_cache_bytes="16MiB", kv_store=store, kv_block_tokens=BT,
               enable_prefix_caching=False, **kw)


def store_all(model_dir, store, ps) -> tuple[list[list[int]], float]:
    """An engine computes and stores `ps`: (its tokens, the slowest prompt's seconds)."""
    llm = engine(model_dir, store)
    try:
        toks, worst = [], 0.0
        for p in ps:
            t0 = time.perf_counter()
            toks.append(llm.generate(prompt_token_ids=p, sampling_params=G)[0].outputs[0].token_ids)
            worst = max(worst, time.perf_counter() - t0)
        llm.connector.flush()
        return toks, worst
    finally:
        llm.close()


def ask(llm, p) -> tuple[list[int], int, list[str]]:
    out = llm.generate(prompt_token_ids=p, sampling_params=G)[0]
    return out.outputs[0].token_ids, out.metrics["tier_cached_tokens"], out.metrics["tier_sources"]


def disk_store(tmp_path, faults) -> TieredStore:
    """An embedded store whose disk reads `faults` can slow (its stall watch is set past the
    hang: a slow disk, not a stalled one)."""
    return TieredStore(host_bytes="64MiB", disk_path=str(tmp_path / "d"), disk_bytes="64MiB",
                       disk_slab_bytes="4MiB", disk_fault_file=str(faults), disk_stall_s=600)


def slow_then_healed(model_dir, store, faults, down, ps, cold):
    """Prompts on disk only, the disk's reads slowed to several recomputes: the first hit is
    slow (the model had not measured the disk), then the disk is declined; healed, it is
    loaded again within a few probes. Tokens identical to the cold run throughout."""
    _, recompute_s = store_all(model_dir, store, ps[:1])      # (a prompt's compute time, warm)
    faults.write_text(f"read=hang:{max(0.3, 4 * recompute_s):.3f}")
    llm = engine(model_dir, store)
    try:
        ledger = []
        for i in range(4):
            down()
            toks, tier, _ = ask(llm, ps[i])
            assert toks == cold[i]
            ledger.append(tier)
        st = llm.kv_connector_stats()
        assert ledger[0] > 0 and ledger[2:] == [0, 0], ledger        # loaded once, then declined
        assert st["slow_hits"] >= 1 and st["declined_tokens"] >= 2 * 8 * BT
        faults.write_text("")                                        # healed
        deadline, i, tier = time.monotonic() + 60, 4, 0
        while time.monotonic() < deadline:
            down()
            toks, tier, src = ask(llm, ps[i % len(ps)])
            assert toks == cold[i % len(ps)]
            if tier == 8 * BT and src == ["disk"]:
                break
            i += 1
            time.sleep(0.2)
        assert tier == 8 * BT, "a healed disk was never loaded from again"
        assert llm.kv_connector_stats()["probes"] >= 1
    finally:
        faults.write_text("")
        llm.close()


def test_embedded_a_slow_disk_is_declined_and_a_healed_one_loaded_again(model_dir, tmp_path):
    faults = tmp_path / "faults"
    store = disk_store(tmp_path, faults)
    try:
        ps = prompts(1, 8)
        cold, _ = store_all(model_dir, store, ps)

        def down():
            store.sync()
            store.flush(tier="host")
        slow_then_healed(model_dir, store, faults, down, ps, cold)
        ledger = store.stats()["costs"]["ledger"]["disk"]
        assert ledger["slow_hits"] >= 1 and ledger["declined_tokens"] > 0 and ledger["loaded_tokens"] > 0
    finally:
        store.close()


def test_through_a_daemon_a_slow_disk_is_declined_and_a_healed_one_loaded_again(model_dir, tmp_path):
    faults = tmp_path / "faults"
    d = DaemonProc(tmp_path, host_bytes="64MiB", disk_bytes="64MiB",
                   toml=f'[disk]\nslab_bytes = "4MiB"\nfile_bytes = "32MiB"\nfault_file = "{faults}"\n'
                        'stall_s = 600\n').start()
    url = d.url
    try:
        ps = prompts(2, 8)
        cold, _ = store_all(model_dir, url, ps)
        import tierd
        with tierd.connect(url) as ctl:
            def down():
                ctl.sync()
                ctl.flush(tier="host")
            slow_then_healed(model_dir, url, faults, down, ps, cold)
            st = ctl.stats()["costs"]
        assert st["ledger"]["disk"]["slow_hits"] >= 1 and st["ledger"]["disk"]["declined_tokens"] > 0
        assert st["transfers"]["disk/load"]["source"] == "measured"
        assert any(r["measured"] for r in st["recompute"].values())
    finally:
        faults.write_text("")
        assert d.stop() == 0


def test_a_head_in_host_ram_is_loaded_and_a_slow_tail_on_disk_computed(model_dir, tmp_path):
    faults = tmp_path / "faults"
    store = disk_store(tmp_path, faults)
    try:
        ps = prompts(3, 4)
        cold, recompute_s = store_all(model_dir, store, ps)
        faults.write_text(f"read=hang:{max(0.3, 4 * recompute_s):.3f}")
        m = store.cost_model()
        for _ in range(3):                          # the disk measured slow, as a first hit would
            m.observe_transfer("disk", "load", 4 * store.stats()["namespaces"].popitem()[1]["block_bytes"],
                               max(0.3, 4 * recompute_s))
        llm = engine(model_dir, store)
        try:
            for i, p in enumerate(ps):
                # the head (3 blocks) is read into host RAM, the tail (5 blocks) is left on disk
                store.sync()
                store.flush(tier="host")
                head_keys = llm.connector.tier_keys(type("S", (), {"tier_keys": [], "token_ids": p})(), 3)
                lease = store.acquire(llm.connector.ns, head_keys)
                lease.__exit__(None, None, None)
                toks, tier, src = ask(llm, p)
                assert toks == cold[i]
                assert tier == 3 * BT and src == ["host"], (tier, src)
            assert llm.kv_connector_stats()["declined_tokens"] >= 4 * 5 * BT
        finally:
            llm.close()
    finally:
        faults.write_text("")
        store.close()


def test_a_prefix_only_the_remote_tier_holds_is_loaded_from_it(model_dir, tmp_path):
    """`where` answers for this node's tiers; a block only the remote tier holds continues the
    found prefix (a lookup asks the remote tier), so node B's engine loads what node A's stored,
    from "remote", with A's tokens."""
    pytest.importorskip("redis")
    from .redis_servers import RedisServer
    from .test_remote import node
    server = RedisServer(tmp_path)
    try:
        a = node(server.url)
        try:
            ps = prompts(4, 1)
            cold, _ = store_all(model_dir, a, ps)
            deadline = time.monotonic() + 30
            while a.stats()["tiers"]["remote"]["queue"] and time.monotonic() < deadline:
                time.sleep(0.05)
        finally:
            a.close()
        b = node(server.url)
        try:
            llm = engine(model_dir, b, kv_load_policy="always")
            try:
                toks, tier, src = ask(llm, ps[0])
            finally:
                llm.close()
            assert toks == cold[0] and tier == 8 * BT and src == ["remote"], (tier, src)
        finally:
            b.close()
    finally:
        server.stop()
