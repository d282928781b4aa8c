"""Run under Triton's interpreter (TRITON_INTERPRET=1, on the CPU) by tests/test_triton.py: the
Triton paged decode kernel against the torch reference over a grid of shapes, its self-check,
and the dispatcher's choice. Prints one line per check and "triton decode: OK" at the end."""

from __future__ import annotations

import itertools
import os
import sys

import torch


def main() -> int:
    assert os.environ.get("TRITON_INTERPRET") == "1", "run under TRITON_INTERPRET=1"
    import tierd.kernels as K
    from tierd.kernels import cases, reference, triton_decode as T

    worst = 0.0
    checked = 0
    grid = itertools.product((torch.float32, torch.float16), ((8, 2), (4, 4), (8, 1), (16, 2)),
                             (64, 80, 128), (16, 32), (None, 1, 3), ("contiguous", "b2hnd"))
    for i, (dtype, (heads, kvh), d, bs, splits, layout) in enumerate(grid):
        if i % 5:                                   # a fifth of the grid: every value of each axis
            continue
        a = cases.decode_inputs("cpu", batch=3, heads=heads, kv_heads=kvh, head_dim=d, block_size=bs,
                                num_blocks=60, max_len=90, dtype=dtype, seed=i)
        k, v = a["k_cache"], a["v_cache"]
        if layout != "contiguous":
            _, k, v = cases.cache_views(layout, k.shape[0], bs, kvh, d, lambda s: torch.empty(s, dtype=dtype))
            k.copy_(a["k_cache"])
            v.copy_(a["v_cache"])
        args = (a["q"], k, v, a["block_tables"], a["seq_lens"], a["scale"])
        got = T.paged_attention_decode(*args, splits=splits)
        want = reference.paged_attention_decode(*args)
        # (float16: the output's own rounding, half a unit in the last place, and the kernel's
        # float16 probabilities in P V)
        tol = 1e-5 if dtype == torch.float32 else 2e-3
        diff = ((got.float() - want.float()).abs() / (tol * (1 + want.float().abs()))).max().item()
        assert got.dtype == dtype and not got.isnan().any(), (dtype, heads, kvh, d, bs, splits, layout)
        assert diff <= 1, f"{dtype} heads {heads}/{kvh} d {d} block {bs} splits {splits} {layout}: {diff}"
        worst = max(worst, diff)
        checked += 1
    print(f"grid: {checked} shapes, worst difference {worst:.2f} of its tolerance")

    # what it declines, and why (the dispatcher then uses another kernel)
    q = torch.zeros(1, 8, 64)
    c = torch.zeros(4, 16, 2, 64)
    assert "cache" in T.takes(q, c.to(torch.float8_e4m3fn), c.to(torch.float8_e4m3fn))
    assert "block size 8" in T.takes(q, torch.zeros(4, 8, 2, 64), torch.zeros(4, 8, 2, 64))
    assert "head size 512" in T.takes(torch.zeros(1, 8, 512), torch.zeros(4, 16, 2, 512), torch.zeros(4, 16, 2, 512))
    assert T.takes(q, c, c) is None
    print("declines: fp8 caches, block sizes below 16, head sizes past 256")

    # its self-check passes, and the dispatcher chooses it where it takes the inputs
    assert K.paged_attention_decode_triton.use_kernel(torch.device("cpu")), \
        K.paged_attention_decode_triton.status(torch.device("cpu"))
    a = cases.decode_inputs("cpu", batch=2, heads=8, kv_heads=2, head_dim=64, block_size=16, num_blocks=40,
                            max_len=100, dtype=torch.float32, seed=7)
    args = (a["q"], a["k_cache"], a["v_cache"], a["block_tables"], a["seq_lens"], a["scale"], 1.0, 1.0)
    assert K.decode_attention.choose(a["q"], a["k_cache"], a["v_cache"]) == "triton"
    got = K.decode_attention(*args, max_seq_len=100)
    torch.testing.assert_close(got, reference.paged_attention_decode(*args), atol=1e-5, rtol=1e-5)
    small = cases.decode_inputs("cpu", batch=2, heads=8, kv_heads=2, head_dim=64, block_size=8, num_blocks=40,
                                max_len=50, dtype=torch.float32, seed=8)
    name = K.decode_attention.choose(small["q"], small["k_cache"], small["v_cache"])
    assert name != "triton", name
    sargs = (small["q"], small["k_cache"], small["v_cache"], small["block_tables"], small["seq_lens"],
             small["scale"], 1.0, 1.0)
    torch.testing.assert_close(K.decode_attention(*sargs, max_seq_len=50),
                               reference.paged_attention_decode(*sargs), atol=1e-5, rtol=1e-5)
    print(f"dispatcher: {K.decode_attention.choices()}")
    print("triton decode: OK")
    return 0


if __name__ == "__main__":
    sys.exit(main())
