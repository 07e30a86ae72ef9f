// How MLA's latent decode kernels (decode_attn_latent.c, float32; decode_attn_latent_dp.c, AVX512-BF16) spread a
// step over threads: one task per sequence and group of heads, or, with fewer such tasks than threads (one
// sequence at batch 1), each sequence's tokens in parts of whole CH-token chunks, at least MIN_PART tokens a part,
// a task each, whose partial results the kernel combines after by their maxima. WHY: one thread attended while
// the other waited (DeepSeek-V2-tiny at 1,000 tokens: ~180 us a layer on a 2-core Zen 4; 0.75 ms of a 10.1 ms
// W4A16 token on a Zen 3). cbuild.py hashes this header with every source that includes it.
#ifndef TIANMEN_LATENT_SPLIT_H
#define TIANMEN_LATENT_SPLIT_H
#include <stdint.h>

#define MAX_PARTS 8  // parts a sequence's tokens are split in at most
#define MIN_PART 64  // tokens a part at least where a sequence's tokens are split over threads

// Parts a task may take: threads / tasks where there are fewer tasks than threads (at most MAX_PARTS), else 1.
static inline int64_t latent_split(int64_t tasks, int nthreads) {
    const int64_t split = tasks < nthreads ? nthreads / tasks : 1;
    return split > MAX_PARTS ? MAX_PARTS : split;
}

// n_parts[t] for each task t (groups of heads a sequence, sequence t / groups): as many as `split` allows with at
// least MIN_PART tokens and one CH-token chunk a part, or 1.
static inline void latent_parts(int64_t tasks, int64_t groups, int64_t split, int64_t ch, const int64_t *ctx_lens,
                                int64_t *n_parts) {
    for (int64_t t = 0; t < tasks; t++) {
        const int64_t len = ctx_lens[t / groups], chunks = (len + ch - 1) / ch, most = len / MIN_PART;
        const int64_t n = split < most ? split : most;
        n_parts[t] = n > 1 && chunks >= n ? n : 1;
    }
}

// The tokens [*t0, *t1) of part p of n of a sequence of L tokens: whole ch-token chunks, the last part's cut at L.
static inline void latent_part_tokens(int64_t p, int64_t n, int64_t L, int64_t ch, int64_t *t0, int64_t *t1) {
    const int64_t chunks = (L + ch - 1) / ch, end = chunks * (p + 1) / n * ch;
    *t0 = chunks * p / n * ch;
    *t1 = end < L ? end : L;
}

#endif
