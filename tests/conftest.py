import pytest

from tierd import TieredStore

from .helpers import make_ns, small_config


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
