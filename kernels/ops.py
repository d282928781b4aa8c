"""CUDA implementations of the ops in `reference`, same signatures, for CUDA tensors.

Each one checks what it relies on (contiguity, dtypes, devices) and raises ValueError otherwise;
the dispatcher then uses the reference. They are selected only after passing the self-check.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import numpy as np
import torch

from .loader import f32, i32, i64, launch, ptr
from .reference import PARTITION

_SUFFIX = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}
V1_MAX_TOKENS = 8192   # longer contexts use split-K (v1 keeps every logit in shared memory)


def _suffix(dtype: torch.dtype, cache_dtype: torch.dtype) -> str:
    if dtype not in _SUFFIX:
        raise ValueError(f"no kernel for {dtype}")
    if cache_dtype == torch.float8_e4m3fn:
        return _SUFFIX[dtype] + "_fp8"
    if cache_dtype != dtype:
        raise ValueError(f"cache dtype {cache_dtype} with compute dtype {dtype}")
    return _SUFFIX[dtype]


def _threads(n: int) -> int:
    return max(32, min(1024, (n + 31) // 32 * 32))


def _upload(values: list[int], device: torch.device) -> torch.Tensor:
    """int64 values on `device` without waiting: from page-locked memory, asynchronously on the
    current stream (torch's host allocator keeps the pinned buffer until the copy has run)."""
    host = torch.tensor(values, dtype=torch.int64)
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


def _cache_strides(k_cache: torch.Tensor, v_cache: torch.Tensor) -> tuple[int, int, int]:
    """(block, token, head) element strides shared by a K and a V view (num_blocks, block_size,
    heads, head_dim) whose head_dim is contiguous; ValueError otherwise."""
    if k_cache.stride() != v_cache.stride() or k_cache.shape != v_cache.shape or k_cache.stride(-1) != 1:
        raise ValueError("K and V views need one layout with a contiguous head_dim")
    return k_cache.stride(0), k_cache.stride(1), k_cache.stride(2)


def reshape_and_cache(key, value, k_cache, v_cache, slot_mapping, k_scale: float = 1.0,
                      v_scale: float = 1.0) -> None:
    if key.stride(-1) != 1 or value.stride(-1) != 1:
        raise ValueError("key/value need a contiguous last dimension")
    c_block, c_token, c_head = _cache_strides(k_cache, v_cache)
    t, h, d = key.shape
    if t == 0:
        return
    slots = slot_mapping.to(device=key.device, dtype=torch.int64).contiguous()
    name = "reshape_and_cache_" + _suffix(key.dtype, k_cache.dtype)
    launch(key.device, "reshape_and_cache.cu", name, (t,), (_threads(h * d),),
           (ptr(key), ptr(value), ptr(k_cache), ptr(v_cache), ptr(slots), i64(key.stride(0)),
            i64(key.stride(1)), i64(value.stride(0)), i64(value.stride(1)), i32(h), i32(d),
            i32(k_cache.shape[1]), i64(c_block), i64(c_token), i64(c_head), f32(k_scale), f32(v_scale)))


def paged_attention_decode(q, k_cache, v_cache, block_tables, seq_lens, scale: float,
                           k_scale: float = 1.0, v_scale: float = 1.0, *, version: str | None = None,
                           max_seq_len: int | None = None) -> torch.Tensor:
    if q.stride(-1) != 1 or q.stride(1) != q.shape[2]:
        raise ValueError("q needs contiguous heads")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("caches must be contiguous")
    b, heads, d = q.shape
    _, bs, kv_heads, _ = k_cache.shape
    if heads % kv_heads:
        raise ValueError(f"{heads} heads over {kv_heads} kv heads")
    tables = block_tables.to(torch.int32).contiguous()
    lens = seq_lens.to(device=q.device, dtype=torch.int32).contiguous()
    if max_seq_len is None:
        max_seq_len = int(lens.max())
    out = torch.empty((b, heads, d), dtype=q.dtype, device=q.device)
    suffix = _suffix(q.dtype, k_cache.dtype)
    common = (ptr(q), ptr(k_cache), ptr(v_cache), ptr(tables), ptr(lens), i32(tables.shape[1]), i32(heads),
              i32(kv_heads), i32(d), i32(bs), i64(q.stride(0)), f32(scale), f32(k_scale), f32(v_scale))
    threads = 128
    if version is None:
        version = "v1" if max_seq_len <= V1_MAX_TOKENS else "v2"
    if version == "v1":
        launch(q.device, "paged_attention.cu", f"paged_attention_v1_{suffix}", (heads, b), (threads,),
               (ptr(out), *common), shared_mem=4 * (d + 32 + max_seq_len))
        return out
    parts = (max_seq_len + PARTITION - 1) // PARTITION
    exp_sums = torch.empty((b, heads, parts), dtype=torch.float32, device=q.device)
    max_logits = torch.empty_like(exp_sums)
    tmp = torch.empty((b, heads, parts, d), dtype=torch.float32, device=q.device)
    launch(q.device, "paged_attention.cu", f"paged_attention_v2_{suffix}", (heads, b, parts), (threads,),
           (ptr(exp_sums), ptr(max_logits), ptr(tmp), *common), shared_mem=4 * (d + 32 + PARTITION))
    launch(q.device, "paged_attention.cu", f"paged_attention_v2_reduce_{_SUFFIX[q.dtype]}", (heads, b), (threads,),
           (ptr(out), ptr(exp_sums), ptr(max_logits), ptr(tmp), ptr(lens), i32(heads), i32(d), i32(parts)),
           shared_mem=4 * (32 + parts))
    return out


@functools.lru_cache(maxsize=4096)
def _cache_ptrs(device: torch.device, ptrs: tuple[int, ...]) -> torch.Tensor:
    """The layers' cache addresses on the device: the caches live as long as the engine, so one
    upload serves every transfer (slots change per call and are uploaded each time). This one
    waits, once per set of caches (every layer, or one layer for layer-by-layer copies), so the
    tensor is complete before any stream reads it."""
    return torch.tensor(ptrs, dtype=torch.int64).to(device)


def _geometry(k_caches, v_caches) -> tuple:
    """(device, planes, block size, heads, row bytes, byte strides, unit bytes) of caches the
    copy kernels take; ValueError otherwise."""
    device = k_caches[0].device
    k0 = k_caches[0]
    _, bs, heads, d = k0.shape
    planes = 1 if v_caches is None else 2
    if not all(c.device == device and c.shape == k0.shape and c.stride() == k0.stride() and c.dtype == k0.dtype
               for c in (*k_caches, *(v_caches or ()))) or k0.stride(-1) != 1:
        raise ValueError("every K and V view needs one shape, one layout (head_dim contiguous) and one device")
    esize = k0.element_size()
    unit = bs * heads * d * esize
    if unit >= 1 << 31:
        raise ValueError(f"an engine block of {unit} bytes per layer (the kernel indexes below 2 GiB)")
    strides = tuple(s * esize for s in k0.stride()[:3])
    return device, planes, bs, heads, d * esize, strides, unit


def _block_copy(kernel: str, k_caches: Sequence[torch.Tensor], v_caches: Sequence[torch.Tensor] | None,
                block_ids: torch.Tensor, slots: Sequence[torch.Tensor]) -> None:
    device, planes, bs, heads, row_bytes, (s_block, s_token, s_head), unit = _geometry(k_caches, v_caches)
    if not all(s.device == device and s.is_contiguous() for s in slots):
        raise ValueError("slots must be contiguous device memory")
    n_tier, ratio = block_ids.shape
    if n_tier == 0:
        return
    if len(slots) != n_tier:
        raise ValueError(f"{len(slots)} slots for {n_tier} tier blocks")
    if any(s.numel() * s.element_size() < planes * len(k_caches) * ratio * unit for s in slots):
        raise ValueError("a slot is smaller than a tier block")
    k_ptrs = _cache_ptrs(device, tuple(c.data_ptr() for c in k_caches))
    v_ptrs = _cache_ptrs(device, tuple(c.data_ptr() for c in (v_caches or k_caches)))
    # the block ids and the slots' addresses in one upload that does not wait for the device
    ids = block_ids.to(torch.int64).reshape(-1)
    if ids.device.type == "cpu":
        ids_slots = _upload([*ids.tolist(), *(s.data_ptr() for s in slots)], device)
    else:
        ids_slots = torch.cat([ids.to(device), _upload([s.data_ptr() for s in slots], device)])
    launch(device, "gather_scatter.cu", kernel, (n_tier * ratio, planes * len(k_caches)), (256,),
           (ptr(k_ptrs), ptr(v_ptrs), ptr(ids_slots), i32(n_tier), i32(ratio), i32(bs), i32(heads),
            i64(row_bytes), i64(s_block), i64(s_token), i64(s_head), i32(planes)))


class AddressScatter:
    """Tier blocks copied into the caches from memory the device reads at these addresses
    (`slot_addrs`, one whole tier block each): host memory registered with the CUDA runtime and
    mapped into the device's address space, or device memory (the HBM tier's copies, a load's
    staging buffer) -- no host-to-device copy of its own. Made on the stream that copies: the
    block ids and the slots' addresses for every layer go to the device in one upload for the
    whole load. Then `launch(i)` per layer (`layered`), or `launch()` once for every layer.
    (`launch_fn`: the launcher, for tests.)"""

    def __init__(self, k_caches, v_caches, block_ids: torch.Tensor, slot_addrs: Sequence[int], *,
                 layered: bool, launch_fn=None):
        self.launch_fn = launch_fn or launch
        self.device, planes, bs, heads, row_bytes, (s_block, s_token, s_head), unit = _geometry(k_caches, v_caches)
        n_tier, ratio = block_ids.shape
        if len(slot_addrs) != n_tier:
            raise ValueError(f"{len(slot_addrs)} slots for {n_tier} tier blocks")
        self.layers, self.layered, self.n_tier, self.ratio, self.planes = len(k_caches), layered, n_tier, ratio, planes
        self.launches = 0
        if n_tier == 0:
            return
        layer_bytes = planes * ratio * unit
        ids = block_ids.to(torch.int64).reshape(-1).tolist()
        addrs = [int(a) for a in slot_addrs]
        if layered:   # per layer: the ids, then each slot's address of that layer's part
            values = [v for i in range(self.layers) for v in (*ids, *(a + i * layer_bytes for a in addrs))]
        else:
            values = [*ids, *addrs]
        self.table = _upload(values, self.device)
        self.k_ptrs = _cache_ptrs(self.device, tuple(c.data_ptr() for c in k_caches))
        self.v_ptrs = _cache_ptrs(self.device, tuple(c.data_ptr() for c in (v_caches or k_caches)))
        self.common = (i32(n_tier), i32(ratio), i32(bs), i32(heads), i64(row_bytes), i64(s_block), i64(s_token),
                       i64(s_head), i32(planes))

    def launch(self, layer: int | None = None) -> None:
        """Layer `layer`'s copy (layered), or every layer's (`layer` None, not layered)."""
        if self.n_tier == 0:
            return
        if (layer is None) == self.layered:
            raise ValueError("a layered scatter launches per layer, another once for every layer")
        rows = self.n_tier * self.ratio
        if layer is None:
            self.launch_fn(self.device, "gather_scatter.cu", "scatter_blocks", (rows, self.planes * self.layers),
                           (256,), (ptr(self.k_ptrs), ptr(self.v_ptrs), ptr(self.table), *self.common))
        else:
            per = (rows + self.n_tier) * 8
            self.launch_fn(self.device, "gather_scatter.cu", "scatter_blocks", (rows, self.planes), (256,),
                           (np.uint64(self.k_ptrs.data_ptr() + 8 * layer), np.uint64(self.v_ptrs.data_ptr() + 8 * layer),
                            np.uint64(self.table.data_ptr() + per * layer), *self.common))
        self.launches += 1


def scatter_from_host(k_caches, v_caches, block_ids: torch.Tensor, slot_addrs: Sequence[int], *,
                      layered: bool, after_layer=None, launch_fn=None) -> int:
    """`AddressScatter` run whole: one upload, then one launch per layer (`layered`;
    `after_layer(i)` after layer i's, to record its event) or one for every layer. Returns the
    launches."""
    scatter = AddressScatter(k_caches, v_caches, block_ids, slot_addrs, layered=layered, launch_fn=launch_fn)
    if scatter.n_tier == 0:
        return 0
    if not layered:
        scatter.launch()
        return 1
    for i in range(scatter.layers):
        scatter.launch(i)
        if after_layer is not None:
            after_layer(i)
    return scatter.layers


def gather_blocks(k_caches, v_caches, block_ids, slots) -> None:
    _block_copy("gather_blocks", k_caches, v_caches, block_ids, slots)


def scatter_blocks(k_caches, v_caches, block_ids, slots) -> None:
    _block_copy("scatter_blocks", k_caches, v_caches, block_ids, slots)


def _grid(n: int) -> tuple[int]:
    return (max(1, min(65535, (n + 255) // 256)),)


def quantize_fp8(x: torch.Tensor, scale: float) -> torch.Tensor:
    x = x.contiguous()
    out = torch.empty(x.shape, dtype=torch.float8_e4m3fn, device=x.device)
    if x.numel():
        launch(x.device, "fp8.cu", f"quantize_fp8_{_SUFFIX[x.dtype]}", _grid(x.numel()), (256,),
               (ptr(out), ptr(x), i64(x.numel()), f32(scale)))
    return out


def dequantize_fp8(x: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    x = x.contiguous()
    out = torch.empty(x.shape, dtype=dtype, device=x.device)
    if x.numel():
        launch(x.device, "fp8.cu", f"dequantize_fp8_{_SUFFIX[dtype]}", _grid(x.numel()), (256,),
               (ptr(out), ptr(x), i64(x.numel()), f32(scale)))
    return out


def paged_attention_int4_decode(q, k_q, k_min, k_step, v_q, v_min, v_step, k_own, block_tables, seq_lens,
                                scale: float, *, max_seq_len: int | None = None) -> torch.Tensor:
    if q.stride(-1) != 1 or q.stride(1) != q.shape[2]:
        raise ValueError("q needs contiguous heads")
    for t in (k_q, k_min, k_step, v_q, v_min, v_step, k_own):
        if not t.is_contiguous():
            raise ValueError("int4 cache tensors must be contiguous")
    if k_q.dtype != torch.uint8 or v_q.dtype != torch.uint8 or k_min.dtype != torch.float16:
        raise ValueError("not an int4 cache")
    if k_own.dtype != q.dtype:
        raise ValueError("k_own must have q's dtype")
    b, heads, d = q.shape
    _, bs, kv_heads, _ = v_q.shape
    group = d // v_min.shape[-1]
    if heads % kv_heads or d % group:
        raise ValueError("heads or groups do not divide")
    tables = block_tables.to(torch.int32).contiguous()
    lens = seq_lens.to(device=q.device, dtype=torch.int32).contiguous()
    max_len = int(lens.max()) if max_seq_len is None else max_seq_len   # the caller knows it: no sync
    if max_len > V1_MAX_TOKENS:
        raise ValueError("context too long for the one-pass int4 kernel")
    out = torch.empty((b, heads, d), dtype=q.dtype, device=q.device)
    launch(q.device, "int4_attention.cu", f"paged_attention_int4_{_SUFFIX[q.dtype]}", (heads, b), (128,),
           (ptr(out), ptr(q), ptr(k_q), ptr(k_min), ptr(k_step), ptr(v_q), ptr(v_min), ptr(v_step), ptr(k_own),
            ptr(tables), ptr(lens), i32(tables.shape[1]), i32(heads), i32(kv_heads), i32(d), i32(bs), i32(group),
            i64(q.stride(0)), f32(scale)), shared_mem=4 * (d + 32 + max_len))
    return out
