// Decode attention from the paged bf16 KV cache with AVX512-BF16 dot products (engine/kernels/decode_attn_dp.py):
// the same call as the portable kernel (decode_attn.c), for CPUs that have VDPBF16PS but no AMX tiles (Zen 4 and
// 5, Cooper Lake). The portable kernel widens every K and V value to float32 and spends more time on that, on
// horizontal sums and on spilled accumulators than on arithmetic. Here, per 16-token slice of a cache block:
//   - each score is D / 32 bf16 dot products (two bf16 pairs a float32 lane) and sixteen tokens' partial sums
//     become one vector of scores in one shuffle tree (reduce16);
//   - the softmax runs on that vector, and P is rounded to bf16, as flash attention does;
//   - P.V is bf16 dot products over pairs of tokens: V rows of tokens 2i, 2i+1 interleaved (unpacklo/hi), the
//     pair of probabilities broadcast, float32 accumulators in the interleaved lane order until the end.
// PF_AHEAD > 0: each slice asks for the task's rows of the slice that many ahead (K and V). The blocks of a
// sequence lie anywhere in the pool, so the hardware prefetchers lose the stream at every block; on a 2-core Zen 5,
// 24 layers' caches (75 MB, Qwen2-0.5B's heads, 32 x 192 tokens) took 240-270 us a layer against 300 without.
// On a Zen 4 it measured no faster. Built both ways (decode_attn_dp.py); the op choice times both, cold.
//
// Requires: bf16 cache, block_size % 16 == 0, head_dim % 32 == 0 and <= 32 * MAX_STEPS, G = H / KV <= 16.
// Built twice (decode_attn_dp.py): for attention heads (MAX_STEPS 8: head_dim <= 256), and for MLA's latent rows
// (MAX_STEPS 18: DeepSeek's 512 + 64 columns, one "KV head" that is K and V at once, all query heads over it),
// so the heads' build keeps its smaller per-task state.
#if !defined(__AVX512BF16__) || !defined(__AVX512BW__)
#error "this kernel needs AVX512-BF16"
#endif
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "avx512_math.h"

#ifndef MAX_STEPS
#define MAX_STEPS 8  // head_dim / 32
#endif
#define MAX_G 16
#define MAX_HT 32  // query heads one task keeps state for
#ifndef PF_AHEAD
#define PF_AHEAD 0  // slices ahead to prefetch; 0: none
#endif
#ifndef PV_G
#define PV_G 4  // P.V accumulators: heads x vectors of 16 lanes
#endif
#ifndef PV_J
#define PV_J 4
#endif

static inline __m512 pair_sum(__m512 a, __m512 b, __m512i lo, __m512i hi) {
    return _mm512_add_ps(_mm512_permutex2var_ps(a, lo, b), _mm512_permutex2var_ps(a, hi, b));
}

// Sixteen vectors -> one vector of their sixteen horizontal sums, in order (lane t = the sum of v[t]).
static inline __m512 reduce16(const __m512 v[16]) {
    const __m512i l1 = _mm512_set_epi32(23, 22, 21, 20, 19, 18, 17, 16, 7, 6, 5, 4, 3, 2, 1, 0);
    const __m512i l2 = _mm512_set_epi32(27, 26, 25, 24, 19, 18, 17, 16, 11, 10, 9, 8, 3, 2, 1, 0);
    const __m512i l3 = _mm512_set_epi32(29, 28, 25, 24, 21, 20, 17, 16, 13, 12, 9, 8, 5, 4, 1, 0);
    const __m512i l4 = _mm512_set_epi32(30, 28, 26, 24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0);
    const __m512i h1 = _mm512_add_epi32(l1, _mm512_set1_epi32(8)), h2 = _mm512_add_epi32(l2, _mm512_set1_epi32(4));
    const __m512i h3 = _mm512_add_epi32(l3, _mm512_set1_epi32(2)), h4 = _mm512_add_epi32(l4, _mm512_set1_epi32(1));
    __m512 r1[8], r2[4], r3[2];
    for (int i = 0; i < 8; i++) r1[i] = pair_sum(v[2 * i], v[2 * i + 1], l1, h1);
    for (int i = 0; i < 4; i++) r2[i] = pair_sum(r1[2 * i], r1[2 * i + 1], l2, h2);
    for (int i = 0; i < 2; i++) r3[i] = pair_sum(r2[2 * i], r2[2 * i + 1], l3, h3);
    return pair_sum(r3[0], r3[1], l4, h4);
}

// The first row of the 16-token slice holding position `pos` (a multiple of 16) for KV head `kvh`.
static inline const uint16_t *slice_of(const uint16_t *cache, int64_t pos, const int64_t *table, int64_t bs,
                                       int64_t KV, int64_t kvh, int64_t D) {
    return cache + ((table[pos / bs] * bs + pos % bs) * KV + kvh) * D;
}

// One sequence's KV heads [k0, k1) (their G query heads each), slice by slice: each 16-token slice of a block is
// read for all of the task's KV heads before the next slice, which walks the block's rows in address order (the
// cache keeps a token's KV heads side by side) instead of one strided head at a time.
static inline __attribute__((always_inline)) void task(int64_t b, int64_t k0, int64_t k1, int64_t H, int64_t KV,
                                                       int64_t D, const uint16_t *q, const uint16_t *kc,
                                                       const uint16_t *vc, int64_t bs, const int64_t *tables,
                                                       int64_t W, int64_t L, float scale, uint16_t *out,
                                                       const int64_t steps) {
    const int64_t G = H / KV, nv = 2 * steps, stride = KV * D, NH = (k1 - k0) * G;  // NH <= MAX_HT
    const int64_t *table = tables + b * W;
    const uint16_t *qb = q + (b * H + k0 * G) * D;  // the task's query heads are adjacent
    __m512i qv[MAX_HT][MAX_STEPS];
    __m512 o[MAX_HT][MAX_STEPS * 2];
    float m[MAX_HT], l[MAX_HT];
    for (int64_t h = 0; h < NH; h++) {
        for (int64_t s = 0; s < steps; s++) qv[h][s] = _mm512_loadu_si512((const void *)(qb + h * D + 32 * s));
        for (int64_t j = 0; j < nv; j++) o[h][j] = _mm512_setzero_ps();
        m[h] = -INFINITY;
        l[h] = 0.0f;
    }
    const __m512 vscale = _mm512_set1_ps(scale), ninf = _mm512_set1_ps(-INFINITY);
    __m512i V2[8 * MAX_STEPS * 2];  // one KV head's V of this slice, token pairs interleaved: [pair * nv + j]
    uint32_t P[MAX_G][8];            // bf16 probabilities of tokens 2i, 2i+1, one dword per pair
    for (int64_t c = 0; c < L; c += 16) {
        const int64_t n = L - c < 16 ? L - c : 16, pairs = (n + 1) / 2;
        const __mmask16 valid = (__mmask16)((1u << n) - 1u);
        const int64_t first = (table[c / bs] * bs + c % bs) * KV;  // the slice's first row, KV head 0
#if PF_AHEAD > 0
        if (c + 16 * PF_AHEAD < L) {
            const int64_t ahead = c + 16 * PF_AHEAD, nrow = L - ahead < 16 ? L - ahead : 16;
            const int64_t row = (table[ahead / bs] * bs + ahead % bs) * KV + k0;
            const char *kp = (const char *)(kc + row * D), *vp = (const char *)(vc + row * D);
            const int64_t bytes = ((nrow - 1) * KV + (k1 - k0)) * D * 2;
            for (int64_t off = 0; off < bytes; off += 64) {
                _mm_prefetch(kp + off, _MM_HINT_T0);
                _mm_prefetch(vp + off, _MM_HINT_T0);
            }
        }
#endif
        for (int64_t kh = k0; kh < k1; kh++) {
            const uint16_t *kr = kc + (first + kh) * D, *vr = vc + (first + kh) * D;
            __m512i *qh = qv[(kh - k0) * G];
            __m512 *oh = o[(kh - k0) * G];
            float *mh = m + (kh - k0) * G, *lh = l + (kh - k0) * G;
            __m512 sc[MAX_G];
            for (int64_t g = 0; g < G; g++) {
                __m512 acc[16];
                for (int t = 0; t < 16; t++) {  // rows past n are read (they are in the block); their scores masked
                    __m512 a = _mm512_setzero_ps();
                    for (int64_t s = 0; s < steps; s++)
                        a = _mm512_dpbf16_ps(a, (__m512bh)qh[g * MAX_STEPS + s],
                                             (__m512bh)_mm512_loadu_si512((const void *)(kr + t * stride + 32 * s)));
                    acc[t] = a;
                }
                sc[g] = _mm512_mask_mov_ps(ninf, valid, _mm512_mul_ps(reduce16(acc), vscale));
            }
            // NOTE: the softmax in short loops across the heads, not one long body per head: each head's steps
            // form one dependent chain (max, exp, sum), and the CPU overlaps the chains only when they sit close.
            float mx[MAX_G], alpha[MAX_G];
            for (int64_t g = 0; g < G; g++) mx[g] = fmaxf(mh[g], _mm512_reduce_max_ps(sc[g]));
            for (int64_t g = 0; g < G; g++) alpha[g] = expf(mh[g] - mx[g]);  // exp(-inf) = 0 on the first slice
            for (int64_t g = 0; g < G; g++) {
                // exp512 clamps its input, so masked lanes are zeroed outright rather than left at exp(-87)
                const __m512 p = _mm512_maskz_mov_ps(valid, exp512(_mm512_sub_ps(sc[g], _mm512_set1_ps(mx[g]))));
                lh[g] = lh[g] * alpha[g] + _mm512_reduce_add_ps(p);
                mh[g] = mx[g];
                _mm256_storeu_si256((__m256i *)P[g], (__m256i)_mm512_cvtneps_pbh(p));
            }
            for (int64_t i = 0; i < pairs; i++) {  // V rows past n are zero: a zero weight times stale memory is NaN
                const __mmask32 second = 2 * i + 1 < n ? ~0u : 0u;
                for (int64_t s = 0; s < steps; s++) {
                    const __m512i x = _mm512_loadu_si512((const void *)(vr + 2 * i * stride + 32 * s));
                    const __m512i y = _mm512_maskz_loadu_epi16(second, vr + (2 * i + 1) * stride + 32 * s);
                    V2[i * nv + 2 * s] = _mm512_unpacklo_epi16(x, y);
                    V2[i * nv + 2 * s + 1] = _mm512_unpackhi_epi16(x, y);
                }
            }
            // P.V with up to PV_G x PV_J accumulators in registers, independent chains: one dot product's
            // latency is hidden behind the others', where one accumulator per (head, vector) would wait on each
            for (int64_t g0 = 0; g0 < G; g0 += PV_G)
                for (int64_t j0 = 0; j0 < nv; j0 += PV_J) {
                    __m512 acc[PV_G][PV_J];
                    for (int gg = 0; gg < PV_G; gg++)
                        for (int jj = 0; jj < PV_J; jj++)
                            if (g0 + gg < G && j0 + jj < nv)
                                acc[gg][jj] = _mm512_mul_ps(oh[(g0 + gg) * MAX_STEPS * 2 + j0 + jj],
                                                            _mm512_set1_ps(alpha[g0 + gg]));
                    for (int64_t i = 0; i < pairs; i++)
                        for (int gg = 0; gg < PV_G; gg++) {
                            if (g0 + gg >= G) break;
                            const __m512bh pw = (__m512bh)_mm512_set1_epi32((int)P[g0 + gg][i]);
                            for (int jj = 0; jj < PV_J; jj++)
                                if (j0 + jj < nv)
                                    acc[gg][jj] = _mm512_dpbf16_ps(acc[gg][jj], pw, (__m512bh)V2[i * nv + j0 + jj]);
                        }
                    for (int gg = 0; gg < PV_G; gg++)
                        for (int jj = 0; jj < PV_J; jj++)
                            if (g0 + gg < G && j0 + jj < nv) oh[(g0 + gg) * MAX_STEPS * 2 + j0 + jj] = acc[gg][jj];
                }
        }
    }
    for (int64_t h = 0; h < NH; h++)
        store_deinterleaved(out + (b * H + k0 * G + h) * D, o[h], steps,
                            _mm512_set1_ps(l[h] > 0.0f ? 1.0f / l[h] : 0.0f));
}

// q, out: [B][H][D] bf16; caches: [blocks][bs][KV][D] bf16; tables: [B][W] block ids; ctx_lens: [B].
void decode_attn_dp_bf16(int64_t B, int64_t H, int64_t KV, int64_t D, const uint16_t *q, const uint16_t *kc,
                         const uint16_t *vc, int64_t bs, const int64_t *tables, int64_t W, const int64_t *ctx_lens,
                         float scale, uint16_t *out, int nthreads) {
    // KV heads per task: as many as MAX_HT query heads hold, fewer while that leaves under two tasks per thread
    int64_t per = MAX_HT / (H / KV);
    if (per > KV) per = KV;
    while (per > 1 && B * ((KV + per - 1) / per) < 2 * nthreads) per = (per + 1) / 2;
    const int64_t groups = (KV + per - 1) / per;
#pragma omp parallel for schedule(dynamic, 1) num_threads(nthreads)
    for (int64_t t = 0; t < B * groups; t++) {
        const int64_t b = t / groups, k0 = (t % groups) * per, k1 = k0 + per < KV ? k0 + per : KV;
#define TASK(steps) task(b, k0, k1, H, KV, D, q, kc, vc, bs, tables, W, ctx_lens[b], scale, out, steps)
        // the common widths get their own compiled copies: a constant step count keeps the sums in registers
        switch (D) {
        case 64: TASK(2); break;
        case 128: TASK(4); break;
#if MAX_STEPS >= 18
        case 576: TASK(18); break;  // MLA's latent rows (DeepSeek-V2/V3: 512 + 64)
#endif
        default: TASK(D / 32); break;
        }
#undef TASK
    }
}
