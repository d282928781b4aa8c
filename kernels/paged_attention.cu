// Paged attention for decode: one query token per sequence, keys and values in paged caches.
//
// q, out: (B, num_heads, head_size), q with a per-sequence stride (a view of a fused qkv output
// is fine). k_cache, v_cache: (num_blocks, block_size, num_kv_heads, head_size), the compute
// type or fp8 bytes with per-tensor scales. block_tables: (B, max_blocks_per_seq) int32;
// seq_lens: (B,) int32, each >= 1. GQA: head h reads kv head h / (num_heads / num_kv_heads).
// Only the first seq_lens[b] tokens are read: block table entries and slots past a sequence's
// length are never touched.
//
// v1: grid (num_heads, B), the whole context in one block; dynamic shared memory
//     (head_size + 32 + max_seq_len) floats.
// v2: split-K: grid (num_heads, B, partitions of TIERD_PARTITION tokens), each partition
//     writes its max logit, exp-sum and normalised partial output; v2_reduce (grid (num_heads, B),
//     shared memory (32 + max_partitions) floats) combines them.
#include "common.cuh"

#define TIERD_PARTITION 512

template <typename T, typename C>
__device__ __forceinline__ void load_query(float* qs, const T* q, i64 q_stride, int b, int h, int head_size) {
    const T* qp = q + b * q_stride + (i64)h * head_size;
    for (int d = threadIdx.x; d < head_size; d += blockDim.x) qs[d] = to_float(qp[d]);
    __syncthreads();
}

// Logits of tokens [start, end) into logits[0 .. end-start); returns the block-wide max.
template <typename C>
__device__ float partition_logits(float* logits, float* scratch, const float* qs, const C* k_cache,
                                  const int* table, int start, int end, int block_size, int num_kv_heads,
                                  int kvh, int head_size, float scale, float k_scale) {
    float m = TIERD_NEG_INF;
    for (int t = start + threadIdx.x; t < end; t += blockDim.x) {
        const i64 blk = table[t / block_size];
        const i64 base = ((blk * block_size + t % block_size) * num_kv_heads + kvh) * head_size;
        float dot = 0.0f;
        for (int d = 0; d < head_size; ++d) dot += qs[d] * cache_load(k_cache, base + d, k_scale);
        dot *= scale;
        logits[t - start] = dot;
        m = fmaxf(m, dot);
    }
    return block_max(m, scratch);
}

// Turns logits into exp(logit - m) in place; returns the block-wide sum.
__device__ float partition_exp(float* logits, float* scratch, int n, float m) {
    float s = 0.0f;
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
        const float e = expf(logits[i] - m);
        logits[i] = e;
        s += e;
    }
    return block_sum(s, scratch);  // its barriers also publish logits[]
}

// out_d = sum_t w[t - start] * v[t][d] * inv, for d owned by this thread; written by `emit`.
template <typename C, typename Emit>
__device__ void weighted_values(const float* w, const C* v_cache, const int* table, int start, int end,
                                int block_size, int num_kv_heads, int kvh, int head_size, float v_scale,
                                float inv, Emit emit) {
    for (int d = threadIdx.x; d < head_size; d += blockDim.x) {
        float acc = 0.0f;
        for (int t = start; t < end; ++t) {
            const i64 blk = table[t / block_size];
            const i64 base = ((blk * block_size + t % block_size) * num_kv_heads + kvh) * head_size;
            acc += w[t - start] * cache_load(v_cache, base + d, v_scale);
        }
        emit(d, acc * inv);
    }
}

template <typename T, typename C>
__device__ void paged_attention_v1_impl(T* __restrict__ out, const T* __restrict__ q, const C* __restrict__ k_cache,
                                        const C* __restrict__ v_cache, const int* __restrict__ block_tables,
                                        const int* __restrict__ seq_lens, int max_blocks_per_seq, int num_heads,
                                        int num_kv_heads, int head_size, int block_size, i64 q_stride,
                                        float scale, float k_scale, float v_scale) {
    extern __shared__ float smem[];
    const int h = blockIdx.x, b = blockIdx.y;
    const int len = seq_lens[b];
    const int kvh = h / (num_heads / num_kv_heads);
    float* qs = smem;
    float* scratch = smem + head_size;
    float* logits = scratch + 32;
    const int* table = block_tables + (i64)b * max_blocks_per_seq;
    load_query<T, C>(qs, q, q_stride, b, h, head_size);
    const float m = partition_logits(logits, scratch, qs, k_cache, table, 0, len, block_size, num_kv_heads,
                                     kvh, head_size, scale, k_scale);
    const float s = partition_exp(logits, scratch, len, m);
    T* o = out + ((i64)b * num_heads + h) * head_size;
    weighted_values(logits, v_cache, table, 0, len, block_size, num_kv_heads, kvh, head_size, v_scale,
                    1.0f / s, [&](int d, float x) { o[d] = from_float<T>(x); });
}

template <typename T, typename C>
__device__ void paged_attention_v2_impl(float* __restrict__ exp_sums, float* __restrict__ max_logits,
                                        float* __restrict__ tmp_out, const T* __restrict__ q,
                                        const C* __restrict__ k_cache, const C* __restrict__ v_cache,
                                        const int* __restrict__ block_tables, const int* __restrict__ seq_lens,
                                        int max_blocks_per_seq, int num_heads, int num_kv_heads, int head_size,
                                        int block_size, i64 q_stride, float scale, float k_scale, float v_scale) {
    extern __shared__ float smem[];
    const int h = blockIdx.x, b = blockIdx.y, p = blockIdx.z, partitions = gridDim.z;
    const int len = seq_lens[b];
    const int start = p * TIERD_PARTITION;
    if (start >= len) return;  // the reduce reads only partitions that hold tokens
    const int end = min(start + TIERD_PARTITION, len);
    const int kvh = h / (num_heads / num_kv_heads);
    float* qs = smem;
    float* scratch = smem + head_size;
    float* logits = scratch + 32;
    const int* table = block_tables + (i64)b * max_blocks_per_seq;
    load_query<T, C>(qs, q, q_stride, b, h, head_size);
    const float m = partition_logits(logits, scratch, qs, k_cache, table, start, end, block_size, num_kv_heads,
                                     kvh, head_size, scale, k_scale);
    const float s = partition_exp(logits, scratch, end - start, m);
    const i64 row = ((i64)b * num_heads + h) * partitions + p;
    if (threadIdx.x == 0) {
        exp_sums[row] = s;
        max_logits[row] = m;
    }
    float* o = tmp_out + row * head_size;
    weighted_values(logits, v_cache, table, start, end, block_size, num_kv_heads, kvh, head_size, v_scale,
                    1.0f / s, [&](int d, float x) { o[d] = x; });
}

template <typename T>
__device__ void paged_attention_v2_reduce_impl(T* __restrict__ out, const float* __restrict__ exp_sums,
                                               const float* __restrict__ max_logits,
                                               const float* __restrict__ tmp_out, const int* __restrict__ seq_lens,
                                               int num_heads, int head_size, int partitions) {
    extern __shared__ float smem[];
    const int h = blockIdx.x, b = blockIdx.y;
    const int n = (seq_lens[b] + TIERD_PARTITION - 1) / TIERD_PARTITION;
    float* scratch = smem;
    float* weights = smem + 32;
    const i64 row0 = ((i64)b * num_heads + h) * partitions;
    float m = TIERD_NEG_INF;
    for (int p = threadIdx.x; p < n; p += blockDim.x) m = fmaxf(m, max_logits[row0 + p]);
    m = block_max(m, scratch);
    float total = 0.0f;
    for (int p = threadIdx.x; p < n; p += blockDim.x) {
        const float w = exp_sums[row0 + p] * expf(max_logits[row0 + p] - m);
        weights[p] = w;
        total += w;
    }
    total = block_sum(total, scratch);
    const float inv = 1.0f / total;
    T* o = out + ((i64)b * num_heads + h) * head_size;
    for (int d = threadIdx.x; d < head_size; d += blockDim.x) {
        float acc = 0.0f;
        for (int p = 0; p < n; ++p) acc += weights[p] * tmp_out[(row0 + p) * head_size + d];
        o[d] = from_float<T>(acc * inv);
    }
}

#define TIERD_PA_ARGS(T, C)                                                                           \
    const T *q, const C *k_cache, const C *v_cache, const int *block_tables, const int *seq_lens,     \
        int max_blocks_per_seq, int num_heads, int num_kv_heads, int head_size, int block_size,       \
        i64 q_stride, float scale, float k_scale, float v_scale
#define TIERD_PA_PASS                                                                                 \
    q, k_cache, v_cache, block_tables, seq_lens, max_blocks_per_seq, num_heads, num_kv_heads, head_size, \
        block_size, q_stride, scale, k_scale, v_scale

#define TIERD_PAGED_ATTENTION(SUFFIX, T, C)                                                            \
    extern "C" __global__ void paged_attention_v1_##SUFFIX(T* out, TIERD_PA_ARGS(T, C)) {              \
        paged_attention_v1_impl<T, C>(out, TIERD_PA_PASS);                                              \
    }                                                                                                 \
    extern "C" __global__ void paged_attention_v2_##SUFFIX(float* exp_sums, float* max_logits,        \
                                                           float* tmp_out, TIERD_PA_ARGS(T, C)) {     \
        paged_attention_v2_impl<T, C>(exp_sums, max_logits, tmp_out, TIERD_PA_PASS);                    \
    }

TIERD_PAGED_ATTENTION(float32, float, float)
TIERD_PAGED_ATTENTION(float16, __half, __half)
TIERD_PAGED_ATTENTION(bfloat16, __nv_bfloat16, __nv_bfloat16)
TIERD_PAGED_ATTENTION(float32_fp8, float, u8)
TIERD_PAGED_ATTENTION(float16_fp8, __half, u8)
TIERD_PAGED_ATTENTION(bfloat16_fp8, __nv_bfloat16, u8)

#define TIERD_REDUCE(SUFFIX, T)                                                                        \
    extern "C" __global__ void paged_attention_v2_reduce_##SUFFIX(T* out, const float* exp_sums,       \
                                                                  const float* max_logits,             \
                                                                  const float* tmp_out, const int* seq_lens, \
                                                                  int num_heads, int head_size, int partitions) { \
        paged_attention_v2_reduce_impl<T>(out, exp_sums, max_logits, tmp_out, seq_lens, num_heads, head_size, \
                                          partitions);                                                 \
    }

TIERD_REDUCE(float32, float)
TIERD_REDUCE(float16, __half)
TIERD_REDUCE(bfloat16, __nv_bfloat16)
