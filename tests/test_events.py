"""KV events: a real daemon publishes what each tier holds in vLLM's KV-events wire format; a
subscriber decodes the stream with vLLM's own event classes (in the vLLM environment) and sees
put, demotion, flushes and a restart as they happened."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import time

import msgpack
import pytest

import tierd

from .daemon import SMALL_TOML, DaemonProc
from .helpers import block_for, chain, make_ns, wait_for
from tierd.client import Client
from .test_vllm_connector import VLLM_ENVS, vllm_python

zmq = pytest.importorskip("zmq")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Subscriber:
    def __init__(self, addr: str):
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.SUB)
        self.sock.setsockopt(zmq.SUBSCRIBE, b"")
        self.sock.connect(addr)
        self.frames: list[list[bytes]] = []

    def drain(self, settle_s: float = 0.3) -> list[list[bytes]]:
        """Every message until none came for `settle_s`."""
        got = []
        while self.sock.poll(int(settle_s * 1000)):
            got.append(self.sock.recv_multipart())
        self.frames += got
        return got

    def close(self):
        self.sock.close()
        self.ctx.term()


def events_of(frames, raw: bool = False) -> list[tuple[str, str, tuple]]:
    """(topic, type, (tier, keys)) per event, decoded with msgpack (tierd's own view); the tier
    as GPU, CPU, DISK or REMOTE (`raw`: the event's medium and locality)."""
    from tierd.routing import tier_name
    out = []
    for topic, seq, payload in frames:
        ts, events = msgpack.unpackb(payload, raw=False)[:2]
        for e in events:
            tier = (e.get("medium"), e.get("locality")) if raw else tier_name(e.get("medium"), e.get("locality"))
            if e["type"] == "AllBlocksCleared":
                tier = (None, None) if raw else None
            out.append((topic.decode(), e["type"], (tier, tuple(e.get("block_hashes", ())))))
    return out


def test_events_follow_put_demotion_flush_and_restart(tmp_path):
    addr = f"tcp://127.0.0.1:{free_port()}"
    toml_extra = f'events_addr = "{addr}"\nevents_token_ids = true\n'
    d = DaemonProc(tmp_path, toml=toml_extra + SMALL_TOML).start()
    sub = Subscriber(addr)
    ns = make_ns()
    keys = chain(ns, 1, 4)
    try:
        time.sleep(0.5)                                     # the subscription reaches the daemon
        with tierd.connect(d.url) as c:
            c.put(ns, keys, [block_for(ns, k) for k in keys])
            got = events_of(sub.drain())
            assert [(t, m) for _, t, (m, _) in got] == [("BlockStored", "CPU")] * 4
            assert {k for _, _, (_, ks) in got for k in ks} == set(keys)
            assert all(topic == ns.name for topic, _, _ in got)
            c.sync()
            got = events_of(sub.drain())
            assert sorted(k for _, t, (m, ks) in got if t == "BlockStored" and m == "DISK" for k in ks) == sorted(keys)
            c.flush("host")
            got = events_of(sub.drain())
            assert sorted(k for _, t, (m, ks) in got if t == "BlockRemoved" and m == "CPU" for k in ks) == sorted(keys)
            c.flush("disk", namespace=ns)
            got = events_of(sub.drain())
            assert sorted(k for _, t, (m, ks) in got if t == "BlockRemoved" and m == "DISK" for k in ks) == sorted(keys)
            c.put(ns, keys[:2], [block_for(ns, k) for k in keys[:2]])
            c.sync()
            sub.drain()
            # token ids a connector supplies travel with the event (an indexer's own keys)
            import numpy as np
            toks = np.random.default_rng(5).integers(0, 32000, 3 * ns.block_tokens).tolist()
            tkeys = ns.block_keys(np.asarray(toks))
            assert c.events
            c.put(ns, tkeys, [block_for(ns, k) for k in tkeys], token_ids=toks)
            stored = [e for f in sub.drain() for e in msgpack.unpackb(f[2], raw=False)[1]
                      if e["type"] == "BlockStored" and e["medium"] == "CPU"]
            assert [e["block_hashes"] for e in stored] == [[k] for k in tkeys]
            assert [e["token_ids"] for e in stored] == [toks[i * ns.block_tokens:(i + 1) * ns.block_tokens]
                                                         for i in range(3)]
            assert stored[1]["parent_block_hash"] == tkeys[0]
            c.flush("all")
            c.put(ns, keys[:2], [block_for(ns, k) for k in keys[:2]])
            c.sync()
            sub.drain()
        assert d.stop() == 0
        d.start()                                           # a restart: a clean slate, then what disk holds
        time.sleep(0.5)
        with tierd.connect(d.url) as c:
            c.register(ns)
            c.ping()
        frames = sub.drain(1.0)
        got = events_of(frames)
        types = [(t, m) for _, t, (m, _) in got]
        assert types[0] == ("AllBlocksCleared", None), types
        assert sorted(k for _, t, (m, ks) in got if t == "BlockStored" and m == "DISK" for k in ks) == sorted(keys[:2])
        seqs = [int.from_bytes(f[1], "big") for f in frames]
        assert seqs == sorted(seqs)                          # in order within one daemon's life
    finally:
        sub.close()
        if d.alive():
            d.stop()

    # the same stream, decoded by vLLM's own classes
    py = vllm_python("cpu-build")
    if py is None:
        if os.environ.get("TEST_REQUIRE_VLLM"):
            pytest.fail(f"the vLLM environment {VLLM_ENVS['cpu-build']} is part of this suite here, and it is missing")
        pytest.skip("no .venv-vllm: the vLLM decoding half is skipped")
    dump = tmp_path / "frames.msgpack"
    dump.write_bytes(msgpack.packb([f[2] for f in sub.frames], use_bin_type=True))
    code = (
        "import json, sys, msgpack, msgspec\n"
        "from vllm.distributed.kv_events import KVEventBatch, BlockStored, BlockRemoved, AllBlocksCleared\n"
        "dec = msgspec.msgpack.Decoder(type=KVEventBatch)\n"
        "out = []\n"
        "for p in msgpack.unpackb(open(sys.argv[1], 'rb').read()):\n"
        "    b = dec.decode(p)\n"
        "    for e in b.events:\n"
        "        out.append([type(e).__name__, [getattr(e, 'medium', None), getattr(e, 'locality', None)],\n"
        "                    [h.hex() for h in getattr(e, 'block_hashes', [])],\n"
        "                    getattr(e, 'block_size', None)])\n"
        "print(json.dumps(out))\n")
    r = subprocess.run([py, "-c", code, str(dump)], capture_output=True, text=True, timeout=300,
                       env=dict(os.environ, VLLM_LOGGING_LEVEL="WARNING"))
    assert r.returncode == 0, r.stderr[-3000:]
    decoded = json.loads(r.stdout.strip().splitlines()[-1])
    mine = [[t, list(m), [k.hex() for k in ks]] for _, t, (m, ks) in events_of(sub.frames, raw=True)]
    assert [x[:3] for x in decoded] == mine
    assert {x[3] for x in decoded if x[0] == "BlockStored"} == {ns.block_tokens}


def test_events_bind_to_loopback_and_carry_no_token_ids_unless_told(tmp_path):
    """Finding 8: events name every block a node holds and, from a connector, its prompt token
    ids; on b90e890 any address was bound and token ids always published."""
    d = DaemonProc(tmp_path, toml=f'events_addr = "tcp://0.0.0.0:{free_port()}"\n' + SMALL_TOML)
    with pytest.raises(RuntimeError, match="did not start"):
        d.start(timeout_s=30)
    assert d.proc.wait(10) != 0 and "reachable from other hosts" in d.log.read_text()
    d._logf.close()
    addr = f"tcp://127.0.0.1:{free_port()}"
    (tmp_path / "b").mkdir()
    d = DaemonProc(tmp_path / "b", toml=f'events_addr = "{addr}"\n' + SMALL_TOML).start()
    sub = Subscriber(addr)
    ns = make_ns()
    try:
        time.sleep(0.5)
        with Client(d.socket) as c:
            keys = chain(ns, 3, 2)
            toks = list(range(2 * ns.block_tokens))
            c.put(ns, keys, [block_for(ns, k) for k in keys], token_ids=toks)
        stored = wait_for(lambda: [e for f in sub.drain() for e in msgpack.unpackb(f[2], raw=False)[1]
                                   if e["type"] == "BlockStored"], what="events")
        assert stored and all(e["token_ids"] == [] for e in stored)
    finally:
        sub.close()
        assert d.stop() == 0


def test_subscribing_in_a_loop_gets_at_most_one_snapshot_a_second(tmp_path):
    from tierd.events import EventPublisher
    addr = f"tcp://127.0.0.1:{free_port()}"
    d = DaemonProc(tmp_path, toml=f'events_addr = "{addr}"\n' + SMALL_TOML).start()
    try:
        subs = []
        t0 = time.monotonic()
        for _ in range(30):                     # a peer subscribing again and again
            subs.append(Subscriber(addr))
            time.sleep(0.05)
        time.sleep(1.2)
        elapsed = time.monotonic() - t0
        with Client(d.socket) as c:
            snaps = c.stats()["daemon"]["event_snapshots"]
        most = elapsed / EventPublisher.SNAPSHOT_INTERVAL_S + 2   # one per interval (+ both ends)
        assert 1 <= snaps <= most, f"{snaps} snapshots in {elapsed:.1f}s"
    finally:
        for s in subs:
            s.close()
        assert d.stop() == 0
