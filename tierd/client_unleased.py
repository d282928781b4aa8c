"""Reads without a lease, the client's side: blocks the daemon's shared lookup index
(tierd/index.py) shows ready in host RAM are copied straight out of their slots with no request,
and count only if the index shows no change to them afterwards; the keys read are reported to the
daemon later, in one unanswered `hits` message (by the next read, or by a background thread when
the client idles). Part of `Client` (tierd/client.py), whose constructor declares the state used
here (`_unleased_ok`, `_hits`, `_hits_keys`, `_hits_since`, `_hits_cv`, `_hits_reporter`, the
counters `unleased_reads` and `unleased_discarded`). Where the index cannot tell, `get` leases.
"""

from __future__ import annotations

import threading
import time
import weakref
from collections.abc import Sequence

from . import protocol as P
from . import threads
from .client_handles import ClientLease, PendingGrant
from .keys import check_keys
from .namespace import Namespace
from .transfer import copy_block


def _report_hits_when_due(ref, cv: threading.Condition) -> None:
    """A client's hits reporter (see `Client._wake_hits_reporter`). It holds the client only
    weakly while it waits, so a client dropped without `close` is still collected."""
    me = threading.current_thread()
    with cv:
        while True:
            c = ref()
            if c is None or c._hits_reporter is not me:
                return
            if c._hits:
                wait = c._hits_since + c.HITS_MAX_AGE_S - time.monotonic()
                if wait <= 0:
                    c._report_hits()   # a lost connection just drops them, as at a read
                    continue
            else:
                wait = 5.0             # idle: look again now and then, in case it was dropped
            del c
            cv.wait(wait)


class UnleasedReads:
    """Part of `Client`: its state is the client's."""

    HITS_BATCH = 256       # keys read without a lease, reported to the daemon in one message ...
    HITS_MAX_AGE_S = 0.05  # ... or once the oldest unreported one is this old (at the next
                           # read, or by a background thread when the client goes idle)

    def _get_unleased(self, nsobj: Namespace, keys: list[bytes], dsts, out) -> list | None:
        """`get` without a lease (tierd/index.py), or None where the lease must decide: the
        index cannot tell, a lease might get more blocks, or a block changed during the copy."""
        got: list = []

        def copy(views) -> None:
            if dsts is None:
                got[:] = [v.copy() for v in views]
            else:
                for dst, v in zip(dsts, views):
                    copy_block(dst, v)
                got[:] = list(out[:len(views)])
        return None if self._read_unleased(nsobj, keys, copy) is None else got

    def read_unleased(self, ns, keys: Sequence[bytes], copy) -> int | None:
        """The leading blocks of `keys` read straight out of their host slots, with no request to
        the daemon, where its shared index shows them ready, as `get` does: `copy(views)` gets
        read-only views of the slots of the blocks to read (at least one) and must copy them out
        before it returns. Returns how many blocks were read (all exact: what a lease would have
        served), or None where the index cannot tell or a block changed while `copy` ran — then
        whatever `copy` wrote must not be used: lease the blocks (`acquire`) and copy again.
        For callers that copy at once and can redo a copy, such as a load into an engine's KV
        blocks that nothing reads before the load is done."""
        if not (self._unleased_ok and keys):
            return None
        return self._read_unleased(self._namespace(ns), check_keys(keys), copy)

    def _index_run(self, nsobj: Namespace, keys: list[bytes]):
        """(Lock held.) The leading blocks of `keys` the shared index shows ready in host RAM, as
        `SharedIndex.host_run` gives them — None where it cannot tell, where a lease might get
        more (from disk, or this client's writes in flight) or more than one request may name,
        or where reads go to HBM copies."""
        hbm = self._gpu_arena is not None if self._hbm is None else self._hbm
        idx = self._index
        # (a stalled daemon's table is read too: nothing moves while it is stopped, and what
        # moved before shows in the sequence numbers)
        if hbm or idx is None or self._sock is None or self._hup.poll(0):
            return None
        run = idx.host_run(nsobj.id, keys)
        if run is None:
            return None
        n, final = run[0], run[1]
        if n < len(keys) and (not final or self._putting or self._deferred_commits):
            return None
        if n > self.limits.get("max_keys_per_request", P.DEFAULT_MAX_KEYS):
            return None
        return run

    def _read_unleased(self, nsobj: Namespace, keys: list[bytes], copy) -> int | None:
        with self._lock:
            idx, arena = self._index, self._arena_ro
            run = self._index_run(nsobj, keys)
            if run is None:
                return None
            n, _, ways, seqs, offsets = run
            limit = self.limits.get("max_keys_per_request", P.DEFAULT_MAX_KEYS)
            if self._hits_keys + n > limit:
                self._report_hits()
            link = self._pin()
        try:
            bb = nsobj.block_bytes
            copy([arena[o:o + bb] for o in offsets])
            with self._lock:
                if (idx is not self._index or link is not self._link or self._hup.poll(0)
                        or not idx.unchanged(ways, seqs)):
                    self.unleased_discarded += 1
                    return None
                self.unleased_reads += 1
                self._note_hits(nsobj, keys[:n], len(keys))
            return n
        finally:
            self._unpin(link)

    def _note_hits(self, nsobj: Namespace, keys: list[bytes], asked: int) -> None:
        """(Lock held.) Blocks read without a daemon lease, reported in the next `hits` message."""
        if not self._hits:
            self._hits_since = time.monotonic()
            self._wake_hits_reporter()
        self._hits.append({"ns": nsobj.name, "keys": keys, "asked": asked})
        self._hits_keys += len(keys)
        if self._hits_keys >= self.HITS_BATCH or time.monotonic() - self._hits_since >= self.HITS_MAX_AGE_S:
            self._report_hits()

    def _acquire_pipelined(self, nsobj: Namespace, keys: list[bytes]) -> ClientLease | None:
        """`acquire(..., pipelined=True)`: where the shared index shows the blocks ready in host
        RAM, a lease of them whose request is sent and not waited for. The bytes count only if
        the index shows no change to those slots from before the first read until after the copy
        (as a read without a lease). With a daemon that takes quiet leases the request is never
        answered: the daemon pins the blocks when it reads it (or, where they moved meanwhile,
        does nothing), and the release names it by its request's id; with an older one the
        answer is read at release, and must name the very slots the index showed. Where that
        daemon's host tier evicted nothing within `pin_after_eviction_s`, nothing is sent at
        all: nothing but a flush would take the slots, the copy is checked all the same, and the
        hit is reported with the reads without a lease.
        None where the index cannot tell, or a lease might get more blocks: lease as usual."""
        with self._lock:
            idx = self._index
            run = self._index_run(nsobj, keys) if self._unleased_ok else None
            if run is None:
                return None
            n, _, ways, seqs, offsets = run
            bb = nsobj.block_bytes
            views = [self._view(o, bb, False) for o in offsets]
            link = self._pin()
            lease = ClientLease(0, nsobj, keys[:n], views, ["host"] * n, self, self._generation, link)
            grant = lease._pending = PendingGrant(idx, ways, seqs, offsets)
            if self._quiet and self._evictions and not idx.evicted_within(self.pin_after_eviction_s):
                grant.unpinned = True    # nothing to send: the release checks it, the hit is noted
                self.pipelined_leases += 1
                self.unpinned_leases += 1
                return lease
            msg = {"op": "acquire", "ns": nsobj.name, "keys": keys[:n]}
            try:
                if self._hits:
                    self._report_hits()   # counted before what this request may show, as `_call` does
                if self._quiet:
                    sent = self._send_deferred(msg, answered=False)
                    grant.request = msg["id"]
                else:
                    sent = self._send_deferred(msg, grant.answered)
            except BaseException:
                self._unpin(link)
                raise
            if not sent:
                self._unpin(link)
                return None   # the connection is gone: lease as usual (it connects again)
            self.pipelined_leases += 1
            return lease

    def _settle_grant(self, lease: ClientLease, link) -> str | None:
        """(Lock held.) A pipelined lease at its release: read the daemon's answer (it came
        during the caller's copy, or comes now); set the lease's id where it was granted.
        Returns why the bytes read under it may not be the blocks', or None."""
        grant = lease._pending
        if grant.request or grant.unpinned:   # a quiet lease or none: no answer to wait for
            if link is None or link is not self._link or link.dead:
                return "the connection to the daemon was lost"
            if grant.index is not self._index or not grant.index.unchanged(grant.ways, grant.seqs):
                return "a block changed while it was read"
            return None
        lost = "the connection to the daemon was lost before it answered"
        if grant.reply is None:
            if link is None or link is not self._link or link.dead:
                return lost
            try:
                self._drain_deferred(time.monotonic() + self.timeout_s, enough=lambda: grant.reply is not None)
            except (OSError, EOFError):
                self._disconnect()
                return lost
            if grant.reply is None:
                return lost
        reply = grant.reply
        if "error" in reply:
            return f"the daemon did not lease them ({reply['error'].get('message', '')})"
        lease.id = int(reply.get("lease") or 0)
        if list(reply.get("offsets", ())) != grant.offsets:
            return "the daemon leased other slots than its index showed"
        if grant.index is not self._index or not grant.index.unchanged(grant.ways, grant.seqs):
            return "a block changed before the daemon leased it"
        return None

    def _wake_hits_reporter(self) -> None:
        """(Lock held.) Make sure the reads of a client that then goes quiet still reach the
        daemon within about HITS_MAX_AGE_S (its stats, and the blocks' recency for eviction):
        one thread per client, started at its first read without a lease, idle otherwise."""
        if self._hits_reporter is None or not self._hits_reporter.is_alive():   # (or forked)
            self._hits_reporter = threads.start(_report_hits_when_due, weakref.ref(self), self._hits_cv,
                                                name=f"tierd-hits-{self.name}")
        else:
            self._hits_cv.notify()

    def _report_hits(self) -> None:
        """(Lock held.) Tell the daemon which blocks were read without a lease (recency, hit
        counts), unanswered; sent before any other request too, so it is counted first."""
        hits, self._hits, self._hits_keys = self._hits, [], 0
        if hits and self._sock is not None:
            self._send_deferred({"op": "hits", "reads": hits}, answered=False)
