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
//   3-row x 4-column tiles over every row (12 accumulators, the widening shared by all the rows). Batches.
//
// Packed layout (i8avx2.py packs): W row-major [N4][K32] int8, N rounded up to 4 and K to 32 with zeros.
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

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

// y[n0 .. n0 + nn) of one row from its 4 columns' int32 sums: (sum * xs) * ws + b, as the reference rounds it.
static inline void store4(__m128i sums, float xs, const float *ws, const float *b, float *y, int64_t nn) {
    const __m128 s = _mm_loadu_ps(ws), bias = b ? _mm_loadu_ps(b) : _mm_setzero_ps();
    const __m128 out = _mm_add_ps(_mm_mul_ps(_mm_mul_ps(_mm_cvtepi32_ps(sums), _mm_set1_ps(xs)), s), bias);
    if (nn >= NC) {
        _mm_storeu_ps(y, out);
    } else {
        float o[NC];
        _mm_storeu_ps(o, out);
        memcpy(y, o, sizeof(float) * (size_t)nn);
    }
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
#define PR 3    // rows a panel tile: 3 x 4 accumulators, 3 rows and 1 weight vector (the 16 registers)
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
    case 2: ptile(2, nt, kc, ldx, x, wp, sums); break;
    default: ptile(3, nt, kc, ldx, x, wp, sums); break;
    }
}

// ws, b as i8avx2_linear. Returns 0, or -1 without memory for the quantized rows or a panel (y then incomplete).
int i8avx2_linear_panel(int64_t M, int64_t N, int64_t K, const float *x, const int8_t *w, const float *ws,
                        const float *b, float *y, int nthreads) {
    const int64_t K32 = (K + 31) / 32 * 32, N4 = (N + NC - 1) / NC * NC, blocks = (N4 + PB - 1) / PB;
    if (M <= 0) return 0;
    int16_t *xq;
    float *xs;
    if (quantize_rows(M, K, K32, x, &xq, &xs, nthreads)) return -1;
    int failed = 0;
#pragma omp parallel num_threads(nthreads) reduction(| : failed)
    {
        int16_t *wp = grow(&panel_buf, sizeof(int16_t) * PB * PK + 32);
        failed = wp == NULL;
        if (wp) wp = (int16_t *)(((uintptr_t)wp + 31) & ~(uintptr_t)31);  // aligned loads in the tiles
        int32_t sums[PM * PB];
#pragma omp for schedule(static)
        for (int64_t nb = 0; nb < blocks; nb++) {
            if (!wp) continue;
            const int64_t n0 = nb * PB, cols = N4 - n0 < PB ? N4 - n0 : PB;
            const int nt = (int)(cols / NC);
            for (int64_t m0 = 0; m0 < M; m0 += PM) {
                const int64_t mc = M - m0 < PM ? M - m0 : PM;
                memset(sums, 0, sizeof(int32_t) * (size_t)(mc * PB));
                for (int64_t k0 = 0; k0 < K32; k0 += PK) {
                    const int64_t kc = K32 - k0 < PK ? K32 - k0 : PK;
                    for (int64_t c = 0; c < cols; c++)  // widen the chunk once for every row of the pass
                        for (int64_t k = 0; k < kc; k += 16)
                            _mm256_store_si256((__m256i *)(wp + c * PK + k),
                                               _mm256_cvtepi8_epi16(_mm_loadu_si128(
                                                   (const __m128i *)(w + (n0 + c) * K32 + k0 + k))));
                    for (int64_t r = 0; r < mc; r += PR) {
                        const int mr = mc - r < PR ? (int)(mc - r) : PR;
                        ptile_any(mr, nt, kc, K32, xq + (m0 + r) * K32 + k0, wp, sums + r * PB);
                    }
                }
                for (int64_t r = 0; r < mc; r++)
                    for (int t = 0; t < nt; t++) {  // every tile starts below N (N4 - N < NC)
                        const int64_t n = n0 + t * NC;
                        store4(_mm_loadu_si128((const __m128i *)(sums + r * PB + t * NC)), xs[m0 + r], ws + n,
                               b ? b + n : NULL, y + (m0 + r) * N + n, N - n);
                    }
            }
        }
    }
    return failed ? -1 : 0;
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
