// Shared device helpers for tierd's kernels: element conversions and block reductions.
// Self-contained apart from CUDA's own fp16/bf16/fp8 headers, so that NVRTC (through CuPy)
// and nvcc compile the same text.
#pragma once

#include <cuda_fp16.h>
#include <cuda_bf16.h>
#include <cuda_fp8.h>

typedef long long i64;
typedef unsigned char u8;

#define TIERD_FP8_MAX 448.0f
#define TIERD_NEG_INF (-__int_as_float(0x7f800000))

__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }

template <typename T> __device__ __forceinline__ T from_float(float x);
template <> __device__ __forceinline__ float from_float<float>(float x) { return x; }
template <> __device__ __forceinline__ __half from_float<__half>(float x) { return __float2half_rn(x); }
template <> __device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) {
    return __float2bfloat16_rn(x);
}

// float8 e4m3 (the OCP "fn" variant torch calls float8_e4m3fn): saturating, round to nearest
// even, NaN kept.
__device__ __forceinline__ u8 fp8_from_float(float x) {
    return (u8)__nv_cvt_float_to_fp8(x, __NV_SATFINITE, __NV_E4M3);
}
__device__ __forceinline__ float fp8_to_float(u8 x) {
    __half_raw h = __nv_cvt_fp8_to_halfraw((__nv_fp8_storage_t)x, __NV_E4M3);
    return __half2float(__half(h));
}

// Cache element <-> float. A cache element is either the compute type T or fp8 bytes (u8) with
// a per-tensor scale (value = stored * scale).
template <typename T> __device__ __forceinline__ float cache_load(const T* p, i64 i, float) {
    return to_float(p[i]);
}
template <> __device__ __forceinline__ float cache_load<u8>(const u8* p, i64 i, float scale) {
    return fp8_to_float(p[i]) * scale;
}
template <typename C, typename T> __device__ __forceinline__ C cache_store(T x, float scale);
#define TIERD_SAME_STORE(T) \
    template <> __device__ __forceinline__ T cache_store<T, T>(T x, float) { return x; }
TIERD_SAME_STORE(float)
TIERD_SAME_STORE(__half)
TIERD_SAME_STORE(__nv_bfloat16)
template <> __device__ __forceinline__ u8 cache_store<u8, float>(float x, float s) { return fp8_from_float(x / s); }
template <> __device__ __forceinline__ u8 cache_store<u8, __half>(__half x, float s) {
    return fp8_from_float(to_float(x) / s);
}
template <> __device__ __forceinline__ u8 cache_store<u8, __nv_bfloat16>(__nv_bfloat16 x, float s) {
    return fp8_from_float(to_float(x) / s);
}

// Block-wide reductions over blockDim.x threads (a multiple of 32, at most 1024).
__device__ __forceinline__ float warp_max(float v) {
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}
__device__ __forceinline__ float warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}
// Block-wide reduction with `warp_op` (warp_max or warp_sum) and its identity; `scratch` holds
// at least 32 floats; every thread gets the result.
template <float (*WarpOp)(float)>
__device__ __forceinline__ float block_reduce(float v, float identity, float* scratch) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = (blockDim.x + 31) >> 5;
    v = WarpOp(v);
    __syncthreads();
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    v = lane < nwarps ? scratch[lane] : identity;
    return WarpOp(v);
}
__device__ __forceinline__ float block_max(float v, float* scratch) {
    return block_reduce<warp_max>(v, TIERD_NEG_INF, scratch);
}
__device__ __forceinline__ float block_sum(float v, float* scratch) { return block_reduce<warp_sum>(v, 0.0f, scratch); }
