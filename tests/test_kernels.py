"""Kernels: nvcc compiles every source for sm_80 and sm_90; the torch references pass vLLM's
kernel-test grid on CPU (small sizes) against dense float64 attention, NaN-poisoned slots
included; the dispatcher never returns a wrong kernel's result. The `gpu` tests run the CUDA
kernels against the references on the full grid where CUDA and CuPy are present."""

from __future__ import annotations

import logging
import platform
import shutil
import subprocess
from pathlib import Path

import pytest
import numpy as np
import torch

import tierd.kernels as K
from tierd.kernels import cases, reference
from tierd.kernels.dispatch import KernelOp, close, same_bytes
from tierd.kernels.loader import KERNEL_DIR, SOURCES, source_text

HEAD_PAIRS = [(32, 8), (40, 40), (64, 8)]
HEAD_SIZES = [64, 80, 96, 112, 128, 256]
BLOCK_SIZES = [16, 32]
DTYPES = [torch.float16, torch.bfloat16, torch.float32]
needs_cc = pytest.mark.skipif(not (shutil.which("cc") or shutil.which("gcc")), reason="no C compiler")


# -- nvcc ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
@pytest.mark.parametrize("source", SOURCES)
def test_nvcc_compiles_every_kernel_with_warnings_as_errors(source, arch, tmp_path):
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        pytest.skip("nvcc not found on PATH: the CUDA sources were not compiled")
    r = subprocess.run([nvcc, "-std=c++17", f"-arch={arch}", "-Werror", "all-warnings", "-Xcompiler", "-Wall,-Werror",
                        f"-I{KERNEL_DIR}", "-c", str(KERNEL_DIR / source), "-o", str(tmp_path / "k.o")],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr


def test_the_text_nvrtc_gets_compiles_too(tmp_path):
    """The loader inlines common.cuh; that text must compile on its own (no include path)."""
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        pytest.skip("nvcc not found on PATH")
    src = tmp_path / "inlined.cu"
    src.write_text(source_text("gather_scatter.cu"))
    r = subprocess.run([nvcc, "-std=c++17", "-arch=sm_90", "-Werror", "all-warnings", "-c", str(src),
                        "-o", str(tmp_path / "k.o")], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr


# -- references on CPU ----------------------------------------------------------------------------
def dense_decode(a: dict) -> torch.Tensor:
    """Independent float64 decode attention: gathers each sequence token by token."""
    q, k_cache, v_cache = a["q"], a["k_cache"], a["v_cache"]
    tables, lens = a["block_tables"], a["seq_lens"]
    b_, heads, d = q.shape
    bs, kv_heads = k_cache.shape[1], k_cache.shape[2]
    out = torch.empty((b_, heads, d), dtype=torch.float64)
    for b in range(b_):
        n = int(lens[b])
        slots = [(int(tables[b, t // bs]), t % bs) for t in range(n)]
        k = torch.stack([k_cache[blk, off].double() for blk, off in slots]) * a["k_scale"]
        v = torch.stack([v_cache[blk, off].double() for blk, off in slots]) * a["v_scale"]
        for h in range(heads):
            kh = h // (heads // kv_heads)
            p = torch.softmax((k[:, kh] @ q[b, h].double()) * a["scale"], dim=0)
            out[b, h] = p @ v[:, kh]
    return out


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("head_size", HEAD_SIZES)
@pytest.mark.parametrize("heads", HEAD_PAIRS, ids=lambda p: f"{p[0]}q{p[1]}kv")
def test_reference_decode_grid(heads, head_size, block_size, dtype):
    a = cases.decode_inputs("cpu", batch=7, heads=heads[0], kv_heads=heads[1], head_dim=head_size,
                            block_size=block_size, num_blocks=7 * (97 // block_size + 1) + 20, max_len=97,
                            dtype=dtype, seed=head_size + block_size)
    assert a["k_cache"].isnan().any()                       # the poison is there ...
    out = reference.paged_attention_decode(**a)
    assert not out.isnan().any()                            # ... and never read
    atol = {torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 1.6e-2}[dtype]
    torch.testing.assert_close(out.double(), dense_decode(a), atol=atol, rtol=0)


@pytest.mark.parametrize("heads", HEAD_PAIRS, ids=lambda p: f"{p[0]}q{p[1]}kv")
def test_reference_decode_fp8_cache(heads):
    a = cases.decode_inputs("cpu", batch=7, heads=heads[0], kv_heads=heads[1], head_dim=128, block_size=16,
                            num_blocks=80, max_len=150, dtype=torch.float16, fp8=True, seed=1)
    assert a["k_cache"].dtype == torch.float8_e4m3fn
    out = reference.paged_attention_decode(**a)
    torch.testing.assert_close(out.double(), dense_decode(a), atol=1e-2, rtol=0)


def test_reference_decode_matches_the_engine_path():
    """The kernels' reference and the engine's batched decode agree (one ground truth)."""
    from tierd.engine.attention import AttentionMetadata, paged_attention
    a = cases.decode_inputs("cpu", batch=4, heads=8, kv_heads=2, head_dim=64, block_size=16, num_blocks=64,
                            max_len=120, dtype=torch.float32, seed=4)
    seqs = [(i, 1, int(a["seq_lens"][i]), a["block_tables"][i].long()) for i in range(4)]
    meta = AttentionMetadata(seqs, 16)
    q = a["q"]
    out = paged_attention(q, a["k_cache"], a["v_cache"], meta, a["scale"])
    torch.testing.assert_close(out, reference.paged_attention_decode(**a), atol=1e-5, rtol=0)


def test_reference_reshape_and_cache_strided_padding_and_fp8():
    for fp8 in (False, True):
        k_cache, v_cache = cases.reshape_case("cpu", reference.reshape_and_cache, fp8=fp8)
        g = torch.Generator().manual_seed(5)
        tokens, heads, d = 37, 4, 64
        qkv = torch.randn((tokens, 4 * heads * d), generator=g).half()
        slots = torch.randperm(8 * 16, generator=g)[:tokens]
        slots[::5] = -1
        want_k = torch.zeros((8 * 16, heads, d))
        written = torch.zeros(8 * 16, dtype=torch.bool)
        for t in range(tokens):
            if slots[t] >= 0:
                want_k[slots[t]] = qkv[t, 2 * heads * d:3 * heads * d].view(heads, d).float()
                written[slots[t]] = True
        got = k_cache.view(-1, heads, d).float() * (0.03 if fp8 else 1.0)
        atol = 0.03 * 448 / 8 if fp8 else 0          # one fp8 step at the top of the range
        torch.testing.assert_close(got[written], want_k[written], atol=atol, rtol=0.07 if fp8 else 0)
        assert not got[~written].any()                 # padding wrote nothing


def test_reference_gather_scatter_round_trip_in_tier_layout():
    layers, ratio, bs, h, d = 3, 2, 16, 2, 64
    ks, vs, ids, slots = None, None, None, None
    g = torch.Generator().manual_seed(0)
    ks = [torch.randn((24, bs, h, d), generator=g).half() for _ in range(layers)]
    vs = [torch.randn((24, bs, h, d), generator=g).half() for _ in range(layers)]
    ids = torch.tensor([[3, 7], [11, 2], [-1, 5]])
    slots = [torch.zeros(layers * 2 * ratio * bs * h * d, dtype=torch.float16) for _ in range(3)]
    reference.gather_blocks(ks, vs, ids, slots)
    # tierd's layout: [layers, 2, ratio * block_size tokens, kv_heads, head_dim]
    s0 = slots[0].view(layers, 2, ratio * bs, h, d)
    for layer in range(layers):
        assert torch.equal(s0[layer, 0], torch.cat([ks[layer][3], ks[layer][7]]))
        assert torch.equal(s0[layer, 1], torch.cat([vs[layer][3], vs[layer][7]]))
    assert not slots[2].view(layers, 2, ratio, -1)[:, :, 0].any()     # the -1 part left alone
    ks2 = [torch.zeros_like(k) for k in ks]
    vs2 = [torch.zeros_like(v) for v in vs]
    reference.scatter_blocks(ks2, vs2, ids, slots)
    for layer in range(layers):
        for b in (3, 7, 11, 2, 5):
            assert torch.equal(ks2[layer][b], ks[layer][b]) and torch.equal(vs2[layer][b], vs[layer][b])
        assert not ks2[layer][0].any()


@pytest.mark.parametrize("planes", [2, 1], ids=["kv", "latent"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float8_e4m3fn])
def test_host_memory_moves_equal_tensor_copies_for_runs_gaps_and_skipped_parts(planes, dtype):
    """Contiguous host caches are copied by memory moves, one per run of consecutive engine
    blocks; the same copies through tensor indexing (strided views of the same values) give the
    same bytes in both directions, whatever the runs, gaps and skipped parts."""
    layers, ratio, bs, h, d, nb = 2, 4, 16, 2, 32, 40
    g = torch.Generator().manual_seed(3)

    def caches():
        return [torch.randn((nb, bs, h, d), generator=g).to(dtype) for _ in range(layers)]

    def strided(cs):             # the same values in views that are not contiguous
        out = []
        for c in cs:
            wide = torch.zeros((nb, bs, h, 2 * d), dtype=torch.uint8).view(dtype) if dtype.itemsize == 1 \
                else torch.zeros((nb, bs, h, 2 * d), dtype=dtype)
            view = wide[..., :d]
            view.view(torch.uint8).copy_(c.view(torch.uint8)) if dtype.itemsize == 1 else view.copy_(c)
            out.append(view)
        return out
    ks = caches()
    vs = caches() if planes == 2 else None
    ks_strided = strided(ks)
    vs_strided = None if vs is None else strided(vs)
    assert ks[0].is_contiguous() and not ks_strided[0].is_contiguous()
    ids = torch.tensor([[4, 5, 6, 7], [8, 9, 20, 21], [-1, 30, 31, -1], [33, 2, 35, 36], [-1, -1, -1, -1]])
    size = layers * planes * ratio * bs * h * d
    slots = [torch.zeros(size, dtype=torch.uint8).view(dtype) if dtype.itemsize == 1 else torch.zeros(size, dtype=dtype)
             for _ in range(len(ids))]
    want = [x.clone() for x in slots]
    reference.gather_blocks(ks, vs, ids, slots)
    reference.gather_blocks(ks_strided, vs_strided, ids, want)
    assert all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(slots, want))
    assert slots[0].view(torch.uint8).any()
    fresh = [torch.randint(0, 255, (size * dtype.itemsize,), dtype=torch.uint8, generator=g).view(dtype)
             for _ in range(len(ids))]
    reference.scatter_blocks(ks, vs, ids, fresh)
    reference.scatter_blocks(ks_strided, vs_strided, ids, fresh)
    for a, b in zip((*ks, *(vs or ())), (*ks_strided, *(vs_strided or ()))):
        assert torch.equal(a.view(torch.uint8), b.contiguous().view(torch.uint8))
    with pytest.raises(IndexError):                  # never a move past the cache
        reference.scatter_blocks(ks, vs, torch.tensor([[nb - 1, nb, -1, -1]]), fresh[:1])


@pytest.mark.parametrize("layout", cases.LAYOUTS)
def test_reference_cache_ops_take_every_engine_layout(layout):
    """reshape_and_cache, gather and scatter on views of a cache laid out as engines keep it (K
    and V in one tensor, head-major, side by side in a row) do what they do on contiguous caches."""
    layers, ratio, bs, h, d, nb = 2, 2, 16, 2, 64, 12
    g = torch.Generator().manual_seed(1)
    made = [cases.cache_views(layout, nb, bs, h, d, lambda s: torch.randn(s, generator=g).half())
            for _ in range(layers)]
    ks, vs = [m[1] for m in made], [m[2] for m in made]
    if layout in ("b2hnd", "bhn2d"):
        assert not ks[0].is_contiguous()
    plain_k, plain_v = [k.contiguous() for k in ks], [v.contiguous() for v in vs]
    ids = torch.tensor([[3, 7], [-1, 2], [11, 0]])
    slots = [torch.zeros(layers * 2 * ratio * bs * h * d, dtype=torch.float16) for _ in range(3)]
    want = [s.clone() for s in slots]
    reference.gather_blocks(ks, vs, ids, slots)
    reference.gather_blocks(plain_k, plain_v, ids, want)
    assert all(torch.equal(a, b) for a, b in zip(slots, want)) and slots[0].any()
    fresh = [torch.randn(s.shape, generator=g).half() for s in slots]
    reference.scatter_blocks(ks, vs, ids, fresh)
    reference.scatter_blocks(plain_k, plain_v, ids, fresh)
    for a, b in zip((*ks, *vs), (*plain_k, *plain_v)):
        assert torch.equal(a, b)
    key = torch.randn((9, h, d), generator=g).half()
    value = torch.randn((9, h, d), generator=g).half()
    slot_mapping = torch.tensor([0, 17, -1, 33, 190, 5, 64, -1, 100])
    reference.reshape_and_cache(key, value, ks[0], vs[0], slot_mapping)
    reference.reshape_and_cache(key, value, plain_k[0], plain_v[0], slot_mapping)
    assert torch.equal(ks[0], plain_k[0]) and torch.equal(vs[0], plain_v[0])
    assert torch.equal(ks[0][190 // bs, 190 % bs], key[4])


def test_reference_fp8_saturates_and_round_trips():
    x = torch.tensor([0.0, 1.0, -1.0, 1e6, -1e6, 0.3])
    q = reference.quantize_fp8(x, 0.5)
    back = reference.dequantize_fp8(q, 0.5, torch.float32)
    assert back[3] == 448 * 0.5 and back[4] == -448 * 0.5     # saturated, not inf
    torch.testing.assert_close(back[[0, 1, 2, 5]], x[[0, 1, 2, 5]], atol=0.02, rtol=0.07)


# -- the dispatcher: a wrong kernel is harmless ----------------------------------------------------
def test_a_wrong_kernel_is_never_used(caplog):
    calls = []

    def wrong(*args, **kwargs):
        calls.append(1)
        return reference.paged_attention_decode(*args, **kwargs) + 0.01

    op = KernelOp("decode", reference.paged_attention_decode, wrong, case=cases.attention_case,
                  compare=close(atol=1e-3), devices=("cpu",))
    a = cases.decode_inputs("cpu", batch=2, heads=4, kv_heads=2, head_dim=64, block_size=16, num_blocks=32,
                            max_len=50, dtype=torch.float32)
    with caplog.at_level(logging.WARNING, logger="tierd.kernels"):
        out = op(**a)
        out2 = op(**a)
    assert torch.equal(out, reference.paged_attention_decode(**a)) and torch.equal(out2, out)
    assert op.status(torch.device("cpu")).startswith("reference: self-check failed")
    assert len(calls) == 3                   # only the self-check's three sub-cases ran it
    assert sum("failed its self-check" in r.message for r in caplog.records) == 1   # logged once


def test_a_wrong_in_place_kernel_never_touches_the_callers_buffers():
    def wrong_gather(ks, vs, ids, slots):
        for s in slots:
            s.fill_(7)

    op = KernelOp("gather", reference.gather_blocks, wrong_gather, case=cases.gather_case, devices=("cpu",))
    want = cases.gather_case(torch.device("cpu"), reference.gather_blocks)
    got = cases.gather_case(torch.device("cpu"), op)
    assert all(same_bytes(w, g) for w, g in zip(want, got))


def test_a_kernel_that_cannot_compile_or_raises_later_falls_back():
    def broken(*a, **k):
        raise RuntimeError("nvrtc: error: identifier undefined")

    op = KernelOp("q", reference.quantize_fp8, broken, case=cases.quantize_case, devices=("cpu",))
    x = torch.randn(100)
    assert same_bytes(op(x, 0.1), reference.quantize_fp8(x, 0.1))
    assert "self-check failed" in op.status(torch.device("cpu"))

    state = {"n": 0}

    def flaky(x, scale):
        state["n"] += 1
        if state["n"] > 3:                  # passes the self-check's three calls, then fails
            raise RuntimeError("an illegal memory access was encountered")
        return reference.quantize_fp8(x, scale)

    op = KernelOp("q", reference.quantize_fp8, flaky, case=cases.quantize_case, devices=("cpu",))
    assert same_bytes(op(x, 0.1), reference.quantize_fp8(x, 0.1))
    assert op.status(torch.device("cpu")).startswith("reference: raised")
    assert same_bytes(op(x, 0.1), reference.quantize_fp8(x, 0.1)) and state["n"] == 4


def test_a_correct_kernel_is_used_after_its_check():
    used = []

    def good(x, scale):
        used.append(1)
        return reference.quantize_fp8(x, scale)

    op = KernelOp("q", reference.quantize_fp8, good, case=cases.quantize_case, devices=("cpu",))
    op(torch.randn(10), 0.2)
    assert op.status(torch.device("cpu")) == "kernel" and len(used) == 4


def test_reference_int4_decode_matches_the_engine_path():
    """The int4 kernel's reference and the engine's int4 attention agree on a batched decode
    step (one ground truth), for the dtypes and groups the self-check uses."""
    from tierd.engine.attention import AttentionMetadata, paged_attention_int4
    for dtype, group, bs in ((torch.float32, 32, 16), (torch.float32, 16, 32), (torch.float16, 64, 16)):
        a = cases.int4_inputs("cpu", dtype=dtype, group=group, block_size=bs, max_len=200, seed=group + bs)
        seqs = [(i, 1, int(a["seq_lens"][i]), a["block_tables"][i].long()) for i in range(3)]
        engine = paged_attention_int4(a["q"], a["cache"], AttentionMetadata(seqs, bs), a["scale"])
        args = {k: v for k, v in a.items() if k not in ("cache", "k")}
        ref = reference.paged_attention_int4_decode(**args)
        tol = 1e-5 if dtype == torch.float32 else 2e-3
        torch.testing.assert_close(engine.float(), ref.float(), atol=tol, rtol=tol)
    # and it is attention over what was cached: exact keys give a different answer
    a = cases.int4_inputs("cpu", dtype=torch.float32, group=32, max_len=100)
    args = {k: v for k, v in a.items() if k not in ("cache", "k")}
    quant = reference.paged_attention_int4_decode(**args)
    assert not torch.allclose(quant, reference.paged_attention_int4_decode(
        **{**args, "k_min": args["k_min"] * 0, "k_step": args["k_step"] * 0}), atol=1e-3)


def test_on_cpu_the_real_ops_run_their_references_or_the_checked_c_kernels():
    x = torch.randn(100)
    assert same_bytes(K.quantize_fp8(x, 0.1), reference.quantize_fp8(x, 0.1))
    assert K.status("cpu")["quantize_fp8"] == "unchecked"              # no kernel for CPU tensors
    a = cases.decode_inputs("cpu", batch=2, heads=4, kv_heads=2, head_dim=64, block_size=16, num_blocks=32,
                            max_len=40, dtype=torch.float32)
    torch.testing.assert_close(K.paged_attention_decode(**a), reference.paged_attention_decode(**a),
                               atol=1e-5, rtol=1e-5)
    assert K.status("cpu")["paged_attention_decode"] == ("kernel" if K.native.available() else
                                                          "reference: no cpu kernel here")
    fp8 = cases.decode_inputs("cpu", batch=2, heads=4, kv_heads=2, head_dim=64, block_size=16, num_blocks=32,
                              max_len=40, dtype=torch.float16, fp8=True)
    assert torch.equal(K.paged_attention_decode(**fp8), reference.paged_attention_decode(**fp8))   # the reference's


@needs_cc
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_c_decode_attention_matches_the_reference_and_reads_nothing_past_a_length(dtype):
    """GQA groups of 1 to 8, ragged head and block sizes, NaN past every length (one NaN read
    would show), a batch split across threads; and bad tables refused before any read."""
    from tierd.kernels import native
    for heads, kvh, d, bs, batch in ((8, 1, 64, 16, 7), (6, 3, 20, 5, 4), (4, 4, 128, 32, 1), (16, 2, 72, 8, 9)):
        a = cases.decode_inputs("cpu", batch=batch, heads=heads, kv_heads=kvh, head_dim=d, block_size=bs,
                                num_blocks=400, max_len=300, dtype=dtype, seed=heads * d)
        got = native.paged_attention_decode(**a)
        want = reference.paged_attention_decode(**a)
        assert got.dtype == want.dtype and not got.isnan().any()
        torch.testing.assert_close(got.float(), want.float(), atol=2e-3 if dtype == torch.bfloat16 else 1e-5,
                                   rtol=1e-2 if dtype == torch.bfloat16 else 1e-5)
    bad = dict(a, block_tables=a["block_tables"].clone())
    bad["block_tables"][0, 0] = 400
    with pytest.raises(ValueError):
        native.paged_attention_decode(**bad)
    with pytest.raises(ValueError):
        native.paged_attention_decode(**dict(a, seq_lens=a["seq_lens"] + bs * a["block_tables"].shape[1]))


# -- the C block copy on the CPU -------------------------------------------------------------------


def test_c_source_compiles_with_warnings_as_errors(tmp_path):
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler")
    r = subprocess.run([cc, "-O2", "-march=native", "-Wall", "-Wextra", "-Werror", "-fPIC", "-shared",
                        str(KERNEL_DIR / "cpu_copy.c"), "-o", str(tmp_path / "c.so")],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr


@needs_cc
@pytest.mark.skipif(platform.machine() != "x86_64", reason="SIMD paths are x86's")
def test_c_block_copy_without_simd_matches_the_reference():
    """The portable tiles (what a CPU without AVX or SSE2 runs) give the same bytes."""
    from tierd.kernels import native
    lib = native._build((("-mno-avx", "-mno-sse2"),))
    for layout, dtype, bs, d in (("cpu_attn", torch.float32, 24, 20), ("cpu_attn", torch.bfloat16, 24, 20),
                                 ("cpu_amx", torch.bfloat16, 32, 48)):
        for scatter in (False, True):
            ref = reference.scatter_blocks if scatter else reference.gather_blocks
            want = cases.block_copy_case(torch.device("cpu"), ref, scatter=scatter, layout=layout, dtype=dtype,
                                         block_size=bs, head_dim=d, seed=3)
            for stream in (False, True):
                got = cases.block_copy_case(
                    torch.device("cpu"),
                    lambda *a: native._copy_blocks(*a, to_slots=not scatter, lib=lib, stream=stream),
                    scatter=scatter, layout=layout, dtype=dtype, block_size=bs, head_dim=d, seed=3)
                assert all(same_bytes(w, g) for w, g in zip(want, got, strict=True))


@needs_cc
@pytest.mark.parametrize("bs,d,heads", [(32, 64, 3), (128, 128, 2), (64, 32, 1)])
def test_c_block_copy_of_amx_tiles_matches_the_reference(bs, d, heads):
    """vLLM's "amx" CPU attention layout (K in 16-token tiles of head_dim pairs, V in 16-column
    tiles of token pairs): the C copy (tile transposes and pair interleaves) gives the
    reference's bytes both ways, and takes these views (it does not hand them to the reference)."""
    from tierd.kernels import native
    for scatter in (False, True):
        kw = dict(scatter=scatter, layout="cpu_amx", dtype=torch.bfloat16, block_size=bs, head_dim=d,
                  kv_heads=heads, seed=bs + d)
        want = cases.block_copy_case(torch.device("cpu"), reference.scatter_blocks if scatter else
                                     reference.gather_blocks, **kw)
        # on the caller alone, and split into items (the OpenMP team's on this, the main thread)
        for stream, threads in ((False, 1), (True, 1), (True, 3)):
            got = cases.block_copy_case(torch.device("cpu"),
                                        lambda *a: native._copy_blocks(*a, to_slots=not scatter, stream=stream,
                                                                       threads=threads),
                                        **kw)
            assert all(same_bytes(w, g) for w, g in zip(want, got, strict=True))
    # views that are not the tiles' (K and V swapped) are refused, not copied wrong
    t = torch.zeros(4, heads, 2 * bs * d, dtype=torch.bfloat16)
    from tierd.connectors.vllm_layout import amx_views
    k, v = amx_views(t, bs, d)
    with pytest.raises(ValueError, match="AMX tiles"):
        native.gather_blocks([v], [k], torch.tensor([[0, 1]]), [torch.zeros(4 * bs * heads * d, dtype=torch.bfloat16)])


@needs_cc
@pytest.mark.parametrize("stream,threads", [(None, None), (True, 1), (True, 3), (False, 2)],
                         ids=["by-size", "streamed", "streamed-3-threads", "2-threads"])
@pytest.mark.parametrize("layout", [*cases.LAYOUTS, "cpu_attn"])
@pytest.mark.parametrize("dtype,bs,d", [(torch.float32, 16, 64), (torch.bfloat16, 32, 128), (torch.float16, 13, 36),
                                        (torch.float8_e4m3fn, 16, 64), (torch.float32, 7, 9),
                                        # rows of half a line (16 tokens of 2 bytes); a block's K plane
                                        # past the transposing load's bounce buffer (read per head)
                                        (torch.bfloat16, 16, 64), (torch.float32, 256, 128)])
def test_c_block_copy_matches_the_reference_on_every_layout(layout, dtype, bs, d, stream, threads):
    """Bit for bit what the reference does, both ways, on every engine layout (vLLM's CPU
    attention's transposed K among them), for 4-, 2- and 1-byte elements and sizes that are no
    multiple of its 8 x 8 tiles; parts marked -1 untouched. Through plain stores (what a copy
    this small uses) and streaming stores (copies over a MiB: runs and rows of any length and
    alignment, their partial lines written as usual), on the caller alone and split by plane and
    layer across helper threads (copies over a MiB)."""
    from tierd.kernels import native
    for scatter in (False, True):
        want = cases.block_copy_case(torch.device("cpu"), reference.scatter_blocks if scatter else
                                     reference.gather_blocks, scatter=scatter, layout=layout, dtype=dtype,
                                     block_size=bs, head_dim=d, kv_heads=3, seed=bs + d)
        got = cases.block_copy_case(torch.device("cpu"),
                                    lambda *a: native._copy_blocks(*a, to_slots=not scatter, stream=stream,
                                                                   threads=threads),
                                    scatter=scatter, layout=layout, dtype=dtype, block_size=bs, head_dim=d,
                                    kv_heads=3, seed=bs + d)
        untouched = cases.block_copy_case(torch.device("cpu"), lambda *a: None, scatter=scatter, layout=layout,
                                          dtype=dtype, block_size=bs, head_dim=d, kv_heads=3, seed=bs + d)
        assert all(same_bytes(w, g) for w, g in zip(want, got, strict=True))
        assert not all(same_bytes(w, u) for w, u in zip(want, untouched))     # the case copies something


@needs_cc
def test_cpu_ops_use_the_c_copy_after_its_check_and_fall_back_for_what_it_does_not_take():
    from tierd.kernels import native
    cpu = torch.device("cpu")
    assert K.gather_blocks.use_kernel(cpu) and K.scatter_blocks.use_kernel(cpu), K.status("cpu")
    assert native.available() and native.why_not() is None
    layers, ratio, bs, h, d, nb = 2, 2, 16, 2, 32, 8
    made = [cases.cache_views("cpu_attn", nb, bs, h, d, lambda s: torch.zeros(s)) for _ in range(layers)]
    ks, vs = [m[1] for m in made], [m[2] for m in made]
    slot = torch.randn(layers * 2 * ratio * bs * h * d)
    with pytest.raises(IndexError):             # never a copy past the cache: the reference's error
        K.scatter_blocks(ks, vs, torch.tensor([[nb - 1, nb]]), [slot])
    assert all(not m[0][0].any() for m in made)    # nothing was copied, not even the valid part first
    with pytest.raises(ValueError):
        native.scatter_blocks(ks, vs, torch.tensor([[0, 1]]), [slot[:-1]])    # a slot too small
    K.scatter_blocks(ks, vs, torch.tensor([[5, -1]]), [slot])
    want = slot.view(layers, 2, ratio, bs, h, d)
    assert torch.equal(ks[1][5], want[1, 0, 0]) and torch.equal(vs[0][5], want[0, 1, 0])
    assert K.scatter_blocks.status(cpu) == "kernel"   # bad input never unpins it


def random_caches(layers: int, ratio: int, num_blocks: int, *, heads: int, head_dim: int, seed: int,
                  block_size: int = 16):
    """K and V caches of `layers` layers (float32, random), and the bytes of one tier block of
    `ratio` engine blocks of them."""
    g = torch.Generator().manual_seed(seed)
    ks = [torch.randn(num_blocks, block_size, heads, head_dim, generator=g) for _ in range(layers)]
    vs = [torch.randn(num_blocks, block_size, heads, head_dim, generator=g) for _ in range(layers)]
    return ks, vs, layers * 2 * ratio * block_size * heads * head_dim * 4


@needs_cc
def test_a_copy_plan_takes_the_stores_buffers_as_they_are_and_copies_runs_and_gaps_exactly():
    """What a BlockTransfer on CPU caches copies through: the caches' geometry checked once, the
    store's numpy buffers (a lease's read-only views too) used in place. Runs of consecutive
    blocks, a reversed run, a skipped part and a part at block 0 give the reference's bytes."""
    from tierd.kernels import native
    layers, ratio, nb = 3, 4, 16
    ks, vs, bb = random_caches(layers, ratio, nb, heads=2, head_dim=32, seed=5)
    ids = torch.tensor([[3, 4, 5, 6], [9, -1, 10, 11], [15, 14, 13, 0]])
    slots = [np.zeros(bb, np.uint8) for _ in range(3)]
    native.CopyPlan(ks, vs).copy(ids, slots, to_slots=True)
    want = [torch.zeros(bb, dtype=torch.uint8) for _ in range(3)]
    reference.gather_blocks(ks, vs, ids, want)
    assert all(np.array_equal(s, w.numpy()) for s, w in zip(slots, want))
    assert not np.any(slots[1].reshape(layers, 2, ratio, -1)[:, :, 1])      # the skipped part
    ro = [s.copy() for s in slots]
    for r in ro:
        r.flags.writeable = False
    ks2, vs2 = [torch.zeros_like(k) for k in ks], [torch.zeros_like(v) for v in vs]
    plan = native.CopyPlan(ks2, vs2)
    plan.copy(ids, ro, to_slots=False)
    kw, vw = [torch.zeros_like(k) for k in ks], [torch.zeros_like(v) for v in vs]
    reference.scatter_blocks(kw, vw, ids, [torch.from_numpy(s) for s in slots])
    assert all(torch.equal(a, b) for a, b in zip(ks2 + vs2, kw + vw))
    with pytest.raises(ValueError):
        plan.copy(ids, ro, to_slots=True)                     # a lease's view is never written
    with pytest.raises(ValueError):
        plan.copy(ids, [s[:-1] for s in slots], to_slots=False)   # a slot too small
    with pytest.raises(ValueError):
        plan.copy(ids, [np.zeros(2 * bb, np.uint8)[::2] for _ in slots], to_slots=False)   # not contiguous
    # block ids as a numpy array (a CPU load's), then a second copy of the same shape with other
    # ids and other slots: the items kept from the first take the new addresses
    k4, v4 = [torch.zeros_like(k) for k in ks], [torch.zeros_like(v) for v in vs]
    p4 = native.CopyPlan(k4, v4)
    p4.copy(ids.numpy(), ro, to_slots=False)
    assert all(torch.equal(a, b) for a, b in zip(k4 + v4, kw + vw))
    ids2 = torch.tensor([[1, 2, 7, 8], [12, 13, -1, 0], [6, 5, 4, 3]])
    other = [np.random.default_rng(i).integers(0, 256, bb, dtype=np.uint8) for i in range(3)]
    p4.copy(ids2.numpy(), other, to_slots=False)
    kx, vx = [k.clone() for k in kw], [v.clone() for v in vw]
    reference.scatter_blocks(kx, vx, ids2, [torch.from_numpy(o) for o in other])
    assert all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(k4 + v4, kx + vx))   # (bytes: NaNs)
    before = [c.clone() for c in ks2 + vs2]
    for threads in (1, 2, 5):      # split across helper threads too: no part copied by any of them
        with pytest.raises(ValueError, match="out of range"):
            plan.copy(torch.tensor([[1, 2, 3, nb]]), ro[:1], to_slots=False, threads=threads)
        assert all(torch.equal(a, b) for a, b in zip(before, ks2 + vs2))   # nothing copied, not even a part
    for threads in (2, 5):          # and a split copy gives the same bytes both ways
        back = [np.zeros(bb, np.uint8) for _ in range(3)]
        plan.copy(ids, back, to_slots=True, threads=threads)
        assert all(np.array_equal(a, b) for a, b in zip(back, slots))
        k3, v3 = [torch.zeros_like(k) for k in ks], [torch.zeros_like(v) for v in vs]
        native.CopyPlan(k3, v3).copy(ids, ro, to_slots=False, threads=threads)
        assert all(torch.equal(a, b) for a, b in zip(k3 + v3, kw + vw))


@needs_cc
def test_a_split_copy_runs_on_torchs_openmp_team_on_the_main_thread_and_on_helpers_elsewhere():
    """A large copy's items go to the OpenMP team torch computes with where the caller is the
    main thread (whose team's threads still spin after a forward), else to helper threads of
    our own (a background thread's team would spin beside the engine's compute). Both give the
    reference's bytes, both ways; an id out of range copies nothing on either."""
    import threading

    from tierd.kernels import native
    if torch._C.has_openmp:
        assert native.omp_team() is not None        # this torch's runtime is found
    seen = []
    t = threading.Thread(target=lambda: seen.append(native.omp_team()))
    t.start()
    t.join()
    assert seen == [None]
    nb = 32
    ks, vs, bb = random_caches(4, 4, nb, heads=4, head_dim=64, seed=7)
    ids = torch.tensor([[3, 4, 5, 6], [9, -1, 10, 11], [31, 14, 13, 0]])
    want = [torch.zeros(bb, dtype=torch.uint8) for _ in range(3)]
    reference.gather_blocks(ks, vs, ids, want)

    def both_ways(out: list) -> None:
        slots = [np.zeros(bb, np.uint8) for _ in range(3)]
        native.CopyPlan(ks, vs).copy(ids, slots, to_slots=True, threads=3, stream=True)
        k2, v2 = [torch.zeros_like(k) for k in ks], [torch.zeros_like(v) for v in vs]
        plan = native.CopyPlan(k2, v2)
        plan.copy(ids, slots, to_slots=False, threads=2)
        bad = [torch.zeros_like(k) for k in ks]
        try:
            native.CopyPlan(bad, [torch.zeros_like(v) for v in vs]).copy(
                torch.tensor([[0, 1, 2, nb]]), slots[:1], to_slots=False, threads=2)
        except ValueError:
            out.append(not any(b.any() for b in bad))   # nothing copied, not even a part
        out.append((slots, k2, v2))

    main: list = []
    both_ways(main)
    other: list = []
    t = threading.Thread(target=both_ways, args=(other,))
    t.start()
    t.join()
    kw, vw = [torch.zeros_like(k) for k in ks], [torch.zeros_like(v) for v in vs]
    reference.scatter_blocks(kw, vw, ids, want)
    for refused, (slots, k2, v2) in (main, other):
        assert refused is True
        assert all(np.array_equal(s, w.numpy()) for s, w in zip(slots, want))
        assert all(torch.equal(a, b) for a, b in zip(k2 + v2, kw + vw))


# -- on a GPU -------------------------------------------------------------------------------------
needs_gpu = pytest.mark.skipif(not K.available(), reason="needs CUDA and CuPy")


@pytest.mark.gpu
@needs_gpu
def test_gpu_every_op_passes_its_self_check():
    dev = torch.device("cuda")
    for op in K.OPS:
        assert op.use_kernel(dev), f"{op.name}: {op.status(dev)}"


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("version", ["v1", "v2"])
@pytest.mark.parametrize("fp8", [False, True], ids=["kv16", "fp8"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("head_size", HEAD_SIZES)
@pytest.mark.parametrize("heads", HEAD_PAIRS, ids=lambda p: f"{p[0]}q{p[1]}kv")
def test_gpu_decode_grid(heads, head_size, block_size, dtype, fp8, version):
    a = cases.decode_inputs("cuda", batch=7, heads=heads[0], kv_heads=heads[1], head_dim=head_size,
                            block_size=block_size, num_blocks=4096, max_len=1500, dtype=dtype, fp8=fp8,
                            seed=head_size * block_size)
    out = K.ops.paged_attention_decode(**a, version=version)
    want = reference.paged_attention_decode(**a)
    assert not out.isnan().any()
    atol = 1e-2 if fp8 else {torch.bfloat16: 1.6e-2}.get(dtype, 1e-3)
    torch.testing.assert_close(out.float(), want.float(), atol=atol, rtol=0)


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("fp8", [False, True], ids=["kv16", "fp8"])
def test_gpu_cache_ops_are_exact(dtype, fp8):
    dev = torch.device("cuda")
    for w, g in zip(cases.reshape_case(dev, reference.reshape_and_cache, dtype=dtype, fp8=fp8, num_blocks=4096),
                    cases.reshape_case(dev, K.ops.reshape_and_cache, dtype=dtype, fp8=fp8, num_blocks=4096)):
        assert same_bytes(w, g)
    for scatter in (False, True):
        fn_ref = reference.scatter_blocks if scatter else reference.gather_blocks
        fn = K.ops.scatter_blocks if scatter else K.ops.gather_blocks
        kw = dict(scatter=scatter, dtype=dtype, num_blocks=4096, n_tier=64, layers=4)
        for w, g in zip(cases.block_copy_case(dev, fn_ref, **kw), cases.block_copy_case(dev, fn, **kw)):
            assert same_bytes(w, g)
    if dtype != torch.float32 or not fp8:
        return
    for w, g in zip(cases.quantize_case(dev, reference.quantize_fp8), cases.quantize_case(dev, K.ops.quantize_fp8)):
        assert same_bytes(w, g)
    for w, g in zip(cases.dequantize_case(dev, reference.dequantize_fp8),
                    cases.dequantize_case(dev, K.ops.dequantize_fp8)):
        assert same_bytes(w, g)


def test_sources_are_packaged():
    assert {p.name for p in Path(KERNEL_DIR).glob("*.cu")} == set(SOURCES)


# -- the transfer path --------------------------------------------------------------------------------
def _transfer_roundtrip(store, device, name="transfer-test"):
    from tierd import Namespace
    from tierd.kernels.transfer import BlockTransfer
    layers, ratio, bs, h, d = 3, 2, 16, 2, 32
    ns = Namespace(name, "float16", layers, h, d, block_tokens=ratio * bs)
    g = torch.Generator().manual_seed(0)
    ks = [torch.randn((40, bs, h, d), generator=g).half().to(device) for _ in range(layers)]
    vs = [torch.randn((40, bs, h, d), generator=g).half().to(device) for _ in range(layers)]
    src = BlockTransfer(ks, vs, ratio)
    assert src.block_bytes == ns.block_bytes
    from tierd.kernels import native
    assert (src._plan is not None) == (device == "cpu" and native.available())   # the C copy's plan
    assert store.host_array().dtype.itemsize == 1 and store.host_array().nbytes >= 4 * ns.block_bytes
    assert src.attach(store) == (device == "cuda")   # page-locked on CUDA only
    keys = ns.block_keys(list(range(4 * ratio * bs)))
    ids = torch.tensor([[1, 9], [4, 3], [30, 31], [7, 8]])
    assert src.store(store, ns, keys, ids) == 4
    assert src.store(store, ns, keys, ids) == 0                 # already there
    ks2 = [torch.zeros_like(k) for k in ks]
    vs2 = [torch.zeros_like(v) for v in vs]
    dst = BlockTransfer(ks2, vs2, ratio)
    dst_ids = torch.tensor([[20, 21], [-1, 23], [0, 5], [11, 12]])
    assert dst.load(store, ns, keys, dst_ids) == 4
    for (s, t) in [(1, 20), (9, 21), (3, 23), (30, 0), (31, 5), (7, 11), (8, 12)]:
        for layer in range(layers):
            assert torch.equal(ks2[layer][t].cpu(), ks[layer][s].cpu())
            assert torch.equal(vs2[layer][t].cpu(), vs[layer][s].cpu())
    assert not ks2[0][22].any()                                # the -1 part stayed as it was
    # the slot bytes are tierd's block layout, readable by any other client
    (block,) = store.get(ns, keys[1:2])
    t = torch.from_numpy(block).view(torch.float16).view(ns.block_shape)
    assert torch.equal(t[2, 1], torch.cat([vs[2][4], vs[2][3]]).cpu())
    return src, dst


def test_transfer_store_and_load_embedded(host_store):
    _transfer_roundtrip(host_store, "cpu")


def test_transfer_store_and_load_through_the_daemon(daemon):
    import tierd
    with tierd.connect(daemon.url) as c:
        _transfer_roundtrip(c, "cpu")


class RecordingPinning:
    """A stand-in for the CUDA runtime's page-locking: what would be registered, and when."""

    def __init__(self):
        self.pinned: dict[int, int] = {}
        self.calls: list[tuple[str, int]] = []

    def register(self, ptr, size, tag=None):
        assert ptr not in self.pinned, "registered twice"
        self.pinned[ptr] = size
        self.calls.append(("register", ptr))
        return True

    def unregister(self, ptr, tag=None):
        assert ptr in self.pinned, "unregistered a range that was not registered"
        del self.pinned[ptr]
        self.calls.append(("unregister", ptr))


def test_transfer_pins_each_arena_mapping_once_and_never_keeps_stale_pages(daemon):
    """The client re-maps the daemon's arena after a restart: the transfer then unregisters the
    old mapping's range and registers the new one; never twice, never a range it did not pin;
    close() leaves nothing pinned."""
    import tierd
    from tierd import Namespace
    from tierd.kernels.transfer import BlockTransfer
    pin = RecordingPinning()
    ks = [torch.zeros((8, 16, 2, 32), dtype=torch.float16) for _ in range(2)]
    tr = BlockTransfer(ks, [torch.zeros_like(k) for k in ks], 1, pinning=pin)
    ns = Namespace("pin-test", "float16", 2, 2, 32, block_tokens=16)
    with tierd.connect(daemon.url) as c:
        first = c.host_array()
        for _ in range(3):
            assert tr.attach(c)
        assert tr.wait_pinned()                       # registered in the background
        assert pin.pinned == {first.ctypes.data: first.nbytes} and len(pin.calls) == 1
        daemon.kill()
        daemon.start()
        keys = ns.block_keys(list(range(16)))
        assert tr.store(c, ns, keys, torch.tensor([[2]])) == 1    # reconnects, re-maps, re-pins
        second = c.host_array()
        assert tr.wait_pinned()
        # re-pinned even were the new mapping at the old address (other pages behind it)
        assert pin.calls[1:] == [("unregister", first.ctypes.data), ("register", second.ctypes.data)]
        assert pin.pinned == {second.ctypes.data: second.nbytes}
        assert tr.load(c, ns, keys, torch.tensor([[5]])) == 1
    tr.close()
    assert pin.pinned == {}
    cpu = BlockTransfer(ks, ks, 1)                                 # on CPU nothing is pinned
    assert cpu.pinning is None and not cpu.attach(object())


def test_a_re_mapped_arena_is_unpinned_only_after_every_copy_queued_from_it_has_run(daemon):
    """A copy queued from the old mapping (here: not yet run, on a stand-in for streams) must
    have run before the old range is unpinned. It read the old mapping: the block's bytes, or
    zeros where the restarted daemon had already given the old arena's pages back while it
    re-adopted them (a lease of the dead daemon: its load is discarded either way)."""
    import tierd
    from tierd import Namespace
    from tierd.kernels.transfer import BlockTransfer

    from .helpers import LazyStreams
    pin, sx = RecordingPinning(), LazyStreams()
    g = torch.Generator().manual_seed(2)
    ks = [torch.randn((8, 16, 2, 32), generator=g).half() for _ in range(2)]
    vs = [torch.randn((8, 16, 2, 32), generator=g).half() for _ in range(2)]
    tr = BlockTransfer(ks, vs, 1, pinning=pin, streams=sx)
    ns = Namespace("unpin-test", "float16", 2, 2, 32, block_tokens=16)
    keys = ns.block_keys(list(range(16)))
    pending_at_unpin = []
    unregister = pin.unregister

    def watched(ptr, tag=None):
        pending_at_unpin.append(sum(len(st.ops) - st.done for st in sx.streams[1:]))
        unregister(ptr, tag)
    pin.unregister = watched
    with tierd.connect(daemon.url) as c:
        assert tr.store(c, ns, keys, torch.tensor([[2]])) == 1
        lease = c.acquire(ns, keys)
        tr.load_layers(torch.tensor([[5]]), lease.buffers, layered=True)      # queued, not run
        daemon.kill()
        daemon.start()
        c.stats()                                         # a read: reconnects and re-maps the arena
        tr.store(c, ns, keys, torch.tensor([[3]]))        # reconnects, re-maps, re-pins
        assert pending_at_unpin == [0]
        for layer in range(2):
            for c in (ks, vs):
                assert same_bytes(c[layer][5], c[layer][2]) or not c[layer][5].any()
    tr.close()
    assert pin.pinned == {}


@pytest.mark.gpu
@needs_gpu
def test_gpu_transfer_store_and_load(host_store):
    """Two transfers in one process attach the same arena (the runtime refuses a second
    registration of a range): both copy, and the range stays page-locked until the last of
    them closes."""
    from tierd.kernels import transfer
    src, dst = _transfer_roundtrip(host_store, "cuda")
    assert src.wait_pinned() and dst.wait_pinned()     # registered in the background
    ptr = host_store.host_array().ctypes.data
    assert transfer._PINS[ptr][2] == 2                 # one registration, two holders
    src.close()
    assert transfer._PINS[ptr][2] == 1
    torch.empty(1 << 20, dtype=torch.uint8, device="cuda")   # no runtime error left pending
    more = _transfer_roundtrip(host_store, "cuda", "transfer-test-2")   # new transfers beside the open one
    assert all(t.wait_pinned() for t in more)
    dst.close()
    assert transfer._PINS[ptr][2] == 2
    for t in more:
        t.close()
    assert ptr not in transfer._PINS


# -- stream ordering, with a CPU stand-in for CUDA streams -------------------------------------------
def _lazy_transfer(layout: str = "contiguous"):
    from tierd.kernels.transfer import BlockTransfer
    from tests.helpers import LazyStreams
    layers, ratio, bs, h, d, nb = 3, 2, 16, 2, 32, 16
    g = torch.Generator().manual_seed(3)
    made = [cases.cache_views(layout, nb, bs, h, d, lambda s: torch.randn(s, generator=g).half())
            for _ in range(layers)]
    sx = LazyStreams()
    tr = BlockTransfer([m[1] for m in made], [m[2] for m in made], ratio, streams=sx)
    return tr, sx


@pytest.mark.parametrize("layout", ["contiguous", "b2hnd"])
def test_a_layered_load_gives_the_compute_stream_each_layer_after_its_copy_and_no_earlier(layout):
    tr, sx = _lazy_transfer(layout)
    ids = torch.tensor([[3, 5], [8, -1]])
    g = torch.Generator().manual_seed(4)
    bufs = [torch.randint(0, 256, (tr.block_bytes,), generator=g, dtype=torch.uint8).numpy() for _ in range(2)]
    before = [k[3].clone() for k in tr.k]
    seen = []
    # work the engine queued before the load: it must read the blocks as they were
    sx.run(sx.compute, lambda: seen.append(tr.k[0][3].clone()))
    job = tr.load_layers(ids, bufs, layered=True)
    assert all(same_bytes(k[3], b) for k, b in zip(tr.k, before))   # nothing ran yet
    want = [torch.from_numpy(b).view(torch.float16).view(tr.layers, 2, 2, 16, 2, 32) for b in bufs]
    for layer in range(tr.layers):
        job.wait_layer(layer)
        sx.settle()
        assert same_bytes(tr.k[layer][3], want[0][layer, 0, 0]) and same_bytes(tr.v[layer][8], want[1][layer, 1, 0])
        if layer + 1 < tr.layers:     # the next layer is still on its way: layered, not all at once
            assert same_bytes(tr.k[layer + 1][3], before[layer + 1])
    assert same_bytes(seen[0], before[0])
    assert ("side2", "compute") in sx.waits          # the load stream waited for queued compute work
    job.synchronize()


def test_a_save_copies_what_the_forward_wrote_and_its_bytes_are_there_only_after_its_event():
    tr, sx = _lazy_transfer()
    ids = torch.tensor([[2, 4]])
    buf = np.zeros(tr.block_bytes, dtype=np.uint8)
    sx.run(sx.compute, lambda: tr.k[1][4].fill_(7.0))            # the forward writes a block
    ev = tr.save_async(ids, [buf])
    assert not buf.any()                                           # queued, not copied
    sx.synchronize(ev)
    got = torch.from_numpy(buf).view(torch.float16).view(tr.layers, 2, 2, 16, 2, 32)
    assert bool((got[1, 0, 1] == 7.0).all()) and same_bytes(got[0, 1, 0], tr.v[0][2])


def test_work_queued_after_a_save_may_reuse_its_blocks_once_they_are_gathered():
    tr, sx = _lazy_transfer()
    buf = np.zeros(tr.block_bytes, dtype=np.uint8)
    want = tr.k[2][5].clone()
    ev = tr.save_async(torch.tensor([[5, 6]]), [buf])
    sx.run(sx.compute, lambda: tr.k[2][5].fill_(-1.0))           # block 5 freed and written again
    sx.settle()
    sx.synchronize(ev)
    got = torch.from_numpy(buf).view(torch.float16).view(tr.layers, 2, 2, 16, 2, 32)
    assert same_bytes(got[2, 0, 0], want)


def test_hbm_copies_on_the_engines_device_are_scattered_from_there():
    """A tier block whose HBM copy is on the engine's device is copied from it (device to
    device), not from its host copy; others come from the host."""
    tr, sx = _lazy_transfer()
    ids = torch.tensor([[1, 2], [6, 7]])
    g = torch.Generator().manual_seed(5)
    host = [torch.randint(0, 256, (tr.block_bytes,), generator=g, dtype=torch.uint8).numpy() for _ in range(2)]
    device_copy = torch.randint(0, 256, (tr.block_bytes,), generator=g, dtype=torch.uint8)
    job = tr.load_layers(ids, host, [device_copy, None], layered=True)
    job.wait_all()
    sx.settle()
    first = device_copy.view(torch.float16).view(tr.layers, 2, 2, 16, 2, 32)
    second = torch.from_numpy(host[1]).view(torch.float16).view(tr.layers, 2, 2, 16, 2, 32)
    for layer in range(tr.layers):
        assert same_bytes(tr.k[layer][1], first[layer, 0, 0]) and same_bytes(tr.v[layer][7], second[layer, 1, 1])


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("layout", ["contiguous", "b2hnd"])
def test_gpu_layered_load_and_async_save_with_real_streams(layout):
    """On CUDA: a save while the compute stream is busy copies what the forward wrote; a layered
    load, each layer waited for by the compute stream, puts the exact bytes in place."""
    from tierd.kernels.transfer import BlockTransfer
    layers, ratio, bs, h, d, nb = 4, 4, 16, 8, 128, 64
    g = torch.Generator().manual_seed(9)
    made = [cases.cache_views(layout, nb, bs, h, d, lambda s: torch.randn(s, generator=g).half().cuda())
            for _ in range(layers)]
    tr = BlockTransfer([m[1] for m in made], [m[2] for m in made], ratio)
    ids = torch.randperm(nb, generator=g)[:3 * ratio].view(3, ratio)
    host = [torch.zeros(tr.block_bytes, dtype=torch.uint8).pin_memory() for _ in range(3)]
    busy = torch.randn((4096, 4096), device="cuda")
    _ = busy @ busy                                          # keep the compute stream busy
    for k in tr.k:
        k[ids[0, 0]].fill_(5.0)                              # the forward's last write
    ev = tr.save_async(ids, [x.numpy() for x in host])
    ev.synchronize()
    want = [torch.zeros(tr.block_bytes, dtype=torch.uint8) for _ in range(3)]
    reference.gather_blocks([k.cpu() for k in tr.k], [v.cpu() for v in tr.v], ids, want)
    assert all(same_bytes(a, b) for a, b in zip(host, want))
    made2 = [cases.cache_views(layout, nb, bs, h, d, lambda s: torch.zeros(s).half().cuda()) for _ in range(layers)]
    dst = BlockTransfer([m[1] for m in made2], [m[2] for m in made2], ratio)
    _ = busy @ busy
    job = dst.load_layers(ids, [x.numpy() for x in host], layered=True)
    got = []
    for layer in range(layers):
        job.wait_layer(layer)
        got.append((dst.k[layer][ids.flatten().cuda()].clone(), dst.v[layer][ids.flatten().cuda()].clone()))
    job.synchronize()
    for layer in range(layers):
        assert same_bytes(got[layer][0], tr.k[layer][ids.flatten().cuda()])
        assert same_bytes(got[layer][1], tr.v[layer][ids.flatten().cuda()])


# -- layer groups (vLLM's hybrid manager: per-group block ids from one pool, aliased layers) ---------
@pytest.mark.parametrize("layout", ["plain", "vllm-cpu"])
@pytest.mark.parametrize("staged", [False, True])
def test_layer_groups_copy_each_layer_through_its_groups_blocks_and_save_zeros_for_skipped_parts(staged, layout):
    """Layers 0 and 2 form group 0, layers 1 and 3 group 1, and layer 0 aliases layer 1's memory
    (layer 2 layer 3's), as vLLM lays a hybrid model out: block 5 belongs to group 0, block 6 to
    group 1. A save reads each layer through its group's ids and writes zeros for a skipped part
    (a slot that held another block's bytes keeps none of them); a load writes each layer only
    into its group's blocks, never into another group's, which the aliasing would overwrite."""
    from tierd.kernels.transfer import BlockTransfer

    from .helpers import LazyStreams
    ratio, bs, h, d, nb = 2, 16, 2, 32, 12
    g = torch.Generator().manual_seed(7)
    if layout == "plain":
        mem = [torch.randn((nb, 2, bs, h, d), generator=g).half() for _ in range(2)]   # two allocations
        kv = [(m[:, 0], m[:, 1]) for m in mem]
    else:   # vLLM's CPU attention: K transposed in each (block, head)
        from connectors.vllm_layout import CPU_BACKEND, kv_views
        mem = [torch.randn((nb, h, bs, 2 * d), generator=g).half() for _ in range(2)]
        kv = [kv_views(m, CPU_BACKEND, "vec16", bs, h, d) for m in mem]
    ks = [kv[0][0], kv[0][0], kv[1][0], kv[1][0]]                                  # layer i -> mem[i // 2]
    vs = [kv[0][1], kv[0][1], kv[1][1], kv[1][1]]
    sx = LazyStreams() if staged else None
    tr = BlockTransfer(ks, vs, ratio, layer_groups=[0, 1, 0, 1], streams=sx)
    assert (tr._plan is not None) == K.native.available()        # the C copy takes grouped layers
    ids = torch.tensor([[[5, 2], [6, 3]], [[-1, 9], [7, 8]]])       # (tier blocks, groups, ratio)
    bufs = [np.full(tr.block_bytes, 0xAB, dtype=np.uint8) for _ in range(2)]     # stale slot bytes
    ev = tr.save_async(ids, bufs)
    if staged:
        sx.synchronize(ev)
    got = [torch.from_numpy(b).view(torch.float16).view(4, 2, ratio, bs, h, d) for b in bufs]
    for layer in range(4):
        grp = [0, 1, 0, 1][layer]
        for t in range(2):
            for r in range(ratio):
                b = int(ids[t, grp, r])
                for kv, caches in ((0, ks), (1, vs)):
                    if b < 0:
                        assert not got[t][layer, kv, r].view(torch.uint8).any(), (layer, t, r)
                    else:
                        assert same_bytes(got[t][layer, kv, r], caches[layer][b]), (layer, t, r)
    # load into other blocks of each group; everything else, in either group, stays as it was
    before = [m.clone() for m in mem]
    dst = torch.tensor([[[10, 11], [1, 0]], [[4, -1], [-1, 2]]])
    job = tr.load_layers(dst, bufs, layered=staged)
    job.wait_all()
    if staged:
        sx.settle()
    job.synchronize()
    written = {(layer // 2, int(dst[t, layer % 2, r])) for layer in range(4) for t in range(2) for r in range(ratio)
               if dst[t, layer % 2, r] >= 0}
    for layer in range(4):
        for t in range(2):
            for r in range(ratio):
                b = int(dst[t, layer % 2, r])
                if b >= 0:
                    assert same_bytes(ks[layer][b], got[t][layer, 0, r]) and same_bytes(vs[layer][b], got[t][layer, 1, r])
    for m in range(2):
        for b in range(nb):
            if (m, b) not in written:
                assert same_bytes(mem[m][b], before[m][b]), (m, b)
    with pytest.raises(ValueError, match="groups"):
        tr.load_layers(torch.tensor([[5, 2]]), bufs[:1])               # flat ids for grouped layers


def test_latent_caches_round_trip_as_one_plane_per_layer(host_store):
    """MLA's caches (a row of kv_lora_rank + rope dims per token, no V): a tier block is
    [layers, block_tokens, latent], token-major per layer, as a latent namespace says."""
    from tierd import Namespace
    from tierd.kernels.transfer import BlockTransfer
    layers, ratio, bs, latent = 3, 2, 16, 576
    ns = Namespace("latent-test", "float16", layers, 1, latent, block_tokens=ratio * bs, planes=1)
    assert ns.block_shape == (layers, 1, ratio * bs, 1, latent) and ns.block_bytes == layers * ratio * bs * latent * 2
    g = torch.Generator().manual_seed(11)
    caches = [torch.randn((20, 1, bs, latent), generator=g).half() for _ in range(layers)]   # vLLM's (B, 1, N, C)
    views = [c.view(20, bs, 1, latent) for c in caches]
    tr = BlockTransfer(views, None, ratio)
    assert tr.block_bytes == ns.block_bytes
    keys = ns.block_keys(list(range(2 * ratio * bs)))
    assert tr.store(host_store, ns, keys, torch.tensor([[3, 9], [12, 1]])) == 2
    (got,) = host_store.get(ns, keys[1:2])
    t = torch.from_numpy(got).view(torch.float16).view(layers, ratio * bs, latent)
    for layer in range(layers):
        assert torch.equal(t[layer], torch.cat([caches[layer][12, 0], caches[layer][1, 0]]))
    dst = [torch.zeros_like(v) for v in views]
    back = BlockTransfer(dst, None, ratio)
    assert back.load(host_store, ns, keys, torch.tensor([[5, 6], [-1, 8]])) == 2
    for layer in range(layers):
        assert torch.equal(dst[layer][5], views[layer][3]) and torch.equal(dst[layer][8], views[layer][1])
        assert not dst[layer][7].any()
