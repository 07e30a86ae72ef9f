// Float32 vectors in GCC's vector extensions, and the math the portable kernels share (decode_attn.c,
// decode_attn_latent.c, pointwise.c): sixteen lanes (v16f), and AL lanes (vf: the machine's widest register).
// cbuild.py hashes this header with every source that includes it.
#ifndef TIANMEN_VEC16_H
#define TIANMEN_VEC16_H
#include <stdint.h>
#include <string.h>

typedef float v16f __attribute__((vector_size(64)));
typedef int32_t v16i __attribute__((vector_size(64)));
typedef uint32_t v16u __attribute__((vector_size(64)));
typedef uint16_t v16h __attribute__((vector_size(32)));
#define VL 16

// AL lanes: 16 where there are 512-bit registers, 8 on AVX2 and other 16-register machines. WHY: there GCC (12)
// splits a 16-lane vector in two but keeps one carried around a loop (an accumulator, a running maximum) on the
// stack, a load and a store per step: on a Zen 3 (2026-12-07) a MoE router's float32 scores ran at ~2 GFLOP/s
// and the router lost to torch's, which kept DeepSeek's decode steps out of programs.
#ifdef __AVX512F__
#define AL 16
#else
#define AL 8
#endif
typedef float vf __attribute__((vector_size(AL * 4)));
typedef int32_t vi __attribute__((vector_size(AL * 4)));
typedef uint32_t vu __attribute__((vector_size(AL * 4)));
typedef uint16_t vh __attribute__((vector_size(AL * 2)));

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

static inline float hsum_v(vf v) {  // hsum's tree over AL lanes
#if AL == 16
    return hsum(v);
#else
    v += __builtin_shuffle(v, (vi){4, 5, 6, 7, 0, 1, 2, 3});
    v += __builtin_shuffle(v, (vi){2, 3, 0, 1, 6, 7, 4, 5});
    v += __builtin_shuffle(v, (vi){1, 0, 3, 2, 5, 4, 7, 6});
    return v[0];
#endif
}

static inline float hmax_v(vf v) {
    float m = v[0];
    for (int i = 1; i < AL; i++) m = v[i] > m ? v[i] : m;
    return m;
}

// exp(x): 2^n * p(r), n = x / ln2 rounded to nearest, r = x - n ln2 in [-ln2/2, ln2/2], a degree-6 polynomial
// (relative error ~2.5e-7 against expf over [-87, 100]); 0 below -87 (where expf's would underflow), inf past
// 88.72 (where expf overflows). vexp over v16f (the softmax's scores less their maximum), vexp_v over vf (SiLU's
// exp(-g) in silu.h; the same function where AL is 16). 2^n is two normal factors 2^(n/2) and 2^(n - n/2): no n
// in [-126, 128] wraps the exponent field, and each product by a power of two is exact.
#define VEXP(name, F, I)                                                                                      \
    static inline F name(F x) {                                                                               \
        const F lo = (F){0} - 87.0f, hi = (F){0} + 89.0f;                                                     \
        const I under = x < lo, over = x > hi;                                                                \
        x = (F)(((I)x & ~under) | ((I)lo & under));                                                           \
        x = (F)(((I)x & ~over) | ((I)hi & over));                                                             \
        const F t = x * 1.44269504f;                                                                          \
        const I neg = t < 0; /* truncation after adding +-0.5 rounds to nearest on both sides of zero */     \
        const F half = (F)(((I)((F){0} + 0.5f) & ~neg) | ((I)((F){0} - 0.5f) & neg));                        \
        const F n = __builtin_convertvector(__builtin_convertvector(t + half, I), F);                         \
        const F r = x - n * 0.693359375f + n * 2.12194440e-4f;                                                \
        F p = (F){0} + 1.0f / 720;                                                                            \
        p = p * r + 1.0f / 120;                                                                               \
        p = p * r + 1.0f / 24;                                                                                \
        p = p * r + 1.0f / 6;                                                                                 \
        p = p * r + 0.5f;                                                                                     \
        p = p * r + 1.0f;                                                                                     \
        p = p * r + 1.0f;                                                                                     \
        const I ni = __builtin_convertvector(n, I), n1 = ni >> 1;                                             \
        const I b1 = (n1 + 127) << 23, b2 = (ni - n1 + 127) << 23;                                            \
        F s1, s2;                                                                                             \
        memcpy(&s1, &b1, sizeof(s1));                                                                         \
        memcpy(&s2, &b2, sizeof(s2));                                                                         \
        return (F)((I)(p * s1 * s2) & ~under);                                                                \
    }
VEXP(vexp, v16f, v16i)
#if AL == 16
#define vexp_v vexp
#else
VEXP(vexp_v, vf, vi)
#endif

#endif
