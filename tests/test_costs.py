"""The cost model (tierd/costs.py): transfer and recompute fits follow what is measured, the
decision loads exactly the prefix that wins, and a daemon's model is what its clients measured."""

import math
import random

import pytest

from tierd import costs as C
from tierd.client import Client
from tierd.costs import CostModel, RecomputeFit, TransferFit

from .daemon import DaemonProc


def test_a_transfer_fit_recovers_latency_and_bandwidth():
    fit = TransferFit(C.SEED["disk"])
    rng = random.Random(1)
    for _ in range(40):
        n = rng.choice([64 << 10, 256 << 10, 1 << 20, 4 << 20])
        fit.add(n, 1e-3 + n / 2e9)
    lat, per_byte = fit.coef()
    assert lat == pytest.approx(1e-3, rel=1e-3)
    assert 1 / per_byte == pytest.approx(2e9, rel=1e-3)


def test_a_tier_that_slows_down_shows_within_two_transfers_and_so_does_its_recovery():
    fit = TransferFit(C.SEED["disk"])
    for _ in range(30):
        fit.add(1 << 20, 1e-3)                      # healthy: 1 ms a MiB
    for _ in range(2):
        fit.add(1 << 20, 50e-3)                     # a stalling disk: 50 ms
    assert fit.predict(1 << 20) > 30e-3
    for _ in range(2):
        fit.add(1 << 20, 1e-3)                      # healed
    assert fit.predict(1 << 20) < 15e-3
    for _ in range(3):
        fit.add(1 << 20, 1e-3)
    assert fit.predict(1 << 20) < 3e-3


def test_one_transfer_far_off_the_estimate_restarts_the_fit():
    """A disk that stalls (5 s a MiB) after a hundred healthy reads, then heals: one transfer
    each way is enough for the estimate to follow."""
    fit = TransferFit(C.SEED["disk"])
    for _ in range(100):
        fit.add(1 << 20, 1e-3)
    fit.add(1 << 20, 5.0)
    assert fit.predict(1 << 20) == pytest.approx(5.0, rel=0.01)
    fit.add(1 << 20, 1e-3)
    assert fit.predict(1 << 20) == pytest.approx(1e-3, rel=0.01)


def test_an_unmeasured_tier_uses_its_seed():
    fit = TransferFit((1e-3, 1e9))
    assert fit.predict(1e9) == pytest.approx(1.001)
    assert fit.describe()["source"] == "seed"


def test_the_recompute_fit_recovers_its_terms_and_never_goes_negative():
    fit = RecomputeFit()
    rng = random.Random(2)
    a, b, c = 2e-3, 50e-6, 1e-8
    for _ in range(60):
        batch = [(rng.randrange(1, 2048), rng.randrange(0, 4096)) for _ in range(rng.randrange(1, 4))]
        n, q = C.forward_terms(batch)
        fit.add(n, q, a + b * n + c * q)
    got = fit.coef()
    assert got == pytest.approx((a, b, c), rel=1e-3)
    # a model whose measurements say "no fixed cost" fits none (never a negative one)
    neg = RecomputeFit()
    for n in (16, 64, 256, 1024):
        neg.add(n, n * n / 2, 1e-5 * n)
    assert all(v >= 0 for v in neg.coef())
    assert neg.saving(0, 512) == pytest.approx(512e-5, rel=1e-3)


def model_with(per_token_s: float, tiers: dict[str, tuple[float, float]]) -> CostModel:
    """A model whose recompute costs `per_token_s` a token and whose tiers cost (latency,
    seconds per byte) as given, measured."""
    m = CostModel()
    for n in (16, 64, 256, 1024):
        m.observe_forward("e", [(n, 0)], per_token_s * n)
    for t, (lat, per_byte) in tiers.items():
        for nbytes in (1 << 16, 1 << 18, 1 << 20, 1 << 22):
            m.observe_transfer(t, "load", nbytes, lat + per_byte * nbytes)
    return m


BT, BB = 16, 1 << 16       # 16 tokens and 64 KiB a block


def test_a_fast_tier_is_loaded_whole_and_a_slow_one_not_at_all():
    fast = model_with(1e-4, {"host": (1e-5, 1e-10)})            # a block: 1.6 ms to compute, 17 us to load
    p = fast.plan("e", ["host"] * 8, BB, BT)
    assert (p.found, p.blocks, p.reason) == (8, 8, "model")
    assert p.load_s < p.recompute_s and math.isfinite(p.deadline_s) and p.deadline_s > p.load_s
    slow = model_with(1e-4, {"disk": (1e-3, 1e-7)})             # a block: 7.5 ms to load
    p = slow.plan("e", ["disk"] * 8, BB, BT)
    assert p.blocks == 0 and p.declined() == {"disk": 8}


def test_a_head_in_host_ram_is_loaded_and_a_slow_tail_computed():
    m = model_with(1e-4, {"host": (1e-5, 1e-10), "disk": (1e-3, 1e-7)})
    p = m.plan("e", ["host"] * 5 + ["disk"] * 3 + [""] + ["host"], BB, BT)
    assert p.found == 8                              # the found prefix ends at the first absent block
    assert p.blocks == 5 and p.declined() == {"disk": 3}
    assert p.runs() == [("host", 0, 5)]
    assert p.probe == 5                              # the first declined block re-measures the disk ...
    keys = [bytes([i]) * 16 for i in range(8)]
    assert p.probe_run(keys) == ("disk", keys[5:8]) and p.probe_run(keys, most=2) == ("disk", keys[5:7])
    assert m.plan("e", ["host"] * 5 + ["disk"] * 3, BB, BT).probe == -1   # ... once a period


def test_without_a_recompute_estimate_everything_found_is_loaded():
    m = CostModel()
    p = m.plan("e", ["disk"] * 4, BB, BT)
    assert (p.blocks, p.reason) == (4, "unmeasured") and p.deadline_s == math.inf


def test_usable_tokens_cap_what_a_load_saves():
    m = model_with(1e-4, {"host": (0.0, 1.2e-9)})               # a block: 1.6 ms computed, 79 us loaded
    p = m.plan("e", ["host"] * 4, BB, BT, usable_tokens=3 * BT)
    assert p.blocks == 3                              # the 4th block saves nothing: its tokens are computed anyway


def test_a_daemon_model_is_what_its_clients_measured(tmp_path):
    d = DaemonProc(tmp_path).start()
    try:
        with Client(d.socket, name="a") as a, Client(d.socket, name="b") as b:
            ma = a.cost_model()
            for n in (16, 64, 256):
                ma.observe_forward("engine-a", [(n, 0)], 1e-4 * n)
            ma.observe_transfer("disk", "load", 1 << 20, 0.25)
            ma.count("disk", loads=1, loaded_tokens=64, slow_hits=1)
            a.cost_model(now=True)                    # sent
            mb = b.cost_model()                       # another engine on the node sees it
            assert mb.has_recompute("engine-a")
            assert mb.transfers[("disk", "load")].predict(1 << 20) == pytest.approx(0.25, rel=0.05)
            st = a.stats()["costs"]
            assert st["ledger"]["disk"]["slow_hits"] == 1 and st["ledger"]["disk"]["loaded_tokens"] == 64
            assert st["recompute"]["engine-a"]["per_token_s"] == pytest.approx(1e-4, rel=1e-3)
            assert st["transfers"]["disk/load"]["source"] == "measured"
            # a report a client would never send is refused, or its bad rows skipped
            from tierd import protocol as P
            with pytest.raises(P.RemoteError):
                a._call("costs", report={"transfers": "x"})
            a._call("costs", report={"transfers": [["disk", "load", "x", 1.0]], "forwards": [[1, 2, 3, "y"]],
                                     "ledger": {"disk": {"slow_hits": -5, "nope": 1}}})
            assert a.stats()["costs"]["ledger"]["disk"]["slow_hits"] == 1
    finally:
        assert d.stop() == 0


def test_what_a_replica_measures_during_an_exchange_counts_at_once_and_is_sent_with_the_next():
    """The exchange takes the replica's report, and the daemon's state comes back a round trip
    later: a slow load measured in between must not vanish from the replica until the next
    exchange (a plan there would load from a tier its own engine just found slow)."""
    node, m = CostModel(), CostModel(replica=True)
    for _ in range(8):
        m.observe_transfer("disk", "load", 1 << 20, 1e-3)
    m.count("disk", loads=8)
    report = m.take_outbox()                          # the exchange starts ...
    m.observe_transfer("disk", "load", 1 << 20, 0.5)  # ... a load finds the disk slow ...
    m.count("disk", loads=1, slow_hits=1)
    node.merge_report(report)
    m.adopt(node.state())                             # ... and the daemon's state arrives
    assert m.transfers[("disk", "load")].predict(1 << 20) > 0.1
    assert m.ledger["disk"]["loads"] == 9 and m.ledger["disk"]["slow_hits"] == 1
    node.merge_report(m.take_outbox())                # the next exchange sends it, once
    m.adopt(node.state())
    assert node.ledger["disk"]["loads"] == 9 and m.ledger["disk"]["loads"] == 9
    assert node.transfers[("disk", "load")].n == m.transfers[("disk", "load")].n == 9


def test_only_a_replica_keeps_what_it_measured_for_the_daemon():
    """A client's replica keeps its measurements until they are sent; a store's own model (an
    embedded engine's, the daemon's) has no one to send them to and keeps none: a long-running
    engine measures every forward and load, and nothing may pile up for that."""
    from tierd import TieredStore
    store = TieredStore(host_bytes=16 << 20)
    try:
        for m, kept in ((store.costs, 0), (CostModel(replica=True), 1000)):
            for i in range(1000):
                m.observe_forward("e", [(16 + i % 7, 0)], 1e-3)
                m.observe_transfer("host", "load", 1 << 20, 1e-4)
            m.count("host", loads=3)
            out = m.take_outbox()
            assert len(out["forwards"]) == len(out["transfers"]) == kept
            assert out["ledger"] == ({"host": {"loads": 3}} if kept else {})
            assert m.has_recompute("e") and m.ledger["host"]["loads"] == 3   # measured either way
    finally:
        store.close()
