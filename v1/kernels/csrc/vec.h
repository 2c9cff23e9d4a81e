/* The block kernels' vectors: VL lanes of 32 bits, one machine register each (GCC/Clang
   vector extensions), and the helpers on them that need no particular ISA. VL is the
   register width the build targets: 16 with AVX-512, 8 with AVX/AVX2, else 4 (SSE2, NEON).
   NREGS is how many such registers there are, which sizes the tiles (block_tiles.h). The
   ISA-specific primitives are in isa.h. */
#ifndef V1_VEC_H
#define V1_VEC_H

#include <stdint.h>
#include <string.h>

#if defined(__AVX512F__)
#define VL 16
#define NREGS 32
#elif defined(__AVX__)
#define VL 8
#define NREGS 16
#elif defined(__aarch64__)
#define VL 4
#define NREGS 32
#else
#define VL 4
#define NREGS 16
#endif

typedef float vf __attribute__((vector_size(4 * VL)));
typedef int32_t vi __attribute__((vector_size(4 * VL)));
typedef uint32_t vu __attribute__((vector_size(4 * VL)));
typedef double vd __attribute__((vector_size(4 * VL)));
typedef uint8_t u8v __attribute__((vector_size(VL)));

/* Vectors per 32-value block. */
enum { BV = 32 / VL };

static inline vf loadv(const float *p) { vf x; memcpy(&x, p, sizeof x); return x; }
static inline vi loadvi(const void *p) { vi x; memcpy(&x, p, sizeof x); return x; }

/* x in every lane: x - 0 is x exactly (+0 would turn -0 into +0), and compiles to one
   broadcast (an element loop became one masked broadcast per lane inside the tiles). */
static inline vf splatv(float x) { return x - (vf){0}; }

/* Halving trees over the lanes: element loops compiled to one extract per lane. The sum of
   floats is in this tree's order (the fp32 path's, not bit-exact across VL); of integers,
   exact in any order. */
#if VL == 16
#define HALF(x) __builtin_shufflevector(x, x, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7)
#define QUARTER(x) __builtin_shufflevector(x, x, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11)
#define EIGHTH(x) __builtin_shufflevector(x, x, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13)
#define TREE(x, op) (x = op(x, HALF(x)), x = op(x, QUARTER(x)), x = op(x, EIGHTH(x)))
#elif VL == 8
#define QUARTER(x) __builtin_shufflevector(x, x, 4, 5, 6, 7, 0, 1, 2, 3)
#define EIGHTH(x) __builtin_shufflevector(x, x, 2, 3, 0, 1, 6, 7, 4, 5)
#define TREE(x, op) (x = op(x, QUARTER(x)), x = op(x, EIGHTH(x)))
#else
#define EIGHTH(x) __builtin_shufflevector(x, x, 2, 3, 0, 1)
#define TREE(x, op) (x = op(x, EIGHTH(x)))
#endif
#define ADD_(a, b) ((a) + (b))

static inline float hsumv(vf x) { TREE(x, ADD_); return x[0] + x[1]; }

/* C's roundf (halves away from zero) on every lane, exactly, for |v| < 2^31. */
static inline vi roundv(vf v) {
    const vf a = (vf)((vi)v & 0x7fffffff);
    const vi t = __builtin_convertvector(a, vi);  /* truncated */
    const vi r = t - (a - __builtin_convertvector(t, vf) >= 0.5f);  /* true is -1 */
    const vi neg = v < 0.f;
    return (r ^ neg) - neg;
}

/* The larger of a and b in each lane. */
static inline vi maxvi2(vi a, vi b) {
    const vi gt = a > b;
    return (a & gt) | (b & ~gt);
}

/* The largest lane, and the sum of the lanes. */
static inline int32_t maxvi(vi x) { TREE(x, maxvi2); return x[0] > x[1] ? x[0] : x[1]; }
static inline int32_t sumvi(vi x) { TREE(x, ADD_); return x[0] + x[1]; }

#endif
