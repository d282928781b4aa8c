"""The embedded block store, as parts with one job each; `TieredStore` (core.py) ties them.

    records.py     block and namespace records, block states, pins (the invariants)
    index.py       the block index, chain links, residency bookkeeping, the shared lookup index
    residency.py   each tier's slot owners and eviction order; allocation with eviction
    namespaces.py  the table of namespaces (an object: `NamespaceTable`) and registration
    ownership.py   who holds which slots (an object: `Holdings`): reservations, leases, staged
                   slots, their owners, how they end
    promotion.py   leases and reads up the tiers (plan, execute, settle)
    demotion.py    writes down the tiers, the background demoter, sync
    health.py      tier fault episodes and the disk tier's watch
    remote.py      the store's side of the remote tier (lookups, fetches, write-behind)
    feed.py        KV events and snapshots
    keeping.py     host block records and their re-adoption after a restart
"""

from .core import TieredStore
from .ownership import Lease, Reservation
from .records import ABSENT, LOADING, READY, REMOTE, RESERVED, WouldBlock

__all__ = ["TieredStore", "Lease", "Reservation", "WouldBlock", "ABSENT", "RESERVED", "LOADING", "READY", "REMOTE"]
