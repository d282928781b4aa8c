"""Paged decode attention in Triton: one query token per sequence over its paged KV cache.

Same arguments and result as `reference.paged_attention_decode`. The work is split three ways:
by sequence, by KV head (each program computes every query head of that KV head's GQA group, so
each key and value row is read once for the whole group, in `tl.dot` tiles), and along the
context (split-KV: with few sequences the context is cut into spans run side by side, each with
its own online softmax; a second small kernel merges them by their log-sum-exp). A page's keys
and values are rows of head_dim contiguous elements, loaded whole (16-byte vectors).

Takes float32, float16 and bfloat16 caches in the queries' dtype, any cache layout whose
head_dim is contiguous (K and V views with one set of strides), block sizes that are powers of
two from 16 and head sizes up to 256. Its tiles are bounded by the device's shared memory
(`tiles`: a page is read in tiles of up to block_size tokens, fewer where the smem would not hold
them). Arguments that vary from step to step are not specialised on (`SPLIT_VARYING`): no
recompile while serving. Anything else raises ValueError, and the dispatcher
(`tierd.kernels.decode_attention`) uses the CUDA kernel instead: fp8 caches among them (the CUDA
kernel takes them), and INT4 caches, which have their own op.

Written within what Triton 3.6 accepts. On the CPU it runs only under Triton's interpreter
(`TRITON_INTERPRET=1`), where the tests check it against the reference on small shapes
(float32 and float16: the interpreter computes bfloat16 wrongly, so bfloat16 is checked on a GPU,
by the dispatcher's self-check).
"""

from __future__ import annotations

import functools
import os

import torch

try:
    import triton
    import triton.language as tl
except ImportError:   # the dispatcher then never chooses this kernel
    triton = tl = None

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
MAX_HEAD_DIM = 256


def interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET", "") == "1"


def available() -> bool:
    """Triton is importable and can run here: on a CUDA device, or under its interpreter."""
    return triton is not None and (interpreted() or torch.cuda.is_available())


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def takes(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> str | None:
    """None where this kernel takes these inputs, else why not."""
    if triton is None:
        return "triton is not installed"
    if q.dtype not in DTYPES or k_cache.dtype != q.dtype or v_cache.dtype != q.dtype:
        return f"{k_cache.dtype} cache with {q.dtype} queries"
    _, bs, kvh, d = k_cache.shape
    if bs < 16 or bs & (bs - 1):
        return f"block size {bs} (a power of two from 16)"
    if d > MAX_HEAD_DIM:
        return f"head size {d} (at most {MAX_HEAD_DIM})"
    if q.shape[1] % kvh:
        return f"{q.shape[1]} heads over {kvh} kv heads"
    if k_cache.stride() != v_cache.stride() or k_cache.shape != v_cache.shape or k_cache.stride(-1) != 1:
        return "K and V views need one layout with a contiguous head_dim"
    if q.stride(-1) != 1:
        return "queries need a contiguous head_dim"
    if q.device.type != "cuda" and not interpreted():
        return f"{q.device.type} tensors (Triton runs on CUDA, or under its interpreter)"
    smem = smem_per_block(q.device)
    if tiles(d, bs, q.dtype, smem, q.shape[1] // kvh) is None:
        return f"tiles of head size {d} over {smem} bytes of shared memory"
    return None


@functools.lru_cache(maxsize=16)
def _programs_wanted(device: torch.device) -> int:
    """Programs that keep the device busy: two per streaming multiprocessor."""
    if device.type == "cuda":
        return 2 * torch.cuda.get_device_properties(device).multi_processor_count
    return 8


def plan(batch: int, kv_heads: int, max_seq_len: int, block_size: int, device: torch.device,
         splits: int | None = None) -> tuple[int, int]:
    """(splits, pages per split): enough programs to fill the device, at least one page each."""
    pages = max(1, -(-max_seq_len // block_size))
    if splits is None:
        splits = -(-_programs_wanted(device) // max(1, batch * kv_heads))
    splits = max(1, min(splits, pages))
    per = -(-pages // splits)
    return -(-pages // per), per


STAGES = 2                 # the launches' software-pipelining depth (K and V tiles in flight)
INTERPRETER_SMEM = 101376  # (the interpreter has no shared memory: an sm_86's 99 KiB per block)


def smem_needed(block_h: int, block_d: int, block_n: int, esize: int, stages: int = STAGES) -> int:
    """Shared memory one program of `_decode_split` asks for, as bytes: the operands `tl.dot`
    stages there -- the queries' tile, `stages` K and V tiles (the loop's pipelining) and the
    probabilities' tile, in the cache's dtype -- and the float32 accumulator's tile (layout
    conversions go through shared memory)."""
    return esize * (block_h * block_d + stages * 2 * block_n * block_d + block_h * block_n) + 4 * block_h * block_d


def tiles(head_dim: int, block_size: int, dtype: torch.dtype, smem_bytes: int, group: int = 1):
    """(BLOCK_H, BLOCK_D, BLOCK_N, stages) of `_decode_split` for these inputs within
    `smem_bytes` of shared memory per block, or None where even the smallest tiles do not fit
    (the dispatcher then uses another kernel). BLOCK_N, the tokens of one K/V tile, is the
    largest power of two from 16 up to the block size that fits: a page is read in
    block_size / BLOCK_N tiles; two pipeline stages where they fit, else one."""
    block_h, block_d = max(16, _pow2(group)), max(16, _pow2(head_dim))
    esize = torch.empty((), dtype=dtype).element_size()
    for stages in (STAGES, 1):
        block_n = max(16, _pow2(block_size))
        while block_n > 16 and smem_needed(block_h, block_d, block_n, esize, stages) > smem_bytes:
            block_n //= 2
        if smem_needed(block_h, block_d, block_n, esize, stages) <= smem_bytes:
            return block_h, block_d, block_n, stages
    return None


@functools.lru_cache(maxsize=16)
def smem_per_block(device: torch.device) -> int:
    """Shared memory a program may use on `device` (the opt-in maximum per block)."""
    if device.type != "cuda":
        return INTERPRETER_SMEM
    props = torch.cuda.get_device_properties(device)
    for name in ("shared_memory_per_block_optin", "shared_memory_per_block"):
        v = getattr(props, name, None)
        if v:
            return int(v)
    try:
        idx = device.index if device.index is not None else torch.cuda.current_device()
        return int(triton.runtime.driver.active.utils.get_device_properties(idx)["max_shared_mem"])
    except Exception:  # noqa: BLE001
        return 48 * 1024      # every CUDA device has this much per block


# Arguments that change from step to step (the context's pages per span, the tables' width,
# the spans' strides) are not specialised on (Triton would compile a variant for a value of 1
# and for multiples of 16): one compile per shape, none while serving.
SPLIT_VARYING = ("pages_per_split", "stride_tb", "stride_pb", "stride_ph", "stride_lb", "stride_lh")
MERGE_VARYING = ("n_splits", "stride_pb", "stride_ph", "stride_lb", "stride_lh")

if triton is not None:
    @triton.jit(do_not_specialize=SPLIT_VARYING)
    def _decode_split(q_ptr, k_ptr, v_ptr, tables_ptr, lens_ptr, out_ptr, part_ptr, lse_ptr,
                      stride_qb, stride_qh, stride_kb, stride_kt, stride_kh, stride_tb,
                      stride_ob, stride_oh, stride_pb, stride_ph, stride_ps, stride_lb, stride_lh,
                      pages_per_split, scale, v_scale,
                      GROUP: tl.constexpr, BLOCK_H: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr,
                      BS: tl.constexpr, BLOCK_N: tl.constexpr, DIRECT: tl.constexpr, IEEE: tl.constexpr):
        b = tl.program_id(0)
        kvh = tl.program_id(1)
        s = tl.program_id(2)
        seq_len = tl.load(lens_ptr + b)
        h = tl.arange(0, BLOCK_H)
        d = tl.arange(0, BLOCK_D)
        t = tl.arange(0, BLOCK_N)
        TILES = BS // BLOCK_N     # K/V tiles per page
        hmask = h < GROUP
        dmask = d < D
        heads = kvh * GROUP + h
        q = tl.load(q_ptr + b * stride_qb + heads[:, None] * stride_qh + d[None, :],
                    mask=hmask[:, None] & dmask[None, :], other=0.0)
        first = s * pages_per_split * TILES
        last = tl.minimum(first + pages_per_split * TILES, tl.cdiv(seq_len, BLOCK_N))
        m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_H], tl.float32)
        acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
        for it in range(first, last):             # tile `it`: page it // TILES, its (it % TILES)-th part
            blk = tl.load(tables_ptr + b * stride_tb + it // TILES).to(tl.int64)
            tmask = it * BLOCK_N + t < seq_len
            rows = blk * stride_kb + kvh * stride_kh + ((it % TILES) * BLOCK_N + t)[:, None] * stride_kt + d[None, :]
            kvmask = tmask[:, None] & dmask[None, :]
            k = tl.load(k_ptr + rows, mask=kvmask, other=0.0)     # slots past the length: never read
            v = tl.load(v_ptr + rows, mask=kvmask, other=0.0)
            if IEEE:
                qk = tl.dot(q, tl.trans(k), input_precision="ieee")
            else:
                qk = tl.dot(q, tl.trans(k))
            qk = tl.where(tmask[None, :], qk.to(tl.float32) * scale, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(qk, 1))
            alpha = tl.exp(m_i - m_new)
            pr = tl.exp(qk - m_new[:, None])
            l_i = l_i * alpha + tl.sum(pr, 1)
            if IEEE:
                pv = tl.dot(pr.to(v.dtype), v, input_precision="ieee")
            else:
                pv = tl.dot(pr.to(v.dtype), v)
            acc = acc * alpha[:, None] + pv.to(tl.float32)
            m_i = m_new
        seen = l_i > 0
        o = tl.where(seen[:, None], acc / tl.where(seen, l_i, 1.0)[:, None], 0.0) * v_scale
        omask = hmask[:, None] & dmask[None, :]
        if DIRECT:
            tl.store(out_ptr + b * stride_ob + heads[:, None] * stride_oh + d[None, :],
                     o.to(out_ptr.dtype.element_ty), mask=omask)
        else:
            tl.store(part_ptr + b * stride_pb + heads[:, None] * stride_ph + s * stride_ps + d[None, :], o,
                     mask=omask)
            lse = tl.where(seen, m_i + tl.log(tl.where(seen, l_i, 1.0)), float("-inf"))
            tl.store(lse_ptr + b * stride_lb + heads * stride_lh + s, lse, mask=hmask)

    @triton.jit(do_not_specialize=MERGE_VARYING)
    def _decode_merge(part_ptr, lse_ptr, out_ptr, n_splits,
                      stride_pb, stride_ph, stride_ps, stride_lb, stride_lh, stride_ob, stride_oh,
                      D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr):
        b = tl.program_id(0)
        h = tl.program_id(1)
        s = tl.arange(0, BLOCK_S)
        d = tl.arange(0, BLOCK_D)
        smask = s < n_splits
        lse = tl.load(lse_ptr + b * stride_lb + h * stride_lh + s, mask=smask, other=float("-inf"))
        live = lse > float("-inf")
        m = tl.max(tl.where(live, lse, -3.0e38), 0)
        w = tl.where(live, tl.exp(lse - m), 0.0)
        parts = tl.load(part_ptr + b * stride_pb + h * stride_ph + s[:, None] * stride_ps + d[None, :],
                        mask=(smask & live)[:, None] & (d < D)[None, :], other=0.0)
        total = tl.sum(w, 0)
        o = tl.sum(parts * w[:, None], 0) / tl.where(total > 0, total, 1.0)
        tl.store(out_ptr + b * stride_ob + h * stride_oh + d, o.to(out_ptr.dtype.element_ty), mask=d < D)


def _launch(kernel, grid, *args, **kwargs) -> None:
    """Every launch of this module's kernels (the boundary where the tests inject a failure)."""
    kernel[grid](*args, **kwargs)


def paged_attention_decode(q, k_cache, v_cache, block_tables, seq_lens, scale: float,
                           k_scale: float = 1.0, v_scale: float = 1.0, *, version: str | None = None,
                           max_seq_len: int | None = None, splits: int | None = None) -> torch.Tensor:
    """Decode attention (see the module's docstring); ValueError for inputs it does not take.
    `version` is the CUDA kernel's and ignored; `splits` fixes the number of context spans."""
    why = takes(q, k_cache, v_cache)
    if why is not None:
        raise ValueError(why)
    b, heads, d = q.shape
    _, bs, kvh, _ = k_cache.shape
    group = heads // kvh
    tables = block_tables.to(device=q.device, dtype=torch.int32).contiguous()
    lens = seq_lens.to(device=q.device, dtype=torch.int32).contiguous()
    if max_seq_len is None:
        max_seq_len = int(lens.max()) if b else 0
    out = torch.empty((b, heads, d), dtype=q.dtype, device=q.device)
    if b == 0:
        return out
    n_splits, per = plan(b, kvh, max_seq_len, bs, q.device, splits)
    block_h, block_d, block_n, stages = tiles(d, bs, q.dtype, smem_per_block(q.device), group)
    direct = n_splits == 1
    if direct:
        part = lse = out    # (unused)
        part_strides, lse_strides = (0, 0, 0), (0, 0)
    else:
        part = torch.empty((b, heads, n_splits, d), dtype=torch.float32, device=q.device)
        lse = torch.empty((b, heads, n_splits), dtype=torch.float32, device=q.device)
        part_strides, lse_strides = part.stride()[:3], lse.stride()[:2]
    _launch(_decode_split, (b, kvh, n_splits),
            q, k_cache, v_cache, tables, lens, out, part, lse,
            q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), tables.stride(0),
            out.stride(0), out.stride(1), *part_strides, *lse_strides,
            per, float(scale) * float(k_scale), float(v_scale),
            GROUP=group, BLOCK_H=block_h, D=d, BLOCK_D=block_d, BS=bs, BLOCK_N=block_n, DIRECT=direct,
            IEEE=q.dtype == torch.float32, num_stages=stages)
    if not direct:
        _launch(_decode_merge, (b, heads), part, lse, out, n_splits, *part_strides, *lse_strides, out.stride(0),
                out.stride(1), D=d, BLOCK_D=block_d, BLOCK_S=max(2, _pow2(n_splits)))
    return out
