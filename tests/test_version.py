"""What runs is named (issue 52, item 1): one version (tierd/__init__.py, which the package
metadata reads), the commit where it is not a release, in `tierd --version`, the wheel
`make wheel` builds and the daemon's metrics."""

import re
import subprocess
import sys
import urllib.request
import zipfile

import tierd
from tierd.version import commit, version_string

from .daemon import ROOT, DaemonProc


def test_the_version_names_the_commit_when_not_a_release():
    r = subprocess.run([sys.executable, "-m", "tierd", "--version"], cwd=ROOT, capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0
    assert r.stdout.strip() == f"tierd {version_string()}"
    assert ".dev" in tierd.__version__      # (no release is tagged yet)
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    if head:                                 # a checkout git reads: its commit
        c = commit()
        assert c and head.startswith(c.split("-")[0]) and f"commit {c}, not a release" in r.stdout


def test_make_wheel_builds_a_versioned_wheel_that_records_its_commit(tmp_path):
    r = subprocess.run(["make", "-s", "wheel", f"DIST={tmp_path}", f"PY={sys.executable}", "STAMP="], cwd=ROOT,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    (whl,) = tmp_path.glob("tierd-*.whl")
    assert whl.name == f"tierd-{tierd.__version__}-py3-none-any.whl"
    with zipfile.ZipFile(whl) as z:
        info = z.read("tierd/_build_info.py").decode()
        meta = z.read(f"tierd-{tierd.__version__}.dist-info/METADATA").decode()
    assert re.search(r'COMMIT = "[0-9a-f]{12}', info)
    assert f"Version: {tierd.__version__}" in meta
    assert not (ROOT / "tierd" / "_build_info.py").exists()   # built for the wheel only


def test_the_daemon_exports_its_build_and_process_metrics(tmp_path):
    d = DaemonProc(tmp_path).start()
    try:
        text = urllib.request.urlopen(f"http://127.0.0.1:{d.metrics_port}/metrics", timeout=10).read().decode()
    finally:
        assert d.stop() == 0
    m = re.search(r'^tierd_build_info\{commit="([^"]*)",version="([^"]+)"\} 1\.0$', text, re.M)
    assert m and m.group(2) == tierd.__version__ and m.group(1) == (commit() or "")
    for name in ("process_resident_memory_bytes", "process_cpu_seconds_total", "process_open_fds"):
        assert re.search(rf"^{name} \d", text, re.M), name
