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
// one VPDPBUSD. Padding weights are 0. i8mm_grouped (at the end, CPUs with AVX512-BF16) runs a MoE layer's
// experts over this layout in one call.
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

#include "grouped_tasks.h"
#include "i8_rows.h"
#include "silu.h"

// Row tiles a block may have for its tiles to prefetch the next block (see i8mm_linear): bf16mm's figure, from a
// Zen 4. i8mm.py also builds the kernel with -DPF_TILES=1 (no software prefetch); the selection times both.
#ifndef PF_TILES
#define PF_TILES 8
#endif

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

// acc of mr rows → y rows (i8_rows.h).
static inline __attribute__((always_inline)) void store(const int mr, __m512i acc[MR][4], const int32_t *colsum,
                                                        const float *ws, const float *bias, const float *xs,
                                                        void *y, int bf16, int64_t N, int64_t n0, int64_t nn) {
    for (int r = 0; r < mr; r++) store_row(acc[r], colsum, ws, bias, xs[r], y, bf16, r * N + n0, nn);
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

#ifdef __AVX512BF16__
#include "avx512_math.h"
#endif

// silu(g) * u of a block's 32 gate and 32 up float sums (o: gate, then up) into 32 float32 outputs: silu.h's, as
// w4f32's, i8avx2's and wbf16's fused entries compute it (a vector exp; libm's expf once an output before).
static void store_silu_mul_f32(const float *o, float *yr) { silu_mul_f32(o, o + NB / 2, yr, NB / 2); }

// x [M][K] (bf16 when bf16, else float32) → y [M][N] of the same type (with silu_mul y [M][N / 2], see
// i8mm_linear_silu_mul). w: the packed weight; colsum, ws, b: int32 / float [ceil(N/64) * 64] (b may be NULL).
static int linear(int64_t M, int64_t N, int64_t K, const void *x, int bf16, const uint8_t *w, const int32_t *colsum,
                  const float *ws, const float *b, void *y, int nthreads, const int silu_mul) {
    const int64_t K4 = (K + 3) / 4 * 4, nblocks = (N + NB - 1) / NB;
    if (M <= 0) return 0;
    float *xs;
    const uint8_t *xq = quantize_rows(M, K, K4, x, bf16, nthreads, &xs);
    if (!xq) return -1;
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
                const float *bias = b ? b + n0 : zeros;
                if (!silu_mul) {
                    void *yr = bf16 ? (void *)((uint16_t *)y + r0 * N) : (void *)((float *)y + r0 * N);
                    row_tile_any(mr, K4, xq + r0 * K4, w + nb * K4 * NB, colsum + n0, ws + n0, bias, xs + r0, yr,
                                 bf16, N, n0, nn, p);
                    continue;
                }
                float o[MR * NB];  // float rows of 32 gate and 32 up columns each
                row_tile_any(mr, K4, xq + r0 * K4, w + nb * K4 * NB, colsum + n0, ws + n0, bias, xs + r0, o, 0, NB,
                             0, NB, p);
                for (int r = 0; r < mr; r++) {
                    const int64_t off = (r0 + r) * (N / 2) + n0 / 2;
#ifdef __AVX512BF16__
                    if (bf16) {
                        store_silu_mul_block(o + r * NB, (uint16_t *)y + off);
                        continue;
                    }
#endif
                    store_silu_mul_f32(o + r * NB, (float *)y + off);
                }
            }
        }
    }
    return 0;
}

// x [M][K] (bf16 when bf16, else float32) → y [M][N] of the same type. w: the packed weight; colsum, ws, b:
// int32 / float [ceil(N/64) * 64] (b may be NULL). Returns 0, or -1 without memory for the quantized rows.
int i8mm_linear(int64_t M, int64_t N, int64_t K, const void *x, int bf16, const uint8_t *w, const int32_t *colsum,
                const float *ws, const float *b, void *y, int nthreads) {
    return linear(M, N, K, x, bf16, w, colsum, ws, b, y, nthreads, 0);
}

// i8mm_linear_silu_mul (below) over float32 rows in and out, silu(gate) * up in float32 (float32 math: CPUs with
// AVX512-VNNI but no AVX512-BF16, or float32 forced). WHY: without it such a gated MLP ran i8mm's plain entry and
// torch's act, a decode program stopping for Python at each. Returns 0, or -1 without memory for the quantized rows.
int i8mm_linear_silu_mul_f32(int64_t M, int64_t N, int64_t K, const float *x, const uint8_t *w,
                             const int32_t *colsum, const float *ws, const float *b, float *y, int nthreads) {
    return linear(M, N, K, x, 0, w, colsum, ws, b, y, nthreads, 1);
}

#ifdef __AVX512BF16__
// i8mm_linear over a gated MLP's [gate; up] weight packed with its rows (and their column sums, scales and bias)
// interleaved in blocks of 32 (N % 64 == 0, checked by the caller): bf16 x [M][K] → y [M][N / 2] = silu(gate) *
// up, rounded as the unfused bf16 torch code rounds. WHY: unfused, the [M, N] projection went to memory and torch's
// SiLU and product read it back (w4mm_linear_silu_mul's note measures what that cost W4A16). Returns 0, or -1
// without memory for the quantized rows.
int i8mm_linear_silu_mul(int64_t M, int64_t N, int64_t K, const uint16_t *x, const uint8_t *w,
                         const int32_t *colsum, const float *ws, const float *b, uint16_t *y, int nthreads) {
    return linear(M, N, K, x, 1, w, colsum, ws, b, y, nthreads, 1);
}

#endif

// One task of i8mm_grouped / i8mm_grouped_f32: a layer's rows (piece p) through one column block (grouped_tasks.h).
static void i8group_task(const void *ctx, int64_t p, int64_t nb, int64_t end) {
    (void)end;  // no prefetch of the next block here
    const i8group_t *g = ctx;
    const int64_t e = g->layer[p], N = g->N, K4 = g->Kq, n0 = nb * NB, nn = N - n0 < NB ? N - n0 : NB;
    const int64_t width = g->silu_mul ? N / 2 : N, stop = g->first[p] + g->counts[e];
    static const float zeros[NB];
    const pf_t none = {NULL, NULL, 0};
    const uint8_t *w = g->w[e] + nb * K4 * NB;
    for (int64_t r0 = g->first[p]; r0 < stop; r0 += MR) {
        const int mr = stop - r0 < MR ? (int)(stop - r0) : MR;
        if (!g->silu_mul) {
            void *yr = g->bf16 ? (void *)((uint16_t *)g->y + r0 * width) : (void *)((float *)g->y + r0 * width);
            row_tile_any(mr, K4, g->xq + r0 * K4, w, g->colsum[e] + n0, g->ws[e] + n0, zeros, g->xs + r0, yr,
                         g->bf16, width, n0, nn, none);
            continue;
        }
        float o[MR * NB];  // float rows (N % 64 == 0, checked by the caller), then 32 gate and 32 up columns each
        row_tile_any(mr, K4, g->xq + r0 * K4, w, g->colsum[e] + n0, g->ws[e] + n0, zeros, g->xs + r0, o, 0, NB, 0,
                     NB, none);
        for (int r = 0; r < mr; r++) {
            const int64_t off = (r0 + r) * width + n0 / 2;
#ifdef __AVX512BF16__
            if (g->bf16) {
                store_silu_mul_block(o + r * NB, (uint16_t *)g->y + off);
                continue;
            }
#endif
            store_silu_mul_f32(o + r * NB, (float *)g->y + off);
        }
    }
}

// i8mm_grouped's call over float32 rows in and out (float32 math: CPUs with AVX512-VNNI but no AVX512-BF16, such
// as Cascade Lake, or float32 forced), y = silu(gate) * up in float32 with silu_mul. WHY: in float32 math a MoE
// layer's W8A8 experts had no grouped call on these CPUs but i8avx2's, slower than a call per expert through i8mm
// here, and experts run a call each keep DeepSeek's decode steps out of programs. Returns 0, or -1 without memory.
int i8mm_grouped_f32(int64_t E, const int64_t *counts, int64_t N, int64_t K, const float *x,
                     const uint8_t *const *w, const int32_t *const *colsum, const float *const *ws, float *y,
                     int nthreads, int silu_mul) {
    return i8_grouped(E, counts, N, K, (K + 3) / 4 * 4, x, w, colsum, ws, y, nthreads, silu_mul, 0, i8group_task);
}

#ifdef __AVX512BF16__
// E W8A8 linear layers of one shape (no bias) in one call, bf16 rows in and out, as bf16mm_grouped: layer e takes
// counts[e] consecutive rows of x and its packed weight w[e] (colsum[e], ws[e]); y gets its rows in the same
// order, N wide (N / 2 with silu_mul: the weight's rows are a gated MLP's [gate; up] interleaved in blocks of 32,
// and y = silu(gate) * up, rounded as torch rounds it in bf16). Every row is quantized once, as i8mm_linear does.
// WHY: a MoE layer's W8A8 experts each paid a Python round trip and a parallel region per projection. Returns 0,
// or -1 without memory for the quantized rows.
int i8mm_grouped(int64_t E, const int64_t *counts, int64_t N, int64_t K, const uint16_t *x,
                 const uint8_t *const *w, const int32_t *const *colsum, const float *const *ws, uint16_t *y,
                 int nthreads, int silu_mul) {
    return i8_grouped(E, counts, N, K, (K + 3) / 4 * 4, x, w, colsum, ws, y, nthreads, silu_mul, 1, i8group_task);
}
#endif
