"""Random inputs for the kernels' self-checks and tests: each `*_case(device, fn, ...)` builds
seeded inputs on `device`, runs `fn` (a kernel or its reference) and returns its outputs."""

from __future__ import annotations

import itertools

import torch

from .reference import quantize_fp8


def _gen(seed: int, device="cpu") -> torch.Generator:
    return torch.Generator(device=device).manual_seed(seed)


def poisoned_caches(num_blocks: int, block_size: int, kv_heads: int, head_dim: int, dtype: torch.dtype,
                    block_tables: torch.Tensor, seq_lens: torch.Tensor, *, seed: int = 0,
                    fp8_scales: tuple[float, float] | None = None, device="cpu"):
    """Random K/V caches (made on `device`) whose slots past each sequence's length in its used
    blocks hold NaN, so any read past a length shows in the output. With fp8_scales the caches
    are quantised."""
    g = _gen(seed, device)
    shape = (num_blocks, block_size, kv_heads, head_dim)
    k = torch.randn(shape, generator=g, dtype=torch.float32, device=device)
    v = torch.randn(shape, generator=g, dtype=torch.float32, device=device)
    for b in range(block_tables.shape[0]):
        n = int(seq_lens[b])
        last = (n - 1) // block_size
        blk, off = int(block_tables[b, last]), n - last * block_size
        k[blk, off:] = float("nan")
        v[blk, off:] = float("nan")
        # block table entries past the length point at blocks that are all NaN
        for j in range(last + 1, block_tables.shape[1]):
            k[int(block_tables[b, j])] = float("nan")
            v[int(block_tables[b, j])] = float("nan")
    if fp8_scales is not None:
        return quantize_fp8(k, fp8_scales[0]), quantize_fp8(v, fp8_scales[1])
    return k.to(dtype), v.to(dtype)


def decode_inputs(device, *, batch: int, heads: int, kv_heads: int, head_dim: int, block_size: int,
                  num_blocks: int, max_len: int, dtype: torch.dtype, fp8: bool = False, seed: int = 0,
                  full: bool = False):
    """vLLM-style decode case: `batch` sequences of random lengths, the last at max_len (`full`:
    every one at max_len); random block tables over `num_blocks` blocks (distinct across
    sequences), unused slots NaN."""
    g = _gen(seed)
    lens = torch.randint(1, max_len + 1, (batch,), generator=g)
    lens[-1] = max_len
    if full:
        lens[:] = max_len
    per_seq = (max_len + block_size - 1) // block_size
    if batch * per_seq > num_blocks:
        raise ValueError("not enough blocks for distinct block tables")
    tables = torch.randperm(num_blocks, generator=g)[:batch * per_seq].view(batch, per_seq).to(torch.int32)
    scales = (0.05, 0.07) if fp8 else None
    k, v = poisoned_caches(num_blocks, block_size, kv_heads, head_dim, dtype, tables, lens, seed=seed + 1,
                           fp8_scales=scales, device=device)
    q = torch.randn((batch, heads, head_dim), generator=g).to(dtype)
    to = (lambda t: t.to(device))
    return dict(q=to(q), k_cache=to(k), v_cache=to(v), block_tables=to(tables), seq_lens=to(lens.to(torch.int32)),
                scale=head_dim ** -0.5, k_scale=scales[0] if scales else 1.0, v_scale=scales[1] if scales else 1.0)


def attention_case(device, fn):
    outs = []
    for dtype, fp8, version in ((torch.float16, False, "v1"), (torch.float16, True, "v2"),
                                (torch.float32, False, "v2")):
        a = decode_inputs(device, batch=3, heads=8, kv_heads=2, head_dim=64, block_size=16, num_blocks=160,
                          max_len=700, dtype=dtype, fp8=fp8, seed=3)
        outs.append(fn(a["q"], a["k_cache"], a["v_cache"], a["block_tables"], a["seq_lens"], a["scale"],
                       a["k_scale"], a["v_scale"], version=version).float())
    return outs


def triton_attention_case(device, fn):
    """The Triton decode kernel's self-check: half, bfloat16 and float32 caches, GQA groups of
    4 and 1, one context span and several (split-KV), a head size that is no power of two, a
    head-major cache view, NaN in every slot past a length."""
    outs = []
    for dtype, heads, kv_heads, head_dim, splits, layout in (
            (torch.float16, 8, 2, 128, None, "contiguous"), (torch.bfloat16, 8, 2, 64, 4, "b2hnd"),
            (torch.float16, 4, 4, 80, 1, "contiguous"), (torch.float32, 8, 2, 64, 3, "contiguous")):
        if dtype == torch.bfloat16 and torch.device(device).type == "cpu":
            dtype = torch.float16   # (Triton's interpreter computes bfloat16 wrongly: a GPU checks it)
        a = decode_inputs(device, batch=3, heads=heads, kv_heads=kv_heads, head_dim=head_dim, block_size=16,
                          num_blocks=160, max_len=700, dtype=dtype, seed=head_dim + heads)
        k, v = a["k_cache"], a["v_cache"]
        if layout != "contiguous":
            _, k, v = cache_views(layout, k.shape[0], 16, kv_heads, head_dim,
                                  lambda shape: torch.empty(shape, dtype=dtype, device=device))
            k.copy_(a["k_cache"])
            v.copy_(a["v_cache"])
        outs.append(fn(a["q"], k, v, a["block_tables"], a["seq_lens"], a["scale"], max_seq_len=700,
                       splits=splits).float())
    return outs


def triton_decode_grid(dtypes=(torch.float32, torch.float16, torch.bfloat16), *, every: int = 1):
    """Shapes the Triton decode kernel is checked over (tests/test_triton.py: on a GPU, and a
    small part under the interpreter): (dtype, heads, kv_heads, head_dim, block_size, splits,
    layout), GQA groups of 1, 4 and 8, head sizes up to 256, block sizes up to 128 (pages read
    in tiles smaller than a page where the shared memory would not hold a page's: `tiles`),
    one context span or several, a contiguous and a head-major cache. `every`: each every-th
    shape, in an order that still takes every value of each axis."""
    axes = (dtypes, ((8, 2), (4, 4), (32, 4)), (64, 80, 128, 256), (16, 64, 128), (None, 3),
            ("contiguous", "b2hnd"))
    grid = list(itertools.product(*axes))
    picked = grid[::every]
    for i, axis in enumerate(axes):     # (each value of each axis is in the part)
        missing = set(axis) - {g[i] for g in picked}
        picked += [next(g for g in grid if g[i] == m) for m in missing]
    return [(dt, heads, kvh, d, bs, splits, layout) for dt, (heads, kvh), d, bs, splits, layout in picked]


def run_triton_grid_shape(device, shape, fn, *, batch: int = 3, max_len: int = 300, seed: int = 0):
    """(fn's output, the reference's) for one shape of `triton_decode_grid` on `device`."""
    dtype, heads, kvh, d, bs, splits, layout = shape
    a = decode_inputs(device, batch=batch, heads=heads, kv_heads=kvh, head_dim=d, block_size=bs,
                      num_blocks=batch * -(-max_len // bs) + 4, max_len=max_len, dtype=dtype, seed=seed)
    k, v = a["k_cache"], a["v_cache"]
    if layout != "contiguous":
        _, k, v = cache_views(layout, k.shape[0], bs, kvh, d, lambda s: torch.empty(s, dtype=dtype, device=device))
        k.copy_(a["k_cache"])
        v.copy_(a["v_cache"])
    from . import reference
    args = (a["q"], k, v, a["block_tables"], a["seq_lens"], a["scale"])
    return fn(*args, max_seq_len=max_len, splits=splits), reference.paged_attention_decode(*args)


def cpu_attention_case(device, fn):
    """The C decode attention's self-check: float32 and bfloat16 caches (and queries), GQA, a
    head size and block size that are no multiple of 8, NaN in every slot past a length."""
    outs = []
    for dtype, heads, kv_heads, head_dim, bs in ((torch.float32, 8, 2, 64, 16), (torch.bfloat16, 8, 2, 64, 16),
                                                 (torch.float32, 6, 3, 36, 12), (torch.float32, 4, 4, 128, 32)):
        a = decode_inputs(device, batch=5, heads=heads, kv_heads=kv_heads, head_dim=head_dim, block_size=bs,
                          num_blocks=400, max_len=600, dtype=dtype, seed=head_dim + bs)
        outs.append(fn(a["q"], a["k_cache"], a["v_cache"], a["block_tables"], a["seq_lens"], a["scale"],
                       a["k_scale"], a["v_scale"], max_seq_len=600).float())
    return outs


LAYOUTS = ("contiguous", "2bnhd", "b2hnd", "bhn2d")


def cache_views(layout: str, num_blocks: int, block_size: int, heads: int, head_dim: int, make):
    """(tensors, K view, V view) of one layer's paged cache in `layout`, each view (num_blocks,
    block_size, heads, head_dim) with head_dim contiguous; `make(shape)` creates a tensor.
    contiguous: separate K and V tensors; 2bnhd: one (2, B, N, H, D) tensor; b2hnd: one
    (B, 2, H, N, D) tensor, head-major; bhn2d: one (B, H, N, 2 * D) tensor, K and V side by side."""
    n, h, d = block_size, heads, head_dim
    if layout == "contiguous":
        k, v = make((num_blocks, n, h, d)), make((num_blocks, n, h, d))
        return [k, v], k, v
    if layout == "2bnhd":
        t = make((2, num_blocks, n, h, d))
        return [t], t[0], t[1]
    if layout == "b2hnd":
        t = make((num_blocks, 2, h, n, d))
        return [t], t[:, 0].transpose(1, 2), t[:, 1].transpose(1, 2)
    if layout == "bhn2d":
        t = make((num_blocks, h, n, 2 * d))
        return [t], t[..., :d].transpose(1, 2), t[..., d:].transpose(1, 2)
    if layout == "cpu_attn":    # vLLM's CPU attention: per (block, head) K as (D, N), then V as (N, D)
        t = make((num_blocks, h, 2 * n * d))
        return ([t], t[..., :n * d].view(num_blocks, h, d, n).permute(0, 3, 1, 2),
                t[..., n * d:].view(num_blocks, h, n, d).permute(0, 2, 1, 3))
    if layout == "cpu_amx":     # vLLM's CPU attention, "amx" ISA: K and V in tiles (connectors/vllm_layout.py)
        from tierd.connectors.vllm_layout import amx_views
        t = make((num_blocks, h, 2 * n * d))
        return [t], *amx_views(t, n, d)
    raise ValueError(layout)


def reshape_case(device, fn, *, tokens: int = 37, heads: int = 4, head_dim: int = 64, block_size: int = 16,
                 num_blocks: int = 8, dtype: torch.dtype = torch.float16, fp8: bool = False, seed: int = 5,
                 layout: str = "contiguous"):
    g = _gen(seed)
    # key and value as strided views of a fused qkv projection, as models produce them
    q_heads = 2 * heads
    qkv = torch.randn((tokens, (q_heads + 2 * heads) * head_dim), generator=g).to(dtype).to(device)
    key = qkv[:, q_heads * head_dim:(q_heads + heads) * head_dim].view(tokens, heads, head_dim)
    value = qkv[:, (q_heads + heads) * head_dim:].view(tokens, heads, head_dim)
    slots = torch.randperm(num_blocks * block_size, generator=g)[:tokens]
    slots[::5] = -1                                   # padding tokens
    cache_dtype = torch.float8_e4m3fn if fp8 else dtype
    tensors, k_cache, v_cache = cache_views(layout, num_blocks, block_size, heads, head_dim,
                                            lambda shape: torch.zeros(shape, dtype=cache_dtype, device=device))
    fn(key, value, k_cache, v_cache, slots.to(device), 0.03 if fp8 else 1.0, 0.04 if fp8 else 1.0)
    return tensors


def reshape_self_check(device, fn):
    return [*reshape_case(device, fn), *reshape_case(device, fn, dtype=torch.bfloat16, fp8=True, seed=6),
            *reshape_case(device, fn, layout="b2hnd", seed=12), *reshape_case(device, fn, layout="bhn2d", seed=13)]


def block_copy_case(device, fn, *, scatter: bool, layers: int = 3, ratio: int = 2, block_size: int = 16,
                    kv_heads: int = 2, head_dim: int = 64, num_blocks: int = 24, n_tier: int = 5,
                    dtype: torch.dtype = torch.float16, seed: int = 7, layout: str = "contiguous",
                    latent: bool = False):
    """`latent`: one plane (MLA's caches, a row per token), no V: `fn(ks, None, ...)`."""
    g = _gen(seed)
    tensors, ks, vs = [], [], []
    for _ in range(layers):
        ts, k, v = cache_views(layout, num_blocks, block_size, kv_heads, head_dim,
                               lambda shape: torch.randn(shape, generator=g).to(dtype).to(device))
        tensors += ts
        ks.append(k)
        vs.append(v)
    ids = torch.randperm(num_blocks, generator=g)[:n_tier * ratio].view(n_tier, ratio)
    ids[1, 0] = -1                                    # a part the engine already holds
    unit = block_size * kv_heads * head_dim
    planes = 1 if latent else 2
    slots = [torch.randn((layers * planes * ratio * unit,), generator=g).to(dtype).to(device) for _ in range(n_tier)]
    fn(ks, None if latent else vs, ids, slots)
    return [*tensors, *slots]


def gather_case(device, fn):
    return [*block_copy_case(device, fn, scatter=False), *block_copy_case(device, fn, scatter=False, layout="b2hnd"),
            *block_copy_case(device, fn, scatter=False, kv_heads=1, head_dim=576, latent=True, seed=21)]


def scatter_case(device, fn):
    return [*block_copy_case(device, fn, scatter=True, dtype=torch.bfloat16, seed=8),
            *block_copy_case(device, fn, scatter=True, layout="bhn2d", seed=14),
            *block_copy_case(device, fn, scatter=True, kv_heads=1, head_dim=576, latent=True, seed=22)]


def cpu_gather_case(device, fn):
    """The C block copy's self-check: every layout engines hand over on a CPU (vLLM's CPU
    attention's transposed K among them), 4-, 2- and 1-byte elements, and sizes that are not
    multiples of its 8 x 8 tiles."""
    return [*block_copy_case(device, fn, scatter=False, layout="cpu_attn", dtype=torch.float32, block_size=32),
            *block_copy_case(device, fn, scatter=False, layout="cpu_attn", dtype=torch.bfloat16, seed=31,
                             block_size=12, head_dim=20),
            *block_copy_case(device, fn, scatter=False, layout="cpu_attn", dtype=torch.float8_e4m3fn, seed=32),
            *block_copy_case(device, fn, scatter=False, seed=33),
            *block_copy_case(device, fn, scatter=False, layout="bhn2d", dtype=torch.float32, seed=34),
            *block_copy_case(device, fn, scatter=False, kv_heads=1, head_dim=576, latent=True, seed=35),
            *block_copy_case(device, fn, scatter=False, layout="cpu_amx", dtype=torch.bfloat16, block_size=32,
                             head_dim=96, seed=36),
            *cpu_streamed_cases(device, fn, scatter=False, seed=37)]


def cpu_streamed_cases(device, fn, *, scatter: bool, seed: int):
    """Copies of over a MiB, which the C copy writes with streaming stores: a contiguous cache,
    vLLM's CPU attention (its V rows streamed) and its amx tiles (V lines streamed)."""
    return [*block_copy_case(device, fn, scatter=scatter, layers=2, ratio=2, kv_heads=8, head_dim=128,
                             n_tier=2, dtype=torch.float32, seed=seed),
            *block_copy_case(device, fn, scatter=scatter, layout="cpu_attn", layers=2, block_size=32, kv_heads=8,
                             n_tier=2, dtype=torch.float32, seed=seed + 1),
            *block_copy_case(device, fn, scatter=scatter, layout="cpu_amx", dtype=torch.bfloat16, layers=2,
                             block_size=32, head_dim=128, kv_heads=4, seed=seed + 2)]


def cpu_scatter_case(device, fn):
    return [*block_copy_case(device, fn, scatter=True, layout="cpu_attn", dtype=torch.float32, block_size=32,
                             seed=40),
            *block_copy_case(device, fn, scatter=True, layout="cpu_attn", dtype=torch.float16, seed=41,
                             block_size=12, head_dim=20),
            *block_copy_case(device, fn, scatter=True, layout="cpu_attn", dtype=torch.float8_e4m3fn, seed=42),
            *block_copy_case(device, fn, scatter=True, layout="b2hnd", seed=43),
            *block_copy_case(device, fn, scatter=True, layout="2bnhd", dtype=torch.float32, seed=44),
            *block_copy_case(device, fn, scatter=True, kv_heads=1, head_dim=576, latent=True, seed=45),
            *block_copy_case(device, fn, scatter=True, layout="cpu_amx", dtype=torch.bfloat16, block_size=64,
                             head_dim=32, kv_heads=3, seed=46),
            *cpu_streamed_cases(device, fn, scatter=True, seed=47)]


def quantize_case(device, fn):
    g = _gen(9)
    x = (torch.randn((4099,), generator=g) * 40).to(device)
    return [fn(x, 0.07), fn(x.half(), 0.5), fn(x.bfloat16(), 0.01)]


def dequantize_case(device, fn):
    g = _gen(10)
    x = quantize_fp8(torch.randn((4099,), generator=g) * 100, 1.0).to(device)
    return [fn(x, 0.07, torch.float32), fn(x, 0.5, torch.float16), fn(x, 0.01, torch.bfloat16)]


def int4_inputs(device, *, batch: int = 3, heads: int = 8, kv_heads: int = 2, head_dim: int = 64,
                block_size: int = 16, group: int = 32, max_len: int = 300, dtype: torch.dtype = torch.float16,
                seed: int = 11):
    """An int4 cache filled through the engine's own writer as a decode step leaves it: each of
    `batch` sequences (random lengths, distinct blocks) prefilled but for its last token, then one
    batched write of every last token; and each sequence's last block's keys, exact. Returns the
    kernel's arguments, plus `cache` and the raw keys `k` (per sequence) for engine-side checks."""
    from tierd.engine.int4 import Int4LayerCache
    g = _gen(seed)
    lens = torch.randint(1, max_len + 1, (batch,), generator=g)
    lens[-1] = max_len
    per_seq = (max_len + block_size - 1) // block_size
    num_blocks = batch * per_seq + 3
    tables = torch.randperm(num_blocks, generator=g)[:batch * per_seq].view(batch, per_seq).to(torch.int32)
    cache = Int4LayerCache(num_blocks, block_size, kv_heads, head_dim, group, dtype)
    k_own = torch.zeros((batch, block_size, kv_heads, head_dim), dtype=dtype)
    last_k, last_v, last_slot, raw = [], [], [], []
    for b in range(batch):
        n = int(lens[b])
        k = (torch.randn((n, kv_heads, head_dim), generator=g) * 2).to(dtype)
        v = torch.randn((n, kv_heads, head_dim), generator=g).to(dtype)
        slots = (tables[b].long().repeat_interleave(block_size) * block_size
                 + torch.arange(block_size).repeat(per_seq))[:n]
        if n > 1:
            cache.write(k[:-1], v[:-1], slots[:-1])
        last_k.append(k[-1:])
        last_v.append(v[-1:])
        last_slot.append(slots[-1:])
        raw.append(k)
        last = (n - 1) // block_size
        k_own[b, :n - last * block_size] = k[last * block_size:]
    cache.write(torch.cat(last_k), torch.cat(last_v), torch.cat(last_slot))    # the decode step
    q = torch.randn((batch, heads, head_dim), generator=g).to(dtype)
    to = (lambda t: t.to(device))
    return dict(q=to(q), k_q=to(cache.k_q), k_min=to(cache.k_min), k_step=to(cache.k_step), v_q=to(cache.v_q),
                v_min=to(cache.v_min), v_step=to(cache.v_step), k_own=to(k_own), block_tables=to(tables),
                seq_lens=to(lens.to(torch.int32)), scale=head_dim ** -0.5, cache=cache, k=raw)


def int4_case(device, fn):
    outs = []
    for dtype, group in ((torch.float16, 32), (torch.bfloat16, 16), (torch.float32, 64)):
        a = int4_inputs(device, dtype=dtype, group=group)
        outs.append(fn(a["q"], a["k_q"], a["k_min"], a["k_step"], a["v_q"], a["v_min"], a["v_step"], a["k_own"],
                       a["block_tables"], a["seq_lens"], a["scale"]).float())
    return outs


def _activations(rows: int, width: int, dtype, device, g, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn((rows, width), generator=g) * scale).to(dtype).to(device)


def _of(dtype, cases):
    """The sub-cases of `dtype` (None: all); the fused ops' checks run per dtype."""
    return [c for c in cases if dtype is None or c[0] == dtype]


def norm_case(device, fn, dtype=None):
    """RMSNorm with and without the residual add: float16, bfloat16 and float32 (or `dtype`'s
    alone), hidden sizes that are and are not powers of two (in float32 one of 4,096: a sum of
    squares whose rsqrt a GPU's approximate instruction rounds), rows that are views of a wider
    tensor. Outputs: the normed rows and the residual (the sum, in place)."""
    outs = []
    g = _gen(31)
    for dtype, hidden, rows in _of(dtype, ((torch.float16, 2048, 5), (torch.bfloat16, 576, 3), (torch.float32, 96, 4),
                                           (torch.float32, 4096, 2))):
        if dtype == torch.bfloat16 and torch.device(device).type == "cpu":
            dtype = torch.float16   # (Triton's interpreter computes bfloat16 wrongly: a GPU checks it)
        wide = _activations(rows, hidden + 8, dtype, device, g, 3.0)
        x = wide[:, 4:4 + hidden]
        w = (1 + 0.1 * torch.randn(hidden, generator=g)).to(dtype).to(device)
        res = _activations(rows, hidden, dtype, device, g, 10.0)
        outs += [fn(x, w, 1e-5), fn(x, w, 1e-6, residual=res), res]
    return outs


def rotary_case(device, fn, dtype=None):
    """RoPE in place on queries and keys that are views of one fused projection's rows (GQA),
    positions up to 32K, head sizes 64 and 128. Outputs: the rotated q and k."""
    outs = []
    g = _gen(37)
    for dtype, heads, kv_heads, d in _of(dtype, ((torch.float16, 8, 2, 64), (torch.bfloat16, 4, 4, 128),
                                                 (torch.float32, 8, 1, 64))):
        if dtype == torch.bfloat16 and torch.device(device).type == "cpu":
            dtype = torch.float16
        t = 6
        qkv = _activations(t, (heads + 2 * kv_heads) * d, dtype, device, g, 2.0)
        q = qkv[:, :heads * d].view(t, heads, d)
        k = qkv[:, heads * d:(heads + kv_heads) * d].view(t, kv_heads, d)
        positions = torch.tensor([0, 1, 7, 500, 8191, 32767]).to(device)
        inv = (1.0 / (500000.0 ** (torch.arange(0, d, 2, dtype=torch.float64) / d))).float().to(device)
        fn(q, k, positions, inv)
        outs += [q.clone(), k.clone()]
    return outs


def silu_mul_case(device, fn, dtype=None):
    """silu(gate) * up of a fused gate/up projection's rows: float16, bfloat16, float32, widths
    that are no multiple of the kernel's block."""
    outs = []
    g = _gen(41)
    for dtype, width, rows in _of(dtype, ((torch.float16, 8192, 3), (torch.bfloat16, 1000, 2),
                                          (torch.float32, 2500, 4))):
        if dtype == torch.bfloat16 and torch.device(device).type == "cpu":
            dtype = torch.float16
        outs.append(fn(_activations(rows, 2 * width, dtype, device, g, 4.0)))
    return outs
