"""The daemon's table of namespaces stays bounded without hurting anyone: unused namespaces
are forgotten (and registered again by their next user), the limit counts per uid, a refused
namespace is a miss for that request only, and a client with any number of namespaces
reconnects after a daemon restart."""

import numpy as np
import pytest

from tierd.client import Client
from tierd.errors import NamespaceLimitError

from .daemon import SMALL_TOML, DaemonProc
from .helpers import block_for, chain, make_ns, wait_for


def salted(i):
    return make_ns(cache_salt=f"tenant-{i}")


def test_a_client_with_more_than_64_namespaces_reconnects_after_a_restart(daemon):
    """On b90e890 its hello was refused ("at most 64 namespaces per request") and the socket
    stayed half-open: no call worked again."""
    spaces = [salted(i) for i in range(100)]
    c = Client(daemon.socket)
    for i, ns in enumerate(spaces):
        keys = chain(ns, i, 1)
        c.put(ns, keys, [block_for(ns, keys[0])])
    c.sync()
    daemon.kill()
    daemon.start()
    for i, ns in enumerate(spaces):
        keys = chain(ns, i, 1)
        got = c.get(ns, keys)
        assert len(got) == 1 and np.array_equal(got[0], block_for(ns, keys[0]))
    assert c.reconnects == 1
    c.close()


@pytest.fixture
def small_table(tmp_path):
    d = DaemonProc(tmp_path, toml=SMALL_TOML + "[limits]\nmax_namespaces_per_uid = 8\n").start()
    yield d
    if d.alive():
        assert d.stop() == 0


def test_unused_namespaces_are_forgotten_and_come_back_when_used(small_table):
    c = Client(small_table.socket)
    used = [salted(i) for i in range(4)]
    for i, ns in enumerate(used):
        keys = chain(ns, i, 2)
        c.put(ns, keys, [block_for(ns, k) for k in keys])
    for i in range(4, 200):          # lookups only: namespaces with no block
        ns = salted(i)
        assert c.lookup(ns, chain(ns, i, 2)) == 0
    assert len(c.stats()["namespaces"]) <= 8
    for i, ns in enumerate(used):    # the ones with blocks were kept, served exactly
        keys = chain(ns, i, 2)
        assert [np.array_equal(g, block_for(ns, k)) for g, k in zip(c.get(ns, keys), keys)] == [True] * 2
    ns = salted(5)                   # forgotten earlier, used again: registered again by itself
    keys = chain(ns, 5, 2)
    assert c.put(ns, keys, [block_for(ns, k) for k in keys]) == 2
    assert c.lookup(ns, keys) == 2
    c.close()


def test_a_full_table_refuses_new_namespaces_of_that_uid_only_as_a_miss(small_table):
    c = Client(small_table.socket)
    full = [salted(i) for i in range(8)]
    with Client(small_table.socket) as writer:
        for i, ns in enumerate(full):
            keys = chain(ns, i, 1)
            writer.put(ns, keys, [block_for(ns, keys[0])])
        extra = salted(99)
        with pytest.raises(NamespaceLimitError, match="limit"):
            c.lookup(extra, chain(extra, 99, 1))
        keys = chain(full[0], 0, 1)
        assert c.lookup(full[0], keys) == 1      # every known namespace is served as before
        c.flush(tier="all", namespace=full[1])   # an operator frees one, but the writer still
        with pytest.raises(NamespaceLimitError):  # holds slots staged for it: still in use
            c.lookup(extra, chain(extra, 99, 1))
    # the writer is gone with its staged slots: the flushed namespace is unused, the new one fits
    wait_for(lambda: c.stats()["staged_slots"] == 0, what="the writer's staged slots to go")
    assert c.lookup(extra, chain(extra, 99, 1)) == 0
    c.close()


def test_a_refused_namespace_is_a_miss_for_that_request_not_a_failed_link(small_table):
    from tierd.connectors.link import StoreLink
    link = StoreLink(small_table.url)
    store = link.get()
    full = [salted(i) for i in range(8)]
    for i, ns in enumerate(full):
        keys = chain(ns, i, 1)
        store.put(ns, keys, [block_for(ns, keys[0])])
    extra = salted(99)
    try:
        store.lookup(extra, chain(extra, 99, 1))
    except NamespaceLimitError as e:
        link.failed(e, "lookup")
    assert link.stats["refused"] == 1 and link.stats["unavailable"] == 0
    assert link.get() is store and not link.backing_off   # known salts keep their hits
    assert store.lookup(full[0], chain(full[0], 0, 1)) == 1
    link.close()
