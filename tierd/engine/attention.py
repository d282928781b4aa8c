"""Paged-attention references in torch: the CPU path of the engine and the ground truth that
every CUDA kernel in `tierd.kernels` is checked against.

Cache layout per layer: k_cache, v_cache of shape (num_blocks, block_size, num_kv_heads,
head_dim); a token's slot is block_id * block_size + offset. With fp8 the caches hold
float8_e4m3fn and one scale per tensor (value = stored * scale).
"""

from __future__ import annotations

import functools

import torch

FP8_MAX = 448.0  # largest finite float8_e4m3fn


def quantize_fp8(x: torch.Tensor, scale: float) -> torch.Tensor:
    """Saturating per-tensor fp8 e4m3 quantisation: round(x / scale) clamped to +-448."""
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)


def dequantize_fp8(x: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    return (x.float() * scale).to(dtype)


def reshape_and_cache(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                      v_cache: torch.Tensor, slot_mapping: torch.Tensor,
                      k_scale: float = 1.0, v_scale: float = 1.0) -> None:
    """Write key/value (T, kv_heads, head_dim) into the caches at slot_mapping (T,); slot -1 is
    padding and is skipped. The caches are (num_blocks, block_size, kv_heads, head_dim), either
    contiguous or views in another layout."""
    nb, bs, h, d = k_cache.shape
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    k, v = key[keep], value[keep]
    if k_cache.dtype == torch.float8_e4m3fn:
        k, v = quantize_fp8(k, k_scale), quantize_fp8(v, v_scale)
    if k_cache.is_contiguous() and v_cache.is_contiguous():
        k_cache.view(nb * bs, h, d)[slots] = k.to(k_cache.dtype)
        v_cache.view(nb * bs, h, d)[slots] = v.to(v_cache.dtype)
    else:     # strided views of a cache laid out otherwise (K and V in one tensor, head-major)
        blocks, offsets = slots // bs, slots % bs
        k_cache[blocks, offsets] = k.to(k_cache.dtype)
        v_cache[blocks, offsets] = v.to(v_cache.dtype)


def gather_kv(cache: torch.Tensor, block_table: torch.Tensor, length: int, scale: float,
              dtype: torch.dtype) -> torch.Tensor:
    """(length, kv_heads, head_dim) of one sequence from its block table."""
    bs = cache.shape[1]
    n_blocks = (length + bs - 1) // bs
    out = cache[block_table[:n_blocks]].reshape(-1, *cache.shape[2:])[:length]
    if cache.dtype == torch.float8_e4m3fn:
        return dequantize_fp8(out, scale, dtype)
    return out.to(dtype)


class AttentionMetadata:
    """Per-step layout of a packed batch, built once and shared by every layer.

    `seqs`: per sequence (query_start, query_len, context_len, block_table (n_blocks,)), where
    context_len counts every token whose K/V is in the cache, the new ones included (tables on
    the host; they are moved to `device` once here). Sequences with one new token (decodes) are
    also gathered into one batch in the paged decode kernel's shape: `dec_rows` (B,) rows of q,
    `dec_tables` (B, max_blocks) int32 block tables, `dec_lens` (B,) int32 lengths, on `device`,
    and `dec_max_len` on the host (so that no step asks the device for it)."""

    def __init__(self, seqs: list[tuple[int, int, int, torch.Tensor]], block_size: int,
                 device: torch.device | str = "cpu"):
        device = torch.device(device)
        self.device = device
        moved = [(q0, n, ctx, t.to(device, non_blocking=True)) for q0, n, ctx, t in seqs]
        self.all = moved
        self.seqs = [s for s in moved if s[1] > 1]
        dec = [s for s in seqs if s[1] == 1]
        self.dec_rows = self.dec_tables = self.dec_lens = None
        self.dec_max_len = 0
        if dec:
            max_blocks = max(len(s[3]) for s in dec)
            tables = torch.zeros(len(dec), max_blocks, dtype=torch.int32)
            for i, s in enumerate(dec):
                tables[i, :len(s[3])] = s[3]
            self.dec_max_len = max(s[2] for s in dec)
            self.dec_tables = tables.to(device, non_blocking=True)
            self.dec_lens = torch.tensor([s[2] for s in dec], dtype=torch.int32).to(device, non_blocking=True)
            self.dec_rows = torch.tensor([s[0] for s in dec]).to(device, non_blocking=True)


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                     seq_lens: torch.Tensor, scale: float, k_scale: float = 1.0, v_scale: float = 1.0, *,
                     max_seq_len: int, sliding_window: int | None = None) -> torch.Tensor:
    """Decode attention of one query per sequence, batched: q (B, heads, d) over each
    sequence's first seq_lens[b] cached tokens (block_tables (B, max_blocks)). The paged decode
    kernel's arguments (`tierd.kernels.paged_attention_decode`), run with torch ops on any
    device. Returns (B, heads, d)."""
    nb, bs, kvh, d = k_cache.shape
    B, heads, _ = q.shape
    nblk = -(-max_seq_len // bs)
    tables = block_tables[:, :nblk].long()
    # whole blocks at a time: one copy of a block's rows per table entry, not one per token
    k = k_cache[tables].view(B, nblk * bs, kvh, d)                     # (B, ctx, kvh, d)
    v = v_cache[tables].view(B, nblk * bs, kvh, d)
    if k_cache.dtype == torch.float8_e4m3fn:
        k, v = dequantize_fp8(k, k_scale, q.dtype), dequantize_fp8(v, v_scale, q.dtype)
    elif k.dtype != q.dtype:
        k, v = k.to(q.dtype), v.to(q.dtype)
    pos = torch.arange(nblk * bs, device=q.device).unsqueeze(0)        # (1, ctx)
    lens = seq_lens.long().unsqueeze(1)
    keep = pos < lens
    if sliding_window is not None:
        keep = keep & (pos > (lens - 1) - sliding_window)
    # slots past a length hold whatever the cache holds there (NaN included): 0 * NaN and
    # NaN - inf are NaN, so they are zeroed (in the gathered copies), not only masked
    drop = ~keep[:, :, None, None]
    k.masked_fill_(drop, 0)
    v.masked_fill_(drop, 0)
    out = torch.nn.functional.scaled_dot_product_attention(
        q.unsqueeze(2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=keep[:, None, None, :], scale=scale,
        enable_gqa=kvh != heads)                                        # (B, heads, 1, d)
    return out.squeeze(2)


def prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_start: int, scale: float,
                      sliding_window: int | None = None, *, lower_right: bool | None = None) -> torch.Tensor:
    """Causal attention of queries q (n, heads, d) at positions q_start.. over keys/values
    (ctx, kv_heads, d) through torch's fused scaled_dot_product_attention (GQA by the kv heads),
    in the 4-D (batch, heads, length, d) layout its fused kernels (flash, memory-efficient,
    cuDNN) take, in the inputs' dtype. Returns (n, heads, d).

    A whole prompt is plain causal attention. Queries after a cached prefix end the context
    (q_start = ctx - n): on a GPU, a lower-right causal bias, which torch runs in its fused
    kernels with no mask materialised (`lower_right`; default: on devices other than the CPU,
    whose fused kernel takes the boolean mask directly). A sliding window, or queries that do
    not end the context, use a boolean mask."""
    n, heads, d = q.shape
    ctx, kvh, _ = k.shape
    gqa = kvh != heads
    qt, kt, vt = (x.transpose(0, 1).unsqueeze(0) for x in (q, k, v))   # (1, heads, len, d)
    sdpa = torch.nn.functional.scaled_dot_product_attention
    if sliding_window is None and q_start == 0 and ctx == n:
        out = sdpa(qt, kt, vt, is_causal=True, scale=scale, enable_gqa=gqa)
        return out[0].transpose(0, 1)
    if lower_right is None:
        lower_right = q.device.type != "cpu"
    if lower_right and sliding_window is None and q_start == ctx - n:
        from torch.nn.attention.bias import causal_lower_right
        if gqa and q.device.type == "cuda" and not _flash_takes_gqa(q.device, q.dtype, heads, kvh, d):
            # (the bias's memory-efficient kernel takes no GQA: the kv heads, repeated)
            kt, vt = (x.repeat_interleave(heads // kvh, dim=1) for x in (kt, vt))
            gqa = False
        out = sdpa(qt, kt, vt, attn_mask=causal_lower_right(n, ctx), scale=scale, enable_gqa=gqa)
        return out[0].transpose(0, 1)
    qpos = torch.arange(q_start, q_start + n, device=q.device).unsqueeze(1)
    kpos = torch.arange(ctx, device=q.device).unsqueeze(0)
    allowed = kpos <= qpos
    if sliding_window is not None:
        allowed = allowed & (kpos > qpos - sliding_window)
    out = sdpa(qt, kt, vt, attn_mask=allowed, scale=scale, enable_gqa=gqa)
    return out[0].transpose(0, 1)


@functools.lru_cache(maxsize=64)
def _flash_takes_gqa(device: torch.device, dtype: torch.dtype, heads: int, kv_heads: int, d: int) -> bool:
    """Whether torch's flash kernel runs (1, heads, len, d) queries over fewer kv heads on
    `device` (asked once per shape, not per layer and step)."""
    try:
        q = torch.empty((1, heads, 2, d), dtype=dtype, device=device)
        k = torch.empty((1, kv_heads, 2, d), dtype=dtype, device=device)
        params = torch.backends.cuda.SDPAParams(q, k, k, None, 0.0, False, True)
        return bool(torch.backends.cuda.can_use_flash_attention(params))
    except (AttributeError, RuntimeError, TypeError):
        return False


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    meta: AttentionMetadata, scale: float, k_scale: float = 1.0,
                    v_scale: float = 1.0, sliding_window: int | None = None, decode=None,
                    new_kv: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """Attention for a batch of sequences whose new tokens are packed in q (T, heads, d);
    the new tokens of a sequence are the last query_len of its context. Prefills run through
    torch's fused attention; decodes in one batch through `decode` (the paged decode kernel's
    signature, e.g. `tierd.kernels.paged_attention_decode`; by default, and for a sliding
    window, `decode_attention`). new_kv: this step's keys and values (T, kv_heads, d), just
    written to the cache: a sequence whose whole context is new reads them instead of gathering
    the same values back (unless the cache holds them in another dtype). Returns (T, heads, d)."""
    out = torch.empty_like(q)
    fresh = new_kv is not None and k_cache.dtype == new_kv[0].dtype == q.dtype
    for q0, n, ctx, table in meta.seqs:
        if fresh and ctx == n:
            k, v = new_kv[0][q0:q0 + n], new_kv[1][q0:q0 + n]
        else:
            k = gather_kv(k_cache, table, ctx, k_scale, q.dtype)
            v = gather_kv(v_cache, table, ctx, v_scale, q.dtype)
        out[q0:q0 + n] = prefill_attention(q[q0:q0 + n], k, v, ctx - n, scale, sliding_window)
    if meta.dec_rows is not None:
        qd = q[meta.dec_rows]
        if decode is not None and sliding_window is None:
            out[meta.dec_rows] = decode(qd, k_cache, v_cache, meta.dec_tables, meta.dec_lens, scale,
                                        k_scale, v_scale, max_seq_len=meta.dec_max_len)
        else:
            out[meta.dec_rows] = decode_attention(qd, k_cache, v_cache, meta.dec_tables, meta.dec_lens, scale,
                                                  k_scale, v_scale, max_seq_len=meta.dec_max_len,
                                                  sliding_window=sliding_window)
    return out


def paged_attention_int4(q: torch.Tensor, cache, meta: AttentionMetadata, scale: float,
                         sliding_window: int | None = None) -> torch.Tensor:
    """paged_attention over an int4 cache (`tierd.engine.int4.Int4LayerCache`): a query sees
    its own block's keys in full precision and earlier blocks' dequantized, values dequantized."""
    out = torch.empty_like(q)
    bs = cache.block_size
    for q0, n, ctx, table in meta.all:
        k, k_own, v = cache.gather(table, ctx, q.dtype)
        qs = q[q0:q0 + n]
        heads, d = qs.shape[1], qs.shape[2]
        kvh = k.shape[1]
        qh = qs.view(n, kvh, heads // kvh, d).permute(1, 2, 0, 3)             # (kvh, g, n, d)
        s_other = torch.matmul(qh, k.permute(1, 2, 0).unsqueeze(1)) * scale     # (kvh, g, n, ctx)
        s_own = torch.matmul(qh, k_own.permute(1, 2, 0).unsqueeze(1)) * scale
        qpos = torch.arange(ctx - n, ctx).unsqueeze(1)
        kpos = torch.arange(ctx).unsqueeze(0)
        scores = torch.where(kpos // bs == qpos // bs, s_own, s_other)
        mask = kpos > qpos
        if sliding_window is not None:
            mask = mask | (kpos <= qpos - sliding_window)
        probs = torch.softmax(scores.masked_fill(mask, float("-inf")).float(), dim=-1).to(q.dtype)
        o = torch.matmul(probs, v.permute(1, 0, 2).unsqueeze(1))               # (kvh, g, n, d)
        out[q0:q0 + n] = o.permute(2, 0, 1, 3).reshape(n, heads, d)
    return out


def rotate(x: torch.Tensor, angle_pos: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """RoPE rotation of x (n, heads, d) by positions angle_pos (n,) (negative: backwards)."""
    freqs = angle_pos.float().unsqueeze(1) * inv_freq.unsqueeze(0)
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos().to(x.dtype).unsqueeze(1), emb.sin().to(x.dtype).unsqueeze(1)
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


def streaming_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        meta: AttentionMetadata, scale: float, sinks: int, window: int | None,
                        inv_freq: torch.Tensor | None, k_scale: float = 1.0, v_scale: float = 1.0,
                        mass: list | None = None) -> torch.Tensor:
    """Attention over the blocks a sequence still holds (table entries -1 were freed).

    StreamingLLM (`window` set): a query at position p sees the first `sinks` tokens and the
    last `window` tokens (p - window, p], at their positions within that cache (sinks 0..S-1,
    the window right after them). Keys are cached roped at their own positions, so the window
    keeps its distances to the query; only the sinks move closer, by delta = p - window + 1 - S,
    which is applied to the query (R(-delta) q . k = q . R(delta) k).

    Eviction (`window` None): causal attention over the held blocks at their own positions;
    `mass[i]` (per sequence, a tensor with one entry per block-table entry) gains each held
    block's attention mass, averaged over heads and summed over this step's queries."""
    out = torch.empty_like(q)
    bs = k_cache.shape[1]
    dev = q.device
    for si, (q0, n, ctx, table) in enumerate(meta.all):
        held = (table[: (ctx + bs - 1) // bs] >= 0).nonzero().flatten()
        kpos = (held.unsqueeze(1) * bs + torch.arange(bs, device=dev)).flatten()
        valid = kpos < ctx
        kpos = kpos[valid]
        k = k_cache[table[held]].reshape(-1, *k_cache.shape[2:])[valid]
        v = v_cache[table[held]].reshape(-1, *v_cache.shape[2:])[valid]
        if k_cache.dtype == torch.float8_e4m3fn:
            k, v = dequantize_fp8(k, k_scale, q.dtype), dequantize_fp8(v, v_scale, q.dtype)
        else:
            k, v = k.to(q.dtype), v.to(q.dtype)
        qs = q[q0:q0 + n]
        heads, d = qs.shape[1], qs.shape[2]
        kvh = k.shape[1]
        qpos = torch.arange(ctx - n, ctx, device=dev)
        qh = qs.view(n, kvh, heads // kvh, d).permute(1, 2, 0, 3)               # (kvh, g, n, d)
        kt = k.permute(1, 2, 0).unsqueeze(1)                                    # (kvh, 1, d, m)
        qp, kp = qpos.unsqueeze(1), kpos.unsqueeze(0)
        mask = kp > qp
        if window is not None:
            delta = (qpos - window + 1 - sinks).clamp(min=0)
            q_sink = rotate(qs, -delta, inv_freq)                               # sinks closer by delta
            qsh = q_sink.view(n, kvh, heads // kvh, d).permute(1, 2, 0, 3)
            is_sink = (kpos < sinks).view(1, 1, 1, -1)
            scores = torch.where(is_sink, torch.matmul(qsh, kt), torch.matmul(qh, kt)) * scale
            mask = mask | ((kp <= qp - window) & (kp >= sinks))
        else:
            scores = torch.matmul(qh, kt) * scale
        probs = torch.softmax(scores.masked_fill(mask, float("-inf")).float(), dim=-1)
        if mass is not None:    # (kvh, g, n, m) -> per key, averaged over heads -> per block
            per_key = probs.sum(dim=2).mean(dim=(0, 1))
            mass[si].index_add_(0, (kpos // bs).cpu(), per_key.to(mass[si].dtype).cpu())
        o = torch.matmul(probs.to(q.dtype), v.permute(1, 0, 2).unsqueeze(1))
        out[q0:q0 + n] = o.permute(2, 0, 1, 3).reshape(n, heads, d)
    return out
