"""Checks the connector's reading of vLLM's "amx" CPU attention layout against vLLM's own cache
writer (`cpu_attn_reshape_and_cache`, the op its attention layers call), run in the vLLM
environment by tests/test_vllm_layout.py:

    python -m tests.vllm_amx_layout

Random bf16 keys and values go into the cache through vLLM's op at shuffled slots; the
connector's views must read each token's K and V back, byte for byte, and a tier block gathered
through them must hold them in the tier's order. Prints "SKIP: ..." and exits 0 on a CPU without
AMX (vLLM does not pick the ISA there)."""

from __future__ import annotations

import sys

import torch


def check(n: int, d: int, heads: int, blocks: int = 5) -> None:
    from vllm import _custom_ops as ops

    from tierd.connectors import vllm_layout as vl
    from tierd.kernels import gather_blocks

    g = torch.Generator().manual_seed(n * 1000 + d)
    cache = torch.zeros(blocks, heads, n, 2 * d, dtype=torch.bfloat16)     # vLLM's logical view
    kc, vc = cache.view(blocks, heads, 2 * n, d).chunk(2, dim=2)           # as its CPU backend splits it
    tokens = blocks * n
    key = torch.randn(tokens, heads, d, generator=g).bfloat16()
    value = torch.randn(tokens, heads, d, generator=g).bfloat16()
    slots = torch.randperm(tokens, generator=g)
    ops.cpu_attn_reshape_and_cache(key, value, kc, vc, slots, "amx", k_scale=1.0, v_scale=1.0,
                                   kv_cache_dtype="auto")
    k, v = vl.kv_views(cache, "CPU_ATTN", "amx", n, heads, d)
    want_k, want_v = torch.empty_like(key), torch.empty_like(value)
    want_k[slots], want_v[slots] = key, value                             # slot s holds token i
    got_k, got_v = k.reshape(tokens, heads, d), v.reshape(tokens, heads, d)
    assert torch.equal(got_k, want_k), f"K differs at block_size {n}, head_dim {d}"
    assert torch.equal(got_v, want_v), f"V differs at block_size {n}, head_dim {d}"
    slot = torch.zeros(2 * 2 * n * heads * d, dtype=torch.bfloat16)
    gather_blocks([k], [v], torch.tensor([[3, 1]]), [slot])
    s = slot.view(1, 2, 2, n, heads, d)
    for r, b in enumerate((3, 1)):
        assert torch.equal(s[0, 0, r], want_k[b * n:(b + 1) * n]) and torch.equal(s[0, 1, r], want_v[b * n:(b + 1) * n])


def main() -> int:
    if not torch.cpu._is_amx_tile_supported():
        print("SKIP: this CPU has no AMX tiles; vLLM's CPU attention does not use the amx ISA here")
        return 0
    for n, d, heads in ((128, 64, 2), (32, 128, 1), (64, 32, 4), (256, 256, 2), (32, 96, 3)):
        check(n, d, heads)
    print("amx layout: OK")
    return 0


if __name__ == "__main__":
    sys.exit(main())
