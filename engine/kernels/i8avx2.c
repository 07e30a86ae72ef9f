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

static __thread thread_buffer xq_buf, xs_buf;  // the quantized rows and their scales

// ws, b: float [N4] (b may be NULL). Returns 0, or -1 without memory for the quantized rows (y untouched).
int i8avx2_linear(int64_t M, int64_t N, int64_t K, const float *x, const int8_t *w, const float *ws,
                  const float *b, float *y, int nthreads) {
    const int64_t K32 = (K + 31) / 32 * 32, tiles = (N + NC - 1) / NC;
    if (M <= 0) return 0;
    int16_t *xq = grow(&xq_buf, sizeof(int16_t) * (size_t)(M * K32));
    float *xs = grow(&xs_buf, sizeof(float) * (size_t)M);
    if (!xq || !xs) return -1;
#pragma omp parallel for schedule(static) num_threads(nthreads) if (M > 1)
    for (int64_t m = 0; m < M; m++) quantize_row(K, K32, x + m * K, xq + m * K32, xs + m);
#pragma omp parallel for schedule(static) num_threads(nthreads)
    for (int64_t t = 0; t < tiles; t++) {
        const int64_t n0 = t * NC, nn = N - n0 < NC ? N - n0 : NC;
        const int8_t *wt = w + n0 * K32;
        const __m128 s = _mm_loadu_ps(ws + n0), bias = b ? _mm_loadu_ps(b + n0) : _mm_setzero_ps();
        for (int64_t m = 0; m < M; m++) {  // the tile's 4 weight rows stay in L1/L2 for every row after the first
            const __m128 v = _mm_cvtepi32_ps(dot4(K32, xq + m * K32, wt));
            const __m128 out = _mm_add_ps(_mm_mul_ps(_mm_mul_ps(v, _mm_set1_ps(xs[m])), s), bias);
            if (nn == NC) {
                _mm_storeu_ps(y + m * N + n0, out);
            } else {
                float o[NC];
                _mm_storeu_ps(o, out);
                memcpy(y + m * N + n0, o, sizeof(float) * (size_t)nn);
            }
        }
    }
    return 0;
}
