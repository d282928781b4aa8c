"""A real `tierd serve` process on a temporary socket, for the daemon tests."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

SMALL_TOML = """
[host]
slab_bytes = "1MiB"
[disk]
slab_bytes = "4MiB"
file_bytes = "32MiB"
"""


class DaemonProc:
    def __init__(self, tmp_path: Path, *, host_bytes="8MiB", disk_bytes="64MiB", toml: str = SMALL_TOML,
                 env: dict | None = None, args: tuple = (), launcher: tuple = ("-m", "tierd")):
        self.dir = tmp_path
        self.launcher = list(launcher)   # how python runs the CLI: `-m tierd`, or `-c CODE`
        self.socket = str(tmp_path / "run" / "tierd.sock")
        self.disk = str(tmp_path / "disk")
        self.config = tmp_path / "tierd.toml"
        self.config.write_text(toml)
        (tmp_path / "arena").mkdir(exist_ok=True)
        self.env = {**os.environ, "TIERD_ARENA_DIR": str(tmp_path / "arena"), **(env or {})}
        self.args = ["--socket", self.socket, "--host-bytes", host_bytes, "--disk-path", self.disk,
                     "--disk-bytes", disk_bytes, "--metrics-addr", "127.0.0.1:0",
                     "--config", str(self.config), *args]
        self.proc: subprocess.Popen | None = None
        self.metrics_port: int | None = None
        self.log = tmp_path / "daemon.log"

    def start(self, timeout_s: float = 30) -> "DaemonProc":
        self._logf = open(self.log, "ab")
        self.proc = subprocess.Popen([sys.executable, *self.launcher, "serve", *self.args], cwd=ROOT,
                                     env=self.env, stdout=subprocess.PIPE, stderr=self._logf)
        deadline = time.monotonic() + timeout_s
        line = b""
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            if not line:
                break
            m = re.search(rb"tierd: serving .* metrics on [\d.]+:(\d+)", line)
            if m:
                self.metrics_port = int(m.group(1))
                return self
        raise RuntimeError(f"daemon did not start: {line!r}\n{self.log.read_text()[-3000:]}")

    @property
    def url(self) -> str:
        return f"unix://{self.socket}"

    def signal(self, sig) -> None:
        self.proc.send_signal(sig)

    def stop(self, timeout_s: float = 30) -> int:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        rc = self.proc.wait(timeout_s)
        self._logf.close()
        return rc

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(30)
        self._logf.close()

    def wait(self, timeout_s: float = 30) -> int:
        """Wait for the daemon to exit on its own (subprocess.TimeoutExpired if it does not
        within `timeout_s`); its exit status."""
        rc = self.proc.wait(timeout_s)
        self._logf.close()
        return rc

    def arena_files(self) -> list[Path]:
        """The host arena file(s) in this daemon's arena_dir (`tierd-UID-TAG.host`)."""
        return sorted(Path(self.env["TIERD_ARENA_DIR"]).glob("tierd-*.host"))

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None
