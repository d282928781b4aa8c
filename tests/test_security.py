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


@pytest.mark.parametrize("operator", [False, True], ids=["engine", "operator"])
def test_flush_is_an_operator_action(operator):
    """S9: on b90e890 every allowed peer could flush every tier, the fleet's shared one too.
    Now an engine's uid gets data operations only; the daemon's uid, root and operator_uids /
    operator_gids may flush."""
    import shutil
    import subprocess
    import sys
    import tempfile
    from pathlib import Path
    from tierd.client import Client
    from .daemon import DaemonProc
    from .helpers import block_for, chain, make_ns
    if os.geteuid() != 0:
        pytest.skip("needs root to run a client under another uid")
    base = Path(tempfile.mkdtemp(prefix="tierd-op-"))   # reachable by uid 65534
    base.chmod(0o755)
    (base / "run").mkdir(mode=0o755)
    toml = 'socket_mode = "0666"\nallowed_uids = [65534]\n' + ("operator_uids = [65534]\n" if operator else "")
    d = DaemonProc(base, toml=toml).start()
    ns = make_ns()
    keys = chain(ns, 1, 2)
    try:
        with Client(d.socket) as c:
            c.put(ns, keys, [block_for(ns, k) for k in keys])
        code = ("import os, socket, struct, msgpack\n"
                "os.setgid(65534); os.setuid(65534)\n"
                f"s = socket.socket(socket.AF_UNIX); s.connect({d.socket!r})\n"
                "def ask(m):\n"
                "    b = msgpack.packb(m, use_bin_type=True); s.sendall(struct.pack('>I', len(b)) + b)\n"
                "    n = struct.unpack('>I', s.recv(4))[0]; r = b''\n"
                "    while len(r) < n: r += s.recv(n - len(r))\n"
                "    r = msgpack.unpackb(r); return r.get('error', {}).get('code', 'ok')\n"
                f"print(ask({{'id': 1, 'op': 'hello', 'version': 1, 'namespaces': [{ns.to_dict()!r}]}}))\n"
                f"print(ask({{'id': 2, 'op': 'lookup', 'ns': {ns.name!r}, 'keys': {keys!r}}}))\n"
                "print(ask({'id': 3, 'op': 'flush', 'tier': 'all'}))\n")
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30)
        assert r.stdout.split() == ["ok", "ok", "ok" if operator else "forbidden"], r.stderr
        with Client(d.socket) as c:
            assert c.lookup(ns, keys) == (0 if operator else 2)
    finally:
        assert d.stop() == 0
        shutil.rmtree(base, ignore_errors=True)
