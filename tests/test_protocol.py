"""Frame encoding and request validation (in process; tests/test_daemon.py covers the wire)."""

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tierd import protocol as P


def test_encode_decode_round_trip():
    msg = {"id": 7, "op": "lookup", "ns": "abc", "keys": [b"k" * 16]}
    frame = P.encode(msg)
    n = P.frame_length(frame[:4], P.DEFAULT_MAX_FRAME_BYTES)
    assert n == len(frame) - 4 and P.decode_body(frame[4:]) == msg


def test_oversized_frame_is_refused_before_reading_it():
    with pytest.raises(P.FrameTooLarge):
        P.frame_length(P.HEADER.pack(0xFFFFFFFF), P.DEFAULT_MAX_FRAME_BYTES)


@settings(max_examples=2000, deadline=None)
@given(st.binary(max_size=256))
def test_any_bytes_decode_to_a_map_or_a_protocol_error(data):
    try:
        msg = P.decode_body(data)
    except P.ProtocolError:
        return
    assert isinstance(msg, dict)


@settings(max_examples=500, deadline=None)
@given(st.dictionaries(st.text(max_size=8), st.one_of(st.integers(), st.binary(max_size=20), st.text(max_size=5),
                                                     st.lists(st.binary(max_size=17), max_size=5), st.none())))
def test_field_validation_raises_only_protocol_errors(msg):
    for check in (lambda: P.keys_field(msg, 4), lambda: P.field(msg, "ns", str),
                  lambda: P.field(msg, "res", int)):
        try:
            check()
        except P.ProtocolError:
            pass


def test_keys_field_limits():
    with pytest.raises(P.ProtocolError, match="limit"):
        P.keys_field({"keys": [b"k" * 16] * 5}, max_keys=4)
    with pytest.raises(P.ProtocolError, match="16 bytes"):
        P.keys_field({"keys": [b"k" * 15]}, max_keys=4)
    assert P.keys_field({"keys": [b"k" * 16]}, max_keys=4) == [b"k" * 16]
    assert msgpack.unpackb(P.encode({"a": 1})[4:]) == {"a": 1}
