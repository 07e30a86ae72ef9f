// W8A8 linear layers for CPUs with AVX2 but no VNNI (Zen 2/3, Haswell to Cascade Lake without it): y[M][N] =
// quant(x)[M][K] . W^T * xs * ws (+ b), x, b and y float32, W int8 [N][K] with a float scale per output channel,
// x quantized here per row exactly as compressed-tensors defines it (engine.quant.weights.quantize_tokens: the
// largest magnitude maps to 127.5 steps, round half to even, clamp to [-128, 127]).
//
// WHY: without VNNI, oneDNN's int8 GEMM saturates (engine.quant.paths._check_exact drops it) and torch._int_mm
// ran a W8A8 Qwen2-0.5B at 209 ms a token on a Zen 3 (2026-12-04), 4x the float model's time.
//
// The products are exact: both sides are widened to int16 (the weight by VPMOVSXBW as it is loaded, the row once
// when it is quantized) and VPMADDWD adds pairs of products into int32. (VPMADDUBSW, the u8 x s8 instruction,
// sums its pairs into int16 with saturation: |x| x sign(x)·w is exact only without weights of -128, which
// checkpoints have, and saves nothing here: 5 instructions per 32 products against 6.)
//
// Two entry points, which the engine times against each other (and oneDNN, torch._int_mm) per shape and batch
// class:
// - i8avx2_linear: each 4-column tile widens its weight rows as it loads them, for every row of x. Decode.
// - i8avx2_linear_panel: a 16-column block's weights widened to int16 once per 512 inputs into a buffer, then
//   2-row x 4-column tiles over every row (the widening shared by all the rows). Batches.
//
// Each has a fused gated-MLP twin (i8avx2_linear_silu_mul, i8avx2_linear_panel_silu_mul: silu(gate) * up in the
// epilogue), and i8avx2_grouped runs a MoE layer's experts in one call.
//
// Packed layout (i8avx2.py packs): W row-major [N4][K32] int8, N rounded up to 4 and K to 32 with zeros.
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "grouped_tasks.h"
#include "silu.h"
#include "thread_buffer.h"

#ifndef __AVX2__
#error "this kernel needs AVX2"
#endif
#include <immintrin.h>

#define NC 4  // columns a tile
#ifndef PF_TILES
#define PF_TILES 2  // software prefetch this many tiles ahead (a tile's rows are too short for the hardware's;
                    // set on a Zen 3: a build with 0 is timed beside this one, engine.quant.paths)
#endif

// One row of x → its quantized values as int16 (K32, zero-padded) and scale.
static void quantize_row(int64_t K, int64_t K32, const float *x, int16_t *xq, float *xs) {
    float amax = 0;
    for (int64_t k = 0; k < K; k++) amax = fmaxf(amax, fabsf(x[k]));
    float scale = amax / 127.5f;
    if (scale < 1.17549435e-38f) scale = 1.17549435e-38f;  // torch.finfo(float32).tiny, as the reference
    for (int64_t k = 0; k < K; k++) {
        float q = nearbyintf(x[k] / scale);  // the default rounding: half to even
        xq[k] = (int16_t)(q < -128.f ? -128.f : (q > 127.f ? 127.f : q));
    }
    memset(xq + K, 0, sizeof(int16_t) * (size_t)(K32 - K));
    *xs = scale;
}

// The int32 sums of one quantized row against NC weight rows (stride K32).
static inline __attribute__((always_inline)) __m128i dot4(int64_t K32, const int16_t *xq, const int8_t *w) {
    __m256i acc[NC];
    for (int c = 0; c < NC; c++) acc[c] = _mm256_setzero_si256();
    const char *ahead = (const char *)(w + PF_TILES * NC * K32);  // the tile PF_TILES on, at the same pace
    for (int64_t k = 0; k < K32; k += 32) {
        _mm_prefetch(ahead + k * NC, _MM_HINT_T0);
        _mm_prefetch(ahead + k * NC + 64, _MM_HINT_T0);
        const __m256i x0 = _mm256_loadu_si256((const __m256i *)(xq + k));
        const __m256i x1 = _mm256_loadu_si256((const __m256i *)(xq + k + 16));
        for (int c = 0; c < NC; c++) {
            const __m256i w0 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(w + c * K32 + k)));
            const __m256i w1 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(w + c * K32 + k + 16)));
            acc[c] = _mm256_add_epi32(acc[c], _mm256_add_epi32(_mm256_madd_epi16(x0, w0), _mm256_madd_epi16(x1, w1)));
        }
    }
    // [c0 c1 c2 c3] per 128-bit half after two rounds of pairwise sums, then the halves added
    const __m256i h = _mm256_hadd_epi32(_mm256_hadd_epi32(acc[0], acc[1]), _mm256_hadd_epi32(acc[2], acc[3]));
    return _mm_add_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1));
}

static __thread thread_buffer xq_buf, xs_buf, panel_buf;  // the quantized rows and their scales; a widened panel

// Quantize M rows into the calling thread's buffers; 0, or -1 without memory.
static int quantize_rows(int64_t M, int64_t K, int64_t K32, const float *x, int16_t **xq, float **xs, int nthreads) {
    *xq = grow(&xq_buf, sizeof(int16_t) * (size_t)(M * K32));
    *xs = grow(&xs_buf, sizeof(float) * (size_t)M);
    if (!*xq || !*xs) return -1;
    int16_t *q = *xq;
    float *s = *xs;
#pragma omp parallel for schedule(static) num_threads(nthreads) if (M > 1)
    for (int64_t m = 0; m < M; m++) quantize_row(K, K32, x + m * K, q + m * K32, s + m);
    return 0;
}

// y[n0 .. n0 + nn) of one row from its 4 columns' int32 sums: (sum * xs) * ws + b, the last two in one FMA.
// WHY explicit: gcc's default -ffp-contract=fast fused the multiply and add in some inlined copies of this and not
// in others (the fused decode entry's), so entries that must agree bit for bit differed in the last bit.
static inline void store4(__m128i sums, float xs, const float *ws, const float *b, float *y, int64_t nn) {
    const __m128 s = _mm_loadu_ps(ws), bias = b ? _mm_loadu_ps(b) : _mm_setzero_ps();
    const __m128 scaled = _mm_mul_ps(_mm_cvtepi32_ps(sums), _mm_set1_ps(xs));
#ifdef __FMA__
    const __m128 out = _mm_fmadd_ps(scaled, s, bias);
#else  // nothing to contract either
    const __m128 out = _mm_add_ps(_mm_mul_ps(scaled, s), bias);
#endif
    if (nn >= NC) {
        _mm_storeu_ps(y, out);
    } else {
        float o[NC];
        _mm_storeu_ps(o, out);
        memcpy(y, o, sizeof(float) * (size_t)nn);
    }
}

// mr rows (xq stride K32, scales xs) through nt 4-column tiles whose weight rows start at w (ws, b at the same
// column) → out (row stride ldo), nn columns of them kept (store4's). Tile after tile: a tile's 4 weight rows stay
// in L1/L2 for every row after the first.
static inline void tiles_rows(int64_t mr, int64_t K32, const int16_t *xq, const float *xs, const int8_t *w,
                              const float *ws, const float *b, int64_t nt, int64_t nn, float *out, int64_t ldo) {
    for (int64_t t = 0; t < nt; t++)
        for (int64_t m = 0; m < mr; m++)
            store4(dot4(K32, xq + m * K32, w + t * NC * K32), xs[m], ws + t * NC, b ? b + t * NC : NULL,
                   out + m * ldo + t * NC, nn - t * NC);
}

// ws, b: float [N4] (b may be NULL). Returns 0, or -1 without memory for the quantized rows (y untouched).
int i8avx2_linear(int64_t M, int64_t N, int64_t K, const float *x, const int8_t *w, const float *ws,
                  const float *b, float *y, int nthreads) {
    const int64_t K32 = (K + 31) / 32 * 32, tiles = (N + NC - 1) / NC;
    if (M <= 0) return 0;
    int16_t *xq;
    float *xs;
    if (quantize_rows(M, K, K32, x, &xq, &xs, nthreads)) return -1;
#pragma omp parallel for schedule(static) num_threads(nthreads)
    for (int64_t t = 0; t < tiles; t++) {
        const int64_t n0 = t * NC, nn = N - n0;
        const int8_t *wt = w + n0 * K32;
        for (int64_t m = 0; m < M; m++)  // the tile's 4 weight rows stay in L1/L2 for every row after the first
            store4(dot4(K32, xq + m * K32, wt), xs[m], ws + n0, b ? b + n0 : NULL, y + m * N + n0, nn);
    }
    return 0;
}

#define PB 16   // columns a panel block (PB / NC column tiles)
#define PR 2    // rows a panel tile: 2 x 4 accumulators, 2 rows, a weight vector and VPMADDWD's products in registers
// WHY 2: 3 rows x 4 columns needs all 16 registers and one more for the products; gcc kept 8 of the 12 accumulators
// on the stack (a load and a store each per step). On a Zen 3 (2026-12-07) 2 rows ran Qwen2-0.5B's QKV 1.7x faster
// at 32 and 512 rows (140-150 GFLOP/s, float32 GEMM's rate there), `python -m benchmarks.quant_gemm --scheme w8a8`
// (24 layers from memory) 201-214 → 165 ms at 32 rows and 1,559-1,566 → 1,291 at 256.
#define PK 512  // inputs a panel chunk: 16 x 512 int16 weights (16 KiB) stay in L1 for every row
#define PM 96   // rows a pass: their int32 sums [PM][PB] stay in L1 while the chunks go by

// mr rows (stride ldx) x nt 4-column tiles of a widened chunk [PB][PK] (kc inputs), added to sums [mr][PB].
static inline __attribute__((always_inline)) void ptile(const int mr, int nt, int64_t kc, int64_t ldx,
                                                        const int16_t *x, const int16_t *wp, int32_t *sums) {
    for (int t = 0; t < nt; t++) {
        __m256i acc[PR][NC];
        for (int r = 0; r < mr; r++)
            for (int c = 0; c < NC; c++) acc[r][c] = _mm256_setzero_si256();
        const int16_t *wt = wp + t * NC * PK;
        for (int64_t k = 0; k < kc; k += 16) {
            __m256i xv[PR];
            for (int r = 0; r < mr; r++) xv[r] = _mm256_loadu_si256((const __m256i *)(x + r * ldx + k));
            for (int c = 0; c < NC; c++) {
                const __m256i wv = _mm256_load_si256((const __m256i *)(wt + c * PK + k));
                for (int r = 0; r < mr; r++) acc[r][c] = _mm256_add_epi32(acc[r][c], _mm256_madd_epi16(xv[r], wv));
            }
        }
        for (int r = 0; r < mr; r++) {
            const __m256i h = _mm256_hadd_epi32(_mm256_hadd_epi32(acc[r][0], acc[r][1]),
                                                _mm256_hadd_epi32(acc[r][2], acc[r][3]));
            int32_t *o = sums + r * PB + t * NC;
            const __m128i v = _mm_add_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1));
            _mm_storeu_si128((__m128i *)o, _mm_add_epi32(_mm_loadu_si128((const __m128i *)o), v));
        }
    }
}

static void ptile_any(int mr, int nt, int64_t kc, int64_t ldx, const int16_t *x, const int16_t *wp, int32_t *sums) {
    switch (mr) {  // a constant row count keeps every accumulator in a register
    case 1: ptile(1, nt, kc, ldx, x, wp, sums); break;
    default: ptile(2, nt, kc, ldx, x, wp, sums); break;
    }
}

// The calling thread's widened chunk [PB][PK] int16, 32-byte aligned (the tiles' loads); NULL without memory.
static int16_t *panel_buffer(void) {
    int16_t *wp = grow(&panel_buf, sizeof(int16_t) * PB * PK + 32);
    return wp ? (int16_t *)(((uintptr_t)wp + 31) & ~(uintptr_t)31) : NULL;
}

// One pass of mc <= PM rows (xq stride K32, scales xs) through a block of cols <= PB columns (a multiple of NC)
// whose weight rows start at w (ws, b at the same column): each chunk of PK inputs widened once into wp for every
// row, the int32 sums kept in L1, then scaled into out (row stride ldo), nn columns of the block kept (store4's).
static void panel_pass(int64_t mc, int64_t K32, const int16_t *xq, const float *xs, const int8_t *w, int64_t cols,
                       const float *ws, const float *b, int16_t *wp, float *out, int64_t ldo, int64_t nn) {
    int32_t sums[PM * PB];
    const int nt = (int)(cols / NC);
    memset(sums, 0, sizeof(int32_t) * (size_t)(mc * PB));
    for (int64_t k0 = 0; k0 < K32; k0 += PK) {
        const int64_t kc = K32 - k0 < PK ? K32 - k0 : PK;
        for (int64_t c = 0; c < cols; c++)  // widen the chunk once for every row of the pass
            for (int64_t k = 0; k < kc; k += 16)
                _mm256_store_si256((__m256i *)(wp + c * PK + k),
                                   _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(w + c * K32 + k0 + k))));
        for (int64_t r = 0; r < mc; r += PR) {
            const int mr = mc - r < PR ? (int)(mc - r) : PR;
            ptile_any(mr, nt, kc, K32, xq + r * K32 + k0, wp, sums + r * PB);
        }
    }
    for (int64_t r = 0; r < mc; r++)
        for (int t = 0; t < nt; t++)  // every tile starts below nn (N4 - N < NC)
            store4(_mm_loadu_si128((const __m128i *)(sums + r * PB + t * NC)), xs[r], ws + t * NC,
                   b ? b + t * NC : NULL, out + r * ldo + t * NC, nn - t * NC);
}

// ws, b as i8avx2_linear. Returns 0, or -1 without memory for the quantized rows or a panel (y then incomplete).
static int panels(int64_t M, int64_t N, int64_t K, const float *x, const int8_t *w, const float *ws, const float *b,
                  float *y, int nthreads, int silu_mul);

int i8avx2_linear_panel(int64_t M, int64_t N, int64_t K, const float *x, const int8_t *w, const float *ws,
                        const float *b, float *y, int nthreads) {
    return panels(M, N, K, x, w, ws, b, y, nthreads, 0);
}

// A gated MLP's [gate; up] projection with silu(gate) * up in the epilogue: W's N = 2I rows (and ws, b) interleaved
// in blocks of 32 (engine.kernels.gemm.interleave_halves; N % 64 == 0, checked by the caller), so a unit of 64
// columns holds 32 gate and their 32 up columns; y [M][N / 2]. gate and up are the floats i8avx2_linear writes
// (the same sums and store4), and SiLU is silu.h's (x / (1 + exp(-x)), as wbf16.c's): a decode program and the
// layers agree bit for bit. WHY: no [M][2I] intermediate to memory and back, no separate SiLU and product.
#define SU 64  // columns a silu unit
#define SR 32  // rows of a unit at a time in the per-row entry: SR x SU floats on the stack

// One row's 64 floats of a unit (32 gate, 32 up) → its 32 outputs.
static inline void silu_mul_row(const float *o, float *y) {
    silu_mul_f32(o, o + SU / 2, y, SU / 2);
}

// The per-row (decode) entry, i8avx2_linear's arguments. Returns 0, or -1 without memory for the quantized rows.
int i8avx2_linear_silu_mul(int64_t M, int64_t N, int64_t K, const float *x, const int8_t *w, const float *ws,
                           const float *b, float *y, int nthreads) {
    const int64_t K32 = (K + 31) / 32 * 32, units = N / SU, width = N / 2;
    if (M <= 0) return 0;
    int16_t *xq;
    float *xs;
    if (quantize_rows(M, K, K32, x, &xq, &xs, nthreads)) return -1;
#pragma omp parallel for schedule(static) num_threads(nthreads)
    for (int64_t u = 0; u < units; u++) {
        const int64_t n0 = u * SU;
        float out[SR * SU];
        for (int64_t m0 = 0; m0 < M; m0 += SR) {
            const int64_t mr = M - m0 < SR ? M - m0 : SR;
            tiles_rows(mr, K32, xq + m0 * K32, xs + m0, w + n0 * K32, ws + n0, b ? b + n0 : NULL, SU / NC, SU,
                       out, SU);
            for (int64_t r = 0; r < mr; r++) silu_mul_row(out + r * SU, y + (m0 + r) * width + n0 / 2);
        }
    }
    return 0;
}

// The panel (batch) entry, the same arguments: a unit's 4 blocks widened once per pass for every row. Returns 0, or
// -1 without memory for the quantized rows or a panel (y then incomplete).
int i8avx2_linear_panel_silu_mul(int64_t M, int64_t N, int64_t K, const float *x, const int8_t *w, const float *ws,
                                 const float *b, float *y, int nthreads) {
    return panels(M, N, K, x, w, ws, b, y, nthreads, 1);
}

// Both panel entries: the rows quantized once, then units of columns dealt to the threads (a panel block of PB,
// or with silu_mul a silu unit of SU, its PB blocks one after another), each pass of PM rows through panel_pass:
// into y, or with silu_mul into `out`, whose 32 gate and 32 up columns a row become y's 32.
static int panels(int64_t M, int64_t N, int64_t K, const float *x, const int8_t *w, const float *ws, const float *b,
                  float *y, int nthreads, const int silu_mul) {
    const int64_t K32 = (K + 31) / 32 * 32, N4 = (N + NC - 1) / NC * NC, width = N / 2;
    const int64_t unit = silu_mul ? SU : PB, units = silu_mul ? N / SU : (N4 + PB - 1) / PB;
    if (M <= 0) return 0;
    int16_t *xq;
    float *xs;
    if (quantize_rows(M, K, K32, x, &xq, &xs, nthreads)) return -1;
    int failed = 0;
#pragma omp parallel num_threads(nthreads) reduction(| : failed)
    {
        int16_t *wp = panel_buffer();
        failed = wp == NULL;
        float out[PM * SU];  // with silu_mul, a pass's rows of the unit: 32 gate and 32 up columns each
        // passes outside, units shared out inside, as w4f32.c's panel (a 4096-row gate/up 906 → 678 ms on a Zen 3)
        for (int64_t m0 = 0; m0 < M; m0 += PM) {
            const int64_t mc = M - m0 < PM ? M - m0 : PM;
#pragma omp for schedule(static)
            for (int64_t u = 0; u < units; u++) {
                if (!wp) continue;
                const int64_t n0 = u * unit;
                if (!silu_mul) {
                    panel_pass(mc, K32, xq + m0 * K32, xs + m0, w + n0 * K32, N4 - n0 < PB ? N4 - n0 : PB, ws + n0,
                               b ? b + n0 : NULL, wp, y + m0 * N + n0, N, N - n0);
                    continue;
                }
                for (int64_t c = 0; c < SU; c += PB)
                    panel_pass(mc, K32, xq + m0 * K32, xs + m0, w + (n0 + c) * K32, PB, ws + n0 + c,
                               b ? b + n0 + c : NULL, wp, out + c, SU, SU - c);
                for (int64_t r = 0; r < mc; r++) silu_mul_row(out + r * SU, y + (m0 + r) * width + n0 / 2);
            }
        }
    }
    return failed ? -1 : 0;
}

// E linear layers of one shape [N][K] (no bias) in one call: layer e takes counts[e] consecutive rows of x (float32
// [rows][K], layers in order) and its packed weight w[e] with scales ws[e]; y gets the rows in the same order, N
// wide, or N / 2 with silu_mul (the weights interleaved as i8avx2_linear_silu_mul's). Every row is quantized once,
// as i8avx2_linear does, and every output is the float i8avx2_linear (_silu_mul) gives that expert's rows alone.
// WHY: a decode batch gives each of a MoE layer's experts a handful of rows, and a call per expert paid a Python
// round trip and a parallel region each (engine.kernels.grouped). Tasks (a layer's rows, a unit of 64 columns) go
// to threads as grouped_tasks.h says; a layer with GPANEL rows or more runs its unit through the panel (the
// widening shared by its rows), fewer through the per-row tiles. colsum: the program's signature (grouped_i8_fn),
// unused.
#define GPANEL 16  // NOTE: untimed; the per-class timings (tests/unit/test_i8avx2.py, a Zen 1) had the per-row
                   // entry ahead at 8 rows and the panel at 32
typedef struct {
    const int64_t *counts, *first, *layer;
    int64_t N, K32;
    const int16_t *xq;
    const float *xs;
    const int8_t *const *w;
    const float *const *ws;
    float *y;
    int silu_mul;
} i8avx2_group_t;

// One task: piece p's rows (layer layer[p]) through column unit nb.
static void i8avx2_group_task(const void *ctx, int64_t p, int64_t nb, int64_t end) {
    (void)end;  // dot4 prefetches a fixed distance ahead, as in i8avx2_linear
    const i8avx2_group_t *g = ctx;
    const int64_t e = g->layer[p], N = g->N, K32 = g->K32, N4 = (N + NC - 1) / NC * NC, n0 = nb * SU;
    const int64_t cols = N4 - n0 < SU ? N4 - n0 : SU, nn = N - n0, width = g->silu_mul ? N / 2 : N;
    const int64_t r0 = g->first[p], M = g->counts[e];
    const int8_t *w = g->w[e] + n0 * K32;
    const float *ws = g->ws[e] + n0;
    int16_t *wp = M >= GPANEL ? panel_buffer() : NULL;  // without memory for it, the per-row tiles: the same floats
    float out[PM * SU];                                 // with silu_mul: a pass's rows of the unit
    for (int64_t m0 = 0; m0 < M; m0 += PM) {
        const int64_t mc = M - m0 < PM ? M - m0 : PM;
        const int16_t *xq = g->xq + (r0 + m0) * K32;
        const float *xs = g->xs + r0 + m0;
        float *dst = g->silu_mul ? out : g->y + (r0 + m0) * N + n0;
        const int64_t ldo = g->silu_mul ? SU : N;
        if (wp)
            for (int64_t c = 0; c < cols; c += PB)
                panel_pass(mc, K32, xq, xs, w + c * K32, cols - c < PB ? cols - c : PB, ws + c, NULL, wp, dst + c,
                           ldo, nn - c);
        else
            tiles_rows(mc, K32, xq, xs, w, ws, NULL, cols / NC, nn, dst, ldo);
        if (g->silu_mul)
            for (int64_t r = 0; r < mc; r++) silu_mul_row(out + r * SU, g->y + (r0 + m0 + r) * width + n0 / 2);
    }
}

// Returns 0, or -1 without memory for the quantized rows (y untouched).
int i8avx2_grouped(int64_t E, const int64_t *counts, int64_t N, int64_t K, const float *x, const int8_t *const *w,
                   const int32_t *const *colsum, const float *const *ws, float *y, int nthreads, int silu_mul) {
    (void)colsum;
    const int64_t K32 = (K + 31) / 32 * 32, nblocks = (N + SU - 1) / SU;
    int64_t first[E > 0 ? E : 1], layer[E > 0 ? E : 1], M;  // each layer with rows: its first row, its index
    const int64_t P = grouped_pieces(E, counts, first, layer, &M);
    if (M <= 0) return 0;
    int16_t *xq;
    float *xs;
    if (quantize_rows(M, K, K32, x, &xq, &xs, nthreads)) return -1;
    const i8avx2_group_t g = {counts, first, layer, N, K32, xq, xs, w, ws, y, silu_mul};
    grouped_tasks(P, nblocks, nthreads, 2, i8avx2_group_task, &g);
    return 0;
}

// The two entry points with i8mm_linear's arguments, the signature a decode program calls (engine/kernels/program.c
// i8_fn): rows float32 whatever `bf16` says, no column sums (this kernel's products need none).
int i8avx2_program_linear(int64_t M, int64_t N, int64_t K, const float *x, int bf16, const int8_t *w,
                          const int32_t *colsum, const float *ws, const float *b, float *y, int nthreads) {
    (void)bf16, (void)colsum;
    return i8avx2_linear(M, N, K, x, w, ws, b, y, nthreads);
}

int i8avx2_program_panel(int64_t M, int64_t N, int64_t K, const float *x, int bf16, const int8_t *w,
                         const int32_t *colsum, const float *ws, const float *b, float *y, int nthreads) {
    (void)bf16, (void)colsum;
    return i8avx2_linear_panel(M, N, K, x, w, ws, b, y, nthreads);
}

// The fused entries with the signature a decode program calls them by (program.c i8_silu_fn): rows float32, no
// column sums.
int i8avx2_program_silu_mul(int64_t M, int64_t N, int64_t K, const void *x, const void *w, const void *colsum,
                            const void *ws, const void *b, void *y, int nthreads) {
    (void)colsum;
    return i8avx2_linear_silu_mul(M, N, K, x, w, ws, b, y, nthreads);
}

int i8avx2_program_panel_silu_mul(int64_t M, int64_t N, int64_t K, const void *x, const void *w, const void *colsum,
                                  const void *ws, const void *b, void *y, int nthreads) {
    (void)colsum;
    return i8avx2_linear_panel_silu_mul(M, N, K, x, w, ws, b, y, nthreads);
}
