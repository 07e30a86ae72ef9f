// W8A8 linear layers on Intel AMX-INT8 tiles: y[M][N] = dequant(xq) . dequant(W)^T (+ b), x and y bf16 or float32,
// W int8 with a float scale per output channel, x quantized per row exactly as compressed-tensors defines it
// (i8_rows.h), in i8mm's packed layout (i8mm.c; one packed copy serves both kernels).
//
// WHY: on an AMX CPU the bf16 model's batches run on AMX-BF16 tiles, and i8mm's VPDPBUSD loops, which halve the
// bytes streamed, trailed them from 32 rows on (24 Qwen2-0.5B layers on a 2-core AMX Xeon: 35.5 ms at 32 rows
// against amxmm's 34.5, 108 against oneDNN's 63 at 128). TDPBUSD does 16 x 16 x 64 products an instruction.
//
// Tiles (palette 1, amx_tiles.h): 0-3 accumulate a 32 x 32 int32 block, 4-5 hold two 16-row slices of the
// quantized rows (64 k each, as q + 128: TDPBUSD multiplies unsigned by signed bytes, and 128 * the column's sum
// of weights comes off at the end, as in i8mm), 6-7 two 16-column slices of the weight. i8mm's layout
// [N/64][K/4][64][4] holds, for a 64-column block, 64 k as 16 rows of 256 bytes whose bytes 64c .. 64c + 63 are
// columns 16c .. 16c + 15 x 4 k: a weight tile is loaded in place with a row stride of 256. K must be a multiple
// of 64 (i8amx.py checks).
#if !defined(__AMX_TILE__) || !defined(__AMX_INT8__) || !defined(__AVX512VNNI__)
#error "this kernel needs AMX-INT8 (-march=native on a CPU without it: i8mm or oneDNN is used instead)"
#endif
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define NB 64

#include "amx_tiles.h"
#include "deal.h"
#include "grouped_tasks.h"
#include "i8_rows.h"
#ifdef __AVX512BF16__  // the fused gated-MLP entry's epilogue rounds to bf16 (i8amx_linear_silu_mul), as i8mm's
#include "avx512_math.h"
#endif

// Weight k-steps (64 k) asked for ahead: AMX tile loads do not draw the hardware prefetcher along (amxmm.c). Set
// on one AMX Xeon (model 167): the library is also built with -DPF=0 and the selection times both.
#ifndef PF
#define PF 2
#endif

int i8amx_init(void) { return request_tile_state(); }

// mr (<= 32) rows of quantized x (row stride K) against a block's packed weight w: the int32 sums, 32 x 64, into
// acc (rows 64 wide), one 32-column half at a time (tiles configured for mr rows).
static void block_rows(int mr, int64_t K, const uint8_t *xq, const uint8_t *w, int32_t *acc) {
    const int64_t ksteps = K / 64, step = 16 * 4 * NB;  // a k-step of the block: 16 rows of 256 bytes
    for (int h = 0; h < 2; h++) {
        _tile_zero(0);
        _tile_zero(1);
        if (mr > 16) {
            _tile_zero(2);
            _tile_zero(3);
        }
        for (int64_t ks = 0; ks < ksteps; ks++) {
            const uint8_t *wk = w + ks * step + 2 * h * 64;
            if (PF > 0 && ks + PF < ksteps)
                for (int l = 0; l < 16; l++) {
                    _mm_prefetch((const char *)(wk + PF * step) + 256 * l, _MM_HINT_T0);
                    _mm_prefetch((const char *)(wk + PF * step) + 256 * l + 64, _MM_HINT_T0);
                }
            _tile_loadd(4, xq + ks * 64, K);
            _tile_loadd(6, wk, 4 * NB);
            _tile_loadd(7, wk + 64, 4 * NB);
            _tile_dpbusd(0, 4, 6);
            _tile_dpbusd(1, 4, 7);
            if (mr > 16) {
                _tile_loadd(5, xq + 16 * K + ks * 64, K);
                _tile_dpbusd(2, 5, 6);
                _tile_dpbusd(3, 5, 7);
            }
        }
        _tile_stored(0, acc + 32 * h, NB * 4);
        _tile_stored(1, acc + 32 * h + 16, NB * 4);
        if (mr > 16) {
            _tile_stored(2, acc + 16 * NB + 32 * h, NB * 4);
            _tile_stored(3, acc + 16 * NB + 32 * h + 16, NB * 4);
        }
    }
}

// M quantized rows xq (row stride K; xs: their scales) through one 64-column block's packed weight wb, 32 rows at a
// time, into y's rows row0.. (bf16 when bf16, else float32; N wide, columns n0.., nn of them; with silu_mul, bf16
// and N / 2 wide: see i8amx_linear_silu_mul). colsum, ws, bias: the block's 64 column sums, scales and biases.
// *configured: the rows the calling thread's tiles are configured for (-1: none yet).
static void block_out(int64_t M, int64_t N, int64_t K, const uint8_t *xq, const float *xs, const uint8_t *wb,
                      const int32_t *colsum, const float *ws, const float *bias, void *y, int bf16, int64_t row0,
                      int64_t n0, int64_t nn, int *configured, const int silu_mul) {
    int32_t acc[32 * NB] __attribute__((aligned(64)));
    for (int64_t m0 = 0; m0 < M; m0 += 32) {
        const int mr = M - m0 < 32 ? (int)(M - m0) : 32;
        if (*configured != mr) {  // a row tail's configuration differs from a full 32 rows'
            amx_configure(mr < 16 ? mr : 16, mr > 16 ? mr - 16 : 0);
            *configured = mr;
        }
        block_rows(mr, K, xq + m0 * K, wb, acc);
        for (int r = 0; r < mr; r++) {
            __m512i a[4];
            for (int j = 0; j < 4; j++) a[j] = _mm512_load_si512((const void *)(acc + r * NB + 16 * j));
            const int64_t row = row0 + m0 + r;
            if (!silu_mul) {
                store_row(a, colsum, ws, bias, xs[m0 + r], y, bf16, row * N + n0, nn);
                continue;
            }
#ifdef __AVX512BF16__
            float o[NB];  // 32 gate then 32 up columns (N % 64 == 0: whole blocks), as i8mm's epilogue
            store_row(a, colsum, ws, bias, xs[m0 + r], o, 0, 0, NB);
            store_silu_mul_block(o, (uint16_t *)y + row * (N / 2) + n0 / 2);
#endif
        }
    }
}

// x [M][K] (bf16 when bf16, else float32) → y [M][N] of the same type (with silu_mul, bf16 only: y [M][N / 2], see
// i8amx_linear_silu_mul). w: the packed weight; colsum, ws, b: int32 / float [ceil(N/64) * 64] (b may be NULL).
// Returns 0, or -1 without memory for the quantized rows.
static int linear(int64_t M, int64_t N, int64_t K, const void *x, int bf16, const uint8_t *w, const int32_t *colsum,
                  const float *ws, const float *b, void *y, int nthreads, const int silu_mul) {
    const int64_t nblocks = (N + NB - 1) / NB;
    if (M <= 0) return 0;
    float *xs;
    const uint8_t *xq = quantize_rows(M, K, K, x, bf16, nthreads, &xs);
    if (!xq) return -1;
    static const float zeros[NB];
    deal_t deal;
    deal_init(&deal, nblocks, nthreads);
#pragma omp parallel num_threads(nthreads)
    {
        int configured = -1;
        // Dealt as amxmm's blocks (deal.h): a thread the event loop preempts leaves its blocks to the other.
        for (int64_t nb; (nb = deal_next(&deal, omp_get_thread_num())) >= 0;) {
            const int64_t n0 = nb * NB, nn = N - n0 < NB ? N - n0 : NB;
            block_out(M, N, K, xq, xs, w + nb * K * NB, colsum + n0, ws + n0, b ? b + n0 : zeros, y, bf16, 0, n0, nn,
                      &configured, silu_mul);
        }
        if (configured != -1) _tile_release();
    }
    return 0;
}

int i8amx_linear(int64_t M, int64_t N, int64_t K, const void *x, int bf16, const uint8_t *w, const int32_t *colsum,
                 const float *ws, const float *b, void *y, int nthreads) {
    return linear(M, N, K, x, bf16, w, colsum, ws, b, y, nthreads, 0);
}

#ifdef __AVX512BF16__
// i8amx_linear over a gated MLP's [gate; up] weight packed with its rows (and their column sums, scales and bias)
// interleaved in blocks of 32, i8mm_linear_silu_mul's copy (N % 64 == 0, checked by the caller): bf16 x [M][K] →
// y [M][N / 2] = silu(gate) * up, the same bits as i8mm's fused entry. WHY: on AMX the [gate; up] projection held
// i8mm's interleaved copy for decode, and the prefill class took the second copy a weight may hold, oneDNN's int8
// GEMM, which ran Qwen2-0.5B's 4,096-row prefill at 73.6 ms a layer (a 2-core AMX Xeon) where these tiles run
// down_proj's half as many FLOPs in 16.4. Returns 0, or -1 without memory for the quantized rows.
int i8amx_linear_silu_mul(int64_t M, int64_t N, int64_t K, const uint16_t *x, const uint8_t *w,
                          const int32_t *colsum, const float *ws, const float *b, uint16_t *y, int nthreads) {
    return linear(M, N, K, x, 1, w, colsum, ws, b, y, nthreads, 1);
}
#endif

#ifdef __AVX512BF16__
// One task of i8amx_grouped: a layer's rows (piece p) through one column block (grouped_tasks.h); its tiles
// configured for the task and released after it (a task's rows are its layer's).
static void i8agroup_task(const void *ctx, int64_t p, int64_t nb, int64_t end) {
    (void)end;  // block_rows asks only for the block's own k-steps ahead
    const i8group_t *g = ctx;
    static const float zeros[NB];
    const int64_t e = g->layer[p], N = g->N, K = g->Kq, n0 = nb * NB, r0 = g->first[p];
    const int64_t nn = N - n0 < NB ? N - n0 : NB;
    int configured = -1;
    block_out(g->counts[e], N, K, g->xq + r0 * K, g->xs + r0, g->w[e] + nb * K * NB, g->colsum[e] + n0,
              g->ws[e] + n0, zeros, g->y, 1, r0, n0, nn, &configured, g->silu_mul);
    if (configured != -1) _tile_release();
}

// E W8A8 linear layers of one shape (no bias) in one call on AMX-INT8 tiles, as i8mm_grouped (its arguments, over
// the same packed copies; bf16 rows in and out, silu_mul as there): layer e takes counts[e] consecutive rows of x.
// WHY: on AMX CPUs a MoE layer's W8A8 experts otherwise run a call per expert and projection (a Python round trip
// and a parallel region each) or i8mm's VPDPBUSD loops, which AMX's tiles outrun from a few rows on. Returns 0, or
// -1 without memory for the quantized rows.
int i8amx_grouped(int64_t E, const int64_t *counts, int64_t N, int64_t K, const uint16_t *x,
                  const uint8_t *const *w, const int32_t *const *colsum, const float *const *ws, uint16_t *y,
                  int nthreads, int silu_mul) {
    return i8_grouped(E, counts, N, K, K, x, w, colsum, ws, y, nthreads, silu_mul, 1, i8agroup_task);
}
#endif
