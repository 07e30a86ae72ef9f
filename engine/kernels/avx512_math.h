// AVX-512 float32 math shared by the bf16 kernels (bf16mm.c, amxmm.c, w4mm.c, decode_attn_amx.c, decode_attn_dp.c,
// decode_attn_latent_dp.c, prefill_attn_amx.c), and the 16 x 16 dword transposes of the attention kernels.
// cbuild.py hashes this header with every source that includes it, so a change here rebuilds them all.
#ifndef TIANMEN_AVX512_MATH_H
#define TIANMEN_AVX512_MATH_H
#include <immintrin.h>
#include <stdint.h>

static inline __m512 round_bf16(__m512 v) {  // to the nearest bf16 and back to float32
    const __m256i h = (__m256i)_mm512_cvtneps_pbh(v);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

// The index that interleaves two 16-value halves (VCVTNE2PS2BF16's two sources: 16 even k and 16 odd k, or two
// tokens' probabilities) into pairs: [a0, b0, a1, b1, ...].
static inline __m512i pair_order(void) {
    uint16_t idx[32];
    for (int j = 0; j < 16; j++) {
        idx[2 * j] = (uint16_t)j;
        idx[2 * j + 1] = (uint16_t)(16 + j);
    }
    return _mm512_loadu_si512((const void *)idx);
}

// exp(x) = 2^n * p(r), r = x - n ln2, a degree-6 polynomial (relative error ~2e-7); x clamped to [-87, 88].
static inline __m512 exp512(__m512 x) {
    x = _mm512_max_ps(_mm512_min_ps(x, _mm512_set1_ps(88.0f)), _mm512_set1_ps(-87.0f));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.0f / 720);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, n);
}

// 16 outputs of silu(gate) * up from float32 sums, rounded as torch rounds them in bf16
static inline __m512 silu_mul16(__m512 gate, __m512 up) {
    gate = round_bf16(gate);
    const __m512 one = _mm512_set1_ps(1.0f);
    const __m512 s = round_bf16(_mm512_div_ps(gate, _mm512_add_ps(one, exp512(_mm512_sub_ps(_mm512_setzero_ps(), gate)))));
    return _mm512_mul_ps(s, round_bf16(up));
}

// One 64-column block of a gated MLP's interleaved [gate; up] sums (o: 32 gate then 32 up columns, float32, as
// interleave_halves lays the weight's rows out) → its 32 outputs silu(gate) * up, bf16, at yr.
static inline void store_silu_mul_block(const float *o, uint16_t *yr) {
    const __m512 lo = silu_mul16(_mm512_loadu_ps(o), _mm512_loadu_ps(o + 32));
    const __m512 hi = silu_mul16(_mm512_loadu_ps(o + 16), _mm512_loadu_ps(o + 48));
    _mm512_storeu_si512((void *)yr, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
}

// One head's P.V sums over head_dim, kept as decode attention's bf16 dot products leave them (per 32 of head_dim,
// the unpacklo half o[2s] and the unpackhi half o[2s + 1] of interleaved token pairs), times inv, stored as bf16 in
// head_dim order: lane 4L + i of the unpacklo half is d = 8L + i, of the unpackhi half d = 8L + 4 + i.
static inline void store_deinterleaved(uint16_t *orow, const __m512 *o, int64_t steps, __m512 inv) {
    const __m512i lo_order = _mm512_set_epi32(23, 22, 21, 20, 7, 6, 5, 4, 19, 18, 17, 16, 3, 2, 1, 0);
    const __m512i hi_order = _mm512_set_epi32(31, 30, 29, 28, 15, 14, 13, 12, 27, 26, 25, 24, 11, 10, 9, 8);
    for (int64_t s = 0; s < steps; s++) {
        const __m512 lo = _mm512_mul_ps(o[2 * s], inv), hi = _mm512_mul_ps(o[2 * s + 1], inv);
        const __m512 d0 = _mm512_permutex2var_ps(lo, lo_order, hi), d1 = _mm512_permutex2var_ps(lo, hi_order, hi);
        _mm512_storeu_si512((void *)(orow + 32 * s), (__m512i)_mm512_cvtne2ps_pbh(d1, d0));
    }
}

// Sixteen rows of 16 dwords -> their transpose: out[c] lane t = dword c of row t (the standard four stages).
static inline void transpose16(const __m512i r[16], __m512i out[16]) {
    __m512i a[16], b[16];
    for (int i = 0; i < 8; i++) {
        a[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
        a[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 4; i++) {  // b[4i + c], 128-bit lane L: dword 4L + c of rows 4i .. 4i + 3
        b[4 * i + 0] = _mm512_unpacklo_epi64(a[4 * i + 0], a[4 * i + 2]);
        b[4 * i + 1] = _mm512_unpackhi_epi64(a[4 * i + 0], a[4 * i + 2]);
        b[4 * i + 2] = _mm512_unpacklo_epi64(a[4 * i + 1], a[4 * i + 3]);
        b[4 * i + 3] = _mm512_unpackhi_epi64(a[4 * i + 1], a[4 * i + 3]);
    }
    for (int c = 0; c < 4; c++) {  // gather lane L of the four row groups: dword 4L + c of all sixteen rows
        const __m512i u = _mm512_shuffle_i32x4(b[c], b[4 + c], 0x88), v = _mm512_shuffle_i32x4(b[c], b[4 + c], 0xDD);
        const __m512i u2 = _mm512_shuffle_i32x4(b[8 + c], b[12 + c], 0x88);
        const __m512i v2 = _mm512_shuffle_i32x4(b[8 + c], b[12 + c], 0xDD);
        out[c] = _mm512_shuffle_i32x4(u, u2, 0x88);
        out[4 + c] = _mm512_shuffle_i32x4(v, v2, 0x88);
        out[8 + c] = _mm512_shuffle_i32x4(u, u2, 0xDD);
        out[12 + c] = _mm512_shuffle_i32x4(v, v2, 0xDD);
    }
}

// Sixteen rows of 16 dwords at src, `ld` bytes apart (rows n and past read as zero) -> their transpose in out.
static inline void load_transposed(const void *src, int64_t ld, int64_t n, __m512i out[16]) {
    __m512i r[16];
    for (int t = 0; t < 16; t++)
        r[t] = t < n ? _mm512_loadu_si512((const void *)((const char *)src + t * ld)) : _mm512_setzero_si512();
    transpose16(r, out);
}

#endif
