"""The CPU kernels in C (`cpu_copy.c`): what `gather_blocks` / `scatter_blocks` run for CPU
caches, and `paged_attention_decode` for the bundled engine's decode steps on the CPU, once each
has matched its torch reference (`kernels/dispatch.py`).

The reference copies a transposed cache (vLLM's CPU attention keeps K as (head_dim, tokens) per
block and head) through torch's strided copy, one element at a time, at about a fifth of memcpy
here, and a contiguous cache through one ctypes memmove per run, from Python. The C copy
transposes in 8 x 8 tiles (AVX for 4-byte elements, SSE2 for 2-byte ones, where the compiler
targets them) and takes every block of a plane in one call. vLLM's "amx" CPU attention layout
(bf16 K in 16-token tiles of head_dim pairs, V in 16-column tiles of token pairs) is copied by
the same tile transposes over 4-byte pairs (K) and by pair interleaves (V).

The source is compiled at first use, once per process, by the system C compiler (`$CC`, else
`cc`) for this machine (`-march=native`), in a private temporary directory that is removed once
the library is loaded. Without a compiler, or if the build or the self-check fails, the torch
reference runs: slower, never wrong.
"""

from __future__ import annotations

import ctypes
import logging
import os
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import numpy as np
import torch

log = logging.getLogger("tierd.kernels")

SOURCE = Path(__file__).resolve().parent / "cpu_copy.c"
ABI = 3
_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_why: str | None = None        # why there is no library, once a build failed


def _build(flags: tuple[tuple[str, ...], ...] = (("-march=native",), ())) -> ctypes.CDLL:
    """Compile and load the copy with the first of `flags` the compiler takes."""
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if not cc:
        raise RuntimeError("no C compiler (cc, gcc or clang) on PATH")
    work = tempfile.mkdtemp(prefix="tierd-cpu-copy-")
    try:
        out = os.path.join(work, "cpu_copy.so")
        errors = ""
        for arch in flags:      # a compiler without -march=native: its default target
            r = subprocess.run([cc, "-O3", *arch, "-fPIC", "-shared", "-o", out, str(SOURCE), "-lm"],
                               capture_output=True, text=True, timeout=120)
            if r.returncode == 0:
                break
            errors = r.stderr.strip()[-500:]
        else:
            raise RuntimeError(f"{cc} failed: {errors}")
        lib = ctypes.CDLL(out)
    finally:
        shutil.rmtree(work, ignore_errors=True)    # the loaded library stays mapped
    if lib.tierd_cpu_copy_abi() != ABI:
        raise RuntimeError("cpu_copy.c does not match this module")
    p64 = ctypes.POINTER(ctypes.c_int64)
    i64 = ctypes.c_int64
    lib.tierd_copy_blocks.argtypes = (i64, p64, p64, ctypes.c_int, ctypes.c_int, i64, i64, i64, i64, i64, i64)
    lib.tierd_copy_blocks.restype = ctypes.c_int
    lib.tierd_copy_amx.argtypes = (i64, p64, p64, ctypes.c_int, ctypes.c_int, i64, i64, i64, i64)
    lib.tierd_copy_amx.restype = ctypes.c_int
    vp = ctypes.c_void_p
    lib.tierd_decode_attention.argtypes = (vp, vp, vp, ctypes.c_int, vp, i64, vp, i64, i64, i64, i64, i64, i64,
                                           ctypes.c_float, vp, vp, vp)
    lib.tierd_decode_attention.restype = ctypes.c_int
    return lib


def library() -> ctypes.CDLL | None:
    """The compiled copy (built at the first call in this process), or None if it cannot be."""
    global _lib, _why
    if _lib is not None or _why is not None:
        return _lib
    with _lock:
        if _lib is None and _why is None:
            try:
                _lib = _build()
            except Exception as e:  # noqa: BLE001 - no native copy: the reference runs
                _why = str(e)
                log.info("tierd: the C block copy is not available (%s); the torch reference copies", e)
    return _lib


def available() -> bool:
    return library() is not None


def why_not() -> str | None:
    return _why


def gather_blocks(k_caches, v_caches, block_ids, slots) -> None:
    _copy_blocks(k_caches, v_caches, block_ids, slots, to_slots=True)


def scatter_blocks(k_caches, v_caches, block_ids, slots) -> None:
    _copy_blocks(k_caches, v_caches, block_ids, slots, to_slots=False)


def _plane(caches, k0: torch.Tensor) -> tuple[int, int, int, int]:
    """The strides in elements (block, token, head, dim; or the AMX tiles' eight) shared by every
    view of a plane (of K's shape and element size)."""
    first = caches[0]
    if not all(c.device.type == "cpu" and c.shape == k0.shape and c.stride() == first.stride()
               and c.element_size() == k0.element_size() for c in caches):
        raise ValueError("every view of a plane needs one shape and one layout on the CPU")
    return tuple(first.stride())


def _amx_geometry(k0: torch.Tensor, strides: list, es: int) -> tuple[int, int, int, int]:
    """(N, heads, D, head stride in elements) of K and V views of vLLM's "amx" tiles, as
    `connectors/vllm_layout.py` makes them: (blocks, N / 16, 8, 2, heads, D / 16, 8, 2) with the
    strides of K, then V, of that layout, one head stride for both; ValueError for anything else."""
    if es != 2 or len(strides) != 2:
        raise ValueError("AMX tiles hold K and V of 2-byte elements")
    n, d = k0.shape[1] * 16, k0.shape[5] * 16
    if tuple(k0.shape[2:4]) != (8, 2) or tuple(k0.shape[6:]) != (8, 2):
        raise ValueError(f"a view of shape {tuple(k0.shape)} is not one of AMX tiles")
    (sb, *k), (vb, *v) = strides
    sh = k[3]
    if k != [16 * d, 4, 2, sh, 256, 32, 1] or v != [256, 32, 1, sh, 16 * n, 4, 2] or vb != sb or sh < 2 * n * d:
        raise ValueError(f"strides {strides} are not those of AMX tiles")
    return n, k0.shape[4], d, sh


def _copy_blocks(k_caches, v_caches, block_ids, slots, *, to_slots: bool, lib: ctypes.CDLL | None = None) -> None:
    """The reference's `_copy_blocks` (same arguments, same result), in C. Raises ValueError for
    inputs it does not take; the reference then runs. (`lib`: another build, for tests.)"""
    lib = lib or library()
    if lib is None:
        raise ValueError(f"no C block copy: {_why}")
    k0 = k_caches[0]
    if k0.device.type != "cpu":
        raise ValueError("CPU caches expected")
    es = k0.element_size()
    planes = [k_caches] if v_caches is None else [k_caches, v_caches]
    strides = [_plane(p, k0) for p in planes]
    num_blocks = k0.shape[0]
    if k0.dim() == 8:
        n, h, d, amx = _amx_geometry(k0, strides, es)
    elif k0.dim() == 4:
        amx = None
        _, n, h, d = k0.shape
    else:
        raise ValueError("CPU caches of (blocks, block_size, heads, head_dim), or AMX tiles, expected")
    layers, ratio = len(k_caches), block_ids.shape[1]
    ids = block_ids.to(torch.int64).numpy().reshape(-1, ratio) if block_ids.numel() else \
        np.zeros((0, ratio), np.int64)
    if len(slots) != ids.shape[0]:
        raise ValueError(f"{len(slots)} slots for {ids.shape[0]} tier blocks")
    unit = n * h * d * es                                   # one engine block of one plane, bytes
    need = layers * len(planes) * ratio * unit
    slot_base = np.empty(len(slots), np.int64)
    for t, s in enumerate(slots):
        if s.device.type != "cpu" or not s.is_contiguous() or s.numel() * s.element_size() < need:
            raise ValueError("slots must be contiguous CPU memory of a whole tier block")
        slot_base[t] = s.data_ptr()
    used = ids >= 0
    if not used.any():
        return
    if ids[used].max() >= num_blocks:
        raise ValueError(f"engine block id out of range 0..{num_blocks - 1}")  # the reference raises
    if any(x < 0 for st in strides for x in st):
        raise ValueError("negative strides")
    t_idx, r_idx = np.nonzero(used)
    blocks = ids[t_idx, r_idx]
    p64 = ctypes.POINTER(ctypes.c_int64)
    for kv, (caches, st) in enumerate(zip(planes, strides)):
        # every layer's pairs of this plane in one call: (layers, pairs) addresses, flattened
        bases = np.array([c.data_ptr() for c in caches], np.int64)
        cache_at = (bases[:, None] + (blocks * (st[0] * es))[None, :]).reshape(-1)
        offsets = ((np.arange(layers, dtype=np.int64)[:, None] * len(planes) + kv) * ratio + r_idx[None, :]) * unit
        slot_at = (slot_base[t_idx][None, :] + offsets).reshape(-1)
        if amx is not None:
            lib.tierd_copy_amx(len(cache_at), cache_at.ctypes.data_as(p64), slot_at.ctypes.data_as(p64),
                               0 if to_slots else 1, kv, n, h, d, amx)
        else:
            lib.tierd_copy_blocks(len(cache_at), cache_at.ctypes.data_as(p64), slot_at.ctypes.data_as(p64),
                                  0 if to_slots else 1, es, n, h, d, *st[1:])


_pool = None
_pool_lock = threading.Lock()


def _workers():
    """Threads beside the caller for one attention call: as many as torch's intra-op threads,
    less the caller's own (the kernel lets go of the GIL)."""
    global _pool
    n = torch.get_num_threads() - 1
    if n < 1:
        return None, 1
    with _pool_lock:
        if _pool is None or _pool._max_workers != n:
            from concurrent.futures import ThreadPoolExecutor
            if _pool is not None:
                _pool.shutdown(wait=False)
            _pool = ThreadPoolExecutor(n, thread_name_prefix="tierd-attn")
        return _pool, n + 1


def paged_attention_decode(q, k_cache, v_cache, block_tables, seq_lens, scale, k_scale=1.0, v_scale=1.0, *,
                           version=None, max_seq_len=None):
    """`reference.paged_attention_decode` in C: each sequence's cache read where it lies (no
    gathered copy, no padding to the longest), float32 throughout, the batch split across
    torch's intra-op threads. float32 and bfloat16 caches; ValueError for anything else (the
    reference runs)."""
    lib = library()
    if lib is None:
        raise ValueError(f"no C kernels: {_why}")
    if k_cache.dtype not in (torch.float32, torch.bfloat16) or v_cache.dtype != k_cache.dtype:
        raise ValueError("float32 or bfloat16 caches only")
    if not (q.device.type == k_cache.device.type == v_cache.device.type == "cpu"):
        raise ValueError("CPU tensors only")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()) or k_cache.shape != v_cache.shape:
        raise ValueError("contiguous caches of one shape only")
    num_blocks, bs, kvh, d = k_cache.shape
    B, heads, qd = q.shape
    if qd != d or heads % kvh:
        raise ValueError(f"q of {heads} heads x {qd} for a cache of {kvh} heads x {d}")
    tables = block_tables.to(torch.int32).contiguous()
    lens = seq_lens.to(torch.int32).contiguous()
    if B == 0:
        return torch.empty_like(q)
    n_max = int(lens.max())
    need = (lens.long() + bs - 1) // bs
    if int(lens.min()) < 0 or int(need.max()) > tables.shape[1]:
        raise ValueError("a length past its block table")
    used = torch.arange(tables.shape[1]).unsqueeze(0) < need.unsqueeze(1)
    if used.any():
        ids = tables[used]
        if int(ids.min()) < 0 or int(ids.max()) >= num_blocks:
            raise ValueError(f"block id out of range 0..{num_blocks - 1}")   # the reference raises
    qf = q.to(torch.float32).contiguous()
    out = torch.empty((B, heads, d), dtype=torch.float32)
    pool, parts = _workers()
    parts = max(1, min(parts, B))
    group = heads // kvh
    work = torch.empty((parts, group * max(n_max, 1)), dtype=torch.float32)
    kbuf = torch.empty((parts, d), dtype=torch.float32)
    es = k_cache.element_size()
    bounds = [B * i // parts for i in range(parts + 1)]

    def run(i):
        return lib.tierd_decode_attention(qf.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), es,
                                          tables.data_ptr(), tables.shape[1], lens.data_ptr(), bounds[i],
                                          bounds[i + 1], heads, kvh, d, bs, float(scale), out.data_ptr(),
                                          work[i].data_ptr(), kbuf[i].data_ptr())
    futures = [pool.submit(run, i) for i in range(1, parts)] if parts > 1 else []
    run(0)
    for f in futures:
        f.result()
    return out.to(q.dtype)
