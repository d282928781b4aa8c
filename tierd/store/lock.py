"""The store's one lock, and whether the store is closed: every part of the store that takes
the lock or waits on it is handed this object by the store, which owns it.

The rule (every part keeps it): the lock is held only for memory work. No disk, device or
network I/O ever runs under it, and nothing under it waits on such I/O. Code that does I/O
pins what it touches, lets go of the lock, does the I/O, takes the lock again and settles, on
every exit. An O(N) walk holds it one chunk at a time (`SCAN_CHUNK` blocks or `SCAN_HOLD_S`,
then out for `SCAN_YIELD_S`)."""

from __future__ import annotations

import threading

from ..errors import StoreClosedError

SCAN_CHUNK = 2048     # most blocks an O(N) walk handles per hold of the lock
SCAN_HOLD_S = 0.002   # and the longest it holds the lock at a time
SCAN_YIELD_S = 5e-5   # how long it stays out between holds, so that a waiter gets the lock


class StoreLock(threading.Condition):
    """The store's lock (a condition: waiters are woken by `notify_all` whenever a pin ends, a
    block settles or the store closes) and `closed`, which it guards: once set, it is never
    cleared, and every wait on the lock ends."""

    def __init__(self):
        super().__init__(threading.Lock())
        self.closed = False

    def check_open(self) -> None:
        """(Lock held.) StoreClosedError once the store is closed."""
        if self.closed:
            raise StoreClosedError("the store is closed")
