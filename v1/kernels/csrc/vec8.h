/* 8-float vectors (GCC/Clang vector extensions: AVX registers where the target has AVX, pairs
   of SSE registers on the portable build) and e^x on them, for the attention and elementwise
   kernels. */
#ifndef V1_VEC8_H
#define V1_VEC8_H

#include <stdint.h>

typedef float v8 __attribute__((vector_size(32)));
typedef int32_t v8i __attribute__((vector_size(32)));
typedef uint32_t v8u __attribute__((vector_size(32)));

static inline v8 load8(const float *p) { v8 x; __builtin_memcpy(&x, p, 32); return x; }
static inline void store8(float *p, v8 x) { __builtin_memcpy(p, &x, 32); }
static inline float hsum(v8 x) { return x[0] + x[1] + x[2] + x[3] + x[4] + x[5] + x[6] + x[7]; }

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
