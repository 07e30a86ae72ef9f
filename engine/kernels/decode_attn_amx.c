// Decode attention from the paged bf16 KV cache on Intel AMX tiles (engine/kernels/decode_attn_amx.py).
// The portable kernel (decode_attn.c) spends most of its time on horizontal sums: each score is a dot product
// along head_dim, and vectors run along head_dim. Here the scores of 16 cached tokens for all G query heads
// that share a KV head are one tile product, S[16 tokens][16 heads] = K_rows . Q^T, with the K rows loaded
// straight from the cache block (a 16-token slice of a block is 16 equally strided rows). The softmax then runs
// with the heads in the vector lanes, and P.V is a tile product too, over pairs of tokens (P transposed by a
// scatter, V rows interleaved), P rounded to bf16 as flash attention does. Measured against the portable kernel
// and torch by engine.kernels.op_choice.
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

#define SEG 128     // tokens per softmax update: scores, P pairs and interleaved V of a segment stay in L1/L2
#define MAX_STEPS 18  // head_dim / 32: up to 576, MLA's latent + rope width (engine/layers/mla.py)

int decode_attn_amx_init(void) { return request_tile_state(); }

// Tiles, 16 rows x 64 bytes each: 0 scores, 1 K rows, 2 Q^T; 3 P^T, 4 interleaved V, 5 a segment's P.V.
static void configure(void) {
    tile_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette_id = 1;
    for (int t = 0; t < 6; t++) {
        cfg.rows[t] = 16;
        cfg.colsb[t] = 64;
    }
    _tile_loadconfig(&cfg);
}

static inline const uint16_t *row_of(const uint16_t *cache, int64_t pos, const int64_t *table, int64_t bs,
                                     int64_t KV, int64_t kvh, int64_t D) {
    return cache + ((table[pos / bs] * bs + pos % bs) * KV + kvh) * D;
}

static inline __attribute__((always_inline)) void task(int64_t b, int64_t kvh, int64_t H, int64_t KV, int64_t D,
                                                       const uint16_t *q, const uint16_t *kc, const uint16_t *vc,
                                                       int64_t bs, const int64_t *tables, int64_t W, int64_t L,
                                                       float scale, uint16_t *out, const int64_t steps) {
    const int64_t G = H / KV, nv = 2 * steps;
    const int64_t *table = tables + b * W;
    // Q^T in AMX's pair layout, one tile per 32 of head_dim: qt[s][r][g] = q_g[32s + 2r], q_g[32s + 2r + 1]
    uint32_t qt[MAX_STEPS][16][16] __attribute__((aligned(64)));
    memset(qt, 0, (size_t)steps * sizeof qt[0]);
    for (int64_t g = 0; g < G; g++) {
        const uint32_t *qr = (const uint32_t *)(q + (b * H + kvh * G + g) * D);
        for (int64_t s = 0; s < steps; s++)
            for (int r = 0; r < 16; r++) qt[s][r][g] = qr[16 * s + r];
    }
    float S[SEG][16] __attribute__((aligned(64)));     // scores, then probabilities: [token][head]
    uint32_t PT[16 * SEG / 2] __attribute__((aligned(64)));  // [head][i]: bf16 probabilities of tokens 2i, 2i+1
    float Oseg[16][16] __attribute__((aligned(64)));
    // V rows of tokens 2i, 2i+1 interleaved (unpacklo/hi), packed densely ([i * nv + j]): a fixed row of
    // MAX_STEPS * 2 vectors would map the used ones onto a few L1 sets
    __m512i V2[SEG / 2 * MAX_STEPS * 2];
    __m512 o[16][MAX_STEPS * 2];                      // fp32 output per head, in the interleaved lane order
    for (int64_t g = 0; g < G; g++)
        for (int64_t j = 0; j < nv; j++) o[g][j] = _mm512_setzero_ps();
    __m512 m = _mm512_set1_ps(-1e30f), l = _mm512_setzero_ps();
    const __m512 vscale = _mm512_set1_ps(scale);
    const int64_t stride = KV * D * 2;
    for (int64_t seg = 0; seg < L; seg += SEG) {
        const int64_t n = L - seg < SEG ? L - seg : SEG;
        for (int64_t t0 = 0; t0 < n; t0 += 16) {  // 16 tokens are 16 rows of one cache block (bs % 16 == 0)
            const uint16_t *k0 = row_of(kc, seg + t0, table, bs, KV, kvh, D);
            _tile_zero(0);
            for (int64_t s = 0; s < steps; s++) {
                _tile_loadd(1, k0 + 32 * s, stride);
                _tile_loadd(2, qt[s], 64);
                _tile_dpbf16ps(0, 1, 2);
            }
            _tile_stored(0, S[t0], 64);
        }
        __m512 mx = m;
        for (int64_t t = 0; t < n; t++) {
            const __m512 st = _mm512_mul_ps(_mm512_load_ps(S[t]), vscale);
            _mm512_store_ps(S[t], st);
            mx = _mm512_max_ps(mx, st);
        }
        const __m512 alpha = exp512(_mm512_sub_ps(m, mx));
        m = mx;
        __m512 sum = _mm512_setzero_ps();
        for (int64_t t = 0; t < n; t++) {
            const __m512 p = exp512(_mm512_sub_ps(_mm512_load_ps(S[t]), mx));
            _mm512_store_ps(S[t], p);
            sum = _mm512_add_ps(sum, p);
        }
        if (n & 1) _mm512_store_ps(S[n], _mm512_setzero_ps());
        l = _mm512_fmadd_ps(l, alpha, sum);
        // P.V on tiles: O[g][d] += P[g][2r, 2r+1] . V[2r, 2r+1][d], 16 token pairs per tile product. A (tile 3)
        // is P transposed, one row per head (written by a scatter); B (tile 4) is 16 rows of interleaved V.
        const int64_t pairs = (n + 1) / 2, padded = (pairs + 15) & ~(int64_t)15;
        const __m512i inter = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7,
                                               22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
        const __m512i rows_of_pt = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2,
                                                                       1, 0), _mm512_set1_epi32(SEG / 2));
        for (int64_t i = 0; i < padded; i++) {
            if (i >= pairs) {  // the last tile's unused pairs: zero weights over zero values, never stale bytes
                _mm512_i32scatter_epi32(PT + i, rows_of_pt, _mm512_setzero_si512(), 4);
                for (int64_t j = 0; j < nv; j++) V2[i * nv + j] = _mm512_setzero_si512();
                continue;
            }
            const __m512i both = (__m512i)_mm512_cvtne2ps_pbh(_mm512_load_ps(S[2 * i + 1]), _mm512_load_ps(S[2 * i]));
            _mm512_i32scatter_epi32(PT + i, rows_of_pt, _mm512_permutexvar_epi16(inter, both), 4);
            const uint16_t *v0 = row_of(vc, seg + 2 * i, table, bs, KV, kvh, D);
            const int second = 2 * i + 1 < n;  // a missing odd token is zero, never the cache's stale bytes
            const uint16_t *v1 = second ? row_of(vc, seg + 2 * i + 1, table, bs, KV, kvh, D) : v0;
            for (int64_t s = 0; s < steps; s++) {
                const __m512i a = _mm512_loadu_si512((const void *)(v0 + 32 * s));
                const __m512i c = second ? _mm512_loadu_si512((const void *)(v1 + 32 * s)) : _mm512_setzero_si512();
                V2[i * nv + 2 * s] = _mm512_unpacklo_epi16(a, c);
                V2[i * nv + 2 * s + 1] = _mm512_unpackhi_epi16(a, c);
            }
        }
        float al[16] __attribute__((aligned(64)));
        _mm512_store_ps(al, alpha);
        for (int64_t j = 0; j < nv; j++) {
            _tile_zero(5);
            for (int64_t i = 0; i < padded; i += 16) {
                _tile_loadd(3, PT + i, SEG / 2 * 4);
                _tile_loadd(4, V2 + i * nv + j, nv * 64);
                _tile_dpbf16ps(5, 3, 4);
            }
            _tile_stored(5, Oseg, 64);
            for (int64_t g = 0; g < G; g++)
                o[g][j] = _mm512_fmadd_ps(o[g][j], _mm512_set1_ps(al[g]), _mm512_load_ps(Oseg[g]));
        }
    }
    float lv[16] __attribute__((aligned(64)));
    _mm512_store_ps(lv, l);
    for (int64_t g = 0; g < G; g++)
        store_deinterleaved(out + (b * H + kvh * G + g) * D, o[g], steps,
                            _mm512_set1_ps(lv[g] > 0.0f ? 1.0f / lv[g] : 0.0f));
}

// q, out: [B][H][D] bf16; caches: [blocks][bs][KV][D] bf16; tables: [B][W] block ids; ctx_lens: [B].
void decode_attn_amx_bf16(int64_t B, int64_t H, int64_t KV, int64_t D, const uint16_t *q, const uint16_t *kc,
                          const uint16_t *vc, int64_t bs, const int64_t *tables, int64_t W, const int64_t *ctx_lens,
                          float scale, uint16_t *out, int nthreads) {
#pragma omp parallel num_threads(nthreads)
    {
        configure();
#pragma omp for schedule(dynamic, 1)
        for (int64_t t = 0; t < B * KV; t++) {
#define TASK(steps) task(t / KV, t % KV, H, KV, D, q, kc, vc, bs, tables, W, ctx_lens[t / KV], scale, out, steps)
            // head_dim 64, 128 and 576 get their own compiled copies: a constant vector count keeps the sums in registers
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
