"""The peers tierd is measured against, run as their users run them on a CPU machine: LMCache's
multiprocess server (its CPU path; the environment is `make peers-env`). Used by
`benchmarks.vllm_ttft --peers`.

LMCache's configuration is its documented one for a CPU worker, with the choices that favour it
on this benchmark (../shared/notes/lmcache-cpu.md has how they were measured):
- `lmcache server` with a 2 GB shared-memory L1 pool (`--supported-transfer-mode auto` and a
  `--shm-name`: what a CPU worker needs), LRU eviction, 256-token chunks (tierd's block), and an
  `fs` L2 adapter on a directory beside tierd's disk tier (same filesystem);
- vLLM's `LMCacheMPConnector` with `lmcache.mp.nonblocking_lookup_status: false` (the scheduler
  waits for the lookup's answer instead of polling it on later steps: a fresh engine's first
  request hits one step sooner).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import time
import urllib.request
from pathlib import Path

LMCACHE_VERSION = "0.5.6"
# no network here; LMCache reports usage unless told not to
LMCACHE_ENV = {"LMCACHE_TRACK_USAGE": "false", "DO_NOT_TRACK": "1", "LMCACHE_DISABLE_BANNER": "1"}
CHUNK_TOKENS = 256


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_port(port: int, proc: subprocess.Popen, log: Path, timeout: float = 180.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"lmcache server exited ({proc.returncode}):\n{log.read_text()[-3000:]}")
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return
        except OSError:
            time.sleep(0.2)
    raise RuntimeError(f"lmcache server not listening on {port} after {timeout:.0f} s")


class LMCacheServer:
    """`lmcache server` as a subprocess: an L1 pool in /dev/shm and an `fs` L2 directory, both
    removed by `stop`."""

    def __init__(self, py: str, work: Path, *, l1_gb: float = 2.0):
        self.work = Path(work)
        self.port, self.http_port, self.prom_port = free_port(), free_port(), free_port()
        self.shm_name = f"tierd-bench-lmcache-{os.getpid()}"
        self.disk = self.work / "lmcache-l2"
        self.disk.mkdir(parents=True, exist_ok=True)
        exe = Path(py).parent / "lmcache"
        argv = [str(exe), "server", "--host", "localhost", "--port", str(self.port),
                "--chunk-size", str(CHUNK_TOKENS), "--l1-size-gb", str(l1_gb), "--eviction-policy", "LRU",
                "--supported-transfer-mode", "auto", "--shm-name", self.shm_name,
                "--http-host", "127.0.0.1", "--http-port", str(self.http_port),
                "--prometheus-port", str(self.prom_port),
                "--l2-adapter", json.dumps({"type": "fs", "base_path": str(self.disk)})]
        self.log = self.work / "lmcache-server.log"
        self._logf = open(self.log, "wb")
        self.proc = subprocess.Popen(argv, stdout=self._logf, stderr=subprocess.STDOUT,
                                     env={**os.environ, **LMCACHE_ENV, "TMPDIR": str(self.work)},
                                     start_new_session=True)
        try:
            _wait_port(self.port, self.proc, self.log)
            _wait_port(self.http_port, self.proc, self.log)
        except BaseException:
            self.stop()
            raise

    def connector(self) -> dict:
        """The `kv_transfer` spec of tests/vllm_engine.py for a vLLM engine using this server."""
        return {"kv_connector": "LMCacheMPConnector", "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
                "kv_connector_extra_config": {"lmcache.mp.host": "tcp://localhost", "lmcache.mp.port": self.port,
                                              "lmcache.mp.nonblocking_lookup_status": False}}

    def disk_bytes(self) -> int:
        return sum(p.stat().st_size for p in self.disk.rglob("*") if p.is_file())

    def drain(self, quiet_s: float = 2.0, timeout: float = 120.0) -> int:
        """Wait until the L2 directory stops growing (its writes behind the L1 pool are done);
        returns its size."""
        deadline = time.monotonic() + timeout
        last, since = -1, time.monotonic()
        while time.monotonic() < deadline:
            n = self.disk_bytes()
            if n != last:
                last, since = n, time.monotonic()
            elif time.monotonic() - since >= quiet_s:
                return n
            time.sleep(0.2)
        return last

    def clear_l1(self) -> None:
        req = urllib.request.Request(f"http://127.0.0.1:{self.http_port}/cache/clear",
                                     data=json.dumps({"tier": "l1"}).encode(), method="POST",
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=60) as r:
            body = json.loads(r.read())
        if body.get("status") != "ok":
            raise RuntimeError(f"lmcache /cache/clear: {body}")

    def drop_page_cache(self) -> None:
        """Write back and drop the L2 files' pages, so that its next reads come from the device."""
        for p in self.disk.rglob("*"):
            if p.is_file():
                fd = os.open(p, os.O_RDONLY)
                try:
                    os.fsync(fd)
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                finally:
                    os.close(fd)

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(30)
        self._logf.close()
        shutil.rmtree(self.disk, ignore_errors=True)
        for p in Path("/dev/shm").glob(f"*{self.shm_name}*"):
            p.unlink(missing_ok=True)
