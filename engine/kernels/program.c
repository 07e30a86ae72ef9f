// A decode step's kernel calls as one C call (engine/kernels/program.py).
//
// A program is a table of ops, OP_WIDTH int64 each: kind, the kernel's entry point, a mask, then the kernel's
// arguments in order. Bit j of the mask says that argument j is not a value but an index into the step's values
// (rows, block tables, context lengths, ...), which change from step to step; everything else (weights, caches,
// the program's own buffers) stays where it is. Floats travel as their 32-bit pattern in the low half.
//
// WHY: at batch 1 the kernels of a small model's layer take a few microseconds each, and reaching each from
// Python (module calls, argument checks, a torch.empty per output, the ctypes call) took ~100 us a layer.
#include <stdint.h>
#include <string.h>

#define OP_WIDTH 20
#define MAX_ARGS (OP_WIDTH - 3)

enum { OP_GEMM = 1, OP_NORM = 2, OP_ROPE = 3, OP_STORE = 4, OP_ATTN = 5, OP_I8 = 6, OP_I8_SILU = 7, OP_W4 = 8 };

// the entry points' signatures: bf16mm.c / amxmm.c, pointwise.c, decode_attn*.c
typedef void (*gemm_fn)(int64_t, int64_t, int64_t, const void *, const void *, const void *, void *, int);
typedef void (*norm_fn)(int64_t, int64_t, const void *, const void *, const void *, float, void *, void *, int);
typedef void (*rope_fn)(int64_t, int64_t, int64_t, void *, int64_t, const void *, const void *, int);
typedef void (*attn_fn)(int64_t, int64_t, int64_t, int64_t, const void *, const void *, const void *, int64_t,
                        const void *, int64_t, const void *, float, void *, int);
// the quantized GEMMs (i8mm.c / i8amx.c, w4mm.c / w4amx.c) return 0, or -1 without memory for their buffers
typedef int (*i8_fn)(int64_t, int64_t, int64_t, const void *, int, const void *, const void *, const void *,
                     const void *, void *, int);
typedef int (*i8_silu_fn)(int64_t, int64_t, int64_t, const void *, const void *, const void *, const void *,
                          const void *, void *, int);
typedef int (*w4_fn)(int64_t, int64_t, int64_t, int64_t, const void *, const void *, const void *, const void *,
                     void *, int);

static float as_float(int64_t v) {
    union {
        uint32_t i;
        float f;
    } u;
    u.i = (uint32_t)v;
    return u.f;
}

// This step's K and V rows into the paged cache at their slots, and the query rows into a dense buffer (the
// attention kernels read [rows][heads][D] with no gaps; the fused projection interleaves q, k and v per row).
// Sizes in bytes; `ld` is the distance between rows of the projection's output.
static void store(int64_t rows, int64_t ld, const char *q, int64_t q_bytes, char *q_out, const char *k,
                  const char *v, int64_t kv_bytes, char *k_cache, char *v_cache, const int64_t *slots) {
    for (int64_t r = 0; r < rows; r++) {
        memcpy(q_out + r * q_bytes, q + r * ld, (size_t)q_bytes);
        memcpy(k_cache + slots[r] * kv_bytes, k + r * ld, (size_t)kv_bytes);
        memcpy(v_cache + slots[r] * kv_bytes, v + r * ld, (size_t)kv_bytes);
    }
}

// Runs ops [0, n) in order; returns n, or the index of the first op that failed (a quantized GEMM without memory
// for its buffers) or is of an unknown kind: nothing after it runs.
int64_t program_run(const int64_t *ops, int64_t n, const int64_t *step) {
    for (int64_t i = 0; i < n; i++) {
        const int64_t *op = ops + i * OP_WIDTH;
        const int64_t mask = op[2];
        int64_t a[MAX_ARGS];
        for (int j = 0; j < MAX_ARGS; j++) a[j] = (mask >> j & 1) ? step[op[3 + j]] : op[3 + j];
        const void *fn = (const void *)op[1];
        switch (op[0]) {
        case OP_GEMM:
            ((gemm_fn)fn)(a[0], a[1], a[2], (const void *)a[3], (const void *)a[4], (const void *)a[5], (void *)a[6],
                          (int)a[7]);
            break;
        case OP_NORM:
            ((norm_fn)fn)(a[0], a[1], (const void *)a[2], (const void *)a[3], (const void *)a[4], as_float(a[5]),
                          (void *)a[6], (void *)a[7], (int)a[8]);
            break;
        case OP_ROPE:
            ((rope_fn)fn)(a[0], a[1], a[2], (void *)a[3], a[4], (const void *)a[5], (const void *)a[6], (int)a[7]);
            break;
        case OP_STORE:
            store(a[0], a[1], (const char *)a[2], a[3], (char *)a[4], (const char *)a[5], (const char *)a[6], a[7],
                  (char *)a[8], (char *)a[9], (const int64_t *)a[10]);
            break;
        case OP_ATTN:
            ((attn_fn)fn)(a[0], a[1], a[2], a[3], (const void *)a[4], (const void *)a[5], (const void *)a[6], a[7],
                          (const void *)a[8], a[9], (const void *)a[10], as_float(a[11]), (void *)a[12], (int)a[13]);
            break;
        case OP_I8:
            if (((i8_fn)fn)(a[0], a[1], a[2], (const void *)a[3], (int)a[4], (const void *)a[5], (const void *)a[6],
                            (const void *)a[7], (const void *)a[8], (void *)a[9], (int)a[10]) != 0)
                return i;
            break;
        case OP_I8_SILU:
            if (((i8_silu_fn)fn)(a[0], a[1], a[2], (const void *)a[3], (const void *)a[4], (const void *)a[5],
                                 (const void *)a[6], (const void *)a[7], (void *)a[8], (int)a[9]) != 0)
                return i;
            break;
        case OP_W4:
            if (((w4_fn)fn)(a[0], a[1], a[2], a[3], (const void *)a[4], (const void *)a[5], (const void *)a[6],
                            (const void *)a[7], (void *)a[8], (int)a[9]) != 0)
                return i;
            break;
        default:
            return i;
        }
    }
    return n;
}
