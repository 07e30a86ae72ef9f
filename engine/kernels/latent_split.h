// How MLA's latent decode kernels (decode_attn_latent.c, float32; decode_attn_latent_dp.c, AVX512-BF16) spread a
// step over threads: one task per sequence and group of heads, or, with fewer such tasks than threads (one
// sequence at batch 1), each sequence's tokens in parts of whole CH-token chunks, at least MIN_PART tokens a part,
// a task each, whose partial results the kernel combines after by their maxima. WHY: one thread attended while
// the other waited (DeepSeek-V2-tiny at 1,000 tokens: ~180 us a layer on a 2-core Zen 4; 0.75 ms of a 10.1 ms
// W4A16 token on a Zen 3). latent_run deals the tasks; the kernel gives the task and the combine (its row types).
// cbuild.py hashes this header with every source that includes it.
#ifndef TIANMEN_LATENT_SPLIT_H
#define TIANMEN_LATENT_SPLIT_H
#include <stddef.h>
#include <stdint.h>

#include "thread_buffer.h"

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

// A call's arguments, as the family's signature has them (decode_attn.py); q, kc and out in the kernel's row type.
typedef struct {
    const void *q, *kc;
    const int64_t *tables;
    int64_t H_all, W, bs;
    float scale;
    void *out;
} latent_call;

// Sequence b's heads [h0, h0 + H) over its tokens [t0, t1): normalised into the call's out, or with `part` that
// part's partial result into it.
typedef void (*latent_task_fn)(const latent_call *c, int64_t b, int64_t h0, int64_t H, int64_t t0, int64_t t1,
                               void *part);
// Sequence b's heads [h0, h0 + H) from its n parts' partial results (consecutive), normalised into the call's out.
typedef void (*latent_combine_fn)(const latent_call *c, int64_t b, int64_t h0, int64_t H, const void *parts,
                                  int64_t n);

static __thread thread_buffer latent_parts_buf;

// B sequences of H_all heads (tasks of at most max_h heads), tokens in ch-token chunks: `task` over every sequence
// and group of heads, or over each part of a sequence's tokens and then `combine` (part_size: bytes of one part's
// result, a multiple of 64). Without memory for the parts, one task a sequence.
static inline void latent_run(const latent_call *c, int64_t B, int64_t max_h, int64_t ch, const int64_t *ctx_lens,
                              int nthreads, size_t part_size, latent_task_fn task, latent_combine_fn combine) {
    const int64_t groups = (c->H_all + max_h - 1) / max_h, tasks = B * groups;
    if (tasks <= 0) return;
    int64_t split = latent_split(tasks, nthreads);
    char *parts = split > 1 ? grow_aligned(&latent_parts_buf, part_size * (size_t)(tasks * split)) : NULL;
    if (!parts) split = 1;
    int64_t n_parts[tasks];
    latent_parts(tasks, groups, split, ch, ctx_lens, n_parts);
#pragma omp parallel for schedule(dynamic, 1) num_threads(nthreads)
    for (int64_t i = 0; i < tasks * split; i++) {
        // a task's heads: a group of at most max_h (DeepSeek-V2/V3 have 128: eight groups read the same rows)
        const int64_t t = i / split, p = i % split, n = n_parts[t];
        if (p >= n) continue;
        const int64_t b = t / groups, h0 = t % groups * max_h, H = c->H_all - h0 < max_h ? c->H_all - h0 : max_h;
        int64_t t0 = 0, t1 = ctx_lens[b];
        if (n > 1) latent_part_tokens(p, n, ctx_lens[b], ch, &t0, &t1);
        task(c, b, h0, H, t0, t1, n > 1 ? parts + (size_t)i * part_size : NULL);
    }
    for (int64_t t = 0; t < tasks; t++)
        if (n_parts[t] > 1) {
            const int64_t h0 = t % groups * max_h, H = c->H_all - h0 < max_h ? c->H_all - h0 : max_h;
            combine(c, t / groups, h0, H, parts + (size_t)(t * split) * part_size, n_parts[t]);
        }
}

#endif
