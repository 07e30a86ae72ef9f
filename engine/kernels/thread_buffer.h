// A kernel's per-thread scratch (quantized rows, group sums, widened weights), grown to the largest size a call has
// asked for and kept: a fresh malloc of a prefill's size is an mmap whose pages fault in on every call. Portable C
// (the AVX2 and AVX-512 kernels both include it); cbuild.py hashes it with every source that includes it.
#ifndef TIANMEN_THREAD_BUFFER_H
#define TIANMEN_THREAD_BUFFER_H
#include <stddef.h>
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

#endif
