// y[M][N] = x[M][K] . W^T (+ b) with W kept as bf16 and every product and sum in fp32: a bf16 checkpoint
// computed exactly as float32 would, reading half the bytes. Built for the host CPU by engine/kernels/cbuild.py.
//
// Packed layout: [ceil(N/64)][K][64] bf16. Within each 32-column half of a 64-column block, 32-bit lane i
// holds column i in its low half and column 16+i in its high half, so one 64-byte load becomes two fp32
// vectors with a shift and a mask (no shuffle, which would compete with the FMAs for the same port).
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "grouped_tasks.h"
#include "silu.h"
#define NB 64
#define MR 6

// Row tiles a block may have for its tiles to ask for the next block by software (next_block): with one, the
// hardware prefetchers follow the single pass; with many, the block's arithmetic outlasts the stream anyway.
// -DPF_TILES=1 builds it without (to measure against).
#ifndef PF_TILES
#define PF_TILES 8
#endif

#ifdef __AVX512F__
#include <immintrin.h>
// pf .. pf_end: this tile's share of the next block's weights, one line asked for a k step (a share is at most K
// lines: two lines a k over at least two tiles).
static inline __attribute__((always_inline)) void tile(const int mr, int64_t K, const float *x, int64_t ldx,
                                                       const uint16_t *w, float *out, const char *pf,
                                                       const char *pf_end) {
    __m512 acc[MR][4];
    for (int r = 0; r < mr; r++) for (int j = 0; j < 4; j++) acc[r][j] = _mm512_setzero_ps();
    const __m512i hi_mask = _mm512_set1_epi32((int)0xFFFF0000u);
    for (int64_t k = 0; k < K; k++) {
        if (pf < pf_end) {
            _mm_prefetch(pf, _MM_HINT_T1);
            pf += 64;
        }
        const __m512i a = _mm512_loadu_si512((const void *)(w + k * NB));
        const __m512i b = _mm512_loadu_si512((const void *)(w + k * NB + 32));
        const __m512 w0 = _mm512_castsi512_ps(_mm512_slli_epi32(a, 16));
        const __m512 w1 = _mm512_castsi512_ps(_mm512_and_si512(a, hi_mask));
        const __m512 w2 = _mm512_castsi512_ps(_mm512_slli_epi32(b, 16));
        const __m512 w3 = _mm512_castsi512_ps(_mm512_and_si512(b, hi_mask));
        for (int r = 0; r < mr; r++) {
            const __m512 xv = _mm512_set1_ps(x[r * ldx + k]);
            acc[r][0] = _mm512_fmadd_ps(xv, w0, acc[r][0]);
            acc[r][1] = _mm512_fmadd_ps(xv, w1, acc[r][1]);
            acc[r][2] = _mm512_fmadd_ps(xv, w2, acc[r][2]);
            acc[r][3] = _mm512_fmadd_ps(xv, w3, acc[r][3]);
        }
    }
    for (int r = 0; r < mr; r++) for (int j = 0; j < 4; j++) _mm512_storeu_ps(out + r * NB + j * 16, acc[r][j]);
}
#elif defined(__AVX2__) && defined(__FMA__)
// AVX2 has 16 vector registers, so the 6 x 64 tile above would spill (the generic code below does: measured on a
// Zen 3, 2026-12-02, it streamed 5.8 GB/s at one row against oneDNN's 28). Two shapes, each without a spill:
// one row takes a whole 64-column block (8 accumulators); more rows go 6 x 16 (BLIS's AVX2 shape: 12
// accumulators, two weight vectors, one broadcast and the mask), one quarter of the block at a time, from the
// 8 lanes that hold columns q*8.. (low halves) and 16+q*8.. (high halves).
// A 6 x 32 or 3 x 32 tile needs 17 registers: gcc spilled two accumulators, and the store-to-load round trip
// on them halved the FMA rate.
#include <immintrin.h>
static inline __attribute__((always_inline)) __m256 lo_of(__m256i v) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
}
static inline __attribute__((always_inline)) __m256 hi_of(__m256i v, __m256i mask) {
    return _mm256_castsi256_ps(_mm256_and_si256(v, mask));
}

static inline __attribute__((always_inline)) void row_tile(int64_t K, const float *x, const uint16_t *w,
                                                           float *out) {
    __m256 acc[8];
    for (int j = 0; j < 8; j++) acc[j] = _mm256_setzero_ps();
    const __m256i mask = _mm256_set1_epi32((int)0xFFFF0000u);
    for (int64_t k = 0; k < K; k++) {
        const __m256 xv = _mm256_broadcast_ss(x + k);
        for (int q = 0; q < 4; q++) {  // quarter q: columns (q/2)*32 + (q%2)*8 + 0..7 and the same + 16
            const __m256i v = _mm256_loadu_si256((const __m256i *)(w + k * NB + q * 16));
            acc[2 * q] = _mm256_fmadd_ps(xv, lo_of(v), acc[2 * q]);
            acc[2 * q + 1] = _mm256_fmadd_ps(xv, hi_of(v, mask), acc[2 * q + 1]);
        }
    }
    for (int q = 0; q < 4; q++) {
        float *o = out + (q / 2) * 32 + (q % 2) * 8;
        _mm256_storeu_ps(o, acc[2 * q]);
        _mm256_storeu_ps(o + 16, acc[2 * q + 1]);
    }
}

#define QR 6
// rows r0.. of quarter q (w already offset to it): 2 x mr accumulators
// pf: where the block's row k + PF_K starts, asked for on the first pass over a block (the one that misses);
// NULL on the passes that find the block in L1/L2. Past the block's end it asks for the next block's first
// rows, or for nothing (a prefetch never faults). quarters() calls it with pf known to be NULL or not, so the
// test folds away.
#define PF_K 48
static inline __attribute__((always_inline)) void quarter_tile(const int mr, int64_t K, const float *x,
                                                               int64_t ldx, const uint16_t *w, float *out,
                                                               int64_t ldo, const char *pf) {
    __m256 lo[QR], hi[QR];
    for (int r = 0; r < mr; r++) lo[r] = hi[r] = _mm256_setzero_ps();
    const __m256i mask = _mm256_set1_epi32((int)0xFFFF0000u);
    for (int64_t k = 0; k < K; k++) {
        if (pf) {  // both 64-byte lines of the row (the quarters after this one read the other three quarters)
            _mm_prefetch(pf + k * NB * 2, _MM_HINT_T0);
            _mm_prefetch(pf + k * NB * 2 + 64, _MM_HINT_T0);
        }
        const __m256i v = _mm256_loadu_si256((const __m256i *)(w + k * NB));
        const __m256 wl = lo_of(v), wh = hi_of(v, mask);
        for (int r = 0; r < mr; r++) {
            const __m256 xv = _mm256_broadcast_ss(x + r * ldx + k);
            lo[r] = _mm256_fmadd_ps(xv, wl, lo[r]);
            hi[r] = _mm256_fmadd_ps(xv, wh, hi[r]);
        }
    }
    for (int r = 0; r < mr; r++) {
        _mm256_storeu_ps(out + r * ldo, lo[r]);
        _mm256_storeu_ps(out + r * ldo + 16, hi[r]);
    }
}

// always_inline (and block_rows_first): each caller gets its own copy. WHY: as one out-of-line clone gcc (12) kept
// the 6-row tile's accumulators on the stack (a store each step), and the fused entry, which called that clone
// where wbf16_linear inlined its own, ran 2.5x its time at 32 rows (a Zen 3, 2026-12-07).
static inline __attribute__((always_inline)) void quarters(const int mr, int64_t K, const float *x, int64_t ldx,
                                                           const uint16_t *w, float *out, int64_t ldo,
                                                           const char *pf) {
    if (pf) {
        switch (mr) {  // a constant row count keeps every accumulator in a register
        case 1: quarter_tile(1, K, x, ldx, w, out, ldo, pf); break;
        case 2: quarter_tile(2, K, x, ldx, w, out, ldo, pf); break;
        case 3: quarter_tile(3, K, x, ldx, w, out, ldo, pf); break;
        case 4: quarter_tile(4, K, x, ldx, w, out, ldo, pf); break;
        case 5: quarter_tile(5, K, x, ldx, w, out, ldo, pf); break;
        default: quarter_tile(6, K, x, ldx, w, out, ldo, pf); break;
        }
        return;
    }
    switch (mr) {
    case 1: quarter_tile(1, K, x, ldx, w, out, ldo, 0); break;
    case 2: quarter_tile(2, K, x, ldx, w, out, ldo, 0); break;
    case 3: quarter_tile(3, K, x, ldx, w, out, ldo, 0); break;
    case 4: quarter_tile(4, K, x, ldx, w, out, ldo, 0); break;
    case 5: quarter_tile(5, K, x, ldx, w, out, ldo, 0); break;
    default: quarter_tile(6, K, x, ldx, w, out, ldo, 0); break;
    }
}

// A whole 64-column block for all M rows, straight into y: each quarter's K x 32 bytes of weights stay in L1
// while every 6-row group of x passes over them.
#define BLOCK_ROWS_FIRST 1
static inline __attribute__((always_inline)) void block_rows_first(int64_t M, int64_t N, int64_t K, const float *x,
                                                                   const uint16_t *wb, float *y) {
    // rows split evenly into groups of at most QR: 32 rows as 6 + 6 + 5 + 5 + 5 + 5, not 6 x 5 + 2, whose
    // 4 accumulators would wait on the FMA latency
    const int64_t groups = (M + QR - 1) / QR, base = M / groups, extra = M % groups;
    for (int q = 0; q < 4; q++) {
        const int64_t col = (q / 2) * 32 + (q % 2) * 8;
        for (int64_t g = 0, m0 = 0; g < groups; g++) {
            const int mr = (int)(base + (g < extra));
            const char *pf = q == 0 && m0 == 0 ? (const char *)(wb + PF_K * NB) : 0;
            quarters(mr, K, x + m0 * K, K, wb + q * 16, y + m0 * N + col, N, pf);
            m0 += mr;
        }
    }
}

static void tile(const int mr, int64_t K, const float *x, int64_t ldx, const uint16_t *w, float *out,
                 const char *pf, const char *pf_end) {
    (void)pf, (void)pf_end;  // the quarters ask for their block's own rows ahead on the first pass (quarter_tile)
    if (mr == 1) {
        row_tile(K, x, w, out);
        return;
    }
    for (int q = 0; q < 4; q++) quarters(mr, K, x, ldx, w + q * 16, out + (q / 2) * 32 + (q % 2) * 8, NB, 0);
}
#else
typedef float v16f __attribute__((vector_size(64)));
typedef uint32_t v16u __attribute__((vector_size(64)));
static inline __attribute__((always_inline)) void tile(const int mr, int64_t K, const float *x, int64_t ldx,
                                                       const uint16_t *w, float *out, const char *pf,
                                                       const char *pf_end) {
    (void)pf, (void)pf_end;
    v16f acc[MR][4];
    for (int r = 0; r < mr; r++) for (int j = 0; j < 4; j++) acc[r][j] = (v16f){0};
    for (int64_t k = 0; k < K; k++) {
        v16u a, b;
        memcpy(&a, w + k * NB, 64);
        memcpy(&b, w + k * NB + 32, 64);
        v16u u0 = a << 16, u1 = a & 0xFFFF0000u, u2 = b << 16, u3 = b & 0xFFFF0000u;
        v16f w0, w1, w2, w3;
        memcpy(&w0, &u0, 64); memcpy(&w1, &u1, 64); memcpy(&w2, &u2, 64); memcpy(&w3, &u3, 64);
        for (int r = 0; r < mr; r++) {
            const float xv = x[r * ldx + k];
            acc[r][0] += xv * w0; acc[r][1] += xv * w1; acc[r][2] += xv * w2; acc[r][3] += xv * w3;
        }
    }
    for (int r = 0; r < mr; r++) memcpy(out + r * NB, acc[r], sizeof(acc[r]));
}
#endif

static void tile_any(int mr, int64_t K, const float *x, int64_t ldx, const uint16_t *w, float *out, const char *pf,
                     const char *pf_end) {
    switch (mr) {  // a constant row count lets the compiler keep every accumulator in a register
    case 1: tile(1, K, x, ldx, w, out, pf, pf_end); break;
    case 2: tile(2, K, x, ldx, w, out, pf, pf_end); break;
    case 3: tile(3, K, x, ldx, w, out, pf, pf_end); break;
    case 4: tile(4, K, x, ldx, w, out, pf, pf_end); break;
    case 5: tile(5, K, x, ldx, w, out, pf, pf_end); break;
    default: tile(6, K, x, ldx, w, out, pf, pf_end); break;
    }
}

// WHY: a block's first row tile reads its weights from memory and the others from L2, where the hardware
// prefetchers see no misses to follow, so the next block started cold and the stream and the arithmetic took
// turns (as bf16mm's block() tells). Each of a block's tiles asks for its share of the next block (the one after
// it in the packed weight, which the same thread takes next) over its k steps. Zen 5 in float32 math, 32 rows:
// see wbf16.py.
typedef struct {
    const char *next, *end;  // the next block's weights; end == next: nothing to ask for
    int64_t share;           // lines a tile asks for
} next_block_t;

static inline next_block_t next_block(const uint16_t *wb, int64_t K, int64_t rows, int has_next) {
    const int64_t tiles = (rows + MR - 1) / MR, lines = K * NB * 2 / 64;
    const char *next = (const char *)(wb + K * NB);
    const int on = has_next && tiles > 1 && tiles <= PF_TILES;
    return (next_block_t){next, on ? next + lines * 64 : next, on ? (lines + tiles - 1) / tiles : 0};
}

// Tile t's rows through the block, asking for its share of the next block.
static inline void tile_next(int mr, int64_t K, const float *x, const uint16_t *wb, float *out, next_block_t nx,
                             int64_t t) {
    const char *pf = nx.next + t * nx.share * 64, *pf_end = pf + nx.share * 64;
    tile_any(mr, K, x, K, wb, out, pf, pf_end < nx.end ? pf_end : nx.end);
}

// Threads split the output columns, so each streams only its share of the weights.
void wbf16_linear(int64_t M, int64_t N, int64_t K, const float *x, const uint16_t *w, const float *b, float *y,
                  int nthreads) {
    const int64_t nblocks = (N + NB - 1) / NB;
#pragma omp parallel for schedule(static) num_threads(nthreads)
    for (int64_t nb = 0; nb < nblocks; nb++) {
        const uint16_t *wb = w + nb * K * NB;
        const int64_t n0 = nb * NB, nn = N - n0 < NB ? N - n0 : NB;
#ifdef BLOCK_ROWS_FIRST
        if (M > 1 && nn == NB) {
            block_rows_first(M, N, K, x, wb, y + n0);
            if (b)
                for (int64_t r = 0; r < M; r++)
                    for (int64_t j = 0; j < NB; j++) y[r * N + n0 + j] += b[n0 + j];
            continue;
        }
#endif
        float out[MR * NB];
        const next_block_t nx = next_block(wb, K, M, nb + 1 < nblocks);
        for (int64_t m0 = 0; m0 < M; m0 += MR) {
            const int mr = M - m0 < MR ? (int)(M - m0) : MR;
            tile_next(mr, K, x + m0 * K, wb, out, nx, m0 / MR);
            for (int r = 0; r < mr; r++) {
                float *yr = y + (m0 + r) * N + n0;
                if (b) for (int64_t j = 0; j < nn; j++) yr[j] = out[r * NB + j] + b[n0 + j];
                else memcpy(yr, out + r * NB, nn * sizeof(float));
            }
        }
    }
}

// One whole 64-column block (wb: its packed K x 64) for m rows of x (row stride K) into out[m][64]; has_next: a
// block follows it in the packed weight.
static void block_into(int64_t m, int64_t K, const float *x, const uint16_t *wb, float *out, int has_next) {
#ifdef BLOCK_ROWS_FIRST
    if (m > 1) {
        block_rows_first(m, NB, K, x, wb, out);
        return;
    }
#endif
    const next_block_t nx = next_block(wb, K, m, has_next);
    for (int64_t m0 = 0; m0 < m; m0 += MR)
        tile_next(m - m0 < MR ? (int)(m - m0) : MR, K, x + m0 * K, wb, out + m0 * NB, nx, m0 / MR);
}

// A gated MLP's [gate; up] projection with silu(gate) * up in the epilogue: W's N = 2I rows interleaved in blocks
// of 32 (engine.kernels.gemm.interleave_halves; N a multiple of 64), b likewise; y [M][N / 2] gets
// silu(x Wg^T + bg) * (x Wu^T + bu) in float32, SiLU as x / (1 + exp(-x)) (silu.h, as wbf16_grouped's). WHY: no [M][2I]
// intermediate, no separate SiLU and multiply, and a decode program (engine.kernels.program) can call it.
// A block's rows go through block_into SR at a time, the tiles wbf16_linear runs (each quarter's weights in L1
// for every row group). Before (6-row tiles over the whole block, through the spilling clone quarters' comment
// tells of) this entry ran 2-3x wbf16_linear's time past one row on a Zen 3 (2026-12-07), so the plan kept the
// plain entry (one layout a weight) and a decode program stopped for Python at every gated MLP to run the act.
#define SR 64  // rows of a block at a time: SR x 64 floats of output on the stack
void wbf16_linear_silu_mul(int64_t M, int64_t N, int64_t K, const float *x, const uint16_t *w, const float *b,
                           float *y, int nthreads) {
    const int64_t nblocks = N / NB, width = N / 2;
#pragma omp parallel for schedule(static) num_threads(nthreads)
    for (int64_t nb = 0; nb < nblocks; nb++) {
        const uint16_t *wb = w + nb * K * NB;
        float out[SR * NB];
        for (int64_t m0 = 0; m0 < M; m0 += SR) {
            const int64_t mr = M - m0 < SR ? M - m0 : SR;
            block_into(mr, K, x + m0 * K, wb, out, nb + 1 < nblocks);
            for (int64_t r = 0; r < mr; r++) {
                const float *o = out + r * NB;
                float g[NB / 2], u[NB / 2];
                for (int64_t j = 0; j < NB / 2; j++) {
                    g[j] = o[j] + (b ? b[nb * NB + j] : 0.0f);
                    u[j] = o[NB / 2 + j] + (b ? b[nb * NB + NB / 2 + j] : 0.0f);
                }
                silu_mul_f32(g, u, y + (m0 + r) * width + nb * NB / 2, NB / 2);
            }
        }
    }
}

// E linear layers of one shape (no bias) in one call: layer e takes counts[e] consecutive rows of x (layers in
// order) and its packed weight w[e]; y gets its rows in the same order, N wide. With silu_mul the weights are
// gated MLPs' [gate; up] rows interleaved in blocks of 32 (engine.kernels.gemm.interleave_halves), so a 64-column
// block holds 32 gate and their 32 up columns, and y (N / 2 wide) gets silu(gate) * up in float32, as torch's
// unfused float32 code computes it. WHY: a decode batch gives each of a MoE layer's experts a handful of rows,
// and a call per expert paid a parallel region and a Python round trip each (engine.kernels.grouped). Tasks (rows
// of a layer, column block) go to threads as grouped_tasks.h says.
#define GR 32  // rows of one layer per task: GR x 64 floats of output on the stack
typedef struct {
    const float *x;
    const uint16_t *w;
    float *y;
    int64_t m;
} wpiece_t;

typedef struct {
    const wpiece_t *pieces;
    int64_t N, K;
    int silu_mul;
} wgroup_t;

static void wgroup_task(const void *ctx, int64_t piece, int64_t nb, int64_t end) {
    (void)end;
    const wgroup_t *g = ctx;
    const wpiece_t *p = g->pieces + piece;
    const int64_t N = g->N, K = g->K, width = g->silu_mul ? N / 2 : N;
    float out[GR * NB];
    block_into(p->m, K, p->x, p->w + nb * K * NB, out, nb + 1 < (N + NB - 1) / NB);
    for (int64_t r = 0; r < p->m; r++) {
        const float *o = out + r * NB;
        float *yr = p->y + r * width;
        if (g->silu_mul) {
            silu_mul_f32(o, o + NB / 2, yr + nb * NB / 2, NB / 2);
        } else {
            const int64_t nn = N - nb * NB < NB ? N - nb * NB : NB;
            memcpy(yr + nb * NB, o, nn * sizeof(float));
        }
    }
}

void wbf16_grouped(int64_t E, const int64_t *counts, int64_t N, int64_t K, const float *x,
                   const uint16_t *const *w, float *y, int nthreads, int silu_mul) {
    int64_t P = 0, row = 0;
    for (int64_t e = 0; e < E; e++) P += (counts[e] + GR - 1) / GR;
    wpiece_t pieces[P > 0 ? P : 1];
    const int64_t width = silu_mul ? N / 2 : N, nblocks = (N + NB - 1) / NB;
    P = 0;
    for (int64_t e = 0; e < E; e++) {
        for (int64_t m0 = 0; m0 < counts[e]; m0 += GR)
            pieces[P++] = (wpiece_t){x + (row + m0) * K, w[e], y + (row + m0) * width,
                                     counts[e] - m0 < GR ? counts[e] - m0 : GR};
        row += counts[e];
    }
    const wgroup_t g = {pieces, N, K, silu_mul};
    grouped_tasks(P, nblocks, nthreads, 4, wgroup_task, &g);
}

// W [N][K] bf16 row-major -> [ceil(N/64)][K][64] in the interleaved order above, zero-padded.
void wbf16_pack(int64_t N, int64_t K, const uint16_t *w, uint16_t *packed, int nthreads) {
    const int64_t nblocks = (N + NB - 1) / NB;
#pragma omp parallel for schedule(static) num_threads(nthreads)
    for (int64_t nb = 0; nb < nblocks; nb++)
        for (int64_t k = 0; k < K; k++)
            for (int64_t j = 0; j < NB; j++) {
                const int64_t half = j / 32, i = (j % 32) / 2, odd = j % 2;
                const int64_t n = nb * NB + half * 32 + odd * 16 + i;
                packed[(nb * K + k) * NB + j] = n < N ? w[n * K + k] : 0;
            }
}

// Packed bf16 -> W^T as fp32 [K][N] row-major, for large batches where a BLAS GEMM beats the kernel above.
void wbf16_unpack_t(int64_t N, int64_t K, const uint16_t *packed, float *wt, int nthreads) {
    const int64_t nblocks = (N + NB - 1) / NB;
#pragma omp parallel for schedule(static) num_threads(nthreads)
    for (int64_t k = 0; k < K; k++)
        for (int64_t nb = 0; nb < nblocks; nb++) {
            const uint32_t *src = (const uint32_t *)(packed + (nb * K + k) * NB);
            float *dst = wt + k * N + nb * NB;
            float tmp[NB];
            for (int h = 0; h < 2; h++)
                for (int i = 0; i < 16; i++) {
                    const uint32_t u = src[h * 16 + i], lo = u << 16, hi = u & 0xFFFF0000u;
                    memcpy(&tmp[h * 32 + i], &lo, 4);
                    memcpy(&tmp[h * 32 + 16 + i], &hi, 4);
                }
            const int64_t nn = N - nb * NB < NB ? N - nb * NB : NB;
            memcpy(dst, tmp, nn * sizeof(float));
        }
}
