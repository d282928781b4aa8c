"""The engine's prefill attention (tierd/engine/attention.py) in each of its paths — a whole
prompt (causal), queries after a cached prefix as a lower-right causal bias (the GPU's path, no
mask materialised there), the boolean mask (the CPU's path, and sliding windows) — against a
float64 softmax written out here, with and without GQA, in fp32 and bf16."""

from __future__ import annotations

import warnings

import pytest
import torch

from tierd.engine.attention import prefill_attention


def reference(q, k, v, q_start, scale, window=None):
    """softmax(q k^T * scale + causal mask) v in float64, kv heads repeated for GQA."""
    n, heads, d = q.shape
    ctx, kvh, _ = k.shape
    qd, kd, vd = (x.double() for x in (q, k, v))
    kd, vd = kd.repeat_interleave(heads // kvh, dim=1), vd.repeat_interleave(heads // kvh, dim=1)
    scores = torch.einsum("nhd,chd->hnc", qd, kd) * scale
    qpos = torch.arange(q_start, q_start + n).unsqueeze(1)
    kpos = torch.arange(ctx).unsqueeze(0)
    keep = kpos <= qpos
    if window is not None:
        keep &= kpos > qpos - window
    scores = scores.masked_fill(~keep, float("-inf"))
    return torch.einsum("hnc,chd->nhd", scores.softmax(-1), vd)


CASES = [(17, 17), (1, 40), (5, 64), (16, 100), (33, 33 + 128)]   # (queries, context)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("heads,kvh", [(4, 4), (8, 2)])
@pytest.mark.parametrize("n,ctx", CASES)
@pytest.mark.parametrize("lower_right", [False, True])
def test_prefill_attention_equals_a_float64_softmax_in_every_path(n, ctx, heads, kvh, dtype, tol, lower_right):
    g = torch.Generator().manual_seed(n * 1000 + ctx)
    d = 64
    q = torch.randn(n, heads, d, generator=g).to(dtype)
    k = torch.randn(ctx, kvh, d, generator=g).to(dtype)
    v = torch.randn(ctx, kvh, d, generator=g).to(dtype)
    scale = d ** -0.5
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")   # (on a CPU the bias says why it cannot use a GPU kernel)
        out = prefill_attention(q, k, v, ctx - n, scale, lower_right=lower_right)
    assert out.shape == (n, heads, d) and out.dtype == dtype      # no upcast left in the output
    torch.testing.assert_close(out.double(), reference(q, k, v, ctx - n, scale), atol=tol, rtol=tol)


@pytest.mark.parametrize("window", [1, 7, 32])
def test_prefill_attention_with_a_sliding_window(window):
    g = torch.Generator().manual_seed(window)
    n, ctx, heads, kvh, d = 9, 50, 8, 2, 32
    q, k, v = torch.randn(n, heads, d, generator=g), torch.randn(ctx, kvh, d, generator=g), \
        torch.randn(ctx, kvh, d, generator=g)
    for lower_right in (False, True):   # (a window always takes the mask)
        out = prefill_attention(q, k, v, ctx - n, d ** -0.5, window, lower_right=lower_right)
        torch.testing.assert_close(out.double(), reference(q, k, v, ctx - n, d ** -0.5, window),
                                   atol=2e-5, rtol=2e-5)
