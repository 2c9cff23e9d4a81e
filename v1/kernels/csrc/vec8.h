/* 8-float vectors (GCC/Clang vector extensions: AVX registers where the target has AVX, pairs
   of SSE registers on the portable build) and e^x on them, for the attention and elementwise
   kernels. */
#ifndef V1_VEC8_H
#define V1_VEC8_H

#include <stdint.h>

typedef float v8 __attribute__((vector_size(32)));

/* How many v8 the registers hold, which sizes the attention kernel's tiles: 32 with
   AVX-512's VL extension (ymm0-31), 16 with AVX/AVX2 and on aarch64 (a pair of NEON
   registers each), 8 on SSE2 (pairs of its 16). */
#if defined(__AVX512VL__)
#define V8_REGS 32
#elif defined(__AVX__) || defined(__aarch64__)
#define V8_REGS 16
#else
#define V8_REGS 8
#endif
typedef int32_t v8i __attribute__((vector_size(32)));
typedef uint32_t v8u __attribute__((vector_size(32)));

static inline v8 load8(const float *p) { v8 x; __builtin_memcpy(&x, p, 32); return x; }
static inline void store8(float *p, v8 x) { __builtin_memcpy(p, &x, 32); }
static inline float hsum(v8 x) { return x[0] + x[1] + x[2] + x[3] + x[4] + x[5] + x[6] + x[7]; }

/* Lane pairs' sums of a and b, in vhaddps's order: {a0+a1, a2+a3, b0+b1, b2+b3, a4+a5, a6+a7,
   b4+b5, b6+b7} (two in-lane shuffles and an add: no SSE2 or AVX op is needed beyond those). */
static inline v8 pair_sums(v8 a, v8 b) {
    return __builtin_shufflevector(a, b, 0, 2, 8, 10, 4, 6, 12, 14) +
           __builtin_shufflevector(a, b, 1, 3, 9, 11, 5, 7, 13, 15);
}

/* The sums of x[0..7] at once, lane u = x[u]'s: one transposed reduction (7 pair_sums'
   worth of shuffles and adds for 8 sums, where hsum costs 7 scalar adds each). Every lane sums
   by the same tree, ((0 + 1) + (2 + 3)) + ((4 + 5) + (6 + 7)), so a sum does not depend on
   its lane nor on the other vectors. */
static inline v8 hsum8(const v8 x[8]) {
    v8 a = pair_sums(pair_sums(x[0], x[1]), pair_sums(x[2], x[3]));
    v8 b = pair_sums(pair_sums(x[4], x[5]), pair_sums(x[6], x[7]));
    /* a: x[0..3]'s sums of lanes 0-3, then of lanes 4-7; b: the same for x[4..7]. */
    return __builtin_shufflevector(a, b, 0, 1, 2, 3, 8, 9, 10, 11) +
           __builtin_shufflevector(a, b, 4, 5, 6, 7, 12, 13, 14, 15);
}

static inline v8 splat(float x) { return (v8){x, x, x, x, x, x, x, x}; }
/* a where mask (lanes of -1 or 0), else b. */
static inline v8 v8_select(v8i mask, v8 a, v8 b) {
    return (v8)((mask & (v8i)a) | (~mask & (v8i)b));
}

/* e^x on 8 lanes: 2^round(x log2 e) times a degree-6 Taylor polynomial of e^f, |f| <= ln2/2
   (relative error ~1e-7). x is clamped to [-87, 88] first: the result is never a denormal
   (~1e-38 at the bottom) nor an overflowed exponent. NaN stays NaN; +-inf give the clamps'
   values (callers that must follow expf at +-inf check for it). */
static inline v8 exp8(v8 x) {
    x = v8_select(x < splat(-87.f), splat(-87.f), x);
    x = v8_select(x > splat(88.f), splat(88.f), x);
    v8 t = x * 1.44269504088896341f;
    v8 n = (t + 12582912.f) - 12582912.f;   /* round to nearest (|t| < 2^22) */
    v8 f = (t - n) * 0.69314718055994531f;
    v8 p = f * (1.f / 720) + 1.f / 120;
    p = p * f + 1.f / 24;
    p = p * f + 1.f / 6;
    p = p * f + 0.5f;
    p = p * f + 1.f;
    p = p * f + 1.f;
    /* The exponent field, n + 127 in [1, 254] after the clamps (shifted as unsigned: a
       negative left shift is undefined). NaN lanes convert to anything: p is NaN there. */
    v8u e = (v8u)(__builtin_convertvector(n, v8i) + 127) << 23;
    return p * (v8)e;
}

#endif
