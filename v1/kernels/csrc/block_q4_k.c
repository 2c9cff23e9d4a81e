/* GGUF q4_k superblocks, tuned (block_ktiles.h): 256 values as fp16 d, fp16 dmin, 12 bytes of
   6-bit scales and mins (8 of each, one per 32 values), 128 bytes of nibbles (bytes
   32 h .. 32 h + 31 hold values 64 h .. + 31 in their low nibbles, the next 32 values in their
   high ones); x = d sc q - dmin m. block_q4_kx8.c builds the same kernels for 8 rows
   interleaved (KT_ROWS). */
#ifndef KT_FN
#define KT_FN(f) block_q4_k_##f
#endif
#define KT_BYTES 144
#define KT_MIN 1

#include "block_ktiles.h"

static inline kt_b32 kt_piece(const uint8_t *p, int t) {
    const kt_b32 q = kt_load32(p + 16 + 32 * (t / 2));
    return (t % 2 ? (kt_b32)((kt_w32)q >> 4) : q) & 15;
}

static inline kt_b64 kt_piece64(const uint8_t *p, int h) {
    return kt_shift_halves(kt_twice32(p + 16 + 32 * h), 0, 4) & 15;
}

static inline void kt_read_scales(const uint8_t *p, struct kt_scales *s) {
    s->d = fp16(p);
    s->dmin = fp16(p + 2);
    kt_scales_6bit(p + 4, s);
}
