"""The `tierd` command against a real daemon; `tierd size` without one."""

import json
import subprocess
import sys
import time

import jsonschema
import pytest

import tierd
from tierd.client import Client

from .daemon import ROOT, DaemonProc
from .helpers import block_for, chain, make_ns, run_on_terminal


def tierd_cmd(*args, timeout=60):
    return subprocess.run([sys.executable, "-m", "tierd", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout, stdin=subprocess.DEVNULL)


def test_unreachable_daemon_is_one_line_and_nonzero(tmp_path):
    for cmd in ("ping", "stats", "sync"):
        r = tierd_cmd(cmd, "--socket", str(tmp_path / "nope.sock"))
        assert r.returncode == 1
        assert len(r.stderr.strip().splitlines()) == 1
        assert "cannot reach the tierd daemon" in r.stderr


def test_ping_stats_flush_sync(daemon):
    ns = make_ns()
    keys = chain(ns, 1, 6)
    with Client(daemon.socket) as c:
        c.put(ns, keys, [block_for(ns, k) for k in keys])
    r = tierd_cmd("ping", "--socket", daemon.socket)
    assert r.returncode == 0 and f"tierd {tierd.__version__} at" in r.stdout
    r = tierd_cmd("stats", "--socket", daemon.socket)
    assert r.returncode == 0
    assert "tier  capacity" in r.stdout and ns.name in r.stdout
    r = tierd_cmd("sync", "--socket", daemon.socket)
    assert r.returncode == 0 and "6 blocks written" in r.stdout
    r = tierd_cmd("flush", "--socket", daemon.socket, "--tier", "host", "--yes")
    assert r.returncode == 0 and "dropped 6 blocks" in r.stdout
    r = tierd_cmd("flush", "--socket", daemon.socket, "--namespace", "0000000000000000", "--yes")
    assert r.returncode == 1 and "unknown namespace" in r.stderr
    with Client(daemon.socket) as c:
        assert c.where(ns, keys) == ["disk"] * 6


def test_stats_json_matches_the_documented_schema(daemon):
    ns = make_ns()
    with Client(daemon.socket) as c:
        keys = chain(ns, 2, 3)
        c.put(ns, keys, [block_for(ns, k) for k in keys])
        c.get(ns, keys)
        c.stats()   # a get's hits may be reported after it returns (reads without a lease)
        r = tierd_cmd("stats", "--json", "--socket", daemon.socket)
    assert r.returncode == 0
    doc = json.loads(r.stdout)
    schema = json.loads((ROOT / "docs" / "stats.schema.json").read_text())
    jsonschema.validate(doc, schema)
    assert doc["namespaces"][ns.name]["hits"] == 3
    assert doc["daemon"]["clients"] >= 1


def test_metrics_endpoint_parses_and_counters_move(daemon):
    from urllib.request import urlopen

    from prometheus_client.parser import text_string_to_metric_families

    def scrape():
        text = urlopen(f"http://127.0.0.1:{daemon.metrics_port}/metrics", timeout=10).read().decode()
        out = {}
        for fam in text_string_to_metric_families(text):
            for s in fam.samples:
                out[(s.name, tuple(sorted(s.labels.items())))] = s.value
        return out

    ns = make_ns()
    before = scrape()
    with Client(daemon.socket) as c:
        keys = chain(ns, 3, 4)
        c.put(ns, keys, [block_for(ns, k) for k in keys])
        c.get(ns, keys)
        c.sync()
        after = scrape()
    label = (("namespace", ns.name),)
    assert after[("tierd_hits_total", label)] == 4
    assert after[("tierd_puts_total", label)] == 4
    assert after[("tierd_tier_used_bytes", (("tier", "host"),))] > before[("tierd_tier_used_bytes", (("tier", "host"),))]
    assert after[("tierd_block_moves_total", (("from_tier", "host"), ("to_tier", "disk")))] == 4
    ops = {dict(lbl).get("op"): v for (name, lbl), v in after.items()
           if name == "tierd_op_duration_seconds_count"}
    assert ops.get("sync", 0) >= 1
    # the get reached the daemon either as a lease (acquire) or, read without one from the
    # shared index, as the hits report that accounts it; which one depends on timing
    assert ops.get("acquire", 0) + ops.get("hits", 0) >= 1
    assert ("tierd_clients_connected", ()) in after
    # every metric the example alert rules use is exported (the remote tier's only with one:
    # tests/test_deploy_kubernetes.py checks those against a store that has one)
    import re
    rules = (ROOT / "systemd" / "prometheus-alerts.yml").read_text()
    names = {n for n, _ in after}
    for used in set(re.findall(r"\btierd_[a-z0-9_]+", rules)) - set(re.findall(r"\btierd_remote_[a-z0-9_]+", rules)):
        assert used in names, f"alert rule uses {used}, which the daemon does not export"


def test_size_plans_kv_memory_without_a_daemon(tmp_path):
    cfg = {"num_hidden_layers": 80, "num_attention_heads": 64, "num_key_value_heads": 8,
           "hidden_size": 8192, "torch_dtype": "bfloat16", "max_position_embeddings": 8192}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    r = tierd_cmd("size", "--model", str(tmp_path), "--batch", "32", "--host-bytes", "64GiB",
                  "--disk-bytes", "1TiB")
    assert r.returncode == 0, r.stderr
    per_token = 80 * 2 * 8 * 128 * 2  # 327,680 bytes: the Llama-3.1-70B figure
    assert f"= {per_token} (320KiB)" in r.stdout
    assert "GQA" in r.stdout
    assert "2.5GiB" in r.stdout          # one 8K request
    assert "80GiB" in r.stdout           # a batch of 32
    r = tierd_cmd("size", "--model", str(tmp_path), "--remote-bytes", "512GiB")
    assert r.returncode == 0, r.stderr
    remote = [ln for ln in r.stdout.splitlines() if ln.startswith("remote (shared)")]
    assert remote and "512GiB" in remote[0]
    blocks = int(remote[0].split()[3])   # 256-token blocks of 80 MiB, each with its header and overhead
    assert blocks == 512 * 2 ** 30 // (256 * per_token + 112 + 256)
    r = tierd_cmd("size", "--model", str(tmp_path / "missing"))
    assert r.returncode == 1 and "not found" in r.stderr


def test_sighup_reloads_policy_settings(tmp_path):
    d = DaemonProc(tmp_path).start()
    try:
        with Client(d.socket) as c:
            assert c.stats()["daemon"]["settings"]["disk.admit_min_hits"] == 0
            d.config.write_text(d.config.read_text() + "\n[policy]\n" if False else
                                d.config.read_text().replace("[disk]", "[disk]\nadmit_min_hits = 3"))
            d.signal(__import__("signal").SIGHUP)
            deadline = time.monotonic() + 10
            while c.stats()["daemon"]["reloads"] == 0 and time.monotonic() < deadline:
                time.sleep(0.05)
            st = c.stats()["daemon"]
            assert st["reloads"] == 1 and st["settings"]["disk.admit_min_hits"] == 3
            # a broken file is refused and the running settings stay
            d.config.write_text("this is [not toml")
            d.signal(__import__("signal").SIGHUP)
            time.sleep(0.5)
            assert d.alive() and c.stats()["daemon"]["settings"]["disk.admit_min_hits"] == 3
    finally:
        assert d.stop() == 0
    assert "reload refused" in d.log.read_text()


def test_sd_notify_ready_watchdog_stopping(tmp_path):
    import socket as _socket
    addr = str(tmp_path / "notify")
    sink = _socket.socket(_socket.AF_UNIX, _socket.SOCK_DGRAM)
    sink.bind(addr)
    sink.settimeout(10)
    d = DaemonProc(tmp_path, env={"NOTIFY_SOCKET": addr, "WATCHDOG_USEC": "200000"}).start()
    msgs = []
    try:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and sum("WATCHDOG=1" in m for m in msgs) < 2:
            msgs.append(sink.recv(4096).decode())
    finally:
        rc = d.stop()
    while True:
        try:
            sink.settimeout(1)
            msgs.append(sink.recv(4096).decode())
        except (TimeoutError, _socket.timeout):
            break
    sink.close()
    assert rc == 0
    text = "\n".join(msgs)
    assert "READY=1" in text and "STATUS=serving" in text
    assert text.count("WATCHDOG=1") >= 2
    assert "STOPPING=1" in text
    assert text.index("READY=1") < text.index("STOPPING=1")


def test_systemd_unit_passes_systemd_analyze_verify(tmp_path):
    import shutil
    tool = shutil.which("systemd-analyze")
    if tool is None:
        pytest.skip("systemd-analyze is not installed here")
    unit = (ROOT / "systemd" / "tierd.service").read_text()
    exe = shutil.which("tierd") or str(ROOT / ".venv" / "bin" / "tierd")
    # the unit runs the venv systemd/install.sh makes (test_systemd_install.py runs that install)
    (tmp_path / "tierd.service").write_text(unit.replace("/opt/tierd/bin/tierd", exe))
    r = subprocess.run([tool, "verify", str(tmp_path / "tierd.service")], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    for needed in ("Type=notify", "WatchdogSec=", "Restart=on-failure", "LimitMEMLOCK=infinity",
                   "RuntimeDirectory=", "StateDirectory=", "NoNewPrivileges=yes", "ProtectSystem=strict",
                   "ProtectHome=yes", "PrivateTmp=yes", "ReadWritePaths=", "User=tierd"):
        assert needed in unit


def test_example_config_loads(monkeypatch):
    from tierd.config import load_serve_config
    cfg = load_serve_config(str(ROOT / "systemd" / "tierd.toml"), env={})
    assert cfg.socket == "/run/tierd/tierd.sock" and cfg.store.eviction_policy == "s3fifo"
    assert cfg.sources["host.bytes"].startswith("file ")


def test_flush_asks_on_a_terminal_and_sync_shows_progress(daemon):
    ns = make_ns()
    keys = chain(ns, 8, 3)
    with Client(daemon.socket) as c:
        c.put(ns, keys, [block_for(ns, k) for k in keys])
    rc, out = run_on_terminal(["flush", "--socket", daemon.socket], answer=b"n\n")
    assert "[y/N]" in out and "nothing dropped" in out and rc == 1
    rc, out = run_on_terminal(["sync", "--socket", daemon.socket])
    assert rc == 0 and "sync [" in out and "3 blocks written" in out
    rc, out = run_on_terminal(["flush", "--socket", daemon.socket, "--tier", "host"], answer=b"y\n")
    assert rc == 0 and "dropped 3 blocks" in out
