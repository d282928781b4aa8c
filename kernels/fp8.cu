// float8 e4m3 conversion with one scale per tensor: quantize stores x / scale (saturating at
// +-448, round to nearest even, NaN kept); dequantize returns stored * scale. Grid-stride loops.
#include "common.cuh"

#define TIERD_FP8(SUFFIX, T)                                                                        \
    extern "C" __global__ void quantize_fp8_##SUFFIX(u8* out, const T* x, i64 n, float scale) {     \
        for (i64 i = blockIdx.x * (i64)blockDim.x + threadIdx.x; i < n; i += (i64)gridDim.x * blockDim.x) \
            out[i] = fp8_from_float(to_float(x[i]) / scale);                                         \
    }                                                                                               \
    extern "C" __global__ void dequantize_fp8_##SUFFIX(T* out, const u8* x, i64 n, float scale) {   \
        for (i64 i = blockIdx.x * (i64)blockDim.x + threadIdx.x; i < n; i += (i64)gridDim.x * blockDim.x) \
            out[i] = from_float<T>(fp8_to_float(x[i]) * scale);                                      \
    }

TIERD_FP8(float32, float)
TIERD_FP8(float16, __half)
TIERD_FP8(bfloat16, __nv_bfloat16)
