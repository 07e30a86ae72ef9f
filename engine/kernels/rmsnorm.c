// Fused residual add + RMSNorm over rows of float32 or bf16, with the same roundings as the eager torch code
// it replaces (engine/layers/norm.py): s = x + residual (rounded to the dtype), y = s * rsqrt(mean(s^2) + eps)
// (rounded), out = weight * y (rounded). One pass instead of ~9 small torch ops, which at decode's few rows
// cost far more in dispatch than in arithmetic. Portable: GCC vector extensions, no intrinsics.
#include <stdint.h>
#include <string.h>

typedef float v16f __attribute__((vector_size(64)));
typedef uint32_t v16u __attribute__((vector_size(64)));
typedef int32_t v16i __attribute__((vector_size(64)));
typedef uint16_t v16h __attribute__((vector_size(32)));
#define VL 16

static inline v16f widen(const uint16_t *p) {
    v16h h;
    memcpy(&h, p, sizeof(h));
    v16u u = __builtin_convertvector(h, v16u) << 16;
    v16f f;
    memcpy(&f, &u, sizeof(f));
    return f;
}

// Round to nearest even, keeping the result as float32 bits with the low half zero; NaN stays a quiet NaN.
static inline v16u round_bits(v16f f) {
    v16u u;
    memcpy(&u, &f, sizeof(u));
    const v16u rounded = (u + 0x7FFFu + ((u >> 16) & 1u)) & 0xFFFF0000u;
    const v16i mag = (v16i)(u & 0x7FFFFFFFu);
    const v16u nan = (v16u)(mag > 0x7F800000);
    return (nan & ((u & 0xFFFF0000u) | 0x400000u)) | (~nan & rounded);
}

static inline void narrow(uint16_t *p, v16f f) {
    const v16h h = __builtin_convertvector(round_bits(f) >> 16, v16h);
    memcpy(p, &h, sizeof(h));
}

static inline float widen1(uint16_t h) {
    const uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint16_t narrow1(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7FFFFFFFu) > 0x7F800000u) return (uint16_t)((u >> 16) | 0x40);
    return (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

static inline float round_bf16(float f) { return widen1(narrow1(f)); }

static inline v16f round_bf16v(v16f f) {
    const v16u u = round_bits(f);
    v16f out;
    memcpy(&out, &u, sizeof(out));
    return out;
}

static inline float rstd(float sumsq, int64_t dim, float eps) {
    return 1.0f / __builtin_sqrtf(sumsq / (float)dim + eps);
}

// float32: x, residual (may be NULL), weight, out, sum_out (written only with a residual) are [rows][dim].
void rmsnorm_f32(int64_t rows, int64_t dim, const float *x, const float *residual, const float *w, float eps,
                 float *out, float *sum_out, int nthreads) {
#pragma omp parallel for schedule(static) num_threads(nthreads) if (rows >= 4)
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * dim, *rr = residual ? residual + r * dim : NULL;
        float *sr = residual ? sum_out + r * dim : (float *)xr, *o = out + r * dim;
        v16f acc = {0};
        float tail = 0.0f;
        int64_t j = 0;
        for (; j + VL <= dim; j += VL) {
            v16f s;
            memcpy(&s, xr + j, sizeof(s));
            if (rr) {
                v16f a;
                memcpy(&a, rr + j, sizeof(a));
                s += a;
                memcpy(sr + j, &s, sizeof(s));
            }
            acc += s * s;
        }
        for (; j < dim; j++) {
            const float s = rr ? xr[j] + rr[j] : xr[j];
            if (rr) sr[j] = s;
            tail += s * s;
        }
        float sumsq = tail;
        for (int i = 0; i < VL; i++) sumsq += acc[i];
        const float k = rstd(sumsq, dim, eps);
        for (j = 0; j + VL <= dim; j += VL) {
            v16f s, g;
            memcpy(&s, sr + j, sizeof(s));
            memcpy(&g, w + j, sizeof(g));
            s = g * (s * k);
            memcpy(o + j, &s, sizeof(s));
        }
        for (; j < dim; j++) o[j] = w[j] * (sr[j] * k);
    }
}

// bf16: the same, every intermediate the torch code materialises rounded to bf16 where it does.
void rmsnorm_bf16(int64_t rows, int64_t dim, const uint16_t *x, const uint16_t *residual, const uint16_t *w,
                  float eps, uint16_t *out, uint16_t *sum_out, int nthreads) {
#pragma omp parallel for schedule(static) num_threads(nthreads) if (rows >= 4)
    for (int64_t r = 0; r < rows; r++) {
        const uint16_t *xr = x + r * dim, *rr = residual ? residual + r * dim : NULL;
        const uint16_t *sr = residual ? sum_out + r * dim : xr;
        uint16_t *o = out + r * dim;
        v16f acc = {0};
        float tail = 0.0f;
        int64_t j = 0;
        for (; j + VL <= dim; j += VL) {
            v16f s = widen(xr + j);
            if (rr) {
                s = round_bf16v(s + widen(rr + j));
                narrow(sum_out + r * dim + j, s);
            }
            acc += s * s;
        }
        for (; j < dim; j++) {
            const float s = rr ? round_bf16(widen1(xr[j]) + widen1(rr[j])) : widen1(xr[j]);
            if (rr) sum_out[r * dim + j] = narrow1(s);
            tail += s * s;
        }
        float sumsq = tail;
        for (int i = 0; i < VL; i++) sumsq += acc[i];
        const float k = rstd(sumsq, dim, eps);
        for (j = 0; j + VL <= dim; j += VL) narrow(o + j, widen(w + j) * round_bf16v(widen(sr + j) * k));
        for (; j < dim; j++) o[j] = narrow1(widen1(w[j]) * round_bf16(widen1(sr[j]) * k));
    }
}
