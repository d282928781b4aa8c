"""The vLLM connector reads a paged cache as its attention backend lays it out, never by shape
(review S12: on b90e890 the layout was picked by shape, ambiguous when block_size equals the
KV heads per rank, and a backend that was not known, or not known at all, was read by shape)."""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import torch

from tierd.connectors import vllm as tv
from tierd.connectors import vllm_layout as vl

from . import vllm_driver as drv
from . import vllm_wait
from .test_vllm_connector import ROOT, config, required_vllm_python

B, H, N, D = 3, 4, 4, 8          # block_size == kv_heads: (B, H, N, 2D) reads as (B, N, H, 2D) too


def _cache() -> torch.Tensor:
    return torch.arange(B * H * N * 2 * D, dtype=torch.float32).view(B, H, N, 2 * D)


def _expected(t: torch.Tensor, backend: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(K, V) as (B, N, H, D), element by element from the backend's own description."""
    k, v = torch.empty(B, N, H, D), torch.empty(B, N, H, D)
    flat = t.reshape(B, H, N * 2 * D)
    for b in range(B):
        for n in range(N):
            for h in range(H):
                for d in range(D):
                    if backend == "CPU_ATTN":      # K transposed, then V, per (block, head)
                        k[b, n, h, d] = flat[b, h, d * N + n]
                        v[b, n, h, d] = flat[b, h, N * D + n * D + d]
                    else:                          # per token and head: K's head_dim values, then V's
                        k[b, n, h, d] = t[b, h, n, d]
                        v[b, n, h, d] = t[b, h, n, D + d]
    return k, v


@pytest.mark.parametrize("backend,isa", [("FLASH_ATTN", None), ("TRITON_ATTN", None), ("FLASHINFER", None),
                                         ("FLEX_ATTENTION", None), ("ROCM_AITER_UNIFIED_ATTN", None),
                                         ("CPU_ATTN", "vec"), ("CPU_ATTN", "vec16")])
def test_block_size_equal_to_heads_is_read_as_the_backend_lays_it_out(backend, isa):
    t = _cache()
    k, v = vl.kv_views(t, backend, isa, N, H, D)
    ek, ev = _expected(t, backend)
    assert torch.equal(k, ek) and torch.equal(v, ev)
    # the views write through to the cache (loads scatter into them)
    k[1, 2, 3].fill_(-1.0)
    assert torch.equal(vl.kv_views(t, backend, isa, N, H, D)[0][1, 2, 3], torch.full((D,), -1.0))


def test_the_same_bytes_differ_by_backend():
    t = _cache()
    plain = vl.kv_views(t, "FLASH_ATTN", None, N, H, D)[0]
    cpu = vl.kv_views(t, "CPU_ATTN", "vec", N, H, D)[0]
    assert plain.shape == cpu.shape and not torch.equal(plain, cpu)


@pytest.mark.parametrize("backend,isa,why", [
    (None, None, "backend is not known"),                          # outside a vLLM engine
    ("ROCM_ATTN", None, "ROCM_ATTN stores KV in a layout"),        # x-packed K
    ("TREE_ATTN", None, "TREE_ATTN stores KV in a layout"),        # no such backend in vLLM 0.32/0.33
    ("CPU_ATTN", "neon", "packs K and V"),                          # NEON's bf16 path
    ("FLASH_ATTN (vllm.v1.attention.backends.rocm_aiter_fa.AiterFlashAttentionBackend)", None, "does not know"),
])
def test_a_backend_not_listed_or_not_known_is_declined_whatever_the_shape(backend, isa, why):
    t = _cache().bfloat16() if isa == "neon" else _cache()
    with pytest.raises(vl.TierdError, match=why):
        vl.kv_views(t, backend, isa, N, H, D)


@pytest.mark.parametrize("n,d", [(32, 32), (64, 128)])
def test_amx_tiles_are_read_in_the_tiers_order(n, d):
    """vLLM's CPU attention with the "amx" ISA (bf16 on x86 with AMX) packs K in 16-token tiles
    of head_dim pairs and V in 16-column tiles of token pairs (the offsets below, measured with
    vLLM's own op: tests/vllm_amx_layout.py checks them against it on a machine with AMX). The
    views read each element where that layout put it, and write through to the cache."""
    b, h = 2, 3
    t = torch.randn(b, h, n, 2 * d).bfloat16()
    k, v = vl.kv_views(t, "CPU_ATTN", "amx", n, h, d)
    flat = t.reshape(b, h, 2 * n * d)
    kk, vv = k.reshape(b, n, h, d), v.reshape(b, n, h, d)      # the tier's order
    for blk in range(b):
        for tok in range(n):
            for head in range(h):
                ko = [(tok // 16) * 16 * d + (e // 2) * 32 + (tok % 16) * 2 + e % 2 for e in range(d)]
                vo = [n * d + (e // 16) * 16 * n + (tok // 2) * 32 + (e % 16) * 2 + tok % 2 for e in range(d)]
                assert torch.equal(kk[blk, tok, head], flat[blk, head, ko])
                assert torch.equal(vv[blk, tok, head], flat[blk, head, vo])
    # a bijection: every element of the cache is read once
    assert kk.numel() + vv.numel() == flat.numel()
    k[1, 0, 3, 1, 2].fill_(7.0)           # token 7, head 2: written through to the cache
    assert torch.equal(vl.kv_views(t, "CPU_ATTN", "amx", n, h, d)[0].reshape(b, n, h, d)[1, 7, 2],
                       torch.full((d,), 7.0, dtype=torch.bfloat16))


def test_amx_tiles_round_trip_through_tier_blocks():
    """The block copies take the split views: gather into a tier slot gives K and V in the tier's
    (tokens, heads, head_dim) order, and scatter puts them back where they were."""
    from tierd.kernels import gather_blocks, scatter_blocks
    n, h, d, ratio = 32, 2, 64, 2
    caches = [torch.randn(6, h, n, 2 * d).bfloat16() for _ in range(2)]
    views = [vl.kv_views(c, "CPU_ATTN", "amx", n, h, d) for c in caches]
    ks, vs = [kv[0] for kv in views], [kv[1] for kv in views]
    ids = torch.tensor([[4, 1], [2, -1]])
    slots = [torch.zeros(2 * 2 * ratio * n * h * d, dtype=torch.bfloat16) for _ in range(2)]
    gather_blocks(ks, vs, ids, slots)
    s0 = slots[0].view(2, 2, ratio, n, h, d)
    for layer in range(2):
        for r, blk in enumerate((4, 1)):
            assert torch.equal(s0[layer, 0, r], ks[layer][blk].reshape(n, h, d))
            assert torch.equal(s0[layer, 1, r], vs[layer][blk].reshape(n, h, d))
    assert not slots[1].view(2, 2, ratio, n, h, d)[:, :, 1].any()          # the skipped part stays as it was
    before = [c.clone() for c in caches]
    for c in caches:
        c[4].zero_()
        c[1].zero_()
    scatter_blocks(ks, vs, ids[:1], slots[:1])
    assert all(torch.equal(a, b) for a, b in zip(caches, before))


def test_a_shape_other_than_the_backends_is_declined():
    with pytest.raises(vl.TierdError, match=r"expected vLLM's \(blocks, 4, 4, 16\) view"):
        vl.kv_views(torch.zeros(2, B, N, H, D), "FLASH_ATTN", None, N, H, D)     # an older vLLM's shape
    with pytest.raises(vl.TierdError, match="expected"):
        vl.kv_views(torch.zeros(B, H, N, 2 * D + 2), "CPU_ATTN", "vec", N, H, D)


def _layer(backend_cls, isa=None):
    return SimpleNamespace(compilation_config=SimpleNamespace(static_forward_context={
        "l": SimpleNamespace(attn_backend=backend_cls, isa=isa)}))


def test_a_backend_is_known_by_its_name_and_its_vllm_module():
    flash = drv.backend_class("FLASH_ATTN")
    assert vl.backend_of(_layer(flash), "l") == ("FLASH_ATTN", None)
    assert vl.backend_of(_layer(drv.backend_class("CPU_ATTN"), "vec"), "l") == ("CPU_ATTN", "vec")
    # ROCm's AITER flash attention calls itself FLASH_ATTN too, and may fold the heads into C
    aiter = type("AiterFlashAttentionBackend", (), {"get_name": staticmethod(lambda: "FLASH_ATTN"),
                                                    "__module__": "vllm.v1.attention.backends.rocm_aiter_fa"})
    name, _ = vl.backend_of(_layer(aiter), "l")
    assert name != "FLASH_ATTN" and "rocm_aiter_fa.AiterFlashAttentionBackend" in name
    with pytest.raises(vl.TierdError, match="does not know"):
        vl.kv_views(_cache(), name, None, N, H, D)
    assert vl.backend_of(SimpleNamespace(), "l") == (None, None)


def _connector_with(url: str, forward_context: dict | None, heads: int = H):
    ns = dict(drv.extra_config(url)["namespace"], num_kv_heads=heads)
    cfg = config(url, namespace=ns)
    if forward_context is None:
        del cfg.compilation_config
    else:
        cfg.compilation_config.static_forward_context = forward_context
    return tv.TierdConnector(cfg, tv.KVConnectorRole.WORKER, None)


@pytest.mark.parametrize("layout", ["BHN2D", "CPU"])
def test_the_connector_reads_the_ambiguous_cache_by_its_backend(tmp_path, layout):
    url = f"embedded://?host=16MiB&disk={tmp_path}/disk&disk_bytes=64MiB"
    try:
        caches = {n: torch.randn(8, drv.BLOCK_SIZE, drv.BLOCK_SIZE, 2 * drv.HEAD_DIM).half()
                  for n in drv.layer_names()}                      # kv_heads == block_size
        backend = drv.LAYOUTS[layout][0]
        w = _connector_with(url, drv.forward_context(layout), heads=drv.BLOCK_SIZE)
        w.register_kv_caches(caches)
        assert not w.disabled, w.disabled
        t = caches[drv.layer_names()[0]]
        k, v = w._layers[0]
        flat = t.reshape(8, drv.BLOCK_SIZE, -1)
        for (b, n, h) in [(0, 0, 1), (3, 5, 2), (7, 15, 14)]:
            if backend == "CPU_ATTN":
                want_k = flat[b, h, n:drv.BLOCK_SIZE * drv.HEAD_DIM:drv.BLOCK_SIZE]
            else:
                want_k = t[b, h, n, :drv.HEAD_DIM]
            assert torch.equal(k[b, n, h], want_k)
        # the same cache with no backend known: declined, not guessed
        w = _connector_with(url, None, heads=drv.BLOCK_SIZE)
        w.register_kv_caches(caches)
        assert "backend is not known" in w.disabled and not w._layers
        # nor is a backend the connector does not list
        w = _connector_with(url, {n: SimpleNamespace(attn_backend=type("RocmAttentionBackend", (), {
            "get_name": staticmethod(lambda: "ROCM_ATTN"), "__module__": "vllm.v1.attention.backends.rocm_attn"}))
            for n in drv.layer_names()}, heads=drv.BLOCK_SIZE)
        w.register_kv_caches(caches)
        assert "ROCM_ATTN" in w.disabled and not w._layers
    finally:
        store = tv._EMBEDDED.pop(url, None)
        if store is not None:
            store.close()


def test_a_worker_that_declines_its_cache_reports_the_schedulers_promised_loads(tmp_path):
    """The scheduler cannot see a layer's backend: it may promise a hit that a worker which
    declined its cache cannot load. Those blocks are reported for recomputation (on b90e890 a
    synchronous load on such a worker was skipped without a word, and vLLM took the blocks'
    stale contents for the prefix's KV)."""
    from .test_vllm_connector import _stored, pair
    url = f"embedded://?host=16MiB&disk={tmp_path}/disk&disk_bytes=64MiB"
    try:
        sched, good = pair(url, load_async=False)
        objs = drv.Objects()
        prompt = list(range(1, 71))
        _stored(sched, good, objs, prompt)                   # two tier blocks another worker stored
        cfg = config(url, load_async=False)
        cfg.compilation_config.static_forward_context = {n: SimpleNamespace(attn_backend=type(
            "TurboQuantAttentionBackend", (), {"get_name": staticmethod(lambda: "TURBOQUANT"),
                                               "__module__": "vllm.v1.attention.backends.turboquant_attn"}))
            for n in drv.layer_names()}
        declined = tv.TierdConnector(cfg, tv.KVConnectorRole.WORKER, None)
        declined.register_kv_caches(drv.paged_caches())
        assert "TURBOQUANT" in declined.disabled
        r = objs.request("B", prompt)
        blocks = list(range(10, 15))
        assert drv.admit(sched, objs, r, 0, blocks) == 64   # the scheduler promises 64 tokens
        drv.step(sched, declined, objs, objs.output([(r, blocks, 64, 6)]))
        assert objs.take_errors() == set(blocks[:4])         # ... which vLLM recomputes
        for c in (declined, good, sched):
            c.shutdown()
    finally:
        store = tv._EMBEDDED.pop(url, None)
        if store is not None:
            store.close()


@pytest.mark.timeout(vllm_wait.SCRIPT_S + 120)
def test_amx_tiles_as_vllms_own_op_writes_them(tmp_path):
    """The offsets above, against vLLM's cache writer on this machine's CPU (skipped without AMX)."""
    py = required_vllm_python()
    env = dict(os.environ, PYTHONPATH=str(ROOT), VLLM_LOGGING_LEVEL="WARNING", TMPDIR=str(tmp_path))
    r = vllm_wait.run_script([py, "-m", "tests.vllm_amx_layout"], "tests/vllm_amx_layout.py", cwd=ROOT, env=env)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-5000:]
    if "SKIP:" in r.stdout:
        pytest.skip(r.stdout.strip().splitlines()[-1])
    assert "amx layout: OK" in r.stdout
