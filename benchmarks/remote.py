"""How close does the remote tier come to the Redis server it runs on?

  write GB/s          blocks a node holds in host RAM sent to the server (`sync --remote`, write-
                      behind off), beside redis-py pipelined SETs of the same bytes in batches of
                      the same size: the tier's own rate
  write-behind GB/s   blocks put through one node's daemon until the server has them all (the put
                      into host RAM included, on the same 2 cores), beside the same SETs
  fetch GB/s          a second node loading those blocks (verified, into its host RAM), beside
                      redis-py pipelined GETs of the same keys' values
  (goal: >= 0.8 of raw redis-py each way, for write and fetch)

One `redis-server` on a loopback port (Debian's package; `make redis` installs it), alternating
the two sides, best of each. The raw client is made with the tier's connection options (hiredis's
reply parser where installed, redis-py's zero-copy command packer), so the ratio is what tierd
adds: headers, checksums, verification, the copy into host RAM and the store's bookkeeping.

    python -m benchmarks.remote [--json PATH] [--quick]
"""

from __future__ import annotations

import shutil
import tempfile
import time

import numpy as np

from tierd import TieredStore
from tierd.client import Client
from tierd.config import MiB, format_size
from tierd.tiers.remote import RemoteTier, WriteBehind, connection_options

from .common import DaemonUnderTest, Result, parse_args, report, start_redis
from .tiers import kv_like, namespace_for


def bench(url: str, block_bytes: int, n_blocks: int, repeats: int) -> list[Result]:
    """Both nodes live through every round (warm arenas and buffers, as a running daemon's);
    each round uses new keys, so nothing is already on the server."""
    import redis
    ns = namespace_for(block_bytes)
    src = [kv_like(block_bytes, seed=i) for i in range(4)]
    raw = redis.Redis.from_url(url, **connection_options())   # sends and parses as the tier does
    batch = WriteBehind.BATCH          # the write-behind's blocks per round trip
    total = n_blocks * block_bytes
    host = total + 64 * MiB
    best = dict.fromkeys(("w", "p", "rw", "r", "rr"), float("inf"))
    values = [bytes(src[i % 4]) for i in range(n_blocks)]
    kw = dict(host_bytes=host, host_high_watermark=1.0, host_low_watermark=1.0, remote_url=url,
              remote_queue_blocks=max(256, n_blocks))
    # node A is a daemon (its write-behind runs beside, not inside, the process that puts, as
    # on a real node); node B an embedded store
    toml = (f'[remote]\nurl = "{url}"\nqueue_blocks = {max(256, n_blocks)}\n'
            '[host]\nhigh_watermark = 1.0\nlow_watermark = 1.0\n')
    d = DaemonUnderTest(tempfile.mkdtemp(prefix="tierd-bench-remote-a-"), host_bytes=str(host), toml=toml)
    a = Client(d.socket)
    # node C holds the blocks first and then sends them (sync --remote): the tier's own rate
    dc = DaemonUnderTest(tempfile.mkdtemp(prefix="tierd-bench-remote-c-"), host_bytes=str(host),
                         toml=toml.replace("[remote]\n", "[remote]\nwrite_behind = false\n"))
    c = Client(dc.socket)
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
            a.sync()                              # returns once the write-behind queue is empty
            t_w = time.perf_counter() - t0
            assert a.stats()["tiers"]["remote"]["writes"] == written + n_blocks
            raw.flushall()
            c.flush("host")
            for i in range(0, n_blocks, 8):
                c.put(ns, keys[i:i + 8], [src[j % 4] for j in range(i, min(i + 8, n_blocks))])
            t0 = time.perf_counter()
            pushed, pending = c.push_remote()     # host RAM -> server, nothing else running
            t_p = time.perf_counter() - t0
            assert pushed == n_blocks and pending == 0, (pushed, pending)
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
                for name, t in (("w", t_w), ("p", t_p), ("r", t_r), ("rw", t_rw), ("rr", t_rr)):
                    best[name] = min(best[name], t)
    a.close()
    c.close()
    d.stop()
    dc.stop()
    for daemon in (d, dc):
        shutil.rmtree(daemon.workdir, ignore_errors=True)
    g = lambda s: total / s / 1e9  # noqa: E731
    p = {"block": format_size(block_bytes), "blocks": n_blocks, "batch": batch}
    return [Result("remote write (host RAM -> server)", p, g(best["p"]), "GB/s", "redis-py pipelined SET GB/s", g(best["rw"])),
            Result("remote write-behind (put -> server)", p, g(best["w"]), "GB/s", "redis-py pipelined SET GB/s", g(best["rw"])),
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
                results += bench(url, bb, total // bb, 3 if args.quick else 5)
        finally:
            proc.terminate()
            proc.wait(10)
    report("remote", results, args.json)


if __name__ == "__main__":
    main()
