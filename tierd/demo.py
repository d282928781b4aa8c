"""`make run`: tierd end to end.

The default run is a multi-turn chat through the bundled engine with a tierd daemon (or the
embedded store with --embedded): conversations share a system prompt; the engine is restarted
and then the daemon, and each turn prints its time to first token, the prompt tokens served from
cache and the tier they came from. The model has random weights (built once and cached); the
timings are real.

`--store-only` runs the store alone: put, sync, reopen in a new process, get bit-exact.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time

import numpy as np

from . import Namespace, TieredStore
from .config import format_size
from .report import format_stats

# The bench model's KV layout (8 layers, 4 KV heads of 64, fp16), 256-token tier blocks.
NS = Namespace(model="tierd-demo-model", kv_dtype="float16", num_layers=8, num_kv_heads=4,
               head_dim=64, block_tokens=256)
SYSTEM_PROMPT = 1024   # tokens shared by every conversation
USER_PROMPT = 768


def prompt_tokens(user: int) -> np.ndarray:
    rng_sys, rng_user = np.random.default_rng(0), np.random.default_rng(100 + user)
    return np.concatenate([rng_sys.integers(0, 32000, SYSTEM_PROMPT),
                           rng_user.integers(0, 32000, USER_PROMPT)])


def kv_block(key: bytes) -> np.ndarray:
    """(num_layers, 2, block_tokens, kv_heads, head_dim) fp16 with channel-wise scales."""
    rng = np.random.default_rng(int.from_bytes(key[:8], "little"))
    scale = rng.uniform(0.05, 2.0, NS.head_dim).astype(np.float32)
    return (rng.standard_normal(NS.block_shape, dtype=np.float32) * scale).astype(np.float16)


def config(disk_dir: str) -> dict:
    return dict(host_bytes="64MiB", host_slab_bytes="16MiB", disk_path=disk_dir,
                disk_bytes="256MiB", disk_slab_bytes="32MiB", disk_file_bytes="128MiB")


def write_phase(disk_dir: str) -> None:
    print(f"namespace {NS.name}: {NS.num_layers} layers x {NS.num_kv_heads} KV heads x "
          f"{NS.head_dim} ({NS.kv_dtype}), {NS.block_tokens}-token blocks of {format_size(NS.block_bytes)}")
    with TieredStore(**config(disk_dir)) as store:
        for user in range(3):
            toks = prompt_tokens(user)
            keys = NS.block_keys(toks)
            hit = store.lookup(NS, keys)
            blocks = [kv_block(k) for k in keys]
            t0 = time.perf_counter()
            stored = store.put(NS, keys, blocks)
            dt = time.perf_counter() - t0
            print(f"conversation {user}: {len(toks)} prompt tokens, {len(keys)} full blocks, "
                  f"{hit} already cached (shared system prompt), stored {stored} in {dt * 1e3:.1f} ms")
        t0 = time.perf_counter()
        n = store.sync()
        print(f"sync: wrote {n} blocks to disk durably in {(time.perf_counter() - t0) * 1e3:.1f} ms")
    print("store closed (index checkpoint written)\n")


def read_phase(disk_dir: str) -> None:
    t0 = time.perf_counter()
    with TieredStore(**config(disk_dir)) as store:
        print(f"new process {__import__('os').getpid()}: reopened the disk tier in "
              f"{(time.perf_counter() - t0) * 1e3:.1f} ms "
              f"(index from {store.stats()['tiers']['disk']['recovered_from']})")
        for user in (2, 0, 1):
            keys = NS.block_keys(prompt_tokens(user))
            t0 = time.perf_counter()
            with store.acquire(NS, keys) as lease:
                dt = time.perf_counter() - t0
                ok = all(np.array_equal(buf, kv_block(k).reshape(-1).view(np.uint8))
                         for k, buf in zip(lease.keys, lease.buffers))
                tiers = ", ".join(f"{t}: {lease.tiers.count(t)}" for t in ("host", "disk")
                                  if lease.tiers.count(t))
                print(f"conversation {user}: {len(lease)}/{len(keys)} blocks loaded in {dt * 1e3:.1f} ms "
                      f"({tiers}) -- {'bit-exact' if ok else 'MISMATCH'}")
                if not ok:
                    sys.exit(1)
        print()
        print(format_stats(store.stats()))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m tierd.demo", description=__doc__.splitlines()[0])
    ap.add_argument("--dir", help="disk tier directory (default: a temporary one)")
    ap.add_argument("--embedded", action="store_true", help="the store in this process, no daemon")
    ap.add_argument("--store-only", action="store_true", help="the store alone, synthetic KV bytes")
    ap.add_argument("--conversations", type=int, default=3)
    ap.add_argument("--read-only-phase", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.read_only_phase:
        read_phase(args.dir)
        return
    if not args.store_only:
        from .chat_demo import run_chat_demo
        run_chat_demo(embedded=args.embedded, conversations=args.conversations)
        return
    print("tierd demo -- synthetic KV bytes, real timings\n")
    with tempfile.TemporaryDirectory(prefix="tierd-demo-") as tmp:
        disk_dir = args.dir or tmp
        write_phase(disk_dir)
        subprocess.run([sys.executable, "-m", "tierd.demo", "--dir", disk_dir, "--read-only-phase"],
                       check=True)


if __name__ == "__main__":
    main()
