/* The instruction throughputs v1's CPU kernels are bound by, on this machine, on one thread:
   each kernel's innermost pattern on its own, on registers and L1 only, as fast as the core
   runs it. bench/bench_isa_peak.py compiles this (any C compiler: each pattern is built for
   its instruction set by a target attribute and run where the CPU has it) and sets the
   kernels' attained rates against these.

   Patterns, one line each as "name macs_per_second":
     i8_avx2        tile_i8_few's dot products with AVX2 (block_tiles.h, dot4_i16): a weight
                    vector meets 7 activation rows' broadcast dwords, vpmaddubsw then vpaddw
                    into 7 sums; 32 multiply-adds an instruction pair
     i8_avxvnni     the same with AVX-VNNI's 256-bit vpdpbusd; 32 multiply-adds
     i8_avx512vnni  the same with AVX-512 VNNI's vpdpbusd, 12 rows (its groups); 64
     f32_fma256     the attention's p.v tile (paged_decode.h, pv_tile): a broadcast weight
                    times a loaded row into 8 sums, 8 lanes; 8 multiply-adds an FMA
     f32_fma512     the same on 16 lanes (pv_tile16); 16
   Each pattern's rate is the best of 5 runs of 10-40 ms. x86-64 only: elsewhere it prints
   nothing (NEON's patterns are not written). */
#include <stdint.h>
#include <stdio.h>
#include <time.h>

#if defined(__x86_64__)
#include <immintrin.h>

enum { STEPS = 1 << 24, ROWS = 1024, FLOATS = 4096 };  /* 4 and 16 KiB: in L1 */
static int32_t act[ROWS] __attribute__((aligned(64)));
static float flt[FLOATS] __attribute__((aligned(64)));

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

/* The sums leave through this, so that no pattern's work is dropped. */
static volatile int64_t sink;

#define R7(X) X(0) X(1) X(2) X(3) X(4) X(5) X(6)
#define R8(X) R7(X) X(7)
#define R12(X) R8(X) X(8) X(9) X(10) X(11)

__attribute__((target("avx2"))) static double i8_avx2(void) {
    __m256i u = _mm256_set1_epi8(7);
#define Z(i) __m256i s##i = _mm256_setzero_si256();
    R7(Z)
    const double t = now();
    for (int64_t n = 0; n < STEPS; n++) {
        const int32_t *a = act + (n * 7 & (ROWS - 8));
#define M(i) s##i = _mm256_add_epi16(s##i, _mm256_maddubs_epi16(u, _mm256_set1_epi32(a[i])));
        R7(M)
        __asm__ volatile("" : "+x"(u));  /* the next weight vector: not hoisted */
    }
    const double dt = now() - t;
#define OUT(i) sink += _mm256_extract_epi16(s##i, 0);
    R7(OUT)
    return 7.0 * 32 * STEPS / dt;
}

__attribute__((target("avx2,avxvnni"))) static double i8_avxvnni(void) {
    __m256i u = _mm256_set1_epi8(7);
    R7(Z)
    const double t = now();
    for (int64_t n = 0; n < STEPS; n++) {
        const int32_t *a = act + (n * 7 & (ROWS - 8));
#define V(i) s##i = _mm256_dpbusd_avx_epi32(s##i, u, _mm256_set1_epi32(a[i]));
        R7(V)
        __asm__ volatile("" : "+x"(u));
    }
    const double dt = now() - t;
#define OUT32(i) sink += _mm256_extract_epi32(s##i, 0);
    R7(OUT32)
    return 7.0 * 32 * STEPS / dt;
}

__attribute__((target("avx512f,avx512vnni"))) static double i8_avx512vnni(void) {
    __m512i u = _mm512_set1_epi8(7);
#define Z5(i) __m512i s##i = _mm512_setzero_si512();
    R12(Z5)
    const double t = now();
    for (int64_t n = 0; n < STEPS; n++) {
        const int32_t *a = act + (n * 12 & (ROWS - 16));
#define V5(i) s##i = _mm512_dpbusd_epi32(s##i, u, _mm512_set1_epi32(a[i]));
        R12(V5)
        __asm__ volatile("" : "+v"(u));
    }
    const double dt = now() - t;
#define OUT5(i) sink += _mm_extract_epi32(_mm512_castsi512_si128(s##i), 0);
    R12(OUT5)
    return 12.0 * 64 * STEPS / dt;
}

__attribute__((target("avx2,fma"))) static double f32_fma256(void) {
#define ZF(i) __m256 s##i = _mm256_setzero_ps();
    R8(ZF)
    const double t = now();
    for (int64_t n = 0; n < STEPS; n++) {
        const float *row = flt + (n * 64 & (FLOATS - 64));
        const __m256 p = _mm256_broadcast_ss(flt + (n & (ROWS - 1)));
#define F(i) s##i = _mm256_fmadd_ps(_mm256_load_ps(row + 8 * (i)), p, s##i);
        R8(F)
    }
    const double dt = now() - t;
#define OUTF(i) sink += (int64_t)s##i[0];
    R8(OUTF)
    return 8.0 * 8 * STEPS / dt;
}

__attribute__((target("avx512f"))) static double f32_fma512(void) {
#define ZF5(i) __m512 s##i = _mm512_setzero_ps();
    R8(ZF5)
    const double t = now();
    for (int64_t n = 0; n < STEPS; n++) {
        const float *row = flt + (n * 128 & (FLOATS - 128));
        const __m512 p = _mm512_set1_ps(flt[n & (ROWS - 1)]);
#define F5(i) s##i = _mm512_fmadd_ps(_mm512_load_ps(row + 16 * (i)), p, s##i);
        R8(F5)
    }
    const double dt = now() - t;
    R8(OUTF)
    return 8.0 * 16 * STEPS / dt;
}

static void report(const char *name, double (*pattern)(void)) {
    double best = 0;
    for (int r = 0; r < 5; r++) {
        const double rate = pattern();
        best = rate > best ? rate : best;
    }
    printf("%s %.4g\n", name, best);
}

#endif

int main(void) {
#if defined(__x86_64__)
    for (int i = 0; i < ROWS; i++) act[i] = (int32_t)(i * 2654435761u) & 0x3f3f3f3f;
    for (int i = 0; i < FLOATS; i++) flt[i] = 1e-3f * (float)(i % 97);
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx2")) report("i8_avx2", i8_avx2);
    if (__builtin_cpu_supports("avxvnni")) report("i8_avxvnni", i8_avxvnni);
    if (__builtin_cpu_supports("avx512vnni")) report("i8_avx512vnni", i8_avx512vnni);
    if (__builtin_cpu_supports("fma")) report("f32_fma256", f32_fma256);
    if (__builtin_cpu_supports("avx512f")) report("f32_fma512", f32_fma512);
#endif
    return 0;
}
