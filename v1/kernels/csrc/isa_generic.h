/* The block kernels' ISA-dependent primitives in plain C: what the portable build runs, and
   the definition each tuned version in isa_x86.h must match bit for bit. isa.h picks. */
#ifndef V1_ISA_GENERIC_H
#define V1_ISA_GENERIC_H

#include "vec.h"

#include <math.h>
#include <stdint.h>
#include <string.h>

/* IEEE half at p (any alignment) as float. */
static inline float fp16_generic(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, e = (h >> 10) & 0x1f, man = h & 0x3ff, bits;
    if (e == 0) {  /* zero or subnormal: man * 2^-24, exact in float */
        float f = (float)man * 5.9604644775390625e-8f;
        return sign ? -f : f;
    }
    bits = sign | (e == 0x1f ? 0x7f800000u : (e + 112) << 23) | (man << 13);
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

/* VL IEEE halves at p (any alignment) as floats. */
static inline vf fp16v_generic(const uint8_t *p) {
    vf f;
    for (int i = 0; i < VL; i++) f[i] = fp16_generic(p + 2 * i);
    return f;
}

/* a * b + c rounded once, on every lane. */
static inline vf fmav_generic(vf a, vf b, vf c) {
    for (int i = 0; i < VL; i++) a[i] = fmaf(a[i], b[i], c[i]);
    return a;
}

/* acc[l] += sum over t < 4 of byte t of lane l of u (unsigned) * byte t of lane l of s
   (signed). */
static inline vi dot4_generic(vi acc, vi u, vi s) {
    for (int t = 0; t < 4; t++)  /* byte t of each lane: sign-extended in s, not in u */
        acc += ((s << (24 - 8 * t)) >> 24) * ((u >> (8 * t)) & 255);
    return acc;
}

/* dwords[i] = the 4 bytes at w + i rb, i < VL. */
static inline vi gatherv_generic(const uint8_t *w, int64_t rb) {
    vi g = {0};
    for (int i = 0; i < VL; i++) memcpy(&g[i], w + i * rb, 4);
    return g;
}

/* col[c][i] = dword c of the 16 bytes at w + i rb, i < VL. */
static inline void columns4_generic(const uint8_t *w, int64_t rb, vi col[4]) {
    for (int i = 0; i < VL; i++)
        for (int c = 0; c < 4; c++) memcpy(&col[c][i], w + i * rb + 4 * c, 4);
}

/* VL bytes, 4 at a time from p, p + step, ..., as VL int32 lanes (unsigned). */
static inline vi widen_u8_dwords_generic(const uint8_t *p, int64_t step) {
    u8v b;
    for (int i = 0; i < VL / 4; i++) memcpy((uint8_t *)&b + 4 * i, p + i * step, 4);
    return __builtin_convertvector(b, vi);
}

/* The VL / 2 dwords at lo, then the VL / 2 at hi. */
static inline vi join_halves_generic(const uint8_t *lo, const uint8_t *hi) {
    vi v;
    memcpy(&v, lo, sizeof v / 2);
    memcpy((uint8_t *)&v + sizeof v / 2, hi, sizeof v / 2);
    return v;
}

/* fp16 halves of VL dwords as floats: the low ones (hi = 0) or the high ones. */
static inline vf halves_generic(vi x, int hi) {
    if (hi) x = (vi)((vu)x >> 16);
    vf f;
    for (int i = 0; i < VL; i++) {
        const uint16_t h = (uint16_t)x[i];
        f[i] = fp16_generic((const uint8_t *)&h);
    }
    return f;
}

#endif
