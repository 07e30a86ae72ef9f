// MLA decode over the paged latent cache in place with AVX512-BF16 dot products (decode_attn_latent_dp.py), the
// heads in one vector: DeepSeek's latent rows (512 latent + 64 rope = 576) are K and V at once for every query
// head, so attention per sequence is two small GEMMs with the heads as one of their sides:
//   scores  S[t] (a vector over 16 heads) = sum over dim pairs p of bcast(row_t[2p], row_t[2p + 1]) . qT[p],
//           qT[p] lane h = q[h][2p], q[h][2p + 1] (the query transposed once a sequence): no horizontal sums, no
//           transposed keys, a token's pair read straight from its cached row;
//   softmax over a chunk of CH tokens, vectorised over the heads (one exp512 a token);
//   values  O[h][j] += sum over token pairs of bcast(P[2i][h], P[2i + 1][h]) . V2[i][j], V2 the chunk's rows
//           2i, 2i + 1 interleaved (unpacklo/hi), P rounded to bf16 as flash attention does, only the 512
//           latent columns (the rope columns are no values).
// WHY: decode_attn_dp.c's latent build runs each head's scores as its own dot products over transposed keys or
// with a reduction per head, and its P.V over all 576 columns: DeepSeek-V2-tiny's decode attention took 1.1 ms
// a layer at 32 sequences of ~190 tokens on a 2-core Zen 4, 16% of a decode step.
// Requires: bf16, block_size % 16 == 0 (a 16-token slice lies in one block, its rows adjacent). Built by cbuild.py
// with -march=native.
#if !defined(__AVX512BF16__) || !defined(__AVX512BW__)
#error "this kernel needs AVX512-BF16"
#endif
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "avx512_math.h"
#include "latent_split.h"

#define LD 576      // a cached row: kv_lora_rank 512 + qk_rope_head_dim 64 (DeepSeek-V2/V3)
#define LV 512      // its latent part, the values
#define PAIRS (LD / 2)
#define ROW_LINES (LD / 32)  // 64-byte lines a cached row
#define MAX_H 16    // query heads a task: one vector
#define SL 16       // tokens a slice (one score tile of 16 accumulators)
#define CH 32       // tokens a softmax update: two slices (16, 32 and 64 measured alike on a Zen 4)
#define NV (LV / 16)  // value vectors of 16 columns a head (interleaved order: unpacklo, unpackhi halves)
#define HB 4        // heads a value tile
#define JB 4        // value vectors a value tile: HB x JB accumulators (2 alike, 8 slower)

// A task's result over part of a sequence's tokens, before normalising: the values' sums o (interleaved column
// order), and per head (lanes) the running maximum m and the softmax denominator l.
typedef struct {
    __m512 o[MAX_H][NV];
    __m512 m, l;
} partial_t;

// The scores of one 16-token slice (rows adjacent, LD apart) for every head: s[t] lane h, unscaled. `ahead`: the
// next slice's first row, its 16 x ROW_LINES = PAIRS lines asked for one a pair step, spread over the work (the
// blocks of a sequence lie anywhere in the pool, so the hardware prefetchers lose the stream at every block: 32
// sequences of 192 tokens, cold, on a 2-core Zen 4: 0.67 ms with, 0.81 without).
static inline __attribute__((always_inline)) void slice_scores(const uint16_t *rows, const __m512i *qt,
                                                               const uint16_t *ahead, __m512 s[SL]) {
    __m512 acc[SL];
    for (int t = 0; t < SL; t++) acc[t] = _mm512_setzero_ps();
    for (int p = 0; p < PAIRS; p++) {
        const __m512bh q = (__m512bh)_mm512_load_si512((const void *)(qt + p));
        if (ahead) _mm_prefetch((const char *)(ahead + (p / ROW_LINES) * LD + (p % ROW_LINES) * 32), _MM_HINT_T1);
        for (int t = 0; t < SL; t++) {
            int32_t kp;
            memcpy(&kp, rows + t * LD + 2 * p, 4);
            acc[t] = _mm512_dpbf16_ps(acc[t], (__m512bh)_mm512_set1_epi32(kp), q);
        }
    }
    for (int t = 0; t < SL; t++) s[t] = acc[t];
}

// One task: sequence b, heads [h0, h0 + H) of H_all (H <= MAX_H), its tokens [t0, L) (t0 a multiple of CH) →
// the normalised values in out, or with `part` that part's sums, maximum and denominator in it.
static void task(const latent_call *call, int64_t b, int64_t h0, int64_t H, int64_t t0, int64_t L, void *into) {
    const uint16_t *q = call->q, *kc = call->kc;
    const int64_t H_all = call->H_all, bs = call->bs, *table = call->tables + b * call->W;
    const float scale = call->scale;
    uint16_t *out = call->out;
    partial_t *part = into;
    __m512i qt[PAIRS] __attribute__((aligned(64)));  // lane h: head h's dims 2p, 2p + 1 (zero past H)
    __m512 o[MAX_H][NV] __attribute__((aligned(64)));
    __m512i V2[CH / 2][NV] __attribute__((aligned(64)));  // token pairs of the chunk interleaved, per 16 columns
    uint32_t P[CH / 2][MAX_H] __attribute__((aligned(64)));  // bf16 probabilities of tokens 2i, 2i + 1, per head
    float alpha[MAX_H] __attribute__((aligned(64)));
    {
        uint32_t *qd = (uint32_t *)qt;
        memset(qt, 0, sizeof(qt));
        for (int64_t h = 0; h < H; h++) {
            const uint32_t *qh = (const uint32_t *)(q + (b * H_all + h0 + h) * LD);
            for (int p = 0; p < PAIRS; p++) qd[p * MAX_H + h] = qh[p];
        }
    }
    memset(o, 0, sizeof(o));
    const __m512 vscale = _mm512_set1_ps(scale), ninf = _mm512_set1_ps(-INFINITY);
    const __m512i order = pair_order();
    __m512 m = ninf, l = _mm512_setzero_ps();  // per head: running maximum, softmax denominator
    for (int64_t c = t0; c < L; c += CH) {
        const int64_t n = L - c < CH ? L - c : CH;
        __m512 s[CH];
        for (int64_t c0 = 0; c0 < n; c0 += SL) {
            const int64_t pos = c + c0, next = pos + SL;
            const uint16_t *rows = kc + (table[pos / bs] * bs + pos % bs) * LD;
            const uint16_t *ahead = next < L ? kc + (table[next / bs] * bs + next % bs) * LD : NULL;
            slice_scores(rows, qt, ahead, s + c0);
        }
        // scaled; tokens past n (stale memory of the slice's block, perhaps NaN) to -inf, whole vectors
        __m512 mx = m;
        for (int64_t t = 0; t < CH; t++) {
            s[t] = t < n ? _mm512_mul_ps(s[t], vscale) : ninf;
            mx = _mm512_max_ps(mx, s[t]);
        }
        // the first chunk: exp512(-inf - mx) clamps to exp(-87), times O and l that are still zero
        const __m512 a = exp512(_mm512_sub_ps(m, mx));
        m = mx;
        __m512 sum = _mm512_setzero_ps();
        for (int64_t t = 0; t < CH; t += 2) {
            const __m512 p0 = t < n ? exp512(_mm512_sub_ps(s[t], mx)) : _mm512_setzero_ps();
            const __m512 p1 = t + 1 < n ? exp512(_mm512_sub_ps(s[t + 1], mx)) : _mm512_setzero_ps();
            sum = _mm512_add_ps(sum, _mm512_add_ps(p0, p1));
            _mm512_store_si512((void *)P[t / 2], _mm512_permutexvar_epi16(order, (__m512i)_mm512_cvtne2ps_pbh(p1, p0)));
        }
        l = _mm512_fmadd_ps(l, a, sum);
        _mm512_store_ps(alpha, a);
        // rows of the chunk's tokens, pairs interleaved; a pair's second row past n is zero (a zero probability
        // times stale memory could be NaN)
        const int64_t pairs = (n + 1) / 2;
        for (int64_t i = 0; i < pairs; i++) {
            const int64_t p0 = c + 2 * i, p1 = p0 + 1;
            const uint16_t *r0 = kc + (table[p0 / bs] * bs + p0 % bs) * LD;
            const uint16_t *r1 = kc + (table[p1 / bs] * bs + p1 % bs) * LD;  // p0 even: the same block
            const __mmask32 second = 2 * i + 1 < n ? ~0u : 0u;
            for (int64_t s2 = 0; s2 < NV / 2; s2++) {
                const __m512i x = _mm512_loadu_si512((const void *)(r0 + 32 * s2));
                const __m512i y = _mm512_maskz_loadu_epi16(second, r1 + 32 * s2);
                V2[i][2 * s2] = _mm512_unpacklo_epi16(x, y);
                V2[i][2 * s2 + 1] = _mm512_unpackhi_epi16(x, y);
            }
        }
        for (int64_t g0 = 0; g0 < H; g0 += HB)
            for (int64_t j0 = 0; j0 < NV; j0 += JB) {
                const int64_t hb = H - g0 < HB ? H - g0 : HB;
                __m512 acc[HB][JB];
                for (int gg = 0; gg < HB; gg++)
                    for (int jj = 0; jj < JB; jj++)
                        acc[gg][jj] = gg < hb ? _mm512_mul_ps(o[g0 + gg][j0 + jj], _mm512_set1_ps(alpha[g0 + gg]))
                                              : _mm512_setzero_ps();
                for (int64_t i = 0; i < pairs; i++)
                    for (int gg = 0; gg < HB; gg++) {
                        if (gg >= hb) break;
                        const __m512bh pw = (__m512bh)_mm512_set1_epi32((int)P[i][g0 + gg]);
                        for (int jj = 0; jj < JB; jj++)
                            acc[gg][jj] = _mm512_dpbf16_ps(acc[gg][jj], pw, (__m512bh)V2[i][j0 + jj]);
                    }
                for (int gg = 0; gg < HB; gg++)
                    for (int jj = 0; jj < JB; jj++)
                        if (gg < hb) o[g0 + gg][j0 + jj] = acc[gg][jj];
            }
    }
    if (part) {
        memcpy(part->o, o, sizeof(o));
        part->m = m, part->l = l;
        return;
    }
    float lh[MAX_H] __attribute__((aligned(64)));
    _mm512_store_ps(lh, l);
    for (int64_t h = 0; h < H; h++) {
        uint16_t *orow = out + (b * H_all + h0 + h) * LD;
        store_deinterleaved(orow, o[h], NV / 2, _mm512_set1_ps(lh[h] > 0.0f ? 1.0f / lh[h] : 0.0f));
        memset(orow + LV, 0, sizeof(uint16_t) * (LD - LV));
    }
}

// Sequence b's heads [h0, h0 + H) from its parts' results: each part's sums and denominator weighed by
// exp(its maximum - the largest), then normalised into out.
static void combine(const latent_call *call, int64_t b, int64_t h0, int64_t H, const void *results, int64_t n) {
    const partial_t *parts = results;
    const int64_t H_all = call->H_all;
    uint16_t *out = call->out;
    __m512 mx = parts[0].m;
    for (int64_t p = 1; p < n; p++) mx = _mm512_max_ps(mx, parts[p].m);
    float w[MAX_PARTS][MAX_H] __attribute__((aligned(64)));
    __m512 l = _mm512_setzero_ps();
    for (int64_t p = 0; p < n; p++) {
        const __m512 a = exp512(_mm512_sub_ps(parts[p].m, mx));  // a part's -inf maximum: its l and o are zero
        _mm512_store_ps(w[p], a);
        l = _mm512_fmadd_ps(parts[p].l, a, l);
    }
    float lh[MAX_H] __attribute__((aligned(64)));
    _mm512_store_ps(lh, l);
    for (int64_t h = 0; h < H; h++) {
        __m512 o[NV];
        for (int j = 0; j < NV; j++) {
            __m512 acc = _mm512_setzero_ps();
            for (int64_t p = 0; p < n; p++) acc = _mm512_fmadd_ps(parts[p].o[h][j], _mm512_set1_ps(w[p][h]), acc);
            o[j] = acc;
        }
        uint16_t *orow = out + (b * H_all + h0 + h) * LD;
        store_deinterleaved(orow, o, NV / 2, _mm512_set1_ps(lh[h] > 0.0f ? 1.0f / lh[h] : 0.0f));
        memset(orow + LV, 0, sizeof(uint16_t) * (LD - LV));
    }
}

// q, out: [B][H][LD] bf16; cache: [blocks][bs][LD] (kc == vc: K and V are the same rows); tables: [B][W] block
// ids; ctx_lens: [B]. Writes out[b][h][0 .. LV) and zeros the rest. The family's signature (decode_attn.py): KV
// is 1 and D == LD (the caller checks: decode_attn_latent_dp.py). One task per sequence and group of up to 16
// heads (DeepSeek-V2/V3 have 128: eight groups read the same rows), or one per part of a sequence's tokens
// (latent_split.h). Without memory for the parts it runs one task a sequence.
void decode_attn_latent_dp(int64_t B, int64_t H_all, int64_t KV, int64_t D, const uint16_t *q, const uint16_t *kc,
                           const uint16_t *vc, int64_t bs, const int64_t *tables, int64_t W, const int64_t *ctx_lens,
                           float scale, uint16_t *out, int nthreads) {
    (void)KV, (void)D, (void)vc;
    const latent_call c = {q, kc, tables, H_all, W, bs, scale, out};
    latent_run(&c, B, MAX_H, CH, ctx_lens, nthreads, sizeof(partial_t), task, combine);
}
