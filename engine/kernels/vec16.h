// Sixteen-lane float32 vectors in GCC's vector extensions, and the math the portable kernels share
// (decode_attn.c, pointwise.c). cbuild.py hashes this header with every source that includes it.
#ifndef TIANMEN_VEC16_H
#define TIANMEN_VEC16_H
#include <stdint.h>
#include <string.h>

typedef float v16f __attribute__((vector_size(64)));
typedef int32_t v16i __attribute__((vector_size(64)));
typedef uint32_t v16u __attribute__((vector_size(64)));
typedef uint16_t v16h __attribute__((vector_size(32)));
#define VL 16

static inline float hsum(v16f v) {  // a shuffle tree: 4 adds instead of 15
    v += __builtin_shuffle(v, (v16i){8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7});
    v += __builtin_shuffle(v, (v16i){4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11});
    v += __builtin_shuffle(v, (v16i){2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13});
    v += __builtin_shuffle(v, (v16i){1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14});
    return v[0];
}

static inline float hmax(v16f v) {
    float m = v[0];
    for (int i = 1; i < VL; i++) m = v[i] > m ? v[i] : m;
    return m;
}

// exp(x) for x <= 0 (scores minus their running max): 2^n * p(r), r = x - n ln2 in [-ln2/2, ln2/2], a degree-6
// polynomial (relative error ~2e-7). Below -87 the result is 0, as expf's would underflow to.
static inline v16f vexp(v16f x) {
    const v16f lo = (v16f){0} - 87.0f;
    const v16i under = x < lo;
    x = (v16f)((v16i)x & ~under) + (v16f)((v16i)lo & under);
    const v16f n = __builtin_convertvector(__builtin_convertvector(x * 1.44269504f + (v16f){0} - 0.5f, v16i), v16f);
    // (truncation toward zero of x*log2e - 0.5 rounds to nearest for x <= 0)
    const v16f r = x - n * 0.693359375f + n * 2.12194440e-4f;
    v16f p = (v16f){0} + 1.0f / 720;
    p = p * r + 1.0f / 120;
    p = p * r + 1.0f / 24;
    p = p * r + 1.0f / 6;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    const v16i bits = (__builtin_convertvector(n, v16i) + 127) << 23;
    v16f scale;
    memcpy(&scale, &bits, sizeof(scale));
    const v16f out = p * scale;
    return (v16f)((v16i)out & ~under);
}

#endif
