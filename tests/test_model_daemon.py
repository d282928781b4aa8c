"""A real daemon against a model of what may be served (hypothesis' rule-based state machine).

Random sequences drive a real `tierd serve` process through one `Client` shared by several
threads (as an engine shares one) and other clients: puts through staged slots, gets, leases
held across steps while other threads copy, repeated keys, flushes (also while a sync writes,
then kill -9), syncs, kill -9 and restart, failing and hanging disks (requests then time out on
some threads, and in the daemon: a stage or reserve behind a hanging write under a full host),
another client filling host RAM, and namespace churn under a per-uid limit of 3 (the daemon
forgets unused namespaces). After every step:

- every byte any thread read is exactly what was stored under that key, the filler's too;
- a flushed block is never served again (until put again), kill -9 included;
- a synced block survives kill -9 (when the disk was healthy);
- the staged slots the daemon counts for the shared client are exactly those in its pool.

`TEST_MODEL_EXAMPLES` scales it (default: 20 sequences of up to 25 steps here; a soak is the
same test with a larger value).
"""

import os
import shutil
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from tierd.client import Client, DaemonUnavailableError
from tierd.errors import DiskDegradedError, KeyFormatError, LeaseError, NamespaceLimitError
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
                + "[limits]\nrequest_timeout_s = 0.5\nmax_namespaces_per_uid = 3\n")
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
    @rule(c=st.integers(0, 3))
    def hold_a_lease(self, c):
        lease = None      # the model's count of holds must not depend on timing
        try:
            lease = self.shared.acquire(NS, CHAINS[c])
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

    @rule(tier=st.sampled_from(["all", "disk", "host"]))
    def flush(self, tier):
        held = {k for lease in self.leases if lease is not None for k in lease.keys}
        recorded = True
        with self._admin() as a:
            try:
                a.flush(tier=tier)
            except DiskDegradedError:
                recorded = False
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
            for k in list(self.state):
                if a.where(NS, [k])[0]:
                    self.state[k] = "synced"
                else:
                    del self.state[k]

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

    @rule()
    def kill_9_and_restart(self):
        self.faults.write_text("")
        self.disk_ok, self.disk_ok_at = True, 0.0    # hung calls die with the daemon
        self.d.kill()
        self.d.start()
        self.shadowed.clear()   # the daemon's leases went with it
        for k, s in list(self.state.items()):
            if s != "synced":
                del self.state[k]

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
