// MLA decode over the paged latent cache in place, float32, for CPUs without bf16 arithmetic (where
// engine.kernels.decode_attn_dp and decode_attn_amx cannot run). Each cached token is one row of 576: the
// normalised KV latent (512, the values) and the roped shared key (64); every query head attends over the same
// rows, so attention is two small GEMMs per sequence and chunk of tokens, done here with the heads in one vector:
//   scores  S[t][h] = sum_k row_t[k] * qT[k][h]        (query transposed once: no horizontal sums)
//   values  O[h][j] += P[t][h] * row_t[j], j < 512      (the rows just read are still in L1/L2)
// with a running (flash-style) softmax per chunk of CH tokens, vectorised over the heads. WHY: the portable kernel
// (decode_attn.c built 576 wide) does a dot product per head and token, and was slower than gathering the rows
// and running SDPA (Zen 3, 32 sequences of 192 tokens: 5.2 against 4.8 ms a layer). Built by cbuild.py.
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "latent_split.h"
#include "vec16.h"

#define LD 576  // a cached row: kv_lora_rank 512 + qk_rope_head_dim 64 (DeepSeek-V2/V3)
#define LV 512  // its latent part, the values
#define MAX_H 16  // query heads: one v16f (fewer are padded with zero queries)
#define CH 32  // tokens per softmax update
#define HB 4  // heads per value tile
#ifdef __AVX512F__  // AL (vec16.h) 16
#define TT 12  // tokens per score tile: accumulators of one v16f each
#define JB 4  // vectors of AL columns per value tile: HB * JB accumulators
#else  // AL 8
#define TT 6  // a v16f is two registers on AVX2: 12 accumulators of 16
#define JB 2
#endif

static inline vf loadv(const float *p) {
    vf v;
    memcpy(&v, p, sizeof(v));
    return v;
}

static inline v16f vmax(v16f a, v16f b) {
    const v16i gt = a > b;
    return (v16f)(((v16i)a & gt) | ((v16i)b & ~gt));
}

#define HV (MAX_H / AL)  // vectors of heads in a row of scores: 2 on AVX2, 1 on AVX-512

// s[t][h] = the scores of token t for every head (qt: the scaled query, transposed [LD][MAX_H]), tt tokens
static inline __attribute__((always_inline)) void score_tile(const int tt, const float *const *rows, const float *qt,
                                                             float *s) {
    vf acc[TT][HV];
    for (int t = 0; t < tt; t++)
        for (int i = 0; i < HV; i++) acc[t][i] = (vf){0};
    for (int k = 0; k < LD; k++) {
        vf qv[HV];
        for (int i = 0; i < HV; i++) qv[i] = loadv(qt + k * MAX_H + i * AL);
        for (int t = 0; t < tt; t++) {
            const float x = rows[t][k];
            for (int i = 0; i < HV; i++) acc[t][i] += x * qv[i];
        }
    }
    for (int t = 0; t < tt; t++)
        for (int i = 0; i < HV; i++) memcpy(s + t * MAX_H + i * AL, &acc[t][i], sizeof(vf));
}

static void scores(int64_t n, const float *const *rows, const float *qt, float *s) {
    for (int64_t t0 = 0; t0 < n; t0 += TT) {
        const int64_t tt = n - t0 < TT ? n - t0 : TT;
        float *st = s + t0 * MAX_H;
        switch (tt) {  // a constant count keeps the accumulators in registers
        case 1: score_tile(1, rows + t0, qt, st); break;
        case 2: score_tile(2, rows + t0, qt, st); break;
        case 3: score_tile(3, rows + t0, qt, st); break;
        case 4: score_tile(4, rows + t0, qt, st); break;
        case 5: score_tile(5, rows + t0, qt, st); break;
#if TT > 6
        case 6: score_tile(6, rows + t0, qt, st); break;
        case 7: score_tile(7, rows + t0, qt, st); break;
        case 8: score_tile(8, rows + t0, qt, st); break;
        case 9: score_tile(9, rows + t0, qt, st); break;
        case 10: score_tile(10, rows + t0, qt, st); break;
        case 11: score_tile(11, rows + t0, qt, st); break;
#endif
        default: score_tile(TT, rows + t0, qt, st); break;
        }
    }
}

// o[h][j0 .. j0 + JB * AL) for heads h0 .. h0 + HB: scaled by alpha[h] (the softmax's new maximum), then
// plus p[t][h] * rows[t][j] over the chunk's n tokens
static inline void value_tile(int64_t n, const float *const *rows, const float *p, int64_t h0, int64_t j0,
                              float *o, const float *alpha) {
    vf acc[HB][JB];
    for (int h = 0; h < HB; h++)
        for (int j = 0; j < JB; j++) acc[h][j] = loadv(o + (h0 + h) * LV + j0 + j * AL) * alpha[h0 + h];
    for (int64_t t = 0; t < n; t++) {
        vf r[JB];
        for (int j = 0; j < JB; j++) r[j] = loadv(rows[t] + j0 + j * AL);
        for (int h = 0; h < HB; h++) {
            const float ph = p[t * MAX_H + h0 + h];
            for (int j = 0; j < JB; j++) acc[h][j] += ph * r[j];
        }
    }
    for (int h = 0; h < HB; h++)
        for (int j = 0; j < JB; j++) memcpy(o + (h0 + h) * LV + j0 + j * AL, &acc[h][j], sizeof(vf));
}

// A task's result over part of a sequence's tokens, before normalising: the values' sums o, and per head the
// running maximum m and the softmax denominator l.
typedef struct {
    float o[MAX_H * LV];
    float m[MAX_H], l[MAX_H];
} partial_t;

// Sequence b's heads [first, first + H) over its tokens [t0, t1): normalised into out, or with `part` that part's
// sums, maximum and denominator into it.
static void task(const latent_call *call, int64_t b, int64_t first, int64_t H, int64_t t0, int64_t t1, void *into) {
    const float *q = call->q, *kc = call->kc;
    const float scale = call->scale;
    const int64_t H_all = call->H_all, bs = call->bs, *table = call->tables + b * call->W;
    float *out = call->out;
    partial_t *part = into;
    float qt[LD * MAX_H] __attribute__((aligned(64))), s[CH * MAX_H] __attribute__((aligned(64)));
    float o[MAX_H * LV] __attribute__((aligned(64))), alpha[MAX_H], l[MAX_H];
    const float *rows[CH];
    memset(qt, 0, sizeof(qt));
    for (int64_t h = 0; h < H; h++)
        for (int64_t k = 0; k < LD; k++) qt[k * MAX_H + h] = q[(b * H_all + first + h) * LD + k] * scale;
    memset(o, 0, sizeof(float) * H * LV);
    v16f mv = (v16f){0} - INFINITY, lv = (v16f){0};
    for (int64_t c = t0; c < t1; c += CH) {
        const int64_t n = t1 - c < CH ? t1 - c : CH;
        for (int64_t t = 0; t < n; t++) {
            const int64_t pos = c + t;
            rows[t] = kc + (table[pos / bs] * bs + pos % bs) * LD;
        }
        scores(n, rows, qt, s);
        v16f st[CH];  // the chunk's scores, one vector of heads per token
        memcpy(st, s, sizeof(v16f) * n);
        v16f mx = st[0];
        for (int64_t t = 1; t < n; t++) mx = vmax(mx, st[t]);
        const v16f mn = vmax(mv, mx);
        const v16f a = vexp(mv - mn);  // 0 at the first chunk (mv = -inf)
        v16f sum = (v16f){0};
        for (int64_t t = 0; t < n; t++) {
            st[t] = vexp(st[t] - mn);
            sum += st[t];
        }
        memcpy(s, st, sizeof(v16f) * n);
        lv = lv * a + sum;
        mv = mn;
        memcpy(alpha, &a, sizeof(a));
        for (int64_t j0 = 0; j0 < LV; j0 += JB * AL)
            for (int64_t h0 = 0; h0 < H; h0 += HB) value_tile(n, rows, s, h0, j0, o, alpha);
    }
    memcpy(l, &lv, sizeof(l));
    if (part) {
        memcpy(part->o, o, sizeof(float) * H * LV);
        memcpy(part->m, &mv, sizeof(part->m));
        memcpy(part->l, l, sizeof(part->l));
        return;
    }
    for (int64_t h = 0; h < H; h++) {
        float *orow = out + (b * H_all + first + h) * LD;
        const float inv = l[h] > 0.0f ? 1.0f / l[h] : 0.0f;
        for (int64_t j = 0; j < LV; j++) orow[j] = o[h * LV + j] * inv;
        memset(orow + LV, 0, sizeof(float) * (LD - LV));
    }
}

// Sequence b's heads [first, first + H) from its n parts' results: each part's sums and denominator weighed by
// exp(its maximum - the largest), then normalised into out.
static void combine(const latent_call *call, int64_t b, int64_t first, int64_t H, const void *results, int64_t n) {
    const partial_t *parts = results;
    const int64_t H_all = call->H_all;
    float *out = call->out;
    for (int64_t h = 0; h < H; h++) {
        float mx = parts[0].m[h], w[MAX_PARTS], l = 0.0f;
        for (int64_t p = 1; p < n; p++) mx = parts[p].m[h] > mx ? parts[p].m[h] : mx;
        for (int64_t p = 0; p < n; p++) {
            w[p] = parts[p].m[h] == -INFINITY ? 0.0f : expf(parts[p].m[h] - mx);  // a part with no tokens: 0
            l += parts[p].l[h] * w[p];
        }
        const float inv = l > 0.0f ? 1.0f / l : 0.0f;
        float *orow = out + (b * H_all + first + h) * LD;
        for (int64_t j = 0; j < LV; j++) {
            float acc = 0.0f;
            for (int64_t p = 0; p < n; p++) acc += parts[p].o[h * LV + j] * w[p];
            orow[j] = acc * inv;
        }
        memset(orow + LV, 0, sizeof(float) * (LD - LV));
    }
}

// q, out: [B][H][LD]; cache: [blocks][bs][LD] (kc == vc: K and V are the same rows); tables: [B][W] block ids;
// ctx_lens: [B]. Writes out[b][h][0 .. LV) and zeros the rest. The family's signature (decode_attn.py): KV must be
// 1 and D == LD, H a multiple of HB (the caller checks: decode_attn_latent.py); one task per sequence and group of
// up to MAX_H heads, or one per part of a sequence's tokens (latent_split.h). Without memory for the parts it runs
// one task a sequence.
void decode_attn_latent_f32(int64_t B, int64_t H_all, int64_t KV, int64_t D, const float *q, const float *kc,
                            const float *vc, int64_t bs, const int64_t *tables, int64_t W, const int64_t *ctx_lens,
                            float scale, float *out, int nthreads) {
    (void)KV, (void)D, (void)vc;
    const latent_call c = {q, kc, tables, H_all, W, bs, scale, out};
    latent_run(&c, B, MAX_H, CH, ctx_lens, nthreads, sizeof(partial_t), task, combine);
}
