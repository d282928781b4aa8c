"""One `Client` shared by threads (as engines share one): a request that times out on one
thread gives the connection up, yet the slots other threads are copying through stay theirs
until they are done — no other client's block is overwritten, no wrong byte is returned."""

import threading

import numpy as np
import pytest

from tierd.client import Client, DaemonUnavailableError
from tierd.errors import LeaseError

from .daemon import SMALL_TOML, DaemonProc
from .helpers import block_for, chain, make_ns


@pytest.fixture
def hanging_daemon(tmp_path):
    """A daemon whose disk reads can be made to hang (disk.fault_file)."""
    faults = tmp_path / "faults"
    d = DaemonProc(tmp_path, toml=SMALL_TOML + f'fault_file = "{faults}"\n').start()
    d.faults = faults
    yield d
    faults.write_text("")
    if d.alive():
        assert d.stop() == 0


def disk_only_block(d, ns, seed):
    """A block that lives on disk only: an acquire of it must read the disk."""
    (k,) = chain(ns, seed, 1)
    with Client(d.socket) as c:
        c.put(ns, [k], [block_for(ns, k)])
        c.sync()
        c.flush(tier="host")
        assert c.where(ns, [k]) == ["disk"]
    return k


def time_out_one_request(client, ns, key):
    """Make one request of `client` time out, on another thread, and wait for it."""
    seen = []

    def run():
        try:
            client.acquire(ns, [key])
        except DaemonUnavailableError as e:
            seen.append(e)

    t = threading.Thread(target=run)
    t.start()
    t.join(30)
    assert seen and "timed out" in str(seen[0]), "the request did not time out"


def overwrite_host_tier(d, ns, seed, n=600):
    """Another client fills the host tier (600 blocks of 16 KiB > 8 MiB): any slot the daemon
    took back is handed out again and written with this client's blocks."""
    keys = chain(ns, seed, n)
    with Client(d.socket) as other:
        for i in range(0, n, 50):
            other.put(ns, keys[i:i + 50], [block_for(ns, k) for k in keys[i:i + 50]])
    return keys


def assert_exact_where_present(d, ns, keys):
    with Client(d.socket) as c:
        got = c.get(ns, keys)
        for k, g in zip(keys, got):
            assert np.array_equal(g, block_for(ns, k)), "a stored block was overwritten"
    return len(got)


def test_a_timeout_on_one_thread_never_lets_a_reserved_slot_be_reused_mid_copy(hanging_daemon):
    d, ns = hanging_daemon, make_ns()
    slow = disk_only_block(d, ns, 1)
    mine = chain(ns, 2, 8)
    c = Client(d.socket, timeout_s=1.0, retries=0)
    res = c.reserve(ns, mine)            # this thread is about to copy into its slots
    assert res.num_reserved == 8
    d.faults.write_text("read=hang:60")
    time_out_one_request(c, ns, slow)    # ... when a request on another thread times out
    d.faults.write_text("")
    theirs = overwrite_host_tier(d, ns, 3)
    for buf, k in zip(res.buffers, mine):  # the late copy
        buf[:] = np.frombuffer(b"\xee" * ns.block_bytes, dtype=np.uint8)
    with pytest.raises(LeaseError, match="lost with its connection"):
        c.commit(res)                    # nothing committed from a lost reservation
    assert assert_exact_where_present(d, ns, theirs) > 0   # no other client's block overwritten
    with Client(d.socket) as fresh:
        assert fresh.lookup(ns, mine) == 0
    c.close()


def test_a_timeout_on_one_thread_never_lets_a_leased_slot_be_reused_mid_read(hanging_daemon):
    d, ns = hanging_daemon, make_ns()
    slow = disk_only_block(d, ns, 4)
    mine = chain(ns, 5, 8)
    c = Client(d.socket, timeout_s=1.0, retries=0)
    c.put(ns, mine, [block_for(ns, k) for k in mine])
    lease = c.acquire(ns, mine)           # this thread is about to read its blocks
    assert len(lease) == 8
    d.faults.write_text("read=hang:60")
    time_out_one_request(c, ns, slow)
    d.faults.write_text("")
    with Client(d.socket) as other:
        other.flush(tier="host")          # leased blocks stay: the lease still stands
    overwrite_host_tier(d, ns, 6)
    for buf, k in zip(lease.buffers, mine):   # the late read sees its own bytes
        assert np.array_equal(buf, block_for(ns, k))
    c.release(lease, confirm=True)
    c.close()


def test_threads_sharing_a_client_with_timeouts_read_and_write_only_exact_bytes(hanging_daemon):
    """Several threads put and get through one client while another keeps timing out; every
    block any client reads back is exactly the one stored under its key."""
    d, ns = hanging_daemon, make_ns()
    slow = disk_only_block(d, ns, 7)
    c = Client(d.socket, timeout_s=0.5, retries=0)
    stop = threading.Event()
    wrong, errors = [], []

    def worker(seed):
        rng = np.random.default_rng(seed)
        while not stop.is_set():
            keys = chain(ns, int(rng.integers(0, 40)), 4)
            try:
                c.put(ns, keys, [block_for(ns, k) for k in keys])
                for k, g in zip(keys, c.get(ns, keys)):
                    if not np.array_equal(g, block_for(ns, k)):
                        wrong.append(k)
            except (LeaseError, DaemonUnavailableError) as e:
                errors.append(type(e).__name__)

    def timeouts():
        while not stop.is_set():
            try:
                c.acquire(ns, [slow])
            except DaemonUnavailableError:
                pass
            except LeaseError:
                pass

    d.faults.write_text("read=hang:60")
    threads = [threading.Thread(target=worker, args=(i,)) for i in range(3)]
    threads.append(threading.Thread(target=timeouts))
    for t in threads:
        t.start()
    stop.wait(6)
    stop.set()
    for t in threads:
        t.join(30)
    d.faults.write_text("")
    assert not wrong, f"{len(wrong)} blocks read back wrong"
    assert c.reconnects > 0, "no request timed out: the test exercised nothing"
    assert_exact_where_present(d, ns, [k for s in range(40) for k in chain(ns, s, 4)])
    c.close()
