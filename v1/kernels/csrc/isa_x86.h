/* The block kernels' primitives tuned for x86 extensions, each named by the one it needs and
   compiled only where the build targets it; each computes what its isa_generic.h namesake
   does, bit for bit. isa.h picks. Vectors are VL lanes (vec.h): 16 with AVX-512, 8 with
   AVX2. */
#ifndef V1_ISA_X86_H
#define V1_ISA_X86_H

#include "vec.h"

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
#endif

#if VL == 8 && defined(__F16C__)
/* 8 halves, one conversion. */
static inline vf fp16v_f16c(const uint8_t *p) {
    return (vf)_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
}
#endif

#if VL == 8 && defined(__FMA__)
static inline vf fmav_fma(vf a, vf b, vf c) {
    return (vf)_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)c);
}
#endif

#if VL == 8 && defined(__AVX2__) && defined(__F16C__)
/* 8 dwords' low (or high) halves packed into 8 words (exactly: each is below 65536), then
   one conversion. */
static inline vf halves_avx2(vi x, int hi) {
    __m256i v = (__m256i)x;
    v = hi ? _mm256_srli_epi32(v, 16) : _mm256_and_si256(v, _mm256_set1_epi32(0xffff));
    const __m128i w = _mm_packus_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    return (vf)_mm256_cvtph_ps(w);
}

/* 8 bytes at p widened to 8 int32 lanes in one instruction: unsigned, or signed. */
static inline vi widen_u8_avx2(const uint8_t *p) {
    return (vi)_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p));
}
static inline vi widen_s8_avx2(const uint8_t *p) {
    return (vi)_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p));
}

/* 2 dwords, at p and p + step, widened to 8 int32 lanes (unsigned). */
static inline vi widen_u8_dwords_avx2(const uint8_t *p, int64_t step) {
    int32_t a, b;
    memcpy(&a, p, 4);
    memcpy(&b, p + step, 4);
    return (vi)_mm256_cvtepu8_epi32(_mm_insert_epi32(_mm_cvtsi32_si128(a), b, 1));
}

/* vpmaddubsw + vpmaddwd: unsigned weight bytes u against signed activation bytes s. The pair
   sums cannot saturate for the unsigned formats' weights (q4_1's nibbles: 15 x 127 x 2). */
static inline vi dot4_avx2(vi acc, vi u, vi s) {
    const __m256i pairs = _mm256_maddubs_epi16((__m256i)u, (__m256i)s);
    return acc + (vi)_mm256_madd_epi16(pairs, _mm256_set1_epi16(1));
}

/* dot4_avx2 without its vpmaddwd: the 16 pair sums added as int16 (the caller keeps them
   within int16), widened to int32 lanes once per block by widen_i16_avx2. */
static inline vi dot4_i16_avx2(vi acc, vi u, vi s) {
    return (vi)_mm256_add_epi16((__m256i)acc, _mm256_maddubs_epi16((__m256i)u, (__m256i)s));
}
static inline vi widen_i16_avx2(vi pairs) {
    return (vi)_mm256_madd_epi16((__m256i)pairs, _mm256_set1_epi16(1));
}

/* The same with signed weight bytes w: their signs move onto the activations (|w| x
   sign(x, w) = w x x), so vpmaddubsw's pair sums stay within 2 x 128 x 127 (with w + 128
   they would saturate: 255 x 127 x 2). */
static inline vi dot4s_avx2(vi acc, vi w, vi s) {
    const __m256i x = _mm256_sign_epi8((__m256i)s, (__m256i)w);
    const __m256i pairs = _mm256_maddubs_epi16(_mm256_sign_epi8((__m256i)w, (__m256i)w), x);
    return acc + (vi)_mm256_madd_epi16(pairs, _mm256_set1_epi16(1));
}

/* One gather. */
static inline vi gatherv_avx2(const uint8_t *w, int64_t rb) {
    const __m256i i = _mm256_set_epi32(7, 6, 5, 4, 3, 2, 1, 0);
    return (vi)_mm256_i32gather_epi32((const int *)w, _mm256_mullo_epi32(i, _mm256_set1_epi32((int)rb)), 1);
}

/* 4 x 4 transposes in the two 128-bit lanes of 4 vectors that hold rows e and 4 + e in lane 0
   and 1 of vector e. */
static inline void columns4_avx2(const uint8_t *w, int64_t rb, vi col[4]) {
#define ROW128(I) _mm_loadu_si128((const __m128i *)(w + (I) * rb))
    __m256i z[4];
    for (int e = 0; e < 4; e++) z[e] = _mm256_inserti128_si256(_mm256_castsi128_si256(ROW128(e)), ROW128(4 + e), 1);
#undef ROW128
    const __m256i t0 = _mm256_unpacklo_epi32(z[0], z[1]), t1 = _mm256_unpackhi_epi32(z[0], z[1]);
    const __m256i t2 = _mm256_unpacklo_epi32(z[2], z[3]), t3 = _mm256_unpackhi_epi32(z[2], z[3]);
    col[0] = (vi)_mm256_unpacklo_epi64(t0, t2);
    col[1] = (vi)_mm256_unpackhi_epi64(t0, t2);
    col[2] = (vi)_mm256_unpacklo_epi64(t1, t3);
    col[3] = (vi)_mm256_unpackhi_epi64(t1, t3);
}

/* The K-quant primitives (isa_generic.h's dot_sc, madd16, words8): vpmaddubsw's pair sums,
   times the words k by vpmaddwd (or added in by AVX-VNNI's vpdpwssd). */
static inline vi dot_sc_avx2(vi acc, vi u, vi s, vi k) {
    const __m256i pairs = _mm256_maddubs_epi16((__m256i)u, (__m256i)s);
#ifdef __AVXVNNI__
    return (vi)_mm256_dpwssd_avx_epi32((__m256i)acc, pairs, (__m256i)k);
#else
    return acc + (vi)_mm256_madd_epi16(pairs, (__m256i)k);
#endif
}
static inline vi madd16_avx2(vi a, vi b) { return (vi)_mm256_madd_epi16((__m256i)a, (__m256i)b); }
/* Words p[0], p[1] broadcast (a load), then each spread over its 128-bit half. */
static inline vi words8_avx2(const int16_t *p) {
    int32_t two;
    memcpy(&two, p, 4);
    const __m256i spread = _mm256_setr_epi8(0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1,
                                            2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3);
    return (vi)_mm256_shuffle_epi8(_mm256_set1_epi32(two), spread);
}
#endif

#if VL == 8 && defined(__AVXVNNI__)
/* One vpdpbusd (unsigned u, signed s). */
static inline vi dot4_avxvnni(vi acc, vi u, vi s) {
    return (vi)_mm256_dpbusd_avx_epi32((__m256i)acc, (__m256i)u, (__m256i)s);
}
#endif

#if VL == 16
static inline vf fmav_avx512(vf a, vf b, vf c) {
    return (vf)_mm512_fmadd_ps((__m512)a, (__m512)b, (__m512)c);
}

/* 16 halves, one conversion. */
static inline vf fp16v_avx512(const uint8_t *p) {
    return (vf)_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p));
}

static inline vf halves_avx512(vi x, int hi) {
    if (hi) x = (vi)((vu)x >> 16);
    return (vf)_mm512_cvtph_ps(_mm512_cvtepi32_epi16((__m512i)x));
}

/* 16 bytes at p, widened to 16 int32 lanes straight from memory (GCC's vector extensions
   convert them one at a time): unsigned, or signed. */
static inline vi widen_u8_avx512(const uint8_t *p) {
    return (vi)_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p));
}
static inline vi widen_s8_avx512(const uint8_t *p) {
    return (vi)_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p));
}

/* 4 dwords, at p, p + step, ..., widened to 16 int32 lanes (unsigned). */
static inline vi widen_u8_dwords_avx512(const uint8_t *p, int64_t step) {
    int32_t d[4];
    for (int i = 0; i < 4; i++) memcpy(&d[i], p + i * step, 4);
    __m128i v = _mm_cvtsi32_si128(d[0]);
    v = _mm_insert_epi32(v, d[1], 1);
    v = _mm_insert_epi32(v, d[2], 2);
    return (vi)_mm512_cvtepu8_epi32(_mm_insert_epi32(v, d[3], 3));
}

/* One gather. */
static inline vi gatherv_avx512(const uint8_t *w, int64_t rb) {
    const __m512i i = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    return (vi)_mm512_i32gather_epi32(_mm512_mullo_epi32(i, _mm512_set1_epi32((int)rb)), w, 1);
}

/* Two loads and an insert (GCC's vector extensions put the halves together in memory). */
static inline vi join_halves_avx512(const uint8_t *lo, const uint8_t *hi) {
    const __m256i l = _mm256_loadu_si256((const __m256i *)lo);
    return (vi)_mm512_inserti64x4(_mm512_castsi256_si512(l), _mm256_loadu_si256((const __m256i *)hi), 1);
}

/* 4 x 4 transposes in the 128-bit lanes of 4 vectors that hold the rows i = 4 L + e in lane L
   of vector e: 4 loads and 12 inserts, 8 unpacks (4 gathers took 1.2x the time). */
static inline void columns4_avx512(const uint8_t *w, int64_t rb, vi col[4]) {
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
    col[0] = (vi)_mm512_unpacklo_epi64(t0, t2);
    col[1] = (vi)_mm512_unpackhi_epi64(t0, t2);
    col[2] = (vi)_mm512_unpacklo_epi64(t1, t3);
    col[3] = (vi)_mm512_unpackhi_epi64(t1, t3);
}
#endif

#if VL == 16 && defined(__AVX512VNNI__)
static inline vi dot4_avx512vnni(vi acc, vi u, vi s) {
    return (vi)_mm512_dpbusd_epi32((__m512i)acc, (__m512i)u, (__m512i)s);
}
#endif

#if VL == 16 && defined(__AVX512VNNI__) && defined(__AVX512BW__)
/* The K-quant primitives (isa_generic.h's dot_sc, madd16, words8): vpmaddubsw's pair sums
   added in times the words k by vpdpwssd. */
static inline vi dot_sc_avx512(vi acc, vi u, vi s, vi k) {
    const __m512i pairs = _mm512_maddubs_epi16((__m512i)u, (__m512i)s);
    return (vi)_mm512_dpwssd_epi32((__m512i)acc, pairs, (__m512i)k);
}
static inline vi madd16_avx512(vi a, vi b) { return (vi)_mm512_madd_epi16((__m512i)a, (__m512i)b); }
/* One vbroadcasti64x4 from memory (a load; GCC's shuffle of a 32-byte load took a shuffle). */
static inline vi bcast32_avx512(const uint8_t *p) {
    return (vi)_mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)p));
}
/* Words p[0 .. 3] broadcast (a load), word L then spread over 128-bit lane L. */
static inline vi words8_avx512(const int16_t *p) {
    int64_t four;
    memcpy(&four, p, 8);
    const __m512i spread = _mm512_set_epi64(0x0706070607060706, 0x0706070607060706,
                                            0x0504050405040504, 0x0504050405040504,
                                            0x0302030203020302, 0x0302030203020302,
                                            0x0100010001000100, 0x0100010001000100);
    return (vi)_mm512_shuffle_epi8(_mm512_set1_epi64(four), spread);
}
#endif

#endif
