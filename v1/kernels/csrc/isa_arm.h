/* The block kernels' primitives for AArch64: NEON (every AArch64 CPU has it) and the
   dot-product extension (SDOT: optional from ARMv8.2, required from ARMv8.4), each compiled
   only where the build targets it; each computes what its isa_generic.h namesake does, bit
   for bit. isa.h picks. Vectors are 4 lanes (vec.h). */
#ifndef V1_ISA_ARM_H
#define V1_ISA_ARM_H

#include "vec.h"

#include <arm_neon.h>
#include <stdint.h>
#include <string.h>

/* One FCVT (base ARMv8). Subnormal halves convert exactly: Linux leaves FPCR's
   flush-to-zero bits clear. */
static inline float fp16_neon(const uint8_t *p) {
    __fp16 h;
    memcpy(&h, p, 2);
    return h;
}

/* 4 halves, one FCVTL. */
static inline vf fp16v_neon(const uint8_t *p) {
    uint16x4_t h;
    memcpy(&h, p, sizeof h);
    return (vf)vcvt_f32_f16(vreinterpret_f16_u16(h));
}

static inline vf fmav_neon(vf a, vf b, vf c) {
    return (vf)vfmaq_f32((float32x4_t)c, (float32x4_t)a, (float32x4_t)b);
}

/* 4 dwords' low (or high) halves narrowed to 4 words (exactly), then one conversion. */
static inline vf halves_neon(vi x, int hi) {
    const uint32x4_t u = hi ? vshrq_n_u32((uint32x4_t)x, 16) : (uint32x4_t)x;
    return (vf)vcvt_f32_f16(vreinterpret_f16_u16(vmovn_u32(u)));
}

/* The 4 bytes at p widened to 4 int32 lanes: one 4-byte load (a wider one could read past
   the weight) and two widenings; unsigned, or signed (the plain conversion of signed bytes
   goes through unsigned ones: see block_q8_0.c). */
static inline vi widen_u8_neon(const uint8_t *p) {
    uint32_t b;
    memcpy(&b, p, 4);
    return (vi)vmovl_u16(vget_low_u16(vmovl_u8(vreinterpret_u8_u32(vdup_n_u32(b)))));
}
static inline vi widen_s8_neon(const uint8_t *p) {
    uint32_t b;
    memcpy(&b, p, 4);
    return (vi)vmovl_s16(vget_low_s16(vmovl_s8(vreinterpret_s8_u32(vdup_n_u32(b)))));
}

/* A 4 x 4 transpose of dwords: 4 loads, 4 + 4 TRN. (Byte loads: they need no alignment.) */
static inline void columns4_neon(const uint8_t *w, int64_t rb, vi col[4]) {
    uint32x4_t r[4];
    for (int i = 0; i < 4; i++) r[i] = vreinterpretq_u32_u8(vld1q_u8(w + i * rb));
    const uint32x4_t t0 = vtrn1q_u32(r[0], r[1]), t1 = vtrn2q_u32(r[0], r[1]);
    const uint32x4_t t2 = vtrn1q_u32(r[2], r[3]), t3 = vtrn2q_u32(r[2], r[3]);
    col[0] = (vi)vtrn1q_u64(vreinterpretq_u64_u32(t0), vreinterpretq_u64_u32(t2));
    col[1] = (vi)vtrn1q_u64(vreinterpretq_u64_u32(t1), vreinterpretq_u64_u32(t3));
    col[2] = (vi)vtrn2q_u64(vreinterpretq_u64_u32(t0), vreinterpretq_u64_u32(t2));
    col[3] = (vi)vtrn2q_u64(vreinterpretq_u64_u32(t1), vreinterpretq_u64_u32(t3));
}

/* The integer dot products, signed bytes a (weights) x signed bytes b (activations) on both
   sides: as dot4 they take unsigned weight bytes below 128 only (q4_1's nibbles), which are
   the same as signed ones; as dot4s, signed weight bytes as they are. */
#ifdef __ARM_FEATURE_DOTPROD
/* One SDOT. */
static inline vi sdot_neon_dotprod(vi acc, vi a, vi b) {
    return (vi)vdotq_s32((int32x4_t)acc, (int8x16_t)a, (int8x16_t)b);
}
#else
/* ARMv8.0: the 16 products widened to 16 bits (SMULL, SMULL2), adjacent ones added (ADDP),
   then adjacent sums added into the 32-bit lanes (SADALP). Exact while a pair of products
   fits 16 bits, which it does when b is above -128 (quantized activations are: |q| <= 127):
   2 x 128 x 127 < 2^15. */
static inline vi sdot_neon(vi acc, vi a, vi b) {
    const int8x16_t x = (int8x16_t)a, y = (int8x16_t)b;
    const int16x8_t lo = vmull_s8(vget_low_s8(x), vget_low_s8(y)), hi = vmull_high_s8(x, y);
    const int16x8_t pairs = vpaddq_s16(lo, hi);
    return (vi)vpadalq_s16((int32x4_t)acc, pairs);
}
#endif

#endif
