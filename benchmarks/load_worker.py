"""One load-generating process: `python -m benchmarks.load_worker SOCKET SEED THREADS SECONDS`.

Each thread is its own client connection doing a random mix of put, get, lookup, acquire +
release, reserve + abort and where over a shared key space for SECONDS, checking every block it
reads bit-exact. Prints one JSON line: per op the latencies' count and percentiles, errors and
blocks verified.
"""

import json
import random
import sys
import threading
import time

import numpy as np

import tierd
from tierd import Namespace

OPS = ("put", "get", "lookup", "acquire", "reserve", "where")


def namespace() -> Namespace:
    return Namespace("load-model", "float16", 2, 2, 64, block_tokens=16)   # 16 KiB blocks


def content(ns: Namespace, key: bytes) -> np.ndarray:
    rng = np.random.default_rng(int.from_bytes(key[:8], "little"))
    return rng.integers(0, 256, ns.block_bytes, dtype=np.uint8)


def chain_keys(ns: Namespace, seed: int) -> list[bytes]:
    toks = np.random.default_rng(seed).integers(0, 32000, 4 * ns.block_tokens)
    return ns.block_keys(toks)


def client_loop(sock: str, seed: int, seconds: float, out: dict) -> None:
    rng = random.Random(seed)
    ns = namespace()
    lat = {op: [] for op in OPS}
    errors, verified = [], 0
    c = tierd.connect(f"unix://{sock}")
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        op = rng.choice(OPS)
        keys = chain_keys(ns, rng.randrange(2000))
        t0 = time.perf_counter()
        try:
            if op == "put":
                c.put(ns, keys, [content(ns, k) for k in keys])
            elif op == "get":
                for blk, k in zip(c.get(ns, keys), keys):
                    if blk.tobytes() != content(ns, k).tobytes():
                        errors.append(f"wrong bytes for {k.hex()}")
                    verified += 1
            elif op == "lookup":
                c.lookup(ns, keys)
            elif op == "acquire":
                with c.acquire(ns, keys) as lease:
                    for buf, k in zip(lease.buffers, keys):
                        if bytes(buf[:64]) != content(ns, k)[:64].tobytes():
                            errors.append(f"wrong lease bytes for {k.hex()}")
                        verified += 1
            elif op == "reserve":
                c.abort(c.reserve(ns, keys))
            else:
                c.where(ns, keys)
        except Exception as e:  # noqa: BLE001 -- every failure is reported
            errors.append(f"{op}: {e!r}")
        lat[op].append(time.perf_counter() - t0)
    c.close()
    out[seed] = (lat, errors, verified)


def main() -> int:
    sock, seed, threads, seconds = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])
    out: dict = {}
    ts = [threading.Thread(target=client_loop, args=(sock, seed * 1000 + i, seconds, out)) for i in range(threads)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    lat = {op: [x for v in out.values() for x in v[0][op]] for op in OPS}
    print(json.dumps({"latencies": lat, "errors": [e for v in out.values() for e in v[1]][:20],
                      "n_errors": sum(len(v[1]) for v in out.values()),
                      "verified": sum(v[2] for v in out.values())}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
