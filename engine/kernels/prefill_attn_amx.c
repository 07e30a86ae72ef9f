// Causal prefill attention of whole prompts on Intel AMX tiles (engine/kernels/prefill_attn_amx.py): the call
// engine.layers.attention makes for prompts with nothing cached before them, in place of torch's SDPA, where
// engine.kernels.op_choice measured it faster. WHY: torch's CPU flash kernel runs a short prompt's small blocks at
// ~100-140 GFLOP/s on a 2-core AMX Xeon (SmolLM2's heads, prompts of 128-158 tokens), where the tiles' rate is
// ~1.5-1.9 TFLOP/s, and a wave of prompts' prefill is what serving's time to first token waits for.
//
// Per prompt and KV head (a task; long prompts split their queries into parts of equal causal work):
//   - V^T once, in AMX's pair layout over keys: [32-key group][16-wide block of head_dim][d][key pair], built by
//     interleaving two keys' rows and transposing 16 x 16 dwords; every query block of the G heads reuses it;
//   - per query head and block of 16 queries: Q^T in the pair layout over head_dim (a 16 x 16 dword transpose a
//     32-wide step), then the scores S^T[key][query] = K_rows . Q^T, four 16-key blocks at a time (four
//     accumulator tiles: a tile product's result is ready tens of cycles after it starts), K rows loaded straight
//     from the prompt's rows;
//   - the softmax down each query's column (queries in the vector lanes: the maximum and the sum are vertical),
//     keys after a query masked, P rounded to bf16 (as flash attention does) and written as P^T's key pairs,
//     which is the B operand as it stands;
//   - O^T[d][query] = V^T . P^T, four 16-wide blocks of head_dim at a time, then transposed back, scaled by the
//     softmax's sum and rounded to bf16.
// Two passes over a query block's keys (all scores, then one softmax) rather than flash's running rescale: a
// prompt's scores for 16 queries are 64 bytes a key, in L2 for any prompt the engine admits.
//
// Requires: bf16, head_dim % 32 == 0 and <= MAX_D, G = H / KV whole.
#if !defined(__AMX_TILE__) || !defined(__AMX_BF16__) || !defined(__AVX512BF16__)
#error "this kernel needs AMX-BF16 and AVX512-BF16"
#endif
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "amx_tiles.h"
#include "avx512_math.h"
#include "thread_buffer.h"

#define MAX_D 256

int prefill_attn_amx_init(void) { return request_tile_state(); }

// Tiles (amx_configure_square: all 16 rows x 64 bytes): 0-3 accumulators (four key blocks' scores, then four
// blocks of O^T), 5 Q^T (scores) or P^T (P.V), 4 and 6 K rows (scores) or V^T (P.V), used in turn, 7 the last,
// partial key block.

// 16 rows of 16 dwords at src (rows ld bytes apart; rows >= n read as zero) -> their transpose, 64-byte rows at dst.
static inline void transpose_rows(const char *src, int64_t ld, int64_t n, uint32_t *dst) {
    __m512i c[16];
    load_transposed(src, ld, n, c);
    for (int t = 0; t < 16; t++) _mm512_store_si512((void *)(dst + 16 * t), c[t]);
}

// The lanes (queries t0 + c) that may attend to `key`: those at or after it.
static inline __mmask16 attends(int64_t key, int64_t t0) {
    const int64_t before = key - t0;  // queries c < before come before the key
    return before <= 0 ? (__mmask16)0xFFFF : (__mmask16)(0xFFFFu << before);
}

// Key t's row of KV head kvh: a prompt's own rows `ld` elements apart (table NULL), or the paged cache's
// ([blocks][bs][KV][D]: ld = KV * D, a 16-key slice of a block is 16 rows ld apart as well).
static inline const uint16_t *key_row(const uint16_t *base, int64_t t, int64_t ld, const int64_t *table, int64_t bs,
                                      int64_t kvh, int64_t D) {
    return (table ? base + (table[t / bs] * bs + t % bs) * ld : base + t * ld) + kvh * D;
}

// The first query block of part p of `parts` over qblocks blocks whose queries follow c0 earlier keys: parts of
// equal causal work (block b attends to c0 + 16 (b + 1) keys).
static int64_t part_start(int64_t p, int64_t parts, int64_t qblocks, int64_t c0) {
    double total = 0.0, done = 0.0;
    for (int64_t b = 0; b < qblocks; b++) total += (double)(c0 + 16 * (b + 1));
    const double target = total * (double)p / (double)parts;
    int64_t b = 0;
    for (; b < qblocks && done < target; b++) done += (double)(c0 + 16 * (b + 1));
    return b;
}

// Macros, not loops: a tile instruction names its tiles as constants. SCORE: key block kb0 + u of the prompt
// (read only while u < nread), step s of head_dim, into accumulator ACC (Q^T in tile 5). PV: block d0 + db of
// head_dim (while db < nd) over key group kg into ACC (P^T in tile 5).
#define SCORE(ACC, KT, u)                                                 \
    if (u < nread) {                                                      \
        _tile_loadd(KT, key_row(kc, (kb0 + u) * 16, ld, table, bs, kvh, D) + 32 * s, ld * 2); \
        _tile_dpbf16ps(ACC, KT, 5);                                       \
    }
#define PV(ACC, VT, db)                                                   \
    if (db < nd) {                                                        \
        _tile_loadd(VT, vt + (kg * ndb + d0 + db) * 256, 64);             \
        _tile_dpbf16ps(ACC, VT, 5);                                       \
    }

// One prompt's (or chunk's) KV head kvh: its G query heads at queries [q0, q1) of q (q0 a multiple of 16), which
// follow c0 earlier keys: keys [0, c0 + q1), rows of kc / vc as key_row finds them. 0, or -1 without memory for
// its scratch (its outputs then unwritten).
static int task(int64_t H, int64_t KV, int64_t D, const uint16_t *q, int64_t ldq, const uint16_t *kc,
                 const uint16_t *vc, int64_t ld, const int64_t *table, int64_t bs, int64_t c0, int64_t kvh, int64_t q0,
                 int64_t q1, float scale, uint16_t *out) {
    static __thread thread_buffer kpad_b, vt_b, sb_b, pb_b;
    const int64_t G = H / KV, steps = D / 32, ndb = D / 16, nkeys = c0 + q1, kgroups = (nkeys + 31) / 32;
    const int64_t full = nkeys / 16 * 16;  // keys in whole 16-key blocks; a tile reads 16 rows
    uint16_t *kpad = grow_aligned(&kpad_b, 16 * (size_t)D * 2);            // the partial block, zero-padded
    uint32_t *vt = grow_aligned(&vt_b, (size_t)kgroups * ndb * 256 * 4);    // V^T tiles
    float *sb = grow_aligned(&sb_b, (size_t)kgroups * 32 * 16 * 4);        // scores, then P: [key][query]
    uint32_t *pb = grow_aligned(&pb_b, (size_t)kgroups * 16 * 16 * 4);    // P^T pairs: [key pair][query]
    if (!kpad || !vt || !sb || !pb) return -1;
    const __m512i po = pair_order();
    for (int64_t kg = 0; kg < kgroups; kg++)
        for (int64_t db = 0; db < ndb; db++) {
            __m512i col[16], rows[16];  // col[i]: dword d = keys 2i, 2i+1 of the group at d (a column of the tile)
            for (int i = 0; i < 16; i++) {
                const int64_t t = 32 * kg + 2 * i;
                const __m256i x = t < nkeys ? _mm256_loadu_si256((const void *)(key_row(vc, t, ld, table, bs, kvh, D) +
                                                                                 16 * db))
                                            : _mm256_setzero_si256();
                const __m256i y = t + 1 < nkeys ? _mm256_loadu_si256((const void *)(key_row(vc, t + 1, ld, table, bs,
                                                                                             kvh, D) + 16 * db))
                                                : _mm256_setzero_si256();
                col[i] = _mm512_permutexvar_epi16(po, _mm512_inserti64x4(_mm512_castsi256_si512(x), y, 1));
            }
            transpose16(col, rows);
            for (int i = 0; i < 16; i++) _mm512_store_si512((void *)(vt + (kg * ndb + db) * 256 + 16 * i), rows[i]);
        }
    if (full < nkeys) {
        memset(kpad, 0, 16 * (size_t)D * 2);
        for (int64_t t = full; t < nkeys; t++)
            memcpy(kpad + (t - full) * D, key_row(kc, t, ld, table, bs, kvh, D), (size_t)D * 2);
    }
    const __m512 vscale = _mm512_set1_ps(scale), ninf = _mm512_set1_ps(-INFINITY);
    uint32_t qt[MAX_D / 32][16][16] __attribute__((aligned(64)));
    float ob[4][16][16] __attribute__((aligned(64)));
    for (int64_t g = 0; g < G; g++) {
        const int64_t h = kvh * G + g;
        for (int64_t t0 = q0; t0 < q1; t0 += 16) {
            const int64_t nq = q1 - t0 < 16 ? q1 - t0 : 16, at = c0 + t0, nk = at + nq, kblocks = (nk + 15) / 16;
            for (int64_t s = 0; s < steps; s++)
                transpose_rows((const char *)(q + t0 * ldq + h * D + 32 * s), ldq * 2, nq, &qt[s][0][0]);
            for (int64_t kb0 = 0; kb0 < kblocks; kb0 += 4) {
                const int64_t nb = kblocks - kb0 < 4 ? kblocks - kb0 : 4;
                const int partial = (kb0 + nb) * 16 > full;  // the group's last block is the padded one
                const int64_t nread = partial ? nb - 1 : nb;
                zero_accumulators();
                for (int64_t s = 0; s < steps; s++) {
                    _tile_loadd(5, qt[s], 64);
                    SCORE(0, 4, 0)
                    SCORE(1, 6, 1)
                    SCORE(2, 4, 2)
                    SCORE(3, 6, 3)
                    if (partial) {
                        _tile_loadd(7, kpad + 32 * s, D * 2);
                        switch (nread) {
                        case 0: _tile_dpbf16ps(0, 7, 5); break;
                        case 1: _tile_dpbf16ps(1, 7, 5); break;
                        case 2: _tile_dpbf16ps(2, 7, 5); break;
                        default: _tile_dpbf16ps(3, 7, 5); break;
                        }
                    }
                }
                store_accumulators(sb + kb0 * 256, nb);
            }
            __m512 m = ninf;
            for (int64_t key = 0; key < nk; key++) {
                const __m512 sc =
                    _mm512_mask_mov_ps(ninf, attends(key, at), _mm512_mul_ps(_mm512_load_ps(sb + key * 16), vscale));
                _mm512_store_ps(sb + key * 16, sc);
                m = _mm512_max_ps(m, sc);
            }
            __m512 sum = _mm512_setzero_ps();
            const int64_t kg_used = (nk + 31) / 32;
            for (int64_t i = 0; i < kg_used * 16; i++) {  // key pairs, zero past the block's keys
                __m512 p[2];
                for (int e = 0; e < 2; e++) {
                    const int64_t key = 2 * i + e;
                    // exp512 clamps its input, so masked lanes are zeroed outright rather than left at exp(-87)
                    p[e] = key < nk ? _mm512_maskz_mov_ps(attends(key, at),
                                                          exp512(_mm512_sub_ps(_mm512_load_ps(sb + key * 16), m)))
                                    : _mm512_setzero_ps();
                    sum = _mm512_add_ps(sum, p[e]);
                }
                const __m512i both = (__m512i)_mm512_cvtne2ps_pbh(p[1], p[0]);
                _mm512_store_si512((void *)(pb + 16 * i), _mm512_permutexvar_epi16(po, both));
            }
            float inv[16] __attribute__((aligned(64)));
            _mm512_store_ps(inv, _mm512_div_ps(_mm512_set1_ps(1.0f), sum));  // every query attends to key 0
            for (int64_t d0 = 0; d0 < ndb; d0 += 4) {
                const int64_t nd = ndb - d0 < 4 ? ndb - d0 : 4;
                zero_accumulators();
                for (int64_t kg = 0; kg < kg_used; kg++) {
                    _tile_loadd(5, pb + kg * 256, 64);
                    PV(0, 4, 0)
                    PV(1, 6, 1)
                    PV(2, 4, 2)
                    PV(3, 6, 3)
                }
                store_accumulators(&ob[0][0][0], nd);
                for (int64_t db = 0; db < nd; db++) {
                    __m512i c[16];
                    load_transposed(ob[db], 64, 16, c);  // c[query]: its 16 outputs of this block of head_dim
                    for (int64_t c2 = 0; c2 < nq; c2++) {
                        const __m512 o = _mm512_mul_ps(_mm512_castsi512_ps(c[c2]), _mm512_set1_ps(inv[c2]));
                        _mm256_storeu_si256((void *)(out + ((t0 + c2) * H + h) * D + 16 * (d0 + db)),
                                            (__m256i)_mm512_cvtneps_pbh(o));
                    }
                }
            }
        }
    }
    return 0;
}

// Parts a task's queries split into: at least four tasks a thread where prompts x KV heads are fewer.
static int64_t parts_for(int64_t tasks, int64_t qblocks, int nthreads) {
    const int64_t parts = (4 * nthreads + tasks - 1) / tasks;
    return parts < qblocks ? parts : qblocks;
}

// n prompts of S tokens side by side: q [n * S] token rows of H heads (ldq elements apart), k, v [n * S] rows of
// KV heads (ldk elements apart, both); out [n * S][H][D], contiguous. Causal within each prompt. 0, or -1 where a
// thread had no memory for its scratch.
int prefill_attn_amx_bf16(int64_t n, int64_t S, int64_t H, int64_t KV, int64_t D, const uint16_t *q, int64_t ldq,
                           const uint16_t *k, const uint16_t *v, int64_t ldk, float scale, uint16_t *out,
                           int nthreads) {
    const int64_t qblocks = (S + 15) / 16, parts = parts_for(n * KV, qblocks, nthreads);
    int failed = 0;
#pragma omp parallel num_threads(nthreads) reduction(| : failed)
    {
        amx_configure_square();
#pragma omp for schedule(dynamic, 1)
        for (int64_t t = 0; t < n * KV * parts; t++) {
            const int64_t p = t % parts, kvh = (t / parts) % KV, i = t / parts / KV;
            const int64_t q0 = part_start(p, parts, qblocks, 0) * 16;
            const int64_t end = part_start(p + 1, parts, qblocks, 0) * 16, q1 = end < S ? end : S;
            if (q0 < q1)
                failed |= task(H, KV, D, q + i * S * ldq, ldq, k + i * S * ldk, v + i * S * ldk, ldk, NULL, 1, 0, kvh,
                               q0, q1, scale, out + i * S * H * D);
        }
        _tile_release();
    }
    return failed;
}

// One sequence's chunk of S tokens whose keys, the chunk's own among them, are the first L in the paged caches
// ([blocks][bs][KV][D], bs % 16 == 0; table: the sequence's block ids): queries at positions L - S .. L - 1. As
// the entry above, 0 or -1.
int prefill_attn_amx_paged_bf16(int64_t S, int64_t H, int64_t KV, int64_t D, const uint16_t *q, int64_t ldq,
                                 const uint16_t *kc, const uint16_t *vc, int64_t bs, const int64_t *table, int64_t L,
                                 float scale, uint16_t *out, int nthreads) {
    const int64_t qblocks = (S + 15) / 16, parts = parts_for(KV, qblocks, nthreads), c0 = L - S;
    int failed = 0;
#pragma omp parallel num_threads(nthreads) reduction(| : failed)
    {
        amx_configure_square();
#pragma omp for schedule(dynamic, 1)
        for (int64_t t = 0; t < KV * parts; t++) {
            const int64_t p = t % parts, kvh = t / parts;
            const int64_t q0 = part_start(p, parts, qblocks, c0) * 16;
            const int64_t end = part_start(p + 1, parts, qblocks, c0) * 16, q1 = end < S ? end : S;
            if (q0 < q1) failed |= task(H, KV, D, q, ldq, kc, vc, KV * D, table, bs, c0, kvh, q0, q1, scale, out);
        }
        _tile_release();
    }
    return failed;
}
