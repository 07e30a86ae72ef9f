// W4A16 linear layers on Intel AMX tiles: y[M][N] = x[M][K] . W^T (+ b), x, b and y bf16, W unsigned 4-bit with a
// float scale s and zero point z per output channel and group of G inputs (w = (q - z) * s), in w4mm's packed
// layout (w4mm.c; one packed copy serves both kernels).
//
// WHY: on an AMX CPU the bf16 model's batches run on AMX tiles (amxmm.c, oneDNN), which do several times the
// work per cycle of w4mm's VDPBF16PS loops, so a W4A16 model whose batches went through w4mm ran them slower
// than the bf16 model it was meant to beat. Two entry points, which the engine times per shape and batch class:
// - w4amx_linear: a thread widens one group of a 64-column block at a time (as 128 + q, exact in bf16:
//   w4mm_common.h) into tiles in an L1 buffer, every row of x goes through TDPBF16PS against it, and at the group's
//   end out += s * sum - s * (128 + z) * (sum x), as in w4mm (exact). Its cost past the products grows with
//   rows x groups: the tiles drain and are scaled every G inputs.
// - w4amx_linear_dequant: a thread dequantizes a whole 64-column block, all of K, into bf16 tiles (w rounded to
//   bf16 once: the precision of the bf16 model's own weights) and runs the rows through them as amxmm does,
//   summing over all of K in the tiles: a fixed cost per weight, none per row and group. 24 Qwen2-0.5B layers
//   streamed on a 2-core AMX Xeon (model 167): group 128 at 1-32 rows 12-28 ms against 23-28, at 128 rows 76
//   against 63; group 32 at 128 rows 117 against 69.
// The weights stream at a quarter of bf16's bytes, read by ordinary loads (which the hardware prefetcher follows,
// and PF_BYTES asks ahead of; AMX tile loads of the weights would draw neither).
//
// Tile buffers: [k/32][4][16][32] bf16 for k inputs (a group, or all of K): for each 32-k step and each 16
// columns of the block, one tile whose row r holds k = 2r, 2r+1 of the 16 columns side by side (AMX's pair
// layout, which w4mm's nibble order widens to directly). K and G are multiples of 32 (w4amx.py checks).
#if !defined(__AMX_TILE__) || !defined(__AMX_BF16__) || !defined(__AVX512BF16__)
#error "this kernel needs AMX-BF16 and AVX512-BF16 (-march=native on a CPU without them: w4mm is used instead)"
#endif
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "amx_tiles.h"
#include "bf16mm_block.h"
#include "deal.h"
#include "grouped_tasks.h"
#include "w4mm_common.h"

#define TILE_ELEMS 512  // 16 rows x 32 bf16

int w4amx_init(void) { return request_tile_state(); }

// Columns [16 c0, 16 c1) of one group of a block's nibbles wq (steps of 4 k: 128 bytes each) widened into the
// tile buffer wg.
static inline void widen_columns(const uint8_t *wq, uint16_t *wg, int64_t steps, int c0, int c1) {
    for (int64_t kq = 0; kq < steps; kq++) {
        prefetch_nibbles(wq + kq * 128);
        for (int c = c0; c < c1; c++) {
            __m512bh a, b;
            widen(wq + kq * 128 + 32 * c, &a, &b);
            uint16_t *t = wg + ((kq / 8) * 4 + c) * TILE_ELEMS + (kq % 8) * 64;
            _mm512_storeu_si512((void *)t, (__m512i)a);
            _mm512_storeu_si512((void *)(t + 32), (__m512i)b);
        }
    }
}

// One group of a block's nibbles wq (G/4 steps of 128 bytes) widened into the tile buffer wg.
static void widen_group_tiles(int64_t G, const uint8_t *wq, uint16_t *wg) { widen_columns(wq, wg, G / 4, 0, 4); }

// mr (<= 32) rows of x (row stride K) against ksteps 32-k steps of widened tiles w: the 32 x 64 sums into out
// (rows 64 wide), one 32-column half at a time, summed over the steps in the tiles (configured for mr rows).
// next (or NULL): the nibbles of a group to widen into w as its tiles are read (the caller's next group, where
// these are the only rows to go through w): each half's columns once that half's products are issued, before
// their sums are stored. WHY: the vector units widen while the tile unit multiplies, where the sums' stores
// would hold them back (32 rows over 24 Qwen2-0.5B layers on a 2-core AMX Xeon, model 207: 29.6 → 25.3 ms, the
// same bits); a second buffer for the next group instead was slower (32.2 ms: two no longer fit L1 with the sums).
static void tile_rows(int mr, int64_t K, int64_t ksteps, const uint16_t *x, uint16_t *w, float *out,
                      const uint8_t *next) {
    const int64_t stride = K * 2;
    for (int h = 0; h < 2; h++) {
        _tile_zero(0);
        _tile_zero(1);
        if (mr > 16) {
            _tile_zero(2);
            _tile_zero(3);
        }
        for (int64_t ks = 0; ks < ksteps; ks++) {
            const uint16_t *wk = w + (ks * 4 + 2 * h) * TILE_ELEMS;
            _tile_loadd(4, x + ks * 32, stride);
            _tile_loadd(6, wk, 64);
            _tile_loadd(7, wk + TILE_ELEMS, 64);
            _tile_dpbf16ps(0, 4, 6);
            _tile_dpbf16ps(1, 4, 7);
            if (mr > 16) {
                _tile_loadd(5, x + 16 * K + ks * 32, stride);
                _tile_dpbf16ps(2, 5, 6);
                _tile_dpbf16ps(3, 5, 7);
            }
        }
        // this half's tiles were loaded (program order): their memory may take the next group's columns
        if (next) widen_columns(next, w, ksteps * 8, 2 * h, 2 * h + 2);
        _tile_stored(0, out + 32 * h, NB * 4);
        _tile_stored(1, out + 32 * h + 16, NB * 4);
        if (mr > 16) {
            _tile_stored(2, out + 16 * NB + 32 * h, NB * 4);
            _tile_stored(3, out + 16 * NB + 32 * h + 16, NB * 4);
        }
    }
}

// out[r] (64 floats a row) += s * c[r] - s * (128 + z) * xs[r * groups], for mr rows of sums c ([32][64]); sc:
// the group's (SC_GROUP floats).
static void scale_into(int mr, const float *restrict c, const float *restrict sc, const float *restrict xs,
                       int64_t groups, float *restrict out) {
    __m512 s[4], sz[4];  // loaded once for all the rows
    for (int v = 0; v < 4; v++) group_scales(sc, v, &s[v], &sz[v]);
    for (int r = 0; r < mr; r++) {
        const __m512 sum = _mm512_set1_ps(xs[r * groups]);
        for (int v = 0; v < 4; v++) {
            __m512 o = _mm512_loadu_ps(out + r * NB + 16 * v);
            o = _mm512_fmadd_ps(_mm512_loadu_ps(c + r * NB + 16 * v), s[v], o);
            _mm512_storeu_ps(out + r * NB + 16 * v, _mm512_fnmadd_ps(sum, sz[v], o));
        }
    }
}

// M rows of x (row stride K; xs: their sums per group, [M][K/G]) through one 64-column block, a group at a time
// (the header): its nibbles wb and scales sb, its bias (NB floats), into y's rows row0.. (store_out's layout, N
// wide, columns n0.., nn of them). wg: the calling thread's buffer of G x 64 bf16; *configured: the rows its tiles
// are configured for (-1: none yet).
static void block_by_group(int64_t M, int64_t N, int64_t K, int64_t G, const uint16_t *x, const float *xs,
                           const uint8_t *wb, const float *sb, const float *bias, uint16_t *y, int64_t row0, int64_t n0,
                           int64_t nn, uint16_t *wg, int *configured, const int silu_mul) {
    const int64_t groups = K / G;
    float out[MC * NB];
    float c[32 * NB] __attribute__((aligned(64)));
    // rows a pass at most MC, so they stay in L2 while the block's groups go past them
    for (int64_t m0 = 0; m0 < M; m0 += MC) {
        const int64_t mc = M - m0 < MC ? M - m0 : MC;
        memset(out, 0, sizeof(float) * (size_t)(mc * NB));
        // one 32-row pass a group: each group after the first is widened as the one before goes through the
        // tiles (tile_rows); with more rows, every pass reads the group's tiles, so it is widened before them
        const int ahead = mc <= 32;
        for (int64_t g = 0; g < groups; g++) {
            if (!ahead || g == 0) widen_group_tiles(G, wb + g * G * 32, wg);
            const uint8_t *next = ahead && g + 1 < groups ? wb + (g + 1) * G * 32 : NULL;
            for (int64_t r = 0; r < mc; r += 32) {
                const int mr = mc - r < 32 ? (int)(mc - r) : 32;
                if (*configured != mr) {  // a row tail's configuration differs from a full 32 rows'
                    amx_configure(mr < 16 ? mr : 16, mr > 16 ? mr - 16 : 0);
                    *configured = mr;
                }
                tile_rows(mr, K, G / 32, x + (m0 + r) * K + g * G, wg, c, next);
                scale_into(mr, c, sb + g * SC_GROUP, xs + (m0 + r) * groups + g, groups, out + r * NB);
            }
        }
        for (int64_t r = 0; r < mc; r++) store_out(out + r * NB, bias, y, row0 + m0 + r, N, n0, nn, silu_mul);
    }
}

// A group at a time (the header). With silu_mul, w is a gated MLP's [gate; up] packed with its rows interleaved in
// blocks of 32 (w4mm_linear_silu_mul's copy, N % 64 == 0: checked by the caller) and y [M][N / 2] = silu(gate) *
// up, w4mm's fused epilogue. Returns 0, or -1 where a buffer could not be had (y is then incomplete).
static int by_group(int64_t M, int64_t N, int64_t K, int64_t G, const uint16_t *x, const uint8_t *wq, const float *sc,
                    const uint16_t *b, uint16_t *y, int nthreads, const int silu_mul) {
    const int64_t nblocks = (N + NB - 1) / NB, groups = K / G;
    if (M <= 0) return 0;
    float *xs = sums_for(M * groups);
    if (!xs) return -1;
    group_sums(M, K, G, x, xs, nthreads);
    int failed = 0;
    deal_t deal;
    deal_init(&deal, nblocks, nthreads);
#pragma omp parallel num_threads(nthreads) reduction(| : failed)
    {
        uint16_t *wg = bf16_buffer(G * NB);
        failed = wg == NULL;
        float bias[NB];
        int configured = -1;
        // Dealt as amxmm's blocks (deal.h): a thread the event loop preempts leaves its blocks to the other.
        for (int64_t nb; (nb = deal_next(&deal, omp_get_thread_num())) >= 0;) {
            if (!wg) continue;
            const int64_t n0 = nb * NB, nn = N - n0 < NB ? N - n0 : NB;
            load_bias(b, n0, nn, bias);
            block_by_group(M, N, K, G, x, xs, wq + nb * K * 32, sc + nb * groups * SC_GROUP, bias, y, 0, n0, nn, wg,
                           &configured, silu_mul);
        }
        if (configured != -1) _tile_release();
    }
    return failed ? -1 : 0;
}

// One task of w4amx_grouped: a layer's rows (piece p) through one column block (grouped_tasks.h), a group at a
// time; its tiles configured for the task and released after it (a task's rows are its layer's).
static void w4group_task(const void *ctx, int64_t p, int64_t nb, int64_t end) {
    (void)end;  // the widening asks for nibbles PF_BYTES ahead, in whichever block they lie
    const w4group_t *g = ctx;
    static const float zeros[NB];
    uint16_t *wg = bf16_buffer(g->G * NB);
    if (!wg) {
        atomic_store(g->failed, 1);
        return;
    }
    const int64_t e = g->layer[p], N = g->N, K = g->K, G = g->G, groups = K / G, n0 = nb * NB, r0 = g->first[p];
    const int64_t nn = N - n0 < NB ? N - n0 : NB;
    int configured = -1;
    block_by_group(g->counts[e], N, K, G, g->x + r0 * K, g->xs + r0 * groups, g->wq[e] + nb * K * 32,
                   g->sc[e] + nb * groups * SC_GROUP, zeros, g->y, r0, n0, nn, wg, &configured, g->silu_mul);
    if (configured != -1) _tile_release();
}

// E W4A16 linear layers of one shape (no bias) in one call on AMX tiles, as w4mm_grouped (its arguments, layout
// and silu_mul): layer e takes counts[e] consecutive rows of x. WHY: a MoE layer's quantized experts took w4amx
// one call per expert and projection on AMX CPUs (w4mm_grouped's VDPBF16PS loops lost to them there), each a
// Python round trip and a parallel region. Returns 0, or -1 where a buffer could not be had (y is then incomplete).
int w4amx_grouped(int64_t E, const int64_t *counts, int64_t N, int64_t K, int64_t G, const uint16_t *x,
                  const uint8_t *const *wq, const float *const *sc, uint16_t *y, int nthreads, int silu_mul) {
    return w4_grouped(E, counts, N, K, G, x, wq, sc, y, nthreads, silu_mul, w4group_task);
}

// A whole block dequantized at a time (the header); silu_mul as by_group's.
static int dequantized(int64_t M, int64_t N, int64_t K, int64_t G, const uint16_t *x, const uint8_t *wq,
                       const float *sc, const uint16_t *b, uint16_t *y, int nthreads, const int silu_mul) {
    const int64_t nblocks = (N + NB - 1) / NB, groups = K / G;
    if (M <= 0) return 0;
    int failed = 0;
    deal_t deal;
    deal_init(&deal, nblocks, nthreads);
#pragma omp parallel num_threads(nthreads) reduction(| : failed)
    {
        uint16_t *wb = bf16_buffer(K * NB);
        failed = wb == NULL;
        float out[32 * NB] __attribute__((aligned(64))), bias[NB];
        int configured = -1;  // a row tail's configuration differs from a full 32 rows'
        // Dealt as amxmm's blocks (deal.h): a thread the event loop preempts leaves its blocks to the other.
        for (int64_t nb; (nb = deal_next(&deal, omp_get_thread_num())) >= 0;) {
            if (!wb) continue;
            const int64_t n0 = nb * NB, nn = N - n0 < NB ? N - n0 : NB;
            load_bias(b, n0, nn, bias);
            dequantize_block(K, G, wq + nb * K * 32, sc + nb * groups * SC_GROUP, wb, 1);
            for (int64_t m0 = 0; m0 < M; m0 += 32) {
                const int mr = M - m0 < 32 ? (int)(M - m0) : 32;
                if (configured != mr) {
                    amx_configure(mr < 16 ? mr : 16, mr > 16 ? mr - 16 : 0);
                    configured = mr;
                }
                tile_rows(mr, K, K / 32, x + m0 * K, wb, out, NULL);
                for (int r = 0; r < mr; r++) store_out(out + r * NB, bias, y, m0 + r, N, n0, nn, silu_mul);
            }
        }
        if (configured != -1) _tile_release();
    }
    return failed ? -1 : 0;
}

int w4amx_linear(int64_t M, int64_t N, int64_t K, int64_t G, const uint16_t *x, const uint8_t *wq, const float *sc,
                 const uint16_t *b, uint16_t *y, int nthreads) {
    return by_group(M, N, K, G, x, wq, sc, b, y, nthreads, 0);
}

int w4amx_linear_dequant(int64_t M, int64_t N, int64_t K, int64_t G, const uint16_t *x, const uint8_t *wq,
                         const float *sc, const uint16_t *b, uint16_t *y, int nthreads) {
    return dequantized(M, N, K, G, x, wq, sc, b, y, nthreads, 0);
}

// The fused gated-MLP entries (by_group's note). WHY: unfused, the [M, 2I] projection went to memory and torch's
// SiLU and product read it back, a pass the bf16 model's amxmm-silu and the AVX-512 w4mm-silu-mul do not make.
int w4amx_linear_silu_mul(int64_t M, int64_t N, int64_t K, int64_t G, const uint16_t *x, const uint8_t *wq,
                          const float *sc, const uint16_t *b, uint16_t *y, int nthreads) {
    return by_group(M, N, K, G, x, wq, sc, b, y, nthreads, 1);
}

int w4amx_linear_dequant_silu_mul(int64_t M, int64_t N, int64_t K, int64_t G, const uint16_t *x, const uint8_t *wq,
                                  const float *sc, const uint16_t *b, uint16_t *y, int nthreads) {
    return dequantized(M, N, K, G, x, wq, sc, b, y, nthreads, 1);
}
