// W4A16 linear layers with AVX512-FP16 products, over w4mm's packed weight (w4mm.c has the layout): for the
// decode batches of CPUs with AVX512-FP16 (Intel Xeons since Sapphire Rapids), where w4mm's VDPBF16PS loop is
// what bounds one row. WHY: on a 2-core AMX Xeon (model 207) a VDPBF16PS (32 products) took 1.0-1.3 ns against
// 0.31-0.33 for an FMA, and one W4A16 row through w4mm widened and multiplied at 43 G weights/s from L3 (17.9
// GB/s of nibbles from memory, where amxmm streams bf16 at 27): VFMADDPH does 32 products at an FMA's rate. On a
// 2-core AMX Xeon (model 167) one row over Qwen2-0.5B's 24 layers from memory took 11.03 ms against w4mm's 11.96
// and w4amx's 12.88 (benchmarks.quant_gemm), 10-22% less than w4mm in cache: the stream, not the products, is
// what is left (it and the widening overlap poorly).
//
// The math: each row of x is scaled by a power of two 2^e (exact) so its largest |x| lies in [32, 64), rounded
// to fp16 (11 significant bits, against bf16's 8 in w4mm), and every column sums x * (q - 8) over 32 inputs in
// fp16 lanes (16 products a lane, each |q - 8| <= 8: at most 8,192, no overflow), which are then widened to float
// and summed per group: y = sum_g s * sum (x (q - 8)) - s * (z - 8) * sum x, then times 2^-e, in float. A column's
// two fp16 lanes (even and odd k of each pair, w4mm's layout) are added when widened. The engine checks the
// result against the reference and times it beside w4mm's and w4amx's entries per shape and batch class.
#ifndef __AVX512FP16__
#error "this kernel needs AVX512-FP16"
#endif
#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16mm_block.h"
#include "w4mm_common.h"

#define HR 3     // rows a tile: 3 x 4 fp16 running sums and 3 x 4 float totals in registers
#define SPAN 8   // k quads (32 inputs) summed in fp16 before they are widened to float

// Nibble → fp16 (q - 8), for vpermw: a word's low 5 bits index it, so a byte's low nibble needs no mask (the
// table repeats) and a high nibble shifted down lands on the same 16 values.
static inline __m512i q_table(void) {
    uint16_t t[32];
    for (int i = 0; i < 32; i++) {
        const _Float16 v = (_Float16)((i & 15) - 8);
        memcpy(&t[i], &v, 2);
    }
    return _mm512_loadu_si512(t);
}

static __thread thread_buffer half_buf;

// Rows of x (bf16 [M][K]) scaled by 2^e[m] and rounded to fp16 in xh [M][K]; their group sums times 2^e[m] in xs
// [M][K/G], and 2^-e[m] in inv[m].
static void rows_to_half(int64_t M, int64_t K, int64_t G, const uint16_t *x, uint16_t *xh, float *xs, float *inv,
                         int nthreads) {
    group_sums(M, K, G, x, xs, nthreads);
    for (int64_t m = 0; m < M; m++) {
        const uint16_t *p = x + m * K;
        __m512 top = _mm512_setzero_ps();
        int64_t k = 0;
        for (; k + 16 <= K; k += 16) {
            const __m512i h = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(p + k)));
            top = _mm512_max_ps(top, _mm512_abs_ps(_mm512_castsi512_ps(_mm512_slli_epi32(h, 16))));
        }
        float amax = _mm512_reduce_max_ps(top);
        for (; k < K; k++) amax = fmaxf(amax, fabsf(bf16_to_f32(p[k])));
        int e = 0;
        if (amax > 0 && isfinite(amax)) {
            frexpf(amax, &e);  // amax = f * 2^e, f in [0.5, 1): amax * 2^(6 - e) in [32, 64)
            e = 6 - e;
            e = e > 100 ? 100 : e < -100 ? -100 : e;
        }
        const float up = ldexpf(1.f, e);
        inv[m] = ldexpf(1.f, -e);
        for (int64_t g = 0; g < K / G; g++) xs[m * (K / G) + g] *= up;
        const __m512 u = _mm512_set1_ps(up);
        for (k = 0; k + 16 <= K; k += 16) {
            const __m512i h = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(p + k)));
            const __m512 f = _mm512_mul_ps(_mm512_castsi512_ps(_mm512_slli_epi32(h, 16)), u);
            _mm256_storeu_si256((__m256i *)(xh + m * K + k), _mm512_cvtps_ph(f, _MM_FROUND_TO_NEAREST_INT));
        }
        for (; k < K; k++) {
            const _Float16 v = (_Float16)(bf16_to_f32(p[k]) * up);
            memcpy(&xh[m * K + k], &v, 2);
        }
    }
}

// A column chunk's fp16 sums (two lanes a column: even and odd k) as 16 floats, the lanes added.
static inline __attribute__((always_inline)) __m512 widen_sums(__m512h acc) {
    const __m512i a = _mm512_castph_si512(acc);
    const __m512 even = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(a));
    const __m512 odd = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(a, 16)));
    return _mm512_add_ps(even, odd);
}

// mr rows of xh (fp16, row stride K) against one 64-column block's nibbles wq and scales sc → out [mr][64] float,
// before the bias; xs: the rows' scaled group sums, inv: their 2^-e.
static inline __attribute__((always_inline)) void htile(const int mr, int64_t K, int64_t G, const uint16_t *xh,
                                                        const uint8_t *wq, const float *sc, const float *xs,
                                                        const float *inv, __m512i table, float *out) {
    const int64_t groups = K / G;
    __m512 tot[HR][4];
    __m512h acc[HR][4];
    for (int r = 0; r < mr; r++)
        for (int c = 0; c < 4; c++) tot[r][c] = _mm512_setzero_ps();
    for (int64_t g = 0; g < groups; g++) {
        const float *sg = sc + g * SC_GROUP;
        for (int64_t k0 = g * G / 4; k0 < (g + 1) * G / 4; k0 += SPAN) {
            for (int r = 0; r < mr; r++)
                for (int c = 0; c < 4; c++) acc[r][c] = _mm512_setzero_ph();
            for (int64_t kq = k0; kq < k0 + SPAN; kq++) {
                const uint8_t *wk = wq + kq * 128;
                prefetch_nibbles(wk);
                int32_t p0[HR], p1[HR];
                for (int r = 0; r < mr; r++) {
                    memcpy(&p0[r], xh + r * K + 4 * kq, 4);
                    memcpy(&p1[r], xh + r * K + 4 * kq + 2, 4);
                }
                for (int c = 0; c < 4; c++) {
                    const __m512i wide = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(wk + 32 * c)));
                    const __m512h a = _mm512_castsi512_ph(_mm512_permutexvar_epi16(wide, table));
                    const __m512h b = _mm512_castsi512_ph(_mm512_permutexvar_epi16(_mm512_srli_epi16(wide, 4), table));
                    for (int r = 0; r < mr; r++) {
                        acc[r][c] = _mm512_fmadd_ph(_mm512_castsi512_ph(_mm512_set1_epi32(p0[r])), a, acc[r][c]);
                        acc[r][c] = _mm512_fmadd_ph(_mm512_castsi512_ph(_mm512_set1_epi32(p1[r])), b, acc[r][c]);
                    }
                }
            }
            for (int c = 0; c < 4; c++) {
                __m512 s, sz;
                group_scales(sg, c, &s, &sz);
                for (int r = 0; r < mr; r++) tot[r][c] = _mm512_fmadd_ps(widen_sums(acc[r][c]), s, tot[r][c]);
            }
        }
        // sz = s * (128 + z) (w4mm's layout): s * (z - 8) = sz - 136 * s
        for (int c = 0; c < 4; c++) {
            __m512 s, sz;
            group_scales(sg, c, &s, &sz);
            const __m512 s8 = _mm512_fnmadd_ps(_mm512_set1_ps(136.f), s, sz);
            for (int r = 0; r < mr; r++) tot[r][c] = _mm512_fnmadd_ps(_mm512_set1_ps(xs[r * groups + g]), s8, tot[r][c]);
        }
    }
    for (int r = 0; r < mr; r++)
        for (int c = 0; c < 4; c++)
            _mm512_storeu_ps(out + r * NB + 16 * c, _mm512_mul_ps(tot[r][c], _mm512_set1_ps(inv[r])));
}

static void htile_any(int mr, int64_t K, int64_t G, const uint16_t *xh, const uint8_t *wq, const float *sc,
                      const float *xs, const float *inv, __m512i table, float *out) {
    switch (mr) {  // constant shapes keep every sum in a register
    case 1: htile(1, K, G, xh, wq, sc, xs, inv, table, out); break;
    case 2: htile(2, K, G, xh, wq, sc, xs, inv, table, out); break;
    default: htile(3, K, G, xh, wq, sc, xs, inv, table, out); break;
    }
}

typedef struct {
    __m512i table;  // q_table()
    int64_t K, G;
    const uint16_t *xh;      // the rows scaled, in fp16
    const float *xs, *inv;   // their scaled group sums, their 2^-e
} direct_t;

static void direct_tile(const void *ctx, int64_t r0, int mr, const uint8_t *wq, const float *sc, float *out) {
    const direct_t *c = ctx;
    htile_any(mr, c->K, c->G, c->xh + r0 * c->K, wq, sc, c->xs + r0 * (c->K / c->G), c->inv + r0, c->table, out);
}

static int tile_rows(int64_t left) { return left < HR ? (int)left : HR; }

static int direct(int64_t M, int64_t N, int64_t K, int64_t G, const uint16_t *x, const uint8_t *wq, const float *sc,
                  const uint16_t *b, uint16_t *y, int nthreads, const int silu_mul) {
    const int64_t groups = K / G;
    if (M <= 0) return 0;
    float *xs = sums_for(M * (groups + 1));
    uint16_t *xh = grow_aligned(&half_buf, sizeof(uint16_t) * (size_t)(M * K));
    if (!xs || !xh) return -1;
    float *inv = xs + M * groups;
    rows_to_half(M, K, G, x, xh, xs, inv, nthreads);
    const direct_t c = {q_table(), K, G, xh, xs, inv};
    w4_direct_blocks(M, N, K, G, wq, sc, b, y, nthreads, silu_mul, HR, tile_rows, direct_tile, &c);
    return 0;
}

// y [M][N] = x W^T + b (bf16 rows; G a multiple of 32). Returns 0, or -1 without memory for its buffers.
int w4fp16_linear(int64_t M, int64_t N, int64_t K, int64_t G, const uint16_t *x, const uint8_t *wq, const float *sc,
                  const uint16_t *b, uint16_t *y, int nthreads) {
    return direct(M, N, K, G, x, wq, sc, b, y, nthreads, 0);
}

// The same over a gated MLP's [gate; up] weight with its rows interleaved in blocks of 32 (w4mm_linear_silu_mul's
// copy; N % 64 == 0): y [M][N / 2] = silu(gate) * up.
int w4fp16_linear_silu_mul(int64_t M, int64_t N, int64_t K, int64_t G, const uint16_t *x, const uint8_t *wq,
                           const float *sc, const uint16_t *b, uint16_t *y, int nthreads) {
    return direct(M, N, K, G, x, wq, sc, b, y, nthreads, 1);
}
