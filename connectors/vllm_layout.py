"""Where vLLM's attention backends keep K and V, as views in the tier's order.

Every tier block holds `[layers, 2, block_tokens, kv_heads, head_dim]` (DESIGN.md); the vLLM
connector converts to and from it, so vLLM and the bundled engine share blocks of one model and
a block is never read in a layout it was not written in. The backend, not the tensor's shape,
says how a paged cache is laid out: vLLM's CPU backend hands connectors tensors of the same
shape as the GPU flash-attention view, `(blocks, kv_heads, block_size, 2 * head_dim)`, but
stores K transposed inside each (block, head). A backend or packing not listed here is declined.

Facts (vLLM 0.32): the CPU backend (`CPU_ATTN`) reads each (block, head) slab of N * 2D values
as K then V; for the ISAs "vec", "vec16" and "vxe" (and "neon" for fp16/fp32) K[t, d] is at
`d * N + t` and V[t, d] at `N * D + t * D + d`. The "amx" ISA (and NEON's bf16 path) pack K and
V into tiles: declined. GPU backends store plain rows (K[t, h, :] contiguous), in one of the
shapes `_plain_views` lists.
"""

from __future__ import annotations

import torch

from tierd.errors import TierdError

# GPU backends that keep each token's K and V as plain head_dim-long rows.
PLAIN_BACKENDS = frozenset({
    "FLASH_ATTN", "FLASHINFER", "TRITON_ATTN", "FLEX_ATTENTION", "TREE_ATTN", "XFORMERS",
    "ROCM_ATTN", "ROCM_AITER_FA", "ROCM_AITER_UNIFIED_ATTN", "TORCH_SDPA",
})
CPU_BACKEND = "CPU_ATTN"
CPU_PLAIN_ISAS = frozenset({"vec", "vec16", "vxe"})


def backend_of(vllm_config, layer_name: str) -> tuple[str | None, str | None]:
    """(backend name, CPU ISA) of one attention layer, or (None, None) outside a vLLM engine."""
    ctx = getattr(getattr(vllm_config, "compilation_config", None), "static_forward_context", None)
    if not ctx or layer_name not in ctx:
        return None, None
    layer = ctx[layer_name]
    backend = getattr(layer, "attn_backend", None)
    try:
        name = backend.get_name() if backend is not None else None
    except Exception:  # noqa: BLE001 - a backend without a name is unknown
        name = None
    return name, getattr(layer, "isa", None)


def cpu_isa(vllm_config) -> str | None:
    """The ISA vLLM's CPU backend picks for this configuration (the scheduler process asks this
    to know what the workers will find), or None where that cannot be told."""
    try:
        from vllm.platforms import current_platform
        if not current_platform.is_cpu():
            return None
        from vllm.v1.attention.backends.cpu_attn import _get_attn_isa
        mc, cc = vllm_config.model_config, vllm_config.cache_config
        return _get_attn_isa(mc.dtype, cc.block_size, mc.get_head_size(), cc.cache_dtype)
    except Exception:  # noqa: BLE001 - another vLLM version: the workers decide alone
        return None


def cpu_isa_supported(isa: str | None, dtype) -> bool:
    if isa in CPU_PLAIN_ISAS:
        return True
    return isa == "neon" and dtype != torch.bfloat16


def kv_views(t: torch.Tensor, backend: str | None, isa: str | None, block_size: int, heads: int,
             head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(K, V) views of one layer's paged cache, each (num_blocks, block_size, kv_heads, head_dim).

    `backend` None means outside a vLLM engine (tools, tests with stand-ins): the layout is then
    told by shape among the plain GPU layouts. Raises TierdError for what is not known."""
    if backend == CPU_BACKEND:
        if not cpu_isa_supported(isa, t.dtype):
            raise TierdError(f"vLLM's CPU attention with ISA {isa!r} packs K and V in a layout the "
                             "connector does not convert; declining")
        n, d = block_size, head_dim
        if tuple(t.shape[1:]) != (heads, n, 2 * d):
            raise TierdError(f"CPU attention cache of shape {tuple(t.shape)}, expected (B, {heads}, {n}, {2 * d})")
        flat = t.view(t.shape[0], heads, 2 * n * d)
        k = flat[..., :n * d].view(t.shape[0], heads, d, n).permute(0, 3, 1, 2)
        v = flat[..., n * d:].view(t.shape[0], heads, n, d).permute(0, 2, 1, 3)
        return k, v
    if backend is not None and backend not in PLAIN_BACKENDS:
        raise TierdError(f"attention backend {backend} stores KV in a layout the connector does not know; declining")
    return _plain_views(t, block_size, heads, head_dim)


def _plain_views(t: torch.Tensor, bs: int, h: int, d: int) -> tuple[torch.Tensor, torch.Tensor]:
    s = tuple(t.shape)
    if len(s) == 4 and s[1:] == (h, bs, 2 * d):          # (B, H, N, 2D): standardized view
        return t[..., :d].transpose(1, 2), t[..., d:].transpose(1, 2)
    if len(s) == 4 and s[1:] == (bs, h, 2 * d):          # (B, N, H, 2D)
        return t[..., :d], t[..., d:]
    if len(s) == 5 and s[0] == 2 and s[2:] == (bs, h, d):  # (2, B, N, H, D): flash-attn NHD
        return t[0], t[1]
    if len(s) == 5 and s[1] == 2 and s[2:] == (bs, h, d):  # (B, 2, N, H, D): flashinfer NHD
        return t[:, 0], t[:, 1]
    if len(s) == 5 and s[0] == 2 and s[2:] == (h, bs, d):  # (2, B, H, N, D): HND
        return t[0].transpose(1, 2), t[1].transpose(1, 2)
    if len(s) == 5 and s[1] == 2 and s[2:] == (h, bs, d):  # (B, 2, H, N, D): HND
        return t[:, 0].transpose(1, 2), t[:, 1].transpose(1, 2)
    raise TierdError(f"unknown paged KV cache layout {s} for block_size={bs}, kv_heads={h}, head_dim={d}")
