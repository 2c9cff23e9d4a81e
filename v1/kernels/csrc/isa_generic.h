/* The block kernels' ISA-dependent primitives in plain C: what the portable build runs, and
   the definition each tuned version in isa_x86.h must match bit for bit. isa.h picks. */
#ifndef V1_ISA_GENERIC_H
#define V1_ISA_GENERIC_H

#include "vec16.h"

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

/* a * b + c rounded once, on 16 lanes. */
static inline v16 fma16_generic(v16 a, v16 b, v16 c) {
    for (int i = 0; i < 16; i++) a[i] = fmaf(a[i], b[i], c[i]);
    return a;
}

/* acc[l] += sum over t < 4 of byte t of lane l of u (unsigned) * byte t of lane l of s
   (signed). */
static inline v16i dot4_generic(v16i acc, v16i u, v16i s) {
    for (int t = 0; t < 4; t++)  /* byte t of each lane: sign-extended in s, not in u */
        acc += ((s << (24 - 8 * t)) >> 24) * ((u >> (8 * t)) & 255);
    return acc;
}

/* dwords[i] = the 4 bytes at w + i rb, i < 16. */
static inline v16i gather16_generic(const uint8_t *w, int64_t rb) {
    v16i g;
    for (int i = 0; i < LANES; i++) memcpy(&g[i], w + i * rb, 4);
    return g;
}

/* col[c][i] = dword c of the 16 bytes at w + i rb, i < 16. */
static inline void columns4_generic(const uint8_t *w, int64_t rb, v16i col[4]) {
    for (int i = 0; i < LANES; i++)
        for (int c = 0; c < 4; c++) memcpy(&col[c][i], w + i * rb + 4 * c, 4);
}

/* fp16 halves of 16 dwords as floats: the low ones (hi = 0) or the high ones. */
static inline v16 halves16_generic(v16i x, int hi) {
    if (hi) x = (v16i)((v16u)x >> 16);
    v16 f;
    for (int i = 0; i < LANES; i++) {
        const uint16_t h = (uint16_t)x[i];
        f[i] = fp16_generic((const uint8_t *)&h);
    }
    return f;
}

#endif
