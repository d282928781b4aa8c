"""The Grafana dashboard (deploy/grafana/tierd-dashboard.json) refers only to metrics the daemon
exports, with the labels it exports them with, and is well formed.

The names are checked against a real daemon's metrics endpoint, scraped over HTTP: a daemon
with its disk tier on, after a put, a get, a miss and a sync (so per-namespace counters and
the latency histogram have samples) and an engine's report of a measured forward pass (so the
cost model's recompute estimates have samples), and with a remote tier configured on a closed port, so
that the remote tier's metrics are exported too (the tier is degraded, which the daemon
reports through those very metrics; no Redis server is needed).
"""

from __future__ import annotations

import json
import re
import socket
from pathlib import Path
from urllib.request import urlopen

import pytest

from tierd.client import Client

from .daemon import SMALL_TOML, DaemonProc
from .helpers import block_for, make_ns

ROOT = Path(__file__).resolve().parent.parent
DASHBOARD = ROOT / "deploy" / "grafana" / "tierd-dashboard.json"

METRIC = re.compile(r"\btierd_[a-z0-9_]+")
# suffixes prometheus_client adds to a family's samples
HISTOGRAM_SUFFIXES = ("_bucket", "_sum", "_count")
COUNTER_SUFFIXES = ("_total", "_created")

# Labels an expression may use besides those the daemon puts on its metrics: Prometheus adds
# `instance` and `job` to every scraped series, and `le` is the histogram's bucket label.
SCRAPE_LABELS = {"instance", "job", "le"}

# Names exported only in some configurations, with the reason they may still be absent from
# the scrape. Empty: the daemon under test is configured so that every name appears.
CONFIG_DEPENDENT: dict[str, str] = {}


def family(name: str) -> str:
    """The metric family a sample name belongs to, as prometheus_client exposes them."""
    for suffix in HISTOGRAM_SUFFIXES + COUNTER_SUFFIXES:
        if name.endswith(suffix):
            return name[: -len(suffix)]
    return name


def load_dashboard(path: Path = DASHBOARD) -> dict:
    return json.loads(path.read_text())


def all_panels(dash: dict) -> list[dict]:
    """Every panel, those nested in collapsed rows included."""
    out = []
    for p in dash.get("panels", []):
        out.append(p)
        out.extend(p.get("panels", []) if p.get("type") == "row" else [])
    return out


def expressions(dash: dict) -> list[tuple[str, str, str]]:
    """(where, PromQL, legend) for every panel target and every query variable."""
    out = []
    for p in all_panels(dash):
        for t in p.get("targets", []):
            out.append((f"panel {p.get('id')} ({p.get('title')!r}) target {t.get('refId')}", t.get("expr", ""),
                        t.get("legendFormat") or ""))
    for v in dash.get("templating", {}).get("list", []):
        q = v.get("query")
        q = q.get("query", "") if isinstance(q, dict) else (q or "")
        if q:
            out.append((f"variable {v.get('name')}", q, ""))
    return out


def labels_used(expr: str) -> set[str]:
    """Label names an expression groups by or matches on."""
    names = set()
    for group in re.findall(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\(([^)]*)\)", expr):
        names.update(n.strip() for n in group.split(",") if n.strip())
    for matchers in re.findall(r"\{([^}]*)\}", expr):
        names.update(re.findall(r"([a-zA-Z_][a-zA-Z0-9_]*)\s*(?:=~|!~|!=|=)", matchers))
    # label_values(metric, label)
    names.update(re.findall(r"label_values\([^,]*,\s*([a-zA-Z_][a-zA-Z0-9_]*)\s*\)", expr))
    return names


def problems(dash: dict, samples: dict[str, set[str]]) -> list[str]:
    """What in the dashboard the exported metrics do not back. `samples` maps each exported
    sample name to the label names it carries."""
    families = {family(n) for n in samples}
    found = []
    for where, expr, legend in expressions(dash):
        names = set(METRIC.findall(expr))
        if not names:
            found.append(f"{where}: no tierd_* metric in {expr!r}")
        labels = set(SCRAPE_LABELS)
        for name in sorted(names):
            if name in CONFIG_DEPENDENT:
                continue
            if family(name) not in families:
                found.append(f"{where}: {name} is not a metric the daemon exports (family {family(name)!r})")
            elif name not in samples:
                found.append(f"{where}: {name} is not a series Prometheus stores (a family of that name is "
                             f"exported, as {sorted(n for n in samples if family(n) == family(name))})")
            else:
                labels |= samples[name]
        unknown = (labels_used(expr) | set(re.findall(r"\{\{\s*([a-zA-Z_][a-zA-Z0-9_]*)\s*\}\}", legend))) - labels
        if unknown and not (names & set(CONFIG_DEPENDENT)):
            found.append(f"{where}: labels {sorted(unknown)} are on none of {sorted(names)}")
    return found


def structure_problems(dash: dict) -> list[str]:
    found = []
    if not isinstance(dash.get("schemaVersion"), int) or dash["schemaVersion"] < 36:
        found.append(f"schemaVersion {dash.get('schemaVersion')!r}: expected a current one (>= 36)")
    inputs = {i.get("name"): i for i in dash.get("__inputs", [])}
    if inputs.get("DS_PROMETHEUS", {}).get("pluginId") != "prometheus":
        found.append("__inputs lacks the DS_PROMETHEUS datasource input")
    if not dash.get("title") or not dash.get("uid"):
        found.append("the dashboard needs a title and a uid")
    ids = [p.get("id") for p in all_panels(dash)]
    if any(not isinstance(i, int) for i in ids):
        found.append("every panel needs an integer id")
    dup = sorted({i for i in ids if ids.count(i) > 1 and isinstance(i, int)})
    if dup:
        found.append(f"panel ids {dup} are used twice")

    def ds_ok(ds) -> bool:
        return isinstance(ds, dict) and ds.get("type") == "prometheus" and ds.get("uid") == "${DS_PROMETHEUS}"

    for p in all_panels(dash):
        what = f"panel {p.get('id')} ({p.get('title')!r})"
        grid = p.get("gridPos", {})
        placed = all(isinstance(grid.get(k), int) for k in ("h", "w", "x", "y"))
        if not placed or grid["x"] + grid["w"] > 24:
            found.append(f"{what}: gridPos {grid} is not a place on the 24-column grid")
        if p.get("type") == "row":
            continue
        if not p.get("title"):
            found.append(f"{what}: no title")
        if not ds_ok(p.get("datasource")):
            found.append(f"{what}: datasource {p.get('datasource')!r} is not the ${{DS_PROMETHEUS}} input")
        targets = p.get("targets") or []
        if not targets:
            found.append(f"{what}: no targets")
        refs = [t.get("refId") for t in targets]
        if len(set(refs)) != len(refs) or not all(refs):
            found.append(f"{what}: target refIds {refs} are not unique")
        for t in targets:
            if not t.get("expr"):
                found.append(f"{what}: target {t.get('refId')} has no expr")
            if "datasource" in t and not ds_ok(t["datasource"]):
                found.append(f"{what}: target {t.get('refId')} names another datasource")
            if t.get("expr", "").count("(") != t.get("expr", "").count(")"):
                found.append(f"{what}: target {t.get('refId')}: unbalanced parentheses")
    for v in dash.get("templating", {}).get("list", []):
        if v.get("type") == "query" and not ds_ok(v.get("datasource")):
            found.append(f"variable {v.get('name')}: datasource is not the ${{DS_PROMETHEUS}} input")
    return found


def scrape(port: int) -> dict[str, set[str]]:
    from prometheus_client.parser import text_string_to_metric_families
    text = urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    samples: dict[str, set[str]] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            samples.setdefault(s.name, set()).update(s.labels)
    return samples


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]    # nothing listens on it once closed


@pytest.fixture(scope="module")
def exported(tmp_path_factory) -> dict[str, set[str]]:
    """Sample names (with their labels) a working daemon exports: disk tier on, a remote tier
    configured, traffic through every counter the dashboard reads."""
    pytest.importorskip("redis", reason="the remote tier needs the 'remote' extra (redis-py)")
    tmp = tmp_path_factory.mktemp("dashboard")
    toml = f'[remote]\nurl = "redis://127.0.0.1:{closed_port()}/0"\ntimeout_s = 0.2\n' + SMALL_TOML
    d = DaemonProc(tmp, toml=toml).start()
    try:
        ns = make_ns()
        keys = ns.block_keys(list(range(ns.block_tokens * 4)))
        with Client(d.socket) as c:
            assert c.put(ns, keys, [block_for(ns, k) for k in keys]) == 4
            assert len(c.get(ns, keys)) == 4
            missing = ns.block_keys(list(range(1, ns.block_tokens + 1)))
            assert c.get(ns, missing) == []
            c.sync()
            c.stats()    # hits of a get read without a lease are reported by then
            m = c.cost_model()     # an engine's forward pass, sent to the daemon's cost model
            m.observe_forward(ns.name, [(64, 0)], 0.01)
            c.cost_model(now=True)
            samples = scrape(d.metrics_port)
    finally:
        assert d.stop() == 0
    return samples


def test_dashboard_is_well_formed():
    dash = load_dashboard()
    found = structure_problems(dash)
    assert not found, "\n".join(found)
    assert len(expressions(dash)) >= 20


def test_every_metric_the_dashboard_uses_is_exported(exported):
    dash = load_dashboard()
    # the scrape really has what the dashboard is about (not an empty or foreign endpoint)
    for name in ("tierd_hits_total", "tierd_misses_total", "tierd_op_duration_seconds_bucket",
                 "tierd_namespace_info", "tierd_tier_used_bytes", "tierd_disk_degraded", "tierd_remote_degraded",
                 "tierd_slow_hits_total", "tierd_transfer_bandwidth_bytes_per_second",
                 "tierd_recompute_seconds_per_token"):
        assert name in exported, f"the daemon under test does not export {name}"
    found = problems(dash, exported)
    assert not found, "the dashboard uses what the daemon does not export:\n" + "\n".join(found)
    used = {family(n) for _, e, _ in expressions(dash) for n in METRIC.findall(e)}
    assert len(used) >= 40, sorted(used)


def test_a_misspelled_metric_or_label_is_caught(exported):
    """The check above fails on a dashboard that names a metric the daemon does not export, a
    family under a sample name Prometheus does not store, or a label the metric lacks."""
    text = DASHBOARD.read_text()
    for right, wrong, why in (("tierd_hits_total", "tierd_hit_total", "not a metric the daemon exports"),
                              ("tierd_evictions_total", "tierd_evictions", "not a series Prometheus stores"),
                              ("tierd_op_duration_seconds_bucket", "tierd_op_duration_bucket",
                               "not a metric the daemon exports")):
        assert right in text
        found = problems(json.loads(text.replace(right, wrong, 1)), exported)
        assert any(wrong in f and why in f for f in found), (wrong, found)
    mutated = json.loads(text.replace("sum by (instance, tier) (rate(tierd_evictions_total",
                                      "sum by (instance, tiers) (rate(tierd_evictions_total", 1))
    assert any("labels ['tiers']" in f for f in problems(mutated, exported))
    mutated = json.loads(text.replace('"{{model}} {{namespace}} hits"', '"{{modle}} {{namespace}} hits"', 1))
    assert any("labels ['modle']" in f for f in problems(mutated, exported))
    broken = json.loads(text)
    broken["panels"][2]["id"] = broken["panels"][1]["id"]
    broken["panels"][3].pop("datasource")
    found = structure_problems(broken)
    assert any("used twice" in f for f in found) and any("datasource" in f for f in found), found
