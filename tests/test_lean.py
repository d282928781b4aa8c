"""`pip install tierd` gives a working daemon, client and CLI without torch: here torch is made
unimportable in the daemon's and the CLI's processes, and a real client stores, loads and
checks blocks through that daemon."""

from __future__ import annotations

import subprocess
import sys

import tierd

from .daemon import ROOT, DaemonProc
from .helpers import block_for, chain, make_ns

# Run `tierd` with every import of torch (and of the bundled engine, which needs it) refused.
NO_TORCH = (
    "import sys\n"
    "class _NoTorch:\n"
    "    def find_spec(self, name, path=None, target=None):\n"
    "        if name == 'torch' or name.startswith('torch.'):\n"
    "            raise ImportError('torch is not installed (refused by the test)')\n"
    "        return None\n"
    "sys.meta_path.insert(0, _NoTorch())\n"
    "from tierd.cli import main\n"
    "sys.exit(main(sys.argv[1:]))\n"
)


def test_the_daemon_and_the_cli_run_without_torch(tmp_path):
    d = DaemonProc(tmp_path, launcher=("-c", NO_TORCH)).start()
    ns = make_ns()
    try:
        with tierd.connect(d.url) as c:
            keys = chain(ns, 1, 6)
            assert c.put(ns, keys, [block_for(ns, k) for k in keys]) == 6
            assert c.sync() == 6                                  # the disk tier works too
            c.flush("host")
            got = c.get(ns, keys)                                 # promoted from disk
            assert [g.tobytes() for g in got] == [block_for(ns, k).tobytes() for k in keys]
        for args in (["stats", "--socket", d.socket], ["ping", "--socket", d.socket],
                     ["sync", "--socket", d.socket]):
            r = subprocess.run([sys.executable, "-c", NO_TORCH, *args], cwd=ROOT, capture_output=True,
                               text=True, timeout=60)
            assert r.returncode == 0, (args, r.stderr)
    finally:
        assert d.stop() == 0
    assert "torch" not in d.log.read_text()
