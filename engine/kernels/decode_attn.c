// Decode attention straight from the paged KV cache: one query token per sequence against that sequence's
// cached K/V, read block by block in place (no gather into a contiguous copy), with a running (flash-style)
// softmax in float32. For bf16 caches every value is widened to float32 on load and only the output is rounded.
// The G = H / KV query heads that share one KV head are done together, so each K/V row is read once for them.
// Portable: GCC vector extensions, no intrinsics. Built by cbuild.py.
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "vec16.h"
#define CHUNK 32     // tokens per softmax update
#define MAX_G 16     // query heads per KV head
// The K/V rows, queries and outputs are vectors of AL lanes (vec16.h): 16 where there are 32 512-bit registers; 8 on
// AVX2 (and other 16-register machines), where 16-lane vectors are split in two: with that and the P.V
// chains below, measured on a Zen 3 (2026-12-02) 2.9x faster at one sequence of 200 tokens, 3.5x at 32.
// The softmax over a chunk's scores stays in 16-lane vectors (vec16.h).
#define MAX_NV (256 / AL)  // head_dim <= 256
static const float ZERO_ROW[256] __attribute__((aligned(64)));  // a float32 row past a context's end
#define PV_J 8             // output vectors accumulated at once in P.V (8 of 16 registers on AVX2)

static inline vf load(const void *p, int bf16) {
    vf f;
    if (bf16) {
        vh h;
        memcpy(&h, p, sizeof(h));
        const vu u = __builtin_convertvector(h, vu) << 16;
        memcpy(&f, &u, sizeof(f));
    } else {
        memcpy(&f, p, sizeof(f));
    }
    return f;
}

static inline void store(void *p, vf f, int bf16) {
    if (bf16) {  // round to nearest even; NaN stays a quiet NaN
        vu u;
        memcpy(&u, &f, sizeof(u));
        const vu rounded = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
        const vu nan = (vu)((vi)(u & 0x7FFFFFFFu) > 0x7F800000);
        const vh h = __builtin_convertvector((nan & ((u >> 16) | 0x40u)) | (~nan & rounded), vh);
        memcpy(p, &h, sizeof(h));
    } else {
        memcpy(p, &f, sizeof(f));
    }
}

// Rows [c, c + n) of one sequence's K or V for one KV head, widened; rows past n are zero (their scores are
// then masked, and a zero row never turns into NaN the way unused cache memory could).
static inline __attribute__((always_inline)) void gather(vf rows[CHUNK][MAX_NV], const char *cache, int64_t c,
                                                         int64_t n, int64_t b, int64_t kvh, const int64_t *tables,
                                                         int64_t W, int64_t bs, int64_t KV, int64_t D, int64_t esz,
                                                         const int bf16, const int64_t nv) {
    for (int64_t t = 0; t < CHUNK; t++) {
        if (t < n) {
            const int64_t pos = c + t, slot = tables[b * W + pos / bs] * bs + pos % bs;
            const char *row = cache + ((slot * KV + kvh) * D) * esz;
            for (int64_t j = 0; j < nv; j++) rows[t][j] = load(row + j * AL * esz, bf16);
        } else {
            for (int64_t j = 0; j < nv; j++) rows[t][j] = (vf){0};
        }
    }
}

// Ask for rows [c, c + n) of K or V ahead of their use: in a model the cache is cold (the weights streamed
// through the caches since this layer last ran), and the rows sit in scattered 16-token blocks.
static inline void prefetch_rows(const char *cache, int64_t c, int64_t n, int64_t b, int64_t kvh,
                                 const int64_t *tables, int64_t W, int64_t bs, int64_t KV, int64_t D, int64_t esz) {
    for (int64_t t = 0; t < n; t++) {
        const int64_t pos = c + t, slot = tables[b * W + pos / bs] * bs + pos % bs;
        const char *row = cache + ((slot * KV + kvh) * D) * esz;
        for (int64_t off = 0; off < D * esz; off += 64) __builtin_prefetch(row + off, 0, 3);
    }
}

// PF_SPREAD: rows [pos, pos + n) of the next chunk, K and V, asked for into L2 a few rows at a time, spread through
// this chunk's score loop. WHY: asked for all at once at a chunk's start (prefetch_rows, the build without it),
// the same rows arrive later (presumably the requests queue up and stall the loads behind them). Measured on a
// 2-core Zen 4 (2026-12-03), 24 layers' caches cold, 32 sequences x 256 tokens: Qwen2-0.5B's heads in float32
// 1,162 -> 769 us a layer, in bf16 957 -> 638; built for Zen 3 (-march=znver3) 1,321 -> 997. Built both ways;
// the op choice times both.
#ifndef PF_SPREAD
#define PF_SPREAD 0
#endif
static inline void prefetch_next(const char *kc, const char *vc, int64_t pos, int64_t n, int64_t b, int64_t kvh,
                                 const int64_t *tables, int64_t W, int64_t bs, int64_t KV, int64_t D, int64_t esz) {
    for (int64_t t = 0; t < n; t++) {
        const int64_t slot = tables[b * W + (pos + t) / bs] * bs + (pos + t) % bs;
        const int64_t off = (slot * KV + kvh) * D * esz;
        for (int64_t line = 0; line < D * esz; line += 64) {
            __builtin_prefetch(kc + off + line, 0, 2);
            __builtin_prefetch(vc + off + line, 0, 2);
        }
    }
}

// AL vectors -> one vector of their AL horizontal sums, in order: a tree of pairwise shuffles and adds
// (2(AL-1) shuffles, AL-1 adds) instead of AL separate horizontal sums.
static inline vf pair(vf a, vf b, vi lo, vi hi) {
    return __builtin_shuffle(a, b, lo) + __builtin_shuffle(a, b, hi);
}

#if AL == 16
static inline vf reduce(const vf v[AL]) {
    const vi l1 = {0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23};
    const vi l2 = {0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27};
    const vi l3 = {0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29};
    const vi l4 = {0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30};
    vf r1[8], r2[4], r3[2];
    for (int i = 0; i < 8; i++) r1[i] = pair(v[2 * i], v[2 * i + 1], l1, l1 + 8);
    for (int i = 0; i < 4; i++) r2[i] = pair(r1[2 * i], r1[2 * i + 1], l2, l2 + 4);
    for (int i = 0; i < 2; i++) r3[i] = pair(r2[2 * i], r2[2 * i + 1], l3, l3 + 2);
    return pair(r3[0], r3[1], l4, l4 + 1);
}
#else
static inline vf reduce(const vf v[AL]) {
    const vi l1 = {0, 1, 2, 3, 8, 9, 10, 11};
    const vi l2 = {0, 1, 4, 5, 8, 9, 12, 13};
    const vi l3 = {0, 2, 4, 6, 8, 10, 12, 14};
    vf r1[4], r2[2];
    for (int i = 0; i < 4; i++) r1[i] = pair(v[2 * i], v[2 * i + 1], l1, l1 + 4);
    for (int i = 0; i < 2; i++) r2[i] = pair(r1[2 * i], r1[2 * i + 1], l2, l2 + 2);
    return pair(r2[0], r2[1], l3, l3 + 1);
}
#endif

static inline __attribute__((always_inline)) void decode(int64_t B, int64_t H, int64_t KV, int64_t D,
                                                         const char *q, const char *kc, const char *vc,
                                                         int64_t bs, const int64_t *tables, int64_t W,
                                                         const int64_t *ctx_lens, float scale, char *out,
                                                         int nthreads, const int bf16, const int64_t nv) {
    const int64_t G = H / KV, esz = bf16 ? 2 : 4;
#pragma omp parallel for schedule(dynamic, 1) num_threads(nthreads)
    for (int64_t task = 0; task < B * KV; task++) {
        const int64_t b = task / KV, kvh = task % KV, L = ctx_lens[b];
        vf qv[MAX_G][MAX_NV], o[MAX_G][MAX_NV];
        float m[MAX_G], l[MAX_G], s[MAX_G][CHUNK] __attribute__((aligned(64)));
        for (int64_t g = 0; g < G; g++) {
            const char *qr = q + ((b * H + kvh * G + g) * D) * esz;
            for (int64_t j = 0; j < nv; j++) {
                qv[g][j] = load(qr + j * AL * esz, bf16) * scale;
                o[g][j] = (vf){0};
            }
            m[g] = -INFINITY;
            l[g] = 0.0f;
        }
        vf rows[CHUNK][MAX_NV];  // bf16: this chunk's K rows, then its V rows, widened to float32
        // float32: the rows are read where they lie (a copy to the stack cost a store and a load per value, as
        // much as the FMAs at few query heads per KV head); past the context, a zero row
        const char *kp[CHUNK], *vp[CHUNK];
#define ROW(which, t, j) (bf16 ? rows[t][j] : load(which[t] + (j) * AL * 4, 0))
        for (int64_t c = 0; c < L; c += CHUNK) {
            const int64_t n = L - c < CHUNK ? L - c : CHUNK;
#if PF_SPREAD
            // the next chunk's rows are asked for one by one inside the score loop below (see PF_SPREAD)
            const int64_t next_n = c + CHUNK < L ? (L - c - CHUNK < CHUNK ? L - c - CHUNK : CHUNK) : 0;
            if (c == 0) {
                prefetch_rows(kc, 0, n, b, kvh, tables, W, bs, KV, D, esz);
                prefetch_rows(vc, 0, n, b, kvh, tables, W, bs, KV, D, esz);
            }
#else
            if (c == 0) prefetch_rows(kc, 0, n, b, kvh, tables, W, bs, KV, D, esz);
            prefetch_rows(vc, c, n, b, kvh, tables, W, bs, KV, D, esz);  // used after the scores
            if (c + CHUNK < L)  // the next chunk's keys
                prefetch_rows(kc, c + CHUNK, L - c - CHUNK < CHUNK ? L - c - CHUNK : CHUNK, b, kvh, tables, W, bs, KV, D, esz);
#endif
            if (bf16) {
                gather(rows, kc, c, n, b, kvh, tables, W, bs, KV, D, esz, bf16, nv);
            } else {
                for (int64_t t = 0; t < CHUNK; t++) {
                    const int64_t pos = c + t, off = t < n ? ((tables[b * W + pos / bs] * bs + pos % bs) * KV + kvh) * D * 4 : -1;
                    kp[t] = off < 0 ? (const char *)ZERO_ROW : kc + off;
                    vp[t] = off < 0 ? (const char *)ZERO_ROW : vc + off;
                }
            }
            for (int64_t g = 0; g < G; g++) {
                for (int64_t h = 0; h < CHUNK; h += AL) {  // AL tokens' scores as one vector
#if PF_SPREAD
                    if (g == 0)
                        prefetch_next(kc, vc, c + CHUNK + h, next_n - h < AL ? next_n - h : AL, b, kvh, tables, W, bs,
                                      KV, D, esz);
#endif
                    vf acc[AL];
                    for (int t = 0; t < AL; t++) acc[t] = qv[g][0] * ROW(kp, h + t, 0);
                    for (int64_t j = 1; j < nv; j++) {  // one query vector in a register for AL tokens
                        const vf qj = qv[g][j];
                        for (int t = 0; t < AL; t++) acc[t] += qj * ROW(kp, h + t, j);
                    }
                    const vf sc = reduce(acc);
                    memcpy(s[g] + h, &sc, sizeof(sc));
                }
                for (int64_t t = n; t < CHUNK; t++) s[g][t] = -INFINITY;
                v16f s0, s1;
                memcpy(&s0, s[g], sizeof(s0));
                memcpy(&s1, s[g] + VL, sizeof(s1));
                const v16i gt = s0 > s1;
                const float cm = hmax((v16f)(((v16i)s0 & gt) | ((v16i)s1 & ~gt)));
                const float mn = cm > m[g] ? cm : m[g];
                const float alpha = m[g] == -INFINITY ? 0.0f : expf(m[g] - mn);
                s0 = vexp(s0 - mn);
                s1 = vexp(s1 - mn);
                memcpy(s[g], &s0, sizeof(s0));
                memcpy(s[g] + VL, &s1, sizeof(s1));
                l[g] = l[g] * alpha + hsum(s0 + s1);
                m[g] = mn;
                for (int64_t j = 0; j < nv; j++) o[g][j] *= alpha;
            }
            if (bf16) gather(rows, vc, c, n, b, kvh, tables, W, bs, KV, D, esz, bf16, nv);
            for (int64_t g = 0; g < G; g++)
                for (int64_t j0 = 0; j0 < nv; j0 += PV_J) {
                    // PV_J accumulators in registers across the chunk, each its own FMA chain: with one chain
                    // per output vector every FMA waited for the one before (measured on a Zen 3, 2026-12-02:
                    // half the kernel's time at 32 sequences)
                    const int64_t nj = nv - j0 < PV_J ? nv - j0 : PV_J;
                    vf acc[PV_J];
                    for (int64_t j = 0; j < nj; j++) acc[j] = o[g][j0 + j];
                    for (int64_t t = 0; t < n; t++) {
                        const float p = s[g][t];
                        for (int64_t j = 0; j < nj; j++) acc[j] += p * ROW(vp, t, j0 + j);
                    }
                    for (int64_t j = 0; j < nj; j++) o[g][j0 + j] = acc[j];
                }
        }
        for (int64_t g = 0; g < G; g++) {
            char *orow = out + ((b * H + kvh * G + g) * D) * esz;
            const float inv = l[g] > 0.0f ? 1.0f / l[g] : 0.0f;
            for (int64_t j = 0; j < nv; j++) store(orow + j * AL * esz, o[g][j] * inv, bf16);
        }
    }
}

#undef ROW

// head_dim 64 and 128 get their own compiled copies: a constant vector count keeps the rows in registers
#define CALL(bf16, nv)                                                                                            \
    decode(B, H, KV, D, (const char *)q, (const char *)kc, (const char *)vc, bs, tables, W, ctx_lens, scale,     \
           (char *)out, nthreads, bf16, nv)
#define DISPATCH(bf16)                                                                                            \
    switch (D) {                                                                                                  \
    case 64: CALL(bf16, 64 / AL); break;                                                                          \
    case 128: CALL(bf16, 128 / AL); break;                                                                        \
    default: CALL(bf16, D / AL); break;                                                                           \
    }

// q, out: [B][H][D]; k_cache, v_cache: [blocks][block_size][KV][D]; tables: [B][W] block ids; ctx_lens: [B].
// Requires D % 16 == 0, D <= 256, H % KV == 0, H / KV <= 16 (the caller checks and falls back otherwise).
void decode_attn_f32(int64_t B, int64_t H, int64_t KV, int64_t D, const float *q, const float *kc, const float *vc,
                     int64_t bs, const int64_t *tables, int64_t W, const int64_t *ctx_lens, float scale, float *out,
                     int nthreads) {
    DISPATCH(0);
}

void decode_attn_bf16(int64_t B, int64_t H, int64_t KV, int64_t D, const uint16_t *q, const uint16_t *kc,
                      const uint16_t *vc, int64_t bs, const int64_t *tables, int64_t W, const int64_t *ctx_lens,
                      float scale, uint16_t *out, int nthreads) {
    DISPATCH(1);
}
