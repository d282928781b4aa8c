"""The embedded block store, as parts with one job each; `TieredStore` (core.py) composes them.

    lock.py        the store's one lock and its closed flag; the rule for holding it
    records.py     block and namespace records, block states, pins (the invariants), and what
                   a block's fields say about it (servable, evictable, unsynced)
    index.py       the block index (`BlockIndex`): block records, chain links, entering and
                   leaving a tier, flushed copies, clean/dirty accounting, the shared index
    residency.py   each tier's slot owners and eviction order (`Resident`): a block's eviction
    namespaces.py  the table of namespaces (`NamespaceTable`)
    ownership.py   who holds which slots (`Holdings`, `Ownership`): reservations, leases,
                   staged slots, their owners, how they end
    promotion.py   leases and reads up the tiers (`Promotion`: plan, execute, settle)
    demotion.py    a block's write-down (`Demotion`): room made, the demoter's passes, sync
    keeping.py     a block's record for restarts, and re-adoption (`HostKeeping`)
    health.py      tier fault episodes and the disk tier's watch (`DiskHealth`)
    remote.py      the store's side of the remote tier (`RemoteLink`: lookups, fetches,
                   write-behind)
    feed.py        KV events and snapshots (`EventFeed`)
"""

from .core import TieredStore
from .ownership import Lease, Reservation
from .records import ABSENT, LOADING, READY, REMOTE, RESERVED, WouldBlock

__all__ = ["TieredStore", "Lease", "Reservation", "WouldBlock", "ABSENT", "RESERVED", "LOADING", "READY", "REMOTE"]
