"""What an operator meets at the edges: starts that cannot fit or cannot bind leave nothing
behind, commands on tiers that are not there refuse instead of pretending, `tierd clean` takes
only what no daemon holds, and stats and metrics say which model a namespace is."""

import json
import os
import re
import socket
import subprocess
import sys
import tomllib

import pytest

from tierd.client import Client
from tierd.errors import ConfigError

from .daemon import ROOT, DaemonProc
from .helpers import block_for, chain, make_ns


def tierd_cmd(*args, timeout=60, env=None):
    return subprocess.run([sys.executable, "-m", "tierd", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout, stdin=subprocess.DEVNULL, env={**os.environ, **(env or {})})


def serve(tmp_path, *args, env=None):
    (tmp_path / "run").mkdir(exist_ok=True)
    (tmp_path / "arena").mkdir(exist_ok=True)
    (tmp_path / "empty.toml").write_text("")
    return tierd_cmd("serve", "--config", str(tmp_path / "empty.toml"), "--socket", str(tmp_path / "run" / "t.sock"),
                     "--host-bytes", "8MiB", *args, env={"TIERD_ARENA_DIR": str(tmp_path / "arena"), **(env or {})})


def test_a_disk_tier_too_large_for_its_filesystem_is_refused_before_a_byte_is_written(tmp_path):
    """50 TiB asked on a small filesystem: one line naming the setting, exit 1, and nothing left:
    not the directory it would have made, not a slab file, not the host arena."""
    r = serve(tmp_path, "--disk-path", str(tmp_path / "cache" / "disk"), "--disk-bytes", "50TiB",
              "--metrics-addr", "")
    assert r.returncode == 1
    assert "cannot reserve 50.0TiB" in r.stderr and "--disk-bytes" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr
    assert not (tmp_path / "cache").exists(), "the directories the refused start made are gone"
    assert os.listdir(tmp_path / "arena") == []
    # a directory that was there stays, with what was in it, and gains nothing
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "keep.txt").write_text("operator's file")
    r = serve(tmp_path, "--disk-path", str(tmp_path / "mine"), "--disk-bytes", "50TiB", "--metrics-addr", "")
    assert r.returncode == 1
    assert sorted(os.listdir(tmp_path / "mine")) == ["keep.txt"]


def test_a_start_that_cannot_listen_names_the_setting_and_leaves_no_arena(tmp_path):
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    port = taken.getsockname()[1]
    try:
        r = serve(tmp_path, "--disk-path", str(tmp_path / "disk"), "--disk-bytes", "64MiB",
                  "--metrics-addr", f"127.0.0.1:{port}")
    finally:
        taken.close()
    assert r.returncode == 1
    line = r.stderr.strip().splitlines()[-1]
    assert "metrics_addr" in line and "--metrics-addr" in line and "in use" in line, r.stderr
    assert "Traceback" not in r.stderr
    assert os.listdir(tmp_path / "arena") == [], "a failed start leaves no arena"
    for bad in ("nonsense", "127.0.0.1:99999", "127.0.0.1:", "[::1:9464"):
        r = serve(tmp_path, "--metrics-addr", bad)
        assert r.returncode == 1, bad
        assert "metrics_addr" in r.stderr and "HOST:PORT" in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert os.listdir(tmp_path / "arena") == []


def test_commands_on_tiers_that_are_not_there_refuse(tmp_path):
    d = DaemonProc(tmp_path).start()   # host and disk tiers; no HBM tier, no remote tier
    try:
        ns = make_ns()
        keys = chain(ns, 3, 4)
        with Client(d.socket) as c:
            c.put(ns, keys, [block_for(ns, k) for k in keys])
            with pytest.raises(ConfigError, match="no remote tier"):
                c.flush(tier="remote")
        for tier in ("remote", "gpu"):
            r = tierd_cmd("flush", "--socket", d.socket, "--tier", tier, "--yes")
            assert r.returncode == 1 and f"no {tier} tier" in r.stderr, r.stderr
        r = tierd_cmd("sync", "--socket", d.socket, "--remote")
        assert r.returncode == 1 and "no remote tier" in r.stderr and "sent" not in r.stdout, (r.stdout, r.stderr)
        # flush asks first; with no terminal and no --yes it refuses and drops nothing
        r = tierd_cmd("flush", "--socket", d.socket, "--tier", "host")
        assert r.returncode == 2 and "--yes" in r.stderr, r.stderr
        with Client(d.socket) as c:
            assert c.where(ns, keys) == ["host"] * 4
    finally:
        assert d.stop() == 0
    (tmp_path / "b").mkdir()
    nodisk = DaemonProc(tmp_path / "b", env={"TIERD_DISK_PATH": ""})
    at = nodisk.args.index("--disk-path")
    del nodisk.args[at:at + 4]   # --disk-path D --disk-bytes S: no disk tier at all
    nodisk.start()
    try:
        r = tierd_cmd("flush", "--socket", nodisk.socket, "--tier", "disk", "--yes")
        assert r.returncode == 1 and "no disk tier" in r.stderr, r.stderr
    finally:
        assert nodisk.stop() == 0


def test_stats_and_metrics_name_the_model_and_never_show_a_salt(tmp_path):
    from urllib.request import urlopen

    from prometheus_client.parser import text_string_to_metric_families
    d = DaemonProc(tmp_path).start()
    try:
        ns = make_ns(cache_salt="tenant-secret-42").with_label("acme/llama-3-8b")
        plain = make_ns(model="other-model")
        with Client(d.socket) as c:
            for n in (ns, plain):
                keys = chain(n, 4, 2)
                c.put(n, keys, [block_for(n, k) for k in keys])
            st = c.stats()
        assert st["namespaces"][ns.name]["label"] == "acme/llama-3-8b"
        assert st["namespaces"][plain.name]["label"] == ""
        r = tierd_cmd("stats", "--socket", d.socket)
        row = next(ln for ln in r.stdout.splitlines() if ln.startswith(ns.name))
        assert "acme/llama-3-8b" in row and "(salt " in row
        r_json = tierd_cmd("stats", "--json", "--socket", d.socket)
        text = urlopen(f"http://127.0.0.1:{d.metrics_port}/metrics").read().decode()
        for out in (r.stdout, r_json.stdout, text):
            assert "tenant-secret-42" not in out, "a cache salt is never shown"
        info = {s.labels["namespace"]: s.labels for f in text_string_to_metric_families(text)
                if f.name == "tierd_namespace_info" for s in f.samples}
        assert info[ns.name]["model"] == "acme/llama-3-8b" and info[ns.name]["salt"]
        assert info[plain.name]["fingerprint"] == "other-model" and info[plain.name]["salt"] == ""
        assert info[ns.name]["salt"] in row
        # the label is display only: the same namespace without it is the same namespace
        assert make_ns(cache_salt="tenant-secret-42") == ns and make_ns(cache_salt="tenant-secret-42").id == ns.id
    finally:
        assert d.stop() == 0


def test_clean_removes_only_arenas_no_daemon_holds_and_a_stop_names_what_it_keeps(tmp_path):
    arena = tmp_path / "arena"
    d = DaemonProc(tmp_path).start()
    (tmp_path / "o").mkdir()
    other = DaemonProc(tmp_path / "o", env={"TIERD_ARENA_DIR": str(arena)})   # a second daemon, same
    other.start()                                                            # arena directory, running
    try:
        ns = make_ns()
        keys = chain(ns, 5, 3)
        with Client(d.socket) as c:
            c.put(ns, keys, [block_for(ns, k) for k in keys])
        r = tierd_cmd("clean", "--arena-dir", str(arena), "--yes")
        assert r.returncode == 0 and "removed" not in r.stdout, r.stdout   # both running: nothing to take
        assert d.stop() == 0
        kept = [ln for ln in d.log.read_text().splitlines() if "kept the host arena" in ln]
        assert kept and "3 blocks" in kept[0], d.log.read_text()[-2000:]
        files = sorted(os.listdir(arena))
        base = re.search(r"kept the host arena \S*/(tierd-\d+-[0-9a-f]+)\.host ", kept[0]).group(1)
        r = tierd_cmd("clean", "--arena-dir", str(arena), "--list")
        assert r.returncode == 0 and "not running" in r.stdout and "running process" in r.stdout, r.stdout
        r = tierd_cmd("clean", "--arena-dir", str(arena))   # no terminal, no --yes
        assert r.returncode == 2 and "--yes" in r.stderr
        assert sorted(os.listdir(arena)) == files
        r = tierd_cmd("clean", "--arena-dir", str(arena), "--yes")
        assert r.returncode == 0 and f"removed {arena / base}" in r.stdout, (r.stdout, r.stderr)
        left = os.listdir(arena)
        assert left and not any(f.startswith(base) for f in left), "the stopped daemon's arena is gone"
        with Client(other.socket) as c:   # the running daemon's arena was not touched
            c.put(ns, keys, [block_for(ns, k) for k in keys])
            assert c.get(ns, keys) is not None
            c.flush(tier="all")
    finally:
        if d.alive():
            d.stop()
        assert other.stop() == 0
    # a daemon that stops with an empty host tier (flushed) keeps no arena: an empty one is not
    # worth its memory
    assert not any(f.endswith(".host") for f in os.listdir(arena)), os.listdir(arena)


def test_the_cuda_extra_is_the_cuda_of_the_last_gpu_run():
    log = (ROOT / "benchmarks" / "results" / "gpu_check.log").read_text()
    cuda = re.search(r"^torch \S+ cuda (\d+)\.", log, re.M).group(1)
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert any(dep.startswith(f"cupy-cuda{cuda}x") for dep in extras["cuda"]), (cuda, extras["cuda"])
