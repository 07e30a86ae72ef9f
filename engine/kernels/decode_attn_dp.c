// Decode attention from the paged bf16 KV cache with AVX512-BF16 dot products (engine/kernels/decode_attn_dp.py):
// the same call as the portable kernel (decode_attn.c), for CPUs that have VDPBF16PS but no AMX tiles (Zen 4 and
// 5, Cooper Lake). The portable kernel widens every K and V value to float32 and spends more time on that, on
// horizontal sums and on spilled accumulators than on arithmetic. Here, per 16-token slice of a cache block:
//   - scores in float32 from bf16 dot products (two bf16 pairs a float32 lane), one vector of 16 tokens per head;
//   - the softmax runs on that vector, and P is rounded to bf16, as flash attention does;
//   - P.V is bf16 dot products over pairs of tokens: V rows of tokens 2i, 2i+1 interleaved (unpacklo/hi), the
//     pair of probabilities broadcast, float32 accumulators in the interleaved lane order until the end.
// Four entry points, one per (scores, prefetch) pair, each its own compiled copy, and a fifth that takes a chunk of
// 256 tokens in two passes (`_c`, at the end); the op choice times them cold:
//   - scores by reduction (decode_attn_dp_bf16, _pf): per head, sixteen tokens' dot products over head_dim, then
//     one shuffle tree (reduce16) turns their partial sums into one vector of scores;
//   - scores over transposed keys (_t, _t_pf): the slice's sixteen K rows are transposed once per KV head (16 x 16
//     dword transposes: lane t of vector p holds dims 2p, 2p+1 of token t), then each query head's scores are
//     D / 2 dot products with its broadcast dim pairs, no reduction; the G heads share the transposition. Hot, on
//     a 2-core Zen 4: faster at G = 3 and 7 of 64 dims (~10%), slower at G = 1, and at G = 4 of 128;
//   - prefetch (_pf, _t_pf): the slice's reads ask for the next slice's rows, one line of K and V a read, into L2
//     (struct Ahead). The blocks of a sequence lie anywhere in the pool, so the hardware prefetchers lose the
//     stream at every block. Cold, 24 layers' caches of Qwen2-0.5B's heads, 32 sequences of 256 tokens, on a
//     2-core Zen 4: 581 us a layer plain, 436 with the prefetch, 318 with both. Asking for a whole slice at once,
//     as this kernel did before, measured no faster than no prefetch (presumably the requests queue up together
//     and stall the loads behind them).
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

// The next slice's rows of a task's KV heads, asked for one 64-byte line of K and one of V at a time, in address
// order: row by row, and within a row the task's heads side by side. WHY address order: asked for in the order of
// the reads (one head's rows, 256 bytes apart) the same lines measured no faster than no prefetch at all; in order,
// they are 1.8x faster cold (the header's case; why is a guess: the hardware prefetcher may follow the requests).
typedef struct {
    const uint16_t *k, *v;  // the next slice's first row of the task's first KV head, in each cache
    int64_t at, col, width, stride;  // the next line: row offset `at` + `col`; `width` columns of the task a row
} Ahead;

static inline void ask_next(Ahead *a) {
    _mm_prefetch((const char *)(a->k + a->at + a->col), _MM_HINT_T1);
    // MLA's latent rows are K and V at once (the same pointer): one request is enough
    if (a->v != a->k) _mm_prefetch((const char *)(a->v + a->at + a->col), _MM_HINT_T1);
    a->col += 32;  // bf16 values a line
    if (a->col == a->width) a->col = 0, a->at += a->stride;
}

// The first row of the 16-token slice starting at position `pos` (a multiple of 16), KV head 0.
static inline int64_t slice_row(int64_t pos, const int64_t *table, int64_t bs, int64_t KV) {
    return (table[pos / bs] * bs + pos % bs) * KV;
}

// One query head's scores over a 16-token slice from the transposed keys kt: D / 2 dot products with the head's
// broadcast dim pairs, for four heads at a time with two accumulators each (eight independent chains: one head's
// chain alone waits on the dot product's latency at every step; measured 1.45x on a Zen 4 against head by head).
static inline __attribute__((always_inline)) void scores_transposed(const __m512i *kt, const uint32_t *qd, int64_t G,
                                                                    int64_t D, __m512 *sc) {
    for (int64_t g0 = 0; g0 < G; g0 += 4) {
        const int64_t ng = G - g0 < 4 ? G - g0 : 4;
        __m512 a[4][2];
        for (int gg = 0; gg < 4; gg++) a[gg][0] = a[gg][1] = _mm512_setzero_ps();
        for (int64_t p = 0; p < D / 2; p += 2)
            for (int gg = 0; gg < 4; gg++) {
                if (gg >= ng) break;
                const uint32_t *qg = qd + (g0 + gg) * D / 2 + p;
                a[gg][0] = _mm512_dpbf16_ps(a[gg][0], (__m512bh)_mm512_set1_epi32((int)qg[0]), (__m512bh)kt[p]);
                a[gg][1] = _mm512_dpbf16_ps(a[gg][1], (__m512bh)_mm512_set1_epi32((int)qg[1]), (__m512bh)kt[p + 1]);
            }
        for (int gg = 0; gg < ng; gg++) sc[g0 + gg] = _mm512_add_ps(a[gg][0], a[gg][1]);
    }
}

// A 16-token slice's scores for one KV head's G query heads over transposed keys: its rows of K from kr (rows
// `stride` apart; rows past the context are read, they are in the block, and their scores are masked by the
// caller), transposed, then scores_transposed. Each row read asks for one line of a and of b where they are given.
static inline __attribute__((always_inline)) void slice_scores(const uint16_t *kr, int64_t stride,
                                                               const int64_t steps, const uint32_t *qd,
                                                               const int64_t G, int64_t D, Ahead *a, Ahead *b,
                                                               __m512 *sc) {
    __m512i kt[16 * MAX_STEPS];  // kt[p] lane t: dims 2p, 2p+1 of token t
    for (int64_t s = 0; s < steps; s++) {
        __m512i rows[16];
        for (int t = 0; t < 16; t++) {
            rows[t] = _mm512_loadu_si512((const void *)(kr + t * stride + 32 * s));
            if (a) ask_next(a);
            if (b) ask_next(b);
        }
        transpose16(rows, kt + 16 * s);
    }
    scores_transposed(kt, qd, G, D, sc);
}

// One sequence's KV heads [k0, k1) (their G query heads each), slice by slice: each 16-token slice of a block is
// read for all of the task's KV heads before the next slice, which walks the block's rows in address order (the
// cache keeps a token's KV heads side by side) instead of one strided head at a time. TRANS: scores over
// transposed keys; PF: ask for the next slice's rows while reading this one's (the header).
static inline __attribute__((always_inline)) void task(int64_t b, int64_t k0, int64_t k1, int64_t H, int64_t KV,
                                                       int64_t D, const uint16_t *q, const uint16_t *kc,
                                                       const uint16_t *vc, int64_t bs, const int64_t *tables,
                                                       int64_t W, int64_t L, float scale, uint16_t *out,
                                                       const int64_t steps, const int TRANS, const int PF) {
    const int64_t G = H / KV, nv = 2 * steps, stride = KV * D, NH = (k1 - k0) * G;  // NH <= MAX_HT
    const int64_t *table = tables + b * W;
    const uint16_t *qb = q + (b * H + k0 * G) * D;  // the task's query heads are adjacent
    __m512i qv[MAX_HT][MAX_STEPS];
    __m512 o[MAX_HT][MAX_STEPS * 2];
    __m512 lv[MAX_HT];  // each head's softmax denominator, summed across lanes only at the end
    float m[MAX_HT];
    for (int64_t h = 0; h < NH; h++) {
        for (int64_t s = 0; s < steps; s++) qv[h][s] = _mm512_loadu_si512((const void *)(qb + h * D + 32 * s));
        for (int64_t j = 0; j < nv; j++) o[h][j] = _mm512_setzero_ps();
        m[h] = -INFINITY;
        lv[h] = _mm512_setzero_ps();
    }
    const __m512 vscale = _mm512_set1_ps(scale), ninf = _mm512_set1_ps(-INFINITY);
    const __mmask16 gmask = (__mmask16)((1u << G) - 1u);
    __m512i V2[8 * MAX_STEPS * 2];  // one KV head's V of this slice, token pairs interleaved: [pair * nv + j]
    uint32_t P[MAX_G][8];            // bf16 probabilities of tokens 2i, 2i+1, one dword per pair
    for (int64_t c = 0; c < L; c += 16) {
        const int64_t n = L - c < 16 ? L - c : 16, pairs = (n + 1) / 2;
        const __mmask16 valid = (__mmask16)((1u << n) - 1u);
        const int64_t first = slice_row(c, table, bs, KV);
        // the next slice's first row (this one's on the last slice: asking again for lines at hand is harmless);
        // rows past its context's end are still inside its block, and a prefetch never faults
        const int64_t ahead = (PF && c + 16 < L ? slice_row(c + 16, table, bs, KV) : first) + k0;
        Ahead pf = {kc + ahead * D, vc + ahead * D, 0, 0, (k1 - k0) * D, stride};  // 16 rows: one line a K row read
        for (int64_t kh = k0; kh < k1; kh++) {
            const uint16_t *kr = kc + (first + kh) * D, *vr = vc + (first + kh) * D;
            __m512i *qh = qv[(kh - k0) * G];
            __m512 *oh = o[(kh - k0) * G];
            float *mh = m + (kh - k0) * G;
            __m512 *lvh = lv + (kh - k0) * G;
            __m512 sc[MAX_G];
            if (TRANS) {
                slice_scores(kr, stride, steps, (const uint32_t *)(qb + (kh - k0) * G * D), G, D, PF ? &pf : NULL,
                             NULL, sc);
                for (int64_t g = 0; g < G; g++) sc[g] = _mm512_mask_mov_ps(ninf, valid, _mm512_mul_ps(sc[g], vscale));
            } else {
                for (int64_t g = 0; g < G; g++) {
                    __m512 acc[16];
                    for (int t = 0; t < 16; t++) {
                        __m512 a = _mm512_setzero_ps();
                        for (int64_t s = 0; s < steps; s++) {
                            const __m512i k = _mm512_loadu_si512((const void *)(kr + t * stride + 32 * s));
                            a = _mm512_dpbf16_ps(a, (__m512bh)qh[g * MAX_STEPS + s], (__m512bh)k);
                            if (PF && g == 0) ask_next(&pf);
                        }
                        acc[t] = a;
                    }
                    sc[g] = _mm512_mask_mov_ps(ninf, valid, _mm512_mul_ps(reduce16(acc), vscale));
                }
            }
            // The running maxima of the G heads in one vector: one exp512 gives every head's rescale factor (G
            // scalar expf calls measured 1.3x slower over the whole kernel); each head's sum stays a vector.
            float mx[MAX_G], alpha[MAX_G];
            for (int64_t g = 0; g < G; g++) mx[g] = fmaxf(mh[g], _mm512_reduce_max_ps(sc[g]));
            const __m512 mnew = _mm512_maskz_loadu_ps(gmask, mx);
            // the first slice: exp512(-inf) clamps to exp(-87), times sums and outputs that are still zero
            _mm512_mask_storeu_ps(alpha, gmask, exp512(_mm512_sub_ps(_mm512_maskz_loadu_ps(gmask, mh), mnew)));
            _mm512_mask_storeu_ps(mh, gmask, mnew);
            for (int64_t g = 0; g < G; g++) {
                // exp512 clamps its input, so masked lanes are zeroed outright rather than left at exp(-87)
                const __m512 p = _mm512_maskz_mov_ps(valid, exp512(_mm512_sub_ps(sc[g], _mm512_set1_ps(mx[g]))));
                lvh[g] = _mm512_fmadd_ps(lvh[g], _mm512_set1_ps(alpha[g]), p);
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
    for (int64_t h = 0; h < NH; h++) {
        const float l = _mm512_reduce_add_ps(lv[h]);
        store_deinterleaved(out + (b * H + k0 * G + h) * D, o[h], steps, _mm512_set1_ps(l > 0.0f ? 1.0f / l : 0.0f));
    }
}

// The same attention a chunk of CHUNK tokens at a time, in two passes over the chunk (the `_c` entry): every
// slice's scores into S (keys transposed, as TRANS), then the softmax of the whole chunk (one rescale of the
// outputs per chunk, not per slice), then P.V with each head group's accumulators in registers for the whole
// chunk. WHY: per 16-token slice the one-pass task reloaded, rescaled and stored every head's outputs, reduced
// and exponentiated the running maxima and sent them through memory; on a 2-core Zen 4 (Qwen2-0.5B's heads,
// 32 x 256 tokens, one thread, caches hot) P.V took 36% of its time and the softmax 23%, the scores 9%.
// Memory: a slice's V rows are asked for while its keys are read (the second pass finds them in L2), and the
// second pass asks for the next chunk's keys (at 1,024 tokens 0.853 → 0.820 ms). Two threads, ms a layer (ad
// hoc, alternating, three runs): 32 x 256 tokens hot 0.148-0.160 against `_t_pf`'s 0.196-0.210, cold (24+ layers'
// caches) 0.237-0.260 against 0.255-0.278; 32 x 1,024 cold 0.820-0.904 against 0.896-0.949. A constant G (the
// common group sizes get their own copies) gave 6-8% of that. Cold, it is bound by how fast one core brings the
// scattered 4 KB blocks in: asking for V during P.V, two slices ahead, or the next sequence's keys did not help.
// 64 and 128 measured slower at 256 and 1,024 tokens, on a Zen 4 only: elsewhere the op choice's timing decides
// whether this entry runs at all
#define CHUNK 256
static inline __attribute__((always_inline)) void task_chunked(int64_t b, int64_t k0, int64_t k1, int64_t H,
                                                               int64_t KV, int64_t D, const uint16_t *q,
                                                               const uint16_t *kc, const uint16_t *vc, int64_t bs,
                                                               const int64_t *tables, int64_t W, int64_t L,
                                                               float scale, uint16_t *out, const int64_t steps,
                                                               const int64_t G) {
    const int64_t nv = 2 * steps, stride = KV * D, NH = (k1 - k0) * G;  // NH <= MAX_HT
    const int64_t *table = tables + b * W;
    const uint16_t *qb = q + (b * H + k0 * G) * D;  // the task's query heads are adjacent
    __m512 o[MAX_HT][MAX_STEPS * 2];
    float m[MAX_HT], l[MAX_HT];
    for (int64_t h = 0; h < NH; h++) {
        for (int64_t j = 0; j < nv; j++) o[h][j] = _mm512_setzero_ps();
        m[h] = -INFINITY;
        l[h] = 0.0f;
    }
    const __m512 vscale = _mm512_set1_ps(scale), ninf = _mm512_set1_ps(-INFINITY);
    float S[MAX_HT][CHUNK] __attribute__((aligned(64)));     // the chunk's scores, then nothing (P holds them)
    uint32_t P[MAX_HT][CHUNK / 2] __attribute__((aligned(64)));  // bf16 probabilities of tokens 2i, 2i+1
    for (int64_t c0 = 0; c0 < L; c0 += CHUNK) {
        const int64_t nc = L - c0 < CHUNK ? L - c0 : CHUNK;
        __m512 vmax[MAX_HT];
        for (int64_t h = 0; h < NH; h++) vmax[h] = ninf;
        for (int64_t s0 = 0; s0 < nc; s0 += 16) {
            const int64_t n = nc - s0 < 16 ? nc - s0 : 16;
            const __mmask16 valid = (__mmask16)((1u << n) - 1u);
            const int64_t first = slice_row(c0 + s0, table, bs, KV);
            const int64_t ahead = (c0 + s0 + 16 < L ? slice_row(c0 + s0 + 16, table, bs, KV) : first) + k0;
            Ahead pf = {kc + ahead * D, kc + ahead * D, 0, 0, (k1 - k0) * D, stride};  // the next slice's keys
            Ahead pv = {vc + (first + k0) * D, vc + (first + k0) * D, 0, 0, (k1 - k0) * D, stride};  // this V
            for (int64_t kh = k0; kh < k1; kh++) {
                __m512 sc[MAX_G];
                slice_scores(kc + (first + kh) * D, stride, steps, (const uint32_t *)(qb + (kh - k0) * G * D), G, D,
                             &pf, &pv, sc);
                for (int64_t g = 0; g < G; g++) {
                    const int64_t h = (kh - k0) * G + g;
                    const __m512 v = _mm512_mask_mov_ps(ninf, valid, _mm512_mul_ps(sc[g], vscale));
                    _mm512_store_ps(S[h] + s0, v);
                    vmax[h] = _mm512_max_ps(vmax[h], v);
                }
            }
        }
        // the chunk's softmax: each head's new maximum, its outputs' rescale, its probabilities as bf16 pairs
        float alpha[MAX_HT];
        for (int64_t h = 0; h < NH; h++) {
            const float mx = fmaxf(m[h], _mm512_reduce_max_ps(vmax[h]));
            alpha[h] = m[h] == -INFINITY ? 0.0f : expf(m[h] - mx);
            m[h] = mx;
            __m512 sum = _mm512_setzero_ps();
            const __m512 vm = _mm512_set1_ps(mx);
            for (int64_t s0 = 0; s0 < nc; s0 += 16) {
                const int64_t n = nc - s0 < 16 ? nc - s0 : 16;
                // exp512 clamps its input, so masked lanes are zeroed outright rather than left at exp(-87)
                const __m512 p = _mm512_maskz_mov_ps((__mmask16)((1u << n) - 1u),
                                                     exp512(_mm512_sub_ps(_mm512_load_ps(S[h] + s0), vm)));
                sum = _mm512_add_ps(sum, p);
                _mm256_store_si256((__m256i *)(P[h] + s0 / 2), (__m256i)_mm512_cvtneps_pbh(p));
            }
            l[h] = l[h] * alpha[h] + _mm512_reduce_add_ps(sum);
        }
        // P.V: tokens 2i, 2i+1 of the chunk as interleaved V rows, PV_G heads x PV_J vectors in registers
        const int64_t pairs = (nc + 1) / 2;
        for (int64_t kh = k0; kh < k1; kh++)
            for (int64_t g0 = 0; g0 < G; g0 += PV_G)
                for (int64_t j0 = 0; j0 < nv; j0 += PV_J) {
                    const int64_t h0 = (kh - k0) * G + g0;
                    __m512 acc[PV_G][PV_J];
                    for (int gg = 0; gg < PV_G; gg++)
                        for (int jj = 0; jj < PV_J; jj++)
                            if (g0 + gg < G && j0 + jj < nv)
                                acc[gg][jj] = _mm512_mul_ps(o[h0 + gg][j0 + jj], _mm512_set1_ps(alpha[h0 + gg]));
                    for (int64_t i = 0; i < pairs; i++) {
                        const int64_t t = 2 * i;  // within the chunk; a pair never straddles a block (bs even)
                        const uint16_t *vr = vc + (slice_row(c0 + t - t % 16, table, bs, KV) + kh) * D +
                                             (t % 16) * stride;
                        // the second row past the context: zero (a zero weight times stale memory is NaN)
                        const __mmask32 second = t + 1 < nc ? ~0u : 0u;
                        // the first walk asks for the next chunk's keys, rows t, t + 1 of it, all the task's heads
                        if (kh == k0 && g0 == 0 && j0 == 0 && c0 + CHUNK + t < L) {
                            const int64_t nt = c0 + CHUNK + t;
                            const char *kr = (const char *)(kc + (slice_row(nt - nt % 16, table, bs, KV) + k0) * D +
                                                            (nt % 16) * stride);
                            for (int64_t e = 0; e < (k1 - k0) * D * 2; e += 64) {
                                _mm_prefetch(kr + e, _MM_HINT_T1);
                                if (nt + 1 < L) _mm_prefetch(kr + 2 * stride + e, _MM_HINT_T1);
                            }
                        }
                        __m512i V2[PV_J];
                        for (int jj = 0; jj < PV_J; jj++) {
                            if (j0 + jj >= nv) break;
                            const int64_t st = (j0 + jj) / 2;
                            const __m512i x = _mm512_loadu_si512((const void *)(vr + 32 * st));
                            const __m512i y = _mm512_maskz_loadu_epi16(second, vr + stride + 32 * st);
                            V2[jj] = (j0 + jj) % 2 ? _mm512_unpackhi_epi16(x, y) : _mm512_unpacklo_epi16(x, y);
                        }
                        for (int gg = 0; gg < PV_G; gg++) {
                            if (g0 + gg >= G) break;
                            const __m512bh pw = (__m512bh)_mm512_set1_epi32((int)P[h0 + gg][i]);
                            for (int jj = 0; jj < PV_J; jj++)
                                if (j0 + jj < nv) acc[gg][jj] = _mm512_dpbf16_ps(acc[gg][jj], pw, (__m512bh)V2[jj]);
                        }
                    }
                    for (int gg = 0; gg < PV_G; gg++)
                        for (int jj = 0; jj < PV_J; jj++)
                            if (g0 + gg < G && j0 + jj < nv) o[h0 + gg][j0 + jj] = acc[gg][jj];
                }
    }
    for (int64_t h = 0; h < NH; h++) {
        const __m512 inv = _mm512_set1_ps(l[h] > 0.0f ? 1.0f / l[h] : 0.0f);
        store_deinterleaved(out + (b * H + k0 * G + h) * D, o[h], steps, inv);
    }
}

// KV heads per task: as many as MAX_HT query heads hold, fewer while that leaves under two tasks per thread
static int64_t heads_per_task(int64_t B, int64_t H, int64_t KV, int nthreads) {
    int64_t per = MAX_HT / (H / KV);
    if (per > KV) per = KV;
    while (per > 1 && B * ((KV + per - 1) / per) < 2 * nthreads) per = (per + 1) / 2;
    return per;
}

// q, out: [B][H][D] bf16; caches: [blocks][bs][KV][D] bf16; tables: [B][W] block ids; ctx_lens: [B].
// WHY a macro: OpenMP outlines a parallel loop into its own function before constants propagate into it, so the
// loop must sit in each entry point for TRANS and PF (and the chunked task's G) to be compile-time constants in
// its copy of the task. The common widths get their own compiled copies too: a constant step count keeps the sums
// in registers. CALL(steps): the entry's task at that step count.
#define TASK(steps, TRANS, PF) \
    task(b, k0, k1, H, KV, D, q, kc, vc, bs, tables, W, ctx_lens[b], scale, out, steps, TRANS, PF)
#if MAX_STEPS >= 18
#define LATENT_CASE(CALL) \
    case 576: CALL(18); break;  // MLA's latent rows (DeepSeek-V2/V3: 512 + 64)
#else
#define LATENT_CASE(CALL)
#endif
#define ENTRY(name, CALL)                                                                                             \
    void name(int64_t B, int64_t H, int64_t KV, int64_t D, const uint16_t *q, const uint16_t *kc, const uint16_t *vc, \
              int64_t bs, const int64_t *tables, int64_t W, const int64_t *ctx_lens, float scale, uint16_t *out,     \
              int nthreads) {                                                                                         \
        const int64_t per = heads_per_task(B, H, KV, nthreads), groups = (KV + per - 1) / per;                       \
        _Pragma("omp parallel for schedule(dynamic, 1) num_threads(nthreads)")                                       \
        for (int64_t t = 0; t < B * groups; t++) {                                                                    \
            const int64_t b = t / groups, k0 = (t % groups) * per, k1 = k0 + per < KV ? k0 + per : KV;               \
            switch (D) {                                                                                              \
            case 64: CALL(2); break;                                                                                  \
            case 128: CALL(4); break;                                                                                 \
            LATENT_CASE(CALL)                                                                                         \
            default: CALL(D / 32); break;                                                                             \
            }                                                                                                         \
        }                                                                                                             \
    }
#define BY_REDUCTION(steps) TASK(steps, 0, 0)
#define BY_REDUCTION_PF(steps) TASK(steps, 0, 1)
#define TRANSPOSED(steps) TASK(steps, 1, 0)
#define TRANSPOSED_PF(steps) TASK(steps, 1, 1)
ENTRY(decode_attn_dp_bf16, BY_REDUCTION)
ENTRY(decode_attn_dp_bf16_pf, BY_REDUCTION_PF)
ENTRY(decode_attn_dp_bf16_t, TRANSPOSED)
ENTRY(decode_attn_dp_bf16_t_pf, TRANSPOSED_PF)

// The chunked entry, in the heads' build only (decode_attn_dp.py's HEAD_VARIANTS); the common group sizes get
// their own copies (a constant G keeps the heads' loops unrolled).
#if MAX_STEPS < 18
#define CTASK(steps, G) \
    task_chunked(b, k0, k1, H, KV, D, q, kc, vc, bs, tables, W, ctx_lens[b], scale, out, steps, G)
#define CHUNKED(steps)                    \
    switch (H / KV) {                     \
    case 1: CTASK(steps, 1); break;       \
    case 2: CTASK(steps, 2); break;       \
    case 4: CTASK(steps, 4); break;       \
    case 7: CTASK(steps, 7); break;       \
    case 8: CTASK(steps, 8); break;       \
    default: CTASK(steps, H / KV); break; \
    }
ENTRY(decode_attn_dp_bf16_c, CHUNKED)
#endif
