/* 16-lane vectors (GCC/Clang vector extensions: one AVX-512 register, two AVX ones, or four
   SSE ones on the portable build) and the helpers on them that need no particular ISA, for
   the block-quantized matmuls. The ISA-specific ones are in isa.h. */
#ifndef V1_VEC16_H
#define V1_VEC16_H

#include <stdint.h>
#include <string.h>

typedef float v16 __attribute__((vector_size(64)));
typedef int32_t v16i __attribute__((vector_size(64)));
typedef uint32_t v16u __attribute__((vector_size(64)));
typedef double v8d __attribute__((vector_size(64)));
typedef uint8_t u8x16 __attribute__((vector_size(16)));

enum { LANES = 16 };

static inline v16 load16(const float *p) { v16 x; memcpy(&x, p, 64); return x; }
static inline v16i load16i(const void *p) { v16i x; memcpy(&x, p, 64); return x; }
static inline float hsum16(v16 x) {
    v16 a = x + __builtin_shufflevector(x, x, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7);
    a += __builtin_shufflevector(a, a, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11);
    a += __builtin_shufflevector(a, a, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13);
    return a[0] + a[1];
}

/* x in every lane (an element list: `(v16){0} + x` adds 0 to x first). */
static inline v16 splat16(float x) {
    return (v16){x, x, x, x, x, x, x, x, x, x, x, x, x, x, x, x};
}

/* C's roundf (halves away from zero) on 16 lanes, exactly, for |v| < 2^31. */
static inline v16i round16(v16 v) {
    const v16 a = (v16)((v16i)v & 0x7fffffff);
    const v16i t = __builtin_convertvector(a, v16i);  /* truncated */
    const v16i r = t - (a - __builtin_convertvector(t, v16) >= 0.5f);  /* true is -1 */
    const v16i neg = v < 0.f;
    return (r ^ neg) - neg;
}

/* The larger of a and b in each lane. */
static inline v16i max16i2(v16i a, v16i b) {
    const v16i gt = a > b;
    return (a & gt) | (b & ~gt);
}

/* The largest lane, and the sum of the lanes, by halving trees: element loops compiled to
   one extract per lane, which made quantizing the activations most of a few-row call's cost
   outside the tiles. (Integers: any order gives the same result.) */
static inline int32_t max16i(v16i x) {
    x = max16i2(x, __builtin_shufflevector(x, x, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7));
    x = max16i2(x, __builtin_shufflevector(x, x, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11));
    x = max16i2(x, __builtin_shufflevector(x, x, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13));
    return x[0] > x[1] ? x[0] : x[1];
}
static inline int32_t sum16i(v16i x) {
    x += __builtin_shufflevector(x, x, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7);
    x += __builtin_shufflevector(x, x, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11);
    x += __builtin_shufflevector(x, x, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13);
    return x[0] + x[1];
}

#endif
