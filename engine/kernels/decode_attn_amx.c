// Decode attention from the paged bf16 KV cache on Intel AMX tiles (engine/kernels/decode_attn_amx.py).
// The portable kernel (decode_attn.c) spends most of its time on horizontal sums: each score is a dot product
// along head_dim, and vectors run along head_dim. Here the scores of 16 cached tokens for all G query heads
// that share a KV head are one tile product, S[16 tokens][16 heads] = K_rows . Q^T, with the K rows loaded
// straight from the cache block (a 16-token slice of a block is 16 equally strided rows). S is transposed in
// registers to [head][token], so the softmax runs with tokens in the vector lanes (G exponentials per 16 tokens,
// not 16) and each head's probabilities, rounded to bf16 as flash attention does, are already the rows of P that
// the P.V tile product takes, over pairs of tokens (V rows interleaved).
//
// WHY four accumulator tiles, and a task per sequence over its KV heads (at most MAX_HT query heads): a tile
// product's result is ready tens of cycles after it starts, so one accumulator (the first version: one slice's
// scores, then one output vector of P.V, at a time) waited on each product; and a task per KV head read 128 of
// every KV * 128 bytes of a block, the other heads' lines left to another task, maybe on the other core. 2-core
// AMX Xeon (model 167), ms a layer, 32 sequences of 128-256 tokens, caches of 40 layers cycled (cold) or one
// (L3): Qwen2-0.5B's heads (7 over each of 2 KV heads) cold 0.26-0.28 against 0.34-0.37 before and 0.28-0.30 for
// decode_attn_dp's chunked entry, L3 0.12 against 0.15 and 0.18; SmolLM2's (3 over each of 3) cold 0.35 against
// 0.42-0.45 and 0.30, where the dot-product kernel stays ahead (this kernel's work is per KV head, not per query
// head); MLA's 16 heads over one 576-wide latent unchanged (0.66 cold). The op choice times them all.
//
// Requires: bf16 cache, block_size % 16 == 0, head_dim % 32 == 0 and <= 576, G = H / KV <= 16.
//
// MLA (DeepSeek) decode is this kernel too: one latent "KV head" of kv_lora_rank + rope columns shared by all
// query heads, K and V the same cached row (the caller drops the rope columns of the output).
#if !defined(__AMX_TILE__) || !defined(__AMX_BF16__) || !defined(__AVX512BF16__)
#error "this kernel needs AMX-BF16 and AVX512-BF16"
#endif
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "amx_tiles.h"
#include "avx512_math.h"

#define SEG 128       // tokens per softmax update: scores, P and interleaved V of a segment stay in L1/L2
#define MAX_STEPS 18  // head_dim / 32: up to 576, MLA's latent + rope width (engine/layers/mla.py)
#define MAX_HT 32     // query heads a task keeps state for
#define MAX_QT 32     // Q^T tiles a task keeps: its KV heads x head_dim / 32
#define WAKE_LINES 2  // lines asked for at the start of each block (wake_blocks)

int decode_attn_amx_init(void) { return request_tile_state(); }

// Tiles (amx_configure_square: all 16 rows x 64 bytes): 0-3 accumulators (four slices' scores, then four vectors
// of a segment's P.V), 5 Q^T (scores) or P (P.V), 4 and 6 K rows (scores) or interleaved V (P.V), used in turn.

static inline const uint16_t *row_of(const uint16_t *cache, int64_t pos, const int64_t *table, int64_t bs,
                                     int64_t KV, int64_t kvh, int64_t D) {
    return cache + ((table[pos / bs] * bs + pos % bs) * KV + kvh) * D;
}

// The first lines of each cache block of tokens [from, to), the task's heads, K and V, asked for a segment ahead:
// the blocks lie anywhere in the pool, and a request at each block's start lets the L2 streamer take the rest of
// its page. 0.26-0.28 against 0.27-0.31 ms cold without (Qwen2's heads, as above): asking for every line, spread
// over the work or all at once, measured no faster than nothing.
static inline void wake_blocks(const uint16_t *kc, const uint16_t *vc, int64_t from, int64_t to, const int64_t *table,
                               int64_t bs, int64_t KV, int64_t k0, int64_t D) {
    for (int64_t p = from - from % bs; p < to; p += bs) {
        const int64_t at = (table[p / bs] * bs * KV + k0) * D;
        for (int e = 0; e < WAKE_LINES; e++) {
            _mm_prefetch((const char *)(kc + at + 32 * e), _MM_HINT_T1);
            if (vc != kc) _mm_prefetch((const char *)(vc + at + 32 * e), _MM_HINT_T1);  // MLA: K and V are one row
        }
    }
}

// Macros, not loops: a tile instruction names its tiles as constants. SCORE: slice u of a group of four, step s
// of head_dim, into accumulator ACC (Q^T in tile 5). PV: output vector j0 + jj over 16 token pairs into ACC (P in
// tile 5).
#define SCORE(ACC, KT, u)                                                                    \
    if (u < ns) {                                                                            \
        _tile_loadd(KT, row_of(kc, pos + 16 * (u), table, bs, KV, kvh, D) + 32 * s, stride); \
        _tile_dpbf16ps(ACC, KT, 5);                                                          \
    }
#define PV(ACC, VT, jj)                                  \
    if (j0 + jj < nv) {                                  \
        _tile_loadd(VT, V2 + i * nv + j0 + jj, nv * 64); \
        _tile_dpbf16ps(ACC, 5, VT);                      \
    }

// One sequence's query heads of KV heads [k0, k1): [b][k0 * G, k1 * G) of out.
static inline __attribute__((always_inline)) void task(int64_t b, int64_t k0, int64_t k1, int64_t H, int64_t KV,
                                                       int64_t D, const uint16_t *q, const uint16_t *kc,
                                                       const uint16_t *vc, int64_t bs, const int64_t *tables,
                                                       int64_t W, int64_t L, float scale, uint16_t *out,
                                                       const int64_t steps, const int64_t G) {
    const int64_t nv = 2 * steps, NH = (k1 - k0) * G;
    const int64_t *table = tables + b * W;
    uint32_t qt[MAX_QT][16][16] __attribute__((aligned(64)));  // [kv head of the task][step]
    memset(qt, 0, (size_t)((k1 - k0) * steps) * sizeof qt[0]);
    for (int64_t h = 0; h < NH; h++) {
        const uint32_t *qr = (const uint32_t *)(q + (b * H + k0 * G + h) * D);
        for (int64_t s = 0; s < steps; s++)
            for (int r = 0; r < 16; r++) qt[(h / G) * steps + s][r][h % G] = qr[16 * s + r];
    }
    float Sb[4][16][16] __attribute__((aligned(64)));       // a group's scores as the tiles leave them: [token][head]
    float ST[MAX_HT][SEG] __attribute__((aligned(64)));     // the segment's scores, [head][token]
    uint32_t PT[16][SEG / 2] __attribute__((aligned(64)));  // [head][i]: bf16 probabilities of tokens 2i, 2i+1
    for (int64_t g = G; g < 16; g++) memset(PT[g], 0, sizeof PT[g]);  // rows past G: zero weights, never stale
    float Oseg[4][16][16] __attribute__((aligned(64)));
    __m512i V2[SEG / 2 * MAX_STEPS * 2];
    __m512 o[MAX_HT][MAX_STEPS * 2];
    float m[MAX_HT], l[MAX_HT];
    for (int64_t h = 0; h < NH; h++) {
        for (int64_t j = 0; j < nv; j++) o[h][j] = _mm512_setzero_ps();
        m[h] = -INFINITY;
        l[h] = 0.0f;
    }
    const __m512 vscale = _mm512_set1_ps(scale), ninf = _mm512_set1_ps(-INFINITY);
    const int64_t stride = KV * D * 2;
    wake_blocks(kc, vc, 0, L < SEG ? L : SEG, table, bs, KV, k0, D);
    for (int64_t seg = 0; seg < L; seg += SEG) {
        const int64_t n = L - seg < SEG ? L - seg : SEG;
        if (seg + SEG < L) wake_blocks(kc, vc, seg + SEG, seg + 2 * SEG < L ? seg + 2 * SEG : L, table, bs, KV, k0, D);
        __m512 vmax[MAX_HT];
        for (int64_t h = 0; h < NH; h++) vmax[h] = ninf;
        for (int64_t t0 = 0; t0 < n; t0 += 64) {  // four slices at a time: four independent accumulator tiles
            const int64_t pos = seg + t0, ns = (n - t0 + 15) / 16 < 4 ? (n - t0 + 15) / 16 : 4;
            for (int64_t kvh = k0; kvh < k1; kvh++) {  // the task's heads in turn over the same blocks
                zero_accumulators();
                for (int64_t s = 0; s < steps; s++) {
                    _tile_loadd(5, qt[(kvh - k0) * steps + s], 64);
                    SCORE(0, 4, 0)
                    SCORE(1, 6, 1)
                    SCORE(2, 4, 2)
                    SCORE(3, 6, 3)
                }
                store_accumulators(&Sb[0][0][0], ns);
                for (int64_t u = 0; u < ns; u++) {
                    __m512i c[16];
                    load_transposed(Sb[u], 64, 16, c);
                    const int64_t at = t0 + 16 * u, nn = n - at < 16 ? n - at : 16;
                    const __mmask16 valid = (__mmask16)((1u << nn) - 1u);
                    for (int64_t g = 0; g < G; g++) {
                        const int64_t h = (kvh - k0) * G + g;
                        const __m512 v =
                            _mm512_mask_mov_ps(ninf, valid, _mm512_mul_ps(_mm512_castsi512_ps(c[g]), vscale));
                        _mm512_store_ps(ST[h] + at, v);
                        vmax[h] = _mm512_max_ps(vmax[h], v);
                    }
                }
            }
        }
        const int64_t pairs = (n + 1) / 2, padded = (pairs + 15) & ~(int64_t)15;
        for (int64_t kvh = k0; kvh < k1; kvh++) {
            float alpha[16] __attribute__((aligned(64)));
            for (int64_t g = 0; g < G; g++) {
                const int64_t h = (kvh - k0) * G + g;
                const float mx = fmaxf(m[h], _mm512_reduce_max_ps(vmax[h]));
                alpha[g] = m[h] == -INFINITY ? 0.0f : expf(m[h] - mx);
                m[h] = mx;
                const __m512 vm = _mm512_set1_ps(mx);
                __m512 sum = _mm512_setzero_ps();
                for (int64_t t0 = 0; t0 < 2 * padded; t0 += 32) {
                    __m512 p[2];
                    for (int e = 0; e < 2; e++) {
                        const int64_t at = t0 + 16 * e;
                        const int64_t nn = at >= n ? 0 : (n - at < 16 ? n - at : 16);
                        // exp512 clamps its input, so masked lanes are zeroed outright rather than left at exp(-87)
                        p[e] = nn ? _mm512_maskz_mov_ps((__mmask16)((1u << nn) - 1u),
                                                        exp512(_mm512_sub_ps(_mm512_load_ps(ST[h] + at), vm)))
                                  : _mm512_setzero_ps();
                        sum = _mm512_add_ps(sum, p[e]);
                    }
                    _mm512_store_si512((void *)(PT[g] + t0 / 2), (__m512i)_mm512_cvtne2ps_pbh(p[1], p[0]));
                }
                l[h] = l[h] * alpha[g] + _mm512_reduce_add_ps(sum);
            }
            for (int64_t i = 0; i < padded; i++) {
                if (i >= pairs) {
                    for (int64_t j = 0; j < nv; j++) V2[i * nv + j] = _mm512_setzero_si512();
                    continue;
                }
                const uint16_t *v0 = row_of(vc, seg + 2 * i, table, bs, KV, kvh, D);
                const int second = 2 * i + 1 < n;
                const uint16_t *v1 = second ? row_of(vc, seg + 2 * i + 1, table, bs, KV, kvh, D) : v0;
                for (int64_t s = 0; s < steps; s++) {
                    const __m512i a = _mm512_loadu_si512((const void *)(v0 + 32 * s));
                    const __m512i c =
                        second ? _mm512_loadu_si512((const void *)(v1 + 32 * s)) : _mm512_setzero_si512();
                    V2[i * nv + 2 * s] = _mm512_unpacklo_epi16(a, c);
                    V2[i * nv + 2 * s + 1] = _mm512_unpackhi_epi16(a, c);
                }
            }
            for (int64_t j0 = 0; j0 < nv; j0 += 4) {  // four output vectors at a time: four accumulator tiles
                zero_accumulators();
                for (int64_t i = 0; i < padded; i += 16) {
                    _tile_loadd(5, PT[0] + i, SEG / 2 * 4);
                    PV(0, 4, 0)
                    PV(1, 6, 1)
                    PV(2, 4, 2)
                    PV(3, 6, 3)
                }
                const int64_t nj = nv - j0 < 4 ? nv - j0 : 4;
                store_accumulators(&Oseg[0][0][0], nj);
                for (int64_t jj = 0; jj < nj; jj++)
                    for (int64_t g = 0; g < G; g++) {
                        const int64_t h = (kvh - k0) * G + g;
                        o[h][j0 + jj] =
                            _mm512_fmadd_ps(o[h][j0 + jj], _mm512_set1_ps(alpha[g]), _mm512_load_ps(Oseg[jj][g]));
                    }
            }
        }
    }
    for (int64_t h = 0; h < NH; h++)
        store_deinterleaved(out + (b * H + k0 * G + h) * D, o[h], steps,
                            _mm512_set1_ps(l[h] > 0.0f ? 1.0f / l[h] : 0.0f));
}

// KV heads per task: as many as the task's state holds, fewer while that leaves under two tasks per thread
static int64_t heads_per_task(int64_t B, int64_t H, int64_t KV, int64_t steps, int nthreads) {
    int64_t per = MAX_HT / (H / KV);
    if (per > MAX_QT / steps) per = MAX_QT / steps;
    if (per > KV) per = KV;
    if (per < 1) per = 1;
    while (per > 1 && B * ((KV + per - 1) / per) < 2 * nthreads) per = (per + 1) / 2;
    return per;
}

// q, out: [B][H][D] bf16; caches: [blocks][bs][KV][D] bf16; tables: [B][W] block ids; ctx_lens: [B].
void decode_attn_amx_bf16(int64_t B, int64_t H, int64_t KV, int64_t D, const uint16_t *q, const uint16_t *kc,
                          const uint16_t *vc, int64_t bs, const int64_t *tables, int64_t W, const int64_t *ctx_lens,
                          float scale, uint16_t *out, int nthreads) {
    const int64_t per = heads_per_task(B, H, KV, D / 32, nthreads), groups = (KV + per - 1) / per;
#pragma omp parallel num_threads(nthreads)
    {
        amx_configure_square();
#pragma omp for schedule(dynamic, 1)
        for (int64_t t = 0; t < B * groups; t++) {
            const int64_t b = t / groups, k0 = (t % groups) * per, k1 = k0 + per < KV ? k0 + per : KV;
#define TASK(steps) task(b, k0, k1, H, KV, D, q, kc, vc, bs, tables, W, ctx_lens[b], scale, out, steps, H / KV)
            switch (D) {
            case 64: TASK(2); break;
            case 128: TASK(4); break;
            case 576: TASK(18); break;
            default: TASK(D / 32); break;
            }
#undef TASK
        }
        _tile_release();
    }
}
