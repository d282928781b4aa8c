"""One screen of the GPU check's figures against their goals (benchmarks/gpu_check.sh runs it
last): every result of gpu_kernels.json and gpu_ttft.json with its same-run reference and ratio,
and for the figures the project holds goals on, whether the goal is met. Exits 1 when a goal
is missed or a figure a goal needs is missing (a part that ran over its time limit).

    python -m benchmarks.gpu_summary RESULTS_DIR
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

# (result name, a params filter, the least ratio (higher is better), what the goal says)
GOALS = [
    ("TTFT host hit", {"prompt_tokens": 2048}, 5.0, "a 2K host hit >= 5x faster than recompute (or declined)"),
    ("TTFT host hit", {"prompt_tokens": 8192}, 10.0, "an 8K host hit >= 10x faster than recompute"),
    ("recompute TTFT", {}, 0.5, "recompute <= 2x its FLOP floor"),
    ("load part of host hit, device time", {}, 0.8, "the load part >= 0.8 of pinned H2D"),
    ("paged decode triton", {"reference": "fused SDPA on dense KV"}, 0.8, "paged decode >= 0.8 of fused SDPA"),
    ("TTFT slowed disk, decide", {}, 1 / 1.3, "decide on a slowed disk <= 1.3x recompute"),
]


def _matches(r: dict, want: dict) -> bool:
    for k, v in want.items():
        if k == "reference":
            if r.get("reference_name") != v:
                return False
        elif r.get("params", {}).get(k) != v:
            return False
    return True


def main(argv: list[str]) -> int:
    base = Path(argv[1] if len(argv) > 1 else "benchmarks/results")
    rows = []
    for name in ("gpu_kernels.json", "gpu_ttft.json"):
        try:
            rows += json.loads((base / name).read_text())["results"]
        except (OSError, ValueError, KeyError):
            print(f"(no figures in {base / name})")
    for r in rows:
        params = ", ".join(f"{k}={v}" for k, v in r.get("params", {}).items())[:70]
        print(f"{r['name'][:38]:38s} {params:70s} {r['value']:10.3f} {r['unit']:6s} "
              f"vs {r['reference_value']:10.3f} {r['ratio']:7.2f}x")
    print("-- goals")
    failed = 0
    for name, want, least, what in GOALS:
        got = [r for r in rows if r["name"] == name and _matches(r, want)]
        if not got:
            print(f"MISSING  {what}")
            failed += 1
            continue
        worst = min(r["ratio"] for r in got)
        declined = name == "TTFT host hit" and all(r.get("params", {}).get("cached_tokens") == 0 and r["ratio"] >= 1 / 1.3
                                                   for r in got)
        ok = worst >= least or declined
        failed += not ok
        print(f"{'ok' if ok else 'MISSED':8s} {what}: {worst:.2f}x (goal {least:.2f}x){' declined' if declined else ''}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
