"""Resizing the disk tier (`disk.bytes`) across a restart (docs/on-disk-format.md, "Resizing").

A larger disk.bytes adds slab files after the ones already there and keeps every block on disk,
served exact, whether the index comes from the checkpoint written with the old files or from a
scan; the new room takes new blocks. A smaller one drops the last files, whole, with their blocks,
and keeps the others; what is dropped is a miss, never a wrong byte."""

from __future__ import annotations

import os
from pathlib import Path

import msgpack
import pytest

import tierd
from tierd import TieredStore
from tierd.tiers.disk import CHECKPOINT_NAME
from tierd.tiers.slot_header import _CSUM, _csum

from .daemon import DaemonProc
from .helpers import assert_exact, block_for, chain, make_ns, put_chain, small_config

MiB = 1 << 20


# The geometries a directory can have (slab_bytes, file_bytes): whole files of 2 slabs; a last
# file shorter than the others (4 slabs in files of 3); and one slab as large as the tier, as the
# daemon's defaults make it for any disk.bytes under disk.slab_bytes (256 MiB): the review's
# 64 -> 128 MiB, refused before ("slab-0000.tds was created with 1 slabs of 64.0MiB").
GEOMETRIES = {"whole-files": ("1MiB", "2MiB"), "short-last-file": ("1MiB", "3MiB"), "one-slab": ("16MiB", "16MiB")}


def cfg(tmp_path: Path, disk_bytes: str, geometry: str = "whole-files"):
    # a host tier that holds every block of the test: a sync writes them all down
    slab, file = GEOMETRIES[geometry]
    return small_config(tmp_path, host_bytes="16MiB", host_slab_bytes="1MiB", disk_bytes=disk_bytes,
                        disk_slab_bytes=slab, disk_file_bytes=file)


def keys_of(ns, seeds) -> list[bytes]:
    return [k for s in seeds for k in chain(ns, s, 5)]


def slab_files(d: Path) -> list[Path]:
    return sorted(d.glob("slab-*.tds"))


def disk_stats(s) -> dict:
    return s.stats()["tiers"]["disk"]


def served(s, ns, keys) -> dict[bytes, bool]:
    """key -> served (exact: a wrong byte fails the test); a miss is False."""
    out = {}
    for k in keys:
        got = s.get(ns, [k])
        if got:
            assert bytes(got[0]) == bytes(block_for(ns, k)), f"block {k.hex()} served with wrong bytes"
        out[k] = bool(got)
    return out


def written(tmp_path, ns, keys, disk_bytes: str, geometry: str = "whole-files") -> int:
    """Put `keys`, sync them all to disk, close (a checkpoint); the disk tier's capacity."""
    with TieredStore(cfg(tmp_path, disk_bytes, geometry)) as s:
        put_chain(s, ns, keys)
        assert s.sync() == len(keys)
        assert disk_stats(s)["blocks"] == len(keys)
        return disk_stats(s)["capacity_bytes"]


def drop_geometry_from_checkpoint(d: Path) -> None:
    """Rewrite index.ckpt as a release before resizing wrote it (no "files")."""
    raw = (d / CHECKPOINT_NAME).read_bytes()
    body = msgpack.unpackb(raw[:-8], raw=False)
    assert body.pop("files") is not None
    new = msgpack.packb(body, use_bin_type=True)
    (d / CHECKPOINT_NAME).write_bytes(new + _CSUM.pack(_csum(new)))


@pytest.mark.parametrize("geometry", list(GEOMETRIES))
@pytest.mark.parametrize("index", ["checkpoint", "older checkpoint", "scan"])
def test_twice_the_disk_bytes_keeps_every_block_and_fills_the_new_room(tmp_path, index, geometry):
    ns = make_ns()
    d = tmp_path / "disk"
    old = keys_of(ns, range(30))          # 150 blocks of 16 KiB: most of 4 MiB
    old_room = written(tmp_path, ns, old, "4MiB", geometry)
    files_before = {f.name: f.read_bytes()[:4096] for f in slab_files(d)}
    if index == "scan":
        (d / CHECKPOINT_NAME).unlink()     # as after a crash: the index comes from the headers
    elif index == "older checkpoint":
        drop_geometry_from_checkpoint(d)

    with TieredStore(cfg(tmp_path, "8MiB", geometry)) as s:
        st = disk_stats(s)
        assert st["recovered_from"] == ("scan" if index == "scan" else "checkpoint"), st
        assert st["capacity_bytes"] == 8 * MiB > old_room
        assert st["blocks"] == len(old) and st["corrupt_dropped"] == 0, st
        # the files already there are untouched (superblocks as written); new ones follow them
        names = [f.name for f in slab_files(d)]
        assert names[:len(files_before)] == sorted(files_before) and len(names) > len(files_before), names
        assert all((d / n).read_bytes()[:4096] == sb for n, sb in files_before.items())
        assert sum(f.stat().st_size for f in slab_files(d)) <= 8 * MiB
        assert_exact(s, ns, old)
        # the new room takes new blocks: together more than the old size could hold
        new = keys_of(ns, range(100, 160))   # 300 more: 450 blocks of 20 KiB slots, 9 MiB
        new = new[:int(0.95 * 8 * MiB) // (20 << 10) - len(old) - 10]
        put_chain(s, ns, new)
        assert s.sync() >= len(new)
        assert disk_stats(s)["blocks"] == len(old) + len(new)
        assert (len(old) + len(new)) * (20 << 10) > old_room
        assert_exact(s, ns, old + new)
    # and all of it comes back, from the checkpoint and from a scan, with the grown geometry
    for how in ("checkpoint", "scan"):
        if how == "scan":
            (d / CHECKPOINT_NAME).unlink()
        with TieredStore(cfg(tmp_path, "8MiB", geometry)) as s:
            st = disk_stats(s)
            assert (st["recovered_from"], st["blocks"]) == (how, len(old) + len(new)), st
            assert_exact(s, ns, old + new)


def test_a_smaller_disk_bytes_drops_the_last_files_only(tmp_path, caplog):
    ns = make_ns()
    d = tmp_path / "disk"
    keys = keys_of(ns, range(75))        # 375 blocks: slabs 0 to 7, in all four files
    written(tmp_path, ns, keys, "8MiB")
    before = [f.name for f in slab_files(d)]
    assert len(before) == 4
    with caplog.at_level("WARNING", logger="tierd.disk"), TieredStore(cfg(tmp_path, "5MiB")) as s:
        st = disk_stats(s)
        assert st["recovered_from"] == "scan", st   # the checkpoint named the dropped files' slabs
        assert sum(f.stat().st_size for f in slab_files(d)) <= 5 * MiB
        assert [f.name for f in slab_files(d)] == before[:3]
        got = served(s, ns, keys)
        kept = [k for k in keys if got[k]]
        assert 0 < len(kept) < len(keys) and st["blocks"] == len(kept)
        assert disk_stats(s)["corrupt_dropped"] == 0
    assert any("removed 2 slab files" in r.getMessage() and "disk.bytes 5MiB" in r.getMessage()
               for r in caplog.records), [r.getMessage() for r in caplog.records]
    # what was kept stays through the next restart
    with TieredStore(cfg(tmp_path, "5MiB")) as s:
        assert disk_stats(s)["blocks"] == len(kept)
        assert_exact(s, ns, kept)


@pytest.mark.parametrize("gone", ["slab-0001.tds", "slab-0003.tds"])
def test_a_missing_slab_file_costs_its_blocks_and_those_after_it_only(tmp_path, gone):
    """A file deleted by hand: the files after the gap go (they are this store's own), the
    missing ones are made anew, and the index is never taken from the checkpoint that named them."""
    ns = make_ns()
    d = tmp_path / "disk"
    keys = keys_of(ns, range(75))        # 375 blocks: slabs 0 to 7, in all four files
    written(tmp_path, ns, keys, "8MiB")
    (d / gone).unlink()
    with TieredStore(cfg(tmp_path, "8MiB")) as s:
        st = disk_stats(s)
        assert st["recovered_from"] == "scan", st
        assert len(slab_files(d)) == 4
        got = served(s, ns, keys)
        assert 0 < sum(got.values()) < len(keys) and st["corrupt_dropped"] == 0, st


def test_a_foreign_file_after_a_gap_is_refused_not_removed(tmp_path):
    ns = make_ns()
    d = tmp_path / "disk"
    written(tmp_path, ns, keys_of(ns, range(4)), "8MiB")
    other = tmp_path / "other"
    written(other, ns, keys_of(ns, range(4)), "8MiB")
    (d / "slab-0003.tds").unlink()
    (d / "slab-0002.tds").unlink()
    os.rename(other / "disk" / "slab-0003.tds", d / "slab-0003.tds")
    with pytest.raises(tierd.errors.NotASlabFileError, match="another tierd store"):
        TieredStore(cfg(tmp_path, "8MiB"))
    assert (d / "slab-0003.tds").exists()


def test_growing_beyond_the_free_space_refuses_with_the_most_that_fits(tmp_path, monkeypatch):
    ns = make_ns()
    d = tmp_path / "disk"
    keys = keys_of(ns, range(10))
    written(tmp_path, ns, keys, "4MiB")
    real = os.statvfs

    class Full:
        def __init__(self, st):
            self.f_frsize, self.f_blocks, self.f_bavail = st.f_frsize, st.f_blocks, (1 * MiB) // st.f_frsize

    monkeypatch.setattr(os, "statvfs", lambda p: Full(real(p)) if str(p).startswith(str(d)) else real(p))
    with pytest.raises(tierd.errors.DiskTierError) as e:
        TieredStore(cfg(tmp_path, "64MiB"))
    msg = str(e.value)
    assert "cannot reserve" in msg and "to grow the tier to 64MiB" in msg and "lower disk.bytes" in msg, msg
    assert "to at most 5.0MiB" in msg, msg   # the 4 MiB there plus the 1 MiB free
    monkeypatch.undo()
    assert len(slab_files(d)) == 2           # nothing made, nothing lost
    with TieredStore(cfg(tmp_path, "4MiB")) as s:
        assert_exact(s, ns, keys)


# the daemon's own disk geometry (slab_bytes 256 MiB, file_bytes 4 GiB): one slab of all of a
# 64 MiB tier
DEFAULT_DISK_TOML = """
[host]
slab_bytes = "1MiB"
"""


def test_a_daemon_restarted_with_twice_the_disk_bytes_serves_every_block(tmp_path):
    """The review's case (W14): disk.bytes 64 -> 128 MiB with the default slab and file sizes."""
    ns = make_ns()
    keys = keys_of(ns, range(40))       # 200 blocks, 4 MiB
    d = DaemonProc(tmp_path, host_bytes="8MiB", disk_bytes="64MiB", toml=DEFAULT_DISK_TOML).start()
    try:
        c = tierd.connect(d.url)
        put_chain(c, ns, keys)
        assert c.sync() == len(keys)
        c.close()
    finally:
        assert d.stop() == 0
    for f in Path(d.env["TIERD_ARENA_DIR"]).iterdir():   # a reboot: only the disk tier is left
        f.unlink()
    files = slab_files(Path(d.disk))
    d = DaemonProc(tmp_path, host_bytes="8MiB", disk_bytes="128MiB", toml=DEFAULT_DISK_TOML).start()
    try:
        c = tierd.connect(d.url)
        st = c.stats()["tiers"]["disk"]
        assert st["capacity_bytes"] == 128 * MiB and st["blocks"] == len(keys), st
        assert set(c.where(ns, keys)) == {"disk"}
        assert_exact(c, ns, keys)
        assert slab_files(Path(d.disk))[:len(files)] == files and len(slab_files(Path(d.disk))) > len(files)
        c.close()
    finally:
        assert d.stop() == 0
