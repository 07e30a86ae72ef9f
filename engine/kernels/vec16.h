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

// exp(x) for x <= 0 (scores minus their running max): 2^n * p(r), r = x - n ln2 in [-ln2/2, ln2/2], a degree-6
// polynomial (relative error ~2e-7). Below -87 the result is 0, as expf's would underflow to. vexp over v16f,
// vexp_v over vf (the same function where AL is 16).
// (truncation toward zero of x*log2e - 0.5 rounds to nearest for x <= 0)
#define VEXP(name, F, I)                                                                                      \
    static inline F name(F x) {                                                                               \
        const F lo = (F){0} - 87.0f;                                                                          \
        const I under = x < lo;                                                                               \
        x = (F)((I)x & ~under) + (F)((I)lo & under);                                                          \
        const F n = __builtin_convertvector(__builtin_convertvector(x * 1.44269504f + (F){0} - 0.5f, I), F); \
        const F r = x - n * 0.693359375f + n * 2.12194440e-4f;                                                \
        F p = (F){0} + 1.0f / 720;                                                                            \
        p = p * r + 1.0f / 120;                                                                               \
        p = p * r + 1.0f / 24;                                                                                \
        p = p * r + 1.0f / 6;                                                                                 \
        p = p * r + 0.5f;                                                                                     \
        p = p * r + 1.0f;                                                                                     \
        p = p * r + 1.0f;                                                                                     \
        const I bits = (__builtin_convertvector(n, I) + 127) << 23;                                           \
        F scale;                                                                                              \
        memcpy(&scale, &bits, sizeof(scale));                                                                 \
        const F out = p * scale;                                                                              \
        return (F)((I)out & ~under);                                                                          \
    }
VEXP(vexp, v16f, v16i)
#if AL == 16
#define vexp_v vexp
#else
VEXP(vexp_v, vf, vi)
#endif

#endif
