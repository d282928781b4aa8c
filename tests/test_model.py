"""The store against a model of what may be served (hypothesis' rule-based state machine).

Random sequences of real operations and faults drive a real embedded store on a real
directory: put, reserve/commit/abort, staged slots (stage, put_staged, a writer dropped),
acquire/release (leases held across steps, HBM readers of an HBM tier kept in host memory),
lookup, get, flush of every tier and namespace (also while a sync writes on another thread),
forgetting unused namespaces, sync, restart, repeated keys, failing and recovering disks,
memory pressure (a host tier of a few dozen blocks). After every step the store is checked
against a plain model:

- whatever is served is exactly the bytes committed under that key (`block_for`);
- a block flushed from every tier is never served again until it is put again, also after a
  restart;
- a block synced (and not flushed since) survives a restart, when the disk was healthy;
- no operation leaves a pin behind: with no lease held, everything can be flushed;
- the staged slots the store counts are the writer's, and a namespace with staged slots or
  blocks is never forgotten.

`TEST_MODEL_EXAMPLES` (default 60 sequences of up to 40 steps: a few thousand steps per run)
sets the length; `python -m pytest tests/test_model.py` with a larger value is the soak.
"""

import os

import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from tierd import TieredStore
from tierd.store import READY
from tierd.errors import DiskDegradedError, KeyFormatError

from .helpers import block_for, chain, make_ns, small_config

SPACES = [make_ns(model="model-a"), make_ns(model="model-b", cache_salt="tenant")]
CHAINS = {(n, c): chain(ns, 100 * n + c, 6) for n, ns in enumerate(SPACES) for c in range(4)}
EXAMPLES = int(os.environ.get("TEST_MODEL_EXAMPLES", "60"))


class StoreModel(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        import tempfile
        self.dir = tempfile.mkdtemp(prefix="tierd-model-")
        self.faults = os.path.join(self.dir, "faults")
        self.store = self._open()
        # the model: per (ns index, key) -> "live" (committed, maybe only in RAM), "synced"
        # (committed and durable), absent = never put or flushed
        self.state: dict[tuple[int, bytes], str] = {}
        self.flushed: set[tuple[int, bytes]] = set()   # dropped by a flush, not put since
        self.leases = []
        self.shadowed: set[tuple[int, bytes]] = set()   # host copy flushed while leased: a miss until released
        self.disk_ok = True
        self.staged: dict[int, list[int]] = {0: [], 1: []}  # the writer's staged slots per namespace

    def _open(self):
        return TieredStore(small_config(None, host_bytes="512KiB", host_slab_bytes="128KiB",
                                        disk_path=os.path.join(self.dir, "disk"), disk_bytes="8MiB",
                                        disk_fault_file=self.faults, disk_stall_s=5.0,
                                        gpu_bytes="128KiB", gpu_slab_bytes="64KiB", gpu_device="cpu",
                                        gpu_admit_hits=1))

    def teardown(self):
        for lease in self.leases:
            self.store.release(lease)
        self.store.close()
        import shutil
        shutil.rmtree(self.dir, ignore_errors=True)

    # -- helpers ------------------------------------------------------------------------------
    def _check_served(self, n, keys, got):
        for k, g in zip(keys, got):
            assert np.array_equal(np.asarray(g), block_for(SPACES[n], k)), "served wrong bytes"
            assert (n, k) not in self.flushed, "served a flushed block"

    # -- rules --------------------------------------------------------------------------------
    @rule(n=st.integers(0, 1), c=st.integers(0, 3), upto=st.integers(1, 6))
    def put(self, n, c, upto):
        ns, keys = SPACES[n], CHAINS[(n, c)][:upto]
        self.store.put(ns, keys, [block_for(ns, k) for k in keys])
        # a put under pressure may drop blocks; what it kept is present now
        for k, there in zip(keys, self.store.where(ns, keys)):
            if there:
                self.state.setdefault((n, k), "live")
                self.flushed.discard((n, k))

    @rule(n=st.integers(0, 1), c=st.integers(0, 3), commit=st.booleans())
    def reserve(self, n, c, commit):
        ns, keys = SPACES[n], CHAINS[(n, c)][:3]
        res = self.store.reserve(ns, keys)
        for buf, k in zip(res.buffers, keys):
            if buf is not None:
                buf[:] = block_for(ns, k)
        if commit:
            self.store.commit(res)
            for k, s in zip(keys, res.status):
                if s == "reserved":
                    self.state.setdefault((n, k), "live")
                    self.flushed.discard((n, k))
        else:
            self.store.abort(res)

    @rule(n=st.integers(0, 1), c=st.integers(0, 3))
    def get(self, n, c):
        keys = CHAINS[(n, c)]
        self._check_served(n, keys, self.store.get(SPACES[n], keys))

    @precondition(lambda self: len(self.leases) < 3)
    @rule(n=st.integers(0, 1), c=st.integers(0, 3), hbm=st.booleans())
    def acquire_and_hold(self, n, c, hbm):
        keys = CHAINS[(n, c)]
        lease = self.store.acquire(SPACES[n], keys, gpu=hbm)
        self._check_served(n, keys, lease.buffers)
        if hbm:   # an HBM reader reads the HBM copies where the lease has them
            self._check_served(n, [k for k, b in zip(lease.keys, lease.gpu_buffers) if b is not None],
                               [b.numpy() for b in lease.gpu_buffers if b is not None])
        if not len(lease):
            self.store.release(lease)     # a lease of nothing holds nothing
            return
        lease.model_ns = n
        self.leases.append(lease)

    @precondition(lambda self: self.leases)
    @rule(i=st.integers(0, 2))
    def release(self, i):
        lease = self.leases.pop(i % len(self.leases))
        # a held lease still reads its own bytes, whatever happened since
        self._check_served(lease.model_ns, lease.keys, lease.buffers)
        self.store.release(lease)
        still = {(l.model_ns, k) for l in self.leases for k in l.keys}
        self.shadowed = {x for x in self.shadowed if x in still}

    @rule(n=st.integers(0, 1), c=st.integers(0, 3), i=st.integers(0, 5))
    def repeated_keys(self, n, c, i):
        keys = CHAINS[(n, c)]
        with pytest.raises(KeyFormatError):
            self.store.acquire(SPACES[n], keys[:i] + [keys[i]] + keys[i:])

    @rule(n=st.integers(0, 1), k=st.integers(1, 4))
    def stage(self, n, k):
        self.staged[n] += self.store.stage(SPACES[n], k, owner="w")

    @precondition(lambda self: self.staged[0] or self.staged[1])
    @rule(n=st.integers(0, 1), c=st.integers(0, 3))
    def put_staged(self, n, c):
        ns, offs = SPACES[n], self.staged[n]
        keys = CHAINS[(n, c)][:len(offs)]
        if not keys:
            return
        mine = [offs.pop() for _ in keys]
        for k, off in zip(keys, mine):
            self.store.host.arena.view(off, ns.block_bytes)[:] = block_for(ns, k)
        self.store.put_staged(ns, keys, mine, owner="w")
        for k, there in zip(keys, self.store.where(ns, keys)):
            if there:
                self.state.setdefault((n, k), "live")
                self.flushed.discard((n, k))

    @rule()
    def writer_goes_away(self):
        self.store.drop_owner("w")
        self.staged = {0: [], 1: []}

    @rule()
    def forget_unused_namespaces(self):
        # (a namespace known only from disk after a restart is not registered: not forgotten)
        registered = {ns.name for ns in SPACES if self.store._namespaces.named(ns.name) is not None}
        gone = self.store.forget_unused([ns.name for ns in SPACES])
        for n, ns in enumerate(SPACES):
            if ns.name in gone and ns.name in registered:
                assert not self.staged[n], "a namespace with staged slots was forgotten"
                for c in range(4):
                    assert not any(self.store.where(ns, CHAINS[(n, c)])), "a namespace with blocks was forgotten"

    @rule(tier=st.sampled_from(["all", "disk"]), pause_ms=st.integers(0, 20))
    def flush_while_a_sync_writes(self, tier, pause_ms):
        import threading
        import time

        def sync():
            try:
                self.store.sync()
            except DiskDegradedError:
                pass
        t = threading.Thread(target=sync)
        t.start()
        time.sleep(pause_ms / 1000)
        self.flush(tier, None)
        t.join(60)

    @rule(tier=st.sampled_from(["all", "disk", "host", "gpu"]), n=st.sampled_from([None, 0, 1]))
    def flush(self, tier, n):
        held = {(l.model_ns, k) for l in self.leases for k in l.keys}
        recorded = True
        try:
            self.store.flush(tier=tier, namespace=None if n is None else SPACES[n])
        except DiskDegradedError:
            assert not self.disk_ok
            recorded = False      # dropped now, but they may come back after a restart
        if tier == "gpu":
            return                 # the HBM tier holds copies of host blocks only
        if tier == "host":
            # a leased host copy is dropped when released; until then the block is a miss even
            # where its disk copy is valid (one host copy per block): a miss, never a wrong byte
            self.shadowed |= {key for key in self.state if key in held and (n is None or key[0] == n)}
            return
        for key in list(self.state):
            if n is not None and key[0] != n:
                continue
            if tier == "all" and key not in held:
                del self.state[key]
                if recorded:
                    self.flushed.add(key)
            else:
                self.state[key] = "live"   # no disk copy now; a RAM copy (leased) may still serve it

    @rule()
    def sync(self):
        try:
            self.store.sync()
        except DiskDegradedError:
            assert not self.disk_ok
            return
        for key in list(self.state):   # every block still here is durable now
            n, k = key
            if self.store.where(SPACES[n], [k])[0]:
                self.state[key] = "synced"
            else:
                del self.state[key]       # dropped earlier (flush of host RAM, eviction)

    @precondition(lambda self: not self.leases)
    @rule()
    def restart(self):
        self.store.close()
        self.store = self._open()
        self.staged = {0: [], 1: []}     # staged slots are the store's, gone with it
        for key, s in list(self.state.items()):
            if s != "synced":
                del self.state[key]      # RAM only: may be gone (not flushed: may not be served?)

    @rule(fault=st.sampled_from(["", "write=EIO", "all=EIO", "flush=ENOSPC"]))
    def disk_fault(self, fault):
        with open(self.faults, "w") as f:
            f.write(fault)
        self.disk_ok = fault == ""

    # -- invariants ---------------------------------------------------------------------------
    @invariant()
    def flushed_blocks_are_gone(self):
        for n, k in self.flushed:
            assert self.store.lookup(SPACES[n], [k]) == 0, "a flushed block is still listed"

    @invariant()
    def synced_blocks_are_served(self):
        if not self.disk_ok:
            return
        for (n, k), s in self.state.items():
            if s == "synced" and (n, k) not in self.shadowed:
                got = self.store.get(SPACES[n], [k])
                assert len(got) == 1, "a synced block is not served"
                self._check_served(n, [k], got)

    @invariant()
    def clean_and_dirty_host_blocks_are_accounted_exactly(self):
        # what the demoter writes down and an allocation drops without I/O: every READY host
        # block is clean (it has a disk copy) or dirty (in the demoter's queue), once
        s = self.store
        with s._cond:
            dirty, clean_bytes = {}, 0
            for b in s._blocks.values():
                want = (1 if b.disk is not None else 0) if b.host_state == READY else -1
                assert b.clean == want, f"block clean={b.clean}, expected {want}"
                if want == 0:
                    dirty[b.ikey] = b
                clean_bytes += b.st.host_slot_bytes if want == 1 else 0
            assert s._dirty == dirty and s._clean_bytes == clean_bytes
            assert s._dirty_bytes == sum(b.st.host_slot_bytes for b in dirty.values())

    @invariant()
    def staged_slots_are_the_writers(self):
        assert self.store.staged_slots("w") == len(self.staged[0]) + len(self.staged[1])
        assert self.store.staged_slots() == self.store.staged_slots("w")

    @invariant()
    def no_pin_is_left_behind(self):
        st_ = self.store.stats()
        assert st_["reservations"] == 0
        assert st_["leases"] == len(self.leases)


StoreModel.TestCase.settings = settings(max_examples=EXAMPLES, stateful_step_count=40, deadline=None,
                                        suppress_health_check=list(HealthCheck))
test_store_against_the_model = pytest.mark.timeout(max(300, EXAMPLES // 5))(StoreModel.TestCase)
