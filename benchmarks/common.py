"""What every benchmark shares: the machine description, the one JSON shape, the table, and
the command line (`--json PATH`, `--quick`). Timing helpers live here, not in each script."""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from dataclasses import dataclass, field


def machine() -> dict:
    try:
        import torch
        torch_version = torch.__version__
        gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    except ImportError:
        torch_version, gpu = None, None
    return {"cpus": os.cpu_count(), "ram_bytes": os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"),
            "torch": torch_version, "python": platform.python_version(), "gpu": gpu}


@dataclass
class Result:
    """One figure beside its same-run reference; `ratio` is oriented so higher is better."""

    name: str
    params: dict
    value: float
    unit: str
    reference_name: str
    reference_value: float
    higher_is_better: bool = True
    note: str = field(default="")

    @property
    def ratio(self) -> float:
        if self.higher_is_better:
            return self.value / self.reference_value if self.reference_value else float("nan")
        return self.reference_value / self.value if self.value else float("nan")

    def to_json(self) -> dict:
        return {"name": self.name, "params": self.params, "value": self.value, "unit": self.unit,
                "reference": {"name": self.reference_name, "value": self.reference_value},
                "ratio": self.ratio}


def parse_args(description: str, extra=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--json", metavar="PATH", help="write the figures as JSON to PATH")
    ap.add_argument("--quick", action="store_true", help="reduced sizes (under a minute)")
    if extra is not None:
        extra(ap)
    return ap.parse_args()


def report(name: str, results: list[Result], json_path: str | None) -> None:
    rows = [[r.name, ", ".join(f"{k}={v}" for k, v in r.params.items()), f"{r.value:.3f} {r.unit}",
             f"{r.reference_name} {r.reference_value:.3f}", f"{r.ratio:.2f}x"] for r in results]
    header = ["result", "params", "value", "reference (same run)", "ratio"]
    widths = [max(len(x[i]) for x in rows + [header]) for i in range(len(header))]
    fmt = lambda r: "  ".join(c.ljust(w) for c, w in zip(r, widths))  # noqa: E731
    print(fmt(header))
    print(fmt(["-" * w for w in widths]))
    for r in rows:
        print(fmt(r))
    seen = set()
    for r in results:
        if r.note and (r.name, r.note) not in seen:
            seen.add((r.name, r.note))
            print(f"note ({r.name}): {r.note}")
    if json_path:
        save_json(name, results, json_path)
        print(f"wrote {json_path}")


def save_json(name: str, results: list[Result], json_path: str | None) -> None:
    """Write the figures so far (a benchmark that may be stopped by a time limit calls this
    after each part: what was measured is kept). Written whole, then renamed into place."""
    if not json_path:
        return
    doc = {"benchmark": name, "machine": machine(), "results": [r.to_json() for r in results]}
    os.makedirs(os.path.dirname(os.path.abspath(json_path)), exist_ok=True)
    with open(json_path + ".tmp", "w") as f:
        json.dump(doc, f, indent=2)
    os.replace(json_path + ".tmp", json_path)


def last_level_cache_bytes() -> int:
    """The CPU's largest cache (from sysfs), or 32 MiB when it cannot be read."""
    best = 0
    base = "/sys/devices/system/cpu/cpu0/cache"
    try:
        for d in os.listdir(base):
            try:
                with open(os.path.join(base, d, "size")) as f:
                    v = f.read().strip()
            except OSError:
                continue
            mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(v[-1:], 1)
            best = max(best, int(v.rstrip("KMG")) * mult)
    except (OSError, ValueError):
        pass
    return best or 32 << 20


def memcpy_gbps(nbytes: int, repeats: int = 5) -> float:
    """GB/s of one memcpy (numpy copyto) of `nbytes` from memory to memory: source and
    destination written beforehand (no page faults), the CPU caches flushed before each copy
    (by reading and writing back every byte of a buffer four times the last-level cache), the
    best of `repeats`. What a load of blocks stored earlier copies: its bytes come from DRAM, not
    from a cache that holds them — a warm copy of a few MiB runs at cache speed and is not this
    floor.

    The flush reads each line before it writes it: a sweep that only writes (a fill) may go
    through streaming stores that leave the caches as they were, and then a copy of 8 MiB ran at
    up to 29 GB/s here against 12-13 GB/s after a read-and-write sweep (docs/design-notes.md,
    "Where a host hit's load part goes")."""
    import numpy as np
    src = np.ones(nbytes, dtype=np.uint8)
    dst = np.zeros(nbytes, dtype=np.uint8)
    best = float("inf")
    for _ in range(repeats):
        flush_caches()
        t0 = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - t0)
    return nbytes / best / 1e9


_sweep = None


def flush_caches() -> None:
    """Push what the CPU caches hold out to memory: read and write back every byte of a buffer
    four times the last-level cache (kept between calls, its pages touched once)."""
    import numpy as np
    global _sweep
    if _sweep is None:
        _sweep = np.ones(4 * last_level_cache_bytes(), dtype=np.uint8)
    np.add(_sweep, 1, out=_sweep)


def best_of(fn, repeats: int = 3) -> float:
    """Fastest wall time of `repeats` runs of fn() (seconds): the least disturbed run on a
    noisy machine."""
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


class DaemonUnderTest:
    """A `tierd serve` subprocess on a temporary socket (no metrics endpoint). Its host arena
    lives in a directory of its own under /dev/shm (a tmpfs, as in production), removed by
    `stop`: the daemon keeps its arena across restarts (`kill` then `start` re-adopts it)."""

    def __init__(self, workdir: str, *, host_bytes: str, disk_path: str = "", disk_bytes: str = "64MiB",
                 toml: str = ""):
        import tempfile
        self.workdir = workdir
        self.socket = os.path.join(workdir, "tierd.sock")
        cfg = os.path.join(workdir, "tierd.toml")
        with open(cfg, "w") as f:
            f.write(toml)
        shm = "/dev/shm" if os.path.isdir("/dev/shm") else None
        self.arena_dir = tempfile.mkdtemp(prefix="tierd-bench-", dir=shm)
        self.argv = ["-m", "tierd", "serve", "--config", cfg, "--socket", self.socket,
                     "--host-bytes", host_bytes, "--disk-path", disk_path, "--disk-bytes", disk_bytes,
                     "--metrics-addr", "", "--log-level", "warning"]
        self.proc = None
        self.start()

    def start(self) -> float:
        """Start the daemon; returns the seconds from exec to serving."""
        import subprocess
        import sys
        t0 = time.perf_counter()
        self.proc = subprocess.Popen([sys.executable, *self.argv], stdout=subprocess.PIPE,
                                     stderr=subprocess.DEVNULL, env={**os.environ, "TIERD_ARENA_DIR": self.arena_dir})
        line = self.proc.stdout.readline()
        if b"serving" not in line:
            self._remove()
            raise RuntimeError(f"daemon did not start: {line!r}")
        return time.perf_counter() - t0

    def kill(self, sig=None) -> None:
        """Stop the daemon (SIGKILL, or `sig`) and wait for it; its arena stays for `start`."""
        import signal
        self.proc.send_signal(signal.SIGKILL if sig is None else sig)
        self.proc.wait(60)

    def stop(self) -> None:
        import signal
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            self.proc.wait(60)
        self._remove()

    def _remove(self) -> None:
        import shutil
        shutil.rmtree(self.arena_dir, ignore_errors=True)


def start_redis(workdir: str, maxmemory: str = "2gb"):
    """A `redis-server` on a free loopback port in `workdir`: (process, redis:// URL), or
    (None, None) where it is not installed (`make redis` installs Debian's package)."""
    import shutil
    import socket
    import subprocess
    exe = shutil.which("redis-server")
    if exe is None:
        return None, None
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    p = subprocess.Popen([exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                          "--dir", workdir, "--maxmemory", maxmemory, "--maxmemory-policy", "allkeys-lru"],
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    for _ in range(200):
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return p, f"redis://127.0.0.1:{port}"
        except OSError:
            time.sleep(0.05)
    p.kill()
    raise RuntimeError("redis-server did not start")


def engine_python(venv: str, env_var: str, make_target: str) -> str:
    """The python of an engine's environment (a venv in the checkout, or $env_var); exits with
    how to build it when it is missing."""
    from pathlib import Path
    py = os.environ.get(env_var) or str(Path(__file__).resolve().parent.parent / venv / "bin" / "python")
    if not Path(py).exists():
        raise SystemExit(f"no {venv} environment; `make {make_target}` builds it")
    return py


def run_engine_process(py: str, module: str, work, name: str, spec: dict, env: dict | None = None) -> dict:
    """Run one engine process (`python -m MODULE SPEC.json`, tests/vllm_engine.py or
    tests/sglang_engine.py) in `work` and return what it wrote; its log goes to work/NAME.log
    and a failure exits with the log's end."""
    import subprocess
    from pathlib import Path
    work = Path(work)
    root = Path(__file__).resolve().parent.parent
    spec = {**spec, "out": str(work / f"{name}.json")}
    path = work / f"{name}.spec.json"
    path.write_text(json.dumps(spec))
    # TMPDIR: the engine's IPC sockets and temporary files go with the run's directory
    full_env = dict(os.environ, PYTHONPATH=str(root), TMPDIR=str(work), **(env or {}))
    log = work / f"{name}.log"
    with open(log, "wb") as f:
        rc = subprocess.run([py, "-m", module, str(path)], cwd=root, env=full_env, stdout=f,
                            stderr=subprocess.STDOUT, timeout=1800).returncode
    if rc != 0:
        raise SystemExit(f"engine {name} failed:\n{log.read_text()[-4000:]}")
    print(f"  engine {name}: done")
    return json.loads((work / f"{name}.json").read_text())


def quick_model(work):
    """The 4-layer random-weight model of the engine benchmarks' --quick runs, written under
    `work` (vocabulary 512, hidden 128, 4 heads over 2 KV heads of 32)."""
    from pathlib import Path

    from tierd.engine.random_model import write_random_model
    return write_random_model(Path(work) / "model", vocab_size=512, hidden_size=128, intermediate_size=256,
                              num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                              head_dim=32, max_position_embeddings=4096, seed=3)


def single_batches(prefix: str, prompts: list[list[int]], warmup: list[int] | None) -> list[dict]:
    """One batch per prompt, so each prompt's TTFT is its own; a warm-up prompt first where given
    (an engine's first request pays one-time costs), never counted."""
    out = [{"name": "warmup", "prompts": [{"tokens": warmup, "max_tokens": 1}]}] if warmup else []
    return out + [{"name": f"{prefix}{i}", "prompts": [{"tokens": p, "max_tokens": 1}]} for i, p in enumerate(prompts)]
