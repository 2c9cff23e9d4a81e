/* What the paged decode kernel's variants share (see paged_decode.h): reading a K/V row of
   each cache dtype as fp32 (row_*) and storing fp32 rows into it (store_*). */
#ifndef V1_KV_ROWS_H
#define V1_KV_ROWS_H

#include "v1.h"
#include "vec8.h"

#include <float.h>
#include <math.h>
#include <stdint.h>

typedef uint16_t v8u16 __attribute__((vector_size(16)));

static inline const float *row_f32(const float *p, float *buf, int64_t D) {
    (void)buf, (void)D;
    return p;
}

/* bf16 is the high half of an fp32: widen each value to 32 bits and shift it up. */
static inline const float *row_bf16(const uint16_t *p, float *buf, int64_t D) {
    for (int64_t i = 0; i < D; i += 8) {
        v8u16 h;
        __builtin_memcpy(&h, p + i, 16);
        store8(buf + i, (v8)(__builtin_convertvector(h, v8u) << 16));
    }
    return buf;
}

#ifdef __F16C__
/* fp16: vcvtph2ps (F16C, the compiler's builtin). Without F16C (the portable build) there is
   no fp16 kernel: torch reads such caches. */
typedef int16_t v8i16 __attribute__((vector_size(16)));

static inline const float *row_f16(const uint16_t *p, float *buf, int64_t D) {
    for (int64_t i = 0; i < D; i += 8) {
        v8i16 h;
        __builtin_memcpy(&h, p + i, 16);
        store8(buf + i, __builtin_ia32_vcvtph2ps256(h));
    }
    return buf;
}
#endif

/* The cache write's STORE_ROW: n (a multiple of 8) fp32 values into the cache's dtype, as
   torch's .to() rounds them (to nearest, ties to even), so that both writes store the same
   bits for every finite value; NaN stays NaN. */
static inline void store_f32(float *dst, const float *src, int64_t n) {
    __builtin_memcpy(dst, src, n * sizeof(float));
}

static inline void store_bf16(uint16_t *dst, const float *src, int64_t n) {
    for (int64_t i = 0; i < n; i++) {
        uint32_t u;
        __builtin_memcpy(&u, src + i, 4);
        dst[i] = src[i] != src[i] ? 0x7fc0 : (uint16_t)((u + 0x7fff + ((u >> 16) & 1)) >> 16);
    }
}

#ifdef __F16C__
/* fp16 saturates at +-65504 (see _FP16_MAX): clamping first rounds to the same value as
   torch's cast-then-clamp (everything above 65504 rounds to 65504 or inf); NaN passes. */
static inline void store_f16(uint16_t *dst, const float *src, int64_t n) {
    for (int64_t i = 0; i < n; i += 8) {
        v8 x = load8(src + i);
        x = v8_select(x > splat(65504.f), splat(65504.f), x);
        x = v8_select(x < splat(-65504.f), splat(-65504.f), x);
        v8i16 h = __builtin_ia32_vcvtps2ph256(x, 0);  /* 0: round to nearest even */
        __builtin_memcpy(dst + i, &h, 16);
    }
}
#endif

#endif
