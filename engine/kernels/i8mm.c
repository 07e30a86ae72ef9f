// W8A8 linear layers for CPUs with AVX512-VNNI (Cascade Lake, Zen 4 and later): y[M][N] = dequant(xq) .
// dequant(W)^T (+ b), x and y bf16 or float32, W int8 with a float scale per output channel, x quantized here per
// row exactly as compressed-tensors defines it (engine.quant.weights.quantize_tokens: the largest magnitude maps
// to 127.5 steps, round half to even, clamp to [-128, 127]).
//
// VPDPBUSD multiplies unsigned by signed bytes, four to a 32-bit lane, and sums into int32: the rows go in as
// xq + 128 (unsigned), and 128 * (the column's sum of weights) comes off at the end, so the int32 sums are
// exactly sum xq * wq. Then y = sum * xscale * wscale + b. 64 products an instruction against VDPBF16PS's 32, and
// half of bf16's bytes streamed: decode at small batches reads the weights once per step.
//
// Packed layout (i8mm.py packs): [ceil(N/64)][K4/4][64][4] bytes, K4 = K rounded up to 4: for each 64-column
// block and each 4 k, the 64 columns' four weights side by side, so one 64-byte load feeds 16 columns x 4 k to
// one VPDPBUSD. Padding weights are 0.
#if !defined(__AVX512VNNI__) || !defined(__AVX512BW__)
#error "this kernel needs AVX512-VNNI (-march=native on a CPU without it: oneDNN or torch._int_mm is used instead)"
#endif
#include <float.h>
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define NB 64
#define MR 6
#define MC 192  // rows a pass, so their quantized values stay in L2 while the column blocks stream past
// Row tiles a block may have for its tiles to prefetch the next block (see i8mm_linear): bf16mm's figure, from a
// Zen 4. i8mm.py also builds the kernel with -DPF_TILES=1 (no software prefetch); the selection times both.
#ifndef PF_TILES
#define PF_TILES 8
#endif

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

// Row m of x → xq[m][K4] (q + 128, the padding 128: q = 0) and its scale.
static void quantize_row(int64_t K, int64_t K4, const void *x, int bf16, int64_t m, uint8_t *xq, float *xs) {
    float amax = 0;
    for (int64_t k = 0; k < K; k++) {
        const float v = x_at(x, bf16, m * K + k);
        amax = fabsf(v) > amax ? fabsf(v) : amax;
    }
    float scale = amax / 127.5f;
    if (scale < FLT_MIN) scale = FLT_MIN;  // torch.finfo(float32).tiny: an all-zero row stays zero
    for (int64_t k = 0; k < K; k++) {
        float q = nearbyintf(x_at(x, bf16, m * K + k) / scale);  // the default rounding: half to even
        q = q < -128.f ? -128.f : (q > 127.f ? 127.f : q);
        xq[m * K4 + k] = (uint8_t)((int)q + 128);
    }
    for (int64_t k = K; k < K4; k++) xq[m * K4 + k] = 128;
    xs[m] = scale;
}

// pf, pf_end, pf_step: the part of the next column block this tile asks for, spread over its k steps (run()).
static inline __attribute__((always_inline)) void tile(const int mr, int64_t K4, const uint8_t *xq,
                                                       const uint8_t *w, __m512i acc[MR][4], const char *pf,
                                                       const char *pf_end, int64_t pf_step) {
    for (int r = 0; r < mr; r++)
        for (int j = 0; j < 4; j++) acc[r][j] = _mm512_setzero_si512();
    for (int64_t kq = 0; kq < K4 / 4; kq++) {
        for (int64_t l = 0; l < pf_step && pf < pf_end; l++, pf += 64) _mm_prefetch(pf, _MM_HINT_T1);
        const uint8_t *wk = w + kq * 4 * NB;
        const __m512i w0 = _mm512_loadu_si512((const void *)wk), w1 = _mm512_loadu_si512((const void *)(wk + 64));
        const __m512i w2 = _mm512_loadu_si512((const void *)(wk + 128));
        const __m512i w3 = _mm512_loadu_si512((const void *)(wk + 192));
        for (int r = 0; r < mr; r++) {
            int32_t p;
            memcpy(&p, xq + r * K4 + 4 * kq, 4);
            const __m512i xv = _mm512_set1_epi32(p);
            acc[r][0] = _mm512_dpbusd_epi32(acc[r][0], xv, w0);
            acc[r][1] = _mm512_dpbusd_epi32(acc[r][1], xv, w1);
            acc[r][2] = _mm512_dpbusd_epi32(acc[r][2], xv, w2);
            acc[r][3] = _mm512_dpbusd_epi32(acc[r][3], xv, w3);
        }
    }
}

// acc of mr rows → y rows: (acc - 128 * colsum) * xscale * wscale + b.
static inline __attribute__((always_inline)) void store(const int mr, __m512i acc[MR][4], const int32_t *colsum,
                                                        const float *ws, const float *bias, const float *xs,
                                                        void *y, int bf16, int64_t N, int64_t n0, int64_t nn) {
    for (int r = 0; r < mr; r++) {
        float o[NB];
        for (int j = 0; j < 4; j++) {
            const __m512i c = _mm512_slli_epi32(_mm512_loadu_si512((const void *)(colsum + 16 * j)), 7);
            const __m512 v = _mm512_cvtepi32_ps(_mm512_sub_epi32(acc[r][j], c));
            const __m512 s = _mm512_mul_ps(_mm512_loadu_ps(ws + 16 * j), _mm512_set1_ps(xs[r]));
            _mm512_storeu_ps(o + 16 * j, _mm512_fmadd_ps(v, s, _mm512_loadu_ps(bias + 16 * j)));
        }
#ifdef __AVX512BF16__
        if (bf16 && nn == NB) {
            uint16_t *yr = (uint16_t *)y + r * N + n0;
            for (int j = 0; j < 4; j += 2) {
                const __m512bh v = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(o + 16 * j + 16), _mm512_loadu_ps(o + 16 * j));
                _mm512_storeu_si512((void *)(yr + 16 * j), (__m512i)v);
            }
            continue;
        }
#endif
        if (bf16) {
            uint16_t *yr = (uint16_t *)y + r * N + n0;
            for (int64_t j = 0; j < nn; j++) yr[j] = to_bf16(o[j]);
        } else {
            memcpy((float *)y + r * N + n0, o, sizeof(float) * (size_t)nn);
        }
    }
}

typedef struct {  // a tile's share of the next block's prefetch
    const char *at, *end;
    int64_t step;
} pf_t;

static inline __attribute__((always_inline)) void row_tile(const int mr, int64_t K4, const uint8_t *xq,
                                                           const uint8_t *w, const int32_t *colsum, const float *ws,
                                                           const float *bias, const float *xs, void *y, int bf16,
                                                           int64_t N, int64_t n0, int64_t nn, pf_t pf) {
    __m512i acc[MR][4];
    tile(mr, K4, xq, w, acc, pf.at, pf.end, pf.step);
    store(mr, acc, colsum, ws, bias, xs, y, bf16, N, n0, nn);
}

static void row_tile_any(int mr, int64_t K4, const uint8_t *xq, const uint8_t *w, const int32_t *colsum,
                         const float *ws, const float *bias, const float *xs, void *y, int bf16, int64_t N,
                         int64_t n0, int64_t nn, pf_t pf) {
    switch (mr) {  // a constant row count keeps every accumulator in a register
    case 1: row_tile(1, K4, xq, w, colsum, ws, bias, xs, y, bf16, N, n0, nn, pf); break;
    case 2: row_tile(2, K4, xq, w, colsum, ws, bias, xs, y, bf16, N, n0, nn, pf); break;
    case 3: row_tile(3, K4, xq, w, colsum, ws, bias, xs, y, bf16, N, n0, nn, pf); break;
    case 4: row_tile(4, K4, xq, w, colsum, ws, bias, xs, y, bf16, N, n0, nn, pf); break;
    case 5: row_tile(5, K4, xq, w, colsum, ws, bias, xs, y, bf16, N, n0, nn, pf); break;
    default: row_tile(6, K4, xq, w, colsum, ws, bias, xs, y, bf16, N, n0, nn, pf); break;
    }
}

// Per thread, grown to the largest call seen: the quantized rows and their scales.
static __thread uint8_t *xq_buf;
static __thread int64_t xq_cap;

// x [M][K] (bf16 when bf16, else float32) → y [M][N] of the same type. w: the packed weight; colsum, ws, b:
// int32 / float [ceil(N/64) * 64] (b may be NULL). Returns 0, or -1 without memory for the quantized rows.
int i8mm_linear(int64_t M, int64_t N, int64_t K, const void *x, int bf16, const uint8_t *w, const int32_t *colsum,
                const float *ws, const float *b, void *y, int nthreads) {
    const int64_t K4 = (K + 3) / 4 * 4, nblocks = (N + NB - 1) / NB, need = M * K4 + 4 * M;
    if (M <= 0) return 0;
    if (xq_cap < need) {
        free(xq_buf);
        xq_buf = malloc((size_t)need);
        xq_cap = xq_buf ? need : 0;
        if (!xq_buf) return -1;
    }
    uint8_t *xq = xq_buf;
    float *xs = (float *)(xq_buf + M * K4 + (4 - (M * K4) % 4) % 4);
#pragma omp parallel for schedule(static) num_threads(nthreads) if (M * K > 65536)
    for (int64_t m = 0; m < M; m++) quantize_row(K, K4, x, bf16, m, xq, xs);
    static const float zeros[NB];
#pragma omp parallel num_threads(nthreads)
    for (int64_t mc0 = 0; mc0 < M; mc0 += MC) {
        const int64_t mc1 = M < mc0 + MC ? M : mc0 + MC;
        // NOTE: as in bf16mm.c, the first row tile of a block reads its weights from memory and the others from
        // L2, where the hardware prefetchers see no misses to follow; each tile asks for its share of the next
        // block instead, so that block streams in while this one is computed
        const int64_t tiles = (mc1 - mc0 + MR - 1) / MR, lines = K4 * NB / 64;
        const int64_t share = (lines + tiles - 1) / tiles, pf_step = (share + K4 / 4 - 1) / (K4 / 4);
        // the same static split in every chunk: a thread always writes the same columns, so no barrier is needed
#pragma omp for schedule(static) nowait
        for (int64_t nb = 0; nb < nblocks; nb++) {
            const int64_t n0 = nb * NB, nn = N - n0 < NB ? N - n0 : NB;
            const char *next = (const char *)(w + (nb + 1) * K4 * NB);
            const char *next_end = nb + 1 < nblocks && tiles > 1 && tiles <= PF_TILES ? next + lines * 64 : next;
            for (int64_t r0 = mc0; r0 < mc1; r0 += MR) {
                const int mr = mc1 - r0 < MR ? (int)(mc1 - r0) : MR;
                const char *pf = next + (r0 - mc0) / MR * share * 64;
                const pf_t p = {pf, pf + share * 64 < next_end ? pf + share * 64 : next_end, pf_step};
                void *yr = bf16 ? (void *)((uint16_t *)y + r0 * N) : (void *)((float *)y + r0 * N);
                row_tile_any(mr, K4, xq + r0 * K4, w + nb * K4 * NB, colsum + n0, ws + n0, b ? b + n0 : zeros,
                             xs + r0, yr, bf16, N, n0, nn, p);
            }
        }
    }
    return 0;
}
