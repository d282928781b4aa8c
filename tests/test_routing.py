"""`tierd.routing`: the prefix index follows KV events, the router prefers the node that holds a
request's prefix in the faster tier, and load and the shared remote tier are weighed right."""

from __future__ import annotations

from pytest import approx

from tierd import events
from tierd.routing import PrefixIndex, Router

from .helpers import chain, make_ns


def frames(events_list, topic="ns", seq=0):
    return [topic.encode(), seq.to_bytes(8, "big"), events.encode_batch(0.0, events_list)]


def test_the_router_follows_the_events():
    ns = make_ns()
    keys = chain(ns, 1, 6)
    idx = PrefixIndex()
    idx.apply_frames("a", frames([events.block_stored([k], None, 16, "host") for k in keys[:4]]))
    idx.apply_frames("b", frames([events.block_stored([k], None, 16, "disk") for k in keys]))
    r = Router(idx, load_penalty=1.0)
    assert r.score("a", keys) == approx(4 * r.weights["CPU"])
    assert r.score("b", keys) == approx(6 * r.weights["DISK"])
    assert r.route(keys, ["a", "b"]) == "b"                    # 6 disk blocks beat 4 host blocks
    assert r.route(keys[:4], ["a", "b"]) == "a"                # same length: the faster tier wins
    assert r.route(keys, ["a", "b"], {"b": 3}) == "a"          # ... unless the node is busy
    idx.apply_frames("b", frames([events.block_removed([keys[2]], "disk")]))
    assert r.score("b", keys) == approx(2 * r.weights["DISK"])  # a hole ends the prefix
    idx.apply_frames("a", frames([events.all_cleared()]))
    assert r.score("a", keys) == 0
    # the shared remote tier counts for every node: it never decides between them
    idx.apply_frames("a", frames([events.block_stored(keys, None, 16, "remote")]))
    assert r.score("a", keys) == r.score("c", keys) == approx(6 * r.weights["REMOTE"])
    assert r.route(keys, ["a", "c"], {"a": 1}) == "c"
