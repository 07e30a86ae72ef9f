// W4A16 linear layers for CPUs with AVX512-BF16: y[M][N] = x[M][K] . W^T (+ b), x, b and y bf16, W unsigned
// 4-bit with a float scale s and zero point z per output channel and group of G inputs: w = (q - z) * s.
//
// Entry points, which the engine times against each other and torch's int4 GEMM per shape and batch class (and
// w4mm_grouped, the direct kernel over a MoE layer's experts in one call):
// - w4mm_linear: the nibbles are widened to bf16 in registers (as 128 + q, exact) and VDPBF16PS sums
//   x * (128 + q) over a group; at the group's end y += s * sum - s * (128 + z) * (sum x). It reads a quarter of
//   bf16's bytes: for decode's small batches, which stream every weight from memory once per step.
//   w4mm_linear_wide: the same sums in tiles of 6-8 rows x 32 columns (wtile), for decode's larger batches.
// - w4mm_linear_panel: a thread widens one group of its 64-column block at a time into bf16mm's layout in an L1
//   buffer of its own, then runs bf16mm's tiles (6 rows x 64 columns) over it for every row, the group's sums
//   scaled into float rows in memory: the widening is shared by all the rows (batches past a few rows).
// - w4mm_linear_block: a 64-column block dequantized to bf16 whole, then bf16mm's tiles over all of K (prefill).
//
// Packed layout (w4mm.py packs): nibbles [N/64][K/4][4][32] bytes: for each 64-column block, each 4 k and each
// 16 columns, byte i holds column i/2's k = 4kq + i%2 in its low nibble and k = 4kq + 2 + i%2 in its high one,
// so one 32-byte load widens to two VDPBF16PS operands of 16 columns x 2 k (bf16mm's pair layout). Scales
// [N/64][K/G][2][64] float: s, then s * (128 + z), of the block's columns for each group; built with -DSCALE16,
// bf16 s and bytes 128 + z (w4mm_common.h). K and G are multiples of 4.
#ifndef __AVX512BF16__
#error "this kernel needs AVX512-BF16 (-march=native on a CPU without it: torch's int4 GEMM is used instead)"
#endif
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16mm_block.h"
#include "grouped_tasks.h"
#include "w4mm_common.h"

#define QR 6   // rows per tile of the direct kernel, up to 3 over the block's 4 column chunks, past that over 2
#define QT 16  // rows of a tall tile: one 16-column chunk at a time, while 16 rows are left (tile_rows)

// mr rows of x (row stride K) against nc 16-column chunks (from chunk c0) of one block's nibbles wq and scales sc;
// xs: the rows' sums per group [mr][K/G]; out [mr][64] float (those chunks' columns), before the bias. Each
// (row, column) sums the same products in the same order whatever the tile's shape, so every shape gives the
// same bits.
static inline __attribute__((always_inline)) void qtile(const int mr, const int nc, const int c0, int64_t K,
                                                        int64_t G, const uint16_t *x, const uint8_t *wq,
                                                        const float *sc, const float *xs, float *out) {
    const int64_t groups = K / G;
    __m512 tot[QT][4], acc[QT][4];
    for (int r = 0; r < mr; r++)
        for (int c = 0; c < nc; c++) tot[r][c] = _mm512_setzero_ps();
    for (int64_t g = 0; g < groups; g++) {
        for (int r = 0; r < mr; r++)
            for (int c = 0; c < nc; c++) acc[r][c] = _mm512_setzero_ps();
        for (int64_t kq = g * G / 4; kq < (g + 1) * G / 4; kq++) {
            const uint8_t *wk = wq + kq * 128;
            if (c0 == 0) prefetch_nibbles(wk);
            int32_t p0[QT], p1[QT];
            for (int r = 0; r < mr; r++) {
                memcpy(&p0[r], x + r * K + 4 * kq, 4);
                memcpy(&p1[r], x + r * K + 4 * kq + 2, 4);
            }
            for (int c = 0; c < nc; c++) {
                __m512bh a, b;
                widen(wk + 32 * (c0 + c), &a, &b);
                for (int r = 0; r < mr; r++) {
                    acc[r][c] = _mm512_dpbf16_ps(acc[r][c], (__m512bh)_mm512_set1_epi32(p0[r]), a);
                    acc[r][c] = _mm512_dpbf16_ps(acc[r][c], (__m512bh)_mm512_set1_epi32(p1[r]), b);
                }
            }
        }
        __m512 s[4], sz[4];
        for (int c = 0; c < nc; c++) group_scales(sc + g * SC_GROUP, c0 + c, &s[c], &sz[c]);
        for (int r = 0; r < mr; r++) {
            const __m512 sum = _mm512_set1_ps(xs[r * groups + g]);
            for (int c = 0; c < nc; c++) {
                tot[r][c] = _mm512_fmadd_ps(acc[r][c], s[c], tot[r][c]);
                tot[r][c] = _mm512_fnmadd_ps(sum, sz[c], tot[r][c]);
            }
        }
    }
    for (int r = 0; r < mr; r++)
        for (int c = 0; c < nc; c++) _mm512_storeu_ps(out + r * NB + 16 * (c0 + c), tot[r][c]);
}

// The wide entry's tile: mr (<= WR) rows against two of the block's 16-column chunks (from chunk c0), their group
// totals in out (memory) rather than in registers: 16 running sums and 4 widened k pairs, no spills, each weight
// widened once for 8 rows. The same products in the same order as qtile, so the same bits. WHY: on a 2-core Zen 5
// (family 26), Qwen2-0.5B's decode GEMMs from memory at 32 rows took 1.11-1.21x bf16mm's time over bf16 weights
// through qtile's tall tiles (QT: their 16 totals spill at every group) and 1.00-1.09x through these (at 8 rows
// 0.74-0.95x against 0.86-1.07x); 4 rows x 4 chunks ran as fast, 6 x 4 and 10-12 x 2 spilled and ran slower.
#define WR 8
static inline __attribute__((always_inline)) void wtile(const int mr, const int c0, int64_t K, int64_t G,
                                                        const uint16_t *x, const uint8_t *wq, const float *sc,
                                                        const float *xs, float *out) {
    const int64_t groups = K / G;
    for (int r = 0; r < mr; r++)
        for (int c = 0; c < 2; c++) _mm512_storeu_ps(out + r * NB + 16 * (c0 + c), _mm512_setzero_ps());
    for (int64_t g = 0; g < groups; g++) {
        __m512 acc[WR][2];
        for (int r = 0; r < mr; r++)
            for (int c = 0; c < 2; c++) acc[r][c] = _mm512_setzero_ps();
        for (int64_t kq = g * G / 4; kq < (g + 1) * G / 4; kq++) {
            const uint8_t *wk = wq + kq * 128;
            if (c0 == 0) prefetch_nibbles(wk);
            __m512bh a[2], b[2];
            for (int c = 0; c < 2; c++) widen(wk + 32 * (c0 + c), &a[c], &b[c]);
            const uint16_t *xk = x + 4 * kq;
            for (int r = 0; r < mr; r++) {
                const __m512bh p0 = (__m512bh)_mm512_set1_epi32(*(const pair_t *)(xk + r * K));
                for (int c = 0; c < 2; c++) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], p0, a[c]);
                const __m512bh p1 = (__m512bh)_mm512_set1_epi32(*(const pair_t *)(xk + r * K + 2));
                for (int c = 0; c < 2; c++) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], p1, b[c]);
            }
        }
        __m512 s[2], sz[2];
        for (int c = 0; c < 2; c++) group_scales(sc + g * SC_GROUP, c0 + c, &s[c], &sz[c]);
        for (int r = 0; r < mr; r++) {
            const __m512 sum = _mm512_set1_ps(xs[r * groups + g]);
            for (int c = 0; c < 2; c++) {
                float *o = out + r * NB + 16 * (c0 + c);
                const __m512 v = _mm512_fmadd_ps(acc[r][c], s[c], _mm512_loadu_ps(o));
                _mm512_storeu_ps(o, _mm512_fnmadd_ps(sum, sz[c], v));
            }
        }
    }
}

// Up to 3 rows: one tile over the block's 64 columns (2 x 4 accumulators a row); 4 to 6 rows: two tiles of 32
// columns each (2 x 2 a row, 24 registers at 6 rows). WHY: a tile widens its nibbles once for all its rows, and
// the widening shares the vector pipes with the products: 6-row tiles widen each weight half as often as 3-row
// ones, ~5% more products a cycle on a Zen 4 in cache, and at 32 rows Qwen2-0.5B's decode GEMMs through 3-row
// tiles ran ~9% behind bf16mm over the bf16 weights. QT rows: four tiles of one 16-column chunk each (16 running
// sums a chunk, the group totals spilled once a group), each weight widened once for 16 rows: on a 2-core Zen 4,
// 12 Qwen2-0.5B layers in turn at 32 rows, gate/up 1.44 -> 1.38 ms a call, down 0.73 -> 0.71, QKV 0.181 ->
// 0.176; at 8 and 13 rows such tiles were slower (0.45 against 0.41 ms, 8 rows as one tall tile), at 16 and 24 as
// fast or faster, hence only whole tall tiles.
static void qtile_any(int mr, int64_t K, int64_t G, const uint16_t *x, const uint8_t *wq, const float *sc,
                      const float *xs, float *out) {
    switch (mr) {  // constant shapes keep every accumulator in a register
    case QT:
        for (int c = 0; c < 4; c++) qtile(QT, 1, c, K, G, x, wq, sc, xs, out);
        break;
    case 1: qtile(1, 4, 0, K, G, x, wq, sc, xs, out); break;
    case 2: qtile(2, 4, 0, K, G, x, wq, sc, xs, out); break;
    case 3: qtile(3, 4, 0, K, G, x, wq, sc, xs, out); break;
    case 4: qtile(4, 2, 0, K, G, x, wq, sc, xs, out), qtile(4, 2, 2, K, G, x, wq, sc, xs, out); break;
    case 5: qtile(5, 2, 0, K, G, x, wq, sc, xs, out), qtile(5, 2, 2, K, G, x, wq, sc, xs, out); break;
    default: qtile(6, 2, 0, K, G, x, wq, sc, xs, out), qtile(6, 2, 2, K, G, x, wq, sc, xs, out); break;
    }
}

// The rows the next tile takes of the `left` still to do (qtile_any's shapes).
static inline int tile_rows(int64_t left) { return left >= QT ? QT : left < QR ? (int)left : QR; }

// Up to 5 rows through qtile (the same bits), which keeps its totals in registers: on the Zen 5, from memory, 1-5
// rows took 0.6-0.97x wtile's time, 6 the same, 7-8 1.06-1.18x.
static void wtile_any(int mr, int64_t K, int64_t G, const uint16_t *x, const uint8_t *wq, const float *sc,
                      const float *xs, float *out) {
    if (mr <= 5) {
        qtile_any(mr, K, G, x, wq, sc, xs, out);
        return;
    }
#define WTILE(n) \
    case n: wtile(n, 0, K, G, x, wq, sc, xs, out), wtile(n, 2, K, G, x, wq, sc, xs, out); break;
    switch (mr) {  // constant shapes keep every sum in a register
        WTILE(6) WTILE(7)
    default: WTILE(WR)
    }
#undef WTILE
}

// The rows the wide entry's next tile takes of the `left` still to do: WR at a time, two even tiles at the end
// rather than a full one and a thin one (which widens its weights for few rows).
static inline int wide_rows(int64_t left) {
    return left <= WR ? (int)left : left < 2 * WR ? (int)(left + 1) / 2 : WR;
}

typedef struct {
    int64_t K, G;
    const uint16_t *x;
    const float *xs;  // the rows' group sums
} direct_t;

static void direct_tile(const void *ctx, int64_t r0, int mr, const uint8_t *wq, const float *sc, float *out) {
    const direct_t *c = ctx;
    qtile_any(mr, c->K, c->G, c->x + r0 * c->K, wq, sc, c->xs + r0 * (c->K / c->G), out);
}

static void wide_tile(const void *ctx, int64_t r0, int mr, const uint8_t *wq, const float *sc, float *out) {
    const direct_t *c = ctx;
    wtile_any(mr, c->K, c->G, c->x + r0 * c->K, wq, sc, c->xs + r0 * (c->K / c->G), out);
}

// wide: the wide entry's tiles (wtile) rather than qtile's.
static int direct(int64_t M, int64_t N, int64_t K, int64_t G, const uint16_t *x, const uint8_t *wq, const float *sc,
                  const uint16_t *b, uint16_t *y, int nthreads, const int silu_mul, const int wide) {
    if (M <= 0) return 0;
    float *xs = sums_for(M * (K / G));
    if (!xs) return -1;
    group_sums(M, K, G, x, xs, nthreads);
    const direct_t c = {K, G, x, xs};
    if (wide)
        w4_direct_blocks(M, N, K, G, wq, sc, b, y, nthreads, silu_mul, WR, wide_rows, wide_tile, &c);
    else
        w4_direct_blocks(M, N, K, G, wq, sc, b, y, nthreads, silu_mul, QT, tile_rows, direct_tile, &c);
    return 0;
}

// Returns 0, or -1 where the rows' group sums could not be had (y untouched).
int w4mm_linear(int64_t M, int64_t N, int64_t K, int64_t G, const uint16_t *x, const uint8_t *wq, const float *sc,
                const uint16_t *b, uint16_t *y, int nthreads) {
    return direct(M, N, K, G, x, wq, sc, b, y, nthreads, 0, 0);
}

// The same through the wide tiles (wtile: 6-8 rows x 32 columns; fewer rows through qtile), for batches of 6 and
// more.
int w4mm_linear_wide(int64_t M, int64_t N, int64_t K, int64_t G, const uint16_t *x, const uint8_t *wq,
                     const float *sc, const uint16_t *b, uint16_t *y, int nthreads) {
    return direct(M, N, K, G, x, wq, sc, b, y, nthreads, 0, 1);
}

// The same over a gated MLP's [gate; up] weight with its rows interleaved in blocks of 32 (N % 64 == 0): y [M][N /
// 2] = silu(gate) * up, rounded as the unfused bf16 torch code rounds (as bf16mm_linear_silu_mul). WHY: unfused,
// the [M, N] projection went to memory and torch's SiLU and product read it back: Qwen2-0.5B's gate/up at 32 rows
// took 1.68 ms against 1.46 for bf16mm's fused kernel over the bf16 weight (a 2-core Zen 4).
int w4mm_linear_silu_mul(int64_t M, int64_t N, int64_t K, int64_t G, const uint16_t *x, const uint8_t *wq,
                         const float *sc, const uint16_t *b, uint16_t *y, int nthreads) {
    return direct(M, N, K, G, x, wq, sc, b, y, nthreads, 1, 0);
}

int w4mm_linear_wide_silu_mul(int64_t M, int64_t N, int64_t K, int64_t G, const uint16_t *x, const uint8_t *wq,
                              const float *sc, const uint16_t *b, uint16_t *y, int nthreads) {
    return direct(M, N, K, G, x, wq, sc, b, y, nthreads, 1, 1);
}

// One task of w4mm_grouped (wide: of w4mm_grouped_wide, through wtile): a layer's rows (piece p) through one
// column block (grouped_tasks.h).
static inline __attribute__((always_inline)) void group_task(const void *ctx, int64_t p, int64_t nb, const int wide) {
    const w4group_t *g = ctx;
    const int64_t e = g->layer[p], N = g->N, K = g->K, G = g->G, groups = K / G, n0 = nb * NB;
    const int64_t nn = N - n0 < NB ? N - n0 : NB, width = g->silu_mul ? N / 2 : N;
    static const float zeros[NB];
    float out[QT * NB];
    for (int64_t r0 = g->first[p], mr; r0 < g->first[p] + g->counts[e]; r0 += mr) {
        const int64_t left = g->first[p] + g->counts[e] - r0;
        mr = wide ? wide_rows(left) : tile_rows(left);
        const uint8_t *wq = g->wq[e] + nb * K * 32;
        const float *sc = g->sc[e] + nb * groups * SC_GROUP;
        if (wide)
            wtile_any((int)mr, K, G, g->x + r0 * K, wq, sc, g->xs + r0 * groups, out);
        else
            qtile_any((int)mr, K, G, g->x + r0 * K, wq, sc, g->xs + r0 * groups, out);
        for (int r = 0; r < mr; r++) {
            const float *o = out + r * NB;
            if (!g->silu_mul) {
                store_row(o, zeros, g->y + (r0 + r) * width + n0, nn);
                continue;
            }
            store_silu_mul_block(o, g->y + (r0 + r) * width + n0 / 2);  // N % 64 == 0 (checked by the caller)
        }
    }
}

// the direct kernels ask for nibbles PF_BYTES ahead, in whichever block they lie: `end` is not needed
static void w4group_task(const void *ctx, int64_t p, int64_t nb, int64_t end) {
    (void)end;
    group_task(ctx, p, nb, 0);
}

static void w4group_task_wide(const void *ctx, int64_t p, int64_t nb, int64_t end) {
    (void)end;
    group_task(ctx, p, nb, 1);
}

// E W4A16 linear layers of one shape (no bias) in one call, as bf16mm_grouped: layer e takes counts[e] consecutive
// rows of x and its packed weight (nibbles wq[e], scales sc[e]); y gets its rows in the same order, N wide (N / 2
// with silu_mul: the weight's rows are a gated MLP's [gate; up] interleaved in blocks of 32, and y = silu(gate) *
// up). WHY: a MoE layer's quantized experts each paid a Python round trip and a parallel region per projection
// (~25 us a call on a 2-core Zen 4), hundreds a decode step at batch 32. Returns 0, or -1 as w4mm_linear.
int w4mm_grouped(int64_t E, const int64_t *counts, int64_t N, int64_t K, int64_t G, const uint16_t *x,
                 const uint8_t *const *wq, const float *const *sc, uint16_t *y, int nthreads, int silu_mul) {
    return w4_grouped(E, counts, N, K, G, x, wq, sc, y, nthreads, silu_mul, w4group_task);
}

// The same through the wide tiles (wtile): the same bits.
int w4mm_grouped_wide(int64_t E, const int64_t *counts, int64_t N, int64_t K, int64_t G, const uint16_t *x,
                      const uint8_t *const *wq, const float *const *sc, uint16_t *y, int nthreads, int silu_mul) {
    return w4_grouped(E, counts, N, K, G, x, wq, sc, y, nthreads, silu_mul, w4group_task_wide);
}

// One group's nibbles of a 64-column block widened to bf16 (128 + q, exact) in bf16mm's layout [G/2][64][2].
static void widen_group(int64_t G, const uint8_t *wq, uint16_t *wg) {
    for (int64_t kq = 0; kq < G / 4; kq++) {
        prefetch_nibbles(wq + kq * 128);
        for (int c = 0; c < 4; c++) {
            __m512bh a, b;
            widen(wq + kq * 128 + 32 * c, &a, &b);
            _mm512_storeu_si512((void *)(wg + ((2 * kq) * NB + 16 * c) * 2), (__m512i)a);
            _mm512_storeu_si512((void *)(wg + ((2 * kq + 1) * NB + 16 * c) * 2), (__m512i)b);
        }
    }
}

// mr rows of x (row stride ldx, at the group's first input) against a widened group wg: the sums of x * q in
// registers (bf16mm's step), then out[r] += s * sum - s * (128 + z) * xs[r] in memory.
static inline __attribute__((always_inline)) void gtile(const int mr, int64_t ldx, int64_t G, const uint16_t *x,
                                                        const uint16_t *wg, const float *sc, const float *xs,
                                                        int64_t groups, float *out) {
    __m512 acc[MR][4];
    for (int r = 0; r < mr; r++)
        for (int c = 0; c < 4; c++) acc[r][c] = _mm512_setzero_ps();
    int32_t p[MR];
    for (int64_t kp = 0; kp < G / 2; kp++) {
        for (int r = 0; r < mr; r++) memcpy(&p[r], x + r * ldx + 2 * kp, 4);
        step(mr, acc, wg + kp * 2 * NB, p);
    }
    __m512 s[4], sz[4];
    for (int c = 0; c < 4; c++) group_scales(sc, c, &s[c], &sz[c]);
    for (int r = 0; r < mr; r++) {
        const __m512 sum = _mm512_set1_ps(xs[r * groups]);
        for (int c = 0; c < 4; c++) {
            __m512 o = _mm512_loadu_ps(out + r * NB + 16 * c);
            o = _mm512_fmadd_ps(acc[r][c], s[c], o);
            o = _mm512_fnmadd_ps(sum, sz[c], o);
            _mm512_storeu_ps(out + r * NB + 16 * c, o);
        }
    }
}

static void gtile_any(int mr, int64_t ldx, int64_t G, const uint16_t *x, const uint16_t *wg, const float *sc,
                      const float *xs, int64_t groups, float *out) {
    switch (mr) {
    case 1: gtile(1, ldx, G, x, wg, sc, xs, groups, out); break;
    case 2: gtile(2, ldx, G, x, wg, sc, xs, groups, out); break;
    case 3: gtile(3, ldx, G, x, wg, sc, xs, groups, out); break;
    case 4: gtile(4, ldx, G, x, wg, sc, xs, groups, out); break;
    case 5: gtile(5, ldx, G, x, wg, sc, xs, groups, out); break;
    default: gtile(6, ldx, G, x, wg, sc, xs, groups, out); break;
    }
}

// Returns 0, or -1 where a buffer could not be had (y is then incomplete).
int w4mm_linear_panel(int64_t M, int64_t N, int64_t K, int64_t G, const uint16_t *x, const uint8_t *wq,
                      const float *sc, const uint16_t *b, uint16_t *y, int nthreads) {
    const int64_t nblocks = (N + NB - 1) / NB, groups = K / G;
    if (M <= 0) return 0;
    float *xs = sums_for(M * groups);
    if (!xs) return -1;
    group_sums(M, K, G, x, xs, nthreads);
    int failed = 0;
#pragma omp parallel num_threads(nthreads) reduction(| : failed)
    {
        uint16_t *wg = bf16_buffer(G * NB);
        failed = wg == NULL;
        float out[MC * NB];
#pragma omp for schedule(static)
        for (int64_t nb = 0; nb < nblocks; nb++) {
            if (!wg) continue;
            const int64_t n0 = nb * NB, nn = N - n0 < NB ? N - n0 : NB;
            float bias[NB];
            load_bias(b, n0, nn, bias);
            const uint8_t *wb = wq + nb * K * 32;
            const float *sb = sc + nb * groups * SC_GROUP;
            // rows a pass at most MC, so they stay in L2 while the block's groups go past them
            for (int64_t m0 = 0; m0 < M; m0 += MC) {
                const int64_t mc = M - m0 < MC ? M - m0 : MC;
                memset(out, 0, sizeof(float) * (size_t)(mc * NB));
                for (int64_t g = 0; g < groups; g++) {
                    widen_group(G, wb + g * G * 32, wg);
                    for (int64_t r = 0; r < mc; r += MR) {
                        const int mr = mc - r < MR ? (int)(mc - r) : MR;
                        gtile_any(mr, K, G, x + (m0 + r) * K + g * G, wg, sb + g * SC_GROUP, xs + (m0 + r) * groups + g,
                                  groups, out + r * NB);
                    }
                }
                for (int64_t r = 0; r < mc; r++) store_row(out + r * NB, bias, y + (m0 + r) * N + n0, nn);
            }
        }
    }
    return failed ? -1 : 0;
}

// w4mm_linear_block: a thread dequantizes one 64-column block, all of K, into bf16 (bf16mm's layout, a buffer of
// its own: K x 128 bytes, in L2 for these models' K), then runs bf16mm's tiles over it for every row, summing over
// all of K in registers: a cost per weight, none per row tile or group. WHY: the direct kernel widens every weight
// again for each 3-row tile, and the panel one scales its sums into memory at every group's end (costly at groups
// of 32). 24 Qwen2-0.5B layers at 256 rows on a 2-core Zen 4: 426 ms against 510 direct and 550 panel at group 32,
// 428 against 472 at group 128 (bf16mm over the bf16 weights: 432); at 32 rows it ties the direct kernel.
// Returns 0, or -1 where a buffer could not be had (y is then incomplete).
static int by_block(int64_t M, int64_t N, int64_t K, int64_t G, const uint16_t *x, const uint8_t *wq,
                    const float *sc, const uint16_t *b, uint16_t *y, int nthreads, const int silu_mul) {
    const int64_t nblocks = (N + NB - 1) / NB, groups = K / G;
    if (M <= 0) return 0;
    int failed = 0;
#pragma omp parallel num_threads(nthreads) reduction(| : failed)
    {
        uint16_t *wb = bf16_buffer(K * NB);
        failed = wb == NULL;
#pragma omp for schedule(static)
        for (int64_t nb = 0; nb < nblocks; nb++) {
            if (!wb) continue;
            dequantize_block(K, G, wq + nb * K * 32, sc + nb * groups * SC_GROUP, wb, 0);  // bf16mm's layout
            // nblocks = nb + 1: the buffer holds this block only, so block() asks for no next one
            for (int64_t m0 = 0; m0 < M; m0 += MC)
                block(m0, M - m0 < MC ? M : m0 + MC, nb, nb + 1, N, K, x, wb, b, y, silu_mul);
        }
    }
    return failed ? -1 : 0;
}

int w4mm_linear_block(int64_t M, int64_t N, int64_t K, int64_t G, const uint16_t *x, const uint8_t *wq,
                      const float *sc, const uint16_t *b, uint16_t *y, int nthreads) {
    return by_block(M, N, K, G, x, wq, sc, b, y, nthreads, 0);
}

// The same with w4mm_linear_silu_mul's interleaved [gate; up] rows and fused silu(gate) * up (N % 64 == 0).
int w4mm_linear_block_silu_mul(int64_t M, int64_t N, int64_t K, int64_t G, const uint16_t *x, const uint8_t *wq,
                               const float *sc, const uint16_t *b, uint16_t *y, int nthreads) {
    return by_block(M, N, K, G, x, wq, sc, b, y, nthreads, 1);
}

// The weight as bf16 rows for a dense GEMM (oneDNN's, through F.linear): w[n][k] = (q - z) * s in float, as the
// reference computes it, rounded once to bf16. From the weight as stored (nibbles [N][K/2], even k in the low
// nibble; scale float and zero uint8 [N][K/G]), not the packed copy: row n's 64 k at a time are one 32-byte read and
// two 64-byte writes. WHY: at prefill sizes oneDNN's blocking outruns widening the nibbles per column block (9728 x
// 896 at 4,096 rows on a 2-core AMX Xeon: 54.6 ms over a bf16 weight against 71.6 in w4amx); this costs ~0.1 ms a
// million weights. G is a multiple of 32.
void w4mm_dequantize(int64_t N, int64_t K, int64_t G, const uint8_t *nibbles, const float *scale,
                     const uint8_t *zero, uint16_t *w, int nthreads) {
    const int64_t groups = K / G;
    const __m512i pairs = pair_order();  // [e0..e15, o0..o15] → [e0, o0, e1, o1, ...]
#pragma omp parallel for schedule(static) num_threads(nthreads)
    for (int64_t n = 0; n < N; n++)
        for (int64_t g = 0; g < groups; g++) {
            const __m512 s = _mm512_set1_ps(scale[n * groups + g]), z = _mm512_set1_ps((float)zero[n * groups + g]);
            for (int64_t k = g * G; k < (g + 1) * G; k += 32) {
                const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(nibbles + (n * K + k) / 2)));
                const __m512 e = _mm512_cvtepi32_ps(_mm512_and_si512(v, _mm512_set1_epi32(15)));
                const __m512 o = _mm512_cvtepi32_ps(_mm512_srli_epi32(v, 4));
                const __m512bh b = _mm512_cvtne2ps_pbh(_mm512_mul_ps(_mm512_sub_ps(o, z), s),
                                                       _mm512_mul_ps(_mm512_sub_ps(e, z), s));
                _mm512_storeu_si512((void *)(w + n * K + k), _mm512_permutexvar_epi16(pairs, (__m512i)b));
            }
        }
}
