// y[M][N] = x[M][K] . W^T (+ b), all bf16, fp32 accumulation, on Intel AMX tiles (Sapphire Rapids and later).
// For the small batches of decode: oneDNN's AMX GEMM is fast at prefill sizes but, at 1-32 rows, measured 3x
// off the weights' streaming rate on a 2-core Xeon (docs/PERFORMANCE.md). The engine times this kernel against
// oneDNN per weight shape and batch size and runs it only where it wins (engine/kernels/select.py).
//
// Tiles (palette 1): 0-3 accumulate a 32 x 32 fp32 block (rows 0-15 / 16-31 x cols 0-15 / 16-31), 4-5 hold two
// 16-row slices of x (32 k each), 6-7 two 16-column slices of the weight in AMX's pair layout. Each weight tile
// is loaded once per 32 rows of x and used twice.
//
// Packed layout: [ceil(N/32)][K/32][2][16][32] bf16: per 32-column block and 32-k step, two tiles; in tile t
// row r holds k = 2r, 2r+1 of the 16 columns 16t..16t+15 side by side (c*2 + j = column c, k 2r + j).
// K must be a multiple of 32 (amxmm.py checks); missing columns are packed as zeros and never stored.
//
// amxmm_linear_silu_mul: a gated MLP's [gate | up] projection whose weight rows were interleaved in blocks of 32
// (gate 0-31, up 0-31, gate 32-63, ...; amxmm.py does it) returns silu(gate) * up, with the roundings of the
// unfused torch code: the [M, 2I] projection never goes to memory, and the separate SiLU and multiply passes
// (58 us a layer at 32 rows of Qwen2-0.5B's MLP on a 2-core Xeon) disappear. Each gate block and its up block
// are adjacent in the packed weight, so the stream stays sequential.
#if !defined(__AMX_TILE__) || !defined(__AMX_BF16__) || !defined(__AVX512BF16__)
#error "this kernel needs AMX-BF16 and AVX512-BF16 (-march=native on a CPU without them: oneDNN is used instead)"
#endif
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#include <omp.h>

#include "amx_tiles.h"
#include "avx512_math.h"
#include "deal.h"

#define TILE_ELEMS 512  // 16 rows x 32 bf16
// Weight k-steps prefetched ahead: AMX tile loads do not draw the hardware prefetcher along, and without it a
// decode GEMM streamed at 7-17 GB/s instead of 13-25 (2 cores, 24 x 17 MB weights, 1-32 rows, a Xeon of model
// 207). On another AMX VM (model 167) the prefetch cost 5-8% at one row instead: the library is also built with
// -DPF=0 (none), and the selection times both (engine/kernels/bind.py).
#ifndef PF
#define PF 2
#endif
// ... and PF_FAR k-steps ahead into L2 only: at 32 rows the tile products' time added to the stream's (the loads
// wait on memory, then the products run) and the near prefetch alone cannot keep enough lines in flight; asking
// L2 for them 12 steps ahead brought gate/up (896 x 9,728, 60 weights from memory) from 642-679 to 542-614 us a
// call and down_proj from 279-304 to 248-289 at 32 rows, no change at 1 and 8 (2-core AMX Xeon, model 207).
#ifndef PF_FAR
#define PF_FAR (PF > 0 ? 12 : 0)
#endif

int amxmm_init(void) { return request_tile_state(); }

// The weight k-step PF steps past wk into L1 and the one PF_FAR steps past it into L2 (2 KB each).
static inline __attribute__((always_inline)) void prefetch_ahead(const uint16_t *wk) {
    const char *near = (const char *)(wk + PF * 2 * TILE_ELEMS), *far = (const char *)(wk + PF_FAR * 2 * TILE_ELEMS);
    if (PF > 0)
        for (int l = 0; l < 32; l++) _mm_prefetch(near + 64 * l, _MM_HINT_T0);
    if (PF_FAR > 0)
        for (int l = 0; l < 32; l++) _mm_prefetch(far + 64 * l, _MM_HINT_T1);
}

static inline uint16_t to_bf16(float f) {  // round to nearest even, as VCVTNEPS2BF16 does
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7FFFFFFFu) > 0x7F800000u) return (uint16_t)((u >> 16) | 0x40);
    return (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1)) >> 16);
}

// b's test outside the loop, as w4mm_common.h's load_bias (masked loads from page zero for b = NULL otherwise).
static void load_bias(const uint16_t *b, int64_t n0, int64_t nn, float bias[32]) {
    memset(bias, 0, sizeof(float) * 32);
    if (!b) return;
    for (int64_t j = 0; j < nn && j < 32; j++) {
        const uint32_t u = (uint32_t)b[n0 + j] << 16;
        memcpy(&bias[j], &u, 4);
    }
}

// c: [32][32] fp32 of the block; rows [m0, m0 + mr) and columns [n0, n0 + nn) of y get c + bias, in bf16.
static void store(const float *c, int64_t m0, int mr, int64_t n0, int64_t nn, int64_t N, const float *bias,
                  uint16_t *y) {
    for (int r = 0; r < mr; r++) {
        const float *cr = c + r * 32;
        uint16_t *yr = y + (m0 + r) * N + n0;
        if (nn == 32) {
            const __m512 lo = _mm512_add_ps(_mm512_loadu_ps(cr), _mm512_loadu_ps(bias));
            const __m512 hi = _mm512_add_ps(_mm512_loadu_ps(cr + 16), _mm512_loadu_ps(bias + 16));
            _mm512_storeu_si512((void *)yr, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
        } else {
            for (int64_t j = 0; j < nn; j++) yr[j] = to_bf16(cr[j] + bias[j]);
        }
    }
}

// g, u: the [32][32] fp32 blocks of 32 gate and the matching 32 up columns; y's columns [n0, n0 + 32) of rows
// [m0, m0 + mr) get silu(g + gb) * (u + ub), a row of y being N / 2 wide.
static void store_silu_mul(const float *g, const float *u, int64_t m0, int mr, int64_t n0, int64_t N,
                           const float *gb, const float *ub, uint16_t *y) {
    for (int r = 0; r < mr; r++) {
        const float *gr = g + r * 32, *ur = u + r * 32;
        uint16_t *yr = y + (m0 + r) * (N / 2) + n0;
        const __m512 lo = silu_mul16(_mm512_add_ps(_mm512_loadu_ps(gr), _mm512_loadu_ps(gb)),
                                     _mm512_add_ps(_mm512_loadu_ps(ur), _mm512_loadu_ps(ub)));
        const __m512 hi = silu_mul16(_mm512_add_ps(_mm512_loadu_ps(gr + 16), _mm512_loadu_ps(gb + 16)),
                                     _mm512_add_ps(_mm512_loadu_ps(ur + 16), _mm512_loadu_ps(ub + 16)));
        _mm512_storeu_si512((void *)yr, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
    }
}

static void block_rows(int64_t m0, int mr, int64_t K, const uint16_t *x, const uint16_t *wb, float *c) {
    const int64_t ksteps = K / 32, stride = K * 2;
    const uint16_t *xa = x + m0 * K, *xb = xa + 16 * K;
    _tile_zero(0);
    _tile_zero(1);
    if (mr > 16) {
        _tile_zero(2);
        _tile_zero(3);
        for (int64_t ks = 0; ks < ksteps; ks++) {
            const uint16_t *wk = wb + ks * 2 * TILE_ELEMS;
            prefetch_ahead(wk);
            _tile_loadd(4, xa + ks * 32, stride);
            _tile_loadd(5, xb + ks * 32, stride);
            _tile_loadd(6, wk, 64);
            _tile_loadd(7, wk + TILE_ELEMS, 64);
            _tile_dpbf16ps(0, 4, 6);
            _tile_dpbf16ps(1, 4, 7);
            _tile_dpbf16ps(2, 5, 6);
            _tile_dpbf16ps(3, 5, 7);
        }
        _tile_stored(2, c + 16 * 32, 128);
        _tile_stored(3, c + 16 * 32 + 16, 128);
    } else {
        for (int64_t ks = 0; ks < ksteps; ks++) {
            const uint16_t *wk = wb + ks * 2 * TILE_ELEMS;
            prefetch_ahead(wk);
            _tile_loadd(4, xa + ks * 32, stride);
            _tile_loadd(6, wk, 64);
            _tile_loadd(7, wk + TILE_ELEMS, 64);
            _tile_dpbf16ps(0, 4, 6);
            _tile_dpbf16ps(1, 4, 7);
        }
    }
    _tile_stored(0, c, 128);
    _tile_stored(1, c + 16, 128);
}

// One GEMM of a group: rows [0, M) of x and y, the packed weight w. A plain linear layer is a group of one;
// a mixture-of-experts layer is one group per expert (the rows routed to it), all under one parallel region.
typedef struct {
    const uint16_t *x, *w;
    uint16_t *y;
    int64_t M;
} group_t;

// Threads take the 32-column blocks (pairs of them for silu_mul) of every group as deal.h deals them: each its own
// contiguous run, then the back of the others' (on a 2-core server the event loop preempts one thread now and
// then, and the other takes its blocks instead of waiting at the end: serving measured 26.6 ms of GEMMs a step
// with blocks dealt dynamically, 28.3 with halves split up front). Within a block the rows of x go by in 32-row
// steps while the block's weights (K x 64 bytes) stay in L1/L2.
static void run(int64_t G, const group_t *groups, int64_t N, int64_t K, const uint16_t *b, int nthreads,
                const int silu_mul) {
    const int64_t nblocks = (N + 31) / 32, ksteps = K / 32, per = silu_mul ? 2 : 1, units = nblocks / per;
    deal_t deal;
    deal_init(&deal, G * units, nthreads);
#pragma omp parallel num_threads(nthreads)
    {
        float c[2][32 * 32] __attribute__((aligned(64)));
        float bias[2][32];
        int configured = -1;  // the tail's config differs from a full block's
        for (int64_t task; (task = deal_next(&deal, omp_get_thread_num())) >= 0;) {
            const group_t *g = groups + task / units;
            const int64_t unit = task % units, nb = unit * per, n0 = nb * 32, nn = N - n0 < 32 ? N - n0 : 32;
            const int64_t full = g->M / 32, tail = g->M % 32;
            for (int64_t i = 0; i < per; i++) load_bias(b, n0 + 32 * i, nn, bias[i]);
            const uint16_t *wb = g->w + nb * ksteps * 2 * TILE_ELEMS;
            for (int64_t mb = 0; mb <= full; mb++) {
                const int mr = mb < full ? 32 : (int)tail;
                if (mr == 0) break;
                if (configured != mr) {
                    amx_configure(mr < 16 ? mr : 16, mr > 16 ? mr - 16 : 0);
                    configured = mr;
                }
                block_rows(mb * 32, mr, K, g->x, wb, c[0]);
                if (!silu_mul) {
                    store(c[0], mb * 32, mr, n0, nn, N, bias[0], g->y);
                    continue;
                }
                block_rows(mb * 32, mr, K, g->x, wb + ksteps * 2 * TILE_ELEMS, c[1]);
                store_silu_mul(c[0], c[1], mb * 32, mr, unit * 32, N, bias[0], bias[1], g->y);
            }
        }
        _tile_release();
    }
}

#ifndef ROWS_A_PASS
#define ROWS_A_PASS 512
#endif
// A call of more rows runs as passes of ROWS_A_PASS: within a pass each column block reads all of the pass's x,
// so a whole prefill's x (4,096 rows) was read from L3 once per 32 columns (Qwen2-0.5B's o_proj: 4.6 ms a call
// as one pass, 3.3 in passes of 512, on a 2-core AMX Xeon). 512 is also the row count the selection times
// the prefill class at (engine/kernels/select.py), so this kernel's time a row there holds for longer calls
// (oneDNN's and F.linear's fall further past it: docs/PERFORMANCE.md).
static void in_passes(int64_t M, int64_t N, int64_t K, const uint16_t *x, const uint16_t *w, const uint16_t *b,
                      uint16_t *y, int nthreads, int silu_mul) {
    const int64_t width = silu_mul ? N / 2 : N;
    for (int64_t m0 = 0; m0 < M; m0 += ROWS_A_PASS) {
        const group_t g = {x + m0 * K, w, y + m0 * width, M - m0 < ROWS_A_PASS ? M - m0 : ROWS_A_PASS};
        run(1, &g, N, K, b, nthreads, silu_mul);
    }
}

void amxmm_linear(int64_t M, int64_t N, int64_t K, const uint16_t *x, const uint16_t *w, const uint16_t *b,
                  uint16_t *y, int nthreads) {
    in_passes(M, N, K, x, w, b, y, nthreads, 0);
}

// N % 64 == 0 (amxmm.py checks): whole gate/up block pairs; y is [M][N / 2].
void amxmm_linear_silu_mul(int64_t M, int64_t N, int64_t K, const uint16_t *x, const uint16_t *w,
                           const uint16_t *b, uint16_t *y, int nthreads) {
    in_passes(M, N, K, x, w, b, y, nthreads, 1);
}

// E experts of one MoE layer in one call: expert e takes counts[e] consecutive rows of x (experts in order)
// and its packed weight w[e] (all N x K, no bias); y gets its rows in the same order, N wide, or N / 2 with
// silu_mul. Experts with no rows are skipped. WHY: a decode batch gives each expert a handful of rows, and a
// call per expert paid a parallel region and a Python round trip each (~135 us a call for ~10 us of streaming,
// DeepSeek-V2-tiny's experts at batch 32 on a 2-core Xeon).
void amxmm_grouped(int64_t E, const int64_t *counts, int64_t N, int64_t K, const uint16_t *x,
                   const uint16_t *const *w, uint16_t *y, int nthreads, int silu_mul) {
    group_t groups[E > 0 ? E : 1];
    int64_t G = 0, row = 0;
    const int64_t width = silu_mul ? N / 2 : N;
    for (int64_t e = 0; e < E; e++) {
        if (counts[e] > 0) groups[G++] = (group_t){x + row * K, w[e], y + row * width, counts[e]};
        row += counts[e];
    }
    if (G) run(G, groups, N, K, NULL, nthreads, silu_mul);
}

void amxmm_pack(int64_t N, int64_t K, const uint16_t *w, uint16_t *packed, int nthreads) {
    const int64_t nblocks = (N + 31) / 32, ksteps = K / 32;
#pragma omp parallel for schedule(static) num_threads(nthreads)
    for (int64_t nb = 0; nb < nblocks; nb++) {
        for (int64_t ks = 0; ks < ksteps; ks++) {
            uint16_t *dst = packed + (nb * ksteps + ks) * 2 * TILE_ELEMS;
            for (int t = 0; t < 2; t++)
                for (int r = 0; r < 16; r++)
                    for (int col = 0; col < 16; col++)
                        for (int j = 0; j < 2; j++) {
                            const int64_t n = nb * 32 + t * 16 + col, k = ks * 32 + 2 * r + j;
                            dst[t * TILE_ELEMS + r * 32 + col * 2 + j] = n < N ? w[n * K + k] : 0;
                        }
        }
    }
}
