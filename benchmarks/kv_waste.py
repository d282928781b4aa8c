"""KV memory waste of paged allocation (the engine's BlockManager) against contiguous
max-length reservation, under one memory budget, and how many sequences each admits at once.

Workload: 4,000 requests (1,000 with --quick) with ShareGPT-like lengths. The vLLM paper reports ShareGPT means of
about 161 input and 338 output tokens; we draw both from log-normal distributions with those
means (sigma 0.9 and 0.7), clipped to [4, 2048] tokens in total. Requests arrive all at once
and are served first come first served; each step every running sequence grows by one token.
Waste and concurrency are sampled every step while requests wait for room (the memory is the
limit): waste = slots reserved but holding no token, over slots reserved.

    python -m benchmarks.kv_waste [--json PATH] [--quick]
"""

from __future__ import annotations

import math

import numpy as np

from tierd.engine.block_manager import BlockManager
from tierd.engine.sampling import SamplingParams
from tierd.engine.sequence import Sequence
from tierd.keys import root_key

from .common import Result, parse_args, report

MAX_LEN = 2048


def workload(n: int, seed: int = 0) -> list[tuple[int, int]]:
    rng = np.random.default_rng(seed)

    def lognormal(mean, sigma, size):
        return rng.lognormal(math.log(mean) - sigma ** 2 / 2, sigma, size)

    ins = np.clip(lognormal(161, 0.9, n), 4, MAX_LEN - 4).astype(int)
    outs = np.clip(lognormal(338, 0.7, n), 1, None).astype(int)
    outs = np.minimum(outs, MAX_LEN - ins)
    return list(zip(ins.tolist(), outs.tolist()))


def simulate_paged(reqs, budget_tokens: int, block_size: int) -> tuple[float, float]:
    """(mean waste, mean concurrent sequences) with the engine's BlockManager."""
    bm = BlockManager(budget_tokens // block_size, block_size, root_key(b"kv-waste"), prefix_caching=False)
    queue = list(reqs)
    running: list[tuple[Sequence, int]] = []
    wastes, conc = [], []
    rid = 0
    while queue or running:
        while queue:  # admit while the prompt plus one new token fits
            n_in, n_out = queue[0]
            seq = Sequence(str(rid), None, [1] * n_in, SamplingParams(max_tokens=max(1, n_out)))
            if not bm.can_allocate(seq, n_in):
                break
            bm.allocate(seq, n_in)
            seq.num_computed = n_in
            running.append((seq, n_in + n_out))
            queue.pop(0)
            rid += 1
        if not running:
            raise RuntimeError("a request does not fit the budget at all")
        still = []
        for seq, total in running:  # one decode step: each sequence grows by one token
            if seq.num_computed >= total:
                bm.free_seq(seq)
                continue
            if not bm.can_allocate(seq, 1):  # out of blocks: preempt (recompute later)
                bm.free_seq(seq)
                queue.insert(0, (len(seq.prompt_token_ids), total - len(seq.prompt_token_ids)))
                continue
            bm.allocate(seq, 1)
            seq.num_computed += 1
            still.append((seq, total))
        running = still
        slots = sum(len(s.block_table) for s, _ in running) * block_size
        used = sum(s.num_computed for s, _ in running)
        if slots and queue:  # saturated: requests are waiting for room
            wastes.append((slots - used) / slots)
            conc.append(len(running))
    return float(np.mean(wastes)), float(np.mean(conc))


def simulate_contiguous(reqs, budget_tokens: int, reserve: int) -> tuple[float, float]:
    """Each sequence reserves `reserve` token slots up front (as static engines do)."""
    slots_total = budget_tokens // reserve
    queue = list(reqs)
    running: list[list[int]] = []  # [used, total]
    wastes, conc = [], []
    while queue or running:
        while queue and len(running) < slots_total:
            n_in, n_out = queue.pop(0)
            running.append([n_in, n_in + n_out])
        for r in running:
            r[0] += 1
        running = [r for r in running if r[0] <= r[1]]
        if running and queue:  # saturated: requests are waiting for room
            used = sum(min(r[0], r[1]) for r in running)
            wastes.append(1 - used / (len(running) * reserve))
            conc.append(len(running))
    return float(np.mean(wastes)), float(np.mean(conc))


def main() -> None:
    args = parse_args(__doc__.splitlines()[0])
    n = 1000 if args.quick else 4000
    reqs = workload(n)
    budget = 32 * MAX_LEN  # one budget: room for 32 max-length sequences
    results = []
    c_waste, c_conc = simulate_contiguous(reqs, budget, MAX_LEN)
    for bs in (16, 32):
        p_waste, p_conc = simulate_paged(reqs, budget, bs)
        params = {"block_size": bs, "requests": n, "budget_tokens": budget,
                  "mean_in": round(float(np.mean([r[0] for r in reqs])), 1),
                  "mean_out": round(float(np.mean([r[1] for r in reqs])), 1)}
        results.append(Result("KV waste", params, p_waste * 100, "%", "contiguous max-length waste %",
                              c_waste * 100, higher_is_better=False))
        results.append(Result("concurrent sequences", params, p_conc, "seqs", "contiguous seqs", c_conc))
    report("kv_waste", results, args.json)


if __name__ == "__main__":
    main()
