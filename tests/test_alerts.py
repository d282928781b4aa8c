"""The alert rules under promtool: systemd/prometheus-alerts.yml and the Kubernetes PrometheusRule
(deploy/kubernetes/components/monitoring/prometheusrule.yaml, its spec.groups).

`promtool check rules` checks both copies; `promtool test rules` runs rule unit tests built here
from scenarios (input series -> the alerts expected at given times): healthy nodes, warmed up and
running as designed (host RAM full, the disk between its watermarks, evictions, a restart, a
rollout through a fleet), fire nothing; each failure fires its alert and no other. Every alert of
each copy is asserted, silent or firing, at every evaluation of every scenario, and every alert
fires in at least one scenario.

promtool is Debian's (`make promtool`, package prometheus). Without it these tests skip, or fail
where the deploy checks are part of the suite (TEST_REQUIRE_DEPLOY=1, as in CI).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from .test_deploy_kubernetes import load_yaml_all   # PyYAML here, or the deploy environment's

ROOT = Path(__file__).resolve().parent.parent
SYSTEMD_RULES = ROOT / "systemd" / "prometheus-alerts.yml"
KUBERNETES_RULES = ROOT / "deploy" / "kubernetes" / "components" / "monitoring" / "prometheusrule.yaml"
PROMTOOL = shutil.which("promtool")


def require_promtool() -> str:
    if PROMTOOL is None:
        if os.environ.get("TEST_REQUIRE_DEPLOY"):
            pytest.fail("promtool is part of this suite here, and it is missing (`make promtool` installs "
                        "Debian's prometheus package, which has it)")
        pytest.skip("no promtool (`make promtool` installs it)")
    return PROMTOOL


def groups_of(copy: str) -> list[dict]:
    if copy == "systemd":
        return load_yaml_all(SYSTEMD_RULES.read_text())[0]["groups"]
    return load_yaml_all(KUBERNETES_RULES.read_text())[0]["spec"]["groups"]


def rules_of(copy: str) -> dict[str, dict]:
    return {r["alert"]: r for g in groups_of(copy) for r in g["rules"]}


COPIES = ("systemd", "kubernetes")


@pytest.fixture(scope="module")
def rule_files(tmp_path_factory) -> dict[str, Path]:
    """Each copy as a Prometheus rule file: the systemd file as it is, the PrometheusRule's
    spec.groups extracted."""
    d = tmp_path_factory.mktemp("rules")
    k8s = d / "kubernetes-rules.yml"
    k8s.write_text(json.dumps({"groups": groups_of("kubernetes")}, indent=1))   # JSON is YAML
    return {"systemd": SYSTEMD_RULES, "kubernetes": k8s}


def promtool(*args, cwd=None) -> subprocess.CompletedProcess:
    return subprocess.run([require_promtool(), *args], capture_output=True, text=True, timeout=120, cwd=cwd)


@pytest.mark.parametrize("copy", COPIES)
def test_promtool_checks_the_rules(rule_files, copy):
    r = promtool("check", "rules", str(rule_files[copy]))
    assert r.returncode == 0, r.stdout + r.stderr
    n = len(rules_of(copy))
    assert f"SUCCESS: {n} rules found" in r.stdout, r.stdout


# -- scenarios ----------------------------------------------------------------------------------

NODE = {"instance": "node-a:9464", "job": "tierd"}
KSM = {"instance": "kube-state-metrics:8080", "job": "kube-state-metrics", "namespace": "tierd-system",
       "daemonset": "tierd"}
MINUTES = 180          # each scenario's series: 3 hours, a sample a minute
GB = 10 ** 9
HOST, DISK = 100 * GB, 1000 * GB


def series(name: str, labels: dict, values: str) -> tuple[str, str]:
    inner = ", ".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    return f"{name}{{{inner}}}", values


def fmt(v) -> str:
    """A sample value as promtool reads it (whole numbers without an exponent)."""
    return str(round(v)) if abs(v - round(v)) < 1e-6 else repr(float(v))


def const(v) -> str:
    return f"{fmt(v)}x{MINUTES}"


def counter(per_minute, start=0) -> str:
    return f"{fmt(start)}+{fmt(per_minute)}x{MINUTES}"


def steps(values: list, every: int) -> str:
    """A gauge that holds each of `values` for `every` minutes."""
    return " ".join(f"{fmt(v)}x{every - 1}" for v in values)


def healthy_node(**over) -> dict[str, str]:
    """A warmed-up node running as designed: host RAM full, the disk at 92% (between its
    watermarks), 15% of host RAM dirty, 10 puts/s with none dropped, 80% hits, evictions,
    records written (5 unrecorded long ago), the remote tier fine, engines loading from host
    RAM and the disk (1% of the disk's loads slow hits). `over`: series replaced (by key of
    this dict) or, with None, removed."""
    n = dict(NODE)
    s = dict([
        series("up", n, const(1)),
        series("tierd_tier_capacity_bytes", {**n, "tier": "host"}, const(HOST)),
        series("tierd_tier_capacity_bytes", {**n, "tier": "disk"}, const(DISK)),
        series("tierd_tier_used_bytes", {**n, "tier": "host"}, const(HOST)),
        series("tierd_tier_used_bytes", {**n, "tier": "disk"}, const(0.92 * DISK)),
        series("tierd_host_dirty_bytes", n, const(0.15 * HOST)),
        series("tierd_host_clean_bytes", n, const(0.85 * HOST)),
        series("tierd_disk_degraded", n, const(0)),
        series("tierd_disk_degraded_episodes_total", n, const(2)),
        series("tierd_disk_io_errors_total", n, const(0)),
        series("tierd_corrupt_blocks_total", {**n, "tier": "disk"}, const(0)),
        series("tierd_puts_total", {**n, "namespace": "0123456789abcdef"}, counter(600)),
        series("tierd_puts_dropped_total", {**n, "namespace": "0123456789abcdef"}, const(0)),
        series("tierd_hits_total", {**n, "namespace": "0123456789abcdef"}, counter(1200)),
        series("tierd_misses_total", {**n, "namespace": "0123456789abcdef"}, counter(300)),
        series("tierd_evictions_total", {**n, "tier": "host"}, counter(600)),
        series("tierd_evictions_total", {**n, "tier": "disk"}, counter(60)),
        series("tierd_host_unrecorded_total", n, const(5)),
        series("tierd_host_unrecorded_pending", n, const(0)),
        series("tierd_remote_degraded", n, const(0)),
        series("tierd_loads_total", {**n, "tier": "host"}, counter(1200)),
        series("tierd_loads_total", {**n, "tier": "disk"}, counter(600)),
        series("tierd_slow_hits_total", {**n, "tier": "host"}, const(0)),
        series("tierd_slow_hits_total", {**n, "tier": "disk"}, counter(6)),
        # kube-state-metrics: a DaemonSet of 3 nodes, all ready
        series("kube_daemonset_status_desired_number_scheduled", KSM, const(3)),
        series("kube_daemonset_status_number_ready", KSM, const(3)),
        series("kube_daemonset_status_updated_number_scheduled", KSM, const(3)),
    ])
    for key, values in over.items():
        k = KEY[key]
        if values is None:
            s.pop(k)
        else:
            assert k in s, k
            s[k] = values
    return s


# short names of the series above, for the scenarios' changes
KEY = {
    "up": series("up", NODE, "")[0],
    "host_used": series("tierd_tier_used_bytes", {**NODE, "tier": "host"}, "")[0],
    "disk_used": series("tierd_tier_used_bytes", {**NODE, "tier": "disk"}, "")[0],
    "disk_capacity": series("tierd_tier_capacity_bytes", {**NODE, "tier": "disk"}, "")[0],
    "dirty": series("tierd_host_dirty_bytes", NODE, "")[0],
    "clean": series("tierd_host_clean_bytes", NODE, "")[0],
    "disk_degraded": series("tierd_disk_degraded", NODE, "")[0],
    "episodes": series("tierd_disk_degraded_episodes_total", NODE, "")[0],
    "io_errors": series("tierd_disk_io_errors_total", NODE, "")[0],
    "corrupt": series("tierd_corrupt_blocks_total", {**NODE, "tier": "disk"}, "")[0],
    "puts": series("tierd_puts_total", {**NODE, "namespace": "0123456789abcdef"}, "")[0],
    "dropped": series("tierd_puts_dropped_total", {**NODE, "namespace": "0123456789abcdef"}, "")[0],
    "hits": series("tierd_hits_total", {**NODE, "namespace": "0123456789abcdef"}, "")[0],
    "misses": series("tierd_misses_total", {**NODE, "namespace": "0123456789abcdef"}, "")[0],
    "host_evictions": series("tierd_evictions_total", {**NODE, "tier": "host"}, "")[0],
    "disk_evictions": series("tierd_evictions_total", {**NODE, "tier": "disk"}, "")[0],
    "unrecorded": series("tierd_host_unrecorded_total", NODE, "")[0],
    "remote_degraded": series("tierd_remote_degraded", NODE, "")[0],
    "host_loads": series("tierd_loads_total", {**NODE, "tier": "host"}, "")[0],
    "disk_loads": series("tierd_loads_total", {**NODE, "tier": "disk"}, "")[0],
    "host_slow_hits": series("tierd_slow_hits_total", {**NODE, "tier": "host"}, "")[0],
    "disk_slow_hits": series("tierd_slow_hits_total", {**NODE, "tier": "disk"}, "")[0],
    "ds_desired": series("kube_daemonset_status_desired_number_scheduled", KSM, "")[0],
    "ds_ready": series("kube_daemonset_status_number_ready", KSM, "")[0],
    "ds_updated": series("kube_daemonset_status_updated_number_scheduled", KSM, "")[0],
}


@dataclass
class Scenario:
    name: str
    series: dict[str, str]
    fires: dict[str, list[dict]] = field(default_factory=dict)   # alert -> the labels of each firing alert
    at: tuple[int, ...] = (MINUTES,)                              # evaluation times, minutes
    kubernetes_only: bool = False


def _restart() -> dict:
    """The daemon restarts at minute 60: 3 minutes without a scrape target answering, counters
    from zero after, the disk at 95% (the stop wrote host RAM down, sync_on_stop)."""
    down = 3
    after = MINUTES - 60 - down
    gap = f"_x{down}"

    def ctr(per_minute):
        return f"0+{per_minute}x59 {gap} 0+{per_minute}x{after}"

    return dict(up=f"1x59 0x{down - 1} 1x{after + 1}", puts=ctr(600), hits=ctr(1200), misses=ctr(300),
                host_evictions=ctr(600), disk_evictions=ctr(60), host_loads=ctr(1200), disk_loads=ctr(600),
                host_slow_hits=f"0x59 {gap} 0x{after}", disk_slow_hits=ctr(6),
                disk_used=f"{fmt(0.92 * DISK)}x59 {gap} {fmt(0.95 * DISK)}x{after}",
                unrecorded=f"5x59 {gap} 0x{after}")


def _rollout(fleet: int, stuck_at: int | None = None) -> dict:
    """A rolling update through `fleet` nodes, one every 5 minutes: one node's pod not ready
    throughout; with `stuck_at`, no new pod after that many."""
    n = MINUTES // 5
    updated = [min(i, stuck_at if stuck_at is not None else fleet) for i in range(n)]
    return dict(ds_desired=const(fleet), ds_ready=const(fleet - 1), ds_updated=steps(updated, 5))


def _slow_spell(per_minute: int, start: int, minutes: int) -> str:
    """The disk's slow hits: 6 a minute (1% of its loads), and `per_minute` for `minutes` from
    minute `start`."""
    base = 6 * start
    return (f"0+6x{start} {fmt(base)}+{per_minute}x{minutes} "
            f"{fmt(base + per_minute * minutes)}+6x{MINUTES - start - minutes}")


HEALTHY_AT = (15, 45, 90, MINUTES)    # a healthy node: silent all along, not only at the end
SCENARIOS = [
    # -- healthy: nothing fires ---------------------------------------------------------------------
    Scenario("healthy-warm-node", healthy_node(), at=HEALTHY_AT),
    Scenario("healthy-disk-at-its-high-watermark", healthy_node(disk_used=const(0.95 * DISK)), at=HEALTHY_AT),
    Scenario("healthy-restart", healthy_node(**_restart()), at=(61, 62, 63, 64, 65, 90, MINUTES)),
    Scenario("healthy-no-disk-tier",   # host RAM only: every block dirty, by design
             healthy_node(dirty=const(HOST), clean=const(0), disk_degraded=None, episodes=None, io_errors=None,
                          corrupt=None, disk_used=None, disk_capacity=None, disk_evictions=None,
                          disk_loads=None, disk_slow_hits=None),
             at=HEALTHY_AT),
    Scenario("healthy-idle-below-high-watermark",   # nothing to evict: dirty blocks are not written ahead
             healthy_node(host_used=const(0.85 * HOST), dirty=const(0.85 * HOST), clean=const(0),
                          hits=const(0), misses=const(0), puts=const(0), host_evictions=const(0),
                          disk_evictions=const(0), host_loads=const(0), disk_loads=const(0),
                          host_slow_hits=const(0), disk_slow_hits=const(0)), at=HEALTHY_AT),
    # the disk slows down at minute 100: every load from it is a slow hit for 4 minutes, until
    # the estimate follows (far longer than the model takes, a load or two). Over 20% of the
    # 15-minute window for some minutes, not for 15
    Scenario("healthy-a-spell-of-slow-hits", healthy_node(disk_slow_hits=_slow_spell(600, 100, 4)),
             at=(101, 104, 108, 112, 116, 120, 125, MINUTES)),
    # a quiet node: 3 loads a minute from the disk, 2 of them slow: too few to tell
    Scenario("healthy-slow-hits-at-low-traffic", healthy_node(disk_loads=counter(3), disk_slow_hits=counter(2)),
             at=HEALTHY_AT),
    Scenario("healthy-rollout-through-a-large-fleet", healthy_node(**_rollout(200)), at=HEALTHY_AT,
             kubernetes_only=True),
    # -- failures: each fires its alert, and only it ------------------------------------------------
    Scenario("disk-above-high-watermark", healthy_node(disk_used=const(0.98 * DISK)),
             fires={"TierdDiskAboveHighWatermark": [{**NODE, "tier": "disk"}]}),
    Scenario("puts-dropped", healthy_node(dropped=counter(60)),
             fires={"TierdPutsDropped": [{"instance": NODE["instance"]}]}),
    Scenario("host-mostly-dirty", healthy_node(dirty=const(0.7 * HOST), clean=const(0.3 * HOST)),
             fires={"TierdHostMostlyDirty": [NODE]}),
    Scenario("host-unrecorded", healthy_node(unrecorded=counter(10, start=5)),
             fires={"TierdHostUnrecorded": [NODE]}),
    Scenario("remote-degraded", healthy_node(remote_degraded="0x119 1x60"),
             fires={"TierdRemoteTierDegraded": [NODE]}),
    Scenario("daemon-down", healthy_node(up="1x149 0x30"), fires={"TierdDown": [NODE]}),
    Scenario("no-target",   # the job is gone from the scrape config, or no pod has an address
             {**{k: v for k, v in healthy_node().items() if k.startswith("kube_")},
              series("up", {"instance": "node-a:9100", "job": "node"}, const(1))[0]: const(1)},
             fires={"TierdAbsent": [{"job": "tierd"}]}),
    Scenario("disk-degraded",   # host RAM fills with dirty blocks meanwhile: that is the disk's alert
             healthy_node(disk_degraded="0x119 1x60", episodes="2x119 3x60",
                          dirty=f"{fmt(0.15 * HOST)}x119 {fmt(0.8 * HOST)}x60",
                          clean=f"{fmt(0.85 * HOST)}x119 {fmt(0.2 * HOST)}x60"),
             fires={"TierdDiskTierDegraded": [NODE]}),
    Scenario("disk-flapping", healthy_node(episodes=steps(list(range(2, 2 + MINUTES // 10)), 10)),
             fires={"TierdDiskTierFlapping": [NODE]}),
    Scenario("disk-io-errors", healthy_node(io_errors=counter(1)), fires={"TierdDiskErrors": [NODE]}),
    Scenario("slow-hits-persist",   # from minute 120, half the disk's loads slower than recomputing
             healthy_node(disk_slow_hits=f"0+6x119 {fmt(6 * 119)}+300x60"),
             fires={"TierdSlowHits": [{"instance": NODE["instance"], "tier": "disk"}]}, at=(145, 160, MINUTES)),
    Scenario("low-hit-rate", healthy_node(hits=counter(300), misses=counter(1200)),
             fires={"TierdLowHitRate": [{"instance": NODE["instance"]}]}),
    Scenario("eviction-thrashing", healthy_node(host_evictions=counter(120_000)),
             fires={"TierdHighEvictionRate": [{"instance": NODE["instance"], "tier": "host"}]}),
    Scenario("daemonset-pod-pending", healthy_node(ds_ready=const(2)),
             fires={"TierdDaemonSetNotReady": [KSM]}, kubernetes_only=True),
    Scenario("daemonset-rollout-stuck", healthy_node(**_rollout(200, stuck_at=12)),
             fires={"TierdDaemonSetNotReady": [KSM]}, kubernetes_only=True),
    Scenario("no-kube-state-metrics", healthy_node(ds_desired=None, ds_ready=None, ds_updated=None),
             fires={"TierdDaemonSetUnobserved": [{"namespace": "tierd-system", "daemonset": "tierd"}]},
             kubernetes_only=True),
]


def render(template: str, labels: dict) -> str:
    """An annotation as Prometheus expands it (the rules use only `{{ $labels.NAME }}`)."""
    out = re.sub(r"\{\{ \$labels\.(\w+) \}\}", lambda m: labels.get(m[1], ""), template)
    assert "{{" not in out, f"a template this test cannot expand: {template}"
    return out


def unit_test(scenario: Scenario, rules: dict[str, dict]) -> dict:
    """promtool's test group for `scenario`: every alert of `rules` asserted at every time."""
    unknown = set(scenario.fires) - set(rules)
    assert not unknown, f"{scenario.name}: no such alert {unknown}"
    checks = []
    for minute in scenario.at:
        for name, rule in rules.items():
            exp = []
            for labels in scenario.fires.get(name, []):
                exp.append({"exp_labels": {**labels, **rule.get("labels", {})},
                            "exp_annotations": {k: render(v, labels) for k, v in rule.get("annotations", {}).items()}})
            checks.append({"eval_time": f"{minute}m", "alertname": name, "exp_alerts": exp})
    return {"interval": "1m", "name": scenario.name,
            "input_series": [{"series": k, "values": v} for k, v in scenario.series.items()],
            "alert_rule_test": checks}


def _cases():
    for copy in COPIES:
        for s in SCENARIOS:
            if copy == "kubernetes" or not s.kubernetes_only:
                yield pytest.param(copy, s, id=f"{copy}-{s.name}")


@pytest.mark.parametrize("copy,scenario", list(_cases()))
def test_rule_unit_tests(rule_files, tmp_path, copy, scenario):
    rules = rules_of(copy)
    test = {"rule_files": [str(rule_files[copy])], "evaluation_interval": "1m",
            "tests": [unit_test(scenario, rules)]}
    f = tmp_path / f"{scenario.name}.test.yml"
    f.write_text(json.dumps(test, indent=1))   # JSON is YAML
    r = promtool("test", "rules", str(f), cwd=tmp_path)
    assert r.returncode == 0, f"{scenario.name} ({copy} rules):\n{r.stdout}{r.stderr}"


@pytest.mark.parametrize("copy", COPIES)
def test_every_alert_fires_in_some_scenario(copy):
    rules = rules_of(copy)
    fired = {a for s in SCENARIOS if copy == "kubernetes" or not s.kubernetes_only for a in s.fires}
    assert fired == set(rules), f"alerts no scenario fires: {sorted(set(rules) - fired)}"
    # and the healthy nodes fire nothing (the scenarios named so assert it for every alert)
    assert any(not s.fires for s in SCENARIOS)


def test_only_the_kubernetes_group_reads_kube_state_metrics():
    """The shared group reads tierd's own series (tests/test_deploy_kubernetes.py checks each
    against the exporter) and `up`; kube-state-metrics' series only in the Kubernetes-only group,
    and only the DaemonSet series these rules were written against."""
    shared = {g["name"] for g in groups_of("systemd")}
    for g in groups_of("kubernetes"):
        used = {m for r in g["rules"] for m in re.findall(r"\bkube_[a-z_]+", r["expr"])}
        if g["name"] in shared:
            assert not used, (g["name"], used)
        else:
            assert used and used <= {"kube_daemonset_status_desired_number_scheduled",
                                     "kube_daemonset_status_number_ready",
                                     "kube_daemonset_status_updated_number_scheduled"}, used
