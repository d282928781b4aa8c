"""What a failing tierd costs the engine: requests through the bundled engine with its connector
pointed at a daemon that is down, stalled (SIGSTOP), or answering every request with an error,
beside the same requests with no connector at all. Every request must complete with the same
tokens; the figure is the extra latency per request.

    python -m benchmarks.engine_faults [--json PATH] [--quick]
"""

from __future__ import annotations

import signal
import socket
import struct
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path

import msgpack

from .common import Result, parse_args, report

TIMEOUT_S = 0.5   # the connector's request timeout used for the stalled case


class ErroringPeer:
    """A Unix socket that answers every tierd request with an error frame."""

    def __init__(self, path: str):
        self.path = path
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.bind(path)
        self.sock.listen(16)
        self.replies = 0
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._conn, args=(conn,), daemon=True).start()

    def _conn(self, conn: socket.socket) -> None:
        with conn:
            while True:
                hdr = conn.recv(4, socket.MSG_WAITALL)
                if len(hdr) < 4:
                    return
                (n,) = struct.unpack(">I", hdr)
                msg = msgpack.unpackb(conn.recv(n, socket.MSG_WAITALL), raw=False)
                body = msgpack.packb({"id": msg.get("id"), "error": {"code": "internal",
                                                                     "message": "injected failure"}})
                conn.sendall(struct.pack(">I", len(body)) + body)
                self.replies += 1

    def close(self) -> None:
        self.sock.close()


def prompts(n: int, length: int) -> list[list[int]]:
    return [[(7 * i + 13 * j) % 500 + 1 for j in range(length)] for i in range(n)]


def run_condition(model_dir, store, reqs, sampling) -> tuple[list[float], list, dict]:
    from tierd.engine import LLM
    llm = LLM(model_dir, kv_cache_bytes="16MiB", kv_store=store, kv_block_tokens=64) if store else \
        LLM(model_dir, kv_cache_bytes="16MiB")
    lat, outs = [], []
    try:
        for p in reqs:
            t0 = time.perf_counter()
            out = llm.generate(prompt_token_ids=p, sampling_params=sampling)[0]
            lat.append(time.perf_counter() - t0)
            outs.append(out.outputs[0].token_ids)
        stats = llm.kv_connector_stats()
    finally:
        if store:
            llm.connector.link.flush(0.1)   # a stalled store thread must not hold up the run
        llm.close()
    return lat, outs, stats


def run(model_dir, n: int, workdir: str) -> dict:
    from tierd.engine import SamplingParams

    from .common import DaemonUnderTest
    sampling = SamplingParams(temperature=0, max_tokens=8)
    reqs = prompts(n, 200)
    res = {}
    res["baseline"] = run_condition(model_dir, None, reqs, sampling)
    res["down"] = run_condition(model_dir, f"unix://{workdir}/absent.sock", reqs, sampling)
    peer = ErroringPeer(f"{workdir}/erroring.sock")
    try:
        res["erroring"] = run_condition(model_dir, f"unix://{peer.path}", reqs, sampling)
    finally:
        peer.close()
    stalled_dir = Path(workdir) / "stalled"
    stalled_dir.mkdir()
    d = DaemonUnderTest(str(stalled_dir), host_bytes="16MiB")
    try:
        d.proc.send_signal(signal.SIGSTOP)
        res["stalled"] = run_condition(model_dir, f"unix://{d.socket}?timeout_s={TIMEOUT_S}", reqs, sampling)
    finally:
        d.proc.send_signal(signal.SIGCONT)
        d.stop()
    return res


def main() -> int:
    args = parse_args(__doc__.splitlines()[0])
    from tierd.engine.random_model import write_random_model
    workdir = tempfile.mkdtemp(prefix="tierd-faults-")
    model_dir = write_random_model(Path(workdir) / "llama", seed=0)
    n = 4 if args.quick else 12
    try:
        res = run(model_dir, n, workdir)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    base_lat, base_out, _ = res["baseline"]
    results = []
    for cond in ("down", "erroring", "stalled"):
        lat, outs, stats = res[cond]
        same = outs == base_out
        extra = [a - b for a, b in zip(lat, base_lat)]
        results.append(Result(f"daemon {cond}: mean latency per request", {"requests": n, "same_tokens": same},
                              sum(lat) / n * 1e3, "ms", "no connector", sum(base_lat) / n * 1e3,
                              higher_is_better=False,
                              note=f"max extra {max(extra) * 1e3:.0f} ms; connector unavailable "
                                   f"{stats.get('unavailable', 0)}x"))
        if not same:
            print(f"{cond}: tokens differ from the no-connector run", file=sys.stderr)
    report("engine_faults", results, args.json)
    return 0 if all(res[c][1] == base_out for c in ("down", "erroring", "stalled")) else 1


if __name__ == "__main__":
    sys.exit(main())
