// What the W8A8 kernels over i8mm's packed layout share (i8mm.c for AVX512-VNNI, i8amx.c for AMX-INT8): the rows
// quantized per token exactly as compressed-tensors defines it, and the int32 sums scaled into output rows.
// Include after NB is defined, with thread_buffer.h; cbuild.py hashes them with every source that includes them.
#ifndef I8_ROWS_H
#define I8_ROWS_H
#include <float.h>
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "grouped_tasks.h"
#include "thread_buffer.h"

static inline float bf16_to_f32(uint16_t h) {
    const uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint16_t to_bf16(float f) {  // round to nearest even, as VCVTNEPS2BF16 does
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7FFFFFFFu) > 0x7F800000u) return (uint16_t)((u >> 16) | 0x40);
    return (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1)) >> 16);
}

static inline float x_at(const void *x, int bf16, int64_t i) {
    return bf16 ? bf16_to_f32(((const uint16_t *)x)[i]) : ((const float *)x)[i];
}

// 16 values of x from element i (bf16 widened exactly, or float32).
static inline __attribute__((always_inline)) __m512 x16_at(const void *x, int bf16, int64_t i) {
    if (!bf16) return _mm512_loadu_ps((const float *)x + i);
    const __m256i h = _mm256_loadu_si256((const __m256i *)((const uint16_t *)x + i));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

// Row m of x → xq[m][K4] (q + 128, the padding 128: q = 0) and its scale. 16 values at a time, with the scalar
// code's exact operations (the division, not a reciprocal; rounding half to even): a scalar loop here was most
// of a W8A8 layer's time at 32 rows and more (24 Qwen2-0.5B layers: ~20 ms a step on a 2-core Xeon).
static void quantize_row(int64_t K, int64_t K4, const void *x, int bf16, int64_t m, uint8_t *xq, float *xs) {
    const int64_t K16 = K / 16 * 16;
    const __m512 magnitude = _mm512_castsi512_ps(_mm512_set1_epi32(0x7FFFFFFF));
    __m512 vmax = _mm512_setzero_ps();
    for (int64_t k = 0; k < K16; k += 16)  // a NaN is passed over, as fabsf(v) > amax passes it below
        vmax = _mm512_max_ps(_mm512_and_ps(x16_at(x, bf16, m * K + k), magnitude), vmax);
    float amax = _mm512_reduce_max_ps(vmax);
    for (int64_t k = K16; k < K; k++) {
        const float v = x_at(x, bf16, m * K + k);
        amax = fabsf(v) > amax ? fabsf(v) : amax;
    }
    float scale = amax / 127.5f;
    if (scale < FLT_MIN) scale = FLT_MIN;  // torch.finfo(float32).tiny: an all-zero row stays zero
    const __m512 vs = _mm512_set1_ps(scale), lo = _mm512_set1_ps(-128.f), hi = _mm512_set1_ps(127.f);
    for (int64_t k = 0; k < K16; k += 16) {
        __m512 q = _mm512_roundscale_ps(_mm512_div_ps(x16_at(x, bf16, m * K + k), vs),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        q = _mm512_min_ps(_mm512_max_ps(q, lo), hi);
        const __m512i u = _mm512_add_epi32(_mm512_cvtps_epi32(q), _mm512_set1_epi32(128));
        _mm_storeu_si128((__m128i *)(xq + m * K4 + k), _mm512_cvtepi32_epi8(u));
    }
    for (int64_t k = K16; k < K; k++) {
        float q = nearbyintf(x_at(x, bf16, m * K + k) / scale);  // the default rounding: half to even
        q = q < -128.f ? -128.f : (q > 127.f ? 127.f : q);
        xq[m * K4 + k] = (uint8_t)((int)q + 128);
    }
    for (int64_t k = K; k < K4; k++) xq[m * K4 + k] = 128;
    xs[m] = scale;
}

static __thread thread_buffer xq_buf;  // the quantized rows and their scales

// x [M][K] → the calling thread's buffer of quantized rows [M][K4] (q + 128), *xs their scales [M]; NULL without
// memory.
static const uint8_t *quantize_rows(int64_t M, int64_t K, int64_t K4, const void *x, int bf16, int nthreads,
                                    float **xs) {
    uint8_t *xq = grow(&xq_buf, (size_t)(M * K4 + 4 * M + 4));
    if (!xq) return NULL;
    float *scales = (float *)(xq + M * K4 + (4 - (M * K4) % 4) % 4);
#pragma omp parallel for schedule(static) num_threads(nthreads) if (M * K > 65536)
    for (int64_t m = 0; m < M; m++) quantize_row(K, K4, x, bf16, m, xq, scales);
    *xs = scales;
    return xq;
}

// A grouped call's arguments for its tasks (i8mm_grouped, i8amx_grouped): layer e's counts[e] rows of the
// quantized rows xq (Kq wide, scales xs) from row first[p] of piece p = its layer[p].
typedef struct {
    const int64_t *counts;
    int64_t N, Kq;
    const uint8_t *xq;
    const float *xs;
    const uint8_t *const *w;
    const int32_t *const *colsum;
    const float *const *ws;
    void *y;  // bf16 rows, or float32 ones (bf16 == 0)
    const int64_t *first, *layer;
    int silu_mul, bf16;
} i8group_t;

// E W8A8 layers of one shape over their own rows in one call (i8mm_grouped's arguments; x and y bf16, or float32
// where bf16 is 0): every row quantized once (Kq wide: i8mm's K rounded up to 4, i8amx's K), then `task` (i8mm's
// or i8amx's) over every (layer with rows, column block) as grouped_tasks.h spreads them. Returns 0, or -1 without
// memory for the quantized rows.
static int i8_grouped(int64_t E, const int64_t *counts, int64_t N, int64_t K, int64_t Kq, const void *x,
                      const uint8_t *const *w, const int32_t *const *colsum, const float *const *ws, void *y,
                      int nthreads, int silu_mul, int bf16, grouped_task_fn task) {
    const int64_t nblocks = (N + NB - 1) / NB;
    int64_t first[E > 0 ? E : 1], layer[E > 0 ? E : 1], M;  // each layer with rows: its first row, its index
    const int64_t P = grouped_pieces(E, counts, first, layer, &M);
    if (M <= 0) return 0;
    float *xs;
    const uint8_t *xq = quantize_rows(M, K, Kq, x, bf16, nthreads, &xs);
    if (!xq) return -1;
    const i8group_t g = {counts, N, Kq, xq, xs, w, colsum, ws, y, first, layer, silu_mul, bf16};
    grouped_tasks(P, nblocks, nthreads, 2, task, &g);
    return 0;
}

// One row's int32 sums acc (64 columns: (xq + 128) . w) → y: (acc - 128 * colsum) * xscale * wscale + b, at
// element off of y (bf16 when bf16, else float32), nn of the 64 columns.
static inline __attribute__((always_inline)) void store_row(const __m512i acc[4], const int32_t *colsum,
                                                            const float *ws, const float *bias, float xs, void *y,
                                                            int bf16, int64_t off, int64_t nn) {
    float o[NB];
    for (int j = 0; j < 4; j++) {
        const __m512i c = _mm512_slli_epi32(_mm512_loadu_si512((const void *)(colsum + 16 * j)), 7);
        const __m512 v = _mm512_cvtepi32_ps(_mm512_sub_epi32(acc[j], c));
        const __m512 s = _mm512_mul_ps(_mm512_loadu_ps(ws + 16 * j), _mm512_set1_ps(xs));
        _mm512_storeu_ps(o + 16 * j, _mm512_fmadd_ps(v, s, _mm512_loadu_ps(bias + 16 * j)));
    }
#ifdef __AVX512BF16__
    if (bf16 && nn == NB) {
        uint16_t *yr = (uint16_t *)y + off;
        for (int j = 0; j < 4; j += 2) {
            const __m512bh v = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(o + 16 * j + 16), _mm512_loadu_ps(o + 16 * j));
            _mm512_storeu_si512((void *)(yr + 16 * j), (__m512i)v);
        }
        return;
    }
#endif
    if (bf16) {
        uint16_t *yr = (uint16_t *)y + off;
        for (int64_t j = 0; j < nn; j++) yr[j] = to_bf16(o[j]);
    } else {
        memcpy((float *)y + off, o, sizeof(float) * (size_t)nn);
    }
}

#endif
