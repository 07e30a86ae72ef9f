// What the AMX kernels (amxmm.c, w4amx.c, i8amx.c, decode_attn_amx.c, prefill_attn_amx.c) share: the tile
// configuration record, the request for tile state, the tile layouts and the attention kernels' accumulators.
// cbuild.py hashes this header with every source that includes it.
#ifndef TIANMEN_AMX_TILES_H
#define TIANMEN_AMX_TILES_H
#include <immintrin.h>
#include <stdint.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

typedef struct {
    uint8_t palette_id;
    uint8_t start_row;
    uint8_t reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} __attribute__((packed)) tile_config;

// Linux hands out AMX state only to a process that asks for it (once; torch's oneDNN asks too). 0: granted.
static inline int request_tile_state(void) {
    return (int)syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA);
}

// The GEMM kernels' tiles (amxmm.c, w4amx.c): 0-3 accumulate a 32 x 32 fp32 block (rows 0-15 / 16-31 x columns
// 0-15 / 16-31), 4-5 hold the two 16-row slices of x (32 bf16 k each), 6-7 two 16-column slices of the weight in
// AMX's pair layout. rows_lo / rows_hi: the rows in x's first and second slice (0 when the slice is empty).
static inline void amx_configure(int rows_lo, int rows_hi) {
    tile_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette_id = 1;
    const int rows[8] = {rows_lo, rows_lo, rows_hi, rows_hi, rows_lo, rows_hi, 16, 16};
    for (int t = 0; t < 8; t++) {
        cfg.rows[t] = (uint8_t)(rows[t] ? rows[t] : 1);
        cfg.colsb[t] = 64;
    }
    _tile_loadconfig(&cfg);
}

// The attention kernels' tiles (decode_attn_amx.c, prefill_attn_amx.c): all eight 16 rows x 64 bytes, 0-3 the
// accumulators.
static inline void amx_configure_square(void) {
    tile_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette_id = 1;
    for (int t = 0; t < 8; t++) {
        cfg.rows[t] = 16;
        cfg.colsb[t] = 64;
    }
    _tile_loadconfig(&cfg);
}

static inline void zero_accumulators(void) {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
}

// Accumulator tiles 0 .. n - 1 (n <= 4) as [n][16][16] float32 at dst.
static inline void store_accumulators(float *dst, int64_t n) {
    _tile_stored(0, dst, 64);
    if (n > 1) _tile_stored(1, dst + 256, 64);
    if (n > 2) _tile_stored(2, dst + 512, 64);
    if (n > 3) _tile_stored(3, dst + 768, 64);
}

#endif
