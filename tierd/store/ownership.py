"""Reservations and leases: who holds which slots, and how they end.

Invariant: every reservation and lease has an owner (a daemon connection, or None embedded) and
ends — committed, aborted, released, or reclaimed with its connection (`drop_owner`); a request
that touches nothing leaves nothing open (id 0). A lease pins each of its blocks' host slot
(`host_pins`) and, where it reads one, the HBM copy (`gpu_pins`) until it ends.

Staged slots (`stage`, `put_staged`) are free host slots handed to a daemon connection before
it knows which keys it will write: no block owns them (`_rh.owner` has no entry, so neither
eviction nor a slab's reassignment can take them), only that connection may name them, and
each goes back to the free pool or becomes a block's slot exactly once — at `put_staged`,
`unstage` or `drop_owner`. A staged slot belongs to one namespace (`st.staged` counts them), so
a namespace with staged slots is in use and never forgotten: the put that names them finds it.

The client writes into its staged slots with no request at all, so the daemon must never give
one back while the client may still write through it: only a `put` that names it (the client
gave it up when it sent the put), `unstage` of slots the client never saw (a `stage` whose
reply came too late: `Daemon._undo_late`), or the connection's end (`drop_owner`; the client's
pool is that connection's and dies with it) hand a staged slot on.

**Slots and the client's process.** A client's process maps the arena read-write and may go on
copying through a slot after its connection is gone: another thread of it mid-copy when the
daemon refused a frame, timed the connection out or stopped reading it. So a connection's end
is not the end of what it holds. The rule, for every slot a connection staged, reserved or
leased: the daemon hands it on only once **the client's end of the socket is closed** — its
process exited (the kernel closes its sockets), or the client closed the socket itself, which is
how it confirms that it dropped the connection's slots (tierd's client closes a connection only
once no thread holds it: `tierd.connection._Link`). Every close the daemon makes goes through
`_Conn._close` (tierd/server_conn.py): a connection that holds slots is half-closed (the daemon
writes its last reply and an end-of-stream, which the client sees at once, and serves nothing
more) and its slots are taken back (`drop_owner`) when the client's end closes. A request that
reaches the store after that (a worker still running it) gives back all it made for the
connection, its count as a staging writer included (`Daemon._undo_late`). A stopping daemon
closes at once: a restart maps a new arena file (tierd/store/keeping.py), so no slot of the old
one is ever handed on; a client's lease or reservation from before it then ends with LeaseError
(tierd.client), never quietly."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ..errors import LeaseError
from ..namespace import Namespace
from .records import RESERVED, Block


class Reservation:
    """Slots handed to a writer; a block becomes visible at `commit`.

    `status[i]` is "reserved" (write `buffers[i]`), "present" (already stored: skip) or
    "full" (no room: the store dropped it).
    """

    def __init__(self, rid: int, ns: Namespace, keys: list[bytes], status: list[str],
                 blocks: list[Block | None], owner, offsets: list[int | None], host):
        self.id = rid
        self.namespace = ns
        self.keys = keys
        self.status = status
        self.offsets = offsets  # byte offset of each reserved slot in the host arena
        self._blocks = blocks
        self.owner = owner
        self._host = host
        self._buffers = None
        self._tokens = None   # token ids of the keys, for KV events (when the store publishes them)
        # Per key, optional: the checksum (`tiers.host_records.checksum`) of what the writer
        # copied into the slot, or -1; set by a writer that hashed the bytes as it copied them
        # (`put` does where the store records its blocks), so the keeper need not read them again.
        self.checksums: list[int] | None = None

    @property
    def buffers(self) -> list[np.ndarray | None]:
        """Per key: a writable (block_bytes,) uint8 view of its reserved slot, or None. Made on
        first use (the daemon hands out offsets and never needs them)."""
        if self._buffers is None:
            n = self.namespace.block_bytes
            self._buffers = [self._host.arena.view(o, n) if o is not None else None for o in self.offsets]
        return self._buffers

    @property
    def num_reserved(self) -> int:
        return sum(s == "reserved" for s in self.status)


class Lease:
    """Read pins on the slots of the leading present blocks of a request.

    `buffers[i]` is a read-only (block_bytes,) uint8 view of block `keys[i]`, valid until
    `release`. Use as a context manager to release on exit.
    """

    def __init__(self, lid: int, ns: Namespace, keys: list[bytes], blocks: list[Block],
                 tiers: list[str], owner, store, offsets: list[int]):
        self.id = lid
        self.namespace = ns
        self.keys = keys
        self._buffers = None
        self.offsets = offsets  # byte offset of each leased slot in the host arena
        self.tiers = tiers  # where each block was found: "host" or "disk" (promoted)
        self.gpu_offsets: list[int] = []     # per block: byte offset in the HBM tier, or -1
        self.gpu_buffers: list = []          # per block: (block_bytes,) device view, or None
        self._blocks = blocks
        self.owner = owner
        self._store = store

    @property
    def buffers(self) -> list[np.ndarray]:
        """Per leased block: a read-only (block_bytes,) uint8 view of its slot, valid until
        `release`. Made on first use (the daemon hands out offsets and never needs them)."""
        if self._buffers is None:
            n = self.namespace.block_bytes
            ro = self._store.host.arena.readonly
            self._buffers = [ro[o:o + n] for o in self.offsets]
        return self._buffers

    def __len__(self) -> int:
        return len(self.keys)

    def release(self, *, confirm: bool = True) -> None:
        """End the lease (as `TieredStore.release`; embedded, a lease cannot be lost)."""
        self._store.release(self, confirm=confirm)

    def __enter__(self) -> "Lease":
        return self

    def __exit__(self, *exc) -> None:
        if self._blocks is not None:
            self._store.release(self)


class Holdings:
    """Who holds which slots: open reservations and leases by id, and staged slots by owner.
    Memory only, always under the store's lock; the store pins and frees the slots themselves.

    Invariants kept here: an open reservation or lease is in exactly one table until it ends
    (`end_reservation`, `end_lease`, `drop_owner`); a staged slot is held by one owner for one
    namespace, and `st.staged` is the number of staged slots of `st` across all owners."""

    def __init__(self):
        self._reservations: dict[int, Reservation] = {}
        self._leases: dict[int, Lease] = {}
        self._staged: dict[object, dict[int, tuple[int, object, int]]] = {}   # owner -> {offset: (slot, NsState, bytes)}
        self._staged_bytes: dict[object, int] = {}   # owner -> bytes of its staged slots (kept as they change)
        self._writers: set = set()   # owners that asked to stage, until all theirs are given back

    # -- reservations and leases ---------------------------------------------------------------
    def open_reservation(self, res: Reservation) -> None:
        self._reservations[res.id] = res

    def end_reservation(self, rid: int) -> Reservation | None:
        """The open reservation `rid`, now ended; None if it was not open."""
        return self._reservations.pop(rid, None)

    def reservation(self, rid: int) -> Reservation | None:
        return self._reservations.get(rid)

    def open_lease(self, lease: Lease) -> None:
        self._leases[lease.id] = lease

    def end_lease(self, lid: int) -> Lease | None:
        return self._leases.pop(lid, None)

    def lease(self, lid: int) -> Lease | None:
        return self._leases.get(lid)

    def end_all_reservations(self) -> list[Reservation]:
        out, self._reservations = list(self._reservations.values()), {}
        return out

    def end_owners(self, owner) -> tuple[list[Reservation], list[Lease]]:
        """Every reservation and lease `owner` holds, now ended (its staged slots: `unstage`)."""
        rs = [r for r in self._reservations.values() if r.owner == owner]
        ls = [lease for lease in self._leases.values() if lease.owner == owner]
        for r in rs:
            del self._reservations[r.id]
        for lease in ls:
            del self._leases[lease.id]
        return rs, ls

    def counts(self) -> tuple[int, int, int]:
        """(open reservations, open leases, staged slots)."""
        return len(self._reservations), len(self._leases), self.staged_count()

    # -- staged slots ----------------------------------------------------------------------------
    def staging(self, owner) -> dict:
        """A token for staging slots for `owner` across a let-go of the lock: `add_staged` with
        it adds nothing once `owner`'s staged slots were all given back meanwhile."""
        self._writers.add(owner)
        return self._staged.setdefault(owner, {})

    def add_staged(self, owner, token: dict, offset: int, slot: int, st, nbytes: int) -> bool:
        if self._staged.get(owner) is not token:
            return False
        token[offset] = (slot, st, nbytes)
        st.staged += 1
        self._staged_bytes[owner] = self._staged_bytes.get(owner, 0) + nbytes
        return True

    def end_staging(self, owner, token: dict) -> None:
        if not token and self._staged.get(owner) is token:
            del self._staged[owner]
            self._staged_bytes.pop(owner, None)

    def _gone(self, owner, entries) -> None:
        """`entries` of `owner` are no longer staged: its byte count follows."""
        left = self._staged_bytes.get(owner, 0) - sum(e[2] for e in entries)
        if left > 0 and owner in self._staged:
            self._staged_bytes[owner] = left
        else:
            self._staged_bytes.pop(owner, None)

    def take_staged(self, owner, offsets: Sequence[int], st) -> list[int]:
        """The slots at `offsets` (-1: none) that `owner` staged for `st`, no longer staged; or
        LeaseError, changing nothing, if one is not (or is named twice)."""
        mine = self._staged.get(owner, {})
        slots, seen = [], set()
        for off in offsets:
            if off == -1:
                slots.append(-1)
                continue
            held = mine.get(off)
            if held is None or off in seen or held[1] is not st:
                raise LeaseError(f"offset {off} is not a staged slot of this client for namespace "
                                 f"{st.name} (or is named twice)")
            seen.add(off)
            slots.append(held[0])
        gone = [mine.pop(off) for off in seen]
        st.staged -= len(seen)
        if not mine:
            self._staged.pop(owner, None)
        self._gone(owner, gone)
        return slots

    def unstage(self, owner, offsets: Sequence[int] | None) -> list[int]:
        """`owner`'s staged slots at `offsets` (None: all of them), no longer staged; offsets it
        does not hold are ignored. All of them also ends `owner`'s staging: a `stage` under way
        for it (one that let go of the lock) adds nothing after this (`add_staged`)."""
        if offsets is None:
            self._writers.discard(owner)
        mine = self._staged.pop(owner, None) if offsets is None else self._staged.get(owner)
        if not mine:
            return []
        gone = list(mine) if offsets is None else [o for o in dict.fromkeys(offsets)
                                                   if isinstance(o, int) and o in mine]
        slots, entries = [], []
        for off in gone:
            e = mine.pop(off)
            e[1].staged -= 1
            slots.append(e[0])
            entries.append(e)
        if not mine:
            self._staged.pop(owner, None)
        self._gone(owner, entries)
        return slots

    def staged_bytes(self) -> tuple[int, int]:
        """(bytes of staged slots of all owners, how many owners stage: those that asked to,
        until all theirs were given back at once) — O(owners)."""
        return sum(self._staged_bytes.values()), len(self._writers)

    def staged_bytes_of(self, owner) -> int:
        return self._staged_bytes.get(owner, 0)

    def staged_count(self, owner=...) -> int:
        if owner is ...:
            return sum(len(m) for m in self._staged.values())
        return len(self._staged.get(owner, ()))


class Ownership:
    """Who holds which slots, and how they end: reservations aborted, leases released, staged
    slots handed out and given back, and everything a gone connection held taken back. The
    tables are `held` (`Holdings`); this object frees and unpins the slots they name.
    Collaborators: the store's lock (`cond`: `StoreLock`), the block index (the host tier, and
    the blocks a reservation or a lease ends for), the namespace table, and demotion (host
    slots for staging, made room for). See the module docstring for the rules it keeps."""

    def __init__(self, cond, index, namespaces, demotion):
        self.cond = cond
        self.index = index
        self.namespaces = namespaces
        self.demotion = demotion
        self.held = Holdings()

    @property
    def host(self):
        return self.index.host.tier

    def abort(self, res: Reservation) -> None:
        """Give back the slots of an uncommitted reservation."""
        if res.id == 0:
            return
        with self.cond:
            if self.held.end_reservation(res.id) is None:
                return
            self.abort_locked(res)

    def abort_locked(self, res: Reservation) -> None:
        """(Lock held; `res` no longer registered.) Give back the slots `res` still holds."""
        for b in res._blocks:
            if b is not None and b.host_state == RESERVED and b.owner_res == res.id:
                self.index.drop_host(b, evicted=False)
        self.cond.notify_all()

    def release(self, lease: Lease, *, confirm: bool = False) -> None:
        """End a lease; its buffers must no longer be read. (`confirm` is for the daemon's
        client, where a lease can be lost with its connection; here it cannot.)"""
        if lease.id == 0:
            if lease._blocks is None:
                raise LeaseError("this (empty) lease is already released")
            lease._blocks = None
            return
        with self.cond:
            if self.held.end_lease(lease.id) is None:
                raise LeaseError(f"lease {lease.id} is unknown or already released")
            self._release_locked(lease)

    def _release_locked(self, lease: Lease) -> None:
        """(Lock held; `lease` no longer registered.) Drop the pins `lease` holds."""
        for i, b in enumerate(lease._blocks):
            b.host_pins -= 1
            if i < len(lease.gpu_offsets) and lease.gpu_offsets[i] >= 0:
                b.gpu_pins -= 1
            self.index.reap(b)
        lease._blocks = None
        self.cond.notify_all()

    def find_reservation(self, rid: int, owner, *, missing_ok: bool = False) -> Reservation | None:
        """The open reservation `rid` held by `owner`; LeaseError otherwise (the daemon's check
        that a client names only its own slots)."""
        with self.cond:
            r = self.held.reservation(rid)
            if r is None and missing_ok:
                return None   # already committed, aborted or reclaimed
            if r is None or r.owner != owner:
                raise LeaseError(f"reservation {rid} is not an open reservation of this client")
            return r

    def find_lease(self, lid: int, owner) -> Lease:
        """The open lease `lid` held by `owner`; LeaseError otherwise."""
        with self.cond:
            lease = self.held.lease(lid)
            if lease is None or lease.owner != owner:
                raise LeaseError(f"lease {lid} is not an open lease of this client")
            return lease

    def drop_owner(self, owner) -> tuple[int, int]:
        """Abort every reservation and release every lease held by `owner` (a disconnected
        client). Returns (reservations aborted, leases released)."""
        with self.cond:
            rs, ls = self.held.end_owners(owner)
            for r in rs:
                self.abort_locked(r)
            for lease in ls:
                self._release_locked(lease)
            self._unstage_locked(owner, None)
            return len(rs), len(ls)

    # -- staged slots -----------------------------------------------------------------------------
    def stage(self, ns: Namespace, n: int, *, owner, inline: bool = False,
              limit_bytes: int | None = None, pool_bytes: int | None = None) -> list[int]:
        """Up to `n` free host slots of `ns`'s slot size for `owner` to write blocks into before
        it names their keys (`put_staged`): their byte offsets in the arena. Fewer when there
        is no room, past `limit_bytes` staged by `owner` in all, or past its share of
        `pool_bytes`, what all owners together may hold staged (an equal share each, and never
        more than the others leave); `inline`: free slots, or clean blocks' slots (their disk
        copies stay): no I/O, no wait. (Staged slots hold no cached block: the bounds keep
        writers' slots from crowding blocks out of the host tier.)"""
        with self.cond:
            self.cond.check_open()
            st = self.namespaces.state(ns, self.host, self.index.disk.tier)
            sb = st.host_slot_bytes
            token = self.held.staging(owner)
            offsets: list[int] = []
            try:
                for _ in range(max(0, n)):
                    # the room is looked at again for every slot, under the same hold of the lock
                    # as the slot's staging: `host_alloc` may let go of it, and concurrent stages
                    # then take their slots from the same pool
                    if self._stage_room(owner, limit_bytes, pool_bytes) < sb:
                        break
                    if inline:        # free slots, or clean blocks dropped: no I/O, no wait
                        slot = self.host.alloc_slot(sb) if self.demotion.host_room_inline(st, 1) else None
                    else:
                        slot = self.demotion.host_alloc(st)   # may let go of the lock
                    if slot is None:
                        break
                    st = self.namespaces.live(st)   # (forgotten while the lock was let go: the table's own)
                    if self._stage_room(owner, limit_bytes, pool_bytes) < sb:
                        self.host.free_slot(slot)     # others staged while the lock was let go
                        break
                    off = self.host.alloc.offset(slot)
                    if not self.held.add_staged(owner, token, off, slot, st, self.host.alloc.slot_bytes_of(slot)):
                        self.host.free_slot(slot)   # dropped (drop_owner) while the lock was let go
                        return []
                    offsets.append(off)
            except BaseException:
                # nothing reached the client: the slots this call staged go back, and the error
                # says it staged none
                self._unstage_locked(owner, offsets)
                self.held.end_staging(owner, token)
                raise
            self.held.end_staging(owner, token)
            return offsets

    def _stage_room(self, owner, limit_bytes: int | None, pool_bytes: int | None) -> int:
        """(Lock held, `owner` staging.) Bytes `owner` may stage now (see `stage`)."""
        room = 1 << 62
        if limit_bytes is None and pool_bytes is None:
            return room
        mine = self.held.staged_bytes_of(owner)
        if limit_bytes is not None:
            room = limit_bytes - mine
        if pool_bytes is not None:
            total, writers = self.held.staged_bytes()
            room = min(room, pool_bytes // max(1, writers) - mine, pool_bytes - total)
        return max(0, room)

    def unstage(self, owner, offsets: Sequence[int] | None = None) -> int:
        """Give `owner`'s staged slots at `offsets` (None: all of them) back to the free pool;
        offsets it does not hold are ignored. Returns how many went back."""
        with self.cond:
            return self._unstage_locked(owner, offsets)

    def _unstage_locked(self, owner, offsets) -> int:
        """(Lock held.) `unstage`."""
        gone = self.held.unstage(owner, offsets)
        for slot in gone:
            self.host.free_slot(slot)
        if gone:
            self.cond.notify_all()
        return len(gone)

    def staged_slots(self, owner=...) -> int:
        """Staged slots held by `owner` (all owners when not given)."""
        with self.cond:
            return self.held.staged_count(owner)
