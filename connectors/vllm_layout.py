"""Where vLLM's attention backends keep K and V, as views in the tier's order.

Every tier block holds `[layers, 2, block_tokens, kv_heads, head_dim]` (DESIGN.md); the vLLM
connector converts to and from it, so vLLM and the bundled engine share blocks of one model and
a block is never read in a layout it was not written in. The attention backend, never the
tensor's shape, says how a paged cache is laid out: one shape holds different layouts (vLLM's
CPU backend hands connectors tensors of the GPU backends' shape but stores K transposed; a
`(B, H, N, 2 * D)` tensor with `H == N` reads as `(B, N, H, 2 * D)` just as well). A layer whose
backend is not listed here, or not known at all (outside a vLLM engine), is declined.

Facts (vLLM 0.32 and 0.33): every layer's cache reaches `register_kv_caches` as vLLM's logical
view `(blocks, kv_heads, block_size, C)` (`vllm/v1/worker/utils.py:allocate_kv_cache`); the
physical order (`kv_cache_layout`: LBHNC, LBNHC, ...) is in its strides. What C holds is the
backend's:

- FLASH_ATTN, TRITON_ATTN, FLEX_ATTENTION, FLASHINFER, ROCM_AITER_UNIFIED_ATTN: per token and
  head, K's head_dim values then V's (`kv_cache.split(head_size, dim=-1)`), C = 2 * head_dim.
- CPU_ATTN: each (block, head) slab of N * 2D values is K then V (`view(B, H, 2N, D).chunk(2,
  dim=2)`); for the ISAs "vec", "vec16" and "vxe" (and "neon" for fp16/fp32) K[t, d] is at
  `d * N + t` and V[t, d] at `N * D + t * D + d`. The "amx" ISA (x86 with AMX, bf16, block
  sizes and head_dim multiples of 32) packs both for its tile multiplies, in pairs of bf16
  values (measured with vLLM's own `cpu_attn_reshape_and_cache`, tests/test_vllm_layout.py):
  K[t, d] at `(t // 16) * 16 * D + (d // 2) * 32 + (t % 16) * 2 + d % 2` (16-token tiles, pairs
  of head_dim values), V[t, d] at `N * D + (d // 16) * 16 * N + (t // 2) * 32 + (d % 16) * 2 +
  t % 2` (16-column tiles, pairs of tokens). NEON's bf16 path packs otherwise: declined.
- CPU_MLA (MLA on vLLM's CPU build): one row of kv_lora_rank + rope dims (512 + 64) per token,
  `(blocks, block_size, 576)`, the same on every tensor-parallel rank; a latent namespace
  (`planes=1`). Other MLA backends are declined.
- Everything else is declined: ROCM_ATTN (x-packed K), ROCm's AITER flash attention (its class
  also calls itself FLASH_ATTN, and folds the heads into C when its shuffled layout is on), MLA
  and quantized backends, and any backend class vLLM does not define under that name. A
  backend is known by its name and by the vLLM module its class comes from.
"""

from __future__ import annotations

import torch

from tierd.errors import TierdError

_BACKENDS = "vllm.v1.attention.backends."
# backends whose C is K's head_dim values then V's, each with the module its class is defined in
PLAIN_BACKENDS = {
    "FLASH_ATTN": _BACKENDS + "flash_attn",
    "TRITON_ATTN": _BACKENDS + "triton_attn",
    "FLEX_ATTENTION": _BACKENDS + "flex_attention",
    "FLASHINFER": _BACKENDS + "flashinfer",
    "ROCM_AITER_UNIFIED_ATTN": _BACKENDS + "rocm_aiter_unified_attn",
}
CPU_BACKEND = "CPU_ATTN"
CPU_PLAIN_ISAS = frozenset({"vec", "vec16", "vxe"})
CPU_AMX_ISA = "amx"
# MLA backends whose cache is a plain row of kv_lora_rank + rope dims per token
LATENT_BACKENDS = {"CPU_MLA": _BACKENDS + "mla.cpu_mla"}
KNOWN_BACKENDS = {**PLAIN_BACKENDS, CPU_BACKEND: _BACKENDS + "cpu_attn", **LATENT_BACKENDS}


def backend_of(vllm_config, layer_name: str) -> tuple[str | None, str | None]:
    """(backend name, CPU ISA) of one attention layer, or (None, None) outside a vLLM engine.
    A class that answers to a listed name but is not vLLM's class of that name is named by
    its module and class instead (so it is unknown, and declined)."""
    ctx = getattr(getattr(vllm_config, "compilation_config", None), "static_forward_context", None)
    if not ctx or layer_name not in ctx:
        return None, None
    layer = ctx[layer_name]
    backend = getattr(layer, "attn_backend", None)
    try:
        name = backend.get_name() if backend is not None else None
    except Exception:  # noqa: BLE001 - a backend without a name is unknown
        name = None
    module = getattr(backend, "__module__", None)
    if name in KNOWN_BACKENDS and module != KNOWN_BACKENDS[name]:
        cls = backend if isinstance(backend, type) else type(backend)
        name = f"{name} ({module}.{cls.__qualname__})"
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
    if isa in CPU_PLAIN_ISAS or isa == CPU_AMX_ISA:
        return True
    return isa == "neon" and dtype != torch.bfloat16


def kv_views(t: torch.Tensor, backend: str | None, isa: str | None, block_size: int, heads: int,
             head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(K, V) views of one layer's paged cache as `backend` lays it out (see the module
    docstring); the shape is only checked against it. Each is (num_blocks, block_size, kv_heads,
    head_dim), except for the CPU backend's "amx" tiles: (num_blocks, block_size / 16, 8, 2,
    kv_heads, head_dim / 16, 8, 2), the token and head_dim axes split where the tiles cut them.
    Either way a block's view, read in order, is the tier's (block_size, kv_heads, head_dim)
    order, which is all the block copies rely on. Raises TierdError for a backend, packing or
    shape that is not known."""
    n, d = block_size, head_dim
    if backend == CPU_BACKEND:
        if not cpu_isa_supported(isa, t.dtype):
            raise TierdError(f"vLLM's CPU attention with ISA {isa!r} packs K and V in a layout the "
                             "connector does not convert; declining")
        _check_shape(t, backend, heads, n, d)
        try:    # each (block, head) slab must be one run, as the backend reads it
            flat = t.view(t.shape[0], heads, 2 * n * d)
        except RuntimeError:
            raise TierdError(f"CPU attention cache with strides {t.stride()}: a (block, head) slab is not "
                             "contiguous; declining") from None
        if isa == CPU_AMX_ISA:
            return amx_views(flat, n, d)
        k = flat[..., :n * d].view(t.shape[0], heads, d, n).permute(0, 3, 1, 2)
        v = flat[..., n * d:].view(t.shape[0], heads, n, d).permute(0, 2, 1, 3)
        return k, v
    if backend in PLAIN_BACKENDS:
        _check_shape(t, backend, heads, n, d)
        return t[..., :d].transpose(1, 2), t[..., d:].transpose(1, 2)
    if backend is None:
        raise TierdError("the layer's attention backend is not known (no vLLM forward context names it), "
                         "so neither is its KV layout; declining")
    raise TierdError(f"attention backend {backend} stores KV in a layout the connector does not know; declining")


def amx_views(flat: torch.Tensor, n: int, d: int) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of the "amx" ISA's tiles (module docstring) as strided views of `flat`
    (blocks, heads, 2 * n * d): token t = 16 a + 2 b + c and head_dim index e = 16 f + 2 g + h
    are axes (a, b, c) and (f, g, h), so one view of each plane reads in the tier's order."""
    if n % 16 or d % 16:
        raise TierdError(f"AMX tiles with block_size {n} and head_dim {d} (multiples of 16 expected); declining")
    blocks, heads = flat.shape[:2]
    sb, sh = flat.stride(0), flat.stride(1)
    size = (blocks, n // 16, 8, 2, heads, d // 16, 8, 2)
    base = flat.storage_offset()
    k = flat.as_strided(size, (sb, 16 * d, 4, 2, sh, 256, 32, 1), base)
    v = flat.as_strided(size, (sb, 256, 32, 1, sh, 16 * n, 4, 2), base + n * d)
    return k, v


def latent_view(t: torch.Tensor, backend: str | None, block_size: int, latent: int) -> torch.Tensor:
    """The (num_blocks, block_size, 1, latent) view of one MLA layer's paged cache: a row of
    kv_lora_rank + rope dims per token (vLLM hands it over as (blocks, block_size, latent) or
    (blocks, 1, block_size, latent)). Raises TierdError for a backend or shape not known."""
    if backend not in LATENT_BACKENDS:
        if backend is None:
            raise TierdError("the layer's MLA backend is not known (no vLLM forward context names it), "
                             "so neither is its cache layout; declining")
        raise TierdError(f"MLA backend {backend} stores its cache in a layout the connector does not know; declining")
    shape = tuple(t.shape)
    if shape[-2:] != (block_size, latent) or not (t.dim() == 3 or (t.dim() == 4 and shape[1] == 1)):
        raise TierdError(f"{backend} cache of shape {shape}, expected (blocks, {block_size}, {latent}); declining")
    try:      # rows of `latent` contiguous values, as the backend reads them
        return t.view(shape[0], block_size, 1, latent)
    except RuntimeError:
        raise TierdError(f"{backend} cache with strides {t.stride()} is not a run of rows; declining") from None


def _check_shape(t: torch.Tensor, backend: str, heads: int, n: int, d: int) -> None:
    if t.dim() != 4 or tuple(t.shape[1:]) != (heads, n, 2 * d):
        raise TierdError(f"{backend} KV cache of shape {tuple(t.shape)}, expected vLLM's (blocks, {heads}, {n}, "
                         f"{2 * d}) view; declining")
