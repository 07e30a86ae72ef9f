// silu(g) * u over float32 rows in vectors of AL lanes (vec16.h), SiLU as g / (1 + exp(-g)), the float32 torch
// code's formula, with vec16.h's vexp_v: the fused gated-MLP epilogues of the float32 kernels (wbf16.c, w4f32.c,
// i8avx2.c, and i8mm.c over float32 rows) share it, so each kernel's entries give the same bits whichever a batch
// class takes. WHY: they called libm's expf once an output; at 32 rows of Qwen2-0.5B's gate/up that was ~15% of
// wbf16's fused call on a Zen 3 (2026-12-07), and 45% of i8mm's float32 one on a Zen 5 (645 -> 351 us, 2 threads).
// cbuild.py hashes this header with every source that includes it.
#ifndef TIANMEN_SILU_H
#define TIANMEN_SILU_H
#include <stdint.h>
#include <string.h>

#include "vec16.h"

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
        const vf out = gv / (1.0f + vexp_v(-gv)) * uv;
        memcpy(y + j, &out, (size_t)(n - j >= AL ? AL : n - j) * sizeof(float));
    }
}

#endif
