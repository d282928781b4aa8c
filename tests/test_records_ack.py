"""A put acknowledged is a put recorded: the record of a host block a client put (with the
checksum the client computed as it copied) is on file before the put is acknowledged, so a
kill -9 right after the acknowledgement loses none of its blocks, however busy the machine, with
no help from the keeper thread.

The daemons here run with their keeper threads never started (`KEEPER_OFF`, a launcher that
no-ops `HostKeeping._keep_start` before `tierd serve` runs): what the commit itself did not
record is then never recorded, deterministically, not only when a busy machine starves the
keeper. Six CPU-bound processes share the cores with the daemon and the client meanwhile, as
in the review that found "0 of 192 host-only blocks re-adopted" (before, the first blocks of a
namespace waited for the keeper to write its description into the namespace file, and a
starved keeper never did).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from tierd import TieredStore
from tierd.client import Client
from tierd.tiers.host_records import HostRecords, read_records
from tierd.transfer import fill_reservation

from .daemon import DaemonProc
from .helpers import assert_exact, block_for, chain, make_ns, put_chain, wait_for

# `tierd serve` with no keeper thread (test only): records are written by commits, or never.
KEEPER_OFF = (
    "import sys\n"
    "from tierd.store.keeping import HostKeeping\n"
    "HostKeeping._keep_start = lambda self: None\n"
    "from tierd.cli import main\n"
    "sys.exit(main(sys.argv[1:]))\n"
)

HOGS = 6


def start_hogs(n: int = HOGS) -> list[subprocess.Popen]:
    return [subprocess.Popen([sys.executable, "-c", "while True:\n    pass\n"]) for _ in range(n)]


def stop_hogs(hogs: list[subprocess.Popen]) -> None:
    for p in hogs:
        if p.poll() is None:
            p.kill()
    for p in hogs:
        p.wait(30)


def put_hashed(c: Client, ns, keys, how: str) -> None:
    """Put `keys`' blocks, hashed as they are copied: `put` (into staged slots) returns once
    its request is sent (the replies are read with the next request's); `commit` returns with
    the daemon's reply."""
    blocks = [block_for(ns, k) for k in keys]
    if how == "put":
        assert c.put(ns, keys, blocks) == len(keys)
    else:
        res = c.reserve(ns, keys)
        assert res.id > 0 and res.num_reserved == len(keys)
        fill_reservation(c, res, blocks, hashed=True)
        assert all(x >= 0 for x in res.checksums)
        assert c.commit(res) == len(keys)


@pytest.mark.parametrize("how", ["put", "commit"], ids=["staged put", "reserve and commit"])
def test_every_acknowledged_put_survives_a_kill_on_a_busy_machine_without_the_keeper(tmp_path, how):
    """16 MiB host tier, 64 MiB disk tier; 25 chains of 8 blocks of 64 KiB, including the first
    puts of two namespaces (one of them mid-run); the daemon is killed -9 as soon as the last
    put is acknowledged, with six CPU hogs running and no keeper thread. The restarted daemon
    serves every block, bit-exact, the host-only ones re-adopted into host RAM."""
    ns = make_ns(num_layers=8)                      # 64 KiB blocks
    ns2 = make_ns(model="second", num_layers=8)     # a namespace whose first put comes mid-run
    assert ns.block_bytes == 64 << 10
    spaces = [ns2 if i >= 12 and i % 2 else ns for i in range(25)]
    chains = [(n, chain(n, 100 + i, 8)) for i, n in enumerate(spaces)]
    d = DaemonProc(tmp_path, host_bytes="16MiB", disk_bytes="64MiB", launcher=("-c", KEEPER_OFF)).start()
    c = Client(d.socket, stage_bytes=(64 << 20) if how == "put" else 0)
    hogs = start_hogs()
    try:
        for n, keys in chains:
            put_hashed(c, n, keys, how)
        if how == "put":
            c.ping()                                # reads the puts' replies: all acknowledged
        d.kill()
        stop_hogs(hogs)
        d.launcher = ["-m", "tierd"]                # an ordinary daemon from here on
        d.start()
        where = {}
        for n, keys in chains:
            for k, w in zip(keys, c.where(n, keys)):
                where[k] = w
        lost = [k.hex()[:8] for k, w in where.items() if not w]
        assert not lost, f"{len(lost)} of {len(where)} acknowledged blocks were lost: {lost[:8]}"
        host = c.stats()["tiers"]["host"]
        in_host = sum("host" in w for w in where.values())
        assert host["adopted_blocks"] == in_host and host["adopt_dropped"] == 0
        assert in_host >= 150, where                # most of them never left host RAM
        for n, keys in chains:
            assert_exact(c, n, keys)
    finally:
        stop_hogs(hogs)
        c.close()
        if d.alive():
            assert d.stop() == 0


def test_a_block_committed_without_its_checksum_is_recorded_within_the_due_time(tmp_path, monkeypatch):
    """A writer that gave no checksum leaves the block to the keeper, which hashes it outside the
    lock. The keeper runs at the lowest priority; if it cannot run, the due thread (normal
    priority) records what waited longer than KEEP_DUE_S: the wait is bounded. Here the keeper
    thread's loop never runs at all."""
    ns = make_ns()
    keys = chain(ns, 7, 6)
    shm = os.path.join("/dev/shm", f"tierd-test-{os.getpid()}-{tmp_path.name}")
    kw = dict(host_bytes=1 << 20, host_slab_bytes=256 << 10, host_shm_path=shm, host_keep=True)
    from tierd.store.keeping import HostKeeping
    real_loop = HostKeeping._keep_loop
    monkeypatch.setattr(HostKeeping, "_keep_loop", lambda self: None)   # the keeper thread ends at once
    monkeypatch.setattr(HostKeeping, "KEEP_DUE_S", 0.3)
    try:
        with TieredStore(**kw) as s:
            res = s.reserve(ns, keys)
            for buf, k in zip(res.buffers, keys):
                buf[:] = block_for(ns, k)
            t0 = time.monotonic()
            assert s.commit(res) == 6                   # no checksums: left to the keeper
            wait_for(lambda: s.keep_pending() == 0, what="overdue records")
            assert time.monotonic() - t0 < 5
            host = s.stats()["tiers"]["host"]
            assert host["records_hashed"] == 6 and host["records_due"] == 6
            assert put_chain(s, ns, chain(ns, 8, 3)) == 3      # with checksums: recorded at once
            assert s.keep_pending() == 0
        monkeypatch.setattr(HostKeeping, "_keep_loop", real_loop)
        with TieredStore(**kw) as s:
            assert s.stats()["tiers"]["host"]["adopted_blocks"] == 9
            assert_exact(s, ns, keys)
            assert_exact(s, ns, chain(ns, 8, 3))
    finally:
        for p in (shm, shm + ".rec", shm + ".rec.ns"):
            if os.path.exists(p):
                os.unlink(p)


def _records(tmp_path, n_ns: int, *, torn_tail: bool = False):
    arena = tmp_path / "a.host"
    with open(arena, "wb") as f:
        f.truncate(1 << 20)
    st = os.stat(arena)
    rec = HostRecords(str(tmp_path / "a.host.rec"), 1 << 20, (st.st_dev, st.st_ino))
    descs = {bytes([i % 256, i // 256]) * 8: {"model": f"m{i}", "pad": "x" * 300} for i in range(n_ns)}
    for ns_id, desc in descs.items():
        assert rec.note_namespace(ns_id, desc)
        assert rec.note_namespace(ns_id, dict(desc))    # known: nothing written again
    end = rec._ns_end
    rec.close(keep=True)
    if torn_tail:                                       # the last entry's bytes half written
        with open(tmp_path / "a.host.rec.ns", "r+b") as f:
            f.seek(end - 20)
            f.write(b"\xff" * 20)
    fd = os.open(arena, os.O_RDONLY)
    try:
        return descs, read_records(str(tmp_path / "a.host.rec"), fd)
    finally:
        os.close(fd)


def test_the_namespace_log_is_read_back_and_a_torn_tail_loses_only_its_entry(tmp_path):
    """Namespace descriptions are appended to a mapped log (memory writes under the store's lock),
    its room growing past the first reservation; the log reads back whole, a torn last entry is
    dropped alone, and a namespace file of the earlier format (one msgpack map) is still read."""
    import msgpack
    descs, (records, got, why) = _records(tmp_path, 1200)    # ~400 KiB: past the first room
    assert not why and records == [] and got == descs
    (tmp_path / "torn").mkdir()
    descs, (_, got, _) = _records(tmp_path / "torn", 5, torn_tail=True)
    assert got == dict(list(descs.items())[:4])
    (tmp_path / "old").mkdir()
    descs, _ = _records(tmp_path / "old", 0)
    (tmp_path / "old" / "a.host.rec.ns").write_bytes(msgpack.packb({b"n" * 16: {"model": "m"}}, use_bin_type=True))
    fd = os.open(tmp_path / "old" / "a.host", os.O_RDONLY)
    try:
        assert read_records(str(tmp_path / "old" / "a.host.rec"), fd)[1] == {b"n" * 16: {"model": "m"}}
    finally:
        os.close(fd)
