"""Eviction order and SSD admission: which block leaves a tier first, and which may enter disk.

Policies are small classes behind one interface (`EvictionPolicy`); adding one is one class
plus a name in `POLICIES`. A policy only orders opaque keys: it never frees memory, never
looks at pins or chains — the store's `can_evict` predicate decides what may actually go
(leased slots, ancestors with resident descendants).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterator
from typing import Hashable


class _Node:
    __slots__ = ("key", "prev", "next", "freq", "owner")

    def __init__(self, key: Hashable):
        self.key = key
        self.prev: _Node | None = None
        self.next: _Node | None = None
        self.freq = 0
        self.owner: _DList | None = None


class _DList:
    """Intrusive doubly linked list; front = most recent, back = next to evict."""

    def __init__(self) -> None:
        self.head = _Node(None)  # sentinel: head.next is the front
        self.head.prev = self.head.next = self.head
        self.size = 0

    def push_front(self, node: _Node) -> None:
        node.prev, node.next = self.head, self.head.next
        self.head.next.prev = node
        self.head.next = node
        node.owner = self
        self.size += 1

    def unlink(self, node: _Node) -> None:
        node.prev.next = node.next
        node.next.prev = node.prev
        node.prev = node.next = None
        node.owner = None
        self.size -= 1

    def back(self) -> _Node | None:
        n = self.head.prev
        return None if n is self.head else n

    def iter_back(self) -> Iterator[_Node]:
        """Nodes from the back; tolerates unlinking the yielded node."""
        n = self.head.prev
        while n is not self.head and n is not None:
            prev = n.prev
            yield n
            n = prev if (prev is not None and (prev is self.head or prev.owner is self)) else None


class EvictionPolicy:
    """Orders the keys resident in one tier.

    `insert` when a key becomes resident, `hit` when it is served, `remove` when it leaves
    (`evicted=True` when the policy chose it), `victim(can_evict)` the next key to go.
    """

    name = "base"

    def insert(self, key: Hashable) -> None:
        raise NotImplementedError

    def hit(self, key: Hashable) -> None:
        raise NotImplementedError

    def remove(self, key: Hashable, *, evicted: bool = False) -> None:
        raise NotImplementedError

    def victim(self, can_evict: Callable[[Hashable], bool]) -> Hashable | None:
        """The key to evict next among those `can_evict` accepts; None if there is none.
        The key stays tracked until the caller `remove`s it."""
        raise NotImplementedError

    def __len__(self) -> int:
        raise NotImplementedError

    def __contains__(self, key: Hashable) -> bool:
        raise NotImplementedError


class LRUPolicy(EvictionPolicy):
    """Least recently used first."""

    name = "lru"

    def __init__(self) -> None:
        self._nodes: dict[Hashable, _Node] = {}
        self._list = _DList()

    def insert(self, key: Hashable) -> None:
        node = self._nodes.get(key)
        if node is None:
            node = self._nodes[key] = _Node(key)
        else:
            self._list.unlink(node)
        self._list.push_front(node)

    def hit(self, key: Hashable) -> None:
        node = self._nodes.get(key)
        if node is not None:
            self._list.unlink(node)
            self._list.push_front(node)

    def remove(self, key: Hashable, *, evicted: bool = False) -> None:
        node = self._nodes.pop(key, None)
        if node is not None:
            self._list.unlink(node)

    def victim(self, can_evict: Callable[[Hashable], bool]) -> Hashable | None:
        for node in self._list.iter_back():
            if can_evict(node.key):
                return node.key
        return None

    def __len__(self) -> int:
        return len(self._nodes)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._nodes


class S3FIFOPolicy(EvictionPolicy):
    """S3-FIFO (Yang et al., SOSP 2023): a small probationary FIFO (10%), a main FIFO with
    2-bit frequencies and lazy promotion, and a ghost FIFO of keys recently evicted from small.
    One-hit wonders (a scan) leave through the small queue without touching main."""

    name = "s3fifo"
    SMALL_FRACTION = 0.10
    MAX_FREQ = 3

    def __init__(self) -> None:
        self._nodes: dict[Hashable, _Node] = {}
        self._small = _DList()
        self._main = _DList()
        self._ghost: OrderedDict[Hashable, None] = OrderedDict()

    def insert(self, key: Hashable) -> None:
        if key in self._nodes:
            self.hit(key)
            return
        node = self._nodes[key] = _Node(key)
        if key in self._ghost:
            del self._ghost[key]
            self._main.push_front(node)
        else:
            self._small.push_front(node)

    def hit(self, key: Hashable) -> None:
        node = self._nodes.get(key)
        if node is not None and node.freq < self.MAX_FREQ:
            node.freq += 1

    def remove(self, key: Hashable, *, evicted: bool = False) -> None:
        node = self._nodes.pop(key, None)
        if node is None:
            return
        from_small = node.owner is self._small
        node.owner.unlink(node)
        if evicted and from_small:
            self._ghost[key] = None
            while len(self._ghost) > max(len(self._nodes), 1024):
                self._ghost.popitem(last=False)

    def victim(self, can_evict: Callable[[Hashable], bool]) -> Hashable | None:
        # Each node is looked at a bounded number of times: a pass moves it small -> main or
        # spends one frequency unit; pinned nodes are rotated to the front.
        budget = (self.MAX_FREQ + 2) * len(self._nodes) + 2
        while budget > 0 and self._nodes:
            budget -= 1
            small_target = max(1, int(self.SMALL_FRACTION * len(self._nodes)))
            if self._small.size and (self._small.size >= small_target or not self._main.size):
                node = self._small.back()
                if node.freq > 0:           # re-accessed while probationary: promote
                    self._small.unlink(node)
                    node.freq = 0
                    self._main.push_front(node)
                    continue
                if can_evict(node.key):
                    return node.key
                self._small.unlink(node)
                self._main.push_front(node)
            else:
                node = self._main.back()
                if node.freq > 0:
                    node.freq -= 1
                    self._main.unlink(node)
                    self._main.push_front(node)
                    continue
                if can_evict(node.key):
                    return node.key
                self._main.unlink(node)
                self._main.push_front(node)
        return None

    def __len__(self) -> int:
        return len(self._nodes)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._nodes


POLICIES: dict[str, type[EvictionPolicy]] = {"lru": LRUPolicy, "s3fifo": S3FIFOPolicy}


def make_policy(name: str) -> EvictionPolicy:
    return POLICIES[name]()


class AdmissionFilter:
    """Decides whether a block leaving host RAM is worth an SSD write.

    `min_hits=0` admits everything; `min_hits=N` admits only blocks served at least N times
    while resident (a cheap guard against write amplification from one-off prompts).
    Explicit `sync()` bypasses the filter: the operator asked for the write.
    """

    def __init__(self, min_hits: int = 0):
        self.min_hits = min_hits

    def admit(self, hits: int) -> bool:
        return hits >= self.min_hits
