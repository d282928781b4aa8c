"""How close does the remote tier come to the Redis server it runs on?

  write-behind GB/s   blocks put through one node's daemon until the server has them all,
                      beside redis-py pipelined SETs of the same bytes in batches of the same size
  fetch GB/s          a second node loading those blocks (verified, into its host RAM), beside
                      redis-py pipelined GETs of the same keys' values
  (goal: >= 0.8 of raw redis-py each way)

One `redis-server` on a loopback port (Debian's package; `make redis` installs it), alternating
the two sides, best of each.

    python -m benchmarks.remote [--json PATH] [--quick]
"""

from __future__ import annotations

import tempfile
import time

import numpy as np

from tierd import TieredStore
from tierd.client import Client
from tierd.config import MiB, format_size
from tierd.tiers.remote import RemoteTier

from .common import DaemonUnderTest, Result, parse_args, report, start_redis
from .tiers import kv_like, namespace_for


def bench(url: str, block_bytes: int, n_blocks: int, repeats: int) -> list[Result]:
    """Both nodes live through every round (warm arenas and buffers, as a running daemon's);
    each round uses new keys, so nothing is already on the server."""
    import redis
    ns = namespace_for(block_bytes)
    src = [kv_like(block_bytes, seed=i) for i in range(4)]
    raw = redis.Redis.from_url(url)
    batch = TieredStore.REMOTE_BATCH
    total = n_blocks * block_bytes
    host = total + 64 * MiB
    best = {"w": float("inf"), "rw": float("inf"), "r": float("inf"), "rr": float("inf")}
    values = [bytes(src[i % 4]) for i in range(n_blocks)]
    kw = dict(host_bytes=host, host_high_watermark=1.0, host_low_watermark=1.0, remote_url=url,
              remote_queue_blocks=max(256, n_blocks))
    # node A is a daemon (its write-behind runs beside, not inside, the process that puts, as
    # on a real node); node B an embedded store
    d = DaemonUnderTest(tempfile.mkdtemp(prefix="tierd-bench-remote-a-"), host_bytes=str(host),
                        toml=f'[remote]\nurl = "{url}"\nqueue_blocks = {max(256, n_blocks)}\n'
                             '[host]\nhigh_watermark = 1.0\nlow_watermark = 1.0\n')
    a = Client(d.socket)
    with TieredStore(**kw) as b:
        for rnd in range(repeats + 1):          # round 0 warms up
            keys = [k for i in range(n_blocks) for k in ns.block_keys(np.full(ns.block_tokens, i + rnd * n_blocks))]
            raw.flushall()
            a.flush("host")
            b.flush("host")
            written = a.stats()["tiers"]["remote"]["writes"]
            t0 = time.perf_counter()
            for i in range(0, n_blocks, 8):       # node A puts; its write-behind fills the server
                a.put(ns, keys[i:i + 8], [src[j % 4] for j in range(i, min(i + 8, n_blocks))])
            while a.stats()["tiers"]["remote"]["writes"] < written + n_blocks:
                time.sleep(0.002)
            t_w = time.perf_counter() - t0
            t0 = time.perf_counter()
            for i in range(0, n_blocks, batch):   # node B loads them, verified, into its host RAM
                with b.acquire(ns, keys[i:i + batch]) as lease:
                    assert len(lease) == min(batch, n_blocks - i)
            t_r = time.perf_counter() - t0
            assert np.array_equal(b.get(ns, keys[:1])[0], src[0])
            raw.flushall()                        # raw redis-py: same bytes, same batches
            rkeys = [RemoteTier.rkey(ns.id, k) for k in keys]
            t0 = time.perf_counter()
            for i in range(0, n_blocks, batch):
                pipe = raw.pipeline(transaction=False)
                for k, v in zip(rkeys[i:i + batch], values[i:i + batch]):
                    pipe.set(k, v)
                pipe.execute()
            t_rw = time.perf_counter() - t0
            t0 = time.perf_counter()
            for i in range(0, n_blocks, batch):
                pipe = raw.pipeline(transaction=False)
                for k in rkeys[i:i + batch]:
                    pipe.get(k)
                out = pipe.execute()
                assert all(v is not None for v in out)
            t_rr = time.perf_counter() - t0
            if rnd:
                for name, t in (("w", t_w), ("r", t_r), ("rw", t_rw), ("rr", t_rr)):
                    best[name] = min(best[name], t)
    a.close()
    d.stop()
    g = lambda s: total / s / 1e9  # noqa: E731
    p = {"block": format_size(block_bytes), "blocks": n_blocks, "batch": batch}
    return [Result("remote write-behind", p, g(best["w"]), "GB/s", "redis-py pipelined SET GB/s", g(best["rw"])),
            Result("remote fetch", p, g(best["r"]), "GB/s", "redis-py pipelined GET GB/s", g(best["rr"]))]


def main() -> None:
    args = parse_args(__doc__.splitlines()[0])
    results: list[Result] = []
    with tempfile.TemporaryDirectory(prefix="tierd-bench-remote-") as tmp:
        proc, url = start_redis(tmp)
        if proc is None:
            raise SystemExit("redis-server is not installed (make redis)")
        try:
            total = (64 if args.quick else 256) * MiB
            for bb in ((256 << 10, 1 * MiB) if not args.quick else (1 * MiB,)):
                results += bench(url, bb, total // bb, 2 if args.quick else 3)
        finally:
            proc.terminate()
            proc.wait(10)
    report("remote", results, args.json)


if __name__ == "__main__":
    main()
