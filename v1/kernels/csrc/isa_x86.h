/* The block kernels' primitives tuned for x86 extensions, each named by the one it needs and
   compiled only where the build targets it; each computes what its isa_generic.h namesake
   does, bit for bit. isa.h picks. */
#ifndef V1_ISA_X86_H
#define V1_ISA_X86_H

#include "vec16.h"

#include <stdint.h>
#include <string.h>
#if defined(__F16C__) || defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

#ifdef __F16C__
static inline float fp16_f16c(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return _cvtsh_ss(h);
}

static inline v16 halves16_f16c(v16i x, int hi) {
    if (hi) x = (v16i)((v16u)x >> 16);
    v16 f;
    for (int i = 0; i < LANES; i++) f[i] = _cvtsh_ss((uint16_t)x[i]);
    return f;
}
#endif

#ifdef __FMA__
static inline v16 fma16_fma(v16 a, v16 b, v16 c) {
    __m256 x[2], y[2], z[2];
    memcpy(x, &a, 64);
    memcpy(y, &b, 64);
    memcpy(z, &c, 64);
    for (int h = 0; h < 2; h++) x[h] = _mm256_fmadd_ps(x[h], y[h], z[h]);
    memcpy(&a, x, 64);
    return a;
}
#endif

#ifdef __AVX2__
/* vpmaddubsw + vpmaddwd. vpmaddubsw saturates its pair sums at 32767, which (q8_0 + 128) x
   127 x 2 passes: with it, signed weight bytes stay signed and their signs move onto the
   activations (|w| x sign(x, w) = w x x), no offset (see INT8_SIGNED_WEIGHTS). */
static inline v16i dot4_avx2(v16i acc, v16i u, v16i s) {
    __m256i a[2], w[2], x[2];
    memcpy(a, &acc, 64);
    memcpy(w, &u, 64);
    memcpy(x, &s, 64);
    for (int h = 0; h < 2; h++) {
        x[h] = _mm256_sign_epi8(x[h], w[h]);  /* no-op for unsigned weights (bytes >= 0) */
        const __m256i pairs = _mm256_maddubs_epi16(_mm256_sign_epi8(w[h], w[h]), x[h]);
        a[h] = _mm256_add_epi32(a[h], _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
    }
    memcpy(&acc, a, 64);
    return acc;
}
#endif

#ifdef __AVXVNNI__
/* vpdpbusd on two halves of 8 lanes. */
static inline v16i dot4_avxvnni(v16i acc, v16i u, v16i s) {
    __m256i a[2], w[2], x[2];
    memcpy(a, &acc, 64);
    memcpy(w, &u, 64);
    memcpy(x, &s, 64);
    for (int h = 0; h < 2; h++) a[h] = _mm256_dpbusd_avx_epi32(a[h], w[h], x[h]);
    memcpy(&acc, a, 64);
    return acc;
}
#endif

#ifdef __AVX512F__
static inline v16 fma16_avx512(v16 a, v16 b, v16 c) {
    return (v16)_mm512_fmadd_ps((__m512)a, (__m512)b, (__m512)c);
}

static inline v16 halves16_avx512(v16i x, int hi) {
    if (hi) x = (v16i)((v16u)x >> 16);
    return (v16)_mm512_cvtph_ps(_mm512_cvtepi32_epi16((__m512i)x));
}

/* 16 bytes at p, widened to 16 int32 lanes straight from memory (GCC's vector extensions
   convert them one at a time): unsigned, or signed. */
static inline v16i widen16_u8_avx512(const uint8_t *p) {
    return (v16i)_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p));
}
static inline v16i widen16_s8_avx512(const uint8_t *p) {
    return (v16i)_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p));
}
#endif

#if defined(__AVX512VNNI__) && defined(__AVX512F__)
static inline v16i dot4_avx512vnni(v16i acc, v16i u, v16i s) {
    return (v16i)_mm512_dpbusd_epi32((__m512i)acc, (__m512i)u, (__m512i)s);
}

/* One gather. */
static inline v16i gather16_avx512(const uint8_t *w, int64_t rb) {
    const __m512i i = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    return (v16i)_mm512_i32gather_epi32(_mm512_mullo_epi32(i, _mm512_set1_epi32((int)rb)), w, 1);
}

/* 4 x 4 transposes in the 128-bit lanes of 4 vectors that hold the rows i = 4 L + e in lane L
   of vector e: 4 loads and 12 inserts, 8 unpacks (4 gathers took 1.2x the time). */
static inline void columns4_avx512(const uint8_t *w, int64_t rb, v16i col[4]) {
#define ROW128(I) _mm_loadu_si128((const __m128i *)(w + (I) * rb))
    __m512i z[4];
    for (int e = 0; e < 4; e++) {
        z[e] = _mm512_castsi128_si512(ROW128(e));
        z[e] = _mm512_inserti32x4(z[e], ROW128(4 + e), 1);
        z[e] = _mm512_inserti32x4(z[e], ROW128(8 + e), 2);
        z[e] = _mm512_inserti32x4(z[e], ROW128(12 + e), 3);
    }
#undef ROW128
    const __m512i t0 = _mm512_unpacklo_epi32(z[0], z[1]), t1 = _mm512_unpackhi_epi32(z[0], z[1]);
    const __m512i t2 = _mm512_unpacklo_epi32(z[2], z[3]), t3 = _mm512_unpackhi_epi32(z[2], z[3]);
    col[0] = (v16i)_mm512_unpacklo_epi64(t0, t2);
    col[1] = (v16i)_mm512_unpackhi_epi64(t0, t2);
    col[2] = (v16i)_mm512_unpacklo_epi64(t1, t3);
    col[3] = (v16i)_mm512_unpackhi_epi64(t1, t3);
}
#endif

#endif
