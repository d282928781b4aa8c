"""`LLM`: the engine's front door (vLLM's names: `LLM`, `SamplingParams`, `generate`).

Owns the request loop: add requests, schedule a step, run the model over the packed batch,
sample, stream finished requests out. Requests may be added while others run
(`add_request` + `step`). It never decides block placement (BlockManager) or batch content
(Scheduler) itself.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..errors import ConfigError
from ..namespace import Namespace
from .block_manager import BlockManager
from .config import ModelConfig
from .int4 import Int4LayerCache
from .model import LlamaModel
from .sampling import Logprob, SamplingParams, sample
from .scheduler import Scheduler
from .sequence import Sequence

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass(slots=True)
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float
    logprobs: list[dict[int, Logprob]] | None
    finish_reason: str | None


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int
    metrics: dict = field(default_factory=dict)


class LLM:
    """A paged-attention engine for Llama-family checkpoints in a local directory."""

    def __init__(self, model: str | Path, *, block_size: int = 16, dtype: str = "auto",
                 max_num_seqs: int = 64, max_num_batched_tokens: int = 2048,
                 kv_cache_bytes: int | str = "256MiB", enable_prefix_caching: bool = True,
                 kv_cache_dtype: str = "auto", kv_store=None, kv_block_tokens: int = 256,
                 cache_salt: str = "", seed: int = 0, max_model_len: int | None = None,
                 kv_tier_codec: str = "", kv_scales: str = "auto",
                 calibration_prompts: list[list[int]] | None = None, int4_group: int = 32,
                 attention_sinks: int = 0, window: int | None = None, kv_budget: int | None = None,
                 device: str = "cpu", warmup: bool | None = None, cuda_graphs: bool | None = None,
                 recompute_probe: bool = True, kv_load_policy: str | None = None):
        from ..config import parse_size
        self.model_dir = Path(model)
        self.config = cfg = ModelConfig.from_dir(self.model_dir)
        if dtype == "auto":
            # CPU matmuls are fastest in fp32 on machines without bf16 units: the CPU path's default
            dtype = "float32"
        if dtype not in _DTYPES:
            raise ConfigError(f"dtype {dtype!r} is not one of {', '.join(_DTYPES)} or 'auto'")
        if kv_cache_dtype not in ("auto", "fp8", "fp8_e4m3", "int4"):
            raise ConfigError(f"kv_cache_dtype {kv_cache_dtype!r} is not 'auto', 'fp8' or 'int4'")
        if block_size < 1 or block_size & (block_size - 1):
            raise ConfigError(f"block_size must be a power of two, got {block_size}")
        self.streaming = None if window is None else (int(attention_sinks), int(window))
        if self.streaming is not None:
            if window < 1 or attention_sinks < 0:
                raise ConfigError("StreamingLLM needs window >= 1 and attention_sinks >= 0")
            if attention_sinks + window > cfg.max_position_embeddings:
                raise ConfigError(f"attention_sinks + window ({attention_sinks + window}) exceed the model's "
                                  f"context ({cfg.max_position_embeddings})")
            if cfg.sliding_window is not None or kv_cache_dtype == "int4":
                raise ConfigError("StreamingLLM with a sliding-window model or an int4 cache is not supported")
        elif attention_sinks and kv_budget is None:
            raise ConfigError("attention_sinks needs window= (StreamingLLM) or kv_budget= (eviction)")
        self.kv_budget = None        # block eviction: (blocks per sequence, blocks of the sinks)
        if kv_budget is not None:
            sink_blocks = -(-attention_sinks // block_size)
            budget_blocks = -(-int(kv_budget) // block_size)
            if window is not None or kv_cache_dtype == "int4" or cfg.sliding_window is not None:
                raise ConfigError("kv_budget (block eviction) with StreamingLLM, an int4 cache or a "
                                  "sliding-window model is not supported")
            if budget_blocks < sink_blocks + 2:
                raise ConfigError(f"kv_budget {kv_budget} holds fewer blocks ({budget_blocks}) than the sinks' "
                                  f"({sink_blocks}) + 2")
            self.kv_budget = (budget_blocks, sink_blocks)
        self.dtype = _DTYPES[dtype]
        self.device = torch.device(device)
        if self.device.type not in ("cpu", "cuda"):
            raise ConfigError(f"device {device!r}: use cpu or cuda[:N]")
        if self.device.type == "cuda":
            if not torch.cuda.is_available():
                raise ConfigError("device='cuda' but CUDA is not available")
            if kv_cache_dtype == "int4":
                raise ConfigError("the int4 KV cache runs on the CPU only (its CUDA kernel is not wired yet)")
        self.block_size = block_size
        self.fp8 = kv_cache_dtype in ("fp8", "fp8_e4m3")
        self.int4 = kv_cache_dtype == "int4"
        self.kv_cache_dtype = "fp8" if self.fp8 else kv_cache_dtype
        if self.int4:
            if cfg.head_dim % int4_group or int4_group % 2:
                raise ConfigError(f"int4_group {int4_group} must be even and divide head_dim {cfg.head_dim}")
            if kv_store is not None:
                raise ConfigError("kv_store with an int4 KV cache is not supported yet (tier blocks are "
                                  "copied from float or fp8 caches)")
        if kv_scales not in ("auto", "checkpoint", "calibrate", "unit"):
            raise ConfigError(f"kv_scales {kv_scales!r} is not auto, checkpoint, calibrate or unit")
        torch.manual_seed(seed)
        self.model = LlamaModel(cfg, self.model_dir, self.dtype, self.device)
        self.max_model_len = min(max_model_len or cfg.max_position_embeddings, cfg.max_position_embeddings)
        # fp8 KV: per layer (k_scale, v_scale), stored value = value / scale
        self.kv_scales: list[tuple[float, float]] | None = None
        self.kv_scale_source = ""
        scales_id = ""
        if self.fp8:
            self.kv_scales, self.kv_scale_source = self._fp8_scales(kv_scales, calibration_prompts)
            if self.kv_scale_source != "unit":   # blocks quantized with other scales are other blocks
                import hashlib
                flat = torch.tensor(self.kv_scales, dtype=torch.float32).numpy().tobytes()
                scales_id = "blake2b:" + hashlib.blake2b(flat, digest_size=8).hexdigest()
        kv_dtype_name = "fp8" if self.fp8 else dtype
        self.namespace = Namespace.from_model_dir(
            self.model_dir, block_tokens=block_size, kv_dtype=kv_dtype_name, cache_salt=cache_salt,
            kv_scales=scales_id)
        # Under StreamingLLM the KV of tokens past the window comes from attention without the
        # middle: other bytes than full attention's, so other blocks (prefix cache and tiers)
        stream_layout = "" if self.streaming is None else "streaming-s%d-w%d" % self.streaming
        if self.kv_budget is not None:          # likewise past the first eviction
            stream_layout = "evict-b%d-s%d" % self.kv_budget
        if stream_layout:
            self.namespace = Namespace.from_dict({**self.namespace.to_dict(), "layout": stream_layout})
        if self.int4:   # its own blocks: another layout, so another namespace (prefix-cache keys)
            self.namespace = Namespace.from_dict({**self.namespace.to_dict(), "layout": f"int4-g{int4_group}"})
            block_bytes = cfg.num_layers * Int4LayerCache.bytes_per_block(block_size, cfg.num_kv_heads,
                                                                          cfg.head_dim, int4_group)
        else:
            block_bytes = self.namespace.bytes_per_token * block_size
        num_blocks = parse_size(kv_cache_bytes, what="kv_cache_bytes") // block_bytes
        if num_blocks < 2:
            raise ConfigError(f"kv_cache_bytes {kv_cache_bytes} holds fewer than 2 blocks of {block_bytes} bytes")
        self.kv_block_bytes = block_bytes
        on_free = None
        if self.int4:
            self.kv_caches = [Int4LayerCache(num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim, int4_group,
                                             self.dtype) for _ in range(cfg.num_layers)]

            def on_free(bid: int) -> None:
                for c in self.kv_caches:
                    c.forget(bid)
        else:
            cache_dtype = torch.float8_e4m3fn if self.fp8 else self.dtype
            shape = (num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim)
            self.kv_caches = [(torch.zeros(shape, dtype=cache_dtype, device=self.device),
                               torch.zeros(shape, dtype=cache_dtype, device=self.device))
                              for _ in range(cfg.num_layers)]
        self.block_manager = BlockManager(num_blocks, block_size, self.namespace.root_key,
                                          enable_prefix_caching, on_free=on_free)
        self.connector = None
        if kv_store is not None:
            from ..connectors.engine import EngineConnector
            if kv_block_tokens % block_size:
                raise ConfigError(f"kv_block_tokens {kv_block_tokens} must be a multiple of block_size {block_size}")
            tier_ns = Namespace.from_model_dir(self.model_dir, block_tokens=kv_block_tokens,
                                               kv_dtype=kv_dtype_name, cache_salt=cache_salt,
                                               tier_codec=kv_tier_codec, kv_scales=scales_id)
            if stream_layout:
                tier_ns = Namespace.from_dict({**tier_ns.to_dict(), "layout": stream_layout})
            self.connector = EngineConnector(kv_store, tier_ns, self.kv_caches, block_size,
                                             load_policy=kv_load_policy)
        self.scheduler = Scheduler(self.block_manager, max_num_seqs, max_num_batched_tokens, self.connector)
        self.tokenizer = None
        tok = self.model_dir / "tokenizer.json"
        if tok.exists():
            from tokenizers import Tokenizer
            self.tokenizer = Tokenizer.from_file(str(tok))
        self._ids = itertools.count()
        # seconds spent in each phase of `step` since the engine started (where a step's time
        # goes: benchmarks.engine_throughput prints it)
        self.phase_seconds = {"schedule": 0.0, "inputs": 0.0, "forward": 0.0, "sample": 0.0}
        self._seqs: dict[str, Sequence] = {}
        self.evicted_blocks = 0
        self.warmup_seconds = 0.0
        # steps of decodes only through static buffers: replayed CUDA graphs on CUDA (the
        # default there), run eagerly elsewhere (cuda_graphs=True on the CPU: the tests' way)
        self.graphs = None
        if cuda_graphs if cuda_graphs is not None else self.device.type == "cuda":
            why = self._graphs_decline()
            if why is None:
                from .graphs import DecodeGraphs
                self.graphs = DecodeGraphs(self.model, self.kv_caches, self.kv_scales, block_size=block_size,
                                           max_num_seqs=max_num_seqs, max_model_len=self.max_model_len,
                                           capture=self.device.type == "cuda")
            elif cuda_graphs:
                raise ConfigError(f"cuda_graphs: {why}")
        if warmup if warmup is not None else self.device.type == "cuda":
            self.warmup()
        if self.connector is not None and recompute_probe and self.connector.load_policy == "decide":
            self.probe_recompute()

    def _graphs_decline(self) -> str | None:
        """Why decode steps cannot run through static buffers with this engine, or None."""
        if self.int4:
            return "an int4 KV cache"
        if self.streaming is not None or self.kv_budget is not None:
            return "StreamingLLM or block eviction"
        if self.config.sliding_window is not None or any(w is not None for w in self.config.layer_windows):
            return "sliding-window layers"
        return None

    # -- warm-up ---------------------------------------------------------------------------------
    def warmup(self) -> float:
        """Run the shapes this engine serves once, before any request (as vLLM's profile run
        does), so that no request pays for lazy module loading, first allocations or kernel
        builds and checks: a whole prompt of a step's size, a chunk after a cached prefix, and
        decode steps of one and of several sequences. It runs the model directly on scratch
        blocks, not through the scheduler: nothing is cached, stored or counted, and the
        blocks are zeroed again. Returns its seconds (also `warmup_seconds`). The default on
        CUDA (`warmup=None`); an int4 cache (CPU only) is not warmed."""
        if self.int4 or self.scheduler.running or self.scheduler.waiting:
            return 0.0
        t0 = time.perf_counter()
        bs, dev, bm = self.block_size, self.device, self.block_manager
        free = bm.num_free
        n = min(self.scheduler.max_num_batched_tokens, self.max_model_len - 1, (free - 1) * bs)
        if n < 2:
            return 0.0
        blocks = list(range(-(-n // bs)))                 # scratch: no block is in use yet
        table = torch.tensor(blocks, dtype=torch.long)
        g = torch.Generator().manual_seed(0)
        prompt = torch.randint(0, self.config.vocab_size, (n,), generator=g)

        def run(tokens, start: int, seqs, logits_rows) -> None:
            t = len(tokens)
            positions = torch.arange(start, start + t) if len(seqs) == 1 else torch.tensor([s[2] - 1 for s in seqs])
            slots = torch.tensor([table[p // bs] * bs + p % bs for p in positions.tolist()])
            self.model.forward(tokens.to(dev), positions.to(dev), slots.to(dev), seqs, self.kv_caches,
                               torch.tensor(logits_rows, dtype=torch.long).to(dev), self.kv_scales,
                               streaming=self.streaming)

        with torch.inference_mode():
            run(prompt, 0, [(0, n, n, table)], [n - 1])                          # a whole prompt
            half = n // 2
            if half >= 2:
                run(prompt[half:], half, [(0, n - half, n, table)], [n - half - 1])   # after a cached prefix
            for batch in sorted({1, min(8, self.scheduler.max_num_seqs)}):      # decode steps
                ctx = list(range(n - batch + 1, n + 1))
                seqs = [(i, 1, c, table) for i, c in enumerate(ctx)]
                run(prompt[-batch:], 0, seqs, list(range(batch)))
            if self.graphs is not None and self.graphs.capture:
                self.graphs.capture_all()           # (they write nothing: every slot is padding)
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)
            idx = table.to(dev)
            for k, v in self.kv_caches:
                k.view(torch.uint8)[idx] = 0     # (as bytes: any cache dtype, fp8 included)
                v.view(torch.uint8)[idx] = 0
        self.model.attention_seconds = 0.0
        self.warmup_seconds = time.perf_counter() - t0
        return self.warmup_seconds

    PROBE_BLOCKS = (2, 8, 32)   # prompt lengths (in engine blocks) `probe_recompute` times

    def probe_recompute(self) -> int:
        """Seed the node's cost model (tierd/costs.py) with what this engine's prefill costs,
        so that its first requests are decided too: a few prompts of `PROBE_BLOCKS` lengths,
        each timed, through the model directly on scratch blocks (nothing cached or stored;
        the blocks are zeroed again). Later forwards refine the estimate. Returns how many
        forwards were measured (0 without a connector, or with the engine busy)."""
        conn = self.connector
        if conn is None or self.int4 or self.scheduler.running or self.scheduler.waiting:
            return 0
        bs, dev = self.block_size, self.device
        most = min(self.scheduler.max_num_batched_tokens, self.max_model_len - 1, (self.block_manager.num_free - 1) * bs)
        lengths = sorted({min(most, b * bs) for b in self.PROBE_BLOCKS if min(most, b * bs) >= 2})
        if not lengths:
            return 0
        table = torch.arange(-(-lengths[-1] // bs), dtype=torch.long)     # scratch: no block is in use yet
        g = torch.Generator().manual_seed(1)
        measured = 0
        with torch.inference_mode():
            for i, n in enumerate([lengths[0]] + lengths):    # (the first run only warms up)
                tokens = torch.randint(0, self.config.vocab_size, (n,), generator=g)
                positions = torch.arange(n)
                slots = table[positions // bs] * bs + positions % bs
                t0 = time.perf_counter()
                self.model.forward(tokens.to(dev), positions.to(dev), slots.to(dev), [(0, n, n, table)],
                                   self.kv_caches, torch.tensor([n - 1], dtype=torch.long).to(dev), self.kv_scales,
                                   streaming=self.streaming)
                if dev.type == "cuda":
                    torch.cuda.synchronize(dev)
                if i:
                    conn.observe_forward([(n, 0)], time.perf_counter() - t0)
                    measured += 1
            idx = table.to(dev)
            for k, v in self.kv_caches:
                k.view(torch.uint8)[idx] = 0
                v.view(torch.uint8)[idx] = 0
        self.model.attention_seconds = 0.0
        return measured

    # -- block eviction --------------------------------------------------------------------------
    def _evict(self, seq: Sequence, n: int, mass: torch.Tensor) -> None:
        """Account this step's attention mass to the sequence's blocks; over the budget, free the
        full blocks with the least mean mass per layer-query that could see them, never the
        sinks' blocks or the last block."""
        nt = len(seq.block_table)
        if seq.block_mass is None or len(seq.block_mass) < nt:
            grow = nt - (0 if seq.block_mass is None else len(seq.block_mass))
            pad = torch.zeros(grow, dtype=torch.float64)
            seq.block_mass = pad.clone() if seq.block_mass is None else torch.cat((seq.block_mass, pad))
            seq.block_seen = pad.clone() if seq.block_seen is None else torch.cat((seq.block_seen, pad))
        held = torch.tensor([b >= 0 for b in seq.block_table])
        seq.block_mass[:nt] += mass
        # the queries that could see each block (causal: those at or after its first position)
        end = seq.num_computed
        could = (end - torch.arange(nt) * self.block_size).clamp(min=0, max=n)
        seq.block_seen[:nt] += torch.where(held, could, 0).double() * self.config.num_layers
        budget, sink_blocks = self.kv_budget
        held_idx = held.nonzero().flatten().tolist()
        over = len(held_idx) - budget
        if over <= 0:
            return
        cands = [i for i in held_idx if i >= sink_blocks and i < nt - 1]
        score = seq.block_mass / seq.block_seen.clamp(min=1)
        for i in sorted(cands, key=lambda i: float(score[i]))[:over]:
            self.block_manager.free_entry(seq, i)
        self.evicted_blocks += min(over, len(cands))

    # -- fp8 KV scales --------------------------------------------------------------------------
    def _fp8_scales(self, mode: str, prompts) -> tuple[list[tuple[float, float]], str]:
        """Per-layer (k_scale, v_scale) and where they came from: the checkpoint's (vLLM's
        `k_scale` / `v_scale`), calibrated, or 1.0 ("unit": values beyond +-448 saturate)."""
        n = self.config.num_layers
        ckpt = self.model.checkpoint_kv_scales
        if mode == "unit":
            return [(1.0, 1.0)] * n, "unit"
        if mode == "checkpoint" or (mode == "auto" and ckpt is not None):
            if ckpt is None:
                raise ConfigError(f"{self.model_dir}: kv_scales='checkpoint' but the checkpoint has no "
                                  "k_scale / v_scale")
            return list(ckpt), "checkpoint"
        return self.calibrate_kv_scales(prompts), "calibrated"

    def calibrate_kv_scales(self, prompts: list[list[int]] | None = None) -> list[tuple[float, float]]:
        """Per-layer scales that map the largest |K| and |V| the calibration prompts produce
        onto fp8's largest value (448). Without prompts: four seeded random prompts of up to 512
        tokens. The prompts run in full precision, each on its own scratch cache."""
        from .attention import FP8_MAX
        cfg = self.config
        if prompts is None:
            g = torch.Generator().manual_seed(0)
            n = min(512, self.max_model_len)
            prompts = [torch.randint(0, cfg.vocab_size, (n,), generator=g).tolist() for _ in range(4)]
        if not prompts or any(not p for p in prompts):
            raise ConfigError("calibration needs non-empty prompts")
        amax = torch.zeros(cfg.num_layers, 2)

        def observe(i, k, v):
            amax[i, 0] = torch.maximum(amax[i, 0], k.abs().max().float().cpu())
            amax[i, 1] = torch.maximum(amax[i, 1], v.abs().max().float().cpu())

        bs = self.block_size
        for p in prompts:
            if len(p) > self.max_model_len or not all(0 <= t < cfg.vocab_size for t in p):
                raise ConfigError("a calibration prompt is longer than the context or has ids outside the vocabulary")
            n, nb = len(p), (len(p) + bs - 1) // bs
            shape = (nb, bs, cfg.num_kv_heads, cfg.head_dim)
            dev = self.device
            caches = [(torch.empty(shape, dtype=self.dtype, device=dev), torch.empty(shape, dtype=self.dtype, device=dev))
                      for _ in range(cfg.num_layers)]
            self.model.forward(torch.tensor(p, device=dev), torch.arange(n, device=dev), torch.arange(n, device=dev),
                               [(0, n, n, torch.arange(nb))], caches, torch.tensor([n - 1], device=dev), None, observe)
        scales = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
        return [(float(k), float(v)) for k, v in scales.tolist()]

    # -- requests -----------------------------------------------------------------------------
    def add_request(self, prompt: str | None = None, params: SamplingParams | None = None,
                    prompt_token_ids: list[int] | None = None, request_id: str | None = None) -> str:
        params = params or SamplingParams()
        if prompt_token_ids is None:
            if prompt is None:
                raise ConfigError("a request needs a prompt or prompt_token_ids")
            if self.tokenizer is None:
                raise ConfigError(f"{self.model_dir} has no tokenizer.json: pass prompt_token_ids")
            prompt_token_ids = self.tokenizer.encode(prompt).ids
        ids = [int(t) for t in prompt_token_ids]
        if not ids:
            raise ConfigError("empty prompt: a request needs at least one token")
        bad = [t for t in ids + list(params.forced_token_ids or []) if not 0 <= t < self.config.vocab_size]
        if bad:
            raise ConfigError(f"token id {bad[0]} is outside the vocabulary (0..{self.config.vocab_size - 1})")
        if len(ids) + params.max_tokens > self.max_model_len and self.streaming is None:
            raise ConfigError(f"prompt ({len(ids)} tokens) + max_tokens ({params.max_tokens}) exceeds the "
                              f"model's context of {self.max_model_len} tokens")
        need = self.block_manager.blocks_needed(len(ids) + params.max_tokens)
        if self.config.uniform_window is not None:  # out-of-window blocks are freed as it goes
            need = min(need, self.block_manager.blocks_needed(max(len(ids), self.config.uniform_window)) + 1)
        if self.streaming is not None:               # sinks, the window, and the chunk being computed
            sinks, window = self.streaming
            chunk = min(len(ids), self.scheduler.max_num_batched_tokens)
            need = min(need, self.block_manager.blocks_needed(sinks) +
                       self.block_manager.blocks_needed(max(chunk, window)) + 2)
        if need > len(self.block_manager.blocks):
            raise ConfigError(f"the request needs {need} KV blocks; the cache has "
                              f"{len(self.block_manager.blocks)}: raise kv_cache_bytes")
        rid = request_id if request_id is not None else str(next(self._ids))
        if rid in self._seqs:
            raise ConfigError(f"request id {rid!r} is already in use")
        seq = Sequence(rid, prompt, ids, params)
        self._seqs[rid] = seq
        self.scheduler.add(seq)
        return rid

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_work()

    # -- one step ---------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one scheduled batch; returns the requests that finished in it."""
        t0 = time.perf_counter()
        batch = self.scheduler.schedule()
        t1 = time.perf_counter()
        self.phase_seconds["schedule"] += t1 - t0
        if not batch:
            if self.connector is not None:
                self._recompute(self.connector.finish_loads())
            if self.graphs is not None and self.graphs.pending:
                self.graphs.capture_pending()      # idle: the buckets steps asked for (none is captured in a step)
            return []
        bs = self.block_size
        tokens, positions, slots, seqs, logits_rows, sampled = [], [], [], [], [], []
        mass = None if self.kv_budget is None else [torch.zeros(len(seq.block_table), dtype=torch.float64)
                                                    for seq, _ in batch]
        q0 = 0
        for seq, n in batch:
            start = seq.num_computed
            table = torch.tensor(seq.block_table, dtype=torch.long)
            if self.streaming is None and self.kv_budget is None:
                table.clamp_(min=0)  # -1: freed, masked (streaming attention reads only held blocks)
            for p in range(start, start + n):
                tokens.append(seq.token_ids[p])
                positions.append(p)
                slots.append(seq.block_table[p // bs] * bs + p % bs)
            seqs.append((q0, n, start + n, table))
            q0 += n
            if start + n == seq.num_tokens:
                logits_rows.append(q0 - 1)
                sampled.append(seq)
        dev = self.device
        conn = self.connector
        # (a prefill step's forward is measured for the cost model, unless loads copy during it)
        measured = conn is not None and not conn.loading and len(batch) < len(tokens)
        t2 = time.perf_counter()
        self.phase_seconds["inputs"] += t2 - t1
        try:
            logits = None
            if self.graphs is not None and q0 == len(batch) == len(sampled) and not (conn is not None and conn.loading):
                # decodes only: the static buffers' step (a replayed CUDA graph on CUDA)
                logits = self.graphs.run(tokens, positions, slots, [seq.block_table for seq, _ in batch],
                                         [s[2] for s in seqs])
            if logits is None:
                inputs = (torch.tensor(tokens).to(dev, non_blocking=True),
                          torch.tensor(positions).to(dev, non_blocking=True),
                          torch.tensor(slots).to(dev, non_blocking=True))
                logits = self.model.forward(*inputs, seqs, self.kv_caches,
                                            torch.tensor(logits_rows, dtype=torch.long).to(dev), self.kv_scales,
                                            streaming=self.streaming, mass=mass,
                                            before_layer=conn.wait_layer if conn is not None and conn.loading else None)
        finally:
            # the loaded blocks' copies have run and their leases end; a sequence whose lease was
            # lost meanwhile may have read overwritten bytes: its step is discarded, recomputed
            lost = conn.finish_loads() if conn is not None else []
        logits = logits.cpu()        # sampling runs on the host: the step's one wait for the device
        t3 = time.perf_counter()
        self.phase_seconds["forward"] += t3 - t2
        if measured:
            conn.observe_forward([(n, end - n) for _, n, end, _ in seqs], t3 - t2)
        if lost:
            gone = {id(s) for s in lost}
            kept = [i for i, (seq, _) in enumerate(batch) if id(seq) not in gone]
            mass = None if mass is None else [mass[i] for i in kept]
            batch = [batch[i] for i in kept]
            rows = [(r, s) for r, s in enumerate(sampled) if id(s) not in gone]
            self._recompute(lost)
        else:
            rows = list(enumerate(sampled))
        window = self.config.uniform_window    # a full-attention layer keeps every block
        for seq, n in batch:
            seq.num_computed += n
            self.block_manager.cache_full_blocks(seq)
            if self.connector is not None:
                self.connector.save(seq)
            if window is not None:  # later queries (positions >= num_computed) never look back further
                self.block_manager.free_before(seq, seq.num_computed - window + 1)
            elif self.streaming is not None:    # the middle goes; the sinks' blocks stay
                sinks, w = self.streaming
                self.block_manager.free_before(seq, seq.num_computed - w + 1,
                                               keep_first=self.block_manager.blocks_needed(sinks))
        if mass is not None:
            for (seq, n), m in zip(batch, mass):
                self._evict(seq, n, m)
        finished = []
        now = time.time()
        for row, seq in rows:
            p = seq.params
            n_out = len(seq.output_token_ids)
            stops = set(p.stop_token_ids) | (set() if p.ignore_eos else set(self.config.eos_token_ids))
            banned = sorted(stops) if n_out < p.min_tokens else []
            token, logprobs = sample(logits[row], p, seq.generator, banned)
            if p.forced_token_ids is not None and n_out < len(p.forced_token_ids):
                token = int(p.forced_token_ids[n_out])     # teacher forcing
            seq.token_ids.append(token)
            seq.cumulative_logprob += float(logprobs[token])
            if p.logprobs is not None:
                seq.logprobs.append(self._logprobs(logprobs, token, p.logprobs))
            if seq.first_token_time is None:
                seq.first_token_time = now
            reason = None
            if token in stops and n_out + 1 >= p.min_tokens:
                reason = "stop"
            elif n_out + 1 >= p.max_tokens or (seq.num_tokens >= self.max_model_len and self.streaming is None):
                reason = "length"
            if reason:
                seq.finish_reason = reason
                seq.finished_time = now
                self.scheduler.finish(seq)
                finished.append(self._output(seq))
                del self._seqs[seq.request_id]
        self.phase_seconds["sample"] += time.perf_counter() - t3
        return finished

    def _recompute(self, seqs: list) -> None:
        """Sequences whose loaded prefix cannot be trusted: their blocks go, they start again."""
        for seq in seqs:
            if seq in self.scheduler.running:
                self.scheduler.preempt(seq)
            elif seq.block_table:
                self.block_manager.free_seq(seq)
                seq.num_computed = seq.tier_loaded = 0

    def _logprobs(self, logprobs: torch.Tensor, token: int, k: int) -> dict[int, Logprob]:
        out = {}
        if k:
            vals, idx = torch.topk(logprobs, k)
            for r, (v, i) in enumerate(zip(vals.tolist(), idx.tolist())):
                out[i] = Logprob(v, r + 1, self._decode([i]))
        if token not in out:
            rank = int((logprobs > logprobs[token]).sum()) + 1
            out[token] = Logprob(float(logprobs[token]), rank, self._decode([token]))
        return out

    def _decode(self, ids: list[int]) -> str | None:
        return self.tokenizer.decode(ids) if self.tokenizer is not None else None

    def _output(self, seq: Sequence) -> RequestOutput:
        out = seq.output_token_ids
        text = self._decode(out) or ""
        metrics = {"arrival_time": seq.arrival_time, "first_token_time": seq.first_token_time,
                   "time_to_first_token": (seq.first_token_time or seq.arrival_time) - seq.arrival_time,
                   "finished_time": seq.finished_time, "preemptions": seq.preemptions,
                   "tier_cached_tokens": seq.tier_loaded * (self.connector.block_tokens if self.connector else 0),
                   "tier_sources": list(seq.tier_sources)}
        return RequestOutput(seq.request_id, seq.prompt, seq.prompt_token_ids,
                             [CompletionOutput(0, text, out, seq.cumulative_logprob,
                                               seq.logprobs if seq.params.logprobs is not None else None,
                                               seq.finish_reason)],
                             True, seq.num_cached_tokens, metrics)

    # -- batch API ------------------------------------------------------------------------------
    def generate(self, prompts: str | list[str] | None = None,
                 sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 prompt_token_ids: list[int] | list[list[int]] | None = None) -> list[RequestOutput]:
        """Run every request to completion; outputs in the order of the inputs."""
        if prompt_token_ids is not None:
            if prompt_token_ids and isinstance(prompt_token_ids[0], int):
                prompt_token_ids = [prompt_token_ids]
            n = len(prompt_token_ids)
        else:
            if prompts is None:
                raise ConfigError("generate needs prompts or prompt_token_ids")
            prompts = [prompts] if isinstance(prompts, str) else list(prompts)
            n = len(prompts)
        params = sampling_params if isinstance(sampling_params, list) else [sampling_params or SamplingParams()] * n
        if len(params) != n:
            raise ConfigError(f"{len(params)} sampling params for {n} prompts")
        ids = []
        try:
            for i in range(n):
                ids.append(self.add_request(
                    prompts[i] if prompts is not None and prompt_token_ids is None else None, params[i],
                    prompt_token_ids[i] if prompt_token_ids is not None else None))
        except BaseException:
            for rid in ids:  # leave the engine as it was
                self.abort_request(rid)
            raise
        done: dict[str, RequestOutput] = {}
        while len(done) < n:
            for out in self.step():
                done[out.request_id] = out
        if self.graphs is not None and self.graphs.pending and not self.scheduler.has_work():
            self.graphs.capture_pending()          # off the serving path: every request is done
        return [done[rid] for rid in ids]

    def abort_request(self, request_id: str) -> None:
        seq = self._seqs.pop(request_id, None)
        if seq is None:
            return
        if seq in self.scheduler.running:
            self.scheduler.finish(seq)
        elif seq in self.scheduler.waiting:
            self.scheduler.waiting.remove(seq)
            self.block_manager.free_seq(seq)

    def kv_connector_stats(self) -> dict:
        """Counters of the tierd connector (empty without kv_store)."""
        return dict(self.connector.stats) if self.connector is not None else {}

    def close(self) -> None:
        """Finish handing blocks to the store and stop the connector; let go of the captured
        decode graphs (their memory returns with the engine's)."""
        if self.connector is not None:
            self.connector.close()
            self.connector = None
        self.graphs = None

    def kv_cache_stats(self) -> dict:
        """Blocks allocated, token slots used, waste = allocated-but-unused slots / allocated."""
        bm = self.block_manager
        allocated = sum(1 for b in bm.blocks if b.ref_count > 0)
        used = sum(s.num_computed - self.block_size * s.block_table.count(-1) for s in self.scheduler.running)
        shared = sum(b.ref_count - 1 for b in bm.blocks if b.ref_count > 1)
        slots = allocated * self.block_size
        used_slots = min(slots, used - shared * self.block_size) if used else 0
        return {"num_blocks": len(bm.blocks), "blocks_allocated": allocated, "blocks_free": bm.num_free,
                "token_slots_allocated": slots, "token_slots_used": used_slots,
                "waste": (slots - used_slots) / slots if slots else 0.0,
                "prefix_cache_blocks": len(bm.cached), "prefix_cache_hits": bm.hits,
                "preemptions": self.scheduler.preemptions, "fp8": self.fp8,
                "kv_cache_dtype": self.kv_cache_dtype, "kv_block_bytes": self.kv_block_bytes,
                "kv_scales": self.kv_scale_source, "evicted_blocks": self.evicted_blocks}
