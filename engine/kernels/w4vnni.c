// W4A16 linear layers by integer dot products (AVX512-VNNI's VPDPBUSD), over w4mm's packed weight (w4mm.c has the
// layout): for decode's small batches on CPUs with AVX512-VNNI, where one row through w4mm is bound by widening
// the nibbles to bf16. WHY: w4mm spends five vector operations widening each 64 weights for two VDPBF16PS; here
// the nibbles are multiplied as the bytes they are (u8 x s8, four products a 32-bit lane): two unpacks and six
// masks or shifts for every 256 weights against twenty, the same eight dot products.
//
// The math: each row's group of G inputs is scaled by a power of two 2^e (exact) so its largest |x| lies in
// [2^12, 2^13), rounded to an integer X (14 bits with the sign: bf16's 8 significant bits of every value within
// 2^5 of the group's largest are kept exactly, a smaller one is off by at most half a step of 2^-13 of the
// largest), and split X = 128 h + l with h in [-64, 64], l in [-64, 63]: two signed bytes. Every column sums
// q * h and q * l in int32 lanes, exactly, so the order of the sums does not matter and every tile shape gives
// the same bits; at a group's end y += s * 2^-e * (128 sum(q h) + sum(q l)) - s * z * 2^-e * sum(X), in float.
//
// Nibbles: a 64-byte load of w4mm's layout is 32 columns x 4 k (a 16-bit word a column: its k0 | k2 << 4 in the
// low byte, k1 | k3 << 4 in the high one); the same load of the next 4 k and VPUNPCK{L,H}WD give each column's
// 8 k in one 32-bit lane (its columns in an order fixed by the unpack, undone when the block is stored), whose
// low nibbles are k0, k1, k4, k5 and high nibbles k2, k3, k6, k7: a mask, or a shift and a mask, makes each an
// unsigned byte operand. The rows' bytes are laid out to match, 8 k at a time (prepare_rows).
#if !defined(__AVX512VNNI__) || !defined(__AVX512BF16__)
#error "this kernel needs AVX512-VNNI and AVX512-BF16"
#endif
#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16mm_block.h"
#include "w4mm_common.h"

#define VR 8  // rows a tile at most: 1-2 over the block's 64 columns, 3-4 over 32 at a time, 5-8 over 16 at a
              // time (two int32 sums a row and 16-column vector in registers: 16 at most; with 24, at 12 rows, gcc
              // spilled a third of them)

static __thread thread_buffer rows_buf;

// Each row's groups as the tiles read them: xq [K/8][M][4] int32 (for each 8 k and row: h of k0, k1, k4, k5; h of
// k2, k3, k6, k7; then l of the same), d [M][K/G] the groups' 2^-e, xs [M][K/G] 2^-e * sum(X). G % 16 == 0. WHY
// 8 k before rows: a tile's rows are then constant offsets from one pointer, which the dot products take as
// broadcast memory operands (with a pointer a row, 12 rows ran out of registers and spilled their sums).
static void prepare_rows(int64_t M, int64_t K, int64_t G, const uint16_t *x, int32_t *xq, float *d, float *xs,
                         int nthreads) {
    const int64_t groups = K / G;
    const __m128i order = _mm_setr_epi8(0, 1, 4, 5, 2, 3, 6, 7, 8, 9, 12, 13, 10, 11, 14, 15);
#pragma omp parallel for schedule(static) num_threads(nthreads) if (M * K > 65536)
    for (int64_t m = 0; m < M; m++)
        for (int64_t g = 0; g < groups; g++) {
            const uint16_t *p = x + m * K + g * G;
            __m512 top = _mm512_setzero_ps();
            for (int64_t k = 0; k < G; k += 16) {
                const __m512i h = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(p + k)));
                top = _mm512_max_ps(top, _mm512_abs_ps(_mm512_castsi512_ps(_mm512_slli_epi32(h, 16))));
            }
            const float amax = _mm512_reduce_max_ps(top);
            int e = 0;
            if (amax > 0 && isfinite(amax)) {
                frexpf(amax, &e);  // amax = f * 2^e, f in [0.5, 1): amax * 2^(13 - e) in [2^12, 2^13)
                e = 13 - e;
                e = e > 126 ? 126 : e < -126 ? -126 : e;  // 2^e and 2^-e stay normal floats
            }
            const __m512 up = _mm512_set1_ps(ldexpf(1.f, e));
            __m512i sum = _mm512_setzero_si512();
            for (int64_t k = 0; k < G; k += 16) {
                const __m512i h = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(p + k)));
                const __m512 f = _mm512_mul_ps(_mm512_castsi512_ps(_mm512_slli_epi32(h, 16)), up);
                const __m512i X = _mm512_cvt_roundps_epi32(f, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
                sum = _mm512_add_epi32(sum, X);
                const __m512i hi = _mm512_srai_epi32(_mm512_add_epi32(X, _mm512_set1_epi32(64)), 7);
                const __m512i lo = _mm512_sub_epi32(X, _mm512_slli_epi32(hi, 7));
                const __m128i hb = _mm512_cvtepi32_epi8(hi), lb = _mm512_cvtepi32_epi8(lo);
                const int64_t kb = (g * G + k) / 8;  // 16 bytes for every 8 k and row
                const __m128i first = _mm_unpacklo_epi64(hb, lb), second = _mm_unpackhi_epi64(hb, lb);
                _mm_storeu_si128((__m128i *)(xq + (kb * M + m) * 4), _mm_shuffle_epi8(first, order));
                _mm_storeu_si128((__m128i *)(xq + ((kb + 1) * M + m) * 4), _mm_shuffle_epi8(second, order));
            }
            d[m * groups + g] = ldexpf(1.f, -e);
            // |sum| <= G * 2^13: exact in float for groups up to 2,048
            xs[m * groups + g] = ldexpf((float)_mm512_reduce_add_epi32(sum), -e);
        }
}

// A 16-column vector v of a 32-column half (unpack t = v % 2): lane 4L + i holds column 8L + 4t + i of the half.
// Its scales gathered from the half's two 16-column chunks a and b.
static inline __attribute__((always_inline)) __m512 gather_half(__m512 a, __m512 b, int t) {
    const __m512i idx = _mm512_add_epi32(_mm512_setr_epi32(0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27),
                                         _mm512_set1_epi32(4 * t));
    return _mm512_permutex2var_ps(a, idx, b);
}

// mr rows against nv 16-column vectors (from vector v0; vector v lies in the block's 32-column half v / 2, whose
// unpack v % 2 gives it) of one block, added into tot [mr][64] (vector v's totals at 16 v, its lanes in the
// unpack's order). xq, d, xs at the tile's first row (prepare_rows' layout: 4 M int32 for each 8 k). WHY the
// order: each 8 k's nibbles first (2 nv operands), then a row at a time its four bytes broadcast, so 2 mr nv
// int32 sums stay in registers beside them (1-2 rows x 4 vectors, 3-4 x 2, 5-8 x 1); the float totals live in
// memory (a load and a store a group).
static inline __attribute__((always_inline)) void vtile(const int mr, const int nv, const int v0, int64_t K,
                                                        int64_t G, int64_t M, const int32_t *xq, const float *d,
                                                        const float *xs, const uint8_t *wq, const float *sc,
                                                        float (*tot)[NB]) {
    const int64_t groups = K / G;
    const __m512i low = _mm512_set1_epi8(15);
    __m512i ah[VR][4], al[VR][4];
    for (int64_t g = 0; g < groups; g++) {
        for (int r = 0; r < mr; r++)
            for (int v = 0; v < nv; v++) ah[r][v] = al[r][v] = _mm512_setzero_si512();
        for (int64_t kp = g * G / 8; kp < (g + 1) * G / 8; kp++) {  // 8 k: two of the layout's 4-k steps
            const uint8_t *wk = wq + kp * 256;
            if (v0 == 0) prefetch_nibbles(wk), prefetch_nibbles(wk + 128);
            __m512i qlo[4], qhi[4];
            for (int v = 0; v < nv; v++) {
                const int h = (v0 + v) / 2, t = (v0 + v) % 2;
                const __m512i A = _mm512_loadu_si512((const void *)(wk + 64 * h));
                const __m512i B = _mm512_loadu_si512((const void *)(wk + 128 + 64 * h));
                const __m512i u = t ? _mm512_unpackhi_epi16(A, B) : _mm512_unpacklo_epi16(A, B);
                qlo[v] = _mm512_and_si512(u, low);
                qhi[v] = _mm512_and_si512(_mm512_srli_epi16(u, 4), low);
            }
            for (int r = 0; r < mr; r++) {
                const int32_t *xr = xq + kp * 4 * M + 4 * r;
                for (int v = 0; v < nv; v++) {
                    ah[r][v] = _mm512_dpbusd_epi32(ah[r][v], qlo[v], _mm512_set1_epi32(xr[0]));
                    ah[r][v] = _mm512_dpbusd_epi32(ah[r][v], qhi[v], _mm512_set1_epi32(xr[1]));
                    al[r][v] = _mm512_dpbusd_epi32(al[r][v], qlo[v], _mm512_set1_epi32(xr[2]));
                    al[r][v] = _mm512_dpbusd_epi32(al[r][v], qhi[v], _mm512_set1_epi32(xr[3]));
                }
            }
        }
        for (int v = 0; v < nv; v++) {  // s, s * (128 + z) (w4mm's layout): s * z = sz - 128 s
            const int h = (v0 + v) / 2, t = (v0 + v) % 2;
            __m512 s0, s1, sz0, sz1;
            group_scales(sc + g * SC_GROUP, 2 * h, &s0, &sz0);
            group_scales(sc + g * SC_GROUP, 2 * h + 1, &s1, &sz1);
            const __m512 z0 = _mm512_fnmadd_ps(_mm512_set1_ps(128.f), s0, sz0);
            const __m512 z1 = _mm512_fnmadd_ps(_mm512_set1_ps(128.f), s1, sz1);
            const __m512 sv = gather_half(s0, s1, t), zv = gather_half(z0, z1, t);
            for (int r = 0; r < mr; r++) {
                const __m512i I = _mm512_add_epi32(_mm512_slli_epi32(ah[r][v], 7), al[r][v]);
                const __m512 f = _mm512_mul_ps(_mm512_cvtepi32_ps(I), _mm512_set1_ps(d[r * groups + g]));
                float *o = tot[r] + 16 * (v0 + v);
                const __m512 acc = _mm512_fmadd_ps(f, sv, _mm512_load_ps(o));
                _mm512_store_ps(o, _mm512_fnmadd_ps(_mm512_set1_ps(xs[r * groups + g]), zv, acc));
            }
        }
    }
}

#define TALL(n) \
    case n: \
        for (int v = 0; v < 4; v++) vtile(n, 1, v, K, G, M, xq, d, xs, wq, sc, tot); \
        break;

// mr <= VR rows against one block → out [mr][64] float, before the bias.
static void vtile_any(int mr, int64_t K, int64_t G, int64_t M, const int32_t *xq, const float *d, const float *xs,
                      const uint8_t *wq, const float *sc, float *out) {
    float tot[VR][NB] __attribute__((aligned(64)));
    memset(tot, 0, sizeof(float) * NB * (size_t)mr);
    switch (mr) {  // constant shapes keep every sum in a register
    case 1: vtile(1, 4, 0, K, G, M, xq, d, xs, wq, sc, tot); break;
    case 2: vtile(2, 4, 0, K, G, M, xq, d, xs, wq, sc, tot); break;
    case 3: vtile(3, 2, 0, K, G, M, xq, d, xs, wq, sc, tot), vtile(3, 2, 2, K, G, M, xq, d, xs, wq, sc, tot); break;
    case 4: vtile(4, 2, 0, K, G, M, xq, d, xs, wq, sc, tot), vtile(4, 2, 2, K, G, M, xq, d, xs, wq, sc, tot); break;
    TALL(5) TALL(6) TALL(7)
    default: TALL(8)
    }
    // back to column order: a half's column 8L + 4t + i from its vector t's lane 4L + i
    const __m512i first = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
    const __m512i second = _mm512_add_epi32(first, _mm512_set1_epi32(8));
    for (int r = 0; r < mr; r++)
        for (int h = 0; h < 2; h++) {
            const __m512 t0 = _mm512_load_ps(tot[r] + 32 * h), t1 = _mm512_load_ps(tot[r] + 32 * h + 16);
            _mm512_storeu_ps(out + r * NB + 32 * h, _mm512_permutex2var_ps(t0, first, t1));
            _mm512_storeu_ps(out + r * NB + 32 * h + 16, _mm512_permutex2var_ps(t0, second, t1));
        }
}

static int tile_rows(int64_t left) { return left < VR ? (int)left : VR; }

typedef struct {
    int64_t M, K, G;
    const int32_t *xq;     // the rows' bytes (prepare_rows)
    const float *d, *xs;   // their groups' 2^-e and 2^-e * sum(X)
} direct_t;

static void direct_tile(const void *ctx, int64_t r0, int mr, const uint8_t *wq, const float *sc, float *out) {
    const direct_t *c = ctx;
    const int64_t groups = c->K / c->G;
    vtile_any(mr, c->K, c->G, c->M, c->xq + 4 * r0, c->d + r0 * groups, c->xs + r0 * groups, wq, sc, out);
}

// The calling thread's buffers for M rows: their bytes, then 2 * M * K/G floats. NULL without memory.
static int32_t *rows_for(int64_t M, int64_t K, int64_t G) {
    return grow_aligned(&rows_buf, sizeof(int32_t) * (size_t)(M * K / 2) + sizeof(float) * (size_t)(2 * M * (K / G)));
}

static int direct(int64_t M, int64_t N, int64_t K, int64_t G, const uint16_t *x, const uint8_t *wq, const float *sc,
                  const uint16_t *b, uint16_t *y, int nthreads, const int silu_mul) {
    if (M <= 0) return 0;
    int32_t *xq = rows_for(M, K, G);
    if (!xq) return -1;
    float *d = (float *)(xq + M * K / 2), *xs = d + M * (K / G);
    prepare_rows(M, K, G, x, xq, d, xs, nthreads);
    const direct_t c = {M, K, G, xq, d, xs};
    w4_direct_blocks(M, N, K, G, wq, sc, b, y, nthreads, silu_mul, VR, tile_rows, direct_tile, &c);
    return 0;
}

// y [M][N] = x W^T + b (bf16 rows; G a multiple of 16). Returns 0, or -1 without memory for its buffers.
int w4vnni_linear(int64_t M, int64_t N, int64_t K, int64_t G, const uint16_t *x, const uint8_t *wq, const float *sc,
                  const uint16_t *b, uint16_t *y, int nthreads) {
    return direct(M, N, K, G, x, wq, sc, b, y, nthreads, 0);
}

// The same over a gated MLP's [gate; up] weight with its rows interleaved in blocks of 32 (w4mm_linear_silu_mul's
// copy; N % 64 == 0): y [M][N / 2] = silu(gate) * up.
int w4vnni_linear_silu_mul(int64_t M, int64_t N, int64_t K, int64_t G, const uint16_t *x, const uint8_t *wq,
                           const float *sc, const uint16_t *b, uint16_t *y, int nthreads) {
    return direct(M, N, K, G, x, wq, sc, b, y, nthreads, 1);
}

// One task of w4vnni_grouped: a layer's rows (piece p) through one column block (grouped_tasks.h); the rows'
// bytes are prepared once for the call (w4vnni_grouped).
typedef struct {
    const w4group_t *g;
    int64_t M;  // the call's rows
    const int32_t *xq;
    const float *d, *xs;
} vgroup_t;

static void vgroup_task(const void *ctx, int64_t p, int64_t nb, int64_t end) {
    (void)end;  // the tiles ask for nibbles PF_BYTES ahead, in whichever block they lie
    const vgroup_t *v = ctx;
    const w4group_t *g = v->g;
    const int64_t e = g->layer[p], N = g->N, K = g->K, G = g->G, groups = K / G, n0 = nb * NB;
    const int64_t nn = N - n0 < NB ? N - n0 : NB, width = g->silu_mul ? N / 2 : N;
    static const float zeros[NB];
    float out[VR * NB];
    for (int64_t r0 = g->first[p], mr; r0 < g->first[p] + g->counts[e]; r0 += mr) {
        mr = tile_rows(g->first[p] + g->counts[e] - r0);
        vtile_any((int)mr, K, G, v->M, v->xq + 4 * r0, v->d + r0 * groups, v->xs + r0 * groups,
                  g->wq[e] + nb * K * 32, g->sc[e] + nb * groups * SC_GROUP, out);
        for (int r = 0; r < mr; r++) {
            if (!g->silu_mul) store_row(out + r * NB, zeros, g->y + (r0 + r) * width + n0, nn);
            else store_silu_mul_block(out + r * NB, g->y + (r0 + r) * width + n0 / 2);  // N % 64 == 0
        }
    }
}

// E W4A16 linear layers of one shape (no bias) in one call, as w4mm_grouped (its arguments; G a multiple of 16):
// layer e takes counts[e] consecutive rows of x. Returns 0, or -1 without memory for the rows' buffers (y untouched).
int w4vnni_grouped(int64_t E, const int64_t *counts, int64_t N, int64_t K, int64_t G, const uint16_t *x,
                   const uint8_t *const *wq, const float *const *sc, uint16_t *y, int nthreads, int silu_mul) {
    int64_t first[E > 0 ? E : 1], layer[E > 0 ? E : 1], M;  // each layer with rows: its first row, its index
    const int64_t P = grouped_pieces(E, counts, first, layer, &M);
    if (M <= 0) return 0;
    int32_t *xq = rows_for(M, K, G);
    if (!xq) return -1;
    float *d = (float *)(xq + M * K / 2), *xs = d + M * (K / G);
    prepare_rows(M, K, G, x, xq, d, xs, nthreads);
    _Atomic int failed = 0;
    const w4group_t g = {counts, N, K, G, x, wq, sc, y, xs, first, layer, silu_mul, &failed};
    const vgroup_t v = {&g, M, xq, d, xs};
    grouped_tasks(P, (N + NB - 1) / NB, nthreads, 2, vgroup_task, &v);
    return 0;
}
