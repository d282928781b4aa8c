"""What does going through the daemon cost?

  lookup latency p50/p99 over the socket      beside the same lookup on an embedded store
  store / fetch GB/s through the daemon       beside the embedded store, same blocks, same run,
                                              measured alternately (goal >= 0.8x at >= 1 MiB)
  ops/s with 1, 4 and 16 client processes     beside 1 client (scaling)

    python -m benchmarks.daemon [--json PATH] [--quick]
"""

from __future__ import annotations

import multiprocessing as mp
import tempfile
import time

import numpy as np

from tierd import Namespace, TieredStore
from tierd.client import Client
from tierd.config import MiB, format_size

from .common import DaemonUnderTest, Result, parse_args, report
from .tiers import kv_like, namespace_for, timed

KiB = 1024


def lookup_latency(store, ns: Namespace, keys: list[bytes], n: int) -> tuple[float, float]:
    lat = np.empty(n)
    for i in range(n):
        t0 = time.perf_counter()
        store.lookup(ns, keys)
        lat[i] = time.perf_counter() - t0
    return float(np.percentile(lat, 50)), float(np.percentile(lat, 99))


def transfer(ns: Namespace, embedded: TieredStore, client: Client, n_blocks: int, repeats: int):
    bb = ns.block_bytes
    keys = [k for i in range(n_blocks) for k in ns.block_keys(np.full(ns.block_tokens, i))]
    src = [kv_like(bb, seed=i) for i in range(4)]
    dst = np.empty(n_blocks * bb, dtype=np.uint8)
    dst[:] = 1
    total = n_blocks * bb

    def put_all(store):
        for i in range(0, n_blocks, 8):
            store.put(ns, keys[i:i + 8], [src[j % 4] for j in range(i, min(i + 8, n_blocks))])

    def get_all(store):
        for i in range(0, n_blocks, 8):
            with store.acquire(ns, keys[i:i + 8]) as lease:
                for j, buf in zip(range(i, i + 8), lease.buffers):
                    np.copyto(dst[j * bb:(j + 1) * bb], buf)

    for s in (embedded, client):
        put_all(s)  # fault the arenas in
    t = {k: float("inf") for k in ("e_put", "d_put", "e_get", "d_get")}
    for _ in range(repeats):
        for name, s in (("e", embedded), ("d", client)):
            s.flush(tier="host")
            t[f"{name}_put"] = min(t[f"{name}_put"], timed(lambda: put_all(s)))
        for name, s in (("e", embedded), ("d", client)):
            t[f"{name}_get"] = min(t[f"{name}_get"], timed(lambda: get_all(s)))
    assert np.array_equal(dst[:bb], src[0])
    params = {"block": format_size(bb), "blocks": n_blocks, "batch": 8}
    g = lambda sec: total / sec / 1e9  # noqa: E731
    return [Result("daemon store", params, g(t["d_put"]), "GB/s", "embedded store GB/s", g(t["e_put"])),
            Result("daemon fetch", params, g(t["d_get"]), "GB/s", "embedded fetch GB/s", g(t["e_get"]))]


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
    repeats = 3 if quick else 5
    results: list[Result] = []
    with tempfile.TemporaryDirectory(prefix="tierd-bench-daemon-") as tmp:
        host = total + 64 * MiB
        d = DaemonUnderTest(tmp, host_bytes=str(host), toml='[host]\nslab_bytes = "64MiB"\n'
                            'high_watermark = 1.0\nlow_watermark = 1.0\n')
        try:
            client = Client(d.socket)
            embedded = TieredStore(host_bytes=host, host_high_watermark=1.0, host_low_watermark=1.0)
            ns = namespace_for(64 * KiB)
            keys = [k for i in range(16) for k in ns.block_keys(np.full(ns.block_tokens, i))]
            for s in (client, embedded):
                s.put(ns, keys, [kv_like(ns.block_bytes, i) for i in range(16)])
            n = 500 if quick else 5000
            e50, e99 = lookup_latency(embedded, ns, keys, n)
            d50, d99 = lookup_latency(client, ns, keys, n)
            p = {"keys": 16, "lookups": n}
            results += [Result("lookup p50", p, d50 * 1e6, "us", "embedded p50 us", e50 * 1e6, higher_is_better=False),
                        Result("lookup p99", p, d99 * 1e6, "us", "embedded p99 us", e99 * 1e6, higher_is_better=False)]
            for bb in (64 * KiB, 1 * MiB, 16 * MiB):
                ns_b = namespace_for(bb)
                results += transfer(ns_b, embedded, client, max(8, total // bb), repeats)
                embedded.flush()
                client.flush()
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
    report("daemon", results, args.json)


if __name__ == "__main__":
    main()
