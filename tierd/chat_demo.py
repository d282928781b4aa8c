"""The multi-turn chat demo behind `make run` (see tierd/demo.py)."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import numpy as np

SYSTEM_TOKENS = 512
USER_TOKENS = 96
ANSWER_TOKENS = 24
TIER_BLOCK_TOKENS = 128


class _Daemon:
    def __init__(self, workdir: str):
        self.workdir = workdir
        self.socket = os.path.join(workdir, "tierd.sock")
        self.proc = None
        self.arena_dir = None

    def start(self) -> None:
        # the host arena in a directory of the demo's own (kept across the daemon's restarts,
        # removed at the end); /dev/shm where there is one, as in production
        if self.arena_dir is None:
            self.arena_dir = tempfile.mkdtemp(prefix="tierd-demo-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tierd", "serve", "--socket", self.socket, "--host-bytes", "256MiB",
             "--disk-path", os.path.join(self.workdir, "disk"), "--disk-bytes", "512MiB",
             "--metrics-addr", "", "--log-level", "warning"],
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env={**os.environ, "TIERD_ARENA_DIR": self.arena_dir})
        line = self.proc.stdout.readline().decode().strip()
        if "serving" not in line:
            raise RuntimeError(f"tierd serve did not start: {line!r}")

    def stop(self, *, remove: bool = True) -> None:
        self.proc.send_signal(signal.SIGTERM)  # finishes requests, syncs host blocks to disk
        self.proc.wait(60)
        if remove:
            shutil.rmtree(self.arena_dir, ignore_errors=True)


def run_chat_demo(*, embedded: bool = False, conversations: int = 3) -> None:
    from .engine import LLM, SamplingParams
    from .engine.random_model import bench_model_dir

    print("tierd demo: multi-turn chat through the bundled engine with tierd")
    print("(the model has RANDOM weights, so the text is noise; the timings are real)\n")
    t0 = time.perf_counter()
    model = bench_model_dir()
    print(f"bench model: {model} ({time.perf_counter() - t0:.1f}s to build or find)")
    rng = np.random.default_rng(0)
    system = rng.integers(100, 32000, SYSTEM_TOKENS).tolist()
    histories = [list(system) for _ in range(conversations)]
    params = SamplingParams(temperature=0, max_tokens=ANSWER_TOKENS, ignore_eos=True)

    with tempfile.TemporaryDirectory(prefix="tierd-demo-") as work:
        daemon = None
        if embedded:
            from . import TieredStore
            store = TieredStore(host_bytes="256MiB", disk_path=os.path.join(work, "disk"), disk_bytes="512MiB")
            where = "embedded store (host 256MiB, disk 512MiB)"
        else:
            daemon = _Daemon(work)
            daemon.start()
            store = f"unix://{daemon.socket}"
            where = f"tierd daemon at {daemon.socket} (host 256MiB, disk 512MiB)"
        print(f"store: {where}; tier blocks of {TIER_BLOCK_TOKENS} tokens\n")

        def engine():
            # a small engine KV cache, as on a busy GPU: the engine forgets, tierd remembers
            return LLM(model, kv_cache_bytes="96MiB", kv_store=store, kv_block_tokens=TIER_BLOCK_TOKENS)

        header = f"{'phase':<22} {'conv':>4} {'turn':>4} {'prompt':>7} {'TTFT ms':>9} {'cached':>7}  from"
        print(header)
        print("-" * len(header))

        def turn(llm, phase: str, t: int) -> None:
            for c in range(conversations):
                user = rng.integers(100, 32000, USER_TOKENS).tolist()
                prompt = histories[c] + user
                out = llm.generate(prompt_token_ids=prompt, sampling_params=params)[0]
                histories[c] = prompt + out.outputs[0].token_ids
                m = out.metrics
                tier = m["tier_cached_tokens"]
                src = []
                if out.num_cached_tokens - tier:
                    src.append(f"engine cache {out.num_cached_tokens - tier}")
                if tier:
                    src.append(f"tierd {'+'.join(m['tier_sources'])} {tier}")
                print(f"{phase:<22} {c:>4} {t:>4} {len(prompt):>7} {m['time_to_first_token'] * 1e3:>9.0f} "
                      f"{out.num_cached_tokens:>7}  {', '.join(src) or 'recomputed'}")
            llm.connector.flush()

        llm = engine()
        turn(llm, "engine 1", 1)
        turn(llm, "engine 1", 2)
        llm.close()
        turn(llm := engine(), "engine 2 (restarted)", 3)
        llm.close()
        if daemon is not None:
            daemon.stop(remove=False)   # its host blocks are re-adopted by the next start
            daemon.start()
            phase = "daemon restarted"
        else:
            store.sync()
            store.flush(tier="host")
            phase = "host tier flushed"
        turn(llm := engine(), phase, 4)
        llm.close()
        print()
        if daemon is not None:
            subprocess.run([sys.executable, "-m", "tierd", "stats", "--socket", daemon.socket], check=False)
            daemon.stop()
        else:
            from .report import format_stats
            print(format_stats(store.stats()))
            store.close()
