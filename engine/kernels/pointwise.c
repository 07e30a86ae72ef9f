// The small ops between the GEMMs, each fused into one pass over float32 or bf16 rows with the roundings of the
// eager torch code it replaces (engine/kernels/pointwise.py): at decode's few rows that code is a handful of
// torch ops per call whose dispatch costs far more than their arithmetic, and at prefill's many rows each op
// is a separate pass over memory. Portable: GCC vector extensions, no intrinsics.
//
// - residual add + RMSNorm: s = x + residual (rounded to the dtype), y = s * rsqrt(mean(s^2) + eps) (rounded),
//   out = weight * y (rounded);
// - rotary embedding (rotate_half layout) in place: out = x * cos (rounded) + rotate_half(x) * sin (rounded),
//   the sum rounded;
// - rotary embedding on interleaved pairs (DeepSeek), written de-interleaved, with the same roundings;
// - a MoE layer's routing (softmax or sigmoid, greedy or group-limited) with its pairs grouped by expert, and its
//   combine: each token's routed rows weighted and summed, plus its shared experts' row;
// - greedy argmax over float32 or bf16 logits rows: the first index of the maximum, or of the first NaN, as torch;
// - sampling: one token per float32 logits row drawn by inverting its CDF at a given uniform number, as
//   engine/sampler.py's inverse_cdf does with four torch ops and a float64 copy of the row.
#include <math.h>
#include <stdlib.h>
#include <stdint.h>
#include <string.h>

#include "vec16.h"  // AL-lane vectors (vf): a 16-lane one carried around a loop spills on AVX2

static inline vf widen(const uint16_t *p) {
    vh h;
    memcpy(&h, p, sizeof(h));
    vu u = __builtin_convertvector(h, vu) << 16;
    vf f;
    memcpy(&f, &u, sizeof(f));
    return f;
}

static inline vu bits_of(vf f) {
    vu u;
    memcpy(&u, &f, sizeof(u));
    return u;
}

static inline vf float_of(vu u) {
    vf f;
    memcpy(&f, &u, sizeof(f));
    return f;
}

// Round to nearest even, as round_bits does for every value but a NaN with bits in its low half (rmsnorm_bf16 says
// why it never meets one), in a third of the operations: the NaN test is what costs.
static inline vu round_bits_number(vf f) {
    const vu u = bits_of(f);
    return (u + 0x7FFFu + ((u >> 16) & 1u)) & 0xFFFF0000u;
}

// Round to nearest even, keeping the result as float32 bits with the low half zero; NaN stays a quiet NaN.
static inline vu round_bits(vf f) {
    const vu u = bits_of(f);
    const vi mag = (vi)(u & 0x7FFFFFFFu);
    const vu nan = (vu)(mag > 0x7F800000);
    return (nan & ((u & 0xFFFF0000u) | 0x400000u)) | (~nan & round_bits_number(f));
}

// float32 bits whose low half is zero (a bf16 value): their upper halves.
static inline void store_upper(uint16_t *p, vu u) {
    const vh h = __builtin_convertvector(u >> 16, vh);
    memcpy(p, &h, sizeof(h));
}

static inline void narrow(uint16_t *p, vf f) { store_upper(p, round_bits(f)); }

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

static inline vf round_bf16v(vf f) { return float_of(round_bits(f)); }

static inline float rstd(float sumsq, int64_t dim, float eps) {
    return 1.0f / __builtin_sqrtf(sumsq / (float)dim + eps);
}

// Rows x dim below this run on one thread: a decode batch's norm is ~10 us of work, less than a parallel region
// costs, and a region waits for its slowest thread, which a busy event loop may have taken the core from
// (measured in serving on 2 cores: 123 us a call in two threads).
#define PARALLEL_ELEMS 65536

// float32: x, residual (may be NULL), weight, out, sum_out (written only with a residual) are [rows][dim].
void rmsnorm_f32(int64_t rows, int64_t dim, const float *x, const float *residual, const float *w, float eps,
                 float *out, float *sum_out, int nthreads) {
#pragma omp parallel for schedule(static) num_threads(nthreads) if (rows * dim >= PARALLEL_ELEMS)
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * dim, *rr = residual ? residual + r * dim : NULL;
        float *sr = residual ? sum_out + r * dim : (float *)xr, *o = out + r * dim;
        vf acc = {0};
        float tail = 0.0f;
        int64_t j = 0;
        for (; j + AL <= dim; j += AL) {
            vf s;
            memcpy(&s, xr + j, sizeof(s));
            if (rr) {
                vf a;
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
        for (int i = 0; i < AL; i++) sumsq += acc[i];
        const float k = rstd(sumsq, dim, eps);
        for (j = 0; j + AL <= dim; j += AL) {
            vf s, g;
            memcpy(&s, sr + j, sizeof(s));
            memcpy(&g, w + j, sizeof(g));
            s = g * (s * k);
            memcpy(o + j, &s, sizeof(s));
        }
        for (; j < dim; j++) o[j] = w[j] * (sr[j] * k);
    }
}

static inline vf round_number(vf f) { return float_of(round_bits_number(f)); }

// f already a bf16 value: its upper half.
static inline void narrow_exact(uint16_t *p, vf f) { store_upper(p, bits_of(f)); }

// bf16: the same, every intermediate the torch code materialises rounded to bf16 where it does. The vector loops
// round without round_bits' NaN test: every value rounded here comes from float arithmetic on bf16 values, whose
// NaNs (an operand's, quieted, or the default one) have the low half zero, and such a NaN rounds to itself (as
// do infinities, and a finite value that rounds up to one). WHY: at prefill's 4,096 x 576 the NaN tests made the
// kernel compute-bound: 1.14-1.26 ms a call where torch's add alone, over as many bytes, took 0.38; without them
// 0.69-0.81 (2-core AMX Xeon, model 207; `python -m benchmarks.step_profile --shape smollm2-135m` shows the call).
void rmsnorm_bf16(int64_t rows, int64_t dim, const uint16_t *x, const uint16_t *residual, const uint16_t *w,
                  float eps, uint16_t *out, uint16_t *sum_out, int nthreads) {
#pragma omp parallel for schedule(static) num_threads(nthreads) if (rows * dim >= PARALLEL_ELEMS)
    for (int64_t r = 0; r < rows; r++) {
        const uint16_t *xr = x + r * dim, *rr = residual ? residual + r * dim : NULL;
        const uint16_t *sr = residual ? sum_out + r * dim : xr;
        uint16_t *o = out + r * dim;
        vf acc = {0};
        float tail = 0.0f;
        int64_t j = 0;
        for (; j + AL <= dim; j += AL) {
            vf s = widen(xr + j);
            if (rr) {
                s = round_number(s + widen(rr + j));
                narrow_exact(sum_out + r * dim + j, s);
            }
            acc += s * s;
        }
        for (; j < dim; j++) {
            const float s = rr ? round_bf16(widen1(xr[j]) + widen1(rr[j])) : widen1(xr[j]);
            if (rr) sum_out[r * dim + j] = narrow1(s);
            tail += s * s;
        }
        float sumsq = tail;
        for (int i = 0; i < AL; i++) sumsq += acc[i];
        const float k = rstd(sumsq, dim, eps);
        for (j = 0; j + AL <= dim; j += AL)
            narrow_exact(o + j, round_number(widen(w + j) * round_number(widen(sr + j) * k)));
        for (; j < dim; j++) o[j] = narrow1(widen1(w[j]) * round_bf16(widen1(sr[j]) * k));
    }
}

// x: [T][heads][D], token rows `ld` elements apart, heads contiguous; cos, sin: [T][D] in the same dtype.
void rope_f32(int64_t T, int64_t heads, int64_t D, float *x, int64_t ld, const float *cos, const float *sin,
              int nthreads) {
    const int64_t half = D / 2;
#pragma omp parallel for schedule(static) num_threads(nthreads) if (T * heads * D >= PARALLEL_ELEMS)
    for (int64_t t = 0; t < T; t++)
        for (int64_t h = 0; h < heads; h++) {
            float *a = x + t * ld + h * D, *b = a + half;
            const float *c = cos + t * D, *s = sin + t * D;
            for (int64_t i = 0; i < half; i++) {
                const float x1 = a[i], x2 = b[i];
                a[i] = x1 * c[i] + (-x2) * s[i];
                b[i] = x2 * c[half + i] + x1 * s[half + i];
            }
        }
}

void rope_bf16(int64_t T, int64_t heads, int64_t D, uint16_t *x, int64_t ld, const uint16_t *cos,
               const uint16_t *sin, int nthreads) {
    const int64_t half = D / 2;
#pragma omp parallel for schedule(static) num_threads(nthreads) if (T * heads * D >= PARALLEL_ELEMS)
    for (int64_t t = 0; t < T; t++)
        for (int64_t h = 0; h < heads; h++) {
            uint16_t *a = x + t * ld + h * D, *b = a + half;
            const uint16_t *c = cos + t * D, *s = sin + t * D;
            int64_t i = 0;
            for (; i + AL <= half; i += AL) {
                const vf x1 = widen(a + i), x2 = widen(b + i);
                const vf lo = round_bf16v(x1 * widen(c + i)) + round_bf16v(-x2 * widen(s + i));
                const vf hi = round_bf16v(x2 * widen(c + half + i)) + round_bf16v(x1 * widen(s + half + i));
                narrow(a + i, lo);
                narrow(b + i, hi);
            }
            for (; i < half; i++) {
                const float x1 = widen1(a[i]), x2 = widen1(b[i]);
                a[i] = narrow1(round_bf16(x1 * widen1(c[i])) + round_bf16(-x2 * widen1(s[i])));
                b[i] = narrow1(round_bf16(x2 * widen1(c[half + i])) + round_bf16(x1 * widen1(s[half + i])));
            }
        }
}

// RoPE on interleaved pairs (DeepSeek's q_pe / k_pe): pair i = (x[2i], x[2i + 1]) turns by angle i and lands
// de-interleaved, x[i] = x1 * cos - x2 * sin, x[half + i] = x2 * cos + x1 * sin (each product and the sum rounded
// in bf16, as engine/kernels/pointwise.py's apply_rotary_interleaved). x: [T][heads][D] in place, token rows `ld`
// and heads `hs` elements apart; cos, sin: [T][D], of which the first half is read.
// NO_FMA: products rounded to float32 before the sums, as torch's separate ops (GCC would fuse them otherwise)
#define NO_FMA __attribute__((optimize("fp-contract=off")))

NO_FMA void rope_interleaved_f32(int64_t T, int64_t heads, int64_t D, float *x, int64_t ld, int64_t hs,
                                 const float *cos, const float *sin, int nthreads) {
    const int64_t half = D / 2;
#pragma omp parallel for schedule(static) num_threads(nthreads) if (T * heads * D >= PARALLEL_ELEMS)
    for (int64_t t = 0; t < T; t++)
        for (int64_t h = 0; h < heads; h++) {
            float *a = x + t * ld + h * hs, pairs[D];
            const float *c = cos + t * D, *s = sin + t * D;
            memcpy(pairs, a, sizeof(float) * (size_t)D);
            for (int64_t i = 0; i < half; i++) {
                const float x1 = pairs[2 * i], x2 = pairs[2 * i + 1];
                const float p1 = x1 * c[i], p2 = x2 * s[i], p3 = x2 * c[i], p4 = x1 * s[i];
                a[i] = p1 - p2;
                a[half + i] = p3 + p4;
            }
        }
}

void rope_interleaved_bf16(int64_t T, int64_t heads, int64_t D, uint16_t *x, int64_t ld, int64_t hs,
                           const uint16_t *cos, const uint16_t *sin, int nthreads) {
    const int64_t half = D / 2;
#pragma omp parallel for schedule(static) num_threads(nthreads) if (T * heads * D >= PARALLEL_ELEMS)
    for (int64_t t = 0; t < T; t++)
        for (int64_t h = 0; h < heads; h++) {
            uint16_t *a = x + t * ld + h * hs, first[half + AL], second[half + AL];
            const uint16_t *c = cos + t * D, *s = sin + t * D;
            for (int64_t i = 0; i < half; i++) {
                first[i] = a[2 * i];
                second[i] = a[2 * i + 1];
            }
            int64_t i = 0;
            for (; i + AL <= half; i += AL) {
                const vf x1 = widen(first + i), x2 = widen(second + i), ci = widen(c + i), si = widen(s + i);
                narrow(a + i, round_bf16v(x1 * ci) + round_bf16v(-x2 * si));
                narrow(a + half + i, round_bf16v(x2 * ci) + round_bf16v(x1 * si));
            }
            for (; i < half; i++) {
                const float x1 = widen1(first[i]), x2 = widen1(second[i]), ci = widen1(c[i]), si = widen1(s[i]);
                a[i] = narrow1(round_bf16(x1 * ci) + round_bf16(-x2 * si));
                a[half + i] = narrow1(round_bf16(x2 * ci) + round_bf16(x1 * si));
            }
        }
}

// A MoE layer's output: out[t] = the routed rows of token t weighted and summed, + shared[t] (when not NULL).
// ys: P rows of H, expert after expert; order[r] = t * K + k: row r is token t's k-th choice, weighted by
// w[t * K + k] (float32). The roundings and order of engine/kernels/pointwise.py's moe_combine (which is
// transformers'): each weighted row rounded to the dtype, a token's rows summed in float32 in ys's order from
// zero (torch's index_add_ accumulates bf16 in float32), the sum rounded, then the shared experts' row added.
// Returns -1 where it found no memory (nothing written).
//
// count[t]: token t's rows in ys; rows[t * K + n]: its n-th, in ys's order (the order they are added). One block:
// count at its start, rows after it; NULL where there is no memory. A row naming no token, or past K for one
// (never, for an `order` that names each choice once), is dropped rather than written past the block.
static int64_t *rows_by_token(int64_t T, int64_t K, int64_t P, const int64_t *order) {
    int64_t *count = calloc((size_t)(T + T * K > 0 ? T + T * K : 1), sizeof(int64_t));
    if (!count) return NULL;
    int64_t *rows = count + T;
    for (int64_t r = 0; r < P; r++) {
        const int64_t t = order[r] / K;
        if (t >= 0 && t < T && count[t] < K) rows[t * K + count[t]++] = r;
    }
    return count;
}

NO_FMA int moe_combine_f32(int64_t T, int64_t K, int64_t H, int64_t P, const int64_t *order, const float *ys,
                           const float *w, const float *shared, float *out, int nthreads) {
    int64_t *count = rows_by_token(T, K, P, order);
    if (!count) return -1;
    const int64_t *rows = count + T;
#pragma omp parallel for schedule(static) num_threads(nthreads) if (T * H * K >= PARALLEL_ELEMS)
    for (int64_t t = 0; t < T; t++) {
        float *o = out + t * H;
        for (int64_t j = 0; j < H; j++) o[j] = 0.0f;
        for (int64_t n = 0; n < count[t]; n++) {
            const int64_t r = rows[t * K + n];
            const float *y = ys + r * H, wr = w[order[r]];
            for (int64_t j = 0; j < H; j++) {
                o[j] = o[j] + y[j] * wr;
            }
        }
        if (shared)
            for (int64_t j = 0; j < H; j++) o[j] = o[j] + shared[t * H + j];
    }
    free(count);
    return 0;
}

int moe_combine_bf16(int64_t T, int64_t K, int64_t H, int64_t P, const int64_t *order, const uint16_t *ys,
                     const float *w, const uint16_t *shared, uint16_t *out, int nthreads) {
    int64_t *count = rows_by_token(T, K, P, order);
    if (!count) return -1;
    const int64_t *rows = count + T;
#pragma omp parallel for schedule(static) num_threads(nthreads) if (T * H * K >= PARALLEL_ELEMS)
    for (int64_t t = 0; t < T; t++) {
        uint16_t *o = out + t * H;
        const uint16_t *sh = shared ? shared + t * H : NULL;
        int64_t j = 0;
        for (; j + AL <= H; j += AL) {
            vf acc = {0};
            for (int64_t n = 0; n < count[t]; n++) {
                const int64_t r = rows[t * K + n];
                acc += round_bf16v(widen(ys + r * H + j) * w[order[r]]);
            }
            acc = round_bf16v(acc);
            if (sh) acc += widen(sh + j);
            narrow(o + j, acc);
        }
        for (; j < H; j++) {
            float acc = 0.0f;
            for (int64_t n = 0; n < count[t]; n++) {
                const int64_t r = rows[t * K + n];
                acc += round_bf16(widen1(ys[r * H + j]) * w[order[r]]);
            }
            acc = round_bf16(acc);
            if (sh) acc += widen1(sh[j]);
            o[j] = narrow1(acc);
        }
    }
    free(count);
    return 0;
}

// A MoE layer's routing and its grouping by expert, in one pass (transformers' DeepseekV2TopkRouter and
// DeepseekV3TopkRouter; then what engine/layers/moe.py did with a dozen torch ops at every layer and step):
//   logits[t][e] = x[t] . W[e] in float32 (x widened; AL lanes of partial sums, then a shuffle tree),
//   scores = softmax over e, or sigmoid (`route_t.sigmoid`); choice = scores (+ bias[e] with a bias, V3's
//   e_score_correction_bias);
//   with groups > 1, the experts in `groups` equal groups, each ranked by its best choice (softmax) or its two best
//   summed (sigmoid); the choices outside the best `topk_groups` groups become 0 (softmax) or -inf (sigmoid);
//   ids[t] = the K best choices, best first (a tie: the lower expert or group first, as torch.topk on CPU),
//   weights[t][k] = choice (softmax) or score (sigmoid) of ids[t][k], over their sum + 1e-20 where `norm`
//   (sigmoid only, as transformers), times scale;
//   order = the pairs p = t * K + k by expert, in pair order within an expert (torch's stable argsort of ids),
//   counts[e] = the pairs of expert e, xs[r] = x[order[r] / K] (the rows the grouped experts read).
// W: [E][H] float32, bias: [E] float32 or NULL. x, xs: bf16 (`bf16`) or float32. E <= 4096 (the caller checks).
typedef struct {
    int64_t groups, topk_groups, sigmoid, norm;
} route_t;

// The k best of n values, best first (ties: the lower index).
static void top_k(const float *v, int64_t n, int64_t k, int64_t *out) {
    for (int64_t j = 0; j < k; j++) {
        int64_t best = -1;
        for (int64_t e = 0; e < n; e++) {
            int taken = 0;
            for (int64_t i = 0; i < j; i++) taken |= out[i] == e;
            if (!taken && (best < 0 || v[e] > v[best])) best = e;
        }
        out[j] = best;
    }
}

static void route_token(int64_t H, int64_t E, int64_t K, const void *x, int bf16, const float *W, const float *bias,
                        const route_t *cfg, float scale, float *weights, int64_t *ids) {
    float score[E], choice[E];
    for (int64_t e = 0; e < E; e++) {
        const float *w = W + e * H;
        vf acc = {0};
        float tail = 0.0f;
        int64_t j = 0;
        if (bf16) {
            const uint16_t *xb = x;
            for (; j + AL <= H; j += AL) {
                vf wv;
                memcpy(&wv, w + j, sizeof(wv));
                acc += widen(xb + j) * wv;
            }
            for (; j < H; j++) tail += widen1(xb[j]) * w[j];
        } else {
            const float *xf = x;
            for (; j + AL <= H; j += AL) {
                vf xv, wv;
                memcpy(&xv, xf + j, sizeof(xv));
                memcpy(&wv, w + j, sizeof(wv));
                acc += xv * wv;
            }
            for (; j < H; j++) tail += xf[j] * w[j];
        }
        score[e] = hsum_v(acc) + tail;
    }
    if (cfg->sigmoid) {
        for (int64_t e = 0; e < E; e++) score[e] = 1.0f / (1.0f + expf(-score[e]));
    } else {
        float m = score[0], sum = 0.0f;
        for (int64_t e = 1; e < E; e++) m = score[e] > m ? score[e] : m;
        for (int64_t e = 0; e < E; e++) sum += score[e] = expf(score[e] - m);
        for (int64_t e = 0; e < E; e++) score[e] /= sum;
    }
    for (int64_t e = 0; e < E; e++) choice[e] = bias ? score[e] + bias[e] : score[e];
    const int64_t G = cfg->groups;
    if (G > 1) {
        const int64_t per = E / G;
        float rank[G];
        int64_t keep[G], best[2];
        for (int64_t g = 0; g < G; g++) {
            top_k(choice + g * per, per, cfg->sigmoid ? 2 : 1, best);
            rank[g] = choice[g * per + best[0]] + (cfg->sigmoid ? choice[g * per + best[1]] : 0.0f);
        }
        top_k(rank, G, cfg->topk_groups, keep);
        const float fill = cfg->sigmoid ? -INFINITY : 0.0f;
        for (int64_t g = 0; g < G; g++) {
            int kept = 0;
            for (int64_t i = 0; i < cfg->topk_groups; i++) kept |= keep[i] == g;
            if (!kept)
                for (int64_t e = g * per; e < (g + 1) * per; e++) choice[e] = fill;
        }
    }
    top_k(choice, E, K, ids);
    float sum = 0.0f;
    for (int64_t k = 0; k < K; k++) sum += weights[k] = cfg->sigmoid ? score[ids[k]] : choice[ids[k]];
    for (int64_t k = 0; k < K; k++) {
        if (cfg->norm && cfg->sigmoid) weights[k] = weights[k] / (sum + 1e-20f);
        weights[k] *= scale;
    }
}

static void moe_route(int64_t T, int64_t H, int64_t E, int64_t K, const void *x, int bf16, const float *W,
                      const float *bias, const int64_t *cfg, float scale, float *weights, int64_t *ids,
                      int64_t *order, int64_t *counts, void *xs, int nthreads) {
    const size_t row = (size_t)H * (bf16 ? 2 : 4);
    const route_t rc = {cfg[0], cfg[1], cfg[2], cfg[3]};
#pragma omp parallel for schedule(static) num_threads(nthreads) if (T * E * H >= PARALLEL_ELEMS)
    for (int64_t t = 0; t < T; t++)
        route_token(H, E, K, (const char *)x + (size_t)t * row, bf16, W, bias, &rc, scale, weights + t * K,
                    ids + t * K);
    int64_t next[E];
    for (int64_t e = 0; e < E; e++) counts[e] = 0;
    for (int64_t p = 0; p < T * K; p++) counts[ids[p]]++;
    for (int64_t e = 0, at = 0; e < E; e++) {
        next[e] = at;
        at += counts[e];
    }
    for (int64_t p = 0; p < T * K; p++) order[next[ids[p]]++] = p;
#pragma omp parallel for schedule(static) num_threads(nthreads) if (T * K * H >= PARALLEL_ELEMS)
    for (int64_t r = 0; r < T * K; r++)
        memcpy((char *)xs + (size_t)r * row, (const char *)x + (size_t)(order[r] / K) * row, row);
}

// cfg: {groups, topk_groups, sigmoid, norm} (route_t)
void moe_route_bf16(int64_t T, int64_t H, int64_t E, int64_t K, const uint16_t *x, const float *W, const float *bias,
                    const int64_t *cfg, float scale, float *weights, int64_t *ids, int64_t *order, int64_t *counts,
                    uint16_t *xs, int nthreads) {
    moe_route(T, H, E, K, x, 1, W, bias, cfg, scale, weights, ids, order, counts, xs, nthreads);
}

void moe_route_f32(int64_t T, int64_t H, int64_t E, int64_t K, const float *x, const float *W, const float *bias,
                   const int64_t *cfg, float scale, float *weights, int64_t *ids, int64_t *order, int64_t *counts,
                   float *xs, int nthreads) {
    moe_route(T, H, E, K, x, 0, W, bias, cfg, scale, weights, ids, order, counts, xs, nthreads);
}

// One row of logits, float32 or bf16 (widened exactly, so the answer is the float32 row's) -> torch.argmax's
// answer: the first maximum, or the first NaN if any.
static inline float logit_at(const void *x, int64_t j, int bf16) {
    return bf16 ? widen1(((const uint16_t *)x)[j]) : ((const float *)x)[j];
}

static inline vf logits_v(const void *x, int64_t j, int bf16) {
    if (bf16) return widen((const uint16_t *)x + j);
    vf v;
    memcpy(&v, (const float *)x + j, sizeof(v));
    return v;
}

static int64_t argmax_row(const void *x, int64_t n, int bf16) {
    vf best = (vf){0} - INFINITY;
    vi at = (vi){0} - 1;
    vi nan = {0};
    vi idx;
    for (int i = 0; i < AL; i++) idx[i] = i;
    int64_t j = 0;
    for (; j + AL <= n && j + AL <= INT32_MAX; j += AL, idx += AL) {
        const vf v = logits_v(x, j, bf16);
        const vi gt = v > best;  // strict: a lane keeps its first maximum
        best = (vf)(((vi)v & gt) | ((vi)best & ~gt));
        at = (idx & gt) | (at & ~gt);
        nan |= v != v;
    }
    int64_t bi = -1;
    float bv = -INFINITY;
    for (int i = 0; i < AL; i++)  // across lanes: the largest value, then the smallest index
        if (at[i] >= 0 && (best[i] > bv || (best[i] == bv && at[i] < bi))) bv = best[i], bi = at[i];
    int has_nan = 0;
    for (int i = 0; i < AL; i++) has_nan |= nan[i] != 0;
    for (; j < n; j++) {
        const float v = logit_at(x, j, bf16);
        if (v != v) has_nan = 1;
        else if (v > bv) bv = v, bi = j;
    }
    if (has_nan)
        for (j = 0; j < n; j++) {
            const float v = logit_at(x, j, bf16);
            if (v != v) return j;
        }
    return bi < 0 ? 0 : bi;
}

// logits: [rows][n] float32 -> out[rows].
void argmax_f32(int64_t rows, int64_t n, const float *logits, int64_t *out, int nthreads) {
#pragma omp parallel for schedule(static) num_threads(nthreads) if (rows * n >= PARALLEL_ELEMS)
    for (int64_t r = 0; r < rows; r++) out[r] = argmax_row(logits + r * n, n, 0);
}

// logits: [rows][n] bf16 -> out[rows]: greedy decoding reads the LM head's bf16 output as it is, without the
// float32 copy (a 32 x 151,936 batch: 19 MB written and read again each step).
void argmax_bf16(int64_t rows, int64_t n, const uint16_t *logits, int64_t *out, int nthreads) {
#pragma omp parallel for schedule(static) num_threads(nthreads) if (rows * n >= PARALLEL_ELEMS)
    for (int64_t r = 0; r < rows; r++) out[r] = argmax_row(logits + r * n, n, 1);
}

// logits: [rows][n] float32 (already tempered and masked, -inf = excluded), u: [rows] in [0, 1) -> out[rows]: the
// first token whose cumulative weight exceeds u * total, weights exp(x - max) in float32. Sums are float64 over
// blocks of AL tokens in order: each block's sum is kept, so the search walks the same sums that made the total and
// then one block's tokens. A token of zero weight is never drawn; where rounding leaves u * total at or past
// the end, the last token with weight is. A row with no finite logit gives token 0.
static inline vf block_of(const float *x, int64_t b, int64_t n) {  // tokens [AL b, AL b + AL); -inf past n
    vf v;
    if (b * AL + AL <= n) {
        memcpy(&v, x + b * AL, sizeof(v));  // a fixed size: one vector load
    } else {
        v = (vf){0} - INFINITY;
        memcpy(&v, x + b * AL, (size_t)((n - b * AL) * 4));
    }
    return v;
}

void sample_f32(int64_t rows, int64_t n, const float *logits, const double *u, int64_t *out, int nthreads) {
#pragma omp parallel num_threads(nthreads) if (rows * n >= PARALLEL_ELEMS)
    {
        const int64_t nb = (n + AL - 1) / AL;
        double *sums = malloc((size_t)(nb > 0 ? nb : 1) * sizeof(double));
#pragma omp for schedule(static)
        for (int64_t r = 0; r < rows; r++) {
            const float *x = logits + r * n;
            vf best = (vf){0} - INFINITY;
            for (int64_t b = 0; b < nb; b++) {
                const vf v = block_of(x, b, n);
                best = (vf)(((vi)v & (vi)(v > best)) | ((vi)best & ~(vi)(v > best)));
            }
            const float mx = hmax_v(best);
            if (!(mx > -INFINITY) || sums == NULL) {
                out[r] = 0;
                continue;
            }
            double total = 0.0;
            int64_t last = 0;  // the last block with weight (the maximum's has some)
            for (int64_t b = 0; b < nb; b++) {
                const double s = hsum_v(vexp_v(block_of(x, b, n) - mx));
                sums[b] = s;
                total += s;
                if (s > 0.0) last = b;
            }
            const double target = u[r] * total;
            double before = 0.0;
            int64_t b = 0;
            while (b < nb && !(before + sums[b] > target)) before += sums[b++];
            const int past = b == nb;  // u * total rounded up to the total: the last token with weight
            if (past) b = last;
            const vf w = vexp_v(block_of(x, b, n) - mx);
            int64_t pick = -1;
            for (int i = 0; i < AL; i++) {
                if (!(w[i] > 0.0f)) continue;
                pick = b * AL + i;  // the last token with weight so far: the answer if rounding leaves none past
                before += w[i];
                if (!past && before > target) break;
            }
            out[r] = pick < 0 ? 0 : pick;
        }
        free(sums);
    }
}
