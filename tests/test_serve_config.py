"""Daemon settings: layers, sources, validation."""

import os

import pytest

from tierd.config import load_serve_config
from tierd.errors import ConfigError
from tierd.server import check_socket_dir


def test_flags_override_env_override_file_override_defaults(tmp_path):
    f = tmp_path / "t.toml"
    f.write_text('socket = "/file/s.sock"\nmetrics_addr = "127.0.0.1:1"\n[host]\nbytes = "1GiB"\n'
                 '[disk]\nbytes = "2GiB"\n')
    cfg = load_serve_config(str(f), flags={"socket": "/flag/s.sock", "disk.bytes": None},
                            env={"TIERD_HOST_BYTES": "3GiB", "TIERD_METRICS_ADDR": ""})
    assert cfg.socket == "/flag/s.sock" and cfg.sources["socket"] == "command line"
    assert cfg.store.host_bytes == "3GiB" and cfg.sources["host.bytes"] == "environment"
    assert cfg.store.disk_bytes == "2GiB" and cfg.sources["disk.bytes"] == f"file {f}"
    assert cfg.metrics_addr == "" and cfg.sources["metrics_addr"] == "environment"
    assert cfg.sources["policy.eviction"] == "default"


def test_defaults_work_with_no_config(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    cfg = load_serve_config(None, env={})
    assert cfg.store.host_bytes == "10%"
    assert cfg.store.disk_path and cfg.store.disk_bytes == "4GiB"
    assert cfg.socket.endswith("tierd.sock")


@pytest.mark.parametrize("toml,match", [
    ('sokcet = "/x"\n', "unknown setting 'sokcet'"),
    ('[host]\nbytes = "lots"\n', "cannot parse"),
    ('[policy]\neviction = "mru"\n', "eviction_policy"),
    ('socket_mode = "rw"\n', "octal mode"),
    ('[limits]\nmax_frame_bytes = 10\n', "max_frame_bytes"),
    ('[disk]\nstall_s = 0\n', "disk_stall_s"),
    ("not toml [", "invalid TOML"),
])
def test_bad_settings_are_refused_with_the_reason(tmp_path, toml, match):
    f = tmp_path / "t.toml"
    f.write_text(toml)
    with pytest.raises(ConfigError, match=match):
        load_serve_config(str(f), env={})


def test_unknown_environment_variable_is_refused():
    with pytest.raises(ConfigError, match="TIERD_HOTS_BYTES names no setting"):
        load_serve_config(None, env={"TIERD_HOTS_BYTES": "1GiB"})


def test_client_side_variables_do_not_trouble_the_daemon():
    """TIERD_URL is the connectors' setting; a shell that exports it can still run tierd serve."""
    cfg = load_serve_config(None, env={"TIERD_URL": "unix:///run/tierd/tierd.sock", "TIERD_HOST_BYTES": "3GiB"})
    assert cfg.store.host_bytes == "3GiB"


def test_world_writable_socket_directory_is_refused(tmp_path):
    d = tmp_path / "open"
    d.mkdir()
    d.chmod(0o777)
    with pytest.raises(ConfigError, match="world-writable"):
        check_socket_dir(str(d / "tierd.sock"))
    d.chmod(0o1777)  # sticky, like /tmp: others cannot replace our socket
    check_socket_dir(str(d / "tierd.sock"))
    assert os.path.isdir(d)


def test_the_event_loop_setting_is_checked():
    import asyncio
    from tierd.server import _loop_runner
    assert _loop_runner("asyncio") is asyncio.run
    assert _loop_runner("auto") is not None
    with pytest.raises(ConfigError, match="event_loop"):
        _loop_runner("twisted")


@pytest.mark.parametrize("text,want", [("false", False), ("0", False), ("no", False), ("true", True), ("on", True)])
def test_remote_write_behind_parses_like_every_boolean(text, want):
    """b90e890 parsed [remote] write_behind with Python's bool(): TIERD_REMOTE_WRITE_BEHIND=false
    meant true."""
    cfg = load_serve_config(None, env={"TIERD_REMOTE_WRITE_BEHIND": text})
    assert cfg.store.remote_write_behind is want
    with pytest.raises(ConfigError, match="true or false"):
        load_serve_config(None, env={"TIERD_REMOTE_WRITE_BEHIND": "maybe"})


def test_host_keep_is_on_for_the_daemon_and_turned_off_by_file_or_environment(tmp_path):
    """A daemon keeps its host tier across restarts unless told not to; the embedded store never
    does (an anonymous arena dies with its process)."""
    assert load_serve_config(None, env={}).store.host_keep is True
    assert load_serve_config(None, env={"TIERD_HOST_KEEP": "off"}).store.host_keep is False
    f = tmp_path / "tierd.toml"
    f.write_text("[host]\nkeep = false\n")
    assert load_serve_config(str(f), env={}).store.host_keep is False
    with pytest.raises(ConfigError, match="true or false"):
        load_serve_config(None, env={"TIERD_HOST_KEEP": "sometimes"})
    from tierd import StoreConfig
    assert StoreConfig().host_keep is False
