"""Continuous batching with chunked prefill and preemption by recompute.

Each step spends a token budget: running sequences first, in arrival order (a decode costs one
token, a prefill its next chunk), then waiting ones, first come first served. When blocks run
out, the most recently admitted running sequence is preempted (its blocks freed, recomputed
later) and goes back to the front of the queue, so nothing starves.
"""

from __future__ import annotations

from collections import deque

from .block_manager import BlockManager
from .sequence import Sequence, Status


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int,
                 connector=None):
        self.bm = block_manager
        self.connector = connector  # loads cached prefixes from tierd at admission (or None)
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def preempt(self, seq: Sequence) -> None:
        """Free a running sequence's blocks; it waits at the front and is recomputed."""
        self.running.remove(seq)
        self.bm.free_seq(seq)
        seq.reset_for_recompute()
        self.waiting.appendleft(seq)
        self.preemptions += 1

    def schedule(self) -> list[tuple[Sequence, int]]:
        """(sequence, new tokens to compute) for this step."""
        budget = self.max_num_batched_tokens
        out: list[tuple[Sequence, int]] = []
        preempted = False
        for seq in list(self.running):
            if budget <= 0 or seq.status is not Status.RUNNING:
                continue
            n = min(seq.num_tokens - seq.num_computed, budget)
            while not self.bm.can_allocate(seq, n):
                victim = self.running[-1]
                self.preempt(victim)
                preempted = True
                if victim is seq:
                    break
            if seq.status is not Status.RUNNING:
                continue
            self.bm.allocate(seq, n)
            out.append((seq, n))
            budget -= n
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs and not preempted:
            seq = self.waiting[0]
            if not seq.block_table:
                cached = self.bm.admit(seq)
                if self.connector is not None:
                    cached += self.connector.load(seq, self.bm)
                if not seq.output_token_ids:
                    seq.num_cached_tokens = cached
            n = min(seq.num_tokens - seq.num_computed, budget)
            if not self.bm.can_allocate(seq, n):
                self.bm.free_seq(seq)
                seq.num_computed = 0
                break
            self.waiting.popleft()
            seq.status = Status.RUNNING
            self.running.append(seq)
            self.bm.allocate(seq, n)
            out.append((seq, n))
            budget -= n
        return out

    def finish(self, seq: Sequence) -> None:
        seq.status = Status.FINISHED
        self.running.remove(seq)
        self.bm.free_seq(seq)
