"""Does routing on KV events pay? N simulated nodes, one multi-tenant, multi-turn trace.

Each node is a real tierd store with a bounded host tier, publishing its KV events (tierd's
wire format, decoded by `tierd.routing.PrefixIndex`); with `--remote` (the default where
`redis-server` is installed) they also share a remote tier on a real Redis server. The trace:
tenants with their own system prompts, RAG documents shared across tenants, conversations whose
turns extend their own history, interleaved. Policies: round-robin, least-loaded, and the
cache-aware router (`tierd.routing.Router`: longest cached prefix, tier-weighted, net of load).

Measured: the hit rate (blocks loaded / blocks asked), per policy, with and without the remote
tier. Modelled (stated assumptions, not measurements): TTFT per request from a queue per node
— prefill 1.6 ms per 16-token block (an 8B model at ~10k tokens/s), loading a block 0.02 ms
from HBM, 0.1 ms from host RAM, 0.4 ms from disk, 1.0 ms from the remote tier — with requests
arriving at 70% of the cluster's no-cache capacity. Reference point: llm-d reports an 87% hit
rate with precise prefix-cache routing on its benchmark (a different trace).

    python -m benchmarks.routing [--json PATH] [--quick] [--nodes N] [--no-remote]
"""

from __future__ import annotations

import random
import tempfile

import numpy as np

from tierd import Namespace, TieredStore
from tierd.events import EventRecorder, encode_batch
from tierd.routing import PrefixIndex, Router

from .common import Result, parse_args, report, start_redis

PREFILL_MS = 1.6
LOAD_MS = {"gpu": 0.02, "host": 0.1, "disk": 0.4, "remote": 1.0}
BLOCK_TOKENS = 16


class IndexFeed(EventRecorder):
    """Stands in for a node's ZeroMQ socket: the store records events, `flush` hands the
    encoded batches to the router's index, as a subscriber would receive them."""

    def __init__(self, node: str, index: PrefixIndex):
        super().__init__()
        self.node, self.index = node, index
        self._seq = 0

    def flush(self) -> None:
        for topic, events in self.take().items():
            self.index.apply_frames(self.node, [topic.encode(), self._seq.to_bytes(8, "big"),
                                                encode_batch(0.0, events)])
            self._seq += 1


def make_trace(seed: int, n_requests: int) -> list[list[int]]:
    """Token ids of every request, in arrival order."""
    rng = random.Random(seed)
    vocab = 32000

    def text(n_blocks):
        return [rng.randrange(vocab) for _ in range(n_blocks * BLOCK_TOKENS)]

    tenants = [text(8) for _ in range(8)]                       # system prompts
    docs = [text(rng.randint(8, 16)) for _ in range(16)]        # RAG documents, shared
    active: list[list[int]] = []
    out = []
    while len(out) < n_requests:
        if len(active) < 24 and rng.random() < 0.35 or not active:
            t = rng.choice(tenants)
            history = t + (rng.choice(docs) if rng.random() < 0.6 else []) + text(rng.randint(1, 3))
            active.append(history)
            out.append(list(history))
            continue
        i = rng.randrange(len(active))
        active[i] = active[i] + text(rng.randint(2, 4))             # the answer and the next question
        out.append(list(active[i]))
        if len(active[i]) > 60 * BLOCK_TOKENS or rng.random() < 0.1:
            active.pop(i)
    return out


def simulate(policy: str, trace: list[list[int]], n_nodes: int, remote_url: str | None,
             host_bytes: int) -> dict:
    ns = Namespace("routing-bench", "float16", 2, 2, 64, block_tokens=BLOCK_TOKENS)   # 16 KiB blocks
    index = PrefixIndex()
    router = Router(index, load_penalty=1.0)
    names = [f"node{i}" for i in range(n_nodes)]
    stores, feeds = {}, {}
    for n in names:
        stores[n] = TieredStore(host_bytes=host_bytes, host_slab_bytes=1 << 20, remote_url=remote_url or "",
                                remote_queue_blocks=4096)
        feeds[n] = IndexFeed(n, index)
        stores[n].attach_events(feeds[n])
    zero = np.zeros(ns.block_bytes, dtype=np.uint8)
    blocks_per_req = np.mean([len(t) // BLOCK_TOKENS for t in trace])
    gap_ms = blocks_per_req * PREFILL_MS / n_nodes / 0.7          # 70% of no-cache capacity
    busy = dict.fromkeys(names, 0.0)
    asked = hit = 0
    ttft = []
    rr = 0
    try:
        for i, tokens in enumerate(trace):
            now = i * gap_ms
            keys = ns.block_keys(np.asarray(tokens))
            for f in feeds.values():
                f.flush()
            if policy == "round-robin":
                node = names[rr % n_nodes]
                rr += 1
            elif policy == "least-loaded":
                node = min(names, key=lambda n: busy[n])
            else:
                loads = {n: max(0.0, busy[n] - now) / PREFILL_MS for n in names}
                node = router.route(keys, names, loads)
            s = stores[node]
            with s.acquire(ns, keys) as lease:
                tiers = list(lease.tiers)
            missing = keys[len(tiers):]
            if missing:
                s.put(ns, missing, [zero] * len(missing), parent=keys[len(tiers) - 1] if tiers else None)
            asked += len(keys)
            hit += len(tiers)
            service = sum(LOAD_MS[t] for t in tiers) + len(missing) * PREFILL_MS
            start = max(now, busy[node])
            busy[node] = start + service
            ttft.append(busy[node] - now)
    finally:
        for s in stores.values():
            s.close()
    return {"hit_rate": hit / asked, "ttft_mean_ms": float(np.mean(ttft)), "ttft_p90_ms": float(np.percentile(ttft, 90)),
            "events": index.events}


def main() -> None:
    args = parse_args(__doc__.splitlines()[0], lambda ap: (
        ap.add_argument("--nodes", type=int, default=4), ap.add_argument("--no-remote", action="store_true")))
    n_requests = 400 if args.quick else 2000
    trace = make_trace(7, n_requests)
    host_bytes = 4 << 20            # 256 blocks per node: capacity matters
    results: list[Result] = []
    with tempfile.TemporaryDirectory(prefix="tierd-bench-routing-") as tmp:
        proc, url = (None, None) if args.no_remote else start_redis(tmp)
        try:
            setups = [("local tiers", None)] + ([("with remote tier", url)] if url else [])
            for label, remote in setups:
                figures = {}
                for policy in ("round-robin", "least-loaded", "cache-aware"):
                    if remote:
                        import redis
                        redis.Redis.from_url(remote).flushall()
                    figures[policy] = simulate(policy, trace, args.nodes, remote, host_bytes)
                base = figures["round-robin"]
                for policy, f in figures.items():
                    p = {"nodes": args.nodes, "requests": n_requests, "setup": label, "policy": policy}
                    results.append(Result("hit rate", p, 100 * f["hit_rate"], "%", "round-robin hit rate %",
                                          100 * base["hit_rate"]))
                    results.append(Result("modelled TTFT mean", p, f["ttft_mean_ms"], "ms",
                                          "round-robin TTFT mean ms", base["ttft_mean_ms"], higher_is_better=False))
                    results.append(Result("modelled TTFT p90", p, f["ttft_p90_ms"], "ms",
                                          "round-robin TTFT p90 ms", base["ttft_p90_ms"], higher_is_better=False))
            if url is None and not args.no_remote:
                print("(no redis-server: the remote-tier rows are left out; `make redis` installs it)")
        finally:
            if proc is not None:
                proc.terminate()
                proc.wait(10)
    report("routing", results, args.json)


if __name__ == "__main__":
    main()
