"""The disk tier lets go of its files only when no I/O call is under way: a write that hangs
while the tier is abandoned (its directory vanished) or closed never lands in a file that
reused its descriptor number (S6)."""

import os

import numpy as np
import threading
import time

from tierd import TieredStore

from .helpers import block_for, chain, make_ns, small_config


def test_a_tier_abandoned_under_a_hanging_write_keeps_its_files_open_until_the_write_ends(tmp_path):
    faults = tmp_path / "faults"
    store = TieredStore(small_config(tmp_path, disk_fault_file=str(faults), disk_stall_s=60.0))
    ns = make_ns()
    warm, late = chain(ns, 1, 2)
    store.put(ns, [warm], [block_for(ns, warm)])
    store.sync()                                 # slab header and namespace record written
    store.put(ns, [late], [block_for(ns, late)])
    disk = store.disk
    files = {fd: os.fstat(fd).st_ino for fd in disk._fds}
    faults.write_text("write=hang:30")
    outcome = {}

    def sync():
        try:
            outcome["sync"] = store.sync()
        except Exception as e:  # noqa: BLE001 -- the abandoned tier may fail it: not what is tested
            outcome["sync"] = e
    syncing = threading.Thread(target=sync, daemon=True)
    syncing.start()
    deadline = time.monotonic() + 10
    while disk.oldest_io() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    assert disk.oldest_io()[0] == "write"        # the write hangs inside its call
    abandoning = threading.Thread(target=disk.abandon, daemon=True)
    abandoning.start()
    time.sleep(0.5)
    # still under way: no descriptor was closed, so none can have been reused by another file
    assert abandoning.is_alive(), "the tier let go of its files under a write in flight"
    for fd, ino in files.items():
        assert os.fstat(fd).st_ino == ino
    faults.write_text("")                        # the write ends; then the files go
    syncing.join(10)
    abandoning.join(10)
    assert not abandoning.is_alive()
    try:
        disk.read_block(next(b.disk for b in store._blocks.values() if b.disk is not None),
                        bytearray(ns.block_bytes))
        raise AssertionError("an abandoned tier served a read")
    except OSError:
        pass                                     # refused: no new I/O on an abandoned tier
    store.close()


def test_a_disk_directory_that_comes_back_joins_the_blocks_still_in_ram(tmp_path):
    """S5: when a vanished disk directory came back with its files, b90e890 replaced the
    records of blocks still in host RAM with disk-only ones, orphaning their host slots (never
    freed again). Now the copies on disk join the records in RAM."""
    from .helpers import wait_for
    store = TieredStore(small_config(tmp_path, host_bytes="2MiB"))
    ns = make_ns()
    keys = chain(ns, 9, 6)
    try:
        store.put(ns, keys, [block_for(ns, k) for k in keys])
        store.sync()
        assert store.where(ns, keys) == ["host+disk"] * 6
        disk_dir = tmp_path / "disk"
        os.rename(disk_dir, tmp_path / "away")
        wait_for(lambda: store.where(ns, keys) == ["host"] * 6, what="the disk copies forgotten")
        os.rename(tmp_path / "away", disk_dir)          # the directory comes back, files and all
        wait_for(lambda: store.where(ns, keys) == ["host+disk"] * 6, what="the copies joined again")
        got = store.get(ns, keys)
        assert all(np.array_equal(g, block_for(ns, k)) for g, k in zip(got, keys))
        assert store.flush(tier="host") == 6
        assert store.stats()["tiers"]["host"]["used_bytes"] == 0, "host slots were orphaned"
        got = store.get(ns, keys)                      # served from the disk copies
        assert len(got) == 6 and all(np.array_equal(g, block_for(ns, k)) for g, k in zip(got, keys))
    finally:
        store.close()
