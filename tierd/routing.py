"""Cache-aware routing from KV events: which node already holds a request's prefix, and where.

A small library, not a server: feed it the KV events each node's daemon publishes
(`tierd.events`, vLLM's wire format) and ask it to score or route a request by its block keys.

    index = PrefixIndex()
    index.apply_frames("node-a", [topic, seq, payload])   # or apply_events(node, [event maps])
    router = Router(index)
    router.route(keys, ["node-a", "node-b"], loads={"node-a": 3, "node-b": 1})   # -> "node-a"

A node's score for a request is its longest cached prefix, each block weighted by the fastest
tier that holds it there (HBM > host RAM > disk > the shared remote tier: what loading it costs),
minus `load_penalty` per unit of load on the node. Blocks in the remote tier count for every
node (any node can load them), so they never decide between nodes — they only keep a busy node
from winning on them.

Balanced routing (opt-in; `benchmarks/routing.py` measures it against the trace's ceiling):

- `window` (requests): the router keeps its own account of the prefill it sent each node over
  its last `window` decisions — each request counted as the blocks the router expected the node
  not to hold. No engine metric is needed, and it measures what the cap bounds: each node's
  share of the recent prefill work. Without a window, `loads` stands in for it.
- `max_imbalance` (e.g. 1.2): a bounded-load cap on that account. A node may take a request
  only if its account plus the request's prefill there stays within `max_imbalance` × the mean
  account after the request; when no node qualifies, the one whose account would end lowest
  takes it. The queue-like `loads` the caller passes still set the penalty.
- `remember` (requests): the keys of the router's last `remember` decisions count as held by
  the node they went to (at the host tier's weight) until that node's events catch up. A real
  router knows where it sent a request; a node's events come only after its prefill, so
  without this a returning user's quick next turn, or a burst of requests for a new document,
  scatters before the first one is stored.

Ties (equal net score) go to the node with the smaller load, then the smaller share in the
router's account, then by rendezvous hashing on the first key no candidate holds: where nothing
else separates the nodes, requests for the same new content agree on one node.
"""

from __future__ import annotations

import hashlib
from collections import defaultdict, deque

import msgpack

# what one block held in a tier is worth, relative to one recomputed (prefilled) block
DEFAULT_WEIGHTS = {"GPU": 1.0, "CPU": 0.95, "DISK": 0.8, "REMOTE": 0.6}


def tier_name(medium: str | None, locality: str | None) -> str:
    """The tier an event names, in vLLM's vocabulary (medium GPU, CPU or STORAGE; locality
    LOCAL or REMOTE): GPU, CPU, DISK (local storage) or REMOTE (shared storage). Older
    publishers' DISK and REMOTE media are read too."""
    if medium == "STORAGE":
        return "REMOTE" if locality == "REMOTE" else "DISK"
    return medium or "CPU"


class PrefixIndex:
    """Per node and tier, the set of block keys held — kept from the node's KV events."""

    def __init__(self):
        self._held: dict[str, dict[str, set[bytes]]] = defaultdict(lambda: defaultdict(set))
        self.remote: set[bytes] = set()      # keys in the shared remote tier (from any node)
        self.events = 0

    def apply_frames(self, node: str, frames) -> None:
        """One message as a ZeroMQ subscriber receives it: [topic, seq, payload]."""
        _, _, payload = frames
        batch = msgpack.unpackb(payload, raw=False)
        self.apply_events(node, batch[1])

    def apply_events(self, node: str, events) -> None:
        held = self._held[node]
        for e in events:
            self.events += 1
            kind = e.get("type")
            if kind == "AllBlocksCleared":
                held.clear()
                continue
            medium = tier_name(e.get("medium"), e.get("locality"))
            keys = [bytes(k) if not isinstance(k, bytes) else k for k in e.get("block_hashes", ())]
            target = self.remote if medium == "REMOTE" else held[medium]
            if kind == "BlockStored":
                target.update(keys)
            elif kind == "BlockRemoved":
                target.difference_update(keys)

    def nodes(self) -> list[str]:
        return list(self._held)

    def tier_of(self, node: str, key: bytes) -> str | None:
        """The fastest tier of `node` holding `key` (the remote tier counts for every node)."""
        held = self._held.get(node)
        if held is not None:
            for medium in ("GPU", "CPU", "DISK"):
                if key in held.get(medium, ()):
                    return medium
        return "REMOTE" if key in self.remote else None


class WorkWindow:
    """Work (e.g. blocks of prefill) sent to each node over the last `size` requests."""

    def __init__(self, size: int):
        if size < 1:
            raise ValueError(f"window size must be at least 1, not {size}")
        self.size = size
        self._recent: deque[tuple[str, float]] = deque()
        self._sum: dict[str, float] = defaultdict(float)

    def add(self, node: str, work: float) -> None:
        self._recent.append((node, work))
        self._sum[node] += work
        if len(self._recent) > self.size:
            old, w = self._recent.popleft()
            self._sum[old] -= w

    def loads(self) -> dict[str, float]:
        return dict(self._sum)


def within_cap(nodes: list[str], loads: dict[str, float], costs: dict[str, float],
               max_imbalance: float) -> list[str]:
    """The nodes that may take a request under a bounded-load cap: node n qualifies if
    `loads[n] + costs[n]` (its load once it takes the request, which costs it `costs[n]`) is at
    most `max_imbalance` × the mean load after the request. Never empty: when none qualifies,
    the node whose load would end lowest (the first of equals)."""
    total = sum(loads.get(n, 0.0) for n in nodes)
    ok = [n for n in nodes
          if loads.get(n, 0.0) + costs[n] <= max_imbalance * (total + costs[n]) / len(nodes) + 1e-9]
    return ok or [min(nodes, key=lambda n: loads.get(n, 0.0) + costs[n])]


def _rendezvous(node: str, key: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(key + node.encode(), digest_size=8).digest(), "big")


class Router:
    """Scores nodes for a request; routes it to the best one (see the module's docstring)."""

    def __init__(self, index: PrefixIndex, weights: dict[str, float] | None = None,
                 load_penalty: float = 0.5, *, max_imbalance: float | None = None, window: int = 0,
                 remember: int = 0):
        if max_imbalance is not None and max_imbalance < 1.0:
            raise ValueError(f"max_imbalance must be at least 1.0, not {max_imbalance}")
        self.index = index
        self.weights = dict(DEFAULT_WEIGHTS, **(weights or {}))
        self.load_penalty = load_penalty    # score one unit of load costs
        self.max_imbalance = max_imbalance
        self.work = WorkWindow(window) if window else None
        self.remember = remember
        self._sent: deque[tuple[str, list[bytes]]] = deque()
        self._sent_keys: dict[str, dict[bytes, int]] = defaultdict(lambda: defaultdict(int))

    def prefix(self, node: str, keys: list[bytes]) -> tuple[int, float]:
        """(blocks, tier-weighted score) of the longest prefix of `keys` that `node` can load:
        from its events, or (with `remember`) sent to it by one of the last decisions."""
        sent = self._sent_keys.get(node)
        n, s = 0, 0.0
        for k in keys:
            tier = self.index.tier_of(node, k)
            if sent is not None and k in sent and (tier is None or self.weights[tier] < self.weights["CPU"]):
                tier = "CPU"
            if tier is None:
                break
            n += 1
            s += self.weights[tier]
        return n, s

    def score(self, node: str, keys: list[bytes]) -> float:
        """Tier-weighted length of the longest prefix of `keys` that `node` can load."""
        return self.prefix(node, keys)[1]

    def route(self, keys: list[bytes], nodes: list[str], loads: dict[str, float] | None = None) -> str:
        """The node with the best score net of `load_penalty` × its load, among those the cap
        allows (see the module's docstring for the cap and the ties). `loads`: each node's load
        in the caller's units (e.g. blocks of queued prefill); absent means none."""
        if not nodes:
            raise ValueError("route: no nodes")
        loads = loads or {}
        shares = self.work.loads() if self.work is not None else loads
        found = {n: self.prefix(n, keys) for n in nodes}
        costs = {n: len(keys) - found[n][0] for n in nodes}
        allowed = nodes if self.max_imbalance is None else within_cap(nodes, shares, costs, self.max_imbalance)
        fresh = keys[min(max(found[n][0] for n in nodes), len(keys) - 1)] if keys else b""
        node = max(allowed, key=lambda n: (found[n][1] - self.load_penalty * loads.get(n, 0.0),
                                           -loads.get(n, 0.0), -shares.get(n, 0.0), _rendezvous(n, fresh)))
        if self.work is not None:
            self.work.add(node, costs[node])
        if self.remember:
            self._note_sent(node, keys)
        return node

    def _note_sent(self, node: str, keys: list[bytes]) -> None:
        mine = self._sent_keys[node]
        for k in keys:
            mine[k] += 1
        self._sent.append((node, list(keys)))
        if len(self._sent) > self.remember:
            old, old_keys = self._sent.popleft()
            theirs = self._sent_keys[old]
            for k in old_keys:
                theirs[k] -= 1
                if not theirs[k]:
                    del theirs[k]
