import os
import tempfile

import pytest

from tierd import TieredStore

from .helpers import make_ns, small_config


# Weight digests the tests compute are remembered in a file of this run, not the user's cache.
os.environ.setdefault("TIERD_DIGEST_CACHE", os.path.join(tempfile.mkdtemp(prefix="tierd-digests-"),
                                                         "digests.json"))


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
