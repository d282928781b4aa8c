"""Property-based fuzzing of the protocol: the frame decoder on random and mutated bytes, and a
real daemon on random and mutated requests for every op (over 10,000 cases in all). The daemon
must answer each with a reply or a closed connection, stay up, leak nothing, and keep serving a
well-behaved client exactly."""

from __future__ import annotations

import math

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tierd import protocol as P
from tierd.client import Client

from .helpers import block_for, chain, make_ns
from .test_daemon import raw_conn, read_reply, send

FUZZ_SETTINGS = dict(deadline=None, derandomize=True, database=None,
                     suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                            HealthCheck.function_scoped_fixture])

NS = make_ns()
VALID = [
    {"id": 1, "op": "lookup", "ns": NS.name, "keys": chain(NS, 1, 3)},
    {"id": 2, "op": "reserve", "ns": NS.name, "keys": chain(NS, 2, 2), "parent": None},
    {"id": 3, "op": "acquire", "ns": NS.name, "keys": chain(NS, 1, 2)},
    {"id": 4, "op": "release", "lease": 1},
    {"id": 5, "op": "commit", "res": 1},
    {"id": 6, "op": "where", "ns": NS.name, "keys": chain(NS, 1, 1)},
    {"id": 7, "op": "hello", "version": 1, "namespaces": [NS.to_dict()]},
    {"id": 8, "op": "sync", "max_blocks": 4},
    {"id": 9, "op": "stats"},
]


def mutate(data: bytes, edits: list[tuple[int, int, int]]) -> bytes:
    b = bytearray(data)
    for kind, pos, val in edits:
        if not b:
            break
        i = pos % len(b)
        if kind == 0:
            b[i] = val
        elif kind == 1:
            b.insert(i, val)
        else:
            del b[i]
    return bytes(b)


edits = st.lists(st.tuples(st.integers(0, 2), st.integers(0, 1 << 16), st.integers(0, 255)), min_size=1, max_size=6)


# -- the decoder alone -----------------------------------------------------------------------------
@settings(max_examples=3000, **FUZZ_SETTINGS)
@given(st.binary(max_size=4096))
def test_decoder_on_random_bytes_returns_a_map_or_a_protocol_error(body):
    try:
        assert isinstance(P.decode_body(body), dict)
    except P.ProtocolError:
        pass


@settings(max_examples=3000, **FUZZ_SETTINGS)
@given(st.sampled_from(VALID), edits)
def test_decoder_on_mutated_frames_returns_a_map_or_a_protocol_error(msg, e):
    try:
        assert isinstance(P.decode_body(mutate(msgpack.packb(msg, use_bin_type=True), e)), dict)
    except P.ProtocolError:
        pass


@settings(max_examples=500, **FUZZ_SETTINGS)
@given(st.binary(min_size=4, max_size=4), st.integers(0, 1 << 31))
def test_frame_length_checks_every_header(header, limit):
    try:
        assert 0 <= P.frame_length(header, limit) <= limit
    except P.FrameTooLarge:
        pass


# -- a real daemon -------------------------------------------------------------------------------
scalars = st.one_of(st.none(), st.booleans(), st.integers(-(1 << 63), (1 << 64) - 1), st.floats(allow_nan=True),
                    st.text(max_size=40), st.binary(max_size=40))
values = st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=6),
                                                       st.dictionaries(st.text(max_size=8), inner, max_size=4)),
                      max_leaves=12)
key_lists = st.lists(st.one_of(st.binary(min_size=16, max_size=16), st.binary(max_size=20)), max_size=8)
# every op but flush (a client allowed to connect may drop blocks: that is not a fault)
fuzz_ops = st.sampled_from([op for op in P.OPS if op != "flush"] + ["", "FLUSH", "launch", "hello\x00"])
requests = st.fixed_dictionaries(
    {"id": st.one_of(st.integers(-5, 1 << 40), values), "op": st.one_of(fuzz_ops, values)},
    optional={"ns": st.one_of(st.just(NS.name), values), "keys": st.one_of(key_lists, values),
              "parent": st.one_of(st.none(), st.binary(min_size=16, max_size=16), values),
              "lease": st.one_of(st.integers(-1, (1 << 64) - 1), values), "res": st.one_of(st.integers(-1, (1 << 64) - 1), values),
              "version": st.one_of(st.integers(0, 3), values), "max_blocks": st.one_of(st.integers(-3, 1 << 40), values),
              "namespaces": st.one_of(st.just([NS.to_dict()]), st.lists(values, max_size=3)),
              "tier": values, "namespace": values})


class Conn:
    """A raw connection that says hello and reconnects when the daemon cuts it off."""

    def __init__(self, path):
        self.path = path
        self.s = None
        self.closed_by_daemon = 0

    def request(self, body: bytes):
        if self.s is None:
            self.s = raw_conn(self.path)
            send(self.s, {"id": 0, "op": "hello", "version": 1, "namespaces": [NS.to_dict()]})
            assert read_reply(self.s)["ok"]
        send(self.s, raw=body)
        try:
            r = read_reply(self.s)
        except ConnectionResetError:
            r = None
        if r is None:
            self.closed_by_daemon += 1
            self.s.close()
            self.s = None
        return r


def check_reply(r):
    if r is None:
        return
    assert isinstance(r, dict) and "id" in r
    if "error" in r:
        assert isinstance(r["error"]["code"], str) and isinstance(r["error"]["message"], str)
    else:
        assert r.get("ok") is True


@pytest.fixture(scope="module")
def fuzz_daemon(tmp_path_factory):
    from .daemon import DaemonProc
    d = DaemonProc(tmp_path_factory.mktemp("fuzz")).start()
    good = Client(d.socket)
    keys = chain(NS, 1, 4)
    good.put(NS, keys, [block_for(NS, k) for k in keys])
    yield d, good, keys
    good.close()
    assert d.stop() == 0


def _after(d, good, keys, conn):
    blocks = good.get(NS, keys)
    assert [b.tobytes() for b in blocks] == [block_for(NS, k).tobytes() for k in keys]
    assert d.alive()


@settings(max_examples=3500, **FUZZ_SETTINGS)
@given(requests)
def test_daemon_on_random_requests(fuzz_daemon, msg):
    d, good, keys = fuzz_daemon
    conn = _conn(d)
    check_reply(conn.request(msgpack.packb(msg, use_bin_type=True)))


@settings(max_examples=2000, **FUZZ_SETTINGS)
@given(st.sampled_from(VALID), edits)
def test_daemon_on_mutated_requests(fuzz_daemon, msg, e):
    d, good, keys = fuzz_daemon
    conn = _conn(d)
    check_reply(conn.request(mutate(msgpack.packb(msg, use_bin_type=True), e)))


_conns: dict[str, Conn] = {}


def _conn(d) -> Conn:
    c = _conns.get(d.socket)
    if c is None:
        c = _conns[d.socket] = Conn(d.socket)
    return c


def test_after_the_fuzzing_the_daemon_is_whole(fuzz_daemon):
    """Runs after the two daemon fuzz tests (file order): the good client is served exactly,
    and once the fuzzing connection is gone nothing it took is left behind."""
    d, good, keys = fuzz_daemon
    conn = _conns.pop(d.socket, None)
    if conn is None:   # (`-k`, or pytest-xdist sent the fuzz tests to another process)
        pytest.skip("the daemon fuzz tests did not run against this daemon in this process")
    if conn.s is not None:
        conn.s.close()
    _after(d, good, keys, conn)
    import time
    deadline = time.monotonic() + 5
    while True:
        st_ = good.stats()
        if (st_["leases"], st_["reservations"]) == (0, 0) or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert (st_["leases"], st_["reservations"]) == (0, 0)
    assert st_["daemon"]["bad_requests"] > 100


def test_absurd_namespaces_are_refused_and_nothing_breaks(fuzz_daemon):
    d, good, keys = fuzz_daemon
    s = raw_conn(d.socket)
    absurd = [dict(NS.to_dict(), num_layers=10 ** 12), dict(NS.to_dict(), head_dim=-3),
              dict(NS.to_dict(), num_layers=4096, num_kv_heads=4096, head_dim=4096),   # 2 TiB blocks
              dict(NS.to_dict(), num_layers=64, num_kv_heads=64, head_dim=1024, block_tokens=4096),
              dict(NS.to_dict(), kv_dtype="float128"), dict(NS.to_dict(), block_tokens=math.inf)]
    for i, ns in enumerate(absurd):
        send(s, {"id": i, "op": "hello", "version": 1, "namespaces": [ns]})
        r = read_reply(s)
        assert r is not None and r["error"]["code"] in ("bad_namespace", "capacity", "bad_request"), r
    s.close()
    _after(d, good, keys, None)
