// W4A16 linear layers for CPUs that compute in float32 (no bf16 arithmetic: AVX2, AVX-512 without BF16, and
// any other CPU through the portable code): y[M][N] = x[M][K] . W^T (+ b), x, b and y float32, W unsigned 4-bit
// with a float scale s and zero point z per output channel and group of G inputs: w = (q - z) * s.
//
// WHY: torch's int4 GEMM for float32 activations ran scalar code on a Zen 3 (2026-12-04): 5.0 ms for one row
// of a 4864 x 896 layer, where float32 matmul over the widened weight took 0.8; W4A16 decoded at 0.11x the
// speed of the bf16 checkpoint it came from.
//
// Two entry points, which the engine times against each other, torch's int4 GEMM and the reference per shape
// and batch class:
// - w4f32_linear: a tile of one or two rows widens the nibbles in registers and sums x * q over a group; at the
//   group's end y += s * sum - s * z * (sum x). Decode.
// - w4f32_linear_panel: one group of a 32-column block at a time widened into a float buffer, then 6-row x
//   16-column FMA tiles over every row (the widening shared by all the rows). Batches and prefill.
// Each has a fused gated-MLP twin (w4f32_linear_silu_mul, w4f32_linear_panel_silu_mul: silu(gate) * up in the
// epilogue), and w4f32_grouped runs a MoE layer's experts in one call. Built with -ffp-contract=off (w4f32.py).
//
// Packed layout (w4f32.py packs): words [N/32][K/8][32] uint32: word j of k octet o holds column j's k = 8o + i
// at bits 4i, i = 0..7 (Int4Weight's bytes for those 8 k's, read as one little-endian word). Scales
// [N/32][K/G][2][32] float: s, then s * z; or, built with -DSCALE16 for scales that are bf16 values (a bf16
// checkpoint's), [N/32][K/G] of 96 bytes: the 32 columns' s as bf16, then their z as bytes, and s * z made here
// (8 significant bits times 4: exact in float, the same value), 37.5% of the bytes. K and G multiples of 8.
//
// The direct tiles widen nibble i of a word by one AND with 15 << 4i and one conversion: it gives q * 16^i
// exactly (4 significant bits), and the row's x[k] is scaled by 16^-i beforehand (exact: a power of two), so
// each product is x * q as the reference rounds it. The top nibble (i = 7) is shifted down instead (bit 31 is
// the sign the conversion reads). Per 8 weights: AND, convert, FMA; the byte layout before (a zero-extending
// load of 8 bytes per 16 weights, AND / shift, two conversions) ran up to 1.25x slower on one Zen 3 core with the
// weight in cache (2026-12-06; from memory at two threads the two were within that VM's noise through Python).
#include <math.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "grouped_tasks.h"
#include "silu.h"
#include "thread_buffer.h"

#define NB 32  // columns per packed block
#if defined(__AVX512F__) && !defined(W4F32_YMM)
#define MR 12  // rows per panel tile: 24 accumulators of the 32 registers
#else
#define MR 6   // rows per panel tile
#endif
#define MC 96  // rows per panel pass: their partial sums [MC][NB] stay in L1/L2 while the groups go by
#ifndef PF_BYTES
#define PF_BYTES 4096  // the direct tiles ask for the words this far ahead (past a block: the next one's; on a
                       // Zen 3 at two threads 4096 streamed 17-22 GB/s, 2048 13-17, 2026-12-06)
#endif

#ifndef PANEL_PF
#define PANEL_PF 1  // the panel asks for the next group's words while this group's tiles run (0: it does not)
#endif

#ifdef SCALE16
#define SC_GROUP (3 * NB / 4)  // floats a group of a block's scales
#else
#define SC_GROUP (2 * NB)
#endif

static __thread thread_buffer sums_buf, scaled_buf, group_buf;

// Group g's [2][NB] of a block's scales sc (s, then s * z): where they lie, or (the compact layout) made in buf.
static inline const float *group_scales(const float *sc, int64_t g, float *buf) {
#ifdef SCALE16
    const uint16_t *s16 = (const uint16_t *)(sc + g * SC_GROUP);
    const uint8_t *z = (const uint8_t *)(s16 + NB);
    for (int j = 0; j < NB; j++) {
        const uint32_t u = (uint32_t)s16[j] << 16;
        float s;
        memcpy(&s, &u, 4);
        buf[j] = s;
        buf[NB + j] = s * (float)z[j];
    }
    return buf;
#else
    (void)buf;
    return sc + g * SC_GROUP;
#endif
}

// The calling thread's buffer for n floats; NULL without memory.
static float *floats(thread_buffer *b, int64_t n) { return grow(b, sizeof(float) * (size_t)n); }

// The sums of x's rows over each group of G inputs: [M][K/G].
static void group_sums(int64_t M, int64_t K, int64_t G, const float *x, float *xs, int nthreads) {
#pragma omp parallel for schedule(static) num_threads(nthreads) if (M * K > 65536)
    for (int64_t m = 0; m < M; m++)
        for (int64_t g = 0; g < K / G; g++) {
            float s = 0;
            for (int64_t k = g * G; k < (g + 1) * G; k++) s += x[m * K + k];
            xs[m * (K / G) + g] = s;
        }
}

// x's rows with x[k] scaled by 16^-(k % 8) where k % 8 < 7 (the direct tiles' widened nibbles are q * 16^(k % 8)).
// A value the scaling would leave subnormal (|x| below ~2^-102) is flushed to zero: such a product is lost beside
// any term of ordinary size, and subnormal operands cost some CPUs a microcode assist per FMA.
static void scale_rows(int64_t M, int64_t K, const float *x, float *xq) {
    static const float f[8] = {1.f, 0x1p-4f, 0x1p-8f, 0x1p-12f, 0x1p-16f, 0x1p-20f, 0x1p-24f, 1.f};
    for (int64_t m = 0; m < M; m++)
        for (int64_t k = 0; k < K; k++) {
            const float v = x[m * K + k] * f[k % 8];
            xq[m * K + k] = (v < 1.17549435e-38f && v > -1.17549435e-38f) ? 0.0f : v;
        }
}

// out[r][j] += s[j] * acc[r][j] - sz[j] * xs[r]: a group's sums into the rows' totals.
static inline void close_group(int mr, const float *acc, const float *s, const float *sz, const float *xs,
                               int64_t groups, float *out) {
    for (int r = 0; r < mr; r++)
        for (int j = 0; j < NB; j++) out[r * NB + j] += s[j] * acc[r * NB + j] - sz[j] * xs[r * groups];
}

#if defined(__AVX512F__) && !defined(W4F32_YMM)
#include <immintrin.h>

// AVX-512 (a CPU that has it but not AVX512-BF16 computes in float32: Skylake-SP, Cascade Lake, Ice Lake): the
// same arithmetic as the AVX2 tiles below on 16 columns a register, so a block's 32 columns are two. WHY: the
// 8-wide tiles ran a 32-row step's int4 GEMMs at half the rate of wbf16's 16-wide float32 FMAs over bf16
// weights on an AVX-512 CPU (DeepSeek-V2-tiny W4A16 in float32 math at 0.60x the float model's batch, Zen 5,
// 2026-12-07). The AVX2 build (-DW4F32_YMM) stays a candidate the engine times against this one.

// Nibble i of each word, as q * 16^i (i < 7) or q (i = 7), in float.
static inline __attribute__((always_inline)) __m512 nibble(__m512i v, int i) {
    const __m512i t = i == 7 ? _mm512_srli_epi32(v, 28) : _mm512_and_si512(v, _mm512_set1_epi32(15 << (4 * i)));
    return _mm512_cvtepi32_ps(t);
}

// One row (scaled) against a block: k mod 4 in accumulators of their own (8 independent FMA chains).
static void dtile1(int64_t K, int64_t G, const float *xq, const uint32_t *wq, const float *sc, const float *xs,
                   float *out) {
    const int64_t groups = K / G;
    __m512 tot[2];
    for (int c = 0; c < 2; c++) tot[c] = _mm512_setzero_ps();
    for (int64_t g = 0; g < groups; g++) {
        __m512 a[4][2];
        for (int p = 0; p < 4; p++) a[p][0] = a[p][1] = _mm512_setzero_ps();
        for (int64_t o = g * G / 8; o < (g + 1) * G / 8; o++) {
            const uint32_t *w = wq + o * NB;
            _mm_prefetch((const char *)w + PF_BYTES, _MM_HINT_T0);
            _mm_prefetch((const char *)w + PF_BYTES + 64, _MM_HINT_T0);
            __m512i v[2];
            for (int c = 0; c < 2; c++) v[c] = _mm512_loadu_si512((const void *)(w + 16 * c));
#pragma GCC unroll 8  // a constant i: its mask is an immediate, i == 7 no branch
            for (int i = 0; i < 8; i++) {
                const __m512 xb = _mm512_set1_ps(xq[8 * o + i]);
                for (int c = 0; c < 2; c++) a[i % 4][c] = _mm512_fmadd_ps(xb, nibble(v[c], i), a[i % 4][c]);
            }
        }
        float buf[2 * NB];
        const float *s = group_scales(sc, g, buf), *sz = s + NB;
        const __m512 sum = _mm512_set1_ps(xs[g]);
        for (int c = 0; c < 2; c++) {
            const __m512 t = _mm512_add_ps(_mm512_add_ps(a[0][c], a[1][c]), _mm512_add_ps(a[2][c], a[3][c]));
            tot[c] = _mm512_fmadd_ps(t, _mm512_loadu_ps(s + 16 * c), tot[c]);
            tot[c] = _mm512_fnmadd_ps(sum, _mm512_loadu_ps(sz + 16 * c), tot[c]);
        }
    }
    for (int c = 0; c < 2; c++) _mm512_storeu_ps(out + 16 * c, tot[c]);
}

// Two rows (scaled, K apart) against a block: each widened nibble feeds both rows' FMAs, even and odd k apart.
static void dtile2(int64_t K, int64_t G, const float *xq, const uint32_t *wq, const float *sc, const float *xs,
                   float *out) {
    const int64_t groups = K / G;
    memset(out, 0, sizeof(float) * 2 * NB);
    for (int64_t g = 0; g < groups; g++) {
        __m512 acc[2][2][2];  // [row][k parity][half]
        for (int r = 0; r < 2; r++)
            for (int p = 0; p < 2; p++) acc[r][p][0] = acc[r][p][1] = _mm512_setzero_ps();
        for (int64_t o = g * G / 8; o < (g + 1) * G / 8; o++) {
            const uint32_t *w = wq + o * NB;
            _mm_prefetch((const char *)w + PF_BYTES, _MM_HINT_T0);
            _mm_prefetch((const char *)w + PF_BYTES + 64, _MM_HINT_T0);
            __m512i v[2];
            for (int c = 0; c < 2; c++) v[c] = _mm512_loadu_si512((const void *)(w + 16 * c));
#pragma GCC unroll 8
            for (int i = 0; i < 8; i++) {
                const __m512 x0 = _mm512_set1_ps(xq[8 * o + i]), x1 = _mm512_set1_ps(xq[K + 8 * o + i]);
                for (int c = 0; c < 2; c++) {
                    const __m512 q = nibble(v[c], i);
                    acc[0][i % 2][c] = _mm512_fmadd_ps(x0, q, acc[0][i % 2][c]);
                    acc[1][i % 2][c] = _mm512_fmadd_ps(x1, q, acc[1][i % 2][c]);
                }
            }
        }
        float a[2 * NB], buf[2 * NB];
        for (int r = 0; r < 2; r++)
            for (int c = 0; c < 2; c++)
                _mm512_storeu_ps(a + r * NB + 16 * c, _mm512_add_ps(acc[r][0][c], acc[r][1][c]));
        const float *s = group_scales(sc, g, buf);
        close_group(2, a, s, s + NB, xs + g, groups, out);
    }
}

// One group of a block widened to floats [G][NB] (the values q themselves).
static void widen_group(int64_t G, const uint32_t *wq, float *wg) {
    for (int64_t o = 0; o < G / 8; o++)
        for (int c = 0; c < 2; c++) {
            const __m512i v = _mm512_loadu_si512((const void *)(wq + o * NB + 16 * c));
#pragma GCC unroll 8
            for (int i = 0; i < 8; i++) {
                const __m512i q = _mm512_and_si512(_mm512_srli_epi32(v, 4 * i), _mm512_set1_epi32(15));
                _mm512_storeu_ps(wg + (8 * o + i) * NB + 16 * c, _mm512_cvtepi32_ps(q));
            }
        }
}

// mr rows (stride ldx, at the group's first input) x the block's 32 columns of a widened group.
static inline __attribute__((always_inline)) void gtile(const int mr, int64_t ldx, int64_t G, const float *x,
                                                        const float *wg, float *acc) {
    __m512 a[MR][2];
    for (int r = 0; r < mr; r++) a[r][0] = a[r][1] = _mm512_setzero_ps();
    for (int64_t k = 0; k < G; k++) {
        const __m512 w0 = _mm512_loadu_ps(wg + k * NB), w1 = _mm512_loadu_ps(wg + k * NB + 16);
        for (int r = 0; r < mr; r++) {
            const __m512 xv = _mm512_set1_ps(x[r * ldx + k]);
            a[r][0] = _mm512_fmadd_ps(xv, w0, a[r][0]);
            a[r][1] = _mm512_fmadd_ps(xv, w1, a[r][1]);
        }
    }
    for (int r = 0; r < mr; r++) {
        _mm512_storeu_ps(acc + r * NB, a[r][0]);
        _mm512_storeu_ps(acc + r * NB + 16, a[r][1]);
    }
}

static void gtile_any(int mr, int64_t ldx, int64_t G, const float *x, const float *wg, float *acc) {
    switch (mr) {  // a constant row count keeps every accumulator in a register
#define GT(n) \
    case n: gtile(n, ldx, G, x, wg, acc); break;
        GT(1) GT(2) GT(3) GT(4) GT(5) GT(6) GT(7) GT(8) GT(9) GT(10) GT(11)
#undef GT
    default: gtile(MR, ldx, G, x, wg, acc); break;
    }
}
#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

// Nibble i of each word, as q * 16^i (i < 7) or q (i = 7), in float.
static inline __attribute__((always_inline)) __m256 nibble(__m256i v, int i) {
    const __m256i t = i == 7 ? _mm256_srli_epi32(v, 28) : _mm256_and_si256(v, _mm256_set1_epi32(15 << (4 * i)));
    return _mm256_cvtepi32_ps(t);
}

// One row (scaled) against a block: even and odd k's in accumulators of their own (8 independent FMA chains).
static void dtile1(int64_t K, int64_t G, const float *xq, const uint32_t *wq, const float *sc, const float *xs,
                   float *out) {
    const int64_t groups = K / G;
    __m256 tot[4];
    for (int c = 0; c < 4; c++) tot[c] = _mm256_setzero_ps();
    for (int64_t g = 0; g < groups; g++) {
        __m256 a0[4], a1[4];
        for (int c = 0; c < 4; c++) a0[c] = a1[c] = _mm256_setzero_ps();
        for (int64_t o = g * G / 8; o < (g + 1) * G / 8; o++) {
            const uint32_t *w = wq + o * NB;
            _mm_prefetch((const char *)w + PF_BYTES, _MM_HINT_T0);
            _mm_prefetch((const char *)w + PF_BYTES + 64, _MM_HINT_T0);
            __m256i v[4];
            for (int c = 0; c < 4; c++) v[c] = _mm256_loadu_si256((const __m256i *)(w + 8 * c));
#pragma GCC unroll 8  // a constant i: its mask is an immediate, i == 7 no branch
            for (int i = 0; i < 8; i++) {
                const __m256 xb = _mm256_broadcast_ss(xq + 8 * o + i);
                for (int c = 0; c < 4; c++) {
                    if (i % 2) a1[c] = _mm256_fmadd_ps(xb, nibble(v[c], i), a1[c]);
                    else a0[c] = _mm256_fmadd_ps(xb, nibble(v[c], i), a0[c]);
                }
            }
        }
        float buf[2 * NB];
        const float *s = group_scales(sc, g, buf), *sz = s + NB;
        const __m256 sum = _mm256_broadcast_ss(xs + g);
        for (int c = 0; c < 4; c++) {
            tot[c] = _mm256_fmadd_ps(_mm256_add_ps(a0[c], a1[c]), _mm256_loadu_ps(s + 8 * c), tot[c]);
            tot[c] = _mm256_fnmadd_ps(sum, _mm256_loadu_ps(sz + 8 * c), tot[c]);
        }
    }
    for (int c = 0; c < 4; c++) _mm256_storeu_ps(out + 8 * c, tot[c]);
}

// Two rows (scaled, K apart) against a block: each widened nibble feeds both rows' FMAs.
static void dtile2(int64_t K, int64_t G, const float *xq, const uint32_t *wq, const float *sc, const float *xs,
                   float *out) {
    const int64_t groups = K / G;
    memset(out, 0, sizeof(float) * 2 * NB);
    for (int64_t g = 0; g < groups; g++) {
        __m256 acc[2][4];
        for (int r = 0; r < 2; r++)
            for (int c = 0; c < 4; c++) acc[r][c] = _mm256_setzero_ps();
        for (int64_t o = g * G / 8; o < (g + 1) * G / 8; o++) {
            const uint32_t *w = wq + o * NB;
            _mm_prefetch((const char *)w + PF_BYTES, _MM_HINT_T0);
            _mm_prefetch((const char *)w + PF_BYTES + 64, _MM_HINT_T0);
#pragma GCC unroll 8
            for (int i = 0; i < 8; i++) {
                const __m256 x0 = _mm256_broadcast_ss(xq + 8 * o + i), x1 = _mm256_broadcast_ss(xq + K + 8 * o + i);
                for (int c = 0; c < 4; c++) {
                    const __m256 q = nibble(_mm256_loadu_si256((const __m256i *)(w + 8 * c)), i);
                    acc[0][c] = _mm256_fmadd_ps(x0, q, acc[0][c]);
                    acc[1][c] = _mm256_fmadd_ps(x1, q, acc[1][c]);
                }
            }
        }
        float a[2 * NB], buf[2 * NB];
        for (int r = 0; r < 2; r++)
            for (int c = 0; c < 4; c++) _mm256_storeu_ps(a + r * NB + 8 * c, acc[r][c]);
        const float *s = group_scales(sc, g, buf);
        close_group(2, a, s, s + NB, xs + g, groups, out);
    }
}

// One group of a block widened to floats [G][NB] (the values q themselves).
static void widen_group(int64_t G, const uint32_t *wq, float *wg) {
    for (int64_t o = 0; o < G / 8; o++)
        for (int c = 0; c < 4; c++) {
            const __m256i v = _mm256_loadu_si256((const __m256i *)(wq + o * NB + 8 * c));
#pragma GCC unroll 8
            for (int i = 0; i < 8; i++) {
                const __m256i q = _mm256_and_si256(_mm256_srli_epi32(v, 4 * i), _mm256_set1_epi32(15));
                _mm256_storeu_ps(wg + (8 * o + i) * NB + 8 * c, _mm256_cvtepi32_ps(q));
            }
        }
}

// mr rows (stride ldx, at the group's first input) x 16 columns (half h of the block) of a widened group.
static inline __attribute__((always_inline)) void gtile(const int mr, int64_t ldx, int64_t G, const float *x,
                                                        const float *wg, float *acc) {
    __m256 a[MR][2];
    for (int r = 0; r < mr; r++) a[r][0] = a[r][1] = _mm256_setzero_ps();
    for (int64_t k = 0; k < G; k++) {
        const __m256 w0 = _mm256_loadu_ps(wg + k * NB), w1 = _mm256_loadu_ps(wg + k * NB + 8);
        for (int r = 0; r < mr; r++) {
            const __m256 xv = _mm256_broadcast_ss(x + r * ldx + k);
            a[r][0] = _mm256_fmadd_ps(xv, w0, a[r][0]);
            a[r][1] = _mm256_fmadd_ps(xv, w1, a[r][1]);
        }
    }
    for (int r = 0; r < mr; r++) {
        _mm256_storeu_ps(acc + r * NB, a[r][0]);
        _mm256_storeu_ps(acc + r * NB + 8, a[r][1]);
    }
}

static void gtile_any(int mr, int64_t ldx, int64_t G, const float *x, const float *wg, float *acc) {
    for (int h = 0; h < 2; h++) switch (mr) {  // a constant row count keeps every accumulator in a register
        case 1: gtile(1, ldx, G, x, wg + 16 * h, acc + 16 * h); break;
        case 2: gtile(2, ldx, G, x, wg + 16 * h, acc + 16 * h); break;
        case 3: gtile(3, ldx, G, x, wg + 16 * h, acc + 16 * h); break;
        case 4: gtile(4, ldx, G, x, wg + 16 * h, acc + 16 * h); break;
        case 5: gtile(5, ldx, G, x, wg + 16 * h, acc + 16 * h); break;
        default: gtile(6, ldx, G, x, wg + 16 * h, acc + 16 * h); break;
        }
}
#else
// Portable: the same arithmetic in plain loops (the compiler vectorises what it can).
static inline float nibble1(uint32_t v, int i) {
    return i == 7 ? (float)(v >> 28) : (float)(int32_t)(v & (15u << (4 * i)));
}

static void dtile1(int64_t K, int64_t G, const float *xq, const uint32_t *wq, const float *sc, const float *xs,
                   float *out) {
    const int64_t groups = K / G;
    memset(out, 0, sizeof(float) * NB);
    for (int64_t g = 0; g < groups; g++) {
        float a[NB] = {0}, buf[2 * NB];
        for (int64_t o = g * G / 8; o < (g + 1) * G / 8; o++)
            for (int i = 0; i < 8; i++)
                for (int j = 0; j < NB; j++) a[j] += xq[8 * o + i] * nibble1(wq[o * NB + j], i);
        const float *s = group_scales(sc, g, buf);
        close_group(1, a, s, s + NB, xs + g, groups, out);
    }
}

static void dtile2(int64_t K, int64_t G, const float *xq, const uint32_t *wq, const float *sc, const float *xs,
                   float *out) {
    dtile1(K, G, xq, wq, sc, xs, out);
    dtile1(K, G, xq + K, wq, sc, xs + K / G, out + NB);
}

static void widen_group(int64_t G, const uint32_t *wq, float *wg) {
    for (int64_t o = 0; o < G / 8; o++)
        for (int i = 0; i < 8; i++)
            for (int j = 0; j < NB; j++) wg[(8 * o + i) * NB + j] = (float)((wq[o * NB + j] >> (4 * i)) & 15);
}

static void gtile_any(int mr, int64_t ldx, int64_t G, const float *x, const float *wg, float *acc) {
    for (int r = 0; r < mr; r++) {
        float a[NB] = {0};
        for (int64_t k = 0; k < G; k++)
            for (int j = 0; j < NB; j++) a[j] += x[r * ldx + k] * wg[k * NB + j];
        memcpy(acc + r * NB, a, sizeof a);
    }
}
#endif

static void store_row(const float *o, const float *b, float *yr, int64_t nn) {
    for (int64_t j = 0; j < nn; j++) yr[j] = o[j] + (b ? b[j] : 0.0f);
}

// A fused gated MLP's 32 outputs from its unit's two blocks (the gate's sums og, the up's ou, each block's bias or
// NULL): silu(g) * u in float32, SiLU as g / (1 + exp(-g)) (silu.h: wbf16_linear_silu_mul's, the float32 torch code's
// formula).
static void store_silu_mul(const float *og, const float *ou, const float *bg, const float *bu, float *yr) {
    float g[NB], u[NB];
    for (int j = 0; j < NB; j++) {
        g[j] = og[j] + (bg ? bg[j] : 0.0f);
        u[j] = ou[j] + (bu ? bu[j] : 0.0f);
    }
    silu_mul_f32(g, u, yr, NB);
}

// Rows m .. m + rows of y from their sums, row r at o0 + r * NB (and the up block's at o1 + r * NB with silu_mul):
// `unit` counts blocks, or block pairs with silu_mul (y then N / 2 wide).
static void store_unit(const float *o0, const float *o1, int64_t rows, int64_t unit, int64_t N, const float *b,
                       float *y, int64_t m, const int silu_mul) {
    for (int64_t r = 0; r < rows; r++) {
        if (silu_mul) {
            const float *bg = b ? b + 2 * unit * NB : NULL, *bu = b ? b + (2 * unit + 1) * NB : NULL;
            store_silu_mul(o0 + r * NB, o1 + r * NB, bg, bu, y + (m + r) * (N / 2) + unit * NB);
        } else {
            const int64_t n0 = unit * NB;
            store_row(o0 + r * NB, b ? b + n0 : NULL, y + (m + r) * N + n0, N - n0 < NB ? N - n0 : NB);
        }
    }
}

// One or two rows (scaled, K apart) of the block at column block nb → out [rows][NB].
static void dtile_rows(int rows, int64_t K, int64_t G, const float *xq, const uint32_t *wq, const float *sc,
                       const float *xs, int64_t nb, float *out) {
    const uint32_t *wb = wq + nb * (K / 8) * NB;
    const float *sb = sc + nb * (K / G) * SC_GROUP;
    if (rows == 2)
        dtile2(K, G, xq, wb, sb, xs, out);
    else
        dtile1(K, G, xq, wb, sb, xs, out);
}

#define RC 64  // rows a pass of the direct entry: their scaled copies [RC][K] (a prefill's rows at once would keep
                // a buffer of M x K floats in the calling thread)

// The direct entry's work: silu_mul, a gated MLP's [gate; up] weight with its rows interleaved in blocks of 32
// (engine.kernels.gemm.interleave_halves; N % 64 == 0), so that blocks 2u and 2u + 1 are unit u's gate and up
// columns 32u ..: y [M][N / 2] = silu(gate) * up. Returns 0, or -1 as w4f32_linear.
static int direct(int64_t M, int64_t N, int64_t K, int64_t G, const float *x, const uint32_t *wq, const float *sc,
                  const float *b, float *y, int nthreads, const int silu_mul) {
    const int64_t nblocks = (N + NB - 1) / NB, groups = K / G, per = silu_mul ? 2 : 1, units = nblocks / per;
    if (M <= 0) return 0;
    float *xs = floats(&sums_buf, M * groups), *xq = floats(&scaled_buf, (M < RC ? M : RC) * K);
    if (!xs || !xq) return -1;
    group_sums(M, K, G, x, xs, nthreads);
    for (int64_t c0 = 0; c0 < M; c0 += RC) {
        const int64_t mc = M - c0 < RC ? M - c0 : RC;
        scale_rows(mc, K, x + c0 * K, xq);
#pragma omp parallel for schedule(static) num_threads(nthreads)
        for (int64_t u = 0; u < units; u++) {
            float out[2][2 * NB];
            for (int64_t r0 = 0; r0 < mc; r0 += 2) {
                const int rows = mc - r0 == 1 ? 1 : 2;
                const int64_t m = c0 + r0;  // the row in x and y
                for (int64_t h = 0; h < per; h++)
                    dtile_rows(rows, K, G, xq + r0 * K, wq, sc, xs + m * groups, u * per + h, out[h]);
                store_unit(out[0], out[1], rows, u, N, b, y, m, silu_mul);
            }
        }
    }
    return 0;
}

// Returns 0, or -1 where the rows' group sums or scaled copies could not be had (y untouched).
int w4f32_linear(int64_t M, int64_t N, int64_t K, int64_t G, const float *x, const uint32_t *wq, const float *sc,
                 const float *b, float *y, int nthreads) {
    return direct(M, N, K, G, x, wq, sc, b, y, nthreads, 0);
}

// The same over a gated MLP's interleaved [gate; up] weight (N % 64 == 0, b interleaved likewise): y [M][N / 2] =
// silu(gate) * up. WHY: unfused, a decode program stopped for Python at every gated MLP to run the act in torch
// between two C calls (one stop a layer on AVX2 CPUs), and the [M][2I] projection went to memory and back.
int w4f32_linear_silu_mul(int64_t M, int64_t N, int64_t K, int64_t G, const float *x, const uint32_t *wq,
                          const float *sc, const float *b, float *y, int nthreads) {
    return direct(M, N, K, G, x, wq, sc, b, y, nthreads, 1);
}

// mc rows of x (row stride K, from row 0) through column block nb, one group at a time widened into wg: the rows'
// totals into out [mc][NB] (xs: their group sums, [mc][K / G]).
static void panel_rows(int64_t mc, int64_t K, int64_t G, const float *x, const uint32_t *wq, const float *sc,
                       const float *xs, int64_t nb, float *wg, float *out) {
    const int64_t groups = K / G;
    const uint32_t *wb = wq + nb * (K / 8) * NB;
    const float *sb = sc + nb * groups * SC_GROUP;
    float acc[MR * NB], buf[2 * NB];
    memset(out, 0, sizeof(float) * (size_t)(mc * NB));
    for (int64_t g = 0; g < groups; g++) {
        widen_group(G, wb + g * (G / 8) * NB, wg);
#if PANEL_PF
        // WHY: the panel reads a group's words (G / 2 * NB bytes: 2 KB at G = 128) in a burst, then runs its tiles
        // for a while: short runs the hardware prefetchers do not run ahead of, so each group began with misses to
        // memory. The next group's words (past the last group: the next block's first, which this thread takes
        // next) and scales are asked for now, while this group's FMAs run. A prefetch past the end never faults.
        const char *next = (const char *)(wb + (g + 1) * (G / 8) * NB);
        for (int64_t o = 0; o < (G / 8) * NB * 4; o += 64) __builtin_prefetch(next + o, 0, 3);
        __builtin_prefetch(sb + (g + 1) * SC_GROUP, 0, 3);
#endif
        const float *s = group_scales(sb, g, buf);
        for (int64_t r = 0; r < mc; r += MR) {
            const int mr = mc - r < MR ? (int)(mc - r) : MR;
            gtile_any(mr, K, G, x + r * K + g * G, wg, acc);
            close_group(mr, acc, s, s + NB, xs + r * groups + g, groups, out + r * NB);
        }
    }
}

// The panel entry's work (silu_mul as direct's). Returns 0, or -1 where a buffer could not be had.
static int panel(int64_t M, int64_t N, int64_t K, int64_t G, const float *x, const uint32_t *wq, const float *sc,
                 const float *b, float *y, int nthreads, const int silu_mul) {
    const int64_t nblocks = (N + NB - 1) / NB, groups = K / G, per = silu_mul ? 2 : 1, units = nblocks / per;
    if (M <= 0) return 0;
    float *xs = floats(&sums_buf, M * groups);
    if (!xs) return -1;
    group_sums(M, K, G, x, xs, nthreads);
    int failed = 0;
#pragma omp parallel num_threads(nthreads) reduction(| : failed)
    {
        float *wg = grow_aligned(&group_buf, sizeof(float) * (size_t)(G * NB));
        failed = wg == NULL;
        float out[2][MC * NB];
        // passes of MC rows outside, the column units shared out inside: a pass's rows stay in L2 while every unit
        // goes by. With the units outside, each unit read all of x again from L3 and wrote y 128 bytes a row
        // across the whole output: a 4096-row prefill of Qwen2-0.5B's gate/up took 595 ms against 496 on a Zen 3
        // (2026-12-07; float32 matmul 499 there).
        for (int64_t m0 = 0; m0 < M; m0 += MC) {
            const int64_t mc = M - m0 < MC ? M - m0 : MC;
#pragma omp for schedule(static)
            for (int64_t u = 0; u < units; u++) {
                if (!wg) continue;
                for (int64_t h = 0; h < per; h++)
                    panel_rows(mc, K, G, x + m0 * K, wq, sc, xs + m0 * groups, u * per + h, wg, out[h]);
                store_unit(out[0], out[1], mc, u, N, b, y, m0, silu_mul);
            }
        }
    }
    return failed ? -1 : 0;
}

// Returns 0, or -1 where a buffer could not be had (y is then incomplete).
int w4f32_linear_panel(int64_t M, int64_t N, int64_t K, int64_t G, const float *x, const uint32_t *wq,
                       const float *sc, const float *b, float *y, int nthreads) {
    return panel(M, N, K, G, x, wq, sc, b, y, nthreads, 0);
}

// The panel entry over a gated MLP's interleaved [gate; up] weight, as w4f32_linear_silu_mul.
int w4f32_linear_panel_silu_mul(int64_t M, int64_t N, int64_t K, int64_t G, const float *x, const uint32_t *wq,
                                const float *sc, const float *b, float *y, int nthreads) {
    return panel(M, N, K, G, x, wq, sc, b, y, nthreads, 1);
}

#define DIRECT_ROWS 2  // a grouped call's layer with at most this many rows runs the direct tiles, one with more the
                       // panel's (decode gives a MoE layer's experts one row each at batch 1, a few at batch 32)

typedef struct {
    const int64_t *counts, *first, *layer;
    int64_t N, K, G;
    const float *x, *xs;
    const uint32_t *const *wq;
    const float *const *sc;
    float *y;
    int silu_mul;
    _Atomic int *failed;
} w4fgroup_t;

static __thread thread_buffer task_scaled_buf;

// One task of w4f32_grouped: a layer's rows (piece p) through one unit (a column block, or with silu_mul a block
// pair): a layer of at most DIRECT_ROWS rows by the direct tiles over its rows scaled here, else by panels.
static void w4fgroup_task(const void *ctx, int64_t p, int64_t u, int64_t end) {
    (void)end;
    const w4fgroup_t *g = ctx;
    const int64_t e = g->layer[p], K = g->K, G = g->G, groups = K / G, per = g->silu_mul ? 2 : 1;
    const int64_t r0 = g->first[p], rows = g->counts[e];
    const uint32_t *wq = g->wq[e];
    const float *sc = g->sc[e];
    if (rows <= DIRECT_ROWS) {
        float *xq = floats(&task_scaled_buf, DIRECT_ROWS * K), out[2][2 * NB];
        if (!xq) {
            *g->failed = 1;
            return;
        }
        scale_rows(rows, K, g->x + r0 * K, xq);
        for (int64_t h = 0; h < per; h++) dtile_rows((int)rows, K, G, xq, wq, sc, g->xs + r0 * groups, u * per + h, out[h]);
        store_unit(out[0], out[1], rows, u, g->N, NULL, g->y, r0, g->silu_mul);
        return;
    }
    float *wg = grow_aligned(&group_buf, sizeof(float) * (size_t)(G * NB));
    if (!wg) {
        *g->failed = 1;
        return;
    }
    float out[2][MC * NB];
    for (int64_t m0 = r0; m0 < r0 + rows; m0 += MC) {
        const int64_t mc = r0 + rows - m0 < MC ? r0 + rows - m0 : MC;
        for (int64_t h = 0; h < per; h++)
            panel_rows(mc, K, G, g->x + m0 * K, wq, sc, g->xs + m0 * groups, u * per + h, wg, out[h]);
        store_unit(out[0], out[1], mc, u, g->N, NULL, g->y, m0, g->silu_mul);
    }
}

// E W4A16 linear layers of one shape (no bias) in one call, float32 rows in and out (w4mm_grouped's arguments):
// layer e takes counts[e] consecutive rows of x and its packed weight (words wq[e], scales sc[e]); y gets its rows
// in the same order, N wide, or N / 2 with silu_mul (the weights' rows interleaved as w4f32_linear_silu_mul's).
// The same bits as the linear entries over each layer's rows. WHY: a MoE layer's float32 W4A16 experts ran a call
// each (a Python round trip and a parallel region per expert and projection), which also kept DeepSeek's decode
// steps out of decode programs on CPUs without bf16. Returns 0, or -1 without memory (y then incomplete).
int w4f32_grouped(int64_t E, const int64_t *counts, int64_t N, int64_t K, int64_t G, const float *x,
                  const uint32_t *const *wq, const float *const *sc, float *y, int nthreads, int silu_mul) {
    const int64_t nblocks = (N + NB - 1) / NB, groups = K / G;
    int64_t first[E > 0 ? E : 1], layer[E > 0 ? E : 1], M;  // each layer with rows: its first row, its index
    const int64_t P = grouped_pieces(E, counts, first, layer, &M);
    if (M <= 0) return 0;
    float *xs = floats(&sums_buf, M * groups);
    if (!xs) return -1;
    group_sums(M, K, G, x, xs, nthreads);
    _Atomic int failed = 0;
    const w4fgroup_t g = {counts, first, layer, N, K, G, x, xs, wq, sc, y, silu_mul, &failed};
    grouped_tasks(P, silu_mul ? nblocks / 2 : nblocks, nthreads, 2, w4fgroup_task, &g);
    return atomic_load(&failed) ? -1 : 0;
}
