"""GPU figures of the kernels and the transfer path, each beside its same-run floor or peer:

- store / load of tier blocks through `BlockTransfer` (gather + D2H into a registered host
  buffer; H2D + scatter, whole and layer by layer) beside cudaMemcpyAsync of the same bytes
  from / to pinned memory (torch's non-blocking copy);
- gather / scatter kernels (many blocks, all layers, one launch; per-layer caches and one
  head-major tensor per layer as vLLM's HND caches) beside one device-to-device copy of the
  same bytes;
- paged decode attention (the CUDA kernel's v1 and v2, and the Triton kernel, split-KV and
  GQA-grouped) beside torch's fused SDPA over the same KV already gathered into dense tensors
  (what an engine without paging runs: every sequence at the full context, 4-D tensors, no
  mask, only the fused backends allowed -- `reference.fused_sdpa_decode`), the torch
  reference, and the Triton kernel beside its
  floor: reading the KV bytes once (half a device-to-device copy of them, which reads and
  writes each byte), with which kernel the dispatcher chose for the shape.

Needs CUDA and CuPy (run by benchmarks/gpu_check.sh on a GPU machine); elsewhere it says so and
exits 0.

    python -m benchmarks.gpu_kernels [--json PATH] [--quick]
"""

from __future__ import annotations

import sys

import numpy as np
import torch

from .common import Result, parse_args, report


def cuda_time(fn, repeats: int = 10) -> float:
    """Median seconds of fn() measured with CUDA events (after one warm-up)."""
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    return float(np.median(times))


def main() -> int:
    args = parse_args(__doc__.splitlines()[0])
    import tierd.kernels as K
    if not K.available():
        print("gpu_kernels: CUDA and CuPy are needed; nothing measured")
        return 0
    from tierd.kernels import cases, reference
    from tierd.kernels.transfer import BlockTransfer
    dev = torch.device("cuda")
    results: list[Result] = []

    # -- transfer path: a Llama-8B-shaped layer stack (32 layers, 8 kv heads, head 128), fp16 --
    layers, kvh, hd, bs, ratio = (8 if args.quick else 32), 8, 128, 16, 16
    n_tier = 8 if args.quick else 32
    num_blocks = n_tier * ratio + 16
    ks = [torch.randn((num_blocks, bs, kvh, hd), device=dev, dtype=torch.float16) for _ in range(layers)]
    vs = [torch.randn_like(k) for k in ks]
    tr = BlockTransfer(ks, vs, ratio)
    total = n_tier * tr.block_bytes
    host = np.zeros(total, dtype=np.uint8)
    registered = tr.register_host(host)
    bufs = [host[i * tr.block_bytes:(i + 1) * tr.block_bytes] for i in range(n_tier)]
    ids = torch.randperm(num_blocks)[:n_tier * ratio].view(n_tier, ratio)
    pinned = torch.empty(total, dtype=torch.uint8, pin_memory=True)
    dsrc = torch.empty(total, dtype=torch.uint8, device=dev)
    params = dict(layers=layers, blocks=n_tier * ratio, MiB=round(total / 2 ** 20), registered=registered)
    t_store = cuda_time(lambda: tr.gather_into(ids, bufs))
    t_d2h = cuda_time(lambda: pinned.copy_(dsrc, non_blocking=True))
    results.append(Result("store (gather + D2H)", params, total / t_store / 1e9, "GB/s",
                          "pinned D2H copy", total / t_d2h / 1e9))

    def load():
        ev = tr.scatter_from(ids, bufs)
        ev.synchronize()
    t_load = cuda_time(load)
    t_h2d = cuda_time(lambda: dsrc.copy_(pinned, non_blocking=True))
    results.append(Result("load (H2D + scatter)", params, total / t_load / 1e9, "GB/s",
                          "pinned H2D copy", total / t_h2d / 1e9))

    def load_layered(t=tr):
        job = t.load_layers(ids, bufs, layered=True)
        job.wait_all()
        job.synchronize()
    t_layered = cuda_time(load_layered)
    path = dict(params, path=tr.direct_reason or "staged")
    results.append(Result("load layer by layer", path, total / t_layered / 1e9,
                          "GB/s", "pinned H2D copy", total / t_h2d / 1e9))
    # the same loads through staging copies (H2D copies per layer and tier block, then a scatter)
    staged = BlockTransfer(ks, vs, ratio, direct=False)
    staged.register_host(host)
    t_staged = cuda_time(lambda: load_layered(staged))
    results.append(Result("load layer by layer", dict(params, path="staged (H2D copies + scatter)"),
                          total / t_staged / 1e9, "GB/s", "pinned H2D copy", total / t_h2d / 1e9))
    t_staged_whole = cuda_time(lambda: staged.scatter_from(ids, bufs).synchronize())
    results.append(Result("load (whole blocks)", dict(params, path="staged (H2D copies + scatter)"),
                          total / t_staged_whole / 1e9, "GB/s", "the default path's", total / t_load / 1e9))
    # check the round trips while we are here: each path writes the stored bytes
    for name, make in (("default", lambda k, v: BlockTransfer(k, v, ratio)),
                       ("staged", lambda k, v: BlockTransfer(k, v, ratio, direct=False))):
        ks2 = [torch.zeros_like(k) for k in ks]
        vs2 = [torch.zeros_like(v) for v in vs]
        t2 = make(ks2, vs2)
        t2.register_host(host)
        job = t2.load_layers(ids, bufs, layered=True)
        job.wait_all()
        job.synchronize()
        flat = ids.flatten().to(dev)
        ok = all(torch.equal(ks2[i][flat], ks[i][flat]) and torch.equal(vs2[i][flat], vs[i][flat])
                 for i in range(layers))
        print(f"transfer round trip bit-exact ({name}, {t2.direct_reason or 'staged'}): {ok}")
        t2.close()
    staged.close()

    # -- gather / scatter kernels alone vs a device-to-device copy of the same bytes --
    staging = torch.empty((n_tier, tr.block_bytes), dtype=torch.uint8, device=dev)
    dst = torch.empty_like(staging)
    t_d2d = cuda_time(lambda: dst.copy_(staging))
    hnd = [cases.cache_views("b2hnd", num_blocks, bs, kvh, hd,
                             lambda shape: torch.randn(shape, device=dev, dtype=torch.float16)) for _ in range(layers)]
    hk, hv = [m[1] for m in hnd], [m[2] for m in hnd]
    for layout, (kk, vv) in (("per-layer K and V", (ks, vs)), ("(B, 2, H, N, D) per layer", (hk, hv))):
        t_g = cuda_time(lambda: K.ops.gather_blocks(kk, vv, ids, list(staging)))
        t_s = cuda_time(lambda: K.ops.scatter_blocks(kk, vv, ids, list(staging)))
        for name, t in (("gather_blocks kernel", t_g), ("scatter_blocks kernel", t_s)):
            results.append(Result(name, {**params, "layout": layout}, total / t / 1e9, "GB/s",
                                  "device-to-device copy", total / t_d2d / 1e9))

    # -- paged decode: kernel vs fused SDPA on the same KV made dense, and vs the torch reference --
    from tierd.kernels import triton_decode
    for heads, kv, ctx, version, batch in ((32, 8, 2048, "v1", 16), (32, 8, 16384, "v2", 16),
                                           (64, 8, 4096, "v1", 16), (32, 8, 8192, "v2", 1),
                                           (32, 8, 2048, "v1", 4)):
        if args.quick and ctx > 4096:
            continue
        # every sequence ctx tokens long: the dense KV needs no mask, and both read the same bytes
        a = cases.decode_inputs(dev, batch=batch, heads=heads, kv_heads=kv, head_dim=128, block_size=16,
                                num_blocks=batch * ctx // 16 + 64, max_len=ctx, dtype=torch.float16, full=True)
        t_k = cuda_time(lambda: K.ops.paged_attention_decode(**a, version=version, max_seq_len=ctx), repeats=5)
        # dense K/V (B, kv, ctx, d) of the same tokens, through torch's fused kernel (no mask)
        lens = a["seq_lens"].long()
        kd, vd = reference.dense_kv(a["k_cache"], a["v_cache"], a["block_tables"], ctx)

        def sdpa():
            return reference.fused_sdpa_decode(a["q"], kd, vd, a["scale"])
        got = K.ops.paged_attention_decode(**a, version=version, max_seq_len=ctx)
        diff = (sdpa().float() - got.float()).abs().max().item()
        t_sdpa = cuda_time(sdpa, repeats=5)
        p = dict(batch=batch, heads=heads, kv_heads=kv, max_ctx=ctx, max_abs_diff_vs_sdpa=round(diff, 5))
        results.append(Result(f"paged decode {version}", p, t_k * 1e3, "ms", "fused SDPA on dense KV",
                              t_sdpa * 1e3, higher_is_better=False))
        if ctx <= 4096 and batch >= 16:
            t_r = cuda_time(lambda: reference.paged_attention_decode(**a), repeats=3)
            results.append(Result(f"paged decode {version}", p, t_k * 1e3, "ms", "torch reference (paged)",
                                  t_r * 1e3, higher_is_better=False))
        if triton_decode.available() and triton_decode.takes(a["q"], a["k_cache"], a["v_cache"]) is None:
            args_t = {k: v for k, v in a.items() if k not in ("k_scale", "v_scale")}
            got_t = triton_decode.paged_attention_decode(**args_t, max_seq_len=ctx)
            diff_t = (sdpa().float() - got_t.float()).abs().max().item()
            t_t = cuda_time(lambda: triton_decode.paged_attention_decode(**args_t, max_seq_len=ctx), repeats=5)
            splits, _ = triton_decode.plan(batch, kv, ctx, 16, dev)
            kv_bytes = 2 * int(lens.sum()) * kv * 128 * 2
            src = torch.empty(kv_bytes, dtype=torch.uint8, device=dev)
            dst = torch.empty_like(src)
            t_copy = cuda_time(lambda: dst.copy_(src), repeats=5)
            del src, dst
            pt = dict(p, max_abs_diff_vs_sdpa=round(diff_t, 5), splits=splits,
                      chosen=K.decode_attention.choose(a["q"], a["k_cache"], a["v_cache"]))
            results.append(Result("paged decode triton", pt, t_t * 1e3, "ms", "fused SDPA on dense KV",
                                  t_sdpa * 1e3, higher_is_better=False))
            results.append(Result("paged decode triton", pt, t_t * 1e3, "ms",
                                  "KV bytes read once (half a device copy of them)", t_copy / 2 * 1e3,
                                  higher_is_better=False))
            results.append(Result("paged decode triton", pt, t_t * 1e3, "ms", f"CUDA kernel {version}",
                                  t_k * 1e3, higher_is_better=False))
    tr.close()
    report("gpu_kernels", results, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
