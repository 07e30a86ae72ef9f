// How a grouped call (several linear layers of one shape, each over its own rows: bf16mm_grouped, w4mm_grouped,
// i8mm_grouped, wbf16_grouped) spreads its (layer piece, column block) tasks over threads. cbuild.py hashes it with
// every source that includes it.
//
// Where there are at least as many column blocks as threads, each thread takes its own range of column blocks of
// every piece, piece after piece: the same work for every thread, and a long run of adjacent blocks of one weight
// for the hardware prefetchers. With more threads than blocks, threads take tasks `chunk` at a time dynamically.
// WHY: taken four at a time dynamically, DeepSeek-V2-tiny's routed experts (8 rows each, 7 layers streamed from
// memory, 2-core Zen 4) took 1.38-1.65 ms a layer through bf16mm's build without software prefetch, 1.29-1.37
// split this way (in another half hour of the same VM: 1.11-1.13 against 1.01-1.06).
#ifndef TIANMEN_GROUPED_TASKS_H
#define TIANMEN_GROUPED_TASKS_H
#include <omp.h>
#include <stdint.h>

// run(ctx, piece, block, end): one task; `end` is where the calling thread's run of blocks of that piece stops
// (a kernel that prefetches its next block asks for none at or past it: another thread's).
typedef void (*grouped_task_fn)(const void *ctx, int64_t piece, int64_t block, int64_t end);

static inline void grouped_tasks(int64_t pieces, int64_t nblocks, int nthreads, int chunk, grouped_task_fn run,
                                 const void *ctx) {
    if (nthreads <= nblocks) {
#pragma omp parallel num_threads(nthreads)
        {
            const int64_t nth = omp_get_num_threads(), tid = omp_get_thread_num();
            const int64_t b0 = nblocks * tid / nth, b1 = nblocks * (tid + 1) / nth;
            for (int64_t p = 0; p < pieces; p++)
                for (int64_t nb = b0; nb < b1; nb++) run(ctx, p, nb, b1);
        }
        return;
    }
#pragma omp parallel for schedule(dynamic, chunk) num_threads(nthreads)
    for (int64_t t = 0; t < pieces * nblocks; t++) run(ctx, t / nblocks, t % nblocks, nblocks);
}

// A grouped call's layers that have rows (counts[e] > 0), in order: each one's first row of x and its index, into
// first and layer (E slots each); returns how many (the call's pieces), and in *rows the rows of all E layers.
static inline int64_t grouped_pieces(int64_t E, const int64_t *counts, int64_t *first, int64_t *layer,
                                     int64_t *rows) {
    int64_t P = 0, row = 0;
    for (int64_t e = 0; e < E; row += counts[e++])
        if (counts[e] > 0) first[P] = row, layer[P++] = e;
    *rows = row;
    return P;
}

#endif
