"""A real daemon against a model of what may be served (hypothesis' rule-based state machine).

Random sequences drive a real `tierd serve` process through one `Client` shared by several
threads (as an engine shares one) and other clients: puts through staged slots, gets, leases
held across steps while other threads copy, repeated keys, flushes (also while a sync writes,
then kill -9), syncs, kill -9 and restart, failing and hanging disks (requests then time out on
some threads, and in the daemon: a stage or reserve behind a hanging write under a full host),
another client filling host RAM, and namespace churn under a per-uid limit of 3 (the daemon
forgets unused namespaces). And the edges of who owns a slot across processes (DESIGN.md,
"Ownership across processes"; tierd/store/ownership.py, "Slots and the client's process"):

- the daemon ends the shared client's connection (an oversize or incomplete frame) while a
  thread of it copies into staged or reserved slots; another client writes meanwhile, then the
  copy goes on with garbage: the commit raises LeaseError, nobody's blocks change, and the
  connection is let go once the client's end closes;
- restarts (SIGTERM, kill -9, the arena file removed: the daemon exits non-zero) while a lease
  and a reservation are held: leaving the lease's `with` and committing raise LeaseError;
- a sync while a flush runs, then kill -9: what the sync covered survives;
- clients that leave with a stage request unanswered: no staged slot, and no writer's share,
  stays counted for them.

After every step:

- every byte any thread read is exactly what was stored under that key, the filler's too;
- a flushed block is never served again (until put again), kill -9 included;
- a synced block survives kill -9 (when the disk was healthy);
- the staged slots the daemon counts for the shared client are exactly those in its pool.

`TEST_MODEL_EXAMPLES` scales it (default: 20 sequences of up to 25 steps here; a soak is the
same test with a larger value).
"""

import contextlib
import os
import shutil
import subprocess
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from tierd import protocol as P
from tierd.client import Client, DaemonUnavailableError
from tierd.errors import (DiskDegradedError, DiskTierError, KeyFormatError, LeaseError, NamespaceLimitError,
                          UnknownNamespaceError)
from tierd.protocol import RemoteError

from .daemon import SMALL_TOML, DaemonProc
from .helpers import block_for, chain, make_ns

NS = make_ns(model="daemon-model")
CHAINS = {c: chain(NS, 500 + c, 5) for c in range(4)}
FILL = make_ns(model="daemon-model", cache_salt="filler")   # another client's blocks
EXAMPLES = max(1, int(os.environ.get("TEST_MODEL_EXAMPLES", "100")) // 5)
TRANSIENT = (DaemonUnavailableError, LeaseError, TimeoutError, NamespaceLimitError)


TRANSIENT_OR_TIMEOUT = TRANSIENT + (RemoteError,)


def is_transient(e: BaseException) -> bool:
    return isinstance(e, TRANSIENT) or (isinstance(e, RemoteError) and e.code == "timeout")


class transient:
    """Swallow what a request may meet under faults: a lost connection, a client-side or
    daemon-side timeout, a refused namespace. Anything else is a failure."""

    def __enter__(self):
        return self

    def __exit__(self, kind, e, tb):
        return e is not None and is_transient(e)


class DaemonModel(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.dir = Path(tempfile.mkdtemp(prefix="tierd-dmodel-"))
        self.faults = self.dir / "faults"
        self.faults.write_text("")
        toml = (SMALL_TOML + f'fault_file = "{self.faults}"\nstall_s = 2.0\n'
                + "[limits]\nrequest_timeout_s = 0.5\nmax_namespaces_per_uid = 3\nframe_timeout_s = 1.0\n")
        self.d = DaemonProc(self.dir, host_bytes="2MiB", disk_bytes="32MiB", toml=toml).start()
        # several threads use it; its writes go through staged slots
        self.shared = Client(self.d.socket, timeout_s=1.0, retries=0, name="shared")
        self.filled: list[bytes] = []        # the filler's keys (exact whenever served)
        self.state: dict[bytes, str] = {}    # key -> "live" | "synced"
        self.flushed: set[bytes] = set()
        self.leases = []
        self.shadowed: set[bytes] = set()   # host copy flushed while leased: a miss until released
        self.disk_ok = True
        self.disk_ok_at = 0.0               # a disk call hung before the fault was cleared: not before
        self.wrong: list[str] = []
        self.fresh = 0                      # chains of keys of this sequence's own (see _fresh_keys)
        # restarts while a lease and a reservation are held (SIGTERM, kill -9, arena removed):
        # one per sequence keeps the run's time (a restart costs up to 2 s)
        self.restarts_left = 1

    def teardown(self):
        self.faults.write_text("")
        for lease in self.leases:
            if lease is None:
                continue
            try:
                self.shared.release(lease)
            except Exception:  # noqa: BLE001
                pass
        self.shared.close()
        if self.d.alive():
            self.d.kill()
        shutil.rmtree(self.dir, ignore_errors=True)

    def _admin(self) -> Client:
        return Client(self.d.socket, timeout_s=30.0)

    def _fresh_keys(self, n: int) -> list[bytes]:
        """Keys of NS that nothing has stored yet (a chain of its own per call)."""
        self.fresh += 1
        return chain(NS, 100_000 + self.fresh, n)

    def _reserve(self, keys, staged: bool):
        """The shared client's reservation of `keys`: in staged slots (its pool, or `stage`), or
        with staging off for the call, a `reserve` request (slots the daemon holds for it)."""
        if staged:
            return self.shared.reserve(NS, keys)
        old, self.shared.stage_bytes = self.shared.stage_bytes, 0
        try:
            return self.shared.reserve(NS, keys)
        finally:
            self.shared.stage_bytes = old

    @staticmethod
    def _write(res, half: bool = False, garbage: bool = False) -> None:
        """A copy into a reservation's slots: the blocks' bytes (their first half: a copy under
        way), or garbage (0xAB), what a thread that goes on copying after its connection ended
        writes."""
        for k, b in zip(res.keys, res.buffers):
            if b is None:
                continue
            if garbage:
                b[:] = 0xAB
            else:
                n = len(b) // 2 if half else len(b)
                b[:n] = block_for(NS, k)[:n]

    def _never_stored(self, keys, where: str) -> None:
        with self._admin() as a:
            if any(a.where(NS, keys)):
                self.wrong.append(f"{where}: a reservation lost with its connection was committed")

    def _daemon_stats_until(self, pred, timeout_s: float):
        """The daemon's stats ("daemon" part) once `pred` holds of them, or None after `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        with self._admin() as a:
            while True:
                d = a.stats()["daemon"]
                if pred(d):
                    return d
                if time.monotonic() > deadline:
                    return None
                time.sleep(0.02)

    def _read_back_all(self, where: str) -> None:
        """Every block of the chains and every block the model knows, read back by another
        client: exact where served (and a flushed one not served)."""
        keys = list(dict.fromkeys([k for c in CHAINS.values() for k in c] + list(self.state)))
        with self._admin() as a:
            for k in keys:
                with transient():
                    self._check([k], a.get(NS, [k]), where)

    def _check(self, keys, got, where):
        for k, g in zip(keys, got):
            if not np.array_equal(np.asarray(g), block_for(NS, k)):
                self.wrong.append(f"{where}: wrong bytes")
            if k in self.flushed:
                self.wrong.append(f"{where}: a flushed block was served")

    # -- rules --------------------------------------------------------------------------------
    @rule(c=st.integers(0, 3), upto=st.integers(1, 5))
    def put(self, c, upto):
        keys = CHAINS[c][:upto]
        try:
            self.shared.put(NS, keys, [block_for(NS, k) for k in keys])
        except TRANSIENT_OR_TIMEOUT as e:
            if not is_transient(e):
                raise
            return
        with self._admin() as a:
            for k, where in zip(keys, a.where(NS, keys)):
                if where:
                    self.state.setdefault(k, "live")
                    self.flushed.discard(k)

    @rule(cs=st.lists(st.integers(0, 3), min_size=2, max_size=4))
    def threads_get_and_put(self, cs):
        """Several threads on the one shared client at once."""
        for c in cs:   # put again during this step by some thread: no longer "flushed"
            self.flushed.difference_update(CHAINS[c][:2])
        def work(c):
            keys = CHAINS[c]
            try:
                self._check(keys, self.shared.get(NS, keys), "threaded get")
                self.shared.put(NS, keys[:2], [block_for(NS, k) for k in keys[:2]])
            except Exception as e:  # noqa: BLE001 -- anything else is a failure of the client
                if is_transient(e):
                    return
                self.wrong.append(f"threaded: {type(e).__name__}: {e}")
        threads = [threading.Thread(target=work, args=(c,)) for c in cs]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        with self._admin() as a:      # what the threads' puts kept
            for c in cs:
                for k, where in zip(CHAINS[c][:2], a.where(NS, CHAINS[c][:2])):
                    if where:
                        self.state.setdefault(k, "live")
                        self.flushed.discard(k)

    @precondition(lambda self: len(self.leases) < 2)
    @rule(c=st.integers(0, 3), pipelined=st.booleans())
    def hold_a_lease(self, c, pipelined):
        """A lease held over the next steps; or a pipelined one (the connectors' loads), its
        answer read by the next request on the shared client (so that the daemon has pinned
        its blocks before the model's other clients act), and then checked at its release."""
        lease = None      # the model's count of holds must not depend on timing
        try:
            lease = self.shared.acquire(NS, CHAINS[c], pipelined=pipelined)
            if lease._pending is not None:
                self.shared.ping()
        except TRANSIENT_OR_TIMEOUT as e:
            if not is_transient(e):
                raise
        self.leases.append(lease)

    @precondition(lambda self: self.leases)
    @rule()
    def read_and_release(self):
        lease = self.leases.pop(0)
        self.shadowed &= {k for lease_ in self.leases if lease_ is not None for k in lease_.keys}
        if lease is None:
            return
        got = [np.array(b, copy=True) for b in lease.buffers]   # a slow copy, after other steps
        try:
            self.shared.release(lease, confirm=True)
        except LeaseError:
            return    # lost (kill -9): the bytes must not be used, and are not checked
        self._check(lease.keys, got, "held lease")

    @rule(c=st.integers(0, 3), i=st.integers(0, 4))
    def repeated_keys(self, c, i):
        keys = CHAINS[c]
        with pytest.raises(KeyFormatError):
            self.shared.acquire(NS, keys[:i] + [keys[i]] + keys[i:])

    def _held(self) -> set[bytes]:
        return {k for lease in self.leases if lease is not None for k in lease.keys}

    @rule(tier=st.sampled_from(["all", "disk", "host"]))
    def flush(self, tier):
        held = self._held()
        recorded = True
        with self._admin() as a:
            try:
                a.flush(tier=tier)
            except DiskDegradedError:
                recorded = False
        self._flushed(tier, held, recorded)

    def _flushed(self, tier, held, recorded):
        """The model after a flush of every namespace from `tier` (what was there when it
        began): `held` (leased) blocks are kept until released."""
        if tier == "host":
            self.shadowed |= held & set(self.state)   # a miss until released, never a wrong byte
            return
        for k in list(self.state):
            if tier == "all" and k not in held:
                del self.state[k]
                if recorded:
                    self.flushed.add(k)
            else:
                self.state[k] = "live"

    @rule()
    def sync(self):
        with self._admin() as a:
            try:
                a.sync()
            except (DiskDegradedError, DaemonUnavailableError):
                return
            except RemoteError as e:       # it ran past the daemon's request timeout
                if e.code != "timeout":
                    raise
                return
            self._synced(a)

    def _synced(self, a: Client) -> None:
        """The model after a sync returned: every block present is on disk, durably."""
        for k in list(self.state):
            if a.where(NS, [k])[0]:
                self.state[k] = "synced"
            else:
                del self.state[k]

    def _sync_ok(self) -> bool:
        """A sync by another client: True when it returned (the blocks present when it was
        called are durable); False when the disk or the daemon failed it."""
        try:
            with self._admin() as a:
                a.sync()
            return True
        except (DiskDegradedError, DaemonUnavailableError):
            return False
        except DiskTierError as e:         # the disk had room: a flush under way held it back too long
            self.wrong.append(f"sync: {type(e).__name__}: {e}")
            return False
        except RemoteError as e:
            if e.code != "timeout":
                raise
            return False

    @rule(seed=st.integers(0, 3))
    def another_client_fills_host_ram(self, seed):
        """150 blocks of 16 KiB through a 2 MiB host: every slot is taken, room is made by
        writing down or dropping; under a hanging disk the daemon's requests time out. What
        the filler stored before is read back first: a slot handed to two clients shows here."""
        keys = chain(FILL, 9000 + seed, 150)
        with Client(self.d.socket, timeout_s=1.0, retries=0, stage_bytes=0) as f:
            with transient():
                if self.filled:
                    self._check_fill(self.filled, f.get(FILL, self.filled[:40]))
            with transient():
                for i in range(0, len(keys), 30):
                    f.put(FILL, keys[i:i + 30], [block_for(FILL, k) for k in keys[i:i + 30]])
        self.filled = keys

    def _check_fill(self, keys, got):
        for k, g in zip(keys, got):
            if not np.array_equal(np.asarray(g), block_for(FILL, k)):
                self.wrong.append("filler: another client's block was read back with other bytes")

    @rule(first=st.integers(0, 20))
    def namespace_churn(self, first):
        """A client of the same uid goes through namespaces with lookups only (limit 3): the
        daemon forgets unused ones, never one the shared client holds staged slots of."""
        with Client(self.d.socket, timeout_s=1.0, retries=0, stage_bytes=0) as c:
            for i in range(first, first + 4):
                ns = make_ns(model="daemon-model", cache_salt=f"churn-{i}")
                with transient():
                    c.lookup(ns, chain(ns, i, 1))

    @rule(tier=st.sampled_from(["all", "disk"]), pause_ms=st.integers(0, 60), kill=st.booleans())
    def flush_while_a_sync_writes(self, tier, pause_ms, kill):
        """A sync writes host blocks down on one connection while a flush runs on another;
        maybe a kill -9 right after. No flushed block may come back."""
        done = threading.Event()

        def sync():
            try:
                with self._admin() as a:
                    a.sync()
            except Exception:  # noqa: BLE001 -- a failing disk or the kill fails it: not what is tested
                pass
            done.set()
        t = threading.Thread(target=sync)
        t.start()
        time.sleep(pause_ms / 1000)
        self.flush(tier)
        if kill:
            self.kill_9_and_restart()
        t.join(60)

    @precondition(lambda self: self.disk_ok)
    @rule(tier=st.sampled_from(["all", "disk"]), pause_ms=st.integers(0, 30), kill=st.booleans())
    def sync_while_another_namespace_flushes(self, tier, pause_ms, kill):
        """A sync while a flush of the filler's namespace runs (maybe a kill -9 after): NS is
        outside its scope, so every NS block present before the sync is durable once it returns."""
        time.sleep(max(0.0, self.disk_ok_at - time.monotonic()))
        out = {}

        def sync():
            out["ok"] = self._sync_ok()
        t = threading.Thread(target=sync)
        t.start()
        time.sleep(pause_ms / 1000)
        with self._admin() as a:
            with contextlib.suppress(DiskDegradedError, UnknownNamespaceError):
                a.flush(tier=tier, namespace=FILL)
        t.join(60)
        if out.get("ok"):
            with self._admin() as a:
                self._synced(a)
        if kill:
            self.kill_9_and_restart()

    @precondition(lambda self: self.disk_ok)
    @rule(tier=st.sampled_from(["all", "disk"]), c=st.integers(0, 3), n=st.integers(1, 4), kill=st.booleans())
    def sync_during_a_flush(self, tier, c, n, kill):
        """A flush of everything runs on one connection; once it has begun (a block it drops is
        seen to go, or it returned) another client commits new blocks, then a sync runs (it
        waits for the flush: tierd/store/demotion.py), maybe a kill -9 after. The flush drops
        what was there before it; a sync that returned made durable every block present when it
        was called: those committed after the flush began, and (a disk flush) those whose disk
        copies it dropped."""
        time.sleep(max(0.0, self.disk_ok_at - time.monotonic()))
        held = self._held()
        keys = CHAINS[c]
        with Client(self.d.socket, timeout_s=5.0, retries=0, name="syncer") as w:
            try:
                w.put(NS, keys, [block_for(NS, k) for k in keys])
                before = w.where(NS, keys)          # (after the put's reply: it is applied)
            except TRANSIENT_OR_TIMEOUT as e:
                if not is_transient(e):
                    raise
                return
            for k, where in zip(keys, before):
                if where:
                    self.state.setdefault(k, "live")
                    self.flushed.discard(k)
            # what shows that the flush has begun: a block it drops going from the index (all:
            # were it evicted instead, the flush may begin after the sync, and then drops what
            # the model would claim; it is not claimed: see _synced), or that it returned (disk:
            # one beginning after the sync would drop disk copies of blocks still listed)
            marker = next((k for k, wh in zip(keys, before) if wh and k not in held), None) if tier == "all" else None
            out, done = {}, threading.Event()

            def flush():
                try:
                    with self._admin() as a:
                        a.flush(tier=tier)
                    out["recorded"] = True
                except DiskDegradedError:
                    out["recorded"] = False
                except Exception as e:  # noqa: BLE001
                    out["error"] = f"{type(e).__name__}: {e}"
                done.set()
            t = threading.Thread(target=flush)
            t.start()
            deadline = time.monotonic() + 30
            while not done.is_set() and time.monotonic() < deadline:
                if marker is not None and not w.where(NS, [marker])[0]:
                    break
                time.sleep(0.002)
            after = self._fresh_keys(n)      # never stored: committed after the flush began
            try:
                w.put(NS, after, [block_for(NS, k) for k in after])
                committed = [k for k, wh in zip(after, w.where(NS, after)) if wh]
            except TRANSIENT_OR_TIMEOUT as e:
                if not is_transient(e):
                    raise
                committed = []
            ok = self._sync_ok()
            t.join(60)
        if "error" in out:
            self.wrong.append(f"flush: {out['error']}")
            return
        self._flushed(tier, held, out.get("recorded", False))
        for k in committed:
            self.state[k] = "live"
        if ok:
            with self._admin() as a:
                self._synced(a)
        if kill:
            self.kill_9_and_restart()

    @rule()
    def kill_9_and_restart(self):
        self._restart("kill")

    def _restart(self, how: str) -> None:
        """Stop the daemon (kill -9; SIGTERM; or remove its arena file: it must exit non-zero
        within 15 s) and start it again. Host-only blocks may be lost; synced ones survive."""
        self.faults.write_text("")
        self.disk_ok, self.disk_ok_at = True, 0.0    # hung calls die with the daemon
        if how == "kill":
            self.d.kill()
        elif how == "term":
            rc = self.d.stop()
            if rc != 0:
                self.wrong.append(f"SIGTERM: the daemon exited with status {rc}")
        else:
            arenas = self.d.arena_files()
            assert arenas, "no arena file in the daemon's arena_dir"
            for f in arenas:
                os.unlink(f)
            try:
                rc = self.d.wait(15)
            except subprocess.TimeoutExpired:
                self.wrong.append("the daemon served on for 15 s after its arena file was removed")
                self.d.kill()
            else:
                if rc == 0:
                    self.wrong.append("the arena file was removed: the daemon exited with status 0")
        self.d.start()
        self.shadowed.clear()   # the daemon's leases went with it
        for k, s in list(self.state.items()):
            if s != "synced":
                del self.state[k]

    @precondition(lambda self: self.restarts_left > 0)
    @rule(how=st.sampled_from(["term", "kill", "arena"]), c=st.integers(0, 3), staged=st.booleans(),
          n=st.integers(1, 3), pipelined=st.booleans())
    def restart_while_holding(self, how, c, staged, n, pipelined):
        """A lease held in a `with` and a reservation half copied into, across a restart
        (SIGTERM, kill -9, or the arena file removed): leaving the `with` raises LeaseError (a
        lease that outlives its daemon ends with an error, never quietly). Another client then
        writes blocks into the new daemon; the copy goes on with garbage (through the old
        arena's mapping) and reaches none of them, and its commit raises LeaseError, storing
        nothing."""
        self.restarts_left -= 1
        sh, fresh = self.shared, self._fresh_keys(n)
        res = lease = None
        with transient():
            res = self._reserve(fresh, staged)
        with transient():
            lease = sh.acquire(NS, CHAINS[c], pipelined=pipelined)   # (pipelined: answered or not)
        if res is not None:
            self._write(res, half=True)
        lost, got = False, []
        try:
            with lease if lease is not None else contextlib.nullcontext():
                self._restart(how)
                if lease is not None:
                    got = [np.array(b, copy=True) for b in lease.buffers]
        except LeaseError:
            lost = True
        if lease is not None and len(lease.keys) and not lost:
            self.wrong.append(f"restart ({how}): a lease held across it ended without LeaseError")
            self._check(lease.keys, got, "a lease held across a restart")
        other = self._fresh_keys(32)     # the new daemon's slots, handed to another client
        with Client(self.d.socket, timeout_s=2.0, retries=0, stage_bytes=0, name="other") as f:
            with transient():
                f.put(NS, other, [block_for(NS, k) for k in other])
            if res is not None:
                self._write(res, garbage=True)   # the copy goes on, through the old arena's mapping
            with transient():
                self._check(other, f.get(NS, other), f"another client's block, after a restart ({how})")
        if res is not None:
            if res.num_reserved:
                try:
                    sh.commit(res)
                    self.wrong.append(f"restart ({how}): a reservation made before it was committed")
                except LeaseError:
                    pass
            else:
                with transient():
                    sh.abort(res)
            self._never_stored(fresh, f"restart ({how})")
        self._read_back_all(f"after a restart ({how}) with a copy going on into the old arena")

    @precondition(lambda self: not any(self.leases))   # (a held lease would keep the ended connection)
    @rule(staged=st.booleans(), n=st.integers(1, 4), c=st.integers(0, 3), reconnect=st.booleans(),
          end=st.sampled_from(["oversize", "oversize", "incomplete"]))
    def daemon_ends_the_connection_mid_copy(self, staged, n, c, reconnect, end):
        """The daemon ends the shared client's connection (a frame over max_frame_bytes, or one
        left incomplete past frame_timeout_s, sent raw on its socket — the client itself never
        sends either) while another thread of the client holds a lease and has copied half
        of its reservation (staged slots, or a `reserve`). Maybe a request on this thread then
        reconnects the client (the old socket stays open while the copy holds it). Another
        client writes blocks; then the copy goes on, with garbage. The daemon hands the
        connection's slots on only once the client's end closes, so the other client's blocks
        — and every block of the model — read back exact; the commit raises LeaseError and
        stores nothing, leaving the lease's `with` raises LeaseError, and once the client has
        closed its end the daemon lets the connection go (its stats' ended_waiting)."""
        sh, fresh = self.shared, self._fresh_keys(n)
        res = None
        with transient():
            res = self._reserve(fresh, staged)
        if res is None:
            return
        if not res.num_reserved:     # no room: nothing to copy into
            with transient():
                sh.abort(res)
            return
        lease = None
        with transient():
            lease = sh.acquire(NS, CHAINS[c])
        before = self._daemon_stats_until(lambda d: True, 0)["ended_waiting"]
        paused, go, out = threading.Event(), threading.Event(), {}

        def copy():   # another thread of the client
            try:
                self._write(res, half=True)
                paused.set()
                go.wait(30)
                self._write(res, garbage=True)   # after the connection ended: must reach no one
                try:
                    sh.commit(res)
                    out["commit"] = "stored"
                except LeaseError:
                    out["commit"] = "LeaseError"
                if lease is not None:
                    try:
                        lease.__exit__(None, None, None)
                        out["lease"] = "kept"
                    except LeaseError:
                        out["lease"] = "LeaseError"
            except BaseException as e:  # noqa: BLE001
                out["error"] = f"{type(e).__name__}: {e}"
            finally:
                paused.set()
        t = threading.Thread(target=copy)
        t.start()
        paused.wait(30)
        with sh._lock:     # on the connection the copy holds: the daemon cannot read past it
            link, sock = sh._link, sh._sock
            too_big = sh.limits.get("max_frame_bytes", P.DEFAULT_MAX_FRAME_BYTES) + 1
            try:
                sock.sendall(P.HEADER.pack(too_big) if end == "oversize" else P.HEADER.pack(64) + b"\x80" * 8)
            except (OSError, AttributeError):
                link = None     # (already gone: a restart in an earlier step the client has not seen)
        if link is not None and self._daemon_stats_until(lambda d: d["ended_waiting"] > before, 5) is None:
            self.wrong.append(f"an {end} frame on a connection that holds slots: not ended (ended_waiting)")
        if reconnect:
            with transient():
                self._check(CHAINS[c], sh.get(NS, CHAINS[c]), "a get on this thread after the daemon ended it")
        other = self._fresh_keys(48)
        with Client(self.d.socket, timeout_s=2.0, retries=0, stage_bytes=0, name="other") as f:
            with transient():
                for i in range(0, len(other), 16):
                    f.put(NS, other[i:i + 16], [block_for(NS, k) for k in other[i:i + 16]])
            go.set()
            t.join(30)
            with transient():
                self._check(other, f.get(NS, other), "another client's block, written while a copy was paused")
        if "error" in out:
            self.wrong.append(f"the copying thread: {out['error']}")
        elif link is not None:
            if out.get("commit") != "LeaseError":
                self.wrong.append(f"a reservation's commit after the daemon ended its connection: {out.get('commit')}")
            if lease is not None and len(lease.keys) and out.get("lease") != "LeaseError":
                self.wrong.append("a lease whose connection the daemon ended was released without LeaseError")
        self._never_stored(fresh, "the daemon ended the connection")
        self._read_back_all("after the daemon ended a connection mid-copy")
        if link is not None:
            # the client's end is closed (no thread holds it): the daemon lets the connection go
            if self._daemon_stats_until(lambda d: d["ended_waiting"] <= before, 5) is None:
                self.wrong.append("the client closed its end: the daemon still counts the connection ended_waiting")

    @precondition(lambda self: self.disk_ok and not any(self.leases))
    @rule(n=st.integers(1, 16), leavers=st.integers(1, 3), delay_ms=st.sampled_from([0, 0.2, 2]))
    def clients_leave_mid_stage(self, n, leavers, delay_ms):
        """Clients that staged slots send another `stage` and close their socket before its
        reply. Afterwards nothing stays counted for them: the daemon's staged slots are the live
        clients' own, and a lone writer's share of the staging pool is what it was before."""
        time.sleep(max(0.0, self.disk_ok_at - time.monotonic()))
        with self.shared._lock:
            self.shared._disconnect()    # (it holds nothing: the probe is then the lone writer)

        def lone_share() -> int:
            with Client(self.d.socket, timeout_s=5.0, retries=0, name="probe") as p:
                p.register(NS)
                return len(p._call("stage", ns=NS.name, n=64)["slots"])

        def settled(d) -> bool:
            return (d["requests_running"] == 0 and all(x["name"] not in ("leaver", "shared", "probe")
                                                        for x in d["client_list"]))
        try:
            if self._daemon_stats_until(settled, 5) is None:
                self.wrong.append("a client that closed its socket is still listed by the daemon")
                return
            share = lone_share()
            for _ in range(leavers):
                c = Client(self.d.socket, timeout_s=5.0, retries=0, name="leaver")
                c.register(NS)
                c._call("stage", ns=NS.name, n=2)     # a writer with staged slots
                with c._lock:
                    c._send(c._encode({"id": next(c._ids), "op": "stage", "ns": NS.name, "n": n}),
                            time.monotonic() + 5)
                time.sleep(delay_ms / 1000)
                c.close()                             # before the reply
            d = self._daemon_stats_until(settled, 5)
            if d is None:
                self.wrong.append("clients that left mid-stage are still listed by the daemon")
                return
            with self._admin() as a:
                st_ = a.stats()
            live = sum(x["staged_slots"] for x in st_["daemon"]["client_list"])
            if st_["staged_slots"] != live:
                self.wrong.append(f"clients left mid-stage: the daemon counts {st_['staged_slots']} staged slots, "
                                  f"its live clients hold {live}")
            again = lone_share()
            if again != share:
                self.wrong.append(f"clients left mid-stage: a lone writer's share went from {share} to {again} slots")
        except TRANSIENT_OR_TIMEOUT as e:
            if not is_transient(e):
                raise

    @rule(fault=st.sampled_from(["", "write=EIO", "all=EIO", "read=hang:3", "write=hang:3"]))
    def disk_fault(self, fault):
        old = self.faults.read_text()
        self.faults.write_text(fault)
        self.disk_ok = fault == ""
        if "hang:" in old:
            # a call that began hanging before the fault went keeps hanging its time out: the
            # disk is stalled (disk-only blocks are misses, not waits) until it has returned
            hang_s = float(old.split("hang:")[1].split()[0])
            self.disk_ok_at = time.monotonic() + hang_s + 0.5

    # -- invariants ---------------------------------------------------------------------------
    @invariant()
    def nothing_wrong_was_served(self):
        assert not self.wrong, self.wrong[:3]

    @invariant()
    def staged_slots_are_the_clients_own(self):
        """What the daemon counts as the shared client's staged slots is its pool: none taken
        back while the client holds it, none leaked."""
        c = self.shared
        if not c.connected:
            return
        try:
            c.where(NS, CHAINS[0][:1])       # reads the replies of its deferred puts
        except Exception:  # noqa: BLE001 -- lost or timed out: its pool went with the connection
            return
        deadline = time.monotonic() + 10
        while True:
            with self._admin() as a:
                st_ = a.stats()
            mine = [x for x in st_["daemon"]["client_list"] if x["name"] == "shared"]
            counted = sum(x["staged_slots"] for x in mine)
            held = sum(len(p) for p in c._stage_pool.values()) if c.connected else 0
            # (a request still running may hold slots it has not handed out yet; a connection
            # given up may not have been reaped yet)
            settled = st_["daemon"]["requests_running"] == 0 and len(mine) <= 1
            if counted == held and settled:
                return
            if time.monotonic() > deadline:
                assert counted == held, f"the daemon counts {counted} staged slots, the client holds {held}"
                return
            time.sleep(0.1)

    @invariant()
    def flushed_blocks_stay_gone(self):
        if self.flushed:
            with self._admin() as a:
                for k in self.flushed:
                    assert a.lookup(NS, [k]) == 0, "a flushed block is listed"

    @invariant()
    def synced_blocks_are_served(self):
        if not self.disk_ok:
            return
        time.sleep(max(0.0, self.disk_ok_at - time.monotonic()))
        with self._admin() as a:
            for k, s in self.state.items():
                if s == "synced" and k not in self.shadowed:
                    got = a.get(NS, [k])
                    assert len(got) == 1, "a synced block is not served"
                    self._check([k], got, "synced")


DaemonModel.TestCase.settings = settings(max_examples=EXAMPLES, stateful_step_count=25, deadline=None,
                                         suppress_health_check=list(HealthCheck))


@pytest.mark.slow
@pytest.mark.timeout(max(300, 30 * EXAMPLES))   # a soak runs longer than one suite's test
class TestDaemonAgainstTheModel(DaemonModel.TestCase):
    pass
