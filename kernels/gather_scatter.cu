// Multi-block copies between paged caches, in the layout the engine keeps them, and contiguous
// tier slots.
//
// A tier block holds `ratio` engine blocks of every layer in tierd's block layout
// [num_layers, 2 (K, V), ratio * block_size tokens, kv_heads, head_dim]; in a slot, one engine
// block of one layer's K (or V) is `unit = block_size * kv_heads * row_bytes` contiguous bytes.
// In the cache it may be strided: each layer's K and V are views (num_blocks, block_size,
// kv_heads, head_dim) with head_dim contiguous and byte strides (s_block, s_token, s_head),
// the same for every layer's K and V. That covers per-layer contiguous caches, one tensor per
// layer holding K and V ((2, B, N, H, D), (B, 2, N, H, D)), head-major caches ((.., H, N, D))
// and K and V side by side in each row ((B, H, N, 2D)).
//   k_ptrs, v_ptrs: (num_layers,) addresses of each layer's K and V view;
//   ids_slots:      (n_tier * ratio + n_tier,) int64: the engine block of tier block t, part r
//                   at t * ratio + r (-1 skips that part), then each tier block's slot address
//                   (device memory, or host memory mapped into the device's address space);
// A slot may also be one layer's part of a tier block ([2, ratio * block_size, heads, head_dim]),
// with one layer's K and V: a layer-by-layer copy.
// planes: 2 (K and V, as above) or 1 (a latent cache, MLA's: one row per token, one "head";
// the tier block is [num_layers, 1, ratio * block_size, 1, latent]; v_ptrs is not read).
// Grid: (n_tier * ratio, num_layers * planes); each thread block copies one unit, with 16-byte
// accesses when every address and stride allows, bytewise otherwise: a flat copy where the
// engine block's rows are contiguous in the cache (NHD caches), else row by row.
#include "common.cuh"

typedef unsigned long long u64;

struct Geometry {
    int ratio, block_size, heads;
    i64 row_bytes, s_block, s_token, s_head;
};

template <bool TO_SLOT>
__device__ __forceinline__ void copy_unit(u8* __restrict__ cache, u8* __restrict__ slot, const Geometry& g) {
    const bool vec = (((u64)cache | (u64)slot | (u64)g.row_bytes | (u64)g.s_token | (u64)g.s_head) & 15) == 0;
    // (a unit is far below 4 GiB, checked by the caller: 32-bit index arithmetic throughout)
    const unsigned heads = (unsigned)g.heads;
    if (g.s_head == g.row_bytes && g.s_token == (i64)heads * g.row_bytes) {
        // the engine block's rows are contiguous in the cache too: one flat copy, no division
        const unsigned bytes = (unsigned)g.block_size * heads * (unsigned)g.row_bytes;
        if (vec) {
            const unsigned n = bytes >> 4;
            uint4* c = reinterpret_cast<uint4*>(cache);
            uint4* s = reinterpret_cast<uint4*>(slot);
            for (unsigned i = threadIdx.x; i < n; i += blockDim.x) {
                if (TO_SLOT) s[i] = c[i];
                else c[i] = s[i];
            }
        } else {
            for (unsigned i = threadIdx.x; i < bytes; i += blockDim.x) {
                if (TO_SLOT) slot[i] = cache[i];
                else cache[i] = slot[i];
            }
        }
        return;
    }
    const unsigned w = vec ? 16u : 1u;
    const unsigned per_row = (unsigned)g.row_bytes / w;
    const unsigned n = (unsigned)g.block_size * heads * per_row;
    for (unsigned i = threadIdx.x; i < n; i += blockDim.x) {
        const unsigned row = i / per_row, col = (i - row * per_row) * w;
        const unsigned t = row / heads, h = row - t * heads;
        u8* c = cache + (i64)t * g.s_token + (i64)h * g.s_head + col;
        u8* s = slot + (i64)row * g.row_bytes + col;
        if (vec) {
            if (TO_SLOT) *reinterpret_cast<uint4*>(s) = *reinterpret_cast<const uint4*>(c);
            else *reinterpret_cast<uint4*>(c) = *reinterpret_cast<const uint4*>(s);
        } else {
            if (TO_SLOT) *s = *c;
            else *c = *s;
        }
    }
}

template <bool TO_SLOT>
__device__ __forceinline__ void block_copy(const u64* k_ptrs, const u64* v_ptrs, const i64* ids_slots, int n_tier,
                                           int planes, const Geometry& g) {
    const i64 i = blockIdx.x;
    const int layer = blockIdx.y / planes, kv = blockIdx.y - layer * planes;
    const i64 block = ids_slots[i];
    if (block < 0) return;
    const i64 tier = i / g.ratio, part = i - tier * g.ratio;
    const i64 unit = (i64)g.block_size * g.heads * g.row_bytes;
    u8* cache = reinterpret_cast<u8*>((kv ? v_ptrs : k_ptrs)[layer]) + block * g.s_block;
    u8* slot = reinterpret_cast<u8*>(ids_slots[(i64)n_tier * g.ratio + tier])
               + ((i64)(layer * planes + kv) * g.ratio + part) * unit;
    copy_unit<TO_SLOT>(cache, slot, g);
}

extern "C" __global__ void gather_blocks(const u64* k_ptrs, const u64* v_ptrs, const i64* ids_slots, int n_tier,
                                         int ratio, int block_size, int heads, i64 row_bytes,
                                         i64 s_block, i64 s_token, i64 s_head, int planes) {
    const Geometry g{ratio, block_size, heads, row_bytes, s_block, s_token, s_head};
    block_copy<true>(k_ptrs, v_ptrs, ids_slots, n_tier, planes, g);
}

extern "C" __global__ void scatter_blocks(const u64* k_ptrs, const u64* v_ptrs, const i64* ids_slots, int n_tier,
                                          int ratio, int block_size, int heads, i64 row_bytes,
                                          i64 s_block, i64 s_token, i64 s_head, int planes) {
    const Geometry g{ratio, block_size, heads, row_bytes, s_block, s_token, s_head};
    block_copy<false>(k_ptrs, v_ptrs, ids_slots, n_tier, planes, g);
}
