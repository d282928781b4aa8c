"""KV events from the store: what each tier gains and loses, recorded in order under the store
lock (memory only; `tierd.events` sends them), and snapshots walked in chunks."""

from __future__ import annotations

import time

from .. import events
from .records import READY, Block


class EventFeed:
    """Part of `TieredStore` (see its docstring): state and lock are the store's."""

    def attach_events(self, publisher) -> None:
        """Record KV events (tierd.events) from now on, starting with a snapshot."""
        publisher.snapshot = self.snapshot_events
        with self._cond:
            self._events = publisher
        self.snapshot_events()

    def snapshot_events(self) -> None:
        """Record a clean slate per namespace, then what every tier holds, in order with the
        live events: each block's events reflect its state when its chunk was walked, and any
        later change follows as a live event."""
        publisher = self._events
        if publisher is None:
            return
        with self._cond:
            for st in self._namespaces.values():
                publisher.record(st.name, events.all_cleared())

        def one(b: Block) -> None:
            if b.host_state == READY:
                self._event(b, "host", True)
            if b.disk is not None:
                self._event(b, "disk", True)
            if b.gpu_slot >= 0 and not b.gpu_filling:
                self._event(b, "gpu", True)
            if self._remote_memory is not None and self._remote_memory.had(b.ikey, time.monotonic()):
                self._event(b, "remote", True)
        self._each_block(one)

    def _event(self, b: Block, tier: str, stored: bool, token_ids=None) -> None:
        st = b.st
        if stored:
            ev = events.block_stored([b.key], b.parent[16:] if b.parent else None,
                                     st.ns.block_tokens if st.ns is not None else st.desc.get("block_tokens", 0),
                                     tier, token_ids)
        else:
            ev = events.block_removed([b.key], tier)
        self._events.record(st.name, ev)
