// How a GEMM kernel deals its column blocks to threads: each thread owns a contiguous range and takes it from the
// front; a thread whose range is done takes from the back of the others'. cbuild.py hashes it with every source
// that includes it.
//
// WHY: a weight streamed from memory keeps the hardware prefetchers and the memory controller on one long run per
// thread only when each thread's blocks are adjacent. amxmm's blocks dealt four at a time dynamically (the
// threads' runs interleaved every 4 blocks) streamed 20.4-22.7 GB/s at 32 rows where the same kernel over
// contiguous halves streamed 24.6-29.1 (2-core AMX Xeon, model 207; 896-9,728 columns, weights from memory).
// Dealt statically, a thread the event loop preempts would hold its half while the other waits; stealing from
// the back keeps what dynamic dealing gave serving (the other thread finishes the preempted one's blocks).
#ifndef TIANMEN_DEAL_H
#define TIANMEN_DEAL_H
#include <stdatomic.h>
#include <stdint.h>

#define DEAL_MAX 256  // ranges; a team larger than this shares them (each still contiguous)

typedef struct {
    _Alignas(64) _Atomic uint64_t range;  // lo | hi << 32: the owner takes lo, thieves take hi - 1
} deal_slot;

typedef struct {
    deal_slot slot[DEAL_MAX];
    int n;
} deal_t;

// Before the parallel region: `tasks` split in `nthreads` contiguous ranges (tasks < 2^32). A team smaller than
// nthreads is fine: the missing threads' ranges are stolen.
static inline void deal_init(deal_t *d, int64_t tasks, int nthreads) {
    d->n = nthreads < 1 ? 1 : nthreads > DEAL_MAX ? DEAL_MAX : nthreads;
    for (int i = 0; i < d->n; i++) {
        const uint64_t lo = (uint64_t)(tasks * i / d->n), hi = (uint64_t)(tasks * (i + 1) / d->n);
        atomic_init(&d->slot[i].range, lo | hi << 32);
    }
}

// The next task for thread `tid`, or -1 when every range is done.
static inline int64_t deal_next(deal_t *d, int tid) {
    for (int i = 0; i < d->n; i++) {
        _Atomic uint64_t *r = &d->slot[(tid + i) % d->n].range;
        uint64_t cur = atomic_load_explicit(r, memory_order_relaxed);
        for (;;) {
            const uint64_t lo = cur & 0xFFFFFFFFu, hi = cur >> 32;
            if (lo >= hi) break;
            const uint64_t next = i == 0 ? lo + 1 | hi << 32 : lo | (hi - 1) << 32;
            if (atomic_compare_exchange_weak_explicit(r, &cur, next, memory_order_relaxed, memory_order_relaxed))
                return (int64_t)(i == 0 ? lo : hi - 1);
        }
    }
    return -1;
}

#endif
