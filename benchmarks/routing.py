"""How close does routing on KV events come to the trace's ceiling? N simulated nodes, two traces.

Each node is a real tierd store (an LRU host tier of `--capacity` blocks) that publishes its KV
events; they reach the router late, as they would. Two seeded traces: chat with returning users,
and RAG with shared documents. Policies: round-robin, least-loaded, and cache-aware
(`tierd.routing.Router`, which sees only the events, the queues and its own decisions).

Figures per trace and policy: the hit rate beside the trace's ceiling (a greedy oracle that reads
every node's true cache at each request, under the same 1.2x load cap), the load imbalance (max
over mean prefill per node), and the hit rate beside the capacity bound (optimal offline eviction
on one cache of all the nodes' memory). A modelled TTFT (a queue per node) is printed for
information.

Method (the traces, the router's settings, the oracle and the bounds, the model's assumptions):
docs/benchmarks.md#routing.

    python -m benchmarks.routing [--json PATH] [--quick] [--nodes N] [--capacity BLOCKS]
"""

from __future__ import annotations

import random
from collections import deque

import numpy as np

from tierd import Namespace, TieredStore
from tierd.events import EventRecorder, encode_batch
from tierd.routing import PrefixIndex, Router, WorkWindow, within_cap

from .common import Result, parse_args, report

PREFILL_MS = 1.6
LOAD_MS = 0.1                 # one block from host RAM
PUBLISH_MS = 20.0             # the event publisher's batching interval
BLOCK_TOKENS = 16
UTILIZATION = 0.7             # arrivals as a share of the cluster's no-cache prefill capacity
MAX_IMBALANCE = 1.2           # the balance budget: the cap for the router and the oracle alike
WINDOW_PER_NODE = 50          # requests per node in the load window (the cap's and the measure's)
REMEMBER = 16                 # the router's own recent decisions it counts until events arrive
QUEUE_PENALTY = 0.25          # the router's score lost per block of prefill queued on the node
VOCAB = 32000

NS = Namespace("routing-bench", "float16", 2, 2, 64, block_tokens=BLOCK_TOKENS)   # 16 KiB blocks

POLICIES = ("round-robin", "least-loaded", "cache-aware, before", "cache-aware", "ceiling", "oracle, no cap")


class IndexFeed(EventRecorder):
    """Stands in for a node's ZeroMQ socket: the store records events; `hold(at_ms)` stamps
    what was recorded since with the time it is published; `flush(now_ms)` hands the router's
    index every batch published by then, encoded as a subscriber would receive it (no
    `now_ms`: everything)."""

    def __init__(self, node: str, index: PrefixIndex):
        super().__init__()
        self.node, self.index = node, index
        self._seq = 0
        self._held: deque[tuple[float, str, list]] = deque()

    def hold(self, at_ms: float) -> None:
        for topic, events in self.take().items():
            self._held.append((at_ms, topic, events))

    def flush(self, now_ms: float | None = None) -> None:
        self.hold(float("-inf"))
        while self._held and (now_ms is None or self._held[0][0] <= now_ms):
            _, topic, events = self._held.popleft()
            self.index.apply_frames(self.node, [topic.encode(), self._seq.to_bytes(8, "big"),
                                                encode_batch(0.0, events)])
            self._seq += 1


def _text(rng: random.Random, n_blocks: int) -> list[int]:
    return [rng.randrange(VOCAB) for _ in range(n_blocks * BLOCK_TOKENS)]


def chat_trace(seed: int, n_requests: int) -> list[list[int]]:
    """Returning users' multi-turn chats (see the module's docstring): token ids per request."""
    rng = random.Random(seed)
    systems = [_text(rng, 8) for _ in range(8)]
    open_, closed, out = [], [], []
    while len(out) < n_requests:
        if not open_ or (len(open_) < 32 and rng.random() < 0.25):
            if closed and rng.random() < 0.3:
                conv = closed.pop(rng.randrange(len(closed))) + _text(rng, rng.randint(2, 3))
            else:
                conv = rng.choice(systems) + _text(rng, rng.randint(1, 4))
            open_.append(conv)
            out.append(conv)
            continue
        i = rng.randrange(len(open_))
        open_[i] = open_[i] + _text(rng, rng.randint(2, 6))
        out.append(open_[i])
        if len(open_[i]) >= 64 * BLOCK_TOKENS or rng.random() < 0.15:
            closed.append(open_.pop(i))
    return out


def rag_trace(seed: int, n_requests: int) -> list[list[int]]:
    """Queries over shared documents (see the module's docstring): token ids per request."""
    rng = random.Random(seed)
    systems = [_text(rng, 4) for _ in range(2)]
    docs = [_text(rng, rng.randint(8, 32)) for _ in range(48)]
    popularity = [1.0 / (r + 1) for r in range(len(docs))]
    out = []
    while len(out) < n_requests:
        picked = rng.choices(range(len(docs)), popularity, k=2 if rng.random() < 0.3 else 1)
        out.append(rng.choice(systems) + sum((docs[d] for d in picked), []) + _text(rng, rng.randint(1, 2)))
    return out


TRACES = {"chat": (chat_trace, 11), "rag": (rag_trace, 13)}


def unbounded(keys_list: list[list[bytes]]) -> float:
    """Hit rate with one node of unlimited memory: a block is a hit if its prefix was seen."""
    seen: set[bytes] = set()
    hit = asked = 0
    for keys in keys_list:
        n = 0
        while n < len(keys) and keys[n] in seen:
            n += 1
        hit += n
        asked += len(keys)
        seen.update(keys)
    return hit / asked


def capacity_bound(keys_list: list[list[bytes]], capacity_blocks: int) -> float:
    """An upper bound on the hit rate of any routing and any eviction on nodes of
    `capacity_blocks` in all: Belady's optimal offline replacement (evict the block used again
    farthest in the future, or do not admit one that is) on one cache of that many blocks plus
    the longest prompt, over every request's blocks in order, a block counted as a hit whenever
    it is present (prefix or not). Why it bounds: the blocks the nodes hold together never
    number more than their capacities, and a cache that keeps that union (plus the request
    being served) hits wherever some node could; MIN hits at least as often as that cache."""
    seq = [k for keys in keys_list for k in keys]
    return belady_hits(seq, capacity_blocks + max(len(k) for k in keys_list)) / len(seq)


def belady_hits(seq: list, size: int) -> int:
    """Hits of Belady's MIN on `seq` with a cache of `size` entries, admission optional: the
    most hits any replacement policy can get."""
    import heapq
    nxt = [0] * len(seq)
    last: dict = {}
    never = len(seq)
    for i in range(len(seq) - 1, -1, -1):
        nxt[i] = last.get(seq[i], never)
        last[seq[i]] = i
    cache: dict = {}                      # key -> position of its next use
    heap: list = []                       # (-next use, key), stale entries skipped
    hit = 0
    for i, k in enumerate(seq):
        if k in cache:
            hit += 1
        elif len(cache) >= size:
            while -heap[0][0] != cache.get(heap[0][1]):
                heapq.heappop(heap)
            if -heap[0][0] <= nxt[i]:
                continue                  # nothing held is needed later than this one: not admitted
            del cache[heapq.heappop(heap)[1]]
        cache[k] = nxt[i]
        heapq.heappush(heap, (-nxt[i], k))
    return hit


def trace_stats(keys_list: list[list[bytes]]) -> dict:
    """Prompt length and reuse distance (requests since the last one that held the longest
    prefix this one shares with any earlier request; over requests that share one)."""
    last: dict[bytes, int] = {}
    dist = []
    for i, keys in enumerate(keys_list):
        n = 0
        while n < len(keys) and keys[n] in last:
            n += 1
        if n:
            dist.append(i - last[keys[n - 1]])
        for k in keys:
            last[k] = i
    lengths = [len(k) for k in keys_list]
    return {"prompt_blocks_mean": float(np.mean(lengths)), "prompt_blocks_max": int(max(lengths)),
            "reuse_distance_p50": float(np.percentile(dist, 50)) if dist else 0.0,
            "reuse_distance_p90": float(np.percentile(dist, 90)) if dist else 0.0,
            "sharing_requests": len(dist) / len(keys_list)}


def simulate(policy: str, keys_list: list[list[bytes]], n_nodes: int, capacity_blocks: int) -> dict:
    """One run of `policy` over the trace's keys on `n_nodes` fresh nodes."""
    names = [f"node{i}" for i in range(n_nodes)]
    window = WINDOW_PER_NODE * n_nodes
    index = PrefixIndex()
    router = Router(index, load_penalty=QUEUE_PENALTY, max_imbalance=MAX_IMBALANCE, window=window, remember=REMEMBER)
    before = Router(index, load_penalty=1.0)
    oracle_work = WorkWindow(window)
    stores, feeds = {}, {}
    for n in names:
        # watermarks at 1.0: no background demoter, eviction happens in the put that needs room,
        # so every run is deterministic
        stores[n] = TieredStore(host_bytes=capacity_blocks * NS.block_bytes, host_slab_bytes=64 * NS.block_bytes,
                                host_high_watermark=1.0, host_low_watermark=1.0)
        feeds[n] = IndexFeed(n, index)
        stores[n].attach_events(feeds[n])
    zero = np.zeros(NS.block_bytes, dtype=np.uint8)
    gap_ms = float(np.mean([len(k) for k in keys_list])) * PREFILL_MS / n_nodes / UTILIZATION
    busy = dict.fromkeys(names, 0.0)
    prefill = dict.fromkeys(names, 0)
    taken = dict.fromkeys(names, 0)
    spans, span = [], dict.fromkeys(names, 0)       # prefill per node in consecutive windows
    asked = hit = 0
    ttft = []
    try:
        for i, keys in enumerate(keys_list):
            now = i * gap_ms
            for f in feeds.values():
                f.flush(now)
            queued = {n: max(0.0, busy[n] - now) / PREFILL_MS for n in names}   # what engines report
            if policy == "round-robin":
                node = names[i % n_nodes]
            elif policy == "least-loaded":
                node = min(names, key=lambda n: busy[n])
            elif policy == "cache-aware":
                node = router.route(keys, names, queued)
            elif policy == "cache-aware, before":        # the router as this benchmark ran it before
                node = before.route(keys, names, queued)
            else:                                   # the oracles: the caches' true contents, now
                held = {n: stores[n].lookup(NS, keys) for n in names}
                costs = {n: len(keys) - held[n] for n in names}
                loads = oracle_work.loads()
                allowed = names if policy == "oracle, no cap" else within_cap(names, loads, costs, MAX_IMBALANCE)
                node = max(allowed, key=lambda n: (held[n], -loads.get(n, 0.0)))
                oracle_work.add(node, costs[node])
            s = stores[node]
            with s.acquire(NS, keys) as lease:
                n_hit = len(lease.tiers)
            missing = keys[n_hit:]
            if missing:
                s.put(NS, missing, [zero] * len(missing), parent=keys[n_hit - 1] if n_hit else None)
            asked += len(keys)
            hit += n_hit
            prefill[node] += len(missing)
            span[node] += len(missing)
            if (i + 1) % window == 0:
                spans.append(max(span.values()) / max(1e-9, float(np.mean(list(span.values())))))
                span = dict.fromkeys(names, 0)
            taken[node] += 1
            busy[node] = max(now, busy[node]) + n_hit * LOAD_MS + len(missing) * PREFILL_MS
            ttft.append(busy[node] - now)
            feeds[node].hold(busy[node] + PUBLISH_MS)   # its blocks are published when its prefill ends
    finally:
        for s in stores.values():
            s.close()
    return {"hit_rate": hit / asked, "imbalance": max(prefill.values()) / float(np.mean(list(prefill.values()))),
            "window_imbalance_p90": float(np.percentile(spans, 90)) if spans else float("nan"),
            "request_imbalance": max(taken.values()) / float(np.mean(list(taken.values()))),
            "ttft_mean_ms": float(np.mean(ttft)), "events": index.events}


def run_trace(name: str, n_requests: int, n_nodes: int, capacity_blocks: int) -> tuple[dict, dict]:
    """(stats, {policy: figures}) of one trace shape; the bounds are hit rates alone."""
    make, seed = TRACES[name]
    keys_list = [NS.block_keys(np.asarray(t)) for t in make(seed, n_requests)]
    figures = {p: simulate(p, keys_list, n_nodes, capacity_blocks) for p in POLICIES}
    pooled = simulate("round-robin", keys_list, 1, n_nodes * capacity_blocks)    # one node: nothing to route
    figures["one node, all memory"] = {"hit_rate": pooled["hit_rate"]}
    figures["capacity bound"] = {"hit_rate": capacity_bound(keys_list, n_nodes * capacity_blocks)}
    figures["unbounded"] = {"hit_rate": unbounded(keys_list)}
    return trace_stats(keys_list), figures


def main() -> None:
    args = parse_args(__doc__.splitlines()[0], lambda ap: (
        ap.add_argument("--nodes", type=int, default=4),
        ap.add_argument("--capacity", type=int, default=256, help="blocks per node (a multiple of 64)")))
    n_requests = 1000 if args.quick else 6000
    results: list[Result] = []
    rows = []
    for trace in TRACES:
        stats, figures = run_trace(trace, n_requests, args.nodes, args.capacity)
        print(f"{trace}: {n_requests} requests, prompts {stats['prompt_blocks_mean']:.1f} blocks mean "
              f"(max {stats['prompt_blocks_max']}); {100 * stats['sharing_requests']:.0f}% share a prefix "
              f"with an earlier request, reuse distance p50 {stats['reuse_distance_p50']:.0f} / "
              f"p90 {stats['reuse_distance_p90']:.0f} requests")
        ceiling = figures["ceiling"]["hit_rate"]
        bound = figures["capacity bound"]["hit_rate"]
        rr = figures["round-robin"]
        for policy, f in figures.items():
            p = {"trace": trace, "nodes": args.nodes, "requests": n_requests, "capacity_blocks": args.capacity,
                 "policy": policy}
            results.append(Result("hit rate", p, 100 * f["hit_rate"], "%", "ceiling hit rate %", 100 * ceiling))
            if "imbalance" in f:
                results.append(Result("hit rate against the capacity bound", p, 100 * f["hit_rate"], "%",
                                      "capacity bound hit rate %", 100 * bound))
            routed = "imbalance" in f
            rows.append([trace, policy, f"{100 * f['hit_rate']:.1f}%", f"{f['hit_rate'] / ceiling:.3f}",
                         f"{f['hit_rate'] / bound:.3f}"]
                        + ([f"{f['imbalance']:.3f}", f"{f['window_imbalance_p90']:.3f}",
                            f"{f['request_imbalance']:.3f}", f"{f['ttft_mean_ms']:.1f}"] if routed else ["-"] * 4))
            if not routed:
                continue
            results.append(Result("prefill imbalance", p, f["imbalance"], "max/mean",
                                  "round-robin prefill imbalance", rr["imbalance"], higher_is_better=False))
            results.append(Result("prefill imbalance per window, p90", p, f["window_imbalance_p90"], "max/mean",
                                  "round-robin prefill imbalance per window, p90", rr["window_imbalance_p90"],
                                  higher_is_better=False))
            results.append(Result("modelled TTFT mean", p, f["ttft_mean_ms"], "ms", "round-robin TTFT mean ms",
                                  rr["ttft_mean_ms"], higher_is_better=False))
    header = ["trace", "policy", "hit rate", "of ceiling", "of bound", "imbalance", "per window p90",
              "requests", "TTFT mean ms"]
    widths = [max(len(r[i]) for r in rows + [header]) for i in range(len(header))]
    print()
    for r in [header, ["-" * w for w in widths]] + rows:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths)))
    print(f"ceiling (the denominator): the greedy oracle on the caches' true contents under the same cap of "
          f"{MAX_IMBALANCE}x the mean prefill;\nof bound: of the capacity bound, optimal eviction on all the nodes' "
          "memory in one, which no routing can beat;\nimbalance: max/mean prefill per node over the run, and its "
          f"p90 over windows of {WINDOW_PER_NODE * args.nodes} requests; requests: max/mean requests per node\n")
    report("routing", results, args.json)


if __name__ == "__main__":
    main()
