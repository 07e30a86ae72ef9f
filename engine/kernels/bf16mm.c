// y[M][N] = x[M][K] . W^T (+ b), all bf16, fp32 accumulation, for CPUs with AVX512-BF16 (Zen 4, Cooper Lake,
// Sapphire Rapids and later). VDPBF16PS multiplies bf16 pairs and accumulates in fp32: what oneDNN does for a
// bf16 linear layer, without its per-call overhead at the small batches of decode. Built by cbuild.py.
//
// Packed layout: [ceil(N/64)][ceil(K/2)][64][2] bf16: for each 64-column block and each pair of k, the 64
// columns' two weights side by side, so one 64-byte load feeds 16 columns x 2 k to one VDPBF16PS.
//
// bf16mm_linear_silu_mul: a gated MLP's [gate | up] projection whose weight rows were interleaved in blocks of
// 32 (gate 0-31, up 0-31, gate 32-63, ...; bf16mm.py does it) returns silu(gate) * up directly, with the
// roundings of the unfused torch code (gate, up, silu(gate) and the product each rounded to bf16): the
// [M, 2I] projection never goes to memory and the separate SiLU and multiply passes disappear.
#ifndef __AVX512BF16__
#error "this kernel needs AVX512-BF16 (-march=native on a CPU without it: oneDNN is used instead)"
#endif
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#include "bf16mm_block.h"
#include "grouped_tasks.h"

// Threads split the output columns, so each streams only its share of the weights.
static void run(int64_t M, int64_t N, int64_t K, const uint16_t *x, const uint16_t *w, const uint16_t *b,
                uint16_t *y, int nthreads, const int silu_mul) {
    const int64_t nblocks = (N + NB - 1) / NB, block_size = (K + 1) / 2 * 2 * NB;
#pragma omp parallel num_threads(nthreads)
    for (int64_t mc0 = 0; mc0 < M; mc0 += MC) {
        const int64_t mc1 = M < mc0 + MC ? M : mc0 + MC;
        // the same static split in every chunk: a thread always writes the same columns, so no barrier is needed
#pragma omp for schedule(static) nowait
        for (int64_t nb = 0; nb < nblocks; nb++)
            block(mc0, mc1, nb, nblocks, N, K, x, w + nb * block_size, b, y, silu_mul);
    }
}

void bf16mm_linear(int64_t M, int64_t N, int64_t K, const uint16_t *x, const uint16_t *w, const uint16_t *b,
                   uint16_t *y, int nthreads) {
    run(M, N, K, x, w, b, y, nthreads, 0);
}

void bf16mm_linear_silu_mul(int64_t M, int64_t N, int64_t K, const uint16_t *x, const uint16_t *w,
                            const uint16_t *b, uint16_t *y, int nthreads) {
    run(M, N, K, x, w, b, y, nthreads, 1);
}

// E linear layers of one shape (no bias) in one call: layer e takes counts[e] consecutive rows of x (layers in
// order) and its packed weight w[e]; y gets its rows in the same order, N wide (N / 2 with silu_mul). WHY: a decode
// batch gives each of a MoE layer's experts a handful of rows, and a call per expert paid a parallel region and a
// Python round trip each (engine.kernels.grouped). Tasks (rows of a layer, column block) go to threads as
// grouped_tasks.h says.
typedef struct {
    const uint16_t *x, *w;
    uint16_t *y;
    int64_t m0, m1;
} piece_t;

typedef struct {
    const piece_t *pieces;
    int64_t N, K;
    int silu_mul;
} grouped_t;

static void grouped_task(const void *ctx, int64_t piece, int64_t nb, int64_t end) {
    const grouped_t *g = ctx;
    const piece_t *p = g->pieces + piece;
    const int64_t K = g->K;
    block(p->m0, p->m1, nb, end, g->N, K, p->x, p->w + nb * ((K + 1) / 2) * 2 * NB, NULL, p->y, g->silu_mul);
}

void bf16mm_grouped(int64_t E, const int64_t *counts, int64_t N, int64_t K, const uint16_t *x,
                    const uint16_t *const *w, uint16_t *y, int nthreads, int silu_mul) {
    int64_t P = 0, row = 0;
    for (int64_t e = 0; e < E; e++) P += (counts[e] + MC - 1) / MC;
    piece_t pieces[P > 0 ? P : 1];
    const int64_t width = silu_mul ? N / 2 : N, nblocks = (N + NB - 1) / NB;
    P = 0;
    for (int64_t e = 0; e < E; e++) {
        for (int64_t m0 = 0; m0 < counts[e]; m0 += MC)
            pieces[P++] = (piece_t){x + row * K, w[e], y + row * width, m0, counts[e] < m0 + MC ? counts[e] : m0 + MC};
        row += counts[e];
    }
    const grouped_t g = {pieces, N, K, silu_mul};
    grouped_tasks(P, nblocks, nthreads, 4, grouped_task, &g);
}

// W [N][K] bf16 row-major -> the packed layout above, zero-padded to whole blocks and pairs.
void bf16mm_pack(int64_t N, int64_t K, const uint16_t *w, uint16_t *packed, int nthreads) {
    const int64_t nblocks = (N + NB - 1) / NB, pairs = (K + 1) / 2;
#pragma omp parallel for schedule(static) num_threads(nthreads)
    for (int64_t nb = 0; nb < nblocks; nb++)
        for (int64_t kp = 0; kp < pairs; kp++)
            for (int64_t j = 0; j < NB; j++)
                for (int64_t t = 0; t < 2; t++) {
                    const int64_t n = nb * NB + j, k = 2 * kp + t;
                    packed[((nb * pairs + kp) * NB + j) * 2 + t] = n < N && k < K ? w[n * K + k] : 0;
                }
}
