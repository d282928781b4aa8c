"""Cache-aware routing from KV events: which node already holds a request's prefix, and where.

A small library, not a server: feed it the KV events each node's daemon publishes
(`tierd.events`, vLLM's wire format) and ask it to score or route a request by its block keys.

    index = PrefixIndex()
    index.apply_frames("node-a", [topic, seq, payload])   # or apply_events(node, [event maps])
    router = Router(index)
    router.route(keys, loads={"node-a": 3, "node-b": 1})   # -> "node-a"

A node's score for a request is its longest cached prefix, each block weighted by the fastest
tier that holds it there (HBM > host RAM > disk > the shared remote tier: what loading it costs),
minus a penalty per request already running on the node. Blocks in the remote tier count for
every node (any node can load them), so they never decide between nodes — they only keep a
busy node from winning on them.
"""

from __future__ import annotations

from collections import defaultdict

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


class Router:
    """Scores nodes for a request; routes it to the best one."""

    def __init__(self, index: PrefixIndex, weights: dict[str, float] | None = None,
                 load_penalty: float = 0.5):
        self.index = index
        self.weights = dict(DEFAULT_WEIGHTS, **(weights or {}))
        self.load_penalty = load_penalty    # blocks of score one running request costs

    def score(self, node: str, keys: list[bytes]) -> float:
        """Tier-weighted length of the longest prefix of `keys` that `node` can load."""
        s = 0.0
        for k in keys:
            tier = self.index.tier_of(node, k)
            if tier is None:
                break
            s += self.weights[tier]
        return s

    def route(self, keys: list[bytes], nodes: list[str], loads: dict[str, float] | None = None) -> str:
        """The node with the best score net of its load (ties: the least loaded, then the first)."""
        loads = loads or {}
        return max(nodes, key=lambda n: (self.score(n, keys) - self.load_penalty * loads.get(n, 0.0),
                                         -loads.get(n, 0.0)))
