"""Security settings a deployment relies on: files other users cannot read, and unsafe paths
refused with a clear message. (Peer credentials: tests/test_daemon.py::
test_peer_with_another_uid_is_refused; world-writable socket directory:
tests/test_serve_config.py::test_world_writable_socket_directory_is_refused.)"""

import os
import stat
import subprocess
import sys

import pytest

import tierd
from tierd import TieredStore
from tierd.errors import DiskTierError

from .daemon import ROOT
from .helpers import block_for, chain, make_ns, small_config


def test_arena_and_slab_files_are_not_readable_by_other_users(daemon):
    ns = make_ns()
    with tierd.connect(daemon.url) as c:
        keys = chain(ns, 1, 2)
        c.put(ns, keys, [block_for(ns, k) for k in keys])
        c.sync()
    arena = [p for p in (daemon.dir / "arena").iterdir()]
    slabs = list((daemon.dir / "disk").iterdir())
    assert arena and slabs
    for p in arena + slabs:
        mode = stat.S_IMODE(os.stat(p).st_mode)
        assert mode & 0o007 == 0, f"{p} is mode {oct(mode)}: other users can reach it"
    assert stat.S_IMODE(os.stat(daemon.socket).st_mode) & 0o007 == 0


def test_a_disk_path_that_is_a_symlink_is_refused(tmp_path):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    link = tmp_path / "disk"
    link.symlink_to(elsewhere)
    with pytest.raises(DiskTierError, match="symbolic link"):
        TieredStore(small_config(None, disk_path=str(link)))
    assert not any(elsewhere.iterdir())                     # nothing written through it
    r = subprocess.run([sys.executable, "-m", "tierd", "serve", "--socket", str(tmp_path / "s.sock"),
                        "--disk-path", str(link), "--host-bytes", "4MiB", "--metrics-addr", ""],
                       cwd=ROOT, capture_output=True, text=True, timeout=60,
                       env={**os.environ, "TIERD_ARENA_DIR": str(tmp_path)})
    assert r.returncode != 0 and "symbolic link" in r.stderr
    assert not any(elsewhere.iterdir())
