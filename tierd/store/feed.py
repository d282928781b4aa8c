"""KV events from the store: what each tier gains and loses, recorded in order under the store
lock (memory only; `tierd.events` sends them), and snapshots walked in chunks."""

from __future__ import annotations

from .. import events
from .records import READY, Block


class EventFeed:
    """The store's KV-event feed: `publisher` (a `tierd.events` publisher, None until the daemon
    attaches one; then every change below is recorded). Collaborators: the store's lock, its
    namespace table, its chunked walk over the blocks (`walk(fn)`, which calls `fn` with the
    lock held) and `remote_had(block)` (the remote tier holds it, as far as the store knows).

    Invariants: every event is recorded with the store's lock held, in the same hold that made
    the change, so a subscriber sees each block's changes in order; a snapshot records a clean
    slate per namespace first, then each block as its chunk is walked, and later changes follow
    as live events."""

    def __init__(self, cond, namespaces, *, walk, remote_had):
        self.cond = cond
        self.namespaces = namespaces
        self.walk, self.remote_had = walk, remote_had
        self.publisher = None

    @property
    def on(self) -> bool:
        """A publisher is attached: changes are to be recorded."""
        return self.publisher is not None

    def attach(self, publisher) -> None:
        """Record KV events from now on, starting with a snapshot."""
        with self.cond:
            self.publisher = publisher
        self.snapshot()

    def snapshot(self) -> None:
        """Record a clean slate per namespace, then what every tier holds, in order with the
        live events: each block's events reflect its state when its chunk was walked, and any
        later change follows as a live event."""
        publisher = self.publisher
        if publisher is None:
            return
        with self.cond:
            for st in self.namespaces.values():
                publisher.record(st.name, events.all_cleared())

        def one(b: Block) -> None:
            if b.host_state == READY:
                self.event(b, "host", True)
            if b.disk is not None:
                self.event(b, "disk", True)
            if b.gpu_slot >= 0 and not b.gpu_filling:
                self.event(b, "gpu", True)
            if self.remote_had(b):
                self.event(b, "remote", True)
        self.walk(one)

    def event(self, b: Block, tier: str, stored: bool, token_ids=None) -> None:
        """(Lock held; a publisher attached.) `b` was stored in or removed from `tier`."""
        st = b.st
        if stored:
            ev = events.block_stored([b.key], b.parent[16:] if b.parent else None,
                                     st.ns.block_tokens if st.ns is not None else st.desc.get("block_tokens", 0),
                                     tier, token_ids)
        else:
            ev = events.block_removed([b.key], tier)
        self.publisher.record(st.name, ev)

    def removed(self, ns_id: bytes, key: bytes, tier: str) -> None:
        """(Lock held; a publisher attached.) The block `key` of namespace `ns_id` left `tier`."""
        self.publisher.record(ns_id.hex()[:16], events.block_removed([key], tier))
