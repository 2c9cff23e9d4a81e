/* GGUF q6_k superblocks, tuned (block_ktiles.h): 256 values as 128 bytes of low nibbles, 64
   bytes of 2-bit high parts, 16 int8 scales (one per 16 values), fp16 d at the end. Each half
   of 128 values has 64 bytes of nibbles (byte l: value l low, value 64 + l high) and 32 of high
   parts (bits 2 u, 2 u + 1 of byte l: value 32 u + l's); x = d sc (q - 32). block_q6_kx8.c
   builds the same kernels for 8 rows interleaved (KT_ROWS). */
#ifndef KT_FN
#define KT_FN(f) block_q6_k_##f
#endif
#define KT_BYTES 210
#define KT_MIN 0

#include "block_ktiles.h"

static inline kt_b32 kt_piece(const uint8_t *p, int t) {
    const int half = t / 4, u = t % 4;
    const kt_b32 ql = kt_load32(p + 64 * half + 32 * (u % 2));
    const kt_b32 lo = (u / 2 ? (kt_b32)((kt_w32)ql >> 4) : ql) & 15;
    const kt_w32 qh = (kt_w32)kt_load32(p + 128 + 32 * half);
    return lo | (kt_b32)(((qh >> (2 * u)) & 0x0303) << 4);
}

static inline kt_b64 kt_piece64(const uint8_t *p, int h) {
    const int half = h / 2, u = 2 * (h % 2);  /* pieces u, u + 1 of the half */
    kt_b64 ql;
    memcpy(&ql, p + 64 * half, 64);
    const kt_b64 lo = kt_shift_halves(ql, 4 * (h % 2), 4 * (h % 2)) & 15;
    const kt_b64 hi = kt_shift_halves(kt_twice32(p + 128 + 32 * half), 2 * u, 2 * u + 2);
    return lo | (kt_b64)(((kt_w64)hi & 0x0303) << 4);
}

static inline void kt_read_scales(const uint8_t *p, struct kt_scales *s) {
    typedef int8_t s8x16 __attribute__((vector_size(16)));
    s8x16 sc;
    memcpy(&sc, p + 192, sizeof sc);
    const kt_h16 v = __builtin_convertvector(sc, kt_h16);
    memcpy(s->sc, &v, sizeof v);
    s->mw = v * 32;
    s->d = fp16(p + 208);
    s->dmin = 0.f;
}
