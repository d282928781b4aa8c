// Multi-block, all-layer copies between per-layer paged caches and contiguous tier slots.
//
// A tier block holds `ratio` engine blocks of every layer in tierd's block layout
// [num_layers, 2 (K, V), ratio * block_size tokens, kv_heads, head_dim]; one engine block of one
// layer's K (or V) is `unit_bytes` contiguous bytes in both places.
//   k_ptrs, v_ptrs: (num_layers,) addresses of each layer's K and V cache
//                   (num_blocks, block_size, kv_heads, head_dim), contiguous;
//   block_ids:      (n_tier * ratio,) int64 engine block of tier block t, part r at t * ratio + r;
//                   -1 skips that part (e.g. blocks the engine already holds);
//   slots:          (n_tier,) address of each tier block's slot (device memory, or pinned host
//                   memory mapped into the device's address space).
// Grid: (n_tier * ratio, num_layers * 2); each thread block copies one unit with 16-byte
// accesses when both addresses and unit_bytes allow, bytewise otherwise.
#include "common.cuh"

typedef unsigned long long u64;

__device__ __forceinline__ void copy_unit(u8* __restrict__ dst, const u8* __restrict__ src, i64 n) {
    if ((((u64)dst | (u64)src | (u64)n) & 15) == 0) {
        uint4* d = reinterpret_cast<uint4*>(dst);
        const uint4* s = reinterpret_cast<const uint4*>(src);
        for (i64 i = threadIdx.x; i < n / 16; i += blockDim.x) d[i] = s[i];
    } else {
        for (i64 i = threadIdx.x; i < n; i += blockDim.x) dst[i] = src[i];
    }
}

__device__ __forceinline__ bool locate(const u64* k_ptrs, const u64* v_ptrs, const i64* block_ids, const u64* slots,
                                       int ratio, i64 unit_bytes, u8** cache, u8** slot) {
    const i64 i = blockIdx.x;
    const int layer = blockIdx.y >> 1, kv = blockIdx.y & 1;
    const i64 block = block_ids[i];
    if (block < 0) return false;
    const i64 tier = i / ratio, part = i % ratio;
    *cache = reinterpret_cast<u8*>((kv ? v_ptrs : k_ptrs)[layer]) + block * unit_bytes;
    *slot = reinterpret_cast<u8*>(slots[tier]) + ((i64)(layer * 2 + kv) * ratio + part) * unit_bytes;
    return true;
}

extern "C" __global__ void gather_blocks(const u64* k_ptrs, const u64* v_ptrs, const i64* block_ids,
                                         const u64* slots, int ratio, i64 unit_bytes) {
    u8 *cache, *slot;
    if (locate(k_ptrs, v_ptrs, block_ids, slots, ratio, unit_bytes, &cache, &slot)) copy_unit(slot, cache, unit_bytes);
}

extern "C" __global__ void scatter_blocks(const u64* k_ptrs, const u64* v_ptrs, const i64* block_ids,
                                          const u64* slots, int ratio, i64 unit_bytes) {
    u8 *cache, *slot;
    if (locate(k_ptrs, v_ptrs, block_ids, slots, ratio, unit_bytes, &cache, &slot)) copy_unit(cache, slot, unit_bytes);
}
