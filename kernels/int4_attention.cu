// Paged decode attention over an int4 KV cache (tierd.engine.int4's layout): one query token
// per sequence.
//
// q, out: (B, num_heads, head_size), q with a per-sequence stride. Per block:
//   k_q    (num_blocks, block_size / 2, kv_heads, head_size) u8: token pairs, low nibble = even token
//   k_min, k_step (num_blocks, 1, kv_heads, head_size) half: per channel over the block's tokens
//   v_q    (num_blocks, block_size, kv_heads, head_size / 2) u8: channel pairs, low nibble = even channel
//   v_min, v_step (num_blocks, block_size, kv_heads, head_size / group) half: per token and group
// value = min + q * step. k_own: (B, block_size, kv_heads, head_size) in T: each sequence's last
// block's keys in full precision (a query sees its own block's keys unquantized). block_tables:
// (B, max_blocks_per_seq) int32; seq_lens: (B,) int32, each >= 1. GQA as paged_attention.cu.
// Grid (num_heads, B); dynamic shared memory (head_size + 32 + max_seq_len) floats.
#include "common.cuh"

__device__ __forceinline__ float nibble(u8 byte, int high) { return (float)(high ? byte >> 4 : byte & 15); }

template <typename T>
__device__ void int4_attention_impl(T* __restrict__ out, const T* __restrict__ q, const u8* __restrict__ k_q,
                                    const __half* __restrict__ k_min, const __half* __restrict__ k_step,
                                    const u8* __restrict__ v_q, const __half* __restrict__ v_min,
                                    const __half* __restrict__ v_step, const T* __restrict__ k_own,
                                    const int* __restrict__ block_tables, const int* __restrict__ seq_lens,
                                    int max_blocks_per_seq, int num_heads, int num_kv_heads, int head_size,
                                    int block_size, int group, i64 q_stride, float scale) {
    extern __shared__ float smem[];
    const int h = blockIdx.x, b = blockIdx.y;
    const int len = seq_lens[b];
    const int kvh = h / (num_heads / num_kv_heads);
    const int last = (len - 1) / block_size;
    const int groups = head_size / group;
    float* qs = smem;
    float* scratch = smem + head_size;
    float* logits = scratch + 32;
    const int* table = block_tables + (i64)b * max_blocks_per_seq;
    const T* qp = q + b * q_stride + (i64)h * head_size;
    for (int d = threadIdx.x; d < head_size; d += blockDim.x) qs[d] = to_float(qp[d]);
    __syncthreads();

    float m = TIERD_NEG_INF;
    for (int t = threadIdx.x; t < len; t += blockDim.x) {
        const int bi = t / block_size, off = t % block_size;
        float dot = 0.0f;
        if (bi == last) {
            const T* kp = k_own + (((i64)b * block_size + off) * num_kv_heads + kvh) * head_size;
            for (int d = 0; d < head_size; ++d) dot += qs[d] * to_float(kp[d]);
        } else {
            const i64 blk = table[bi];
            const u8* kq = k_q + ((blk * (block_size / 2) + off / 2) * num_kv_heads + kvh) * head_size;
            const i64 meta = (blk * num_kv_heads + kvh) * head_size;
            for (int d = 0; d < head_size; ++d)
                dot += qs[d] * (nibble(kq[d], off & 1) * __half2float(k_step[meta + d]) + __half2float(k_min[meta + d]));
        }
        dot *= scale;
        logits[t] = dot;
        m = fmaxf(m, dot);
    }
    m = block_max(m, scratch);
    float s = 0.0f;
    for (int t = threadIdx.x; t < len; t += blockDim.x) {
        const float e = expf(logits[t] - m);
        logits[t] = e;
        s += e;
    }
    s = block_sum(s, scratch);   // its barriers also publish logits[]
    const float inv = 1.0f / s;
    T* o = out + ((i64)b * num_heads + h) * head_size;
    for (int d = threadIdx.x; d < head_size; d += blockDim.x) {
        float acc = 0.0f;
        for (int t = 0; t < len; ++t) {
            const i64 blk = table[t / block_size];
            const i64 row = (blk * block_size + t % block_size) * num_kv_heads + kvh;
            const float x = nibble(v_q[row * (head_size / 2) + d / 2], d & 1);
            const i64 g = row * groups + d / group;
            acc += logits[t] * (x * __half2float(v_step[g]) + __half2float(v_min[g]));
        }
        o[d] = from_float<T>(acc * inv);
    }
}

#define TIERD_INT4_ATTENTION(SUFFIX, T)                                                                \
    extern "C" __global__ void paged_attention_int4_##SUFFIX(                                         \
        T* out, const T* q, const u8* k_q, const __half* k_min, const __half* k_step, const u8* v_q,   \
        const __half* v_min, const __half* v_step, const T* k_own, const int* block_tables,           \
        const int* seq_lens, int max_blocks_per_seq, int num_heads, int num_kv_heads, int head_size,   \
        int block_size, int group, i64 q_stride, float scale) {                                        \
        int4_attention_impl<T>(out, q, k_q, k_min, k_step, v_q, v_min, v_step, k_own, block_tables,    \
                               seq_lens, max_blocks_per_seq, num_heads, num_kv_heads, head_size,       \
                               block_size, group, q_stride, scale);                                     \
    }

TIERD_INT4_ATTENTION(float32, float)
TIERD_INT4_ATTENTION(float16, __half)
TIERD_INT4_ATTENTION(bfloat16, __nv_bfloat16)
