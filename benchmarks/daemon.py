"""What does going through the daemon cost?

Each figure beside the same work on an embedded store (or one client, or a bare Python) in the
same run:

  lookup latency p50/p99      from the daemon's shared index, and asked over the socket
                              (goal: p50 <= 50 us)
  store / fetch GB/s          64 KiB, 1 MiB and 16 MiB blocks, alternated, medians of five runs
                              (--quick: seven) (goals: >= 0.9x from 1 MiB, >= 0.7x at 64 KiB);
                              leased fetches also with every lease pinned (as while the host
                              tier evicts; no goal); also with both sides recording blocks for
                              restarts, and neither
  p99 with 32 clients         32 processes pacing 100 requests/s each, beside one such client
                              (goal: <= 5x)
  ops/s with 1, 4, 16 clients closed loop, beside 1 client
  start-up time and idle RSS  beside a bare Python interpreter's

Method (what each side does, why the comparison is like for like): docs/benchmarks.md#daemon.

    python -m benchmarks.daemon [--json PATH] [--quick]
"""

from __future__ import annotations

import multiprocessing as mp
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np
import psutil

from tierd import Namespace, TieredStore
from tierd.client import Client
from tierd.config import MiB, format_size

from .common import DaemonUnderTest, Result, parse_args, report
from .tiers import kv_like, namespace_for, timed

KiB = 1024


def lookup_latency(store, ns: Namespace, keys: list[bytes], n: int, raw: bool = False):
    lat = np.empty(n)
    for i in range(n):
        t0 = time.perf_counter()
        store.lookup(ns, keys)
        lat[i] = time.perf_counter() - t0
    if raw:
        return list(lat)
    return float(np.percentile(lat, 50)), float(np.percentile(lat, 99))


def transfer(ns: Namespace, embedded: TieredStore, client: Client, n_blocks: int, repeats: int,
             keep: bool = False, daemon_keeps: bool = True, pinning: Client | None = None):
    bb = ns.block_bytes
    keys = [k for i in range(n_blocks) for k in ns.block_keys(np.full(ns.block_tokens, i))]
    src = [kv_like(bb, seed=i) for i in range(4)]
    dst = np.empty(n_blocks * bb, dtype=np.uint8)
    dst[:] = 1
    total = n_blocks * bb

    def put_all(store):
        for i in range(0, n_blocks, 8):
            store.put(ns, keys[i:i + 8], [src[j % 4] for j in range(i, min(i + 8, n_blocks))])

    outs = [dst[j * bb:(j + 1) * bb] for j in range(n_blocks)]

    def get_all(store):            # a fetch: get into the caller's buffers
        for i in range(0, n_blocks, 8):
            got = len(store.get(ns, keys[i:i + 8], out=outs[i:i + 8]))
            if got != len(keys[i:i + 8]):
                raise AssertionError(f"{type(store).__name__}: a fetch of {bb} B blocks {i}.. got {got}")

    def lease_all(store):          # leases, copied out, released and confirmed (as a connector loads)
        for i in range(0, n_blocks, 8):
            with store.acquire(ns, keys[i:i + 8], pipelined=True) as lease:
                for j, buf in zip(range(i, i + 8), lease.buffers):
                    np.copyto(outs[j], buf)

    for s in (embedded, client):
        put_all(s)  # fault the arenas in
    t = {f"{side}_{op}": [] for side in "edp" for op in ("put", "get", "lease")}
    for _ in range(repeats):   # each run measures both sides, alternately: one ratio per run
        for name, s in (("e", embedded), ("d", client)):
            s.flush(tier="host")
            t[f"{name}_put"].append(timed(lambda: put_all(s)))
        for op, fn in (("get", get_all), ("lease", lease_all)):
            sides = (("e", embedded), ("d", client)) + ((("p", pinning),) if op == "lease" and pinning else ())
            for name, s in sides:
                dst[:] = 1
                t[f"{name}_{op}"].append(timed(lambda: fn(s)))
                for j in (0, n_blocks - 1):
                    if not np.array_equal(outs[j], src[j % 4]):
                        raise AssertionError(f"{name} {op}: block {j} is not what was stored")
    params = {"block": format_size(bb), "blocks": n_blocks, "batch": 8, "runs": repeats}
    if keep:
        params["embedded"] = "blocks recorded (host.keep)"
    if not daemon_keeps:
        params["daemon"] = "blocks not recorded (host.keep = false)"
    g = lambda sec: total / sec / 1e9  # noqa: E731
    goal = None if keep or not daemon_keeps else {64 * KiB: 0.7, MiB: 0.9}.get(bb)
    out = []
    lease_goal = None if keep or not daemon_keeps else {64 * KiB: 0.7, MiB: 0.9, 16 * MiB: 0.9}.get(bb)
    for op, what in (("put", "store"), ("get", "fetch"), ("lease", "fetch, leased")):
        ratios = sorted(e / d for e, d in zip(t[f"e_{op}"], t[f"d_{op}"]))
        g_op = lease_goal if op == "lease" else goal
        note = (f"per-run ratios {', '.join(f'{r:.2f}' for r in ratios)} (median {statistics.median(ratios):.2f})"
                + (f"; goal: median >= {g_op}" if g_op else ""))
        out.append(Result(f"daemon {what}", params, g(statistics.median(t[f"d_{op}"])), "GB/s",
                          f"embedded {what}{', recorded' if keep else ''} GB/s",
                          g(statistics.median(t[f"e_{op}"])), note=note))
    if pinning is not None:
        # The leases above send the daemon nothing: its host tier never evicts here. Where it
        # evicts, each lease pins its blocks (a quiet acquire, then a release): that case, beside
        # the same embedded runs.
        ratios = sorted(e / p for e, p in zip(t["e_lease"], t["p_lease"]))
        out.append(Result("daemon fetch, leased, pinned", {**params, "pin": "every lease (as while evicting)"},
                          g(statistics.median(t["p_lease"])), "GB/s", "embedded fetch, leased GB/s",
                          g(statistics.median(t["e_lease"])),
                          note=f"per-run ratios {', '.join(f'{r:.2f}' for r in ratios)} "
                               f"(median {statistics.median(ratios):.2f}); no goal: what a lease costs "
                               "while the host tier evicts"))
    return out


# every block of a run stays in host RAM: no eviction is timed
HOST_TOML = '[host]\nslab_bytes = "64MiB"\nhigh_watermark = 1.0\nlow_watermark = 1.0\n'


def prefaulted_client(sock: str, **kw) -> Client:
    """A client that has mapped the daemon's arena ahead of use, as the engines' connectors do
    (prefault): a copy into a slot this process has not touched yet is not timed."""
    client = Client(sock, prefault=True, **kw)
    client.ping()
    deadline = time.monotonic() + 60
    while client.prefaulted_bytes < len(client._arena) and time.monotonic() < deadline:
        time.sleep(0.05)
    return client


def transfers(sizes, embedded: TieredStore, client: Client, total: int, repeats: int, **kw) -> list[Result]:
    """`transfer` at each block size, `total` bytes each, both stores emptied after each."""
    out = []
    for bb in sizes:
        out += transfer(namespace_for(bb), embedded, client, max(8, total // bb), repeats, **kw)
        embedded.flush()
        client.flush()
    return out


def _client_ops(sock: str, seconds: float, seed: int, out) -> None:
    ns = namespace_for(64 * KiB)
    c = Client(sock)
    keys = [k for i in range(16) for k in ns.block_keys(np.full(ns.block_tokens, i))]
    rng = np.random.default_rng(seed)
    n = 0
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        if rng.random() < 0.8:
            c.lookup(ns, keys)
        else:
            with c.acquire(ns, keys[:4]):
                pass
        n += 1
    out.put(n)
    c.close()


def _paced_client(sock: str, seconds: float, rate_hz: float, seed: int, start_at: float, out) -> None:
    """One engine-like client: requests at `rate_hz` (jittered), each op's latency recorded."""
    ns = namespace_for(64 * KiB)
    c = Client(sock)
    keys = [k for i in range(16) for k in ns.block_keys(np.full(ns.block_tokens, i))]
    c.lookup(ns, keys)
    rng = np.random.default_rng(seed)
    lat = []
    time.sleep(max(0.0, start_at - time.time()))
    t_next = time.perf_counter()
    deadline = t_next + seconds
    while True:
        t_next += rng.uniform(0.5, 1.5) / rate_hz
        now = time.perf_counter()
        if t_next > deadline:
            break
        if t_next > now:
            time.sleep(t_next - now)
        t0 = time.perf_counter()
        if rng.random() < 0.8:
            c.lookup(ns, keys)
        else:
            with c.acquire(ns, keys[:4]):
                pass
        lat.append(time.perf_counter() - t0)
    out.put(lat)
    c.close()


def paced_p99(sock: str, clients: int, seconds: float, rate_hz: float) -> tuple[float, float, int]:
    """(p50, p99) latency in seconds over every request of `clients` paced client processes."""
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    start_at = time.time() + 3.0 + 0.25 * clients      # every process started and connected
    procs = [ctx.Process(target=_paced_client, args=(sock, seconds, rate_hz, i, start_at, q))
             for i in range(clients)]
    for p in procs:
        p.start()
    lat = [x for _ in procs for x in q.get(timeout=start_at - time.time() + seconds + 120)]
    for p in procs:
        p.join()
    return float(np.percentile(lat, 50)), float(np.percentile(lat, 99)), len(lat)


def startup(tmp: str, host: str, repeats: int) -> list[Result]:
    """Time from exec to serving, and the RSS of the idle daemon, beside a bare interpreter."""
    best_start, rss = float("inf"), 0
    for i in range(repeats):
        d_dir = os.path.join(tmp, f"start{i}")
        os.makedirs(d_dir)
        t0 = time.perf_counter()
        d = DaemonUnderTest(d_dir, host_bytes=host)
        best_start = min(best_start, time.perf_counter() - t0)
        time.sleep(0.5)
        rss = psutil.Process(d.proc.pid).memory_info().rss
        d.stop()
    bare_start, bare_rss = float("inf"), 0
    for _ in range(repeats):
        t0 = time.perf_counter()
        p = subprocess.Popen([sys.executable, "-c", "import sys; print('up', flush=True); sys.stdin.read()"],
                             stdout=subprocess.PIPE, stdin=subprocess.PIPE)
        p.stdout.readline()
        bare_start = min(bare_start, time.perf_counter() - t0)
        bare_rss = psutil.Process(p.pid).memory_info().rss
        p.stdin.close()
        p.wait()
    return [Result("daemon start-up", {"host": host}, best_start, "s", "bare python start s", bare_start,
                   higher_is_better=False, note="exec to serving, arena reserved (posix_fallocate)"),
            Result("idle daemon RSS", {"host": host}, rss / 2 ** 20, "MiB", "bare python RSS MiB",
                   bare_rss / 2 ** 20, higher_is_better=False,
                   note="no torch imported; the host arena is mapped but untouched")]


def ops_per_second(sock: str, clients: int, seconds: float) -> float:
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_client_ops, args=(sock, seconds, i, q)) for i in range(clients)]
    for p in procs:
        p.start()
    total = sum(q.get(timeout=seconds + 60) for _ in procs)
    for p in procs:
        p.join()
    return total / seconds


def main() -> None:
    args = parse_args(__doc__.splitlines()[0])
    quick = args.quick
    total = (32 if quick else 256) * MiB
    # runs per transfer case (each a ratio beside its own embedded run, the median reported):
    # a quick run's 32 MiB is 4 batches at 1 MiB blocks, a few milliseconds, so more of them
    repeats = 7 if quick else 5
    results: list[Result] = []
    with tempfile.TemporaryDirectory(prefix="tierd-bench-daemon-") as tmp:
        # room for every block of each size (three 16 MiB blocks fill a 64 MiB slab) and staged slots
        host = 2 * max(total, 8 * 16 * MiB) + 128 * MiB
        d = DaemonUnderTest(tmp, host_bytes=str(host), toml=HOST_TOML)
        try:
            client = prefaulted_client(d.socket)
            embedded = TieredStore(host_bytes=host, host_high_watermark=1.0, host_low_watermark=1.0)
            ns = namespace_for(64 * KiB)
            keys = [k for i in range(16) for k in ns.block_keys(np.full(ns.block_tokens, i))]
            for s in (client, embedded):
                s.put(ns, keys, [kv_like(ns.block_bytes, i) for i in range(16)])
            n = 2000 if quick else 10000
            asked = Client(d.socket, use_index=False)
            nospin = Client(d.socket, use_index=False, spin_us=0)
            lat = {"e": [], "d": [], "a": [], "n": []}
            for _ in range(10):    # alternately, so that all see the same machine
                for name, s in (("e", embedded), ("d", client), ("a", asked), ("n", nospin)):
                    lat[name] += lookup_latency(s, ns, keys, n // 10, raw=True)
            pct = lambda xs, q: float(np.percentile(xs, q)) * 1e6  # noqa: E731
            p = {"keys": 16, "lookups": n}
            e50, e99 = pct(lat["e"], 50), pct(lat["e"], 99)
            results += [Result("lookup p50", {**p, "via": "shared index"}, pct(lat["d"], 50), "us",
                               "embedded p50 us", e50, higher_is_better=False),
                        Result("lookup p99", {**p, "via": "shared index"}, pct(lat["d"], 99), "us",
                               "embedded p99 us", e99, higher_is_better=False),
                        Result("lookup p50, asked", {**p, "via": "socket"}, pct(lat["a"], 50), "us",
                               "embedded p50 us", e50, higher_is_better=False),
                        Result("lookup p99, asked", {**p, "via": "socket"}, pct(lat["a"], 99), "us",
                               "embedded p99 us", e99, higher_is_better=False),
                        Result("lookup p50, asked, no busy-poll", {**p, "via": "socket", "spin_us": 0},
                               pct(lat["n"], 50), "us", "embedded p50 us", e50, higher_is_better=False)]
            asked.close()
            nospin.close()
            pinning = prefaulted_client(d.socket, pin_after_eviction_s=float("inf"))
            results += transfers((64 * KiB, MiB, 16 * MiB), embedded, client, total, repeats, pinning=pinning)
            pinning.close()
            embedded.close()
            # The daemon records every block for restarts (host.keep, its default); the embedded
            # store above does not. Beside an embedded store that does the same work (an arena
            # file in /dev/shm, blocks recorded), the ratio is what the daemon's socket adds.
            shm_dir = tempfile.mkdtemp(prefix="tierd-bench-embedded-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
            embedded = TieredStore(host_bytes=host, host_high_watermark=1.0, host_low_watermark=1.0,
                                   host_slab_bytes=64 * MiB, host_shm_path=os.path.join(shm_dir, "arena"),
                                   host_keep=True)
            results += transfers((64 * KiB, MiB), embedded, client, total, repeats, keep=True)
            embedded.close()
            # Like for like the other way: a daemon that does not record its blocks (host.keep =
            # false; its client then copies without hashing) beside the bare embedded store: the
            # data plane alone, without what keeping blocks across restarts costs either side.
            os.makedirs(os.path.join(tmp, "plain"), exist_ok=True)
            plain = DaemonUnderTest(os.path.join(tmp, "plain"), host_bytes=str(host),
                                    toml=HOST_TOML + "keep = false\n")
            try:
                pc = prefaulted_client(plain.socket)
                embedded = TieredStore(host_bytes=host, host_high_watermark=1.0, host_low_watermark=1.0)
                results += transfers((64 * KiB, MiB), embedded, pc, total, repeats, daemon_keeps=False)
                pc.close()
            finally:
                plain.stop()
            paced_s = 3.0 if quick else 10.0
            one50, one99, n1 = paced_p99(d.socket, 1, paced_s, 100.0)
            many50, many99, nm = paced_p99(d.socket, 32, paced_s, 100.0)
            pp = {"clients": 32, "rate_per_client": 100, "mix": "80% lookup, 20% acquire+release"}
            results += [Result("p50 with 32 clients", {**pp, "requests": nm}, many50 * 1e6, "us",
                               "1 client p50 us", one50 * 1e6, higher_is_better=False),
                        Result("p99 with 32 clients", {**pp, "requests": nm}, many99 * 1e6, "us",
                               "1 client p99 us", one99 * 1e6, higher_is_better=False)]
            seconds = 1.0 if quick else 4.0
            base = ops_per_second(d.socket, 1, seconds)
            for n_clients in (1, 4, 16):
                ops = base if n_clients == 1 else ops_per_second(d.socket, n_clients, seconds)
                results.append(Result("ops/s", {"clients": n_clients, "mix": "80% lookup, 20% acquire+release"},
                                      ops, "ops/s", "1 client ops/s", base))
            client.close()
            embedded.close()
        finally:
            d.stop()
            if "shm_dir" in locals():
                shutil.rmtree(shm_dir, ignore_errors=True)
        results += startup(tmp, "256MiB" if quick else "1GiB", 2 if quick else 3)
    report("daemon", results, args.json)


if __name__ == "__main__":
    main()
