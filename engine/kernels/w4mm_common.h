// What the W4A16 kernels over w4mm's packed layout share (w4mm.c for AVX512-BF16, w4amx.c for AMX): widening
// nibbles to bf16, the rows' sums per group, the thread's buffers, the rows' store (plain or the fused gated
// MLP's), a grouped call's frame around each kernel's task. Include after bf16mm_block.h (NB, to_bf16); cbuild.py
// hashes them, and thread_buffer.h and grouped_tasks.h, with every source that includes them.
#ifndef W4MM_COMMON_H
#define W4MM_COMMON_H
#include <immintrin.h>
#include <omp.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "avx512_math.h"
#include "deal.h"
#include "grouped_tasks.h"
#include "thread_buffer.h"

// How far ahead of the nibbles being widened the kernels ask for the next ones (past a block: the next block's,
// which the same thread takes next under a static schedule, and mostly under w4amx's dynamic one). Without it a
// 2-core AMX Xeon (model 167) streamed int4 weights at 8-12 GB/s at one row, with it 2 KB ahead at 18-19 (1 KB:
// 17-18, 4 KB: 19). Set on that CPU only: the kernels are also built with -DPF_BYTES=0 and the selection times
// both (engine.quant.paths).
#ifndef PF_BYTES
#define PF_BYTES 2048
#endif

// The scales' layout, one of two (w4mm.py packs both). By default [N/64][K/G][2][64] float: each group's s, then
// s * (128 + z), for a block's 64 columns. Built with -DSCALE16, for weights whose scales are bf16 values (what a
// bf16 checkpoint stores): [N/64][K/G] of 192 bytes, the 64 columns' s as bf16, then their 128 + z as bytes, and
// s * (128 + z) made in the kernel (8 significant bits times at most 8: exact in float, the same value as the
// default layout's). WHY: the default layout's 512 bytes a group are 12.5% of the int4 bytes at groups of 128 and
// 50% at 32, all streamed from memory at batch 1; this one is 37.5% of them. SC_GROUP: floats a group.
#ifdef SCALE16
#define SC_GROUP 48
#else
#define SC_GROUP 128
#endif

// 16 columns' s and s * (128 + z) (chunk c of the block's 64) from a group's scales sg, in either layout.
static inline __attribute__((always_inline)) void group_scales(const float *sg, int c, __m512 *s, __m512 *sz) {
#ifdef SCALE16
    const __m256i h = _mm256_loadu_si256((const __m256i *)((const uint16_t *)sg + 16 * c));
    const __m128i zb = _mm_loadu_si128((const __m128i *)((const uint8_t *)sg + 128 + 16 * c));
    *s = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    *sz = _mm512_mul_ps(*s, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(zb)));
#else
    *s = _mm512_loadu_ps(sg + 16 * c);
    *sz = _mm512_loadu_ps(sg + 64 + 16 * c);
#endif
}

// The 128 bytes of 4 k x 64 columns at wk + PF_BYTES.
static inline __attribute__((always_inline)) void prefetch_nibbles(const uint8_t *wk) {
    if (PF_BYTES > 0) {
        _mm_prefetch((const char *)wk + PF_BYTES, _MM_HINT_T0);
        _mm_prefetch((const char *)wk + PF_BYTES + 64, _MM_HINT_T0);
    }
}

// One 32-byte load: 16 columns x 4 k as two bf16 operands (k pairs 0 and 1), each value as 128 + q: a nibble
// under bf16's exponent of 128 (0x4300) is that number exactly (8 significant bits), so widening is two ORs.
static inline __attribute__((always_inline)) void widen(const uint8_t *p, __m512bh *a, __m512bh *b) {
    const __m512i wide = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)p));
    const __m512i e128 = _mm512_set1_epi16(0x4300);
    *a = (__m512bh)_mm512_or_si512(_mm512_and_si512(wide, _mm512_set1_epi16(15)), e128);
    *b = (__m512bh)_mm512_or_si512(_mm512_srli_epi16(wide, 4), e128);
}

// 16 columns' widened k pair v (each 32-bit lane one column's two 128 + q, as widen() gives them) dequantized:
// taken apart to floats by a shift and a mask, w = (128 + q) * s - s * (128 + z) in one rounding (s, sz: the
// columns' scale and s * (128 + z)), back to bf16 pairs in the same layout.
static inline __attribute__((always_inline)) __m512i dequantize_pairs(__m512bh v, __m512 s, __m512 sz,
                                                                      __m512i pairs) {
    const __m512 even = _mm512_castsi512_ps(_mm512_slli_epi32((__m512i)v, 16));
    const __m512 odd = _mm512_castsi512_ps(_mm512_and_si512((__m512i)v, _mm512_set1_epi32((int)0xFFFF0000u)));
    const __m512bh w = _mm512_cvtne2ps_pbh(_mm512_fmsub_ps(odd, s, sz), _mm512_fmsub_ps(even, s, sz));
    return _mm512_permutexvar_epi16(pairs, (__m512i)w);
}

// A 64-column block's nibbles wq (K/4 steps of 128 bytes) and scales sc (K/G groups of SC_GROUP floats) →
// its bf16 weights w = (q - z) * s, rounded once, in wb: bf16mm's pair layout [K/2][64][2] (w4mm.c), or with
// amx_tiles AMX tiles [K/32][4][16][32], a 16 x 32 tile of k pairs for each 32-k step and 16 columns (w4amx.c).
// Each caller passes a constant, so each gets its own loop.
static inline __attribute__((always_inline)) void dequantize_block(int64_t K, int64_t G, const uint8_t *wq,
                                                                   const float *sc, uint16_t *wb,
                                                                   const int amx_tiles) {
    const __m512i pairs = pair_order();
    for (int64_t g = 0; g < K / G; g++) {
        __m512 s[4], sz[4];
        for (int c = 0; c < 4; c++) group_scales(sc + g * SC_GROUP, c, &s[c], &sz[c]);
        for (int64_t kq = g * G / 4; kq < (g + 1) * G / 4; kq++) {
            prefetch_nibbles(wq + kq * 128);
            for (int c = 0; c < 4; c++) {
                __m512bh v[2];
                widen(wq + kq * 128 + 32 * c, &v[0], &v[1]);
                for (int i = 0; i < 2; i++) {
                    uint16_t *t = amx_tiles ? wb + ((kq / 8) * 4 + c) * 512 + (kq % 8) * 64 + 32 * i
                                            : wb + ((2 * kq + i) * 64 + 16 * c) * 2;
                    _mm512_storeu_si512((void *)t, dequantize_pairs(v[i], s[c], sz[c], pairs));
                }
            }
        }
    }
}

static inline float bf16_to_f32(uint16_t h) {
    const uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static __thread thread_buffer sums_buf;

// The calling thread's buffer for n group sums; NULL without memory.
static float *sums_for(int64_t n) { return grow(&sums_buf, sizeof(float) * (size_t)n); }

// The sums of x's rows over each group of G inputs, in float: [M][K/G]; 16 lanes at a time, then the lanes'
// sum (and the rest of a group of G % 16 one by one). WHY: one float added at a time, a chain the compiler must
// keep in order, took ~25 us for 32 rows of 896 inputs on a Zen 4, on the calling thread while the other waited:
// 13% of Qwen2-0.5B's QKV projection at 32 rows.
static void group_sums(int64_t M, int64_t K, int64_t G, const uint16_t *x, float *xs, int nthreads) {
#pragma omp parallel for schedule(static) num_threads(nthreads) if (M * K > 65536)
    for (int64_t m = 0; m < M; m++)
        for (int64_t g = 0; g < K / G; g++) {
            const uint16_t *p = x + m * K + g * G;
            __m512 acc = _mm512_setzero_ps();
            int64_t k = 0;
            for (; k + 16 <= G; k += 16) {
                const __m512i h = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(p + k)));
                acc = _mm512_add_ps(acc, _mm512_castsi512_ps(_mm512_slli_epi32(h, 16)));
            }
            float s = _mm512_reduce_add_ps(acc);
            for (; k < G; k++) s += bf16_to_f32(p[k]);
            xs[m * (K / G) + g] = s;
        }
}

static void store_row(const float *o, const float *bias, uint16_t *yr, int64_t nn) {
    if (nn < NB) {
        for (int64_t j = 0; j < nn; j++) yr[j] = to_bf16(o[j] + bias[j]);
        return;
    }
    __m512 v[4];
    for (int c = 0; c < 4; c++) v[c] = _mm512_add_ps(_mm512_loadu_ps(o + 16 * c), _mm512_loadu_ps(bias + 16 * c));
    _mm512_storeu_si512((void *)yr, (__m512i)_mm512_cvtne2ps_pbh(v[1], v[0]));
    _mm512_storeu_si512((void *)(yr + 32), (__m512i)_mm512_cvtne2ps_pbh(v[3], v[2]));
}

// One row's 64 sums of a block plus its bias → y: N wide, or with silu_mul (a gated MLP's [gate; up] rows
// interleaved in blocks of 32, N % 64 == 0: checked by the caller) its 32 outputs silu(gate) * up, N / 2 wide.
static inline void store_out(float *o, const float *bias, uint16_t *y, int64_t row, int64_t N, int64_t n0,
                             int64_t nn, const int silu_mul) {
    if (!silu_mul) {
        store_row(o, bias, y + row * N + n0, nn);
        return;
    }
    for (int c = 0; c < 4; c++)
        _mm512_storeu_ps(o + 16 * c, _mm512_add_ps(_mm512_loadu_ps(o + 16 * c), _mm512_loadu_ps(bias + 16 * c)));
    store_silu_mul_block(o, y + row * (N / 2) + n0 / 2);
}

// NOTE: b's test stays outside the loop. Inside (b && j < nn ? ... : 0), gcc made it masked loads from b + n0,
// which for b = NULL read page zero with every lane masked off: a fault each load suppresses, a microcode assist on
// AMD CPUs. On a Zen 5 they cost 2.7 µs of a 14.1 µs call (one row, 1,024 x 896 int4 weights in cache, 16 blocks).
static void load_bias(const uint16_t *b, int64_t n0, int64_t nn, float bias[NB]) {
    memset(bias, 0, sizeof(float) * NB);
    if (b)
        for (int64_t j = 0; j < nn; j++) bias[j] = bf16_to_f32(b[n0 + j]);
}

// A direct kernel's tile (w4mm's, w4fp16's): rows [r0, r0 + mr) of its call against one 64-column block's nibbles
// wq and scales sc → out [mr][64], float sums before the bias; ctx: the kernel's own (its rows as it prepared them).
typedef void (*w4_tile_fn)(const void *ctx, int64_t r0, int mr, const uint8_t *wq, const float *sc, float *out);

// The direct kernels' frame: the column blocks dealt to the threads as amxmm's are (deal.h), each block's M rows
// in tiles of rows(rows left) <= max_rows rows through `tile`, the sums plus the bias stored (store_out). WHY the
// dealing: on a 2-core AMX Xeon (model 207, a shared VM) one row over Qwen2-0.5B's 24 layers streamed through w4mm
// took 12.77-13.05 ms against 13.37-13.74 with a static half each (the QKV projection 58 against 66 us): a thread
// slowed by a neighbour no longer holds the other at the end of each call.
static void w4_direct_blocks(int64_t M, int64_t N, int64_t K, int64_t G, const uint8_t *wq, const float *sc,
                             const uint16_t *b, uint16_t *y, int nthreads, int silu_mul, int max_rows,
                             int (*rows)(int64_t left), w4_tile_fn tile, const void *ctx) {
    const int64_t groups = K / G;
    deal_t deal;
    deal_init(&deal, (N + NB - 1) / NB, nthreads);
#pragma omp parallel num_threads(nthreads)
    for (int64_t nb; (nb = deal_next(&deal, omp_get_thread_num())) >= 0;) {
        const int64_t n0 = nb * NB, nn = N - n0 < NB ? N - n0 : NB;
        float out[max_rows * NB], bias[NB];
        load_bias(b, n0, nn, bias);
        for (int64_t r0 = 0, mr; r0 < M; r0 += mr) {
            mr = rows(M - r0);
            tile(ctx, r0, (int)mr, wq + nb * K * 32, sc + nb * groups * SC_GROUP, out);
            for (int r = 0; r < mr; r++) store_out(out + r * NB, bias, y, r0 + r, N, n0, nn, silu_mul);
        }
    }
}

// A grouped call's arguments for its tasks (w4mm_grouped, w4amx_grouped): layer e's counts[e] rows of x from row
// first[p] of piece p = its layer[p]; xs the rows' group sums; failed: set by a task that found no buffer.
typedef struct {
    const int64_t *counts;
    int64_t N, K, G;
    const uint16_t *x;
    const uint8_t *const *wq;
    const float *const *sc;
    uint16_t *y;
    const float *xs;
    const int64_t *first, *layer;
    int silu_mul;
    _Atomic int *failed;
} w4group_t;

// E W4A16 layers of one shape over their own rows in one call (w4mm_grouped's arguments): the rows' group sums,
// then `task` (w4mm's or w4amx's) over every (layer with rows, column block) as grouped_tasks.h spreads them.
// Returns 0, or -1 where the sums or a task's buffer could not be had (y is then incomplete).
static int w4_grouped(int64_t E, const int64_t *counts, int64_t N, int64_t K, int64_t G, const uint16_t *x,
                      const uint8_t *const *wq, const float *const *sc, uint16_t *y, int nthreads, int silu_mul,
                      grouped_task_fn task) {
    const int64_t nblocks = (N + NB - 1) / NB, groups = K / G;
    int64_t first[E > 0 ? E : 1], layer[E > 0 ? E : 1], M;  // each layer with rows: its first row, its index
    const int64_t P = grouped_pieces(E, counts, first, layer, &M);
    if (M <= 0) return 0;
    float *xs = sums_for(M * groups);
    if (!xs) return -1;
    group_sums(M, K, G, x, xs, nthreads);
    _Atomic int failed = 0;
    const w4group_t g = {counts, N, K, G, x, wq, sc, y, xs, first, layer, silu_mul, &failed};
    grouped_tasks(P, nblocks, nthreads, 2, task, &g);
    return atomic_load(&failed) ? -1 : 0;
}

static __thread thread_buffer bf16_buf;

// The calling thread's buffer of n bf16 values (a widened group, a dequantized block), 64-byte aligned; NULL
// without memory.
static uint16_t *bf16_buffer(int64_t n) { return grow_aligned(&bf16_buf, sizeof(uint16_t) * (size_t)n); }

#endif
