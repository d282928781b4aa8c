"""The load path that scatters tier blocks straight from host memory the GPU reads (the arena,
registered and mapped into its address space): `ops.scatter_from_host`, checked on the CPU with
a launcher that runs each launch as the CUDA kernel's documented semantics (kernels/
gather_scatter.cu) on the real addresses. Its arguments put every byte where the torch reference
puts it, and a whole load costs one upload and one launch per layer (or one), with no staging
buffer and no host-to-device copy of its own."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest
import torch

from tierd.kernels import cases, ops, reference


def run_scatter_kernel(device, source, name, grid, block, args) -> None:
    """What `scatter_blocks` in gather_scatter.cu does for this launch, on CPU addresses."""
    assert (source, name) == ("gather_scatter.cu", "scatter_blocks") and block == (256,)
    k_ptrs, v_ptrs, table, n_tier, ratio, bs, heads, row_bytes, s_block, s_token, s_head, planes = \
        (int(a) for a in args)
    u64 = lambda addr: ctypes.c_uint64.from_address(addr).value   # noqa: E731
    i64 = lambda addr: ctypes.c_int64.from_address(addr).value    # noqa: E731
    unit = bs * heads * row_bytes
    for x in range(grid[0]):
        block_id = i64(table + 8 * x)
        if block_id < 0:
            continue
        tier, part = divmod(x, ratio)
        for y in range(grid[1]):
            layer, kv = divmod(y, planes)
            cache = u64((v_ptrs if kv else k_ptrs) + 8 * layer) + block_id * s_block
            slot = u64(table + 8 * (n_tier * ratio + tier)) + ((layer * planes + kv) * ratio + part) * unit
            for t in range(bs):
                for h in range(heads):
                    ctypes.memmove(cache + t * s_token + h * s_head, slot + (t * heads + h) * row_bytes, row_bytes)


def caches(layout: str, layers: int, nb: int, bs: int, heads: int, d: int, planes: int):
    ks, vs = [], []
    for _ in range(layers):
        _, k, v = cases.cache_views(layout, nb, bs, heads, d, lambda s: torch.zeros(s, dtype=torch.float16))
        ks.append(k)
        vs.append(v)
    return ks, (vs if planes == 2 else None)


@pytest.mark.parametrize("layout,planes", [("contiguous", 2), ("b2hnd", 2), ("contiguous", 1)])
@pytest.mark.parametrize("layered", [True, False])
def test_a_load_from_host_mapped_slots_lands_where_the_reference_puts_it(layout, planes, layered, monkeypatch):
    layers, nb, bs, heads, d, ratio = 3, 12, 4, 2, 8, 2
    ks, vs = caches(layout, layers, nb, bs, heads, d, planes)
    want_k, want_v = caches(layout, layers, nb, bs, heads, d, planes)
    unit = bs * heads * d * 2
    block_bytes = layers * planes * ratio * unit
    rng = np.random.default_rng(planes + layered)
    slots = [rng.integers(0, 256, block_bytes, dtype=np.uint8) for _ in range(3)]
    ids = torch.tensor([[5, 1], [-1, 7], [3, 10]], dtype=torch.int64)       # a part skipped
    reference.scatter_blocks(want_k, want_v, ids, [torch.from_numpy(s) for s in slots])
    uploads, launches, layers_done = [], [], []
    real_upload = ops._upload
    monkeypatch.setattr(ops, "_upload", lambda values, device: (uploads.append(len(values)),
                                                                real_upload(values, device))[1])

    def launcher(*a):
        launches.append(a[3])
        run_scatter_kernel(*a)
    n = ops.scatter_from_host(ks, vs, ids, [s.ctypes.data for s in slots], layered=layered,
                              launch_fn=launcher, after_layer=layers_done.append)
    for got, want in zip(ks + (vs or []), want_k + (want_v or [])):
        assert torch.equal(got.contiguous().view(torch.uint8), want.contiguous().view(torch.uint8))
    assert len(uploads) == 1                                   # ids and every slot address, once
    assert n == len(launches) == (layers if layered else 1)
    assert layers_done == (list(range(layers)) if layered else [])
    assert all(g == ((6, planes) if layered else (6, planes * layers)) for g in launches)


def test_what_the_direct_scatter_does_not_take_is_refused():
    ks, vs = caches("contiguous", 2, 4, 4, 2, 8, 2)
    with pytest.raises(ValueError, match="slots"):
        ops.scatter_from_host(ks, vs, torch.zeros((2, 1), dtype=torch.int64), [0], layered=True,
                              launch_fn=run_scatter_kernel)
    with pytest.raises(ValueError, match="layout"):
        ops.scatter_from_host(ks, [v.float() for v in vs], torch.zeros((1, 1), dtype=torch.int64), [0],
                              layered=True, launch_fn=run_scatter_kernel)
