/* The CPU kernels: block copies between tier slots and an engine's paged KV cache, for caches
 * whose blocks are not one run of the slot's bytes (vLLM's CPU attention keeps K transposed per
 * block and head; its "amx" layout packs K and V in tiles) and for many blocks per call; and
 * the bundled engine's decode attention over its paged cache, read in place (at the end).
 * Built by kernels/native.py with the system C compiler and checked against the torch
 * references (kernels/reference.py) before use.
 *
 * A slot part holds one engine block of one plane, token-major: element (n, h, d) at
 * ((n * H) + h) * D + d. The cache block's element (n, h, d) is at n * sn + h * sh + d * sd
 * (strides in elements). Every address is checked by the caller: this file trusts them.
 */
#include <stdatomic.h>
#include <stdint.h>
#include <math.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX__) || defined(__SSE2__)
#include <immintrin.h>
#endif

#define TIERD_CPU_COPY_ABI 7

int tierd_cpu_copy_abi(void) { return TIERD_CPU_COPY_ABI; }

/* dst[j * ld + i] = src[i * ls + j] for an 8 x 8 tile (strides in bytes) */
static inline void tile32(const char *src, int64_t ls, char *dst, int64_t ld) {
#if defined(__AVX__)
    __m256 r0 = _mm256_loadu_ps((const float *)(src + 0 * ls)), r1 = _mm256_loadu_ps((const float *)(src + 1 * ls));
    __m256 r2 = _mm256_loadu_ps((const float *)(src + 2 * ls)), r3 = _mm256_loadu_ps((const float *)(src + 3 * ls));
    __m256 r4 = _mm256_loadu_ps((const float *)(src + 4 * ls)), r5 = _mm256_loadu_ps((const float *)(src + 5 * ls));
    __m256 r6 = _mm256_loadu_ps((const float *)(src + 6 * ls)), r7 = _mm256_loadu_ps((const float *)(src + 7 * ls));
    __m256 t0 = _mm256_unpacklo_ps(r0, r1), t1 = _mm256_unpackhi_ps(r0, r1);
    __m256 t2 = _mm256_unpacklo_ps(r2, r3), t3 = _mm256_unpackhi_ps(r2, r3);
    __m256 t4 = _mm256_unpacklo_ps(r4, r5), t5 = _mm256_unpackhi_ps(r4, r5);
    __m256 t6 = _mm256_unpacklo_ps(r6, r7), t7 = _mm256_unpackhi_ps(r6, r7);
    __m256 u0 = _mm256_shuffle_ps(t0, t2, 0x44), u1 = _mm256_shuffle_ps(t0, t2, 0xEE);
    __m256 u2 = _mm256_shuffle_ps(t1, t3, 0x44), u3 = _mm256_shuffle_ps(t1, t3, 0xEE);
    __m256 u4 = _mm256_shuffle_ps(t4, t6, 0x44), u5 = _mm256_shuffle_ps(t4, t6, 0xEE);
    __m256 u6 = _mm256_shuffle_ps(t5, t7, 0x44), u7 = _mm256_shuffle_ps(t5, t7, 0xEE);
    _mm256_storeu_ps((float *)(dst + 0 * ld), _mm256_permute2f128_ps(u0, u4, 0x20));
    _mm256_storeu_ps((float *)(dst + 1 * ld), _mm256_permute2f128_ps(u1, u5, 0x20));
    _mm256_storeu_ps((float *)(dst + 2 * ld), _mm256_permute2f128_ps(u2, u6, 0x20));
    _mm256_storeu_ps((float *)(dst + 3 * ld), _mm256_permute2f128_ps(u3, u7, 0x20));
    _mm256_storeu_ps((float *)(dst + 4 * ld), _mm256_permute2f128_ps(u0, u4, 0x31));
    _mm256_storeu_ps((float *)(dst + 5 * ld), _mm256_permute2f128_ps(u1, u5, 0x31));
    _mm256_storeu_ps((float *)(dst + 6 * ld), _mm256_permute2f128_ps(u2, u6, 0x31));
    _mm256_storeu_ps((float *)(dst + 7 * ld), _mm256_permute2f128_ps(u3, u7, 0x31));
#else
    for (int i = 0; i < 8; i++)
        for (int j = 0; j < 8; j++)
            memcpy(dst + j * ld + 4 * i, src + i * ls + 4 * j, 4);
#endif
}

static inline void tile16(const char *src, int64_t ls, char *dst, int64_t ld) {
#if defined(__SSE2__)
    __m128i a0 = _mm_loadu_si128((const __m128i *)(src + 0 * ls)), a1 = _mm_loadu_si128((const __m128i *)(src + 1 * ls));
    __m128i a2 = _mm_loadu_si128((const __m128i *)(src + 2 * ls)), a3 = _mm_loadu_si128((const __m128i *)(src + 3 * ls));
    __m128i a4 = _mm_loadu_si128((const __m128i *)(src + 4 * ls)), a5 = _mm_loadu_si128((const __m128i *)(src + 5 * ls));
    __m128i a6 = _mm_loadu_si128((const __m128i *)(src + 6 * ls)), a7 = _mm_loadu_si128((const __m128i *)(src + 7 * ls));
    __m128i b0 = _mm_unpacklo_epi16(a0, a1), b1 = _mm_unpackhi_epi16(a0, a1);
    __m128i b2 = _mm_unpacklo_epi16(a2, a3), b3 = _mm_unpackhi_epi16(a2, a3);
    __m128i b4 = _mm_unpacklo_epi16(a4, a5), b5 = _mm_unpackhi_epi16(a4, a5);
    __m128i b6 = _mm_unpacklo_epi16(a6, a7), b7 = _mm_unpackhi_epi16(a6, a7);
    __m128i c0 = _mm_unpacklo_epi32(b0, b2), c1 = _mm_unpackhi_epi32(b0, b2);
    __m128i c2 = _mm_unpacklo_epi32(b1, b3), c3 = _mm_unpackhi_epi32(b1, b3);
    __m128i c4 = _mm_unpacklo_epi32(b4, b6), c5 = _mm_unpackhi_epi32(b4, b6);
    __m128i c6 = _mm_unpacklo_epi32(b5, b7), c7 = _mm_unpackhi_epi32(b5, b7);
    _mm_storeu_si128((__m128i *)(dst + 0 * ld), _mm_unpacklo_epi64(c0, c4));
    _mm_storeu_si128((__m128i *)(dst + 1 * ld), _mm_unpackhi_epi64(c0, c4));
    _mm_storeu_si128((__m128i *)(dst + 2 * ld), _mm_unpacklo_epi64(c1, c5));
    _mm_storeu_si128((__m128i *)(dst + 3 * ld), _mm_unpackhi_epi64(c1, c5));
    _mm_storeu_si128((__m128i *)(dst + 4 * ld), _mm_unpacklo_epi64(c2, c6));
    _mm_storeu_si128((__m128i *)(dst + 5 * ld), _mm_unpackhi_epi64(c2, c6));
    _mm_storeu_si128((__m128i *)(dst + 6 * ld), _mm_unpacklo_epi64(c3, c7));
    _mm_storeu_si128((__m128i *)(dst + 7 * ld), _mm_unpackhi_epi64(c3, c7));
#else
    for (int i = 0; i < 8; i++)
        for (int j = 0; j < 8; j++)
            memcpy(dst + j * ld + 2 * i, src + i * ls + 2 * j, 2);
#endif
}

/* a row of `bytes` bytes: 32 at a time where both are whole multiples (a call to memcpy per
 * short row costs about as much as the copy) */
static inline void row_copy(char *dst, const char *src, int64_t bytes) {
#if defined(__AVX__)
    if ((bytes & 31) == 0) {
        for (int64_t k = 0; k < bytes; k += 32)
            _mm256_storeu_si256((__m256i *)(dst + k), _mm256_loadu_si256((const __m256i *)(src + k)));
        return;
    }
#endif
    memcpy(dst, src, (size_t)bytes);
}

/* Streaming (non-temporal) stores: the destination's lines are written without being read
 * first and bypass the caches, so a copy much larger than the caches moves two bytes over the
 * memory bus per byte copied instead of three (about 1.4x faster here, what memcpy itself
 * does above a size). The callers end such a copy with STREAM_FENCE, which orders these
 * stores before any later one (a commit that publishes the bytes). */
#if defined(__SSE2__)
#define STREAM_FENCE() _mm_sfence()
#else
#define STREAM_FENCE() ((void)0)
#endif

/* 64 bytes from `src` to the line at `dst` (64-byte aligned), streamed */
static inline void stream_line(char *dst, const char *src) {
#if defined(__AVX512F__)
    _mm512_stream_si512((void *)dst, _mm512_loadu_si512((const void *)src));
#elif defined(__AVX__)
    _mm256_stream_si256((__m256i *)dst, _mm256_loadu_si256((const __m256i *)src));
    _mm256_stream_si256((__m256i *)(dst + 32), _mm256_loadu_si256((const __m256i *)(src + 32)));
#elif defined(__SSE2__)
    for (int k = 0; k < 64; k += 16)
        _mm_stream_si128((__m128i *)(dst + k), _mm_loadu_si128((const __m128i *)(src + k)));
#else
    memcpy(dst, src, 64);
#endif
}

/* `bytes` bytes, whole lines of the destination streamed, its partial first and last lines
 * written as usual. 16 KiB at a time as four interleaved 4 KiB streams: more DRAM pages open at
 * once (here 1.2x the speed of one stream, and ahead of memcpy's own large copy). */
static void stream_copy(char *dst, const char *src, int64_t bytes) {
    int64_t head = (int64_t)((64 - ((uintptr_t)dst & 63)) & 63);
    if (head > bytes) head = bytes;
    memcpy(dst, src, (size_t)head);
    int64_t k = head;
    for (; k + 16384 <= bytes; k += 16384)
        for (int64_t j = 0; j < 4096; j += 64) {
            stream_line(dst + k + j, src + k + j);
            stream_line(dst + k + 4096 + j, src + k + 4096 + j);
            stream_line(dst + k + 8192 + j, src + k + 8192 + j);
            stream_line(dst + k + 12288 + j, src + k + 12288 + j);
        }
    for (; k + 64 <= bytes; k += 64)
        stream_line(dst + k, src + k);
    memcpy(dst + k, src + k, (size_t)(bytes - k));
}

/* a row: streamed when it is whole lines of the destination, else as row_copy */
static inline void row_put(char *dst, const char *src, int64_t bytes, int stream) {
    if (stream && ((uintptr_t)dst & 63) == 0 && (bytes & 63) == 0) {
        for (int64_t k = 0; k < bytes; k += 64)
            stream_line(dst + k, src + k);
        return;
    }
    row_copy(dst, src, bytes);
}

static inline void tile_any(const char *src, int64_t ls, char *dst, int64_t ld, int es) {
    for (int i = 0; i < 8; i++)
        for (int j = 0; j < 8; j++)
            memcpy(dst + j * ld + (int64_t)es * i, src + i * ls + (int64_t)es * j, (size_t)es);
}

/* The source of a transposing load, read first in its own order into a buffer that stays in
 * this core's L2 cache: the tiles below read 8 rows at a time, a few bytes of each, which out of
 * DRAM ran at 0.6-0.75 of memcpy's speed here; a sequential read ahead of them, then tiles out of
 * L2, at 0.8-1.0 (8 to 64 MiB of vLLM's CPU layout, fp32 and bf16, one thread). A save uses both
 * halves (transposed_save below). One per thread, allocated at its first use and freed when the
 * thread exits; NULL where it cannot be had. */
#define BOUNCE_BYTES (256 << 10)     /* a quarter of an L2 cache here: a whole 512 KiB plane ran slower than per head */
static pthread_key_t bounce_key;
static int bounce_key_ok;
static pthread_once_t bounce_once = PTHREAD_ONCE_INIT;
static void bounce_key_make(void) { bounce_key_ok = pthread_key_create(&bounce_key, free) == 0; }
static char *bounce_buffer(void) {
    pthread_once(&bounce_once, bounce_key_make);
    if (!bounce_key_ok) return NULL;
    char *b = pthread_getspecific(bounce_key);
    if (!b) {
        b = aligned_alloc(64, 2 * BOUNCE_BYTES);
        if (b && pthread_setspecific(bounce_key, b) != 0) {
            free(b);
            b = NULL;
        }
    }
    return b;
}

/* A load of `transposed` below through streaming stores: per head, 8 cache rows at a time are
 * transposed into a buffer (whole tiles: N and D multiples of 8) and streamed out as whole
 * lines: each row's, or, where the cache's rows follow one another (vLLM's CPU layout: a
 * (block, head) is one run), the 8 rows' as one run, so rows shorter than a line (16 tokens of
 * 2 bytes) stream too. The slot's rows are read through the bounce buffer: the whole block's
 * plane where it fits, else each head's part of them. 0 (nothing copied) where the rows are
 * neither, or longer than 1 KiB. */
static int transposed_streamed(char *c, const char *s, int64_t N, int64_t H, int64_t D, int64_t sh, int64_t sd,
                               int es) {
    const int64_t srow = H * D * es, crow = sd * es, rowb = N * es, hrow = D * es;
    const int run = crow == rowb;           /* the 8 rows of a tile step are one run */
    if ((N & 7) || (D & 7) || (es != 4 && es != 2) || rowb > 1024 || ((sh * es) & 63) || ((uintptr_t)c & 63) ||
        (run ? ((8 * rowb) & 63) : ((rowb & 63) || (crow & 63))))
        return 0;
    char buf[8 * 1024] __attribute__((aligned(64)));
    char *bounce = bounce_buffer();
    const int whole = bounce && N * srow <= BOUNCE_BYTES;
    const int per_head = bounce && !whole && N * hrow <= BOUNCE_BYTES;
    if (whole) {
        memcpy(bounce, s, (size_t)(N * srow));
        s = bounce;
    }
    for (int64_t h = 0; h < H; h++) {
        char *ch = c + h * sh * es;
        const char *sh0 = s + h * D * es;
        int64_t ls = srow;                  /* the tiles' source row stride */
        if (per_head) {
            for (int64_t n = 0; n < N; n++)
                memcpy(bounce + n * hrow, sh0 + n * srow, (size_t)hrow);
            sh0 = bounce;
            ls = hrow;
        }
        for (int64_t a = 0; a < D; a += 8) {
            for (int64_t b = 0; b < N; b += 8) {
                const char *sp = sh0 + b * ls + a * es;
                if (es == 4) tile32(sp, ls, buf + b * 4, rowb); else tile16(sp, ls, buf + b * 2, rowb);
            }
            if (run)
                for (int64_t k = 0; k < 8 * rowb; k += 64)
                    stream_line(ch + a * crow + k, buf + k);
            else
                for (int64_t r = 0; r < 8; r++)
                    for (int64_t k = 0; k < rowb; k += 64)
                        stream_line(ch + (a + r) * crow + k, buf + r * rowb + k);
        }
    }
    return 1;
}

/* One block of one plane whose cache tokens are contiguous (sn == 1): per head a (D, N) matrix
 * with row stride sd, against the slot's (N, D) rows of stride H * D. `stream`: a load's rows
 * streamed where transposed_streamed takes them. */
/* A save of `transposed` below (cache -> slot) where each (block, head) of the cache is one run
 * of D rows (vLLM's CPU layout): per head, the run is read in order into the first half of the
 * bounce buffer, its tiles transposed into the slot's rows in the second half (the block's whole
 * plane, in the slot's order), which is then written out in one run (streamed with `stream`).
 * Tiles straight between DRAM and the slot read and wrote a few bytes of each of 8 rows at a
 * time: 0.47-0.57 of memcpy here. 0 (nothing copied) where the layout or sizes do not fit. */
static int transposed_save(const char *c, char *s, int64_t N, int64_t H, int64_t D, int64_t sh, int64_t sd,
                           int es, int stream) {
    const int64_t srow = H * D * es, crow = sd * es, rowb = N * es;
    if ((N & 7) || (D & 7) || (es != 4 && es != 2) || crow != rowb || D * rowb > BOUNCE_BYTES ||
        N * srow > BOUNCE_BYTES)
        return 0;
    char *bounce = bounce_buffer();
    if (!bounce)
        return 0;
    char *cb = bounce, *pb = bounce + BOUNCE_BYTES;
    for (int64_t h = 0; h < H; h++) {
        memcpy(cb, c + h * sh * es, (size_t)(D * rowb));
        char *ph = pb + h * D * es;
        for (int64_t b = 0; b < N; b += 8)
            for (int64_t a = 0; a < D; a += 8) {
                const char *cp = cb + a * rowb + b * es;
                char *sp = ph + b * srow + a * es;
                if (es == 4) tile32(cp, rowb, sp, srow); else tile16(cp, rowb, sp, srow);
            }
    }
    if (stream) stream_copy(s, pb, N * srow); else memcpy(s, pb, (size_t)(N * srow));
    return 1;
}

static void transposed(char *c, char *s, int64_t N, int64_t H, int64_t D, int64_t sh, int64_t sd, int es,
                       int to_cache, int stream) {
    if (to_cache && stream && transposed_streamed(c, s, N, H, D, sh, sd, es))
        return;
    if (!to_cache && transposed_save(c, s, N, H, D, sh, sd, es, stream))
        return;
    const int64_t srow = H * D * es, crow = sd * es;
    const int64_t N8 = N & ~(int64_t)7, D8 = D & ~(int64_t)7;
    for (int64_t h = 0; h < H; h++) {
        char *ch = c + h * sh * es, *sh0 = s + h * D * es;
        /* tiles in the order that writes the destination's rows front to back */
        const int64_t outer = to_cache ? D8 : N8, inner = to_cache ? N8 : D8;
        for (int64_t a = 0; a < outer; a += 8)
            for (int64_t b = 0; b < inner; b += 8) {
                const int64_t n0 = to_cache ? b : a, d0 = to_cache ? a : b;
                char *sp = sh0 + n0 * srow + d0 * es, *cp = ch + d0 * crow + n0 * es;
                if (es == 4) {
                    if (to_cache) tile32(sp, srow, cp, crow); else tile32(cp, crow, sp, srow);
                } else if (es == 2) {
                    if (to_cache) tile16(sp, srow, cp, crow); else tile16(cp, crow, sp, srow);
                } else {
                    if (to_cache) tile_any(sp, srow, cp, crow, es); else tile_any(cp, crow, sp, srow, es);
                }
            }
        for (int64_t n = 0; n < N; n++)          /* what the 8 x 8 tiles left: ragged edges */
            for (int64_t d = (n < N8 ? D8 : 0); d < D; d++) {
                char *sp = sh0 + n * srow + d * es, *cp = ch + d * crow + n * es;
                if (to_cache) memcpy(cp, sp, (size_t)es); else memcpy(sp, cp, (size_t)es);
            }
    }
}

/* The engine blocks tier blocks name, `ratio` per tier block, row-major; a negative id: a part
 * not copied. Whether every id is below `num_blocks` (checked before anything is copied). */
static int ids_in_range(int64_t count, const int64_t *ids, int64_t num_blocks) {
    for (int64_t i = 0; i < count; i++)
        if (ids[i] >= num_blocks) return 0;
    return 1;
}

/* One plane of every layer, between `tiers` tier blocks (slots) and engine blocks: part r of
 * tier block t copies engine block ids[t * ratio + r] (skipped if negative) of each layer's
 * cache (the layer's starts at `cache_base[l]`, its blocks `block_stride` bytes apart) to or from
 * the slot bytes at slot_base[t] + slot_offset + l * layer_step + r * (one engine block of the
 * plane). `to_cache`: slot -> cache (a load), else cache -> slot (a save). `stream`: runs and
 * whole-line rows go through streaming stores (copies far larger than the caches). Returns -1,
 * copying nothing, if an id is out of range. */
int tierd_copy_blocks(int64_t layers, const int64_t *cache_base, int64_t block_stride, int64_t num_blocks,
                      int64_t tiers, int64_t ratio, const int64_t *ids, const int64_t *slot_base,
                      int64_t slot_offset, int64_t layer_step, int to_cache, int stream, int es,
                      int64_t N, int64_t H, int64_t D, int64_t sn, int64_t sh, int64_t sd) {
    const int whole = sd == 1 && sh == D && sn == H * D;
    const int64_t unit = N * H * D * es;
    if (!ids_in_range(tiers * ratio, ids, num_blocks)) return -1;
    for (int64_t l = 0; l < layers; l++)
    for (int64_t t = 0; t < tiers; t++)
    for (int64_t r = 0; r < ratio; r++) {
        const int64_t id = ids[t * ratio + r];
        if (id < 0) continue;
        char *c = (char *)(intptr_t)(cache_base[l] + id * block_stride);
        char *s = (char *)(intptr_t)(slot_base[t] + slot_offset + l * layer_step + r * unit);
        if (whole) {
            /* a run of consecutive engine blocks, adjacent in the cache: one copy */
            int64_t run = 1;
            if (block_stride == unit)
                while (r + run < ratio && ids[t * ratio + r + run] == id + run) run++;
            char *d = to_cache ? c : s;
            const char *from = to_cache ? s : c;
            if (stream) stream_copy(d, from, run * unit); else memcpy(d, from, (size_t)(run * unit));
            r += run - 1;
        } else if (sd == 1) {                 /* rows of D elements, the cache's in its order */
            for (int64_t n = 0; n < N; n++)
                for (int64_t h = 0; h < H; h++) {
                    char *cp = c + (n * sn + h * sh) * es, *sp = s + ((n * H + h) * D) * es;
                    if (to_cache) row_put(cp, sp, D * es, stream); else row_put(sp, cp, D * es, stream);
                }
        } else if (sn == 1) {
            transposed(c, s, N, H, D, sh, sd, es, to_cache, stream);
        } else {                               /* any other strides: element by element */
            for (int64_t n = 0; n < N; n++)
                for (int64_t h = 0; h < H; h++)
                    for (int64_t d = 0; d < D; d++) {
                        char *cp = c + (n * sn + h * sh + d * sd) * es, *sp = s + ((n * H + h) * D + d) * es;
                        if (to_cache) memcpy(cp, sp, (size_t)es); else memcpy(sp, cp, (size_t)es);
                    }
        }
    }
    if (stream) STREAM_FENCE();
    return 0;
}

/* ---- vLLM's "amx" CPU attention layout (bf16: 2-byte elements) ---------------------------
 * Per (block, head) a plane of N * D elements. K: 16-token tiles of head_dim pairs, element
 * (t, d) at (t / 16) * 16 * D + (d / 2) * 32 + (t % 16) * 2 + d % 2: per tile, as 4-byte pairs,
 * the transpose of the slot's 16 x D / 2 rows. V: 16-column tiles of token pairs, (t, d) at
 * (d / 16) * 16 * N + (t / 2) * 32 + (d % 16) * 2 + t % 2: two slot rows of 16 values
 * interleaved. `sh`: the cache's head stride in elements. */
static inline void interleave16(const char *a, const char *b, char *out) {  /* out[2g] = a[g], out[2g+1] = b[g] */
#if defined(__SSE2__)
    __m128i a0 = _mm_loadu_si128((const __m128i *)a), a1 = _mm_loadu_si128((const __m128i *)(a + 16));
    __m128i b0 = _mm_loadu_si128((const __m128i *)b), b1 = _mm_loadu_si128((const __m128i *)(b + 16));
    _mm_storeu_si128((__m128i *)out, _mm_unpacklo_epi16(a0, b0));
    _mm_storeu_si128((__m128i *)(out + 16), _mm_unpackhi_epi16(a0, b0));
    _mm_storeu_si128((__m128i *)(out + 32), _mm_unpacklo_epi16(a1, b1));
    _mm_storeu_si128((__m128i *)(out + 48), _mm_unpackhi_epi16(a1, b1));
#else
    for (int g = 0; g < 16; g++) {
        memcpy(out + 4 * g, a + 2 * g, 2);
        memcpy(out + 4 * g + 2, b + 2 * g, 2);
    }
#endif
}

static inline void deinterleave16(const char *in, char *a, char *b) {    /* the reverse */
#if defined(__SSE2__)
    __m128i c0 = _mm_loadu_si128((const __m128i *)in), c1 = _mm_loadu_si128((const __m128i *)(in + 16));
    __m128i c2 = _mm_loadu_si128((const __m128i *)(in + 32)), c3 = _mm_loadu_si128((const __m128i *)(in + 48));
    /* the low halves of each 32-bit lane (sign-extended, so the signed pack keeps them whole), then the high */
#define LO16(x) _mm_srai_epi32(_mm_slli_epi32((x), 16), 16)
    _mm_storeu_si128((__m128i *)a, _mm_packs_epi32(LO16(c0), LO16(c1)));
    _mm_storeu_si128((__m128i *)(a + 16), _mm_packs_epi32(LO16(c2), LO16(c3)));
#undef LO16
    _mm_storeu_si128((__m128i *)b, _mm_packs_epi32(_mm_srai_epi32(c0, 16), _mm_srai_epi32(c1, 16)));
    _mm_storeu_si128((__m128i *)(b + 16), _mm_packs_epi32(_mm_srai_epi32(c2, 16), _mm_srai_epi32(c3, 16)));
#else
    for (int g = 0; g < 16; g++) {
        memcpy(a + 2 * g, in + 4 * g, 2);
        memcpy(b + 2 * g, in + 4 * g + 2, 2);
    }
#endif
}

/* One plane (0: K, 1: V) of every layer of the amx layout, addressed as in tierd_copy_blocks
 * (bf16); a cache block's address is the plane's start in its head 0. N and D multiples of 16.
 * `stream`: a load's lines are streamed (K's through transposed_streamed, V's interleaved). */
int tierd_copy_amx(int64_t layers, const int64_t *cache_base, int64_t block_stride, int64_t num_blocks,
                   int64_t tiers, int64_t ratio, const int64_t *ids, const int64_t *slot_base,
                   int64_t slot_offset, int64_t layer_step, int to_cache, int stream, int plane,
                   int64_t N, int64_t H, int64_t D, int64_t sh) {
    const int64_t srow = H * D * 2;                         /* one token of the slot, bytes */
    const int64_t unit = N * srow;
    if (!ids_in_range(tiers * ratio, ids, num_blocks)) return -1;
    for (int64_t l = 0; l < layers; l++)
    for (int64_t t = 0; t < tiers; t++)
    for (int64_t r = 0; r < ratio; r++) {
        const int64_t id = ids[t * ratio + r];
        if (id < 0) continue;
        char *c = (char *)(intptr_t)(cache_base[l] + id * block_stride);
        char *s = (char *)(intptr_t)(slot_base[t] + slot_offset + l * layer_step + r * unit);
        if (plane == 0) {
            /* each 16-token tile: pairs as 4-byte elements, (16, D / 2) slot rows <-> (D / 2, 16) */
            for (int64_t a = 0; a < N / 16; a++)
                transposed(c + a * 16 * D * 2, s + a * 16 * srow, 16, H, D / 2, sh / 2, 16, 4, to_cache,
                           stream);
            continue;
        }
        for (int64_t h = 0; h < H; h++)
            for (int64_t f = 0; f < D / 16; f++) {
                char *cf = c + (h * sh + f * 16 * N) * 2, *sf = s + (h * D + f * 16) * 2;
                for (int64_t q = 0; q < N / 2; q++) {
                    char *cp = cf + q * 64, *s0 = sf + 2 * q * srow;
                    if (!to_cache) {
                        deinterleave16(cp, s0, s0 + srow);
                    } else if (stream && ((uintptr_t)cp & 63) == 0) {
                        char line[64] __attribute__((aligned(64)));
                        interleave16(s0, s0 + srow, line);
                        stream_line(cp, line);
                    } else {
                        interleave16(s0, s0 + srow, cp);
                    }
                }
            }
    }
    if (stream) STREAM_FENCE();
    return 0;
}

/* ---- one copy split into items, taken in turn by a team of threads ------------------------
 * An item is the arguments of one tierd_copy_blocks (kind 0) or tierd_copy_amx (kind 1) call,
 * TIERD_ITEM_WORDS int64 words: kind, layers, cache_base, block_stride, num_blocks, tiers, ratio,
 * group, (unused), slot_offset, layer_step, to_cache, stream, then the layout's seven (amx: its
 * five). The ids come from `ids[group]` and the slots' addresses from `slots`, arguments of the
 * call: the items of one shape of copy are made once and serve every copy of that shape. Each
 * thread of the team takes the next item not yet taken, so a thread that joins late takes fewer.
 * The team is OpenMP's (`parallel`: the address of the runtime's GOMP_parallel, the runtime
 * torch computes with, whose threads are still spinning after a forward and take their items at
 * once), or the caller alone (`parallel` 0). */
#define TIERD_ITEM_WORDS 20

typedef void (*tierd_parallel_fn)(void (*)(void *), void *, unsigned, unsigned);

struct tierd_split {
    const int64_t *items;
    int64_t count;
    const int64_t *const *ids;
    const int64_t *slots;
    atomic_llong next;
    atomic_int bad;
};

static int run_item(const int64_t *w, const int64_t *const *ids_by_group, const int64_t *slots) {
    const int64_t *base = (const int64_t *)(intptr_t)w[2];
    const int64_t *ids = ids_by_group[w[7]];
    if (w[0] == 0)
        return tierd_copy_blocks(w[1], base, w[3], w[4], w[5], w[6], ids, slots, w[9], w[10], (int)w[11],
                                 (int)w[12], (int)w[13], w[14], w[15], w[16], w[17], w[18], w[19]);
    return tierd_copy_amx(w[1], base, w[3], w[4], w[5], w[6], ids, slots, w[9], w[10], (int)w[11], (int)w[12],
                          (int)w[13], w[14], w[15], w[16], w[17]);
}

static void split_body(void *p) {
    struct tierd_split *s = p;
    int64_t i;
    while ((i = atomic_fetch_add(&s->next, 1)) < s->count)
        if (run_item(s->items + i * TIERD_ITEM_WORDS, s->ids, s->slots) != 0) atomic_store(&s->bad, 1);
}

int tierd_copy_split(const int64_t *items, int64_t count, void *parallel, int threads,
                     const int64_t *const *ids, const int64_t *slots) {
    struct tierd_split s;
    s.items = items;
    s.count = count;
    s.ids = ids;
    s.slots = slots;
    atomic_init(&s.next, 0);
    atomic_init(&s.bad, 0);
    if (parallel != NULL && threads > 1 && count > 1)
        ((tierd_parallel_fn)parallel)(split_body, &s, (unsigned)(threads < count ? threads : count), 0);
    else
        split_body(&s);
    return atomic_load(&s.bad) ? -1 : 0;
}

/* ---- decode attention over a paged cache, read in place ------------------------------------
 * One query per sequence: q (B, heads, d) float32; the caches (blocks, bs, kv_heads, d)
 * contiguous, float32 (es 4) or bfloat16 (es 2); tables (B, max_blocks) int32; lens (B,) int32;
 * out (B, heads, d) float32. Sequences [b0, b1) only (callers split a batch across threads).
 * Exact softmax in two passes per (sequence, kv head): the scores of every token, their max,
 * then the weighted sum of V; float32 throughout, no token at or past a length is read.
 * `work`: room for heads / kv_heads * max length floats. */
static inline float load_el(const char *p, int es) {
    if (es == 4) { float f; memcpy(&f, p, 4); return f; }
    uint16_t h; memcpy(&h, p, 2);
    uint32_t u = (uint32_t)h << 16; float f; memcpy(&f, &u, 4); return f;   /* bfloat16 */
}

int tierd_decode_attention(const float *q, const char *k_cache, const char *v_cache, int es,
                           const int32_t *tables, int64_t max_blocks, const int32_t *lens,
                           int64_t b0, int64_t b1, int64_t heads, int64_t kvh, int64_t d, int64_t bs,
                           float scale, float *out, float *work, float *kbuf) {
    const int64_t group = heads / kvh, row = kvh * d;       /* a token's row, elements */
    for (int64_t b = b0; b < b1; b++) {
        const int64_t n = lens[b];
        const int32_t *table = tables + b * max_blocks;
        for (int64_t g = 0; g < kvh; g++) {
            const float *qg = q + (b * heads + g * group) * d;
            float *sc = work;                                 /* (group, n) scores */
            for (int64_t t = 0; t < n; t++) {
                const char *kp = k_cache + (((int64_t)table[t / bs] * bs + t % bs) * row + g * d) * es;
                const float *k;
                if (es == 4) k = (const float *)kp;
                else { for (int64_t i = 0; i < d; i++) kbuf[i] = load_el(kp + i * es, es); k = kbuf; }
                for (int64_t j = 0; j < group; j++) {
                    const float *qq = qg + j * d;
                    float s0 = 0.f, s1 = 0.f, s2 = 0.f, s3 = 0.f, s4 = 0.f, s5 = 0.f, s6 = 0.f, s7 = 0.f;
                    int64_t i = 0;
                    for (; i + 8 <= d; i += 8) {
                        s0 += qq[i] * k[i]; s1 += qq[i + 1] * k[i + 1]; s2 += qq[i + 2] * k[i + 2];
                        s3 += qq[i + 3] * k[i + 3]; s4 += qq[i + 4] * k[i + 4]; s5 += qq[i + 5] * k[i + 5];
                        s6 += qq[i + 6] * k[i + 6]; s7 += qq[i + 7] * k[i + 7];
                    }
                    for (; i < d; i++) s0 += qq[i] * k[i];
                    sc[j * n + t] = ((s0 + s1) + (s2 + s3) + ((s4 + s5) + (s6 + s7))) * scale;
                }
            }
            for (int64_t j = 0; j < group; j++) {
                float *s = sc + j * n, m = -INFINITY, l = 0.f;
                for (int64_t t = 0; t < n; t++) m = s[t] > m ? s[t] : m;
                for (int64_t t = 0; t < n; t++) { s[t] = expf(s[t] - m); l += s[t]; }
                float *o = out + (b * heads + g * group + j) * d;
                for (int64_t i = 0; i < d; i++) o[i] = 0.f;
                const float inv = n > 0 ? 1.f / l : 0.f;
                for (int64_t t = 0; t < n; t++) s[t] *= inv;
            }
            for (int64_t t = 0; t < n; t++) {
                const char *vp = v_cache + (((int64_t)table[t / bs] * bs + t % bs) * row + g * d) * es;
                const float *v;
                if (es == 4) v = (const float *)vp;
                else { for (int64_t i = 0; i < d; i++) kbuf[i] = load_el(vp + i * es, es); v = kbuf; }
                for (int64_t j = 0; j < group; j++) {
                    const float p = sc[j * n + t];
                    float *o = out + (b * heads + g * group + j) * d;
                    for (int64_t i = 0; i < d; i++) o[i] += p * v[i];
                }
            }
        }
    }
    return 0;
}
