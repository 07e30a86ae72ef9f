// bf16mm's micro-kernel: rows of bf16 x against one packed 64-column block of bf16 weights (the layout in
// bf16mm.c), fp32 accumulation, bf16 out (or silu(gate) * up). Shared by bf16mm.c and w4mm.c (which widens int4
// weights a group at a time into this layout and runs `step` over them). PF_TILES: see below.
#ifndef BF16MM_BLOCK_H
#define BF16MM_BLOCK_H
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#include "avx512_math.h"
#ifdef FMA32
#include "thread_buffer.h"
#endif
#define NB 64
#define MR 6
// Rows per pass over the weights: large batches (prefill) go through in chunks whose activations stay in L2
// while every column block streams past them; measured best at 48-384 on Zen 4, 1.1x faster than one pass.
#define MC 192
// Row tiles a block may have for the next block to be prefetched by software (see block()); with more, the block's
// arithmetic outlasts the stream anyway, and with one the hardware prefetchers follow the single pass. 8 was
// measured on a Zen 4 only: the library is also built with -DPF_TILES=1 (no software prefetch), and the GEMM
// selection times both on the machine it runs on (engine.kernels.bind).
#ifndef PF_TILES
#define PF_TILES 8
#endif

// Bytes ahead of the weights being read that a block's only row tile (decode's 1-6 rows) asks for; past the
// block's end that is the next block's, which the same thread takes next. Its rows are too few for the next-block
// prefetch below. Measured on a 2-core AMX Xeon (model 167), Qwen2-0.5B's LM head streamed from memory: 11.7 ms at
// one row without, 8.7 / 8.6 / 9.1 ms at 1 / 2 / 4 KB ahead; at 4 rows 16.7 against 10.2 (2 KB). Set there only:
// the library built without software prefetch (-DPF_TILES=1 -DPF_AHEAD=0) is timed beside it.
#ifndef PF_AHEAD
#define PF_AHEAD 2048
#endif

// Row r's k-pair kp of x as one 32-bit lane; an odd K's last pair holds a zero, never the next row's value
// (which the zero weight padding would turn into NaN if it were inf).
static inline int32_t pair_at(const uint16_t *xr, int64_t kp, int64_t K) {
    int32_t v = 0;
    memcpy(&v, xr + 2 * kp, 2 * kp + 1 < K ? 4 : 2);
    return v;
}

// One k-pair of a 64-column block: its weights, 4 vectors of 16 columns x 2 k.
static inline __attribute__((always_inline)) void load_pair(const uint16_t *wk, __m512bh w[4]) {
    for (int j = 0; j < 4; j++) w[j] = (__m512bh)_mm512_loadu_si512((const void *)(wk + 32 * j));
}

// One row's 64 sums += its k-pair xv (broadcast) . the block's k-pair w.
static inline __attribute__((always_inline)) void dot_row(__m512 acc[4], __m512bh xv, const __m512bh w[4]) {
    for (int j = 0; j < 4; j++) acc[j] = _mm512_dpbf16_ps(acc[j], xv, w[j]);
}

static inline __attribute__((always_inline)) void step(const int mr, __m512 acc[MR][4], const uint16_t *wk,
                                                       const int32_t *p) {
    __m512bh w[4];
    load_pair(wk, w);
    for (int r = 0; r < mr; r++) dot_row(acc[r], (__m512bh)_mm512_set1_epi32(p[r]), w);
}

typedef int32_t __attribute__((may_alias, aligned(1))) pair_t;  // a k-pair of bf16, anywhere in a row

// A tile's accumulators start from the bias (the block's 64 columns, zeros without one).
static inline __attribute__((always_inline)) void acc_from_bias(const int mr, __m512 acc[MR][4], const float *bias) {
    for (int r = 0; r < mr; r++)
        for (int j = 0; j < 4; j++) acc[r][j] = _mm512_loadu_ps(bias + 16 * j);
}

static inline __attribute__((always_inline)) void store_acc(const int mr, __m512 acc[MR][4], float *out) {
    for (int r = 0; r < mr; r++)
        for (int j = 0; j < 4; j++) _mm512_storeu_ps(out + r * NB + j * 16, acc[r][j]);
}

// At a tile's k-pair wk: its share of the next block (pf up to pf_end, pf_step lines a pair; returns pf advanced)
// and, for a block's only tile (ahead), the weights PF_AHEAD bytes on.
static inline __attribute__((always_inline)) const char *prefetch_pair(const char *pf, const char *pf_end,
                                                                       const int64_t pf_step, const int ahead,
                                                                       const uint16_t *wk) {
    for (int64_t l = 0; l < pf_step && pf < pf_end; l++, pf += 64) _mm_prefetch(pf, _MM_HINT_T1);
    if (PF_AHEAD > 0 && ahead)
        for (int l = 0; l < 4; l++) _mm_prefetch((const char *)wk + PF_AHEAD + 64 * l, _MM_HINT_T0);
    return pf;
}

// pf, pf_end: the part of the next column block this tile asks for, spread over its k steps (see block()).
// ahead: this tile is its block's only one, and asks for the weights PF_AHEAD bytes on.
static inline __attribute__((always_inline)) void tile(const int mr, int64_t K, const uint16_t *x,
                                                       const uint16_t *w, const float *bias, float *out,
                                                       const char *pf, const char *pf_end, const int64_t pf_step,
                                                       const int ahead) {
    __m512 acc[MR][4];
    acc_from_bias(mr, acc, bias);
    // NOTE: rows 0-2 and 3-5 as two pointers and one stride, which the CPU's addressing adds for free: six row
    // pointers (with the prefetch's) spilled, and each pair went through a general register to its broadcast
    const uint16_t *x0 = x, *x3 = x + (mr > 3 ? 3 : 0) * K;
    const int64_t full = K / 2;
    for (int64_t kp = 0; kp < full; kp++) {
        pf = prefetch_pair(pf, pf_end, pf_step, ahead, w + kp * 2 * NB);
        __m512bh wk[4];
        load_pair(w + kp * 2 * NB, wk);
        for (int r = 0; r < mr; r++) {
            const uint16_t *xr = (r < 3 ? x0 + r * K : x3 + (r - 3) * K) + 2 * kp;
            dot_row(acc[r], (__m512bh)_mm512_set1_epi32(*(const pair_t *)xr), wk);
        }
    }
    if (K & 1) {
        int32_t p[MR];
        for (int r = 0; r < mr; r++) p[r] = pair_at(x + r * K, full, K);
        step(mr, acc, w + full * 2 * NB, p);
    }
    store_acc(mr, acc, out);
}

#ifdef FMA32
// Every row's 64 sums += its float32 x at k (rows 0-2 from x0, 3-5 from x3, stride K) times the widened weights wv.
static inline __attribute__((always_inline)) void fma_rows(const int mr, __m512 acc[MR][4], const float *x0,
                                                           const float *x3, int64_t K, int64_t k, const __m512 wv[4]) {
    for (int r = 0; r < mr; r++) {
        const __m512 xv = _mm512_set1_ps((r < 3 ? x0 + r * K : x3 + (r - 3) * K)[k]);
        for (int j = 0; j < 4; j++) acc[r][j] = _mm512_fmadd_ps(xv, wv[j], acc[r][j]);
    }
}

// The same tile in float32 FMAs (bf16mm.c built with -DFMA32, "bf16fma"): each k-pair's weights widened in
// registers (the even k a shift, the odd one a mask) and x's rows read as float32 (tile_any widens each row tile's
// rows once). WHY: the products are those VDPBF16PS makes, summed in float32, but where a CPU runs VDPBF16PS at
// half an instruction a cycle and two FMAs a cycle (a Xeon model 207 whose VM hides AMX: 83 against 172 GFLOP/s a
// core, 2026-12-07) this does ~1.7x the arithmetic a cycle; the GEMM selection times it beside the VDPBF16PS build
// on every CPU, sharing its packed weights.
static inline __attribute__((always_inline)) void tile_f(const int mr, int64_t K, const float *x,
                                                         const uint16_t *w, const float *bias, float *out,
                                                         const char *pf, const char *pf_end, const int64_t pf_step,
                                                         const int ahead) {
    __m512 acc[MR][4];
    acc_from_bias(mr, acc, bias);
    const __m512i odd = _mm512_set1_epi32((int)0xFFFF0000u);
    const float *x0 = x, *x3 = x + (mr > 3 ? 3 : 0) * K;  // as tile()'s NOTE says
    const int64_t full = K / 2;
    for (int64_t kp = 0; kp < full; kp++) {
        pf = prefetch_pair(pf, pf_end, pf_step, ahead, w + kp * 2 * NB);
        const uint16_t *wk = w + kp * 2 * NB;
        __m512 wv[4];  // the even k, then (loaded again from L1: four registers fewer) the odd one
        for (int j = 0; j < 4; j++)
            wv[j] = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_loadu_si512((const void *)(wk + 32 * j)), 16));
        fma_rows(mr, acc, x0, x3, K, 2 * kp, wv);
        for (int j = 0; j < 4; j++)
            wv[j] = _mm512_castsi512_ps(_mm512_and_si512(_mm512_loadu_si512((const void *)(wk + 32 * j)), odd));
        fma_rows(mr, acc, x0, x3, K, 2 * kp + 1, wv);
    }
    if (K & 1) {  // the last pair's odd weights are the zero padding: its even half only
        const uint16_t *wk = w + full * 2 * NB;
        for (int j = 0; j < 4; j++) {
            const __m512 wj = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_loadu_si512((const void *)(wk + 32 * j)), 16));
            for (int r = 0; r < mr; r++) acc[r][j] = _mm512_fmadd_ps(_mm512_set1_ps(x[r * K + K - 1]), wj, acc[r][j]);
        }
    }
    store_acc(mr, acc, out);
}

// Rows of bf16 x as float32 into xf (n values).
static inline void widen_rows(const uint16_t *x, float *xf, int64_t n) {
    int64_t i = 0;
    for (; i + 16 <= n; i += 16)
        _mm512_storeu_ps(xf + i, _mm512_castsi512_ps(_mm512_slli_epi32(
                                     _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(x + i))), 16)));
    for (; i < n; i++) {
        const uint32_t u = (uint32_t)x[i] << 16;
        memcpy(xf + i, &u, 4);
    }
}
#endif

static void tile_any(int mr, int64_t K, const uint16_t *x, const uint16_t *w, const float *bias, float *out,
                     const char *pf, const char *pf_end, int64_t pf_step, int ahead) {
#ifdef FMA32
    static __thread thread_buffer xf_buf;
    float *xf = grow_aligned(&xf_buf, sizeof(float) * (size_t)(mr * K));
    if (xf) {  // (without the memory, the VDPBF16PS tile below: the same products)
        widen_rows(x, xf, mr * K);
        switch (mr) {
        case 1: tile_f(1, K, xf, w, bias, out, pf, pf_end, pf_step, ahead); break;
        case 2: tile_f(2, K, xf, w, bias, out, pf, pf_end, pf_step, ahead); break;
        case 3: tile_f(3, K, xf, w, bias, out, pf, pf_end, pf_step, ahead); break;
        case 4: tile_f(4, K, xf, w, bias, out, pf, pf_end, pf_step, ahead); break;
        case 5: tile_f(5, K, xf, w, bias, out, pf, pf_end, pf_step, ahead); break;
        default: tile_f(6, K, xf, w, bias, out, pf, pf_end, pf_step, ahead); break;
        }
        return;
    }
#endif
    switch (mr) {  // a constant row count lets the compiler keep every accumulator in a register
    case 1: tile(1, K, x, w, bias, out, pf, pf_end, pf_step, ahead); break;
    case 2: tile(2, K, x, w, bias, out, pf, pf_end, pf_step, ahead); break;
    case 3: tile(3, K, x, w, bias, out, pf, pf_end, pf_step, ahead); break;
    case 4: tile(4, K, x, w, bias, out, pf, pf_end, pf_step, ahead); break;
    case 5: tile(5, K, x, w, bias, out, pf, pf_end, pf_step, ahead); break;
    default: tile(6, K, x, w, bias, out, pf, pf_end, pf_step, ahead); break;
    }
}

static inline uint16_t to_bf16(float f) {  // round to nearest even, as VCVTNEPS2BF16 does
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7FFFFFFFu) > 0x7F800000u) return (uint16_t)((u >> 16) | 0x40);  // NaN stays a (quiet) NaN
    return (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1)) >> 16);
}

// Column block nb (of nblocks) for rows [m0, m1) of x [.][K] through the block's packed weights wb, into y (rows
// N wide, N / 2 with silu_mul); at most MC rows, so they stay in L2 while the block's weights go past them.
static void block(int64_t m0, int64_t m1, int64_t nb, int64_t nblocks, int64_t N, int64_t K, const uint16_t *x,
                  const uint16_t *wb, const uint16_t *b, uint16_t *y, const int silu_mul) {
    const int64_t pairs = (K + 1) / 2;
    const int64_t n0 = nb * NB, nn = N - n0 < NB ? N - n0 : NB;
    float out[MR * NB], bias[NB] = {0};
    if (b)
        for (int64_t j = 0; j < nn; j++) {
            const uint32_t u = (uint32_t)b[n0 + j] << 16;
            memcpy(&bias[j], &u, 4);
        }
    // NOTE: the first row tile of a block reads its weights from memory and the others from L2, where the
    // hardware prefetchers see no misses to follow: the next block would then start cold and the stream and the
    // arithmetic take turns. Each tile asks for its share of the next block instead, spread over its k steps, so
    // that block streams in while this one is computed. Measured on a 2-core Zen 4 over 200 MB of weights
    // (SmolLM2 and Qwen2-0.5B shapes), 8-48 rows: 0.84-0.98x the time without.
    const int64_t tiles = (m1 - m0 + MR - 1) / MR, lines = pairs * 2 * NB * 2 / 64;
    const int64_t share = (lines + tiles - 1) / tiles, pf_step = (share + pairs - 1) / pairs;
    const char *next = (const char *)(wb + pairs * 2 * NB);
    const char *next_end = nb + 1 < nblocks && tiles > 1 && tiles <= PF_TILES ? next + lines * 64 : next;
    for (int64_t r0 = m0; r0 < m1; r0 += MR) {
        const int mr = m1 - r0 < MR ? (int)(m1 - r0) : MR;
        const char *pf = next + (r0 - m0) / MR * share * 64;
        const char *pf_end = pf + share * 64 < next_end ? pf + share * 64 : next_end;
        tile_any(mr, K, x + r0 * K, wb, bias, out, pf, pf_end, pf_step, tiles == 1);
        for (int r = 0; r < mr; r++) {
            const float *o = out + r * NB;
            if (silu_mul) {  // N % 64 == 0 (checked by the caller): whole blocks, N / 2 outputs a row
                store_silu_mul_block(o, y + (r0 + r) * (N / 2) + n0 / 2);
                continue;
            }
            uint16_t *yr = y + (r0 + r) * N + n0;
            if (nn == NB) {
                const __m512bh lo = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(o + 16), _mm512_loadu_ps(o));
                const __m512bh hi = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(o + 48), _mm512_loadu_ps(o + 32));
                _mm512_storeu_si512((void *)yr, (__m512i)lo);
                _mm512_storeu_si512((void *)(yr + 32), (__m512i)hi);
            } else {
                for (int64_t j = 0; j < nn; j++) yr[j] = to_bf16(o[j]);
            }
        }
    }
}

#endif
