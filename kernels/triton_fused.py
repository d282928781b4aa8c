"""The small element-wise steps of a decoder layer, each fused into one Triton kernel: on a GPU
a one-token step is bound by how many kernels it launches, and torch runs each of these as 5-10.

- `add_rms_norm(x, weight, eps, residual=None)`: RMSNorm of x, or first the residual add
  (residual += x, in place) and RMSNorm of the sum; returns the normed rows (and the sum is the
  residual). One launch where torch takes eight (and one more for the add).
- `rotary(q, k, positions, inv_freq)`: RoPE (the rotate_half convention of HF checkpoints) on
  queries and keys in place, the angles computed from the positions in the kernel: one launch
  over both (k follows q in each row, as in the fused projection's output) where torch takes
  about sixteen (the cos and sin tables included).
- `silu_mul(gate_up)`: silu(gate) * up of the fused gate/up projection's halves: one launch for
  two (and no chunk copies).

Each computes what the engine's torch code computes (tierd/engine/model.py), rounding where it
rounds: sums and norms in float32, each product rounded to the activations' dtype as torch's
element-wise ops round it. Reductions run in another order, so results may differ in the last
place; the dispatcher's self-checks compare with a tolerance. Rows of head_dim or hidden
elements must be contiguous; anything else raises ValueError and the engine keeps its torch code.
Written within what Triton 3.6 accepts; on the CPU only under Triton's interpreter
(`TRITON_INTERPRET=1`), which the tests use.
"""

from __future__ import annotations

import torch

from .triton_decode import DTYPES, _pow2, available, interpreted, triton

if triton is not None:
    import triton.language as tl

__all__ = ["add_rms_norm", "rotary", "silu_mul", "available", "takes", "DTYPES"]

MAX_ROW = 16384       # hidden sizes (and intermediate sizes) one program normalises or gates


def takes(x: torch.Tensor) -> str | None:
    """None where these kernels take activations like x (rows of its last dimension)."""
    if triton is None:
        return "triton is not installed"
    if x.dtype not in DTYPES:
        return f"{x.dtype} activations"
    if x.stride(-1) != 1:
        return "rows need a contiguous last dimension"
    if x.device.type != "cuda" and not interpreted():
        return f"{x.device.type} tensors (Triton runs on CUDA, or under its interpreter)"
    return None


def _check(x: torch.Tensor, width: int) -> None:
    why = takes(x)
    if why is None and _pow2(width) > MAX_ROW:
        why = f"rows of {width} elements (at most {MAX_ROW})"
    if why is not None:
        raise ValueError(why)


if triton is not None:
    @triton.jit
    def _add_rms_norm(x_ptr, res_ptr, w_ptr, out_ptr, stride_x, stride_r, stride_o, n, eps,
                      ADD: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        c = tl.arange(0, BLOCK)
        m = c < n
        x = tl.load(x_ptr + row * stride_x + c, mask=m, other=0.0)
        if ADD:     # h = h + x, rounded to the activations' dtype as torch's add rounds it
            h = (tl.load(res_ptr + row * stride_r + c, mask=m, other=0.0).to(tl.float32)
                 + x.to(tl.float32)).to(x.dtype)
            tl.store(res_ptr + row * stride_r + c, h, mask=m)
        else:
            h = x
        hf = h.to(tl.float32)
        r = tl.rsqrt(tl.sum(hf * hf, 0) / n + eps)      # (as torch.rsqrt; self-checked per dtype)
        y = (hf * r).to(x.dtype)
        w = tl.load(w_ptr + c, mask=m, other=0.0)
        tl.store(out_ptr + row * stride_o + c, (w.to(tl.float32) * y.to(tl.float32)).to(x.dtype), mask=m)

    @triton.jit
    def _rotary(x_ptr, pos_ptr, inv_ptr, stride_t, stride_h, heads, HALF: tl.constexpr, BLOCK: tl.constexpr):
        t = tl.program_id(0)
        h = tl.program_id(1)
        c = tl.arange(0, BLOCK)
        m = c < HALF
        pos = tl.load(pos_ptr + t).to(tl.float32)
        ang = pos * tl.load(inv_ptr + c, mask=m, other=0.0)
        base = x_ptr + t * stride_t + h * stride_h
        x1 = tl.load(base + c, mask=m, other=0.0)
        x2 = tl.load(base + HALF + c, mask=m, other=0.0)
        cos = tl.cos(ang).to(x1.dtype).to(tl.float32)     # the tables' rounding
        sin = tl.sin(ang).to(x1.dtype).to(tl.float32)
        a1 = (x1.to(tl.float32) * cos).to(x1.dtype).to(tl.float32)
        b1 = (-x2.to(tl.float32) * sin).to(x1.dtype).to(tl.float32)
        a2 = (x2.to(tl.float32) * cos).to(x1.dtype).to(tl.float32)
        b2 = (x1.to(tl.float32) * sin).to(x1.dtype).to(tl.float32)
        tl.store(base + c, (a1 + b1).to(x1.dtype), mask=m)
        tl.store(base + HALF + c, (a2 + b2).to(x1.dtype), mask=m)

    @triton.jit
    def _silu_mul(x_ptr, out_ptr, stride_x, stride_o, n, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        m = c < n
        g = tl.load(x_ptr + row * stride_x + c, mask=m, other=0.0)
        u = tl.load(x_ptr + row * stride_x + n + c, mask=m, other=0.0)
        gf = g.to(tl.float32)
        s = (gf / (1.0 + tl.exp(-gf))).to(g.dtype)
        tl.store(out_ptr + row * stride_o + c, (s.to(tl.float32) * u.to(tl.float32)).to(g.dtype), mask=m)


def add_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
                 residual: torch.Tensor | None = None) -> torch.Tensor:
    """RMSNorm(x) * weight; with `residual`, first residual += x (in place) and the norm of the
    sum. x, residual: (T, hidden)."""
    _check(x, x.shape[-1])
    t, n = x.shape
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype or residual.stride(-1) != 1):
        raise ValueError("the residual needs x's shape and dtype, rows contiguous")
    out = torch.empty((t, n), dtype=x.dtype, device=x.device)
    if t:
        res = residual if residual is not None else x
        _add_rms_norm[(t,)](x, res, weight, out, x.stride(0), res.stride(0), out.stride(0), n, float(eps),
                            ADD=residual is not None, BLOCK=_pow2(n))
    return out


def rotary(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor) -> None:
    """RoPE of q (T, heads, d) and k (T, kv_heads, d) at positions (T,), in place. k must follow
    q in each row (views of one fused projection's output), so that one launch covers both: an
    op that changes its inputs in place is never left half done (else ValueError, and the
    dispatcher runs the reference)."""
    for x in (q, k):
        _check(x, x.shape[-1])
    half = q.shape[-1] // 2
    follows = ((k.stride(0) == q.stride(0) or q.shape[0] == 1) and k.stride(1) == q.stride(1) == q.shape[-1]
               and k.shape[-1] == q.shape[-1] and k.shape[0] == q.shape[0] and k.stride(-1) == 1
               and q.dtype == k.dtype
               and k.data_ptr() == q.data_ptr() + q.shape[1] * q.stride(1) * q.element_size())
    if not follows or q.shape[-1] % 2:
        raise ValueError("rotary needs k right after q in each row and an even head_dim")
    if inv_freq.shape != (half,) or inv_freq.dtype != torch.float32:
        raise ValueError(f"inv_freq needs {half} float32 values")
    if q.shape[0]:
        heads = q.shape[1] + k.shape[1]
        _rotary[(q.shape[0], heads)](q, positions.contiguous(), inv_freq, q.stride(0), q.stride(1), heads,
                                     HALF=half, BLOCK=_pow2(half))


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up, where gate_up (T, 2 * I) holds gate then up."""
    _check(gate_up, gate_up.shape[-1] // 2)
    t, n2 = gate_up.shape
    n = n2 // 2
    out = torch.empty((t, n), dtype=gate_up.dtype, device=gate_up.device)
    if t:
        block = min(1024, _pow2(n))
        _silu_mul[(t, triton.cdiv(n, block))](gate_up, out, gate_up.stride(0), out.stride(0), n, BLOCK=block)
    return out
