"""Shared builders for tests: namespaces, deterministic block contents, store configs."""

from __future__ import annotations

import os

import numpy as np

from tierd import Namespace, StoreConfig


# `make test-fast` runs the suite without the engine environments (vLLM, SGLang): with
# TEST_NO_ENGINES=1 their tests skip, whatever TEST_REQUIRE_VLLM / TEST_REQUIRE_SGLANG say
ENGINES_OFF = "engines off (TEST_NO_ENGINES=1, as in make test-fast)"


def engines_off() -> bool:
    return os.environ.get("TEST_NO_ENGINES") == "1"


def make_ns(*, model: str = "test-model", kv_dtype: str = "float16", num_layers: int = 2,
            num_kv_heads: int = 2, head_dim: int = 64, block_tokens: int = 16, **kw) -> Namespace:
    return Namespace(model=model, kv_dtype=kv_dtype, num_layers=num_layers,
                     num_kv_heads=num_kv_heads, head_dim=head_dim, block_tokens=block_tokens, **kw)


def block_for(ns: Namespace, key: bytes) -> np.ndarray:
    """Deterministic (block_bytes,) uint8 content of the block named `key`: anyone who knows
    the key can check a block bit-exact, also in another process."""
    rng = np.random.default_rng(int.from_bytes(key[:8], "little") ^ int.from_bytes(ns.id[:8], "little"))
    return rng.integers(0, 256, ns.block_bytes, dtype=np.uint8)


def put_chain(store, ns: Namespace, keys, **kw) -> int:
    """Store each key's `block_for` content (an embedded store or a daemon's client)."""
    return store.put(ns, keys, [block_for(ns, k) for k in keys], **kw)


def assert_exact(store, ns: Namespace, keys) -> None:
    """Every key is served, bit-exact."""
    assert_blocks(ns, keys, store.get(ns, keys))


def first_wrong(ns: Namespace, keys, blocks) -> bytes | None:
    """The first key whose block in `blocks` (paired with `keys` in order) is not its
    `block_for` content, or None."""
    return next((k for k, b in zip(keys, blocks) if not np.array_equal(b, block_for(ns, k))), None)


def assert_blocks(ns: Namespace, keys, blocks) -> None:
    """`blocks` are the blocks of `keys`, one each, bit-exact."""
    blocks = list(blocks)
    assert len(blocks) == len(keys), f"{len(blocks)} blocks for {len(keys)} keys"
    wrong = first_wrong(ns, keys, blocks)
    assert wrong is None, f"block {wrong.hex()} is not its bytes"


def chain(ns: Namespace, seed: int, n_blocks: int) -> list[bytes]:
    """Keys of one prompt of `n_blocks` full blocks with token ids drawn from `seed`."""
    toks = np.random.default_rng(seed).integers(0, 32000, n_blocks * ns.block_tokens)
    return ns.block_keys(toks)


def small_config(tmp_path=None, **kw) -> StoreConfig:
    base = dict(host_bytes="1MiB", host_slab_bytes="256KiB", disk_bytes="8MiB",
                disk_slab_bytes="1MiB", disk_file_bytes="4MiB", demotion_interval_s=0.05)
    if tmp_path is not None:
        base["disk_path"] = str(tmp_path / "disk")
    base.update(kw)
    return StoreConfig(**base)


def wait_for(pred, timeout_s: float = 10.0, what: str = "condition"):
    """Poll `pred` until it returns something true (returned), or fail after `timeout_s`."""
    import time
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        v = pred()
        if v:
            return v
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


class LazyStreams:
    """A CPU stand-in for CUDA streams (the `streams` of `tierd.kernels.transfer`): work queued on
    a stream runs only when something waits for it -- an event synchronized on the host, or
    another stream waiting on an event when that wait itself runs -- so a wait the transfer
    forgets shows as bytes missing, and a wait it adds in the wrong place shows as bytes early.
    `compute` is the engine's stream; `settle()` runs everything queued on it. With
    `eager_compute` the compute stream is the host itself (the bundled engine on CPU computes as
    it goes): its waits run at once."""

    class Stream:
        def __init__(self, name: str):
            self.name, self.ops, self.done = name, [], 0

    def __init__(self, eager_compute: bool = False):
        self.eager_compute = eager_compute
        self.compute = self.Stream("compute")
        self.streams = [self.compute]
        self.waits: list[tuple[str, str]] = []       # (waiting stream, stream waited for), as queued

    def stream(self):
        s = self.Stream(f"side{len(self.streams)}")
        self.streams.append(s)
        return s

    def current(self):
        return self.compute

    def run(self, stream, fn) -> None:
        if self.eager_compute and stream is self.compute:
            fn()
            return
        stream.ops.append(fn)

    def record(self, stream):
        return (stream, len(stream.ops))

    def wait(self, stream, event) -> None:
        src, n = event
        self.waits.append((stream.name, src.name))
        if self.eager_compute and stream is self.compute:
            self._flush(src, n)
            return
        stream.ops.append(lambda: self._flush(src, n))

    def synchronize(self, event) -> None:
        self._flush(*event)

    def settle(self) -> None:
        self._flush(self.compute, len(self.compute.ops))

    def _flush(self, stream, n: int) -> None:
        while stream.done < n:
            op = stream.ops[stream.done]
            stream.done += 1
            op()


def run_on_terminal(args, answer: bytes = b"", timeout_s: float = 60) -> tuple[int | None, str]:
    """Run `python -m tierd ARGS` from the checkout with a pseudo-terminal as stdin, stdout and
    stderr, typing `answer`: (exit status, or None when it was killed after `timeout_s`; what it
    printed)."""
    import os
    import pty
    import select
    import subprocess
    import sys
    import time
    from pathlib import Path
    master, slave = pty.openpty()
    p = subprocess.Popen([sys.executable, "-m", "tierd", *args], cwd=Path(__file__).resolve().parent.parent,
                         stdin=slave, stdout=slave, stderr=slave, close_fds=True)
    os.close(slave)
    out = b""
    if answer:
        os.write(master, answer)
    deadline = time.monotonic() + timeout_s
    try:
        while time.monotonic() < deadline:
            r, _, _ = select.select([master], [], [], 0.2)
            if r:
                try:
                    chunk = os.read(master, 4096)
                except OSError:
                    break
                if not chunk:
                    break
                out += chunk
            elif p.poll() is not None:
                break
    finally:
        os.close(master)
        try:
            rc = p.wait(max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(10)
            rc = None
    return rc, out.decode(errors="replace")
