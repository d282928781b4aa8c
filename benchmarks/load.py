"""Sustained load on one daemon: 32 client connections (4 processes x 8 threads) doing mixed ops
for a while, with the daemon's RSS and open file descriptors sampled all along.

Figures: per op p50/p99 latency under load beside the same op's p99 with one client in the same
run; peak RSS beside the host tier size; peak open fds. Checks every block read bit-exact and
that no lease or reservation is left once the clients are gone.

    python -m benchmarks.load [--json PATH] [--quick] [--seconds S] [--clients N]
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import shutil
import tempfile
import threading
import time

import numpy as np
import psutil

import tierd

from .common import DaemonUnderTest, Result, parse_args, report
from .load_worker import OPS

HOST_BYTES = 64 << 20


def run_clients(sock: str, processes: int, threads: int, seconds: float) -> dict:
    procs = [subprocess.Popen([sys.executable, "-m", "benchmarks.load_worker", sock, str(i + 1), str(threads),
                               str(seconds)], stdout=subprocess.PIPE, text=True) for i in range(processes)]
    outs = [json.loads(p.communicate(timeout=seconds + 120)[0].strip().splitlines()[-1]) for p in procs]
    return {"latencies": {op: [x for o in outs for x in o["latencies"][op]] for op in OPS},
            "n_errors": sum(o["n_errors"] for o in outs), "errors": [e for o in outs for e in o["errors"]][:20],
            "verified": sum(o["verified"] for o in outs)}


def run(seconds: float, clients: int = 32, workdir: str | None = None) -> dict:
    """Start a daemon, measure one client then `clients`, return the figures."""
    own = workdir is None
    workdir = workdir or tempfile.mkdtemp(prefix="tierd-load-")
    d = DaemonUnderTest(workdir, host_bytes=f"{HOST_BYTES >> 20}MiB", disk_path=os.path.join(workdir, "disk"),
                        disk_bytes="256MiB", toml="[limits]\nmax_clients = 256\n")
    proc = psutil.Process(d.proc.pid)
    try:
        baseline_fds = proc.num_fds()
        single_s = max(2.0, seconds / 4)
        single = run_clients(d.socket, 1, 1, single_s)
        samples, stop = [], threading.Event()

        def sample():
            while not stop.is_set():
                try:
                    samples.append((proc.memory_info().rss, proc.num_fds()))
                except psutil.Error:
                    return
                time.sleep(0.1)

        t = threading.Thread(target=sample)
        t.start()
        procs = 4
        loaded = run_clients(d.socket, procs, clients // procs, seconds)
        stop.set()
        t.join()
        with tierd.connect(f"unix://{d.socket}") as c:
            deadline = time.monotonic() + 10     # the daemon closes departed clients' sockets
            while True:
                st = c.stats()
                after_fds = proc.num_fds() - 1   # minus this stats connection
                if after_fds <= baseline_fds + 1 and not st["leases"] and not st["reservations"] \
                        or time.monotonic() > deadline:
                    break
                time.sleep(0.1)
    finally:
        d.stop()
        if own:
            shutil.rmtree(workdir, ignore_errors=True)
    pct = lambda xs, q: float(np.percentile(xs, q)) * 1e3 if xs else float("nan")  # noqa: E731
    return {
        "seconds": seconds, "clients": clients,
        "ops": sum(len(v) for v in loaded["latencies"].values()),
        "single_ops_per_s": sum(len(v) for v in single["latencies"].values()) / single_s,
        "p50_ms": {op: pct(v, 50) for op, v in loaded["latencies"].items()},
        "p99_ms": {op: pct(v, 99) for op, v in loaded["latencies"].items()},
        "single_p99_ms": {op: pct(v, 99) for op, v in single["latencies"].items()},
        "errors": loaded["n_errors"] + single["n_errors"], "error_samples": loaded["errors"] + single["errors"],
        "verified": loaded["verified"] + single["verified"],
        "rss_peak": max(s[0] for s in samples), "fds_peak": max(s[1] for s in samples),
        "fds_baseline": baseline_fds, "fds_after": after_fds,
        "leases_after": st["leases"], "reservations_after": st["reservations"],
        "host_bytes": HOST_BYTES,
    }


def main() -> int:
    args = parse_args(__doc__.splitlines()[0], lambda ap: (
        ap.add_argument("--seconds", type=float, default=None), ap.add_argument("--clients", type=int, default=32)))
    seconds = args.seconds or (8.0 if args.quick else 60.0)
    r = run(seconds, args.clients)
    print(f"{r['ops']} ops in {seconds:.0f}s by {r['clients']} clients; errors {r['errors']}; "
          f"blocks verified {r['verified']}; leases/reservations left {r['leases_after']}/{r['reservations_after']}; "
          f"fds baseline {r['fds_baseline']} peak {r['fds_peak']} after {r['fds_after']}")
    results = [Result("operations per second under load", {"clients": r["clients"]}, r["ops"] / seconds, "ops/s",
                      "one client's operations per second", r["single_ops_per_s"],
                      note="closed loop: every client sends its next request when the last one is answered; "
                           "clients and daemon share the machine's CPUs")]
    results += [Result(f"{op} p99 under load", {"clients": r["clients"]}, r["p99_ms"][op], "ms",
                      "same op p99, one client", r["single_p99_ms"][op], higher_is_better=False) for op in OPS]
    results.append(Result("daemon peak RSS", {"clients": r["clients"]}, r["rss_peak"] / 2 ** 20, "MiB",
                          "host tier size", r["host_bytes"] / 2 ** 20, higher_is_better=False,
                          note="RSS counts the touched part of the shared host arena; bound: host tier + "
                               "fixed overhead (docs/RELIABILITY.md)"))
    report("load", results, args.json)
    return 0 if not r["errors"] else 1


if __name__ == "__main__":
    sys.exit(main())
