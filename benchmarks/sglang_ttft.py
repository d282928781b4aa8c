"""Time to first token in a real SGLang engine with tierd as its HiCache storage tier, against
recompute and against SGLang's own file backend, in one run on the same prompts.

Each engine is a fresh process (tests/sglang_engine.py in the SGLang environment, `make
sglang-env`; on a CPU through the test-only glue of tests/sglang_cpu/) on the bench model
(random weights, ~150M parameters, fp32; --quick: a 4-layer model), pages of 64 tokens, the
hierarchical cache on in every engine, storage prefetch `wait_complete`:

- recompute: no storage backend (the reference of every hit; also the no-hit cost's "off");
- tierd host hit: a fresh engine whose prompts another engine stored in the daemon;
- tierd disk hit: the same after `tierd sync` and a host-tier flush (pages only on disk);
- SGLang's file backend (the peer): one engine stores, a fresh one loads (its files are in the
  page cache: they were just written);
- the no-hit cost: tierd's backend on vs off (no storage backend) on prompts it does not hold, in
  two pairs of engines (the recompute engine and the engine that fills the daemon, same prompts;
  then two engines on prompts of their own), so that the machine's drift shows as their spread.
Each prompt runs alone (its TTFT is the engine's first-token latency); medians over the prompts;
greedy tokens compared with recompute's.

    python -m benchmarks.sglang_ttft [--json PATH] [--quick]
"""

from __future__ import annotations

import shutil
import statistics
import tempfile
from pathlib import Path

import numpy as np

import tierd

from .common import (DaemonUnderTest, Result, engine_python, parse_args, quick_model, report, run_engine_process,
                     single_batches)

PAGE = 64


def run_engine(py: str, work: Path, name: str, model: Path, batches: list, *, storage=None, tierd_cfg=None,
               file_dir=None) -> dict:
    # every storing engine's shutdown waits for its writes (SGLang's own file backend's too, so
    # that the peer's loads find all its pages)
    spec = {"model": str(model), "storage": storage, "tierd": tierd_cfg,
            "file_dir": str(file_dir) if file_dir else None, "hicache": True, "drain_any": True,
            "engine": {"page_size": PAGE, "max_total_tokens": 16384}, "batches": batches}
    return run_engine_process(py, "tests.sglang_engine", work, name, spec)


WARMUP: list[int] = []


def singles(prefix: str, prompts: list[list[int]], warmup: bool = True) -> list[dict]:
    return single_batches(prefix, prompts, WARMUP if warmup else None)


def _rows(run: dict, prefix: str) -> list[dict]:
    return [b["outputs"][0] for b in run["batches"] if b["name"].startswith(prefix)]


def ttfts(run: dict, prefix: str) -> list[float]:
    return [o["time_s"] for o in _rows(run, prefix)]


def cached(run: dict, prefix: str) -> float:
    rows = _rows(run, prefix)
    return sum(o["cached"] for o in rows) / max(1, len(rows))


def tokens(run: dict, prefix: str) -> list[list[int]]:
    return [o["tokens"] for o in _rows(run, prefix)]


def main() -> None:
    args = parse_args(__doc__.splitlines()[0])
    py = engine_python(".venv-sglang", "TEST_SGLANG_PYTHON", "sglang-env")
    from tierd.engine.random_model import BENCH_MODEL, bench_model_dir

    work = Path(tempfile.mkdtemp(prefix="tierd-sglang-ttft-"))
    if args.quick:
        model = quick_model(work)
        n_prompts, length, vocab = 2, 600, 500
    else:
        model = bench_model_dir()
        n_prompts, length, vocab = 4, 2048, BENCH_MODEL["vocab_size"] - 1
    rng = np.random.default_rng(7)
    WARMUP[:] = rng.integers(1, vocab, length).tolist()
    hit_prompts = [rng.integers(1, vocab, length).tolist() for _ in range(n_prompts)]
    miss_prompts = [rng.integers(1, vocab, length).tolist() for _ in range(n_prompts)]
    print(f"model {model} ({'quick' if args.quick else 'bench'}), {n_prompts} prompts of {length} tokens, "
          f"pages of {PAGE}")

    daemon = DaemonUnderTest(str(work), host_bytes="2GiB", disk_path=str(work / "disk"), disk_bytes="4GiB")
    url = f"unix://{daemon.socket}"
    cfg = {"url": url}
    try:
        base = run_engine(py, work, "recompute", model, singles("h", hit_prompts))
        fill = run_engine(py, work, "tierd-fill", model, singles("h", hit_prompts), storage="tierd", tierd_cfg=cfg)
        off2 = run_engine(py, work, "nohit-off", model, singles("m", miss_prompts))
        on2 = run_engine(py, work, "nohit-on", model, singles("m", miss_prompts), storage="tierd", tierd_cfg=cfg)
        host = run_engine(py, work, "tierd-host", model, singles("h", hit_prompts), storage="tierd", tierd_cfg=cfg)
        with tierd.connect(url) as c:
            c.sync()
            c.flush(tier="host")
        disk = run_engine(py, work, "tierd-disk", model, singles("h", hit_prompts), storage="tierd", tierd_cfg=cfg)
        files = work / "sglang-files"
        run_engine(py, work, "file-fill", model, singles("h", hit_prompts), storage="file", file_dir=files)
        peer = run_engine(py, work, "file-hit", model, singles("h", hit_prompts), storage="file", file_dir=files)
    finally:
        daemon.stop()
        shutil.rmtree(work, ignore_errors=True)

    ref = statistics.median(ttfts(base, "h"))
    expected = tokens(base, "h")
    results = []
    for label, run in (("tierd host hit", host), ("tierd disk hit", disk), ("SGLang file backend hit (peer)", peer)):
        t = statistics.median(ttfts(run, "h"))
        same = tokens(run, "h") == expected
        results.append(Result(f"{label} TTFT", {"prompt_tokens": length, "loaded_tokens": cached(run, "h")},
                              t, "s", "SGLang recompute TTFT", ref, higher_is_better=False,
                              note="" if same else "greedy tokens differ from recompute"))
    t_host, t_peer = statistics.median(ttfts(host, "h")), statistics.median(ttfts(peer, "h"))
    results.append(Result("tierd host hit vs SGLang file backend hit", {"prompt_tokens": length}, t_host, "s",
                          "SGLang file backend hit TTFT", t_peer, higher_is_better=False))
    t_disk = statistics.median(ttfts(disk, "h"))
    results.append(Result("tierd disk hit vs SGLang file backend hit", {"prompt_tokens": length}, t_disk, "s",
                          "SGLang file backend hit TTFT", t_peer, higher_is_better=False,
                          note="the file backend's files were in the page cache; tierd's disk pages were read "
                               "with O_DIRECT"))
    pairs = [(statistics.median(ttfts(base, "h")), statistics.median(ttfts(fill, "h"))),
             (statistics.median(ttfts(off2, "m")), statistics.median(ttfts(on2, "m")))]
    costs = [100 * (on / off - 1) for off, on in pairs]
    off, on = statistics.median(o for o, _ in pairs), statistics.median(n for _, n in pairs)
    same = tokens(fill, "h") == expected and tokens(on2, "m") == tokens(off2, "m")
    results.append(Result("no-hit TTFT with tierd's backend on", {"prompt_tokens": length, "pairs": 2}, on, "s",
                          "no storage backend", off, higher_is_better=False,
                          note=f"cost per pair of engines {', '.join(f'{c:+.1f}%' for c in costs)}"
                               + ("" if same else "; greedy tokens differ")))
    report("sglang_ttft", results, args.json)


if __name__ == "__main__":
    main()
