"""Start and stop within what the supervisor allows (issue 52, item 4): the daemon asks systemd
for more start-up time while it reserves and re-adopts its arena, and the unit's stop limit
covers the stop's request drain, its sync (a setting) and the store's close."""

import configparser
import socket
import subprocess
import sys

import pytest

from tierd.config import ServeConfig
from tierd.server import Daemon
from tierd.store import TieredStore

from .daemon import ROOT, DaemonProc

UNIT = ROOT / "systemd" / "tierd.service"


def unit_seconds(key: str) -> float:
    cp = configparser.ConfigParser(strict=False, interpolation=None)
    cp.read_string(UNIT.read_text())
    return float(cp["Service"][key].rstrip("s"))


def test_the_units_stop_limit_covers_the_drain_the_sync_and_the_close():
    need = Daemon.STOP_REQUESTS_S + ServeConfig().sync_on_stop_s + TieredStore.CLOSE_WAIT_S
    assert unit_seconds("TimeoutStopSec") > need
    assert unit_seconds("TimeoutStartSec") >= 60


def test_the_daemon_asks_for_start_up_time_before_it_is_ready(tmp_path):
    """Under a notify socket (systemd's Type=notify), the daemon extends its start timeout
    while it opens its tiers, then says READY=1."""
    path = str(tmp_path / "notify")
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
        s.bind(path)
        s.settimeout(30)
        d = DaemonProc(tmp_path, env={"NOTIFY_SOCKET": path}).start()
        try:
            got = []
            while not any("READY=1" in m for m in got):
                got.append(s.recv(4096).decode())
            first = next(i for i, m in enumerate(got) if "EXTEND_TIMEOUT_USEC=" in m)
            ready = next(i for i, m in enumerate(got) if "READY=1" in m)
            assert first < ready and "EXTEND_TIMEOUT_USEC=30000000" in got[first]
        finally:
            assert d.stop() == 0


@pytest.mark.parametrize("value", ["0", "-5"])
def test_sync_on_stop_s_must_be_positive(tmp_path, value):
    cfg = tmp_path / "tierd.toml"
    cfg.write_text(f"sync_on_stop_s = {value}\n")
    r = subprocess.run([sys.executable, "-m", "tierd", "serve", "--config", str(cfg), "--socket",
                        str(tmp_path / "s.sock")], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode != 0 and "sync_on_stop_s" in r.stderr and "Traceback" not in r.stderr
