/* GGUF q5_k superblocks, tuned (block_ktiles.h): 256 values as fp16 d, fp16 dmin, 12 bytes of
   6-bit scales and mins (as q4_k), 32 bytes of high bits (bit t of byte l: value 32 t + l's
   fifth bit), 128 bytes of nibbles (as q4_k); x = d sc q - dmin m. */
#define KT_FN(f) block_q5_k_##f
#define KT_BYTES 176
#define KT_MIN 1

#include "block_ktiles.h"

static inline kt_b32 kt_piece(const uint8_t *p, int t) {
    const kt_b32 q = kt_load32(p + 48 + 32 * (t / 2));
    const kt_b32 lo = (t % 2 ? (kt_b32)((kt_w32)q >> 4) : q) & 15;
    /* bit t of each byte to bit 4 (shifted as words: masked to one bit per byte first) */
    return lo | (kt_b32)((((kt_w32)kt_load32(p + 16) >> t) & 0x0101) << 4);
}

static inline kt_b64 kt_piece64(const uint8_t *p, int h) {
    const kt_b64 lo = kt_shift_halves(kt_twice32(p + 48 + 32 * h), 0, 4) & 15;
    return lo | (kt_b64)(((kt_w64)kt_shift_halves(kt_twice32(p + 16), 2 * h, 2 * h + 1) & 0x0101)
                         << 4);
}

static inline void kt_read_scales(const uint8_t *p, struct kt_scales *s) {
    s->d = fp16(p);
    s->dmin = fp16(p + 2);
    kt_scales_6bit(p + 4, s);
}
