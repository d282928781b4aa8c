"""Real Redis servers for the remote-tier tests: standalone or a 3-master Cluster, each a
`redis-server` process on a loopback port chosen here, in a temporary directory."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time

import pytest


def free_port(cluster: bool = False) -> int:
    """A free loopback port; for a Cluster node also its bus port (port + 10000) must be."""
    for _ in range(200):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if not cluster:
            return port
        if port + 10000 > 65535:
            continue
        try:
            with socket.socket() as s:
                s.bind(("127.0.0.1", port + 10000))
            return port
        except OSError:
            continue
    raise RuntimeError("no free port pair for a cluster node")


def redis_binary() -> str:
    exe = shutil.which("redis-server")
    if exe is None:
        if os.environ.get("TEST_REQUIRE_REDIS"):
            pytest.fail("redis-server is part of this suite here (`make redis` installs it), and it is missing")
        pytest.skip("no redis-server; `make redis` installs Debian's package")
    return exe


class RedisServer:
    def __init__(self, workdir, *, cluster: bool = False, maxmemory: str = "256mb"):
        self.port = free_port(cluster)
        self.dir = workdir / f"redis-{self.port}"
        self.dir.mkdir(parents=True)
        self.args = [redis_binary(), "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
                     "--appendonly", "no", "--dir", str(self.dir), "--maxmemory", maxmemory,
                     "--maxmemory-policy", "allkeys-lru", "--protected-mode", "no"]
        if cluster:
            self.args += ["--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
                          "--cluster-node-timeout", "2000"]
        self.proc = None
        self.start()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}"

    def start(self) -> "RedisServer":
        self.proc = subprocess.Popen(self.args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as s:
                    s.sendall(b"PING\r\n")
                    if s.recv(64).startswith(b"+PONG"):
                        return self
            except OSError:
                time.sleep(0.05)
        raise RuntimeError(f"redis-server on port {self.port} did not start")

    def signal(self, sig) -> None:
        self.proc.send_signal(sig)

    def kill(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.kill()


class RedisCluster:
    """Three masters (with `replicas` replicas each), all 16384 slots assigned."""

    def __init__(self, workdir, replicas: int = 0):
        self.nodes = [RedisServer(workdir, cluster=True) for _ in range(3 * (1 + replicas))]
        cli = shutil.which("redis-cli")
        if cli is None:
            pytest.skip("no redis-cli (Debian's redis-tools) to create the cluster")
        r = subprocess.run([cli, "--cluster", "create", *[f"127.0.0.1:{n.port}" for n in self.nodes],
                            "--cluster-replicas", str(replicas), "--cluster-yes"], capture_output=True, text=True,
                           timeout=60)
        if r.returncode != 0:
            self.stop()
            raise RuntimeError(f"redis-cli --cluster create failed: {r.stdout[-2000:]}{r.stderr[-2000:]}")
        self.cli = cli
        if not all(self.wait_ok(n) for n in self.nodes):     # every node agrees it is up
            raise RuntimeError("the cluster did not become ready")

    def wait_ok(self, node, timeout_s: float = 30.0) -> bool:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            info = subprocess.run([self.cli, "-p", str(node.port), "cluster", "info"], capture_output=True,
                                  text=True).stdout
            if "cluster_state:ok" in info:
                return True
            time.sleep(0.1)
        return False

    def masters(self) -> list:
        """The nodes that are masters now."""
        out = []
        for n in self.nodes:
            if n.proc.poll() is not None:
                continue
            role = subprocess.run([self.cli, "-p", str(n.port), "role"], capture_output=True, text=True).stdout
            if role.startswith("master"):
                out.append(n)
        return out

    @property
    def url(self) -> str:
        return "redis+cluster://" + ",".join(f"127.0.0.1:{n.port}" for n in self.nodes)

    def stop(self) -> None:
        for n in self.nodes:
            n.stop()
