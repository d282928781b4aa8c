// reshape_and_cache: write the new tokens' K and V into the paged caches.
//
// key, value: (T, H, D) with element strides (key_stride, key_head_stride, 1) -- strided views
// of a fused qkv projection are fine. k_cache, v_cache: views (num_blocks, block_size, H, D)
// with head_dim contiguous and element strides (c_block, c_token, c_head), the same for both:
// per-layer contiguous caches, or views of one tensor holding K and V in the layouts engines
// use ((2, B, N, H, D), (B, 2, N, H, D), head-major (.., H, N, D), or (B, H, N, 2D)). Elements
// are of the compute type or fp8 bytes (then value / scale is stored, saturating).
// slot_mapping: (T,) int64; slot = block * block_size + offset; -1 marks padding (skipped).
// One thread block per token.
#include "common.cuh"

template <typename T, typename C>
__device__ void reshape_and_cache_impl(const T* __restrict__ key, const T* __restrict__ value,
                                       C* __restrict__ k_cache, C* __restrict__ v_cache,
                                       const i64* __restrict__ slot_mapping, i64 key_stride,
                                       i64 key_head_stride, i64 value_stride, i64 value_head_stride,
                                       int num_heads, int head_size, int block_size, i64 c_block,
                                       i64 c_token, i64 c_head, float k_scale, float v_scale) {
    const i64 token = blockIdx.x;
    const i64 slot = slot_mapping[token];
    if (slot < 0) return;
    const i64 base = (slot / block_size) * c_block + (slot % block_size) * c_token;
    const int n = num_heads * head_size;
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
        const int h = i / head_size, d = i % head_size;
        const i64 dst = base + h * c_head + d;
        k_cache[dst] = cache_store<C, T>(key[token * key_stride + h * key_head_stride + d], k_scale);
        v_cache[dst] = cache_store<C, T>(value[token * value_stride + h * value_head_stride + d], v_scale);
    }
}

#define TIERD_RESHAPE(NAME, T, C)                                                                   \
    extern "C" __global__ void NAME(const T* key, const T* value, C* k_cache, C* v_cache,          \
                                    const i64* slot_mapping, i64 key_stride, i64 key_head_stride,  \
                                    i64 value_stride, i64 value_head_stride, int num_heads,        \
                                    int head_size, int block_size, i64 c_block, i64 c_token,       \
                                    i64 c_head, float k_scale, float v_scale) {                    \
        reshape_and_cache_impl<T, C>(key, value, k_cache, v_cache, slot_mapping, key_stride,       \
                                     key_head_stride, value_stride, value_head_stride, num_heads,  \
                                     head_size, block_size, c_block, c_token, c_head, k_scale,     \
                                     v_scale);                                                      \
    }

TIERD_RESHAPE(reshape_and_cache_float32, float, float)
TIERD_RESHAPE(reshape_and_cache_float16, __half, __half)
TIERD_RESHAPE(reshape_and_cache_bfloat16, __nv_bfloat16, __nv_bfloat16)
TIERD_RESHAPE(reshape_and_cache_float32_fp8, float, u8)
TIERD_RESHAPE(reshape_and_cache_float16_fp8, __half, u8)
TIERD_RESHAPE(reshape_and_cache_bfloat16_fp8, __nv_bfloat16, u8)
