// What the AMX kernels (amxmm.c, decode_attn_amx.c) share: the tile configuration record and the request for
// tile state. cbuild.py hashes this header with every source that includes it.
#ifndef TIANMEN_AMX_TILES_H
#define TIANMEN_AMX_TILES_H
#include <stdint.h>
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

#endif
