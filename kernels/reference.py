"""Torch references for every kernel in this package: what the CPU path runs, and the ground
truth each CUDA kernel is checked against before it is used.

Layouts (shared with `tierd.engine.attention`): per-layer caches (num_blocks, block_size,
kv_heads, head_dim); fp8 caches hold float8_e4m3fn with one scale per tensor (value = stored *
scale); a tier block is [num_layers, 2, ratio * block_size, kv_heads, head_dim].
"""

from __future__ import annotations

from collections.abc import Sequence
from ctypes import memmove as _memmove

import torch

from tierd.engine.attention import FP8_MAX, dequantize_fp8, quantize_fp8, reshape_and_cache  # noqa: F401
from tierd.engine.model import add_rms_norm, rotary, silu_mul  # noqa: F401

PARTITION = 512  # tokens per split-K partition of paged_attention v2


def paged_attention_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                           k_scale: float = 1.0, v_scale: float = 1.0, *, version: str | None = None,
                           max_seq_len: int | None = None, splits: int | None = None) -> torch.Tensor:
    """Decode attention: q (B, heads, d) over each sequence's first seq_lens[b] cached tokens.
    Computed in float32 and returned in q's dtype. Reads nothing past a sequence's length.
    (`version`, `max_seq_len` and `splits` steer the kernels; the reference has one way.)"""
    B, heads, d = q.shape
    _, bs, kv_heads, _ = k_cache.shape
    group = heads // kv_heads
    out = torch.empty_like(q)
    for b in range(B):
        n = int(seq_lens[b])
        blocks = block_tables[b, :(n + bs - 1) // bs].long()
        k = k_cache[blocks].reshape(-1, kv_heads, d)[:n]
        v = v_cache[blocks].reshape(-1, kv_heads, d)[:n]
        if k_cache.dtype == torch.float8_e4m3fn:
            k, v = k.float() * k_scale, v.float() * v_scale
        k, v = k.float(), v.float()
        qh = q[b].float().view(kv_heads, group, d)
        scores = torch.einsum("kgd,nkd->kgn", qh, k) * scale
        p = torch.softmax(scores, dim=-1)
        out[b] = torch.einsum("kgn,nkd->kgd", p, v).reshape(heads, d).to(q.dtype)
    return out


def dense_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
             ctx: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each sequence's first `ctx` cached keys and values gathered into dense (B, kv_heads, ctx,
    d) tensors, contiguous: the KV an engine without paging holds."""
    B = block_tables.shape[0]
    _, bs, kvh, d = k_cache.shape
    per = -(-ctx // bs)
    tables = block_tables[:, :per].long()
    return tuple(c[tables].reshape(B, per * bs, kvh, d)[:, :ctx].transpose(1, 2).contiguous()
                 for c in (k_cache, v_cache))


def fused_sdpa_decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """One query per sequence over dense KV through torch's fused attention kernel: q (B, heads,
    d); k, v (B, kv_heads, ctx, d) from `dense_kv`, every sequence ctx tokens long. In the 4-D
    (batch, heads, length, d) layout the fused kernels take, with no mask (one query at the end
    of the context attends to all of it: nothing to mask, so not is_causal either, which for
    one query would keep the first key alone); GQA by `enable_gqa` where torch's flash kernel
    takes it, else the kv heads repeated. On CUDA only the fused backends may run (flash,
    memory-efficient, cuDNN): inputs none of them takes raise instead of falling back to the
    math path (which is no fused kernel). Returns (B, heads, d)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    heads, kvh = q.shape[1], k.shape[1]
    gqa = heads != kvh
    if gqa and q.device.type == "cuda":
        from tierd.engine.attention import _flash_takes_gqa
        if not _flash_takes_gqa(q.device, q.dtype, heads, kvh, q.shape[-1]):
            k, v = (x.repeat_interleave(heads // kvh, dim=1) for x in (k, v))
            gqa = False
    fused = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION] \
        if q.device.type == "cuda" else [SDPBackend.FLASH_ATTENTION]
    with sdpa_kernel(fused):
        out = torch.nn.functional.scaled_dot_product_attention(q.unsqueeze(2), k, v, scale=scale, enable_gqa=gqa)
    return out.squeeze(2)


def gather_blocks(k_caches: Sequence[torch.Tensor], v_caches: Sequence[torch.Tensor],
                  block_ids: torch.Tensor, slots: Sequence[torch.Tensor]) -> None:
    """Copy engine blocks into tier slots. k_caches, v_caches: per layer (num_blocks, block_size,
    kv_heads, head_dim), contiguous or views of a cache laid out otherwise; block_ids: (n_tier,
    ratio) engine block per part of each tier block (-1: leave that part of the slot as it is);
    slots[t]: the tier block's slot, any tensor of its bytes (viewed as [layers, 2, ratio,
    block_size, kv_heads, head_dim]); with one layer's caches, that layer's part of a slot.
    v_caches None: latent caches (MLA's, one row per token as a single "head"), one plane:
    slots are [layers, 1, ratio, block_size, 1, latent]."""
    _copy_blocks(k_caches, v_caches, block_ids, slots, to_slots=True)


def scatter_blocks(k_caches: Sequence[torch.Tensor], v_caches: Sequence[torch.Tensor],
                   block_ids: torch.Tensor, slots: Sequence[torch.Tensor]) -> None:
    """The reverse of gather_blocks: tier slots into engine blocks (-1 parts are skipped)."""
    _copy_blocks(k_caches, v_caches, block_ids, slots, to_slots=False)


def _copy_blocks(k_caches, v_caches, block_ids, slots, *, to_slots: bool) -> None:
    if k_caches[0].element_size() == 1 and k_caches[0].dtype != torch.uint8:   # fp8: copy as bytes
        k_caches = [c.view(torch.uint8) for c in k_caches]
        v_caches = None if v_caches is None else [c.view(torch.uint8) for c in v_caches]
    planes = ((0, k_caches),) if v_caches is None else ((0, k_caches), (1, v_caches))
    layers, ratio = len(k_caches), block_ids.shape[1]
    unit = k_caches[0].shape[1:]
    device = k_caches[0].device
    # host caches laid out as (num_blocks, *unit), contiguous: plain memory moves, one per run of
    # consecutive engine blocks, layer and plane (a tensor copy per piece costs several times more)
    flat = device.type == "cpu" and all(c.is_contiguous() for _, cs in planes for c in cs)
    n_blocks = k_caches[0].shape[0]
    if block_ids.numel() and int(block_ids.max()) >= n_blocks:      # checked before any copy
        raise IndexError(f"engine block id {int(block_ids.max())} out of range 0..{n_blocks - 1}")
    for t, row in enumerate(block_ids.tolist()):
        parts = [r for r in range(ratio) if row[r] >= 0]
        if not parts:
            continue
        s = _slot_view(slots[t], layers, ratio, unit, k_caches[0].dtype, len(planes))
        if flat and s.device.type == "cpu" and s.is_contiguous():
            _move_runs(planes, row, parts, s, to_slots)
            continue
        whole = len(parts) == ratio
        ids = [row[r] for r in parts]
        if whole and ids == list(range(ids[0], ids[0] + ratio)):
            idx = slice(ids[0], ids[0] + ratio)        # consecutive blocks: plain copies
        else:
            idx = torch.tensor(ids, dtype=torch.long, device=device)
        for layer in range(layers):
            for kv, caches in planes:
                cache = caches[layer]
                if to_slots and whole:
                    s[layer, kv].copy_(cache[idx])
                elif to_slots:
                    s[layer, kv, parts] = cache[idx].to(s.device)
                elif whole:
                    cache[idx] = s[layer, kv].to(device)
                else:
                    cache[idx] = s[layer, kv, parts].to(device)


def _move_runs(planes, row: list[int], parts: list[int], s: torch.Tensor, to_slots: bool) -> None:
    """`_copy_blocks` for contiguous host tensors: ctypes.memmove per run of parts whose engine
    blocks are consecutive, per layer and plane. Every block id is range-checked first (a
    tensor index would raise; a memory move must not go past the cache)."""
    cache0 = planes[0][1][0]
    n_blocks = cache0.shape[0]
    unit_bytes = cache0[0].numel() * cache0.element_size()
    if min(row[r] for r in parts) < 0 or max(row[r] for r in parts) >= n_blocks:
        raise IndexError(f"engine block id out of range 0..{n_blocks - 1} in {row}")
    runs, start = [], parts[0]
    for a, b in zip(parts, parts[1:] + [None]):
        if b is None or b != a + 1 or row[b] != row[a] + 1:
            runs.append((start, a - start + 1))
            start = b
    n_planes, ratio = s.shape[1], s.shape[2]
    base = s.data_ptr()
    for layer in range(s.shape[0]):
        for kv, caches in planes:
            cache_base = caches[layer].data_ptr()
            for r0, n in runs:
                slot_at = base + ((layer * n_planes + kv) * ratio + r0) * unit_bytes
                cache_at = cache_base + row[r0] * unit_bytes
                if to_slots:
                    _memmove(slot_at, cache_at, n * unit_bytes)
                else:
                    _memmove(cache_at, slot_at, n * unit_bytes)


def _slot_view(slot: torch.Tensor, layers: int, ratio: int, unit: torch.Size, dtype: torch.dtype,
               planes: int = 2) -> torch.Tensor:
    return slot.reshape(-1).view(torch.uint8).view(dtype).view(layers, planes, ratio, *unit)


def paged_attention_int4_decode(q: torch.Tensor, k_q: torch.Tensor, k_min: torch.Tensor, k_step: torch.Tensor,
                                v_q: torch.Tensor, v_min: torch.Tensor, v_step: torch.Tensor, k_own: torch.Tensor,
                                block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float, *,
                                max_seq_len: int | None = None) -> torch.Tensor:
    """Decode attention over an int4 cache (`tierd.engine.int4.Int4LayerCache`'s tensors): q
    (B, heads, d); each sequence's last block's keys from k_own[b] (block_size, kv_heads, d), in
    full precision as its query sees them; earlier blocks' keys dequantized per channel, values
    per token group (value = min + q * step). float32 math, returned in q's dtype.
    (`max_seq_len` steers the kernel; the reference has one way.)"""
    from tierd.engine.int4 import unpack
    B, heads, d = q.shape
    bs, kv_heads = v_q.shape[1], v_q.shape[2]
    group = d // v_min.shape[-1]
    g = heads // kv_heads
    out = torch.empty_like(q)
    for b in range(B):
        n = int(seq_lens[b])
        nb = (n + bs - 1) // bs
        ids = block_tables[b, :nb].long()
        k = unpack(k_q[ids], dim=1).float() * k_step[ids].float() + k_min[ids].float()     # (nb, bs, h, d)
        k[nb - 1] = k_own[b].float()
        vq = unpack(v_q[ids], dim=-1).float().view(nb, bs, kv_heads, d // group, group)
        v = (vq * v_step[ids].float().unsqueeze(-1) + v_min[ids].float().unsqueeze(-1)).view(nb, bs, kv_heads, d)
        k, v = k.reshape(-1, kv_heads, d)[:n], v.reshape(-1, kv_heads, d)[:n]
        qh = q[b].float().view(kv_heads, g, d)
        p = torch.softmax(torch.einsum("kgd,nkd->kgn", qh, k) * scale, dim=-1)
        out[b] = torch.einsum("kgn,nkd->kgd", p, v).reshape(heads, d).to(q.dtype)
    return out
