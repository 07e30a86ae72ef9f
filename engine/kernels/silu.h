// silu(g) * u over float32 rows in vectors of AL lanes (vec16.h), SiLU as g / (1 + exp(-g)), the float32 torch
// code's formula, with exp by vexp_any below: the fused gated-MLP epilogues of the float32 kernels (wbf16.c,
// w4f32.c, i8avx2.c) share it, so each kernel's entries give the same bits whichever a batch class takes.
// WHY: they called libm's expf once an output; at 32 rows of Qwen2-0.5B's gate/up that was ~15% of wbf16's fused
// call on a Zen 3 (2026-12-07). cbuild.py hashes this header with every source that includes it.
#ifndef TIANMEN_SILU_H
#define TIANMEN_SILU_H
#include <stdint.h>
#include <string.h>

#include "vec16.h"

// exp(x) for any x: 2^n * p(r), n = x / ln2 rounded to nearest, r = x - n ln2 in [-ln2/2, ln2/2], the degree-6
// polynomial of vec16.h's vexp (relative error ~2e-7); 0 below -87 (as expf underflows), inf past 88.72.
static inline vf vexp_any(vf x) {
    const vf lo = (vf){0} - 87.0f, hi = (vf){0} + 89.0f;
    const vi under = x < lo;
    x = (vf)(((vi)x & ~under) | ((vi)lo & under));
    const vi over = x > hi;
    x = (vf)(((vi)x & ~over) | ((vi)hi & over));
    const vf t = x * 1.44269504f;
    const vi neg = t < 0;  // truncation after adding +-0.5 rounds to nearest on both sides of zero
    const vf half = (vf)(((vi)((vf){0} + 0.5f) & ~neg) | ((vi)((vf){0} - 0.5f) & neg));
    const vf n = __builtin_convertvector(__builtin_convertvector(t + half, vi), vf);
    const vf r = x - n * 0.693359375f + n * 2.12194440e-4f;
    vf p = (vf){0} + 1.0f / 720;
    p = p * r + 1.0f / 120;
    p = p * r + 1.0f / 24;
    p = p * r + 1.0f / 6;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    // 2^n as two factors 2^(n/2) and 2^(n - n/2), each a normal float for n in [-126, 128]: the product overflows
    // to inf only where exp(x) does (past 88.72), and no n wraps the exponent field
    const vi ni = __builtin_convertvector(n, vi), n1 = ni >> 1;
    const vi b1 = (n1 + 127) << 23, b2 = (ni - n1 + 127) << 23;
    vf s1, s2;
    memcpy(&s1, &b1, sizeof(s1));
    memcpy(&s2, &b2, sizeof(s2));
    return (vf)((vi)(p * s1 * s2) & ~under);
}

// y[j] = silu(g[j]) * u[j], j < n (a tail shorter than AL computed as a whole vector in a copy).
static inline void silu_mul_f32(const float *g, const float *u, float *y, int64_t n) {
    for (int64_t j = 0; j < n; j += AL) {
        vf gv, uv;
        if (n - j >= AL) {
            memcpy(&gv, g + j, sizeof(gv));
            memcpy(&uv, u + j, sizeof(uv));
        } else {
            gv = uv = (vf){0};
            memcpy(&gv, g + j, (size_t)(n - j) * sizeof(float));
            memcpy(&uv, u + j, (size_t)(n - j) * sizeof(float));
        }
        const vf out = gv / (1.0f + vexp_any(-gv)) * uv;
        memcpy(y + j, &out, (size_t)(n - j >= AL ? AL : n - j) * sizeof(float));
    }
}

#endif
