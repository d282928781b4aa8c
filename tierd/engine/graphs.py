"""One-token steps replayed from CUDA graphs.

On a GPU a step of decodes runs a few hundred small kernels, and launching them one by one from
Python takes longer than running them. `DecodeGraphs` captures the model's decode step
(`LlamaModel.decode_step`: fixed shapes, no host work per sequence, no wait for the device)
once per bucket of batch size and context bound, and replays it: one launch for the whole step.

- Buckets: batch sizes 1, 2, 4, 8, 16, 24, 32, 48, ... up to the engine's `max_num_seqs`;
  context bounds that double from 1,024 tokens up to `max_model_len`. A step of B sequences
  whose longest context is L runs the smallest bucket that holds both; the rows past B are
  padding (slot -1: nothing is written; length 1).
- Inputs live in static device buffers: the tokens, positions, slots and lengths in one int32
  tensor, each context bound's block tables in another. A step writes them into page-locked
  host copies and copies them up (two copies), then replays.
- Every bucket writes its logits into one buffer (max_num_seqs, vocab), rows 0..B-1: the
  buckets' graphs share it (and their memory pool), so no bucket keeps logits of its own.
- Graphs are captured off the serving path: the engine's warm-up captures the buckets up to
  8,192 tokens (`capture_all`); a step that needs a bucket not captured yet runs the model's
  forward (`run` returns None) and queues the bucket, which `capture_pending` captures when
  the engine is idle (no step waits for a capture). A capture: two eager runs first (the
  kernels' self-checks, Triton's compiles and cuBLAS's workspaces happen there, not in the
  capture), then the capture, then a check: the replay on other inputs must give what the same
  step run eagerly gives. A capture that fails or a check that differs turns graphs off for
  the engine (logged; steps run eagerly, as without graphs), never a wrong step. (A kernel
  that raises for a shape is not such a failure: the decode dispatcher moves that shape to
  another kernel in the eager runs, `tierd.kernels.DecodeAttention`.)
- Without capture (`capture=False`: the CPU, where there are no graphs) the same static buffers
  and the same padded step run eagerly: the path tests check on the CPU.
"""

from __future__ import annotations

import logging
import time

import numpy as np
import torch

log = logging.getLogger("tierd.engine")

BATCHES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512)
FIRST_CONTEXT = 1024
WARM_CONTEXT = 8192          # the warm-up captures the buckets up to this context bound
# a padding row of the inputs: token 0, position 0, slot -1 (nothing written), length 1
PADDING = np.array([[0], [0], [-1], [1]], dtype=np.int32)


def batch_buckets(max_num_seqs: int) -> list[int]:
    return [b for b in BATCHES if b < max_num_seqs] + [max_num_seqs]


def context_buckets(block_size: int, max_model_len: int) -> list[int]:
    """Context bounds, whole blocks each: doubling from FIRST_CONTEXT, the last max_model_len."""
    top = -(-max_model_len // block_size) * block_size
    out, c = [], max(block_size, -(-FIRST_CONTEXT // block_size) * block_size)
    while c < top:
        out.append(c)
        c *= 2
    return out + [top]


class DecodeGraphs:
    """Steps of one-token decodes through static buffers, replayed from CUDA graphs
    (`capture`), or run eagerly through the same buffers (the CPU)."""

    def __init__(self, model, kv_caches, kv_scales, *, block_size: int, max_num_seqs: int, max_model_len: int,
                 capture: bool):
        self.model, self.kv_caches, self.kv_scales = model, kv_caches, kv_scales
        self.device = model.device
        self.capture = capture
        self.block_size = block_size
        self.batches = batch_buckets(max_num_seqs)
        self.contexts = context_buckets(block_size, max_model_len)
        self.num_blocks = kv_caches[0][0].shape[0]
        self.enabled, self.reason = True, "on" if capture else "eager (no CUDA graphs on this device)"
        bmax = self.batches[-1]
        pin = capture and torch.cuda.is_available()
        # tokens, positions, slots, lengths: rows of one int32 tensor; block tables per context bound
        self._host_head = torch.zeros((4, bmax), dtype=torch.int32, pin_memory=pin)
        self._head = self._host_head.to(self.device) if capture else self._host_head
        self._host_tables = {c: torch.zeros((bmax, c // block_size), dtype=torch.int32, pin_memory=pin)
                             for c in self.contexts}
        self._tables = {c: (t.to(self.device) if capture else t) for c, t in self._host_tables.items()}
        self._graphs: dict[tuple[int, int], tuple] = {}
        self.pending: set[tuple[int, int]] = set()    # buckets a step asked for, to capture when idle
        self._logits: torch.Tensor | None = None      # every bucket's logits: rows 0..B-1
        self._pool = None
        self._copied = None           # the event after the last step's copies up
        self.captured_seconds = 0.0
        self.replays = self.eager_steps = 0

    # -- buckets -----------------------------------------------------------------------------------
    def bucket(self, batch: int, longest: int) -> tuple[int, int] | None:
        """(padded batch, context bound) for a step, or None where no bucket holds it."""
        b = next((x for x in self.batches if x >= batch), None)
        c = next((x for x in self.contexts if x >= longest), None)
        return None if b is None or c is None else (b, c)

    def logits_buffer(self) -> torch.Tensor:
        """The one (max_num_seqs, vocab) float32 buffer every bucket's step writes its logits to."""
        if self._logits is None:
            self._logits = torch.empty((self.batches[-1], self.model.cfg.vocab_size), dtype=torch.float32,
                                       device=self.device)
        return self._logits

    def _step(self, b: int, c: int):
        head = self._head
        tables = self._tables[c][:b]
        logits = self.logits_buffer()[:b]

        def step() -> torch.Tensor:
            logits.copy_(self.model.decode_step(head[0, :b], head[1, :b], head[2, :b], tables, head[3, :b],
                                                self.kv_caches, self.kv_scales, c))
            return logits
        return step

    # -- one step ----------------------------------------------------------------------------------
    def run(self, tokens: list[int], positions: list[int], slots: list[int], tables: list[list[int]],
            lengths: list[int]) -> torch.Tensor | None:
        """Logits (len(tokens), vocab) of one decode step, on the device (rows of the shared
        logits buffer: valid until the next step); None where this step takes no bucket, its
        bucket is not captured yet (queued for `capture_pending`: no capture here) or graphs
        went off (the caller runs the model's forward)."""
        n = len(tokens)
        where = self.bucket(n, max(lengths)) if n and self.enabled else None
        if where is None:
            return None
        b, c = where
        graph = None
        if self.capture:
            graph = self._graphs.get(where)
            if graph is None:
                self.pending.add(where)
                return None
        if self._copied is not None:
            self._copied.synchronize()      # the last step's copies up have read the host buffers
        head = self._host_head.numpy()
        head[:, n:b] = PADDING
        head[0, :n], head[1, :n], head[2, :n], head[3, :n] = tokens, positions, slots, lengths
        ht = self._host_tables[c].numpy()
        width = ht.shape[1]
        for i, t in enumerate(tables):
            m = min(len(t), width)          # (entries past a sequence's length are never read)
            ht[i, :m] = t[:m]
            ht[i, m:] = 0
        ht[n:b] = 0
        if self.capture:
            self._head.copy_(self._host_head, non_blocking=True)
            self._tables[c][:b].copy_(self._host_tables[c][:b], non_blocking=True)
            self._copied = torch.cuda.Event()
            self._copied.record()
            graph[0].replay()
            self.replays += 1
            return graph[1][:n]
        self.eager_steps += 1
        return self._step(b, c)()[:n]

    # -- capture -----------------------------------------------------------------------------------
    def capture_all(self, up_to: int = WARM_CONTEXT) -> int:
        """Capture every bucket with a context bound up to `up_to` (the warm-up). Returns how many."""
        done = 0
        for c in self.contexts:
            if c > max(up_to, self.contexts[0]):
                break
            for b in self.batches:
                if not self.enabled:
                    return done
                if (b, c) not in self._graphs and self._capture(b, c) is not None:
                    done += 1
        return done

    def capture_pending(self) -> int:
        """Capture the buckets steps asked for that were not captured (call it off the serving
        path: the engine does when idle). Returns how many."""
        done = 0
        while self.pending and self.enabled:
            b, c = min(self.pending)
            self.pending.discard((b, c))
            if (b, c) not in self._graphs and self._capture(b, c) is not None:
                done += 1
        if not self.enabled:
            self.pending.clear()
        return done

    def _fill_padding(self, b: int, c: int, rng: np.random.Generator | None = None) -> None:
        """Inputs that write nothing (slot -1): padding, or (rng) random tokens, positions,
        lengths and tables for the check."""
        head = self._host_head.numpy()
        if rng is None:
            head[:, :b] = PADDING
            self._host_tables[c][:b] = 0
        else:
            head[0, :b] = rng.integers(0, self.model.cfg.vocab_size, b)
            head[3, :b] = rng.integers(1, c + 1, b)
            head[1, :b] = head[3, :b] - 1
            head[2, :b] = -1
            self._host_tables[c][:b] = torch.from_numpy(rng.integers(0, self.num_blocks, (b, c // self.block_size),
                                                                     dtype=np.int32))
        self._head.copy_(self._host_head)
        self._tables[c][:b].copy_(self._host_tables[c][:b])

    def _capture(self, b: int, c: int):
        """Capture bucket (b, c) and check its replay; None (graphs off) where either fails."""
        t0 = time.perf_counter()
        dev = self.device
        try:
            if self._copied is not None:
                self._copied.synchronize()
            step = self._step(b, c)
            self._fill_padding(b, c)
            side = torch.cuda.Stream(dev)
            side.wait_stream(torch.cuda.current_stream(dev))
            with torch.cuda.stream(side):
                for _ in range(2):
                    step()
            torch.cuda.current_stream(dev).wait_stream(side)
            torch.cuda.synchronize(dev)
            graph = torch.cuda.CUDAGraph()
            if self._pool is None:
                self._pool = torch.cuda.graph_pool_handle()
            # thread_local: the engine's other threads (a connector's saves) may call CUDA meanwhile
            with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
                out = step()
            # the check: other inputs, replayed and run eagerly
            self._fill_padding(b, c, np.random.default_rng(b * 7919 + c))
            graph.replay()
            got = out.clone()
            want = step()
            torch.cuda.synchronize(dev)
            scale = float(want.abs().max()) or 1.0
            if not torch.allclose(got, want, rtol=1e-2, atol=1e-2 * scale):
                raise AssertionError(f"its replay differs from the eager step by "
                                     f"{float((got - want).abs().max()):.3g} (logits up to {scale:.3g})")
        except Exception as e:  # noqa: BLE001 -- steps run eagerly instead
            self.enabled = False
            self.reason = f"off: bucket ({b} sequences, {c} tokens) failed: {e!r}"
            log.warning("tierd engine: CUDA graphs of the decode step are off (%s); steps run eagerly", self.reason)
            try:
                torch.cuda.synchronize(dev)
            except Exception:  # noqa: BLE001
                pass
            return None
        self._graphs[(b, c)] = (graph, out)
        self.captured_seconds += time.perf_counter() - t0
        return self._graphs[(b, c)]

    def stats(self) -> dict:
        return {"state": self.reason, "graphs": len(self._graphs), "pending": len(self.pending),
                "replays": self.replays, "eager_steps": self.eager_steps,
                "captured_seconds": round(self.captured_seconds, 3)}
