"""`tierd` misused (issue 52, item 5): every mistake ends in one line on stderr, `tierd COMMAND:
…`, with exit status 2 for an argument and 1 for anything else, never a traceback; a reader of
stdout that stops early ends the command quietly; a start that fails leaves no tier behind.

Each case runs the real command line (`python -m tierd`) in a subprocess, as tests/test_cli.py
does. The permission cases need another user: run as root, the command drops to uid 65534
(nobody) once its modules are imported (the interpreter itself may live where nobody may not
read it, as under /root), then runs `tierd.cli.main`; elsewhere they are skipped.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from .daemon import ROOT

NOBODY = 65534


def tierd_cmd(*args, env: dict | None = None, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tierd", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout, stdin=subprocess.DEVNULL, env=env)


def one_line(r: subprocess.CompletedProcess, status: int, *words: str) -> str:
    """The command exited `status` with exactly one line on stderr, holding every one of
    `words`, and no traceback anywhere."""
    assert "Traceback" not in r.stderr and "Traceback" not in r.stdout, r.stderr
    assert r.returncode == status, (r.returncode, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    for w in words:
        assert w in lines[0], (w, lines[0])
    return lines[0]


@pytest.fixture
def model(tmp_path) -> Path:
    d = tmp_path / "model"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({
        "num_hidden_layers": 2, "num_attention_heads": 4, "hidden_size": 64, "torch_dtype": "float16",
        "max_position_embeddings": 1024}))
    return d


@pytest.fixture
def serve_args(tmp_path):
    """`tierd serve` in tmp_path: its settings file (so that no /etc/tierd/tierd.toml of this
    machine is read), its arena directory, disk path and socket; logging quiet but for errors."""
    (tmp_path / "tierd.toml").write_text("[host]\nslab_bytes = \"1MiB\"\n[disk]\nslab_bytes = \"4MiB\"\n")
    (tmp_path / "arena").mkdir()
    env = {**os.environ, "TIERD_ARENA_DIR": str(tmp_path / "arena")}
    env.pop("TIERD_SOCKET", None)
    args = ["--config", str(tmp_path / "tierd.toml"), "--host-bytes", "8MiB", "--disk-bytes", "64MiB",
            "--disk-path", str(tmp_path / "disk"), "--log-level", "error"]
    return args, env


def nothing_made(tmp_path: Path) -> None:
    """No tier of a failed start is left: no disk directory, nothing in the arena directory."""
    assert not (tmp_path / "disk").exists(), sorted((tmp_path / "disk").iterdir())
    assert sorted((tmp_path / "arena").iterdir()) == []


# -- arguments: checked by the parser, one line, exit 2 ------------------------------------------

@pytest.mark.parametrize("args, option", [
    (["--block-tokens", "0"], "--block-tokens"),        # was: ZeroDivisionError
    (["--block-tokens", "-256"], "--block-tokens"),     # was: negative block counts
    (["--max-seq-len", "-5"], "--max-seq-len"),         # was: "full requests -30,310.4"
    (["--max-seq-len", "0"], "--max-seq-len"),
    (["--batch", "0"], "--batch"),
    (["--batch", "-2"], "--batch"),
    (["--batch", "many"], "--batch"),
    (["--tp", "0"], "--tp"),
    (["--host-bytes", "0"], "--host-bytes"),            # was: "host (default: none)"
    (["--host-bytes", "0%"], "--host-bytes"),
    (["--disk-bytes", "lots"], "--disk-bytes"),
    (["--remote-bytes", "0"], "--remote-bytes"),
    (["--remote-bytes", "5%"], "--remote-bytes"),
])
def test_size_refuses_numbers_that_mean_nothing(model, args, option):
    r = tierd_cmd("size", "--model", str(model), *args)
    one_line(r, 2, "tierd size:", f"argument {option}:", repr(args[1]))
    assert r.stdout == ""


def test_size_still_plans_with_good_numbers(model):
    r = tierd_cmd("size", "--model", str(model), "--batch", "4", "--block-tokens", "16", "--max-seq-len", "512",
                  "--host-bytes", "10%", "--disk-bytes", "1GiB", "--remote-bytes", "1GiB", "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["batch"] == 4 and out["block_tokens"] == 16 and out["max_seq_len"] == 512
    assert [t["tier"] for t in out["tiers"]] == ["host", "disk", "remote"]


@pytest.mark.parametrize("args, option", [
    (["--watch", "-1"], "--watch"),      # was: printed once, then "sleep length must be non-negative"
    (["--watch", "0"], "--watch"),       # (a loop with no pause)
    (["--watch", "nan"], "--watch"),
    (["--watch", "soon"], "--watch"),
    (["--timeout", "0"], "--timeout"),
])
def test_stats_refuses_a_watch_or_timeout_that_is_no_time(tmp_path, args, option):
    r = tierd_cmd("stats", "--socket", str(tmp_path / "t.sock"), *args)
    one_line(r, 2, "tierd stats:", f"argument {option}:")


@pytest.mark.parametrize("args, option", [
    (["--host-bytes", "0"], "--host-bytes"),
    (["--host-bytes", "1KiB"], "--host-bytes"),
    (["--disk-bytes", "0"], "--disk-bytes"),
    (["--socket", ""], "--socket"),
])
def test_serve_refuses_bad_arguments_before_making_anything(tmp_path, serve_args, args, option):
    base, env = serve_args
    r = tierd_cmd("serve", *base, "--socket", str(tmp_path / "run" / "t.sock"), *args, env=env)
    one_line(r, 2, "tierd serve:", f"argument {option}:")
    nothing_made(tmp_path)
    assert not (tmp_path / "run").exists()


def test_no_command_and_unknown_options_are_one_line(tmp_path):
    one_line(tierd_cmd(), 2, "tierd:", "command")
    one_line(tierd_cmd("ping", "--sockett", "x"), 2, "tierd ping:", "--sockett")
    one_line(tierd_cmd("flush", "--tier", "ssd", "--socket", str(tmp_path / "t.sock")), 2, "--tier", "'ssd'")


def test_small_tiers_in_a_config_file_are_refused_before_anything_is_made(tmp_path, serve_args):
    """The minimum sizes of the tiers are settings' checks: a config file's too, not only flags."""
    base, env = serve_args
    (tmp_path / "small.toml").write_text('[disk]\nbytes = "1KiB"\n')
    args = [a if a != str(tmp_path / "tierd.toml") else str(tmp_path / "small.toml") for a in base]
    args = [a for a in args if a not in ("--disk-bytes", "64MiB")]
    r = tierd_cmd("serve", *args, "--socket", str(tmp_path / "run" / "t.sock"), "--metrics-addr", "", env=env)
    one_line(r, 1, "tierd serve:", "disk_bytes", "12 KiB minimum")
    nothing_made(tmp_path)


# -- socket paths ----------------------------------------------------------------------------------

def long_socket(tmp_path: Path) -> str:
    path = str(tmp_path / ("d" * 120) / "tierd.sock")
    assert len(path.encode()) > 108
    return path


def test_a_socket_path_over_the_limit_is_refused_with_the_limit_and_its_length(tmp_path, serve_args):
    base, env = serve_args
    path = long_socket(tmp_path)
    n = len(path.encode())
    r = tierd_cmd("serve", *base, "--socket", path, "--metrics-addr", "", env=env)
    one_line(r, 2, "tierd serve:", path, f"{n} bytes", "107", "108")
    nothing_made(tmp_path)
    for cmd in ("ping", "stats", "sync"):
        one_line(tierd_cmd(cmd, "--socket", path), 2, f"tierd {cmd}:", f"{n} bytes", "107")
    # the socket from the environment ...
    one_line(tierd_cmd("ping", env={**os.environ, "TIERD_SOCKET": path}), 2, "tierd ping:", f"{n} bytes")
    # ... and from a config file: checked before the disk tier is made (it was made first)
    cfg = tmp_path / "long.toml"
    cfg.write_text(f'socket = "{path}"\n')
    args = [a if a != str(tmp_path / "tierd.toml") else str(cfg) for a in base]
    r = tierd_cmd("serve", *args, "--metrics-addr", "", env=env)
    one_line(r, 1, "tierd serve:", path, f"{n} bytes", "107")
    nothing_made(tmp_path)
    assert not Path(path).parent.exists()


def test_a_socket_where_no_file_can_be_made_names_the_path(tmp_path, serve_args):
    """Under /proc: the directory is there, but no lock file can be made in it."""
    base, env = serve_args
    r = tierd_cmd("serve", *base, "--socket", "/proc/tierd-test.sock", "--metrics-addr", "", env=env)
    line = one_line(r, 1, "tierd serve:", "/proc/tierd-test.sock", "--socket")
    assert "[Errno" not in line
    nothing_made(tmp_path)


# -- a failed start leaves nothing behind ------------------------------------------------------------

def test_a_busy_metrics_port_fails_the_start_before_any_tier_is_made(tmp_path, serve_args):
    base, env = serve_args
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        r = tierd_cmd("serve", *base, "--socket", str(tmp_path / "run" / "t.sock"),
                      "--metrics-addr", f"127.0.0.1:{port}", env=env)
    one_line(r, 1, "tierd serve:", f"metrics_addr 127.0.0.1:{port}", "cannot listen", "Address already in use")
    nothing_made(tmp_path)           # (was: a 64 MiB slab file, LOCK and index.ckpt in disk/)
    assert not (tmp_path / "run" / "t.sock").exists()


def test_port_zero_still_serves_metrics(daemon):
    """Bound before the tiers are opened, served once the daemon is up: port 0 (the daemon
    fixture's --metrics-addr 127.0.0.1:0) still picks a free port, reported and answered on."""
    from urllib.request import urlopen
    assert daemon.metrics_port
    text = urlopen(f"http://127.0.0.1:{daemon.metrics_port}/metrics", timeout=10).read().decode()
    assert "tierd_clients_connected" in text


# -- clean ------------------------------------------------------------------------------------------

def test_clean_names_a_directory_that_is_not_there(tmp_path):
    env = {**os.environ, "TIERD_ARENA_DIR": str(tmp_path / "never-made")}
    cfg = tmp_path / "tierd.toml"
    cfg.write_text("")
    missing = str(tmp_path / "nonexistent")
    one_line(tierd_cmd("clean", "--config", str(cfg), "--arena-dir", missing, "--list", env=env), 1,
             "tierd clean:", missing, "no such directory")
    one_line(tierd_cmd("clean", "--config", str(cfg), "--arena-dir", str(cfg), "--list", env=env), 1,
             "tierd clean:", str(cfg), "not a directory")
    # the configured arena_dir of a daemon that never ran: nothing to clean, no error
    r = tierd_cmd("clean", "--config", str(cfg), "--list", env=env)
    assert r.returncode == 0 and r.stderr == "" and "no tierd arenas" in r.stdout, r


# -- against a daemon: a closed pipe, the daemon's messages -------------------------------------------

def into_closed_pipe(*args, env: dict | None = None) -> subprocess.CompletedProcess:
    """`tierd ARGS | R` where R closes its end at once: the command's first write finds no reader."""
    r, w = os.pipe()
    os.close(r)
    try:
        p = subprocess.Popen([sys.executable, "-m", "tierd", *args], cwd=ROOT, stdout=w, stderr=subprocess.PIPE,
                             stdin=subprocess.DEVNULL, text=True, env=env)
    finally:
        os.close(w)
    _, err = p.communicate(timeout=60)
    return subprocess.CompletedProcess(p.args, p.returncode, "", err)


def test_stats_into_a_reader_that_stopped_is_quiet(daemon):
    for args in (["stats"], ["stats", "--json"], ["stats", "--watch", "0.2"], ["ping"]):
        r = into_closed_pipe(*args, "--socket", daemon.socket)
        assert r.returncode == 0 and r.stderr == "", (args, r.returncode, r.stderr)
    # a pipeline under pipefail: the command is no reason for it to fail
    r = subprocess.run(["bash", "-c", "set -o pipefail; for i in 1 2 3 4 5; do "
                        f"{sys.executable} -m tierd stats --json --socket {daemon.socket} | head -c 1 >/dev/null "
                        "|| exit $?; done"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stderr == "", r


def test_a_reader_that_stopped_never_cuts_the_work_short(tmp_path):
    """`tierd clean --yes | head -1`: the reader goes after the listing, the removals still all
    happen (output is dropped, not the work), and the status is the command's own."""
    arenas = tmp_path / "arenas"
    arenas.mkdir()
    for i in range(200):   # a listing well over a pipe write's buffer: written before the removals
        (arenas / f"tierd-0-{i:012x}.host").write_bytes(b"")
    cfg = tmp_path / "tierd.toml"
    cfg.write_text("")
    env = {**os.environ, "TIERD_ARENA_DIR": str(tmp_path / "never-made")}
    r = into_closed_pipe("clean", "--config", str(cfg), "--arena-dir", str(arenas), "--yes", env=env)
    assert r.returncode == 0 and r.stderr == "", (r.returncode, r.stderr)
    assert sorted(arenas.iterdir()) == []


def test_a_daemons_message_is_not_prefixed_twice(daemon):
    r = tierd_cmd("flush", "--socket", daemon.socket, "--namespace", "0000000000000000", "--yes")
    line = one_line(r, 1, "tierd flush: unknown namespace")
    assert "flush: flush:" not in line


# -- permissions: another user -------------------------------------------------------------------------

# Runs the CLI as nobody: imports first (as root: the interpreter's own files may be unreadable
# to nobody), then gives up root for good, then points the default config file and the node's
# socket at this test's files, then runs `tierd.cli.main`.
AS_NOBODY = """
import os, sys
import argparse, errno, grp, json, logging, pwd, select, tomllib
import tierd.cli, tierd.client, tierd.config, tierd.connection, tierd.leftovers, tierd.server
try:
    os.setgroups([])
    os.setgid(%d)
    os.setuid(%d)
except OSError as e:
    sys.exit(f"cannot become uid 65534 here: {e}")
tierd.config.DEFAULT_CONFIG_PATH, tierd.cli.SYSTEM_SOCKET = sys.argv[1], sys.argv[2]
sys.exit(tierd.cli.main(sys.argv[3:]))
""" % (NOBODY, NOBODY)


@pytest.fixture
def open_dir():
    """A directory nobody can reach (tmp_path's parents are root's own, mode 0700)."""
    if os.geteuid() != 0:
        pytest.skip("needs root, to run the command as another user")
    d = Path(tempfile.mkdtemp(prefix="tierd-misuse-", dir="/tmp"))
    d.chmod(0o755)
    yield d
    shutil.rmtree(d, ignore_errors=True)


def as_nobody(base: Path, *args, default_config: str | None = None, system_socket: str | None = None):
    env = {k: v for k, v in os.environ.items() if not k.startswith("TIERD_") or k == "TIERD_DIGEST_CACHE"}
    env.update(XDG_RUNTIME_DIR=str(base / "xdg"), TIERD_ARENA_DIR=str(base / "arena"), HOME=str(base / "home"))
    r = subprocess.run([sys.executable, "-c", AS_NOBODY, default_config or str(base / "no-such.toml"),
                        system_socket or str(base / "no-run" / "tierd.sock"), *args],
                       cwd=ROOT, capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL, env=env)
    if r.stderr.startswith("cannot become uid 65534 here"):
        pytest.skip(r.stderr.strip())
    return r


def test_an_unreadable_default_config_is_named_with_its_fix(open_dir):
    """/etc/tierd/tierd.toml is root:tierd 0640: another user's `tierd serve` (or `size`, or
    `clean`) reads it by default, and is told it may not, and what to do; never Errno 13."""
    etc = open_dir / "etc"
    etc.mkdir()
    conf = etc / "tierd.toml"
    conf.write_text('metrics_addr = ""\n')
    conf.chmod(0o640)
    sock = str(open_dir / "own" / "t.sock")
    model = open_dir / "model"
    model.mkdir(mode=0o755)
    (model / "config.json").write_text(json.dumps({"num_hidden_layers": 2, "num_attention_heads": 4,
                                                   "hidden_size": 64}))
    for args in (["serve", "--socket", sock, "--log-level", "error"], ["size", "--model", str(model)],
                 ["clean", "--list"]):
        r = as_nobody(open_dir, *args, default_config=str(conf))
        line = one_line(r, 1, f"tierd {args[0]}:", f"cannot read the default config file {conf}",
                        "Permission denied", "uid 65534", "usermod -aG tierd", "--config")
        assert "[Errno" not in line
    assert not (open_dir / "own").exists()
    # its directory does not admit the user (0700): refused the same way, never skipped
    etc.chmod(0o700)
    r = as_nobody(open_dir, "serve", "--socket", sock, "--log-level", "error", default_config=str(conf))
    one_line(r, 1, "tierd serve:", f"cannot read the default config file {conf}", f"{etc} (mode 0700", "--config")
    # named with --config: the same, with the path
    etc.chmod(0o755)
    r = as_nobody(open_dir, "serve", "--config", str(conf), "--socket", sock, "--log-level", "error")
    one_line(r, 1, "tierd serve:", f"config file {conf}: cannot read it", "Permission denied", "--config")


def test_socket_directories_this_user_cannot_use_are_named_with_the_fix(open_dir):
    root_only = open_dir / "rootdir"
    root_only.mkdir(mode=0o755)           # root's, 0755: nobody may pass, not write
    conf = open_dir / "tierd.toml"
    conf.write_text("")
    conf.chmod(0o644)
    common = ["--config", str(conf), "--disk-path", str(open_dir / "disk"), "--metrics-addr", "",
              "--log-level", "error"]
    # a socket directory that must be made where this user may not (`tierd` without /run/tierd)
    r = as_nobody(open_dir, "serve", "--socket", str(root_only / "tierd" / "t.sock"), *common)
    line = one_line(r, 1, "tierd serve:", f"socket directory {root_only / 'tierd'}: cannot create it",
                    "Permission denied", "RuntimeDirectory", "--socket")
    assert "[Errno" not in line
    # one that is there but not writable
    r = as_nobody(open_dir, "serve", "--socket", str(root_only / "t.sock"), *common)
    one_line(r, 1, "tierd serve:", f"socket directory {root_only}", "not writable by uid 65534", "--socket")
    assert not (open_dir / "disk").exists() and not (open_dir / "arena").exists()


def test_a_node_socket_directory_that_keeps_the_user_out_is_named(open_dir):
    """Not in group tierd, no --socket, no daemon of one's own: the node's socket directory
    (/run/tierd, 0750) is what keeps the user out; was "No such file or directory" about the
    user's own socket."""
    run = open_dir / "run"
    run.mkdir(mode=0o750)
    (run / "tierd.sock").touch()
    for cmd in ("ping", "stats"):
        r = as_nobody(open_dir, cmd, system_socket=str(run / "tierd.sock"))
        one_line(r, 1, f"tierd {cmd}:", f"cannot reach the tierd daemon at {run / 'tierd.sock'}",
                 "Permission denied", f"{run} (mode 0750", "does not admit uid 65534", "usermod -aG tierd")
    # with a daemon of its own (its socket there), the user's own socket stays the default
    own = open_dir / "xdg" / "tierd"
    own.mkdir(parents=True)
    (own / "tierd.sock").touch()
    r = as_nobody(open_dir, "ping", system_socket=str(run / "tierd.sock"))
    one_line(r, 1, "tierd ping:", f"cannot reach the tierd daemon at {own / 'tierd.sock'}")
