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
#include <time.h>

#define OP_WIDTH 20
#define MAX_ARGS (OP_WIDTH - 3)

enum {
    OP_GEMM = 1, OP_NORM = 2, OP_ROPE = 3, OP_STORE = 4, OP_ATTN = 5, OP_I8 = 6, OP_I8_SILU = 7, OP_W4 = 8,
    // DeepSeek's (engine/models/deepseek_program.py): norms of strided rows, RoPE on interleaved pairs, copies
    // between [rows][heads] and [heads][rows] layouts, rows into the cache, grouped GEMMs, MoE routing and combine
    OP_NORM_ROWS = 9, OP_ROPE_PAIRS = 10, OP_COPY = 11, OP_SCATTER = 12, OP_FILL = 13, OP_GROUPED = 14,
    OP_GROUPED_W4 = 15, OP_GROUPED_I8 = 16, OP_ROUTE = 17, OP_COMBINE = 18,
    // MLA's W_UK over the checkpoint's int4 key rows (engine/quant/absorbed_key.py): the query scaled per latent
    // group into [heads][groups][rows], and the products by group back to [heads][rows][latent]
    OP_SCALE_GROUPS = 19, OP_MERGE_GROUPS = 20
};

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
typedef void (*rope_pairs_fn)(int64_t, int64_t, int64_t, void *, int64_t, int64_t, const void *, const void *, int);
// the grouped entries (bf16mm / amxmm / wbf16, w4mm / w4amx, i8mm / i8amx): E layers, counts[e] rows each
typedef void (*grouped_fn)(int64_t, const int64_t *, int64_t, int64_t, const void *, const void *, void *, int, int);
typedef int (*grouped_w4_fn)(int64_t, const int64_t *, int64_t, int64_t, int64_t, const void *, const void *,
                             const void *, void *, int, int);
typedef int (*grouped_i8_fn)(int64_t, const int64_t *, int64_t, int64_t, const void *, const void *, const void *,
                             const void *, void *, int, int);
typedef void (*route_fn)(int64_t, int64_t, int64_t, int64_t, const void *, const void *, const void *,
                         const void *, float, void *, void *, void *, void *, void *, int);
typedef int (*combine_fn)(int64_t, int64_t, int64_t, int64_t, const void *, const void *, const void *,
                          const void *, void *, int);

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

// Rows of `bytes` from src to dst, for each of `heads`; strides in bytes. A head stride of 0 is the layout of a
// grouped call's input or output, [heads][rows][...]: rows times that side's row stride.
static void copy(int64_t rows, int64_t heads, int64_t bytes, const char *src, int64_t s_row, int64_t s_head,
                 char *dst, int64_t d_row, int64_t d_head) {
    if (!s_head) s_head = rows * s_row;
    if (!d_head) d_head = rows * d_row;
    for (int64_t h = 0; h < heads; h++)
        for (int64_t r = 0; r < rows; r++)
            memcpy(dst + r * d_row + h * d_head, src + r * s_row + h * s_head, (size_t)bytes);
}

// bf16 of a float, rounded to nearest even as torch rounds (NaN stays a quiet NaN)
static uint16_t to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

// out[h][g][r][:] = x[h][r][:] * scales[h][g][:] for `n` inputs, scales float: x and out bf16 (the product
// rounded to bf16) or, with f32, float (float32 math's rows: the product as it is)
static void scale_groups(int64_t rows, int64_t heads, int64_t groups, int64_t n, const void *x,
                         const float *scales, void *out, int f32) {
    for (int64_t h = 0; h < heads; h++)
        for (int64_t g = 0; g < groups; g++)
            for (int64_t r = 0; r < rows; r++) {
                const int64_t xi = (h * rows + r) * n, oi = ((h * groups + g) * rows + r) * n;
                const float *s = scales + (h * groups + g) * n;
                if (f32) {
                    for (int64_t i = 0; i < n; i++) ((float *)out)[oi + i] = ((const float *)x)[xi + i] * s[i];
                    continue;
                }
                for (int64_t i = 0; i < n; i++) {
                    uint32_t u = (uint32_t)((const uint16_t *)x)[xi + i] << 16;
                    float v;
                    memcpy(&v, &u, sizeof v);
                    ((uint16_t *)out)[oi + i] = to_bf16(v * s[i]);
                }
            }
}

// dst[h][r][g * bytes ...] = src[h][g][r][...]: runs of `bytes`
static void merge_groups(int64_t rows, int64_t heads, int64_t groups, int64_t bytes, const char *src, char *dst) {
    for (int64_t h = 0; h < heads; h++)
        for (int64_t g = 0; g < groups; g++)
            for (int64_t r = 0; r < rows; r++)
                memcpy(dst + ((h * rows + r) * groups + g) * bytes, src + ((h * groups + g) * rows + r) * bytes,
                       (size_t)bytes);
}

static double now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec * 1e9 + (double)t.tv_nsec;
}

// Runs ops [0, n) in order; returns n, or the index of the first op that failed (a quantized GEMM or the MoE
// combine without memory for its buffers) or is of an unknown kind: nothing after it runs. With `ns`, op i's
// wall time is added to ns[i] and the least of its times kept in least[i] (nanoseconds; benchmarks/program_ops.py).
static int64_t run(const int64_t *ops, int64_t n, const int64_t *step, double *ns, double *least) {
    for (int64_t i = 0; i < n; i++) {
        const double t0 = ns ? now_ns() : 0.0;
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
        case OP_NORM_ROWS:  // one row at a time: the rows are strided (a slice of a projection's output)
            for (int64_t r = 0; r < a[0]; r++) {
                const char *x = (const char *)a[2] + r * a[3];
                ((norm_fn)fn)(1, a[1], x, NULL, (const void *)a[4], as_float(a[5]), (char *)a[6] + r * a[7],
                              (void *)x, (int)a[8]);
            }
            break;
        case OP_ROPE_PAIRS:
            ((rope_pairs_fn)fn)(a[0], a[1], a[2], (void *)a[3], a[4], a[5], (const void *)a[6], (const void *)a[7],
                                (int)a[8]);
            break;
        case OP_COPY:
            copy(a[0], a[1], a[2], (const char *)a[3], a[4], a[5], (char *)a[6], a[7], a[8]);
            break;
        case OP_SCATTER: {  // row r to slot slots[r] of a cache of `bytes` rows
            const int64_t *slots = (const int64_t *)a[5];
            for (int64_t r = 0; r < a[0]; r++)
                memcpy((char *)a[4] + slots[r] * a[1], (const char *)a[2] + r * a[3], (size_t)a[1]);
            break;
        }
        case OP_FILL:
            for (int64_t j = 0; j < a[0]; j++) ((int64_t *)a[2])[j] = a[1];
            break;
        case OP_GROUPED:
            ((grouped_fn)fn)(a[0], (const int64_t *)a[1], a[2], a[3], (const void *)a[4], (const void *)a[5],
                             (void *)a[6], (int)a[7], (int)a[8]);
            break;
        case OP_GROUPED_W4:
            if (((grouped_w4_fn)fn)(a[0], (const int64_t *)a[1], a[2], a[3], a[4], (const void *)a[5],
                                    (const void *)a[6], (const void *)a[7], (void *)a[8], (int)a[9], (int)a[10]) != 0)
                return i;
            break;
        case OP_GROUPED_I8:
            if (((grouped_i8_fn)fn)(a[0], (const int64_t *)a[1], a[2], a[3], (const void *)a[4], (const void *)a[5],
                                    (const void *)a[6], (const void *)a[7], (void *)a[8], (int)a[9], (int)a[10]) != 0)
                return i;
            break;
        case OP_ROUTE:
            ((route_fn)fn)(a[0], a[1], a[2], a[3], (const void *)a[4], (const void *)a[5], (const void *)a[6],
                           (const void *)a[7], as_float(a[8]), (void *)a[9], (void *)a[10], (void *)a[11],
                           (void *)a[12], (void *)a[13], (int)a[14]);
            break;
        case OP_COMBINE:  // the routed rows are the step's rows times K
            if (((combine_fn)fn)(a[0], a[1], a[2], a[0] * a[1], (const void *)a[3], (const void *)a[4],
                                 (const void *)a[5], (const void *)a[6], (void *)a[7], (int)a[8]) != 0)
                return i;
            break;
        case OP_SCALE_GROUPS:
            scale_groups(a[0], a[1], a[2], a[3], (const void *)a[4], (const float *)a[5], (void *)a[6], (int)a[7]);
            break;
        case OP_MERGE_GROUPS:
            merge_groups(a[0], a[1], a[2], a[3], (const char *)a[4], (char *)a[5]);
            break;
        default:
            return i;
        }
        if (ns) {
            const double d = now_ns() - t0;
            ns[i] += d;
            if (least[i] == 0.0 || d < least[i]) least[i] = d;
        }
    }
    return n;
}

int64_t program_run(const int64_t *ops, int64_t n, const int64_t *step) { return run(ops, n, step, NULL, NULL); }

int64_t program_run_timed(const int64_t *ops, int64_t n, const int64_t *step, double *ns, double *least) {
    return run(ops, n, step, ns, least);
}
