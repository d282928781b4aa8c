"""The cost model's ledger and estimates (tierd/costs.py) as a real daemon exports them: its
metrics endpoint, scraped over HTTP, before and after a client reported measurements; the same
numbers in `stats` (docs/stats.schema.json) and in `tierd stats`'s table."""

from __future__ import annotations

import json
from urllib.request import urlopen

import jsonschema
import pytest

from tierd.client import Client

from .daemon import ROOT, DaemonProc


def scrape(port: int) -> dict[tuple[str, tuple], float]:
    from prometheus_client.parser import text_string_to_metric_families
    text = urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def of(samples: dict, name: str) -> dict[tuple, float]:
    """The samples of `name`, by their labels."""
    return {labels: v for (n, labels), v in samples.items() if n == name}


MB = 1 << 20


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    d = DaemonProc(tmp_path_factory.mktemp("cost-metrics")).start()
    yield d
    assert d.stop() == 0


def test_the_ledger_and_the_estimates_are_exported_after_a_client_reports(daemon):
    before = scrape(daemon.metrics_port)
    # a fresh daemon (host RAM and a disk): its tiers' counters at 0, their estimates the seeds;
    # no recompute estimate; tiers it lacks (gpu, remote) not shown while nothing is counted there
    for name in ("tierd_loads_total", "tierd_load_tokens_total", "tierd_load_declined_tokens_total",
                 "tierd_load_abandoned_tokens_total", "tierd_slow_hits_total"):
        assert of(before, name) == {(("tier", "host"),): 0, (("tier", "disk"),): 0}, name
    measured = of(before, "tierd_transfer_measured")
    assert measured == {(("direction", d), ("tier", t)): 0 for t in ("host", "disk") for d in ("load", "store")}
    disk_load = (("direction", "load"), ("tier", "disk"))
    assert of(before, "tierd_transfer_bandwidth_bytes_per_second")[disk_load] == pytest.approx(1e9)   # the seed
    assert of(before, "tierd_transfer_latency_seconds")[disk_load] == pytest.approx(500e-6)
    assert not of(before, "tierd_recompute_seconds_per_token")

    with Client(daemon.socket) as c:
        m = c.cost_model()                  # the replica, synced once
        m.observe_transfer("disk", "load", MB, 0.25)
        m.observe_forward("e", [(64, 0)], 0.01)
        m.count("disk", slow_hits=1, loads=1, loaded_tokens=64)
        m.count("remote", declined_tokens=32)     # a tier this daemon lacks: shown once counted
        c.cost_model(now=True)              # sends what it measured
        st = c.stats()
    after = scrape(daemon.metrics_port)

    disk, remote = (("tier", "disk"),), (("tier", "remote"),)
    assert of(after, "tierd_loads_total")[disk] == 1
    assert of(after, "tierd_load_tokens_total")[disk] == 64
    assert of(after, "tierd_slow_hits_total")[disk] == 1
    assert of(after, "tierd_load_declined_tokens_total")[remote] == 32
    assert of(after, "tierd_load_abandoned_tokens_total")[remote] == 0
    assert of(after, "tierd_loads_total")[(("tier", "host"),)] == 0
    assert (("tier", "gpu"),) not in of(after, "tierd_loads_total")

    assert of(after, "tierd_transfer_measured")[disk_load] == 1
    assert of(after, "tierd_transfer_measured")[(("direction", "store"), ("tier", "disk"))] == 0
    lat = of(after, "tierd_transfer_latency_seconds")[disk_load]
    bw = of(after, "tierd_transfer_bandwidth_bytes_per_second")[disk_load]
    assert lat + MB / bw == pytest.approx(0.25)          # the one transfer measured, exactly
    assert bw == pytest.approx(MB / 0.2495)              # (one size: the seed's latency, the rest per byte)

    e = (("namespace", "e"),)
    fixed = of(after, "tierd_recompute_fixed_seconds")[e]
    per_token = of(after, "tierd_recompute_seconds_per_token")[e]
    per_context = of(after, "tierd_recompute_seconds_per_token_context")[e]
    assert min(fixed, per_token, per_context) >= 0
    assert fixed + 64 * per_token + 64 * 32 * per_context == pytest.approx(0.01, rel=1e-3)

    # the metrics are what `stats` shows, and `stats` is what its schema says
    costs = st["costs"]
    assert costs["ledger"]["disk"] == {"loads": 1, "loaded_tokens": 64, "declined_tokens": 0,
                                       "abandoned_tokens": 0, "slow_hits": 1}
    assert costs["transfers"]["disk/load"]["source"] == "measured"
    assert costs["transfers"]["disk/load"]["bandwidth_bytes_s"] == pytest.approx(bw)
    assert costs["recompute"]["e"]["per_token_s"] == pytest.approx(per_token)
    jsonschema.validate(st, json.loads((ROOT / "docs" / "stats.schema.json").read_text()))
    # and `tierd stats` shows them: a row per tier, a line per engine
    from tierd.report import format_stats
    text = format_stats(st)
    assert "slow hits" in text
    rows = {ln.split()[0]: ln for ln in text.splitlines() if "(seed)" in ln or "measured)" in ln}
    assert set(rows) == {"host", "disk", "remote"}, text
    assert "(1 measured)" in rows["disk"] and "(seed)" in rows["remote"]
    assert rows["disk"].split()[-5:] == ["1", "64", "0", "0", "1"]
    assert rows["remote"].split()[-5:] == ["0", "0", "32", "0", "0"]
    assert "recompute e: " in text and "1 forwards measured" in text


def test_stats_without_a_cost_model_export_no_cost_metrics():
    """Stats of a store from before the cost model (no "costs") export the rest as before."""
    from prometheus_client import generate_latest

    from tierd.metrics import Metrics
    st = {"tiers": {"host": {"capacity_bytes": 1, "used_bytes": 0, "blocks": 0, "waste_ratio": 0.0,
                             "evictions": 0, "bytes_in": 0, "bytes_out": 0}},
          "namespaces": {}, "leases": 0, "reservations": 0}
    text = generate_latest(Metrics(lambda: st).registry).decode()
    assert "tierd_tier_capacity_bytes" in text
    assert "tierd_slow_hits" not in text and "tierd_transfer_latency_seconds" not in text
