"""What a client hands out: `ClientReservation` (slots to write into, made visible at commit)
and `ClientLease` (read-only views of leased slots, valid until release). Each holds its
connection open while it is outstanding (tierd/connection.py's holds), so no other thread's
timeout lets the daemon reclaim its slots under a copy. `Client` (tierd/client.py) makes them
and ends them; they keep no state of the daemon's beyond their ids and views.
"""

from __future__ import annotations


def _with_checksums(msg: dict, res) -> dict:
    """`msg` (a put or commit) with the reservation's checksums, where it has them."""
    if res.checksums is not None:
        msg["checksums"] = [int(c) for c in res.checksums]
    return msg


class ClientReservation:
    """Slots in the daemon's arena to write into; `commit` makes them visible. It holds its
    connection open until committed or aborted (see `Client.acquire`)."""

    def __init__(self, rid, ns, keys, status, buffers, generation, link=None, staged=None):
        self.id, self.namespace, self.keys = rid, ns, keys
        self.status, self.buffers = status, buffers
        self._generation = generation
        self._link = link   # the held connection (None: nothing reserved, nothing held)
        # Staged (see Client.reserve): per key, the staged slot's offset or -1; its commit is
        # a deferred `put`, with the parent and token ids kept here until then.
        self._staged = staged
        self._parent = self._tokens = None
        # per key, optional: the checksum of what was copied into the slot, or -1 (as
        # `tierd.store.Reservation.checksums`); sent with the commit
        self.checksums: list[int] | None = None

    @property
    def num_reserved(self) -> int:
        return sum(s == "reserved" for s in self.status)


class ClientLease:
    """Read-only views of leased slots in the daemon's arena, valid until `release`."""

    def __init__(self, lid, ns, keys, buffers, tiers, client, generation, link=None):
        self.id, self.namespace, self.keys = lid, ns, keys
        self.buffers, self.tiers = buffers, tiers
        self.gpu_offsets: list[int] = []     # per block: offset in the daemon's HBM tier, or -1
        self.gpu_buffers: list = []          # per block: (block_bytes,) CUDA view, or None
        self._client, self._generation, self._open = client, generation, True
        self._link = link   # the held connection (None: nothing leased, nothing held)
        # A pipelined lease (`Client.acquire(..., pipelined=True)`): its request's answer, read
        # at release; until then `id` is 0 and the slots are what the shared index showed (a
        # quiet lease's `id` stays 0: the daemon never answers it).
        self._pending: PendingGrant | None = None

    def __len__(self) -> int:
        return len(self.keys)

    def release(self, *, confirm: bool = True) -> None:
        """End the lease. With `confirm` (the default), raise LeaseError if it was lost before
        now — the daemon restarted or stopped, or ended the connection — so that bytes read
        under it are not to be trusted (see `Client.release`)."""
        self._client.release(self, confirm=confirm)

    def __enter__(self) -> "ClientLease":
        return self

    def __exit__(self, exc_type, *exc) -> None:
        """Leaving the `with` ends the lease and confirms it: LeaseError when it was lost while
        the block was read (what was read must be thrown away), unless the block already raised."""
        if self._open:
            self._client.release(self, confirm=exc_type is None)


class PendingGrant:
    """What a pipelined lease was handed before the daemon answered: the shared index's ways,
    sequence numbers and slots for its blocks, and (once read) the daemon's reply — or, for a
    quiet lease, which is never answered, the id of its request (0 otherwise); `unpinned` where
    nothing was sent at all (no eviction lately: `Client.pin_after_eviction_s`)."""

    __slots__ = ("index", "ways", "seqs", "offsets", "reply", "request", "unpinned")

    def __init__(self, index, ways: list[int], seqs: list[int], offsets: list[int]):
        self.index, self.ways, self.seqs, self.offsets = index, ways, seqs, offsets
        self.reply: dict | None = None
        self.request = 0
        self.unpinned = False

    def answered(self, reply: dict) -> None:
        self.reply = reply
