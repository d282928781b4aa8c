"""What a node learned of the remote tier's server lately (`RemoteMemory`): which keys it had and
which it lacked, each for a while, so lookups and the write-behind skip round trips. The store
keeps one under its lock (tierd/store/remote.py); the tier itself is tierd/tiers/remote.py. It
never asks the server anything: a memory, bounded, not a cache of values.
"""

from __future__ import annotations

import collections


class RemoteMemory:
    """What this node learned of the server lately: keys it had (each counts as there for
    `known_s`) and keys it lacked (`absent_s`), so lookups and write-behind skip round trips.
    Bounded: entries expire in the order they were noted and at most `max_entries` of each kind
    are kept, trimmed at every insert (amortised O(1)). Not thread-safe: its user's lock guards it."""

    def __init__(self, known_s: float, absent_s: float, max_entries: int = 200_000):
        self.known_s, self.absent_s, self.max_entries = known_s, absent_s, max_entries
        self._had: collections.OrderedDict[bytes, float] = collections.OrderedDict()
        self._lacked: collections.OrderedDict[bytes, float] = collections.OrderedDict()

    def had(self, ikey: bytes, now: float) -> bool:
        return self._had.get(ikey, 0.0) > now

    def lacked(self, ikey: bytes, now: float) -> bool:
        return self._lacked.get(ikey, 0.0) > now

    def note_had(self, ikey: bytes, now: float) -> None:
        self._lacked.pop(ikey, None)
        self._note(self._had, ikey, now + self.known_s, now)

    def note_lacked(self, ikey: bytes, now: float) -> None:
        self._had.pop(ikey, None)
        self._note(self._lacked, ikey, now + self.absent_s, now)

    def forget(self, ikey: bytes) -> None:
        self._had.pop(ikey, None)
        self._lacked.pop(ikey, None)

    def forget_namespace(self, ns_id: bytes | None) -> None:
        for d in (self._had, self._lacked):
            for k in [k for k in d if ns_id is None or k[:16] == ns_id]:
                del d[k]

    def __len__(self) -> int:
        return len(self._had) + len(self._lacked)

    def _note(self, d: collections.OrderedDict, ikey: bytes, until: float, now: float) -> None:
        d[ikey] = until
        d.move_to_end(ikey)
        while d:   # expired or over the bound: the oldest go first
            k, t = next(iter(d.items()))
            if t > now and len(d) <= self.max_entries:
                break
            del d[k]
