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

/* The K-quant primitives (block_ktiles.h). Word w of a vector is bits 16w .. 16w + 15 (byte
   2w and 2w + 1), as on x86 and AArch64 (little-endian). */

/* acc[l] + (u0 s0 + u1 s1) k0 + (u2 s2 + u3 s3) k1 in each lane l, u_t its unsigned bytes,
   s_t its signed ones, k0 and k1 its signed words; each pair sum saturated to int16 (as
   vpmaddubsw: the callers keep them within it). */
static inline vi dot_sc_generic(vi acc, vi u, vi s, vi k) {
    for (int l = 0; l < VL; l++)
        for (int h = 0; h < 2; h++) {
            int32_t pair = 0;
            for (int t = 2 * h; t < 2 * h + 2; t++)
                pair += (int32_t)(uint8_t)(u[l] >> (8 * t)) * (int8_t)(s[l] >> (8 * t));
            pair = pair > 32767 ? 32767 : pair < -32768 ? -32768 : pair;
            acc[l] += pair * (int16_t)(k[l] >> (16 * h));
        }
    return acc;
}

/* a0 b0 + a1 b1 in each lane, a_h and b_h its signed words. */
static inline vi madd16_generic(vi a, vi b) {
    for (int l = 0; l < VL; l++)
        a[l] = (int16_t)a[l] * (int16_t)b[l] + (a[l] >> 16) * (b[l] >> 16);
    return a;
}

/* The 32 bytes at p in each 32 of a vector (VL 16: both halves; fewer lanes: its first). */
static inline vi bcast32_generic(const uint8_t *p) {
    vi v;
    for (size_t at = 0; at < sizeof v; at += 32)
        memcpy((uint8_t *)&v + at, p, sizeof v - at < 32 ? sizeof v - at : 32);
    return v;
}

/* Word w = p[w / 8], w < 2 VL: p[0 .. VL / 4 - 1], each 8 times. */
static inline vi words8_generic(const int16_t *p) {
    vi v;
    /* unsigned: a negative word times 0x10001 would overflow int */
    for (int l = 0; l < VL; l++) v[l] = (int32_t)((uint32_t)(uint16_t)p[l / 4] * 0x10001u);
    return v;
}

#endif
