// A kernel's per-thread scratch (quantized rows, group sums, widened weights), grown to the largest size a call has
// asked for and kept: a fresh malloc of a prefill's size is an mmap whose pages fault in on every call. Portable C
// (the AVX2 and AVX-512 kernels both include it); cbuild.py hashes it with every source that includes it.
#ifndef TIANMEN_THREAD_BUFFER_H
#define TIANMEN_THREAD_BUFFER_H
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>

typedef struct {
    void *p;
    size_t cap;
} thread_buffer;

// At least `bytes` of b (declare it `static __thread`), its old contents not kept; NULL without memory.
static inline void *grow(thread_buffer *b, size_t bytes) {
    if (b->cap < bytes) {
        free(b->p);
        b->p = malloc(bytes);
        b->cap = b->p ? bytes : 0;
    }
    return b->p;
}

// The same, 64-byte aligned. WHY: malloc aligns to 16 bytes, so a buffer read and written a vector at a time had
// its 64-byte (AVX-512) or every other 32-byte (AVX2) access split over two cache lines: w4mm's block-dequantizing
// kernel at 32 rows gained ~5% against bf16mm in alternating runs on a Zen 4 (benchmarks.quant_gemm).
static inline void *grow_aligned(thread_buffer *b, size_t bytes) {
    char *p = grow(b, bytes + 63);
    return p ? (void *)(((uintptr_t)p + 63) & ~(uintptr_t)63) : NULL;
}

#endif
