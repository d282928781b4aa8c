"""Daemon restarts under load: time to first token before, during and after a restart.

One engine (the bundled engine, bench model, fp32, CPU; its own prefix cache off, so every hit is
tierd's) sends requests without pause, through a real `tierd serve`, whose prompts' prefixes are
in tierd's host tier (4 prompts of 2,048 tokens in turn; --quick: 3 of 512). The daemon is
restarted mid-run, once by SIGTERM and once by kill -9, and the engine goes on throughout.
Printed: the median TTFT of the requests before each restart, of those sent while the daemon was
down or starting, and of those after it serves again, beside before (goal: after <= 1.2x before,
host hits stay host hits); where each request's prefix came from; the daemon's restart time and
the blocks it re-adopted; and, in the same run, the TTFT of the same requests with their prefix
only on disk (what a restart that drops the host tier gives) and recomputed. Every request's
greedy tokens must equal recompute's and no request may fail: the benchmark exits non-zero
otherwise.

    python -m benchmarks.restart [--json PATH] [--quick]
"""

from __future__ import annotations

import shutil
import signal
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

from tierd.client import Client
from tierd.engine import LLM, SamplingParams
from tierd.engine.random_model import bench_model_dir

from .common import DaemonUnderTest, Result, parse_args, report

FOUR = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
TIER_TOKENS = 256
ROUNDS = 2            # passes over the prompts before and after each restart


def main() -> int:
    args = parse_args(__doc__.splitlines()[0])
    n_prompts, length = (3, 512) if args.quick else (4, 2048)
    model = bench_model_dir()
    rng = np.random.default_rng(7)
    prompts = [rng.integers(100, 32000, length).tolist() for _ in range(n_prompts)]
    work = Path(tempfile.mkdtemp(prefix="tierd-bench-restart-"))
    daemon = DaemonUnderTest(str(work), host_bytes="1GiB", disk_path=str(work / "disk"), disk_bytes="2GiB")
    results: list[Result] = []
    failures: list[str] = []
    try:
        fresh_start_s = _restart_time(daemon, signal.SIGTERM)[1]     # an empty daemon's start
        recompute = LLM(model, kv_cache_bytes="512MiB", max_num_batched_tokens=1024, enable_prefix_caching=False)
        ref = {}
        t_re = []
        for i, p in enumerate(prompts):
            out = recompute.generate(prompt_token_ids=p, sampling_params=FOUR)[0]
            ref[i] = list(out.outputs[0].token_ids)
            t_re.append(out.metrics["time_to_first_token"])
        recompute.close()
        llm = LLM(model, kv_cache_bytes="512MiB", max_num_batched_tokens=1024, enable_prefix_caching=False,
                  kv_store=f"unix://{daemon.socket}", kv_block_tokens=TIER_TOKENS)
        log: list[dict] = []

        def request(i: int, phase: str) -> dict:
            t0 = time.perf_counter()
            try:
                out = llm.generate(prompt_token_ids=prompts[i], sampling_params=FOUR)[0]
            except Exception as e:  # noqa: BLE001 -- a failed request is the figure
                r = {"phase": phase, "prompt": i, "failed": repr(e), "ttft": time.perf_counter() - t0}
                failures.append(f"{phase} prompt {i}: {e!r}")
            else:
                r = {"phase": phase, "prompt": i, "ttft": out.metrics["time_to_first_token"],
                     "sources": out.metrics["tier_sources"], "cached": out.num_cached_tokens}
                if list(out.outputs[0].token_ids) != ref[i]:
                    failures.append(f"{phase} prompt {i}: tokens differ from recompute's")
            log.append(r)
            return r

        for i in range(n_prompts):
            request(i, "fill")
        llm.connector.flush()
        with Client(daemon.socket) as c:
            _wait(lambda: c.stats()["tiers"]["host"]["keep_pending"] == 0)
        restarts = {}
        for how, sig in (("SIGTERM", signal.SIGTERM), ("kill -9", signal.SIGKILL)):
            for r in range(ROUNDS):
                for i in range(n_prompts):
                    request(i, f"before {how}")
            box = {}
            t = threading.Thread(target=lambda: box.update(zip(("down_s", "start_s"), _restart_time(daemon, sig))))
            t.start()
            i = 0
            while t.is_alive():                    # the engine goes on while the daemon restarts
                request(i % n_prompts, f"during {how}")
                i += 1
            t.join()
            with Client(daemon.socket) as c:
                host = c.stats()["tiers"]["host"]
            restarts[how] = {**box, "adopted_blocks": host["adopted_blocks"], "adopted_bytes": host["adopted_bytes"],
                             "adopt_seconds": host["adopt_seconds"], "adopt_dropped": host["adopt_dropped"]}
            for r in range(ROUNDS):
                for i in range(n_prompts):
                    request(i, f"after {how}")
        # the same requests with their prefix only on disk: what a restart that drops host RAM gives
        with Client(daemon.socket) as c:
            c.sync()
            for r in range(ROUNDS):
                for i in range(n_prompts):
                    c.flush(tier="host")
                    request(i, "disk hit")
        llm.close()
    finally:
        daemon.stop()
        shutil.rmtree(work, ignore_errors=True)

    def med(phase: str) -> float:
        return statistics.median(r["ttft"] for r in log if r["phase"] == phase) * 1e3

    def spread(phase: str) -> str:
        v = [r["ttft"] * 1e3 for r in log if r["phase"] == phase]
        return f"{min(v):.1f}-{max(v):.1f} ms over {len(v)}"

    def sources(phase: str) -> str:
        s = ["+".join(r.get("sources") or []) or ("failed" if "failed" in r else "recomputed")
             for r in log if r["phase"] == phase]
        return ", ".join(f"{x} x{s.count(x)}" for x in sorted(set(s)))

    p = {"prompt_tokens": length, "prompts": n_prompts, "tier_block_tokens": TIER_TOKENS}
    disk = med("disk hit")
    for how, rs in restarts.items():
        before = med(f"before {how}")
        results += [
            Result(f"TTFT after a {how} restart", {**p, "sources": sources(f"after {how}")}, med(f"after {how}"), "ms",
                   "TTFT before it, ms", before, higher_is_better=False,
                   note=f"goal ratio >= 0.83 (after <= 1.2x before); before {spread(f'before {how}')}, "
                        f"after {spread(f'after {how}')}"),
            Result(f"TTFT after a {how} restart vs disk hits", p, med(f"after {how}"), "ms",
                   "same prompts, prefix only on disk, ms", disk, higher_is_better=False,
                   note="the disk hit is what every hit was after a restart before the host tier was kept"),
            Result(f"TTFT while the daemon restarts ({how})", {**p, "sources": sources(f"during {how}")},
                   med(f"during {how}"), "ms", "recompute TTFT ms", statistics.median(t_re) * 1e3,
                   higher_is_better=False, note="requests sent while the daemon was down or starting: recomputed, none failed"),
            Result(f"daemon restart, {how} to serving", {"re-adopted blocks": rs["adopted_blocks"],
                   "re-adopted MiB": round(rs["adopted_bytes"] / 2**20, 1), "dropped": rs["adopt_dropped"],
                   "re-adoption s": round(rs["adopt_seconds"], 3)},
                   rs["down_s"] + rs["start_s"], "s", "an empty daemon's start, s", fresh_start_s,
                   higher_is_better=False, note="exit (or kill) plus a start that re-verifies and copies every host block"),
        ]
    report("restart", results, args.json)
    n_req = sum(1 for r in log if r["phase"] != "fill")
    print(f"requests: {n_req}, failed: {sum('failed' in r for r in log)}, "
          f"tokens equal to recompute's: {n_req - sum('differ' in f for f in failures)} of {n_req}")
    if failures:
        print("FAILURES:\n  " + "\n  ".join(failures[:20]), file=sys.stderr)
        return 1
    return 0


def _restart_time(daemon: DaemonUnderTest, sig) -> tuple[float, float]:
    """Stop the daemon by `sig` and start it again: (seconds to exit, seconds from exec to serving)."""
    t0 = time.perf_counter()
    daemon.kill(sig)
    down = time.perf_counter() - t0
    return down, daemon.start()


def _wait(pred, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not pred():
        if time.monotonic() > deadline:
            raise RuntimeError("timed out")
        time.sleep(0.05)


if __name__ == "__main__":
    sys.exit(main())
