/* GGUF block-quantized weights (Q4_1, Q8_0) times fp32 activations: the kernels behind
   v1.models.layers.quant (whose docstring says which path serves which batch and why).
   Bindings: v1/kernels/quant.py, which checks every argument before it gets here. */
#include "kernels.h"
#include "pool.h"

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__F16C__) || defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

/* GGUF blocks of 32 values, a weight row = nb consecutive blocks (see BLOCK_BYTES in Python):
   q4_1: fp16 d, fp16 m, 16 bytes of nibbles (value j < 16 low nibble of byte j, j + 16 high);
   q8_0: fp16 d, 32 int8. */
enum { QK = 32, Q4_1 = 0, Q8_0 = 1 };

typedef float v16 __attribute__((vector_size(64)));
typedef int32_t v16i __attribute__((vector_size(64)));
typedef uint32_t v16u __attribute__((vector_size(64)));
typedef double v8d __attribute__((vector_size(64)));
typedef uint8_t u8x16 __attribute__((vector_size(16)));

static inline v16 load16(const float *p) { v16 x; memcpy(&x, p, 64); return x; }
static inline v16i load16i(const void *p) { v16i x; memcpy(&x, p, 64); return x; }
static inline float hsum16(v16 x) {
    v16 a = x + __builtin_shufflevector(x, x, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7);
    a += __builtin_shufflevector(a, a, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11);
    a += __builtin_shufflevector(a, a, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13);
    return a[0] + a[1];
}

static inline int64_t block_bytes(int kind) { return kind == Q4_1 ? 20 : 34; }

/* Weights stream from memory once per call; the kernels prefetch this many bytes ahead of
   each weight row they read: on the 2-core EPYC VM this was written on, the hardware
   prefetchers alone left a one-row LM head (30 MB of q8_0) waiting on memory most of the
   time. */
enum { PREFETCH = 8192 };

/* IEEE half at p (any alignment) as float. */
static inline float fp16(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
#ifdef __F16C__
    return _cvtsh_ss(h);
#else
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, e = (h >> 10) & 0x1f, man = h & 0x3ff, bits;
    if (e == 0) {  /* zero or subnormal: man * 2^-24, exact in float */
        float f = (float)man * 5.9604644775390625e-8f;
        return sign ? -f : f;
    }
    bits = sign | (e == 0x1f ? 0x7f800000u : (e + 112) << 23) | (man << 13);
    float f;
    memcpy(&f, &bits, 4);
    return f;
#endif
}

/* ---- fp32 activations: blocks dequantized to fp32, FMA with the activations ------------- */

/* One block's 32 values before scaling, as floats: q4_1's nibbles, q8_0's signed bytes.
   Bytes are widened to int32 before float: GCC 12 converts bytes straight to float one at
   a time, and widens only unsigned bytes in one instruction (vpmovzxbd), so q8_0's signed
   bytes go through uint8 (q ^ 0x80 = q + 128); q4_1's 16 bytes are widened once and split
   into nibbles as int32. */
static inline __attribute__((always_inline)) void block_values(int kind, const uint8_t *p,
                                                               v16 *lo, v16 *hi) {
    if (kind == Q4_1) {
        u8x16 q;
        memcpy(&q, p + 4, 16);
        *lo = __builtin_convertvector(__builtin_convertvector(q & 15, v16i), v16);
        *hi = __builtin_convertvector(__builtin_convertvector(q >> 4, v16i), v16);
    } else {
        u8x16 a, b;
        memcpy(&a, p + 2, 16);
        memcpy(&b, p + 18, 16);
        *lo = __builtin_convertvector(__builtin_convertvector(a ^ 0x80, v16i) - 128, v16);
        *hi = __builtin_convertvector(__builtin_convertvector(b ^ 0x80, v16i) - 128, v16);
    }
}

/* One block's 32 floats. q4_1's d * q + m is one FMA here (gguf rounds the product first:
   at most 1 ulp apart). */
static inline __attribute__((always_inline)) void dequant_block(int kind, const uint8_t *p,
                                                                v16 *lo, v16 *hi) {
    block_values(kind, p, lo, hi);
    const float d = fp16(p);
    if (kind == Q4_1) {
        const float m = fp16(p + 2);
        *lo = *lo * d + m;
        *hi = *hi * d + m;
    } else {
        *lo *= d;
        *hi *= d;
    }
}

/* Three tiles, by the number of activation rows M:
   - M <= DOT_ROWS_MAX, dot products: NR weight rows x up to MR activation rows. Each block
     of the NR rows is dequantized into registers and meets the activation rows there; each
     of the NR x MR sums is spread over a vector and reduced at the end.
   - otherwise outer products: a few weight rows are dequantized once into a scratch buffer
     `wb` (L1-sized for K up to ~1.5k); the activations, transposed once per call into `xt`,
     run against it, weight values broadcast, so each loaded vector serves every row of the
     tile. Up to PAIR_ROWS_MAX rows a vector holds 8 activation rows x 2 consecutive k (a
     broadcast weight pair serves 16 products; with 16 rows x 1 k, 8 rows would leave half of
     each vector idle), 12 weight rows per tile; beyond, 16 rows x 1 k, 6 weight rows and up
     to 64 activation rows per tile.
   Each way the weight is read and dequantized once per call (for up to 64 rows). */
enum { NR = 4, MR = 4, DOT_ROWS_MAX = 4, PAIR_ROWS_MAX = 16, NL_PAIRS = 12, NL = 6, MV = 4 };

/* y[m][r] = x[m] . W[r] (+ bias[r]) for r < nr, m < mr; rows past nr repeat the last one. */
static inline __attribute__((always_inline)) void tile_dot(
    int kind, const uint8_t *w, int64_t row_bytes, int nr, int64_t nb, const float *x,
    int64_t ldx, int mr, float *y, int64_t ldy, const float *bias) {
    const int64_t bytes = block_bytes(kind);
    const uint8_t *row[NR];
    for (int r = 0; r < NR; r++) row[r] = w + (r < nr ? r : nr - 1) * row_bytes;
    v16 acc[NR][MR] = {{{0}}};
    for (int64_t b = 0; b < nb; b++) {
        v16 lo[NR], hi[NR];
        for (int r = 0; r < NR; r++) {
            __builtin_prefetch(row[r] + b * bytes + PREFETCH);
            dequant_block(kind, row[r] + b * bytes, &lo[r], &hi[r]);
        }
        for (int m = 0; m < mr; m++) {
            const v16 x0 = load16(x + m * ldx + b * QK), x1 = load16(x + m * ldx + b * QK + 16);
            for (int r = 0; r < NR; r++) acc[r][m] += lo[r] * x0 + hi[r] * x1;
        }
    }
    for (int m = 0; m < mr; m++)
        for (int r = 0; r < nr; r++) y[m * ldy + r] = hsum16(acc[r][m]) + (bias ? bias[r] : 0.f);
}

/* tile_dot for one activation row, with fewer operations per block: d (q . x), plus for
   q4_1 m sum(x), the block sums of x given in sx (batch 1 is where the kernel's arithmetic,
   not memory, bounds the time). With AVX-512 the bytes are widened straight from memory and
   q4_1's nibbles split as int32 (GCC's vector extensions split them as bytes, emulating a
   byte shift, and convert the scales one at a time). */
static inline __attribute__((always_inline)) void tile_dot1(
    int kind, const uint8_t *w, int64_t row_bytes, int nr, int64_t nb, const float *x,
    const float *sx, float *y, const float *bias) {
    const int64_t bytes = block_bytes(kind);
    const uint8_t *row[NR];
    for (int r = 0; r < NR; r++) row[r] = w + (r < nr ? r : nr - 1) * row_bytes;
    v16 acc[NR] = {{0}};
    float offsets[NR] = {0};
    for (int64_t b = 0; b < nb; b++) {
        const v16 x0 = load16(x + b * QK), x1 = load16(x + b * QK + 16);
        for (int r = 0; r < NR; r++) {
            const uint8_t *p = row[r] + b * bytes;
            __builtin_prefetch(p + PREFETCH);
            v16 lo, hi;
#if defined(__AVX512F__) && defined(__F16C__)
            if (kind == Q4_1) {
                const __m512i q = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(p + 4)));
                lo = (v16)_mm512_cvtepi32_ps(_mm512_and_si512(q, _mm512_set1_epi32(15)));
                hi = (v16)_mm512_cvtepi32_ps(_mm512_srli_epi32(q, 4));
            } else {
                const __m128i a = _mm_loadu_si128((const __m128i *)(p + 2));
                const __m128i b = _mm_loadu_si128((const __m128i *)(p + 18));
                lo = (v16)_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(a));
                hi = (v16)_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b));
            }
            int32_t dm;
            memcpy(&dm, p, 4);
            const __m128 scales = _mm_cvtph_ps(_mm_cvtsi32_si128(dm));  /* d, m */
            acc[r] += (lo * x0 + hi * x1) * (v16)_mm512_broadcastss_ps(scales);
            if (kind == Q4_1) offsets[r] += scales[1] * sx[b];
#else
            block_values(kind, p, &lo, &hi);
            acc[r] += (lo * x0 + hi * x1) * fp16(p);
            if (kind == Q4_1) offsets[r] += fp16(p + 2) * sx[b];
#endif
        }
    }
    for (int r = 0; r < nr; r++) y[r] = hsum16(acc[r]) + offsets[r] + (bias ? bias[r] : 0.f);
}

/* Where x[m][k] goes in xt: lane (m % 16) of vector m / 16 at row k, or with pairs, lane
   2 (m % 8) + k % 2 of vector m / 8 at row k / 2. */
static inline int64_t xt_index(int64_t m, int64_t k, int pairs, int64_t ldxt) {
    return pairs ? k / 2 * ldxt + m / 8 * 16 + m % 8 * 2 + k % 2 : k * ldxt + m;
}

/* y[m][r] = x[m] . wb[r] (+ bias[r]) for r < nr, m < rows (at most 16 mv, 8 mv with pairs);
   nl weight rows, mv vectors of activations. */
static inline __attribute__((always_inline)) void tile_outer(
    const float *wb, int64_t K, const float *xt, int64_t ldxt, int nl, int mv, int pairs,
    float *y, int64_t ldy, int nr, int64_t rows, const float *bias) {
    v16 acc[NL_PAIRS][MV] = {{{0}}};
    for (int64_t k = 0; k < K; k += 1 + pairs) {
        v16 xv[MV];
        for (int v = 0; v < mv; v++) xv[v] = load16(xt + (k >> pairs) * ldxt + 16 * v);
        for (int r = 0; r < nl; r++) {
            v16 wk;
            /* One broadcast load (an element list: `{0} + w` would add -0 + 0). */
            if (pairs) {  /* wb[r][k], wb[r][k + 1], repeated */
                double t;
                memcpy(&t, wb + r * K + k, 8);
                wk = (v16)(v8d){t, t, t, t, t, t, t, t};
            } else {
                const float t = wb[r * K + k];
                wk = (v16){t, t, t, t, t, t, t, t, t, t, t, t, t, t, t, t};
            }
            for (int v = 0; v < mv; v++) acc[r][v] += xv[v] * wk;
        }
    }
    const int per = 16 >> pairs;  /* activation rows per vector */
    for (int v = 0; v < mv; v++)
        for (int l = 0; l < per && per * v + l < rows; l++)
            for (int r = 0; r < nr; r++) {
                const float sum = pairs ? acc[r][v][2 * l] + acc[r][v][2 * l + 1] : acc[r][v][l];
                y[(per * v + l) * ldy + r] = sum + (bias ? bias[r] : 0.f);
            }
}

/* nl rows from `w` into wb (rows past nr repeat the last one). */
static inline __attribute__((always_inline)) void dequant_rows(
    int kind, const uint8_t *w, int64_t row_bytes, int nl, int nr, int64_t K, float *wb) {
    const int64_t bytes = block_bytes(kind);
    for (int r = 0; r < nl; r++) {
        const uint8_t *row = w + (r < nr ? r : nr - 1) * row_bytes;
        for (int64_t b = 0; b < K / QK; b++) {
            v16 lo, hi;
            __builtin_prefetch(row + b * bytes + PREFETCH);
            dequant_block(kind, row + b * bytes, &lo, &hi);
            memcpy(wb + r * K + b * QK, &lo, 64);
            memcpy(wb + r * K + b * QK + 16, &hi, 64);
        }
    }
}

/* One call's matmul: y[M, N] = x[M, K] @ W[N, K].T (+ bias). */
struct job {
    const uint8_t *w;
    int64_t N, K, nb, row_bytes;
    const float *x;
    int64_t ldx, M;
    const float *bias;
    float *y;
    int64_t ldy;
    int dot1;                 /* one row, by tile_dot1 (else tile_dot) */
    const float *sx;          /* then q4_1's block sums of x (its offsets) */
    int pairs, nl;            /* outer products: the tile (see above) */
    float *xt;                /* outer: transposed activations, then a wb per thread */
    int64_t ldxt, xt_floats;
};

/* Dot tiles t0 .. t1 - 1 (NR weight rows each). */
static inline __attribute__((always_inline)) void dot_tiles(int kind, const struct job *j,
                                                            int64_t t0, int64_t t1) {
    for (int64_t n0 = t0 * NR; n0 < t1 * NR && n0 < j->N; n0 += NR) {
        const int nr = j->N - n0 < NR ? (int)(j->N - n0) : NR;
        const uint8_t *wn = j->w + n0 * j->row_bytes;
        const float *bn = j->bias ? j->bias + n0 : NULL;
        float *yn = j->y + n0;
        const int64_t rb = j->row_bytes, nb = j->nb, ldx = j->ldx, ldy = j->ldy;
        switch (j->dot1 ? 0 : j->M) {
            case 0: tile_dot1(kind, wn, rb, nr, nb, j->x, j->sx, yn, bn); break;
            case 1: tile_dot(kind, wn, rb, nr, nb, j->x, ldx, 1, yn, ldy, bn); break;
            case 2: tile_dot(kind, wn, rb, nr, nb, j->x, ldx, 2, yn, ldy, bn); break;
            case 3: tile_dot(kind, wn, rb, nr, nb, j->x, ldx, 3, yn, ldy, bn); break;
            default: tile_dot(kind, wn, rb, nr, nb, j->x, ldx, 4, yn, ldy, bn);
        }
    }
}

/* The activations into xt, on the calling thread: O(M K), against the tiles' O(M N K). (As a
   job of the pool, such a short job right before the tiles' job measured the int8 path at
   64-2048 rows at one thread's speed; why is not understood.) */
static void transpose_x(const struct job *j) {
    for (int64_t k = 0; k < j->K; k++)
        for (int64_t m = 0; m < j->M; m++)
            j->xt[xt_index(m, k, j->pairs, j->ldxt)] = j->x[m * j->ldx + k];
}

#define TILE_OUTER(NL_, MV_, PAIRS_) \
    tile_outer(wb, K, xt + m0, ldxt, NL_, MV_, PAIRS_, y + m0 * ldy + n0, ldy, nr, M - m0, bn)

/* Outer-product tiles t0 .. t1 - 1 (nl weight rows each), with this thread's wb. */
static inline __attribute__((always_inline)) void outer_tiles(
    int kind, const struct job *j, int64_t t0, int64_t t1, int thread) {
    const int64_t K = j->K, M = j->M, ldxt = j->ldxt, ldy = j->ldy;
    const int nl = j->nl;
    const float *xt = j->xt;
    float *wb = j->xt + j->xt_floats + thread * nl * K, *y = j->y;
    for (int64_t n0 = t0 * nl; n0 < t1 * nl && n0 < j->N; n0 += nl) {
        const int nr = j->N - n0 < nl ? (int)(j->N - n0) : nl;
        const float *bn = j->bias ? j->bias + n0 : NULL;
        dequant_rows(kind, j->w + n0 * j->row_bytes, j->row_bytes, nl, nr, K, wb);
        if (j->pairs) {
            const int64_t m0 = 0;
            if (M > 8) TILE_OUTER(NL_PAIRS, 2, 1);
            else TILE_OUTER(NL_PAIRS, 1, 1);
            continue;
        }
        for (int64_t m0 = 0; m0 < M; m0 += 16 * MV) {
            const int64_t rows = M - m0;
            switch (rows > 48 ? 4 : rows > 32 ? 3 : rows > 16 ? 2 : 1) {
                case 1: TILE_OUTER(NL, 1, 0); break;
                case 2: TILE_OUTER(NL, 2, 0); break;
                case 3: TILE_OUTER(NL, 3, 0); break;
                default: TILE_OUTER(NL, 4, 0);
            }
        }
    }
}

/* The pool's entry points, one per block kind (the kernels are specialised on it). */
#define RANGE_FNS(NAME, BODY)                                                              \
    static void NAME##_q4_1(void *c, int64_t b, int64_t e, int t) { (void)t; BODY(Q4_1); } \
    static void NAME##_q8_0(void *c, int64_t b, int64_t e, int t) { (void)t; BODY(Q8_0); }
#define DOT_BODY(KIND) dot_tiles(KIND, c, b, e)
#define OUTER_BODY(KIND) outer_tiles(KIND, c, b, e, t)
RANGE_FNS(dot, DOT_BODY)
RANGE_FNS(outer, OUTER_BODY)

/* Weight rows per item, so items are a few tiles: threads take items as they come free (on
   a shared machine one may lose its core for a while; the other then takes the rest). */
enum { TILES_PER_ITEM = 8 };

/* y[M, N] = x[M, K] @ W[N, K].T (+ bias). 0, or -1 when scratch memory cannot be had.

   Non-finite activations give what torch's x @ dequantize().T gives, at every M: each
   product is a dequantized weight times x, except in tile_dot1's d (q . x) + m sum(x), which
   turns q4_1's x = inf against q = 0 into NaN (0 x inf) where w x = m x is +-inf. So a row
   whose block sums are not all finite takes tile_dot (one row) instead. (q8_0's w = d q is 0
   exactly where q is: NaN both ways.) */
V1_API int32_t v1_q_linear_f32(int32_t kind, const uint8_t *w, int64_t N, int64_t K,
                               const float *x, int64_t ldx, int64_t M, const float *bias,
                               float *y, int64_t ldy, int32_t nthreads) {
    struct job j = {.w = w, .N = N, .K = K, .nb = K / QK, .x = x, .ldx = ldx, .M = M,
                    .bias = bias, .y = y, .ldy = ldy};
    j.row_bytes = j.nb * block_bytes(kind);
    if (M <= DOT_ROWS_MAX) {
        float *sx = NULL;
        if (M == 1 && kind == Q4_1) {
            if (!(sx = malloc((size_t)j.nb * sizeof(float)))) return -1;
            int finite = 1;
            for (int64_t b = 0; b < j.nb; b++) {
                sx[b] = hsum16(load16(x + b * QK) + load16(x + b * QK + 16));
                finite &= isfinite(sx[b]) != 0;
            }
            j.sx = sx;
            j.dot1 = finite;
        } else {
            j.dot1 = M == 1;
        }
        v1_parallel_for(nthreads, (N + NR - 1) / NR, TILES_PER_ITEM,
                        kind == Q4_1 ? dot_q4_1 : dot_q8_0, &j);
        free(sx);
        return 0;
    }
    j.pairs = M <= PAIR_ROWS_MAX;
    j.nl = j.pairs ? NL_PAIRS : NL;
    j.ldxt = j.pairs ? (M + 7) / 8 * 16 : (M + 15) / 16 * 16;
    j.xt_floats = (j.pairs ? K / 2 : K) * j.ldxt;
    /* xt, then a weight buffer per thread (64-byte aligned: K is a multiple of 32). */
    j.xt = aligned_alloc(64, (size_t)(j.xt_floats + v1_pool_width(nthreads) * j.nl * K) * 4);
    if (!j.xt) return -1;
    memset(j.xt, 0, (size_t)j.xt_floats * sizeof(float));
    transpose_x(&j);
    v1_parallel_for(nthreads, (N + j.nl - 1) / j.nl, TILES_PER_ITEM,
                    kind == Q4_1 ? outer_q4_1 : outer_q8_0, &j);
    free(j.xt);
    return 0;
}

/* ---- int8 activations: integer dot products, as llama.cpp ------------------------------- */

/* Activations are quantized per block of 32 as q8_0 (dx = max|x| / 127, q = round(x / dx))
   and laid out so that `lanes` rows' 4 consecutive values sit side by side:
     A[((g * nb + b) * 8 + j) * lanes + l]   int8 x 4: row lanes g + l, values 32 b + 4 j .. + 3
     D, Q, T[(g * nb + b) * lanes + l]       dx, sum of the q, dx * sum (float)
   Two tiles read them. tile_i8 (lanes = 16): a weight's 4 bytes for the same values,
   broadcast, meet 16 activation rows in one u8 x s8 dot product (vpdpbusd). tile_i8_few
   (lanes = M, one group): 16 weight rows' 4 bytes, transposed into one vector, meet one
   activation row's 4 bytes, broadcast; each weight byte then serves every row of the call
   with none of tile_i8's idle lanes at a few rows. Weights must be the unsigned side: q4_1's
   nibbles are; q8_0's bytes are offset by 128 (q ^ 0x80), taken back as 128 * sum(q) per
   block. Rows past M are 0.

   Both give every row the same numbers, whatever M and whichever tile serves it (what
   v1.models.layers.quant's per-row path choice rests on): a block's integer dot product is
   exact, and each (activation row, weight row) then runs the same float recurrence over its
   blocks in order, with explicit FMAs (no contraction left to the compiler):
     q4_1: acc = fma(isum_b, dx_b * d_b, fma(t_b, m_b, acc))    (t_b = dx_b * sum q_b)
     q8_0: acc = fma(isum_b, dx_b * d_b, acc)
   then y = acc + bias. Every variant of the library computes these bit for bit.

   tile_i8_few serves up to FEW_ROWS_MAX rows: on an AVX-512 VNNI Xeon (one thread, a
   3072 x 576 q4_1 matmul in L2) it took 107 / 140 / 171 us at 8 / 12 / 16 rows where
   tile_i8 took 257 / 261 / 269 (and 40 us at one row, the fp32 path's tile_dot1 117); more
   rows than 16 would not fit its sums in registers. */
enum { LANES = 16, GROUPS = QK / 4, FEW_ROWS_MAX = 16 };

/* C's roundf (halves away from zero) on 16 lanes, exactly, for |v| < 2^31. */
static inline v16i round16(v16 v) {
    const v16 a = (v16)((v16i)v & 0x7fffffff);
    const v16i t = __builtin_convertvector(a, v16i);  /* truncated */
    const v16i r = t - (a - __builtin_convertvector(t, v16) >= 0.5f);  /* true is -1 */
    const v16i neg = v < 0.f;
    return (r ^ neg) - neg;
}

/* x in every lane (an element list: `(v16){0} + x` adds 0 to x first). */
static inline v16 splat16(float x) {
    return (v16){x, x, x, x, x, x, x, x, x, x, x, x, x, x, x, x};
}

/* a * b + c rounded once, on 16 lanes: the int8 path's float recurrence (see above). */
static inline v16 fma16(v16 a, v16 b, v16 c) {
#if defined(__AVX512F__)
    return (v16)_mm512_fmadd_ps((__m512)a, (__m512)b, (__m512)c);
#elif defined(__FMA__)
    __m256 x[2], y[2], z[2];
    memcpy(x, &a, 64);
    memcpy(y, &b, 64);
    memcpy(z, &c, 64);
    for (int h = 0; h < 2; h++) x[h] = _mm256_fmadd_ps(x[h], y[h], z[h]);
    memcpy(&a, x, 64);
    return a;
#else
    for (int i = 0; i < 16; i++) a[i] = fmaf(a[i], b[i], c[i]);
    return a;
#endif
}

/* The larger of a and b in each lane. */
static inline v16i max16i2(v16i a, v16i b) {
    const v16i gt = a > b;
    return (a & gt) | (b & ~gt);
}

/* The largest lane, and the sum of the lanes, by halving trees: element loops compiled to
   one extract per lane, which made quantize_row most of a few-row call's cost outside the
   tiles. (Integers: any order gives the same result.) */
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

/* Row `row` of x quantized, in the layout for `lanes` rows; 1 if it holds a value that is not
   finite (its blocks are then stored as 0: the caller recomputes the row), else 0. */
static int quantize_row(const float *x, int64_t nb, int64_t row, int64_t lanes, int32_t *A,
                        float *D, int32_t *Q, float *T) {
    const int64_t g = row / lanes, l = row % lanes;
    int nonfinite = 0;
    for (int64_t b = 0; b < nb; b++) {
        v16 x0 = load16(x + b * QK), x1 = load16(x + b * QK + 16);
        const v16i a0 = (v16i)x0 & 0x7fffffff, a1 = (v16i)x1 & 0x7fffffff;
        int32_t amax_bits = max16i(max16i2(a0, a1));  /* |x| compare as integers */
        if (amax_bits >= 0x7f800000) {  /* inf or NaN */
            nonfinite = 1;
            amax_bits = 0;
            x0 = x1 = (v16){0};
        }
        float amax;
        memcpy(&amax, &amax_bits, 4);
        const float d = amax / 127.f, id = d > 0.f ? 1.f / d : 0.f;
        const v16i q0 = round16(x0 * id), q1 = round16(x1 * id);
        const int32_t sum = sum16i(q0 + q1);
        uint8_t q[QK];
        const u8x16 b0 = __builtin_convertvector(q0 & 255, u8x16);
        const u8x16 b1 = __builtin_convertvector(q1 & 255, u8x16);
        memcpy(q, &b0, 16);
        memcpy(q + 16, &b1, 16);
        const int64_t gb = g * nb + b;
        for (int j = 0; j < GROUPS; j++) memcpy(A + (gb * GROUPS + j) * lanes + l, q + 4 * j, 4);
        D[gb * lanes + l] = d;
        Q[gb * lanes + l] = sum;
        T[gb * lanes + l] = d * (float)sum;
    }
    return nonfinite;
}

/* The integer dot product: vpdpbusd on 16 lanes (AVX-512 VNNI) or on two halves of 8
   (AVX-VNNI), else AVX2's vpmaddubsw + vpmaddwd, else plain C. vpmaddubsw saturates its pair
   sums at 32767, which (q8_0 + 128) x 127 x 2 passes: with it, q8_0's bytes stay signed and
   their signs move onto the activations (|w| x sign(x, w) = w x x), no offset. */
#if defined(__AVX512VNNI__) && defined(__AVX512F__)
#define INT8_ISA 3
#elif defined(__AVXVNNI__)
#define INT8_ISA 2
#elif defined(__AVX2__)
#define INT8_ISA 1
#else
#define INT8_ISA 0
#endif
enum { Q8_OFFSET = INT8_ISA != 1 };  /* q8_0 bytes go in + 128 (else signed, see above) */

/* acc[l] += sum over t < 4 of byte t of lane l of u * byte t of lane l of s (signed): u
   unsigned, or signed for q8_0 without Q8_OFFSET. */
static inline v16i dot4(v16i acc, v16i u, v16i s) {
#if INT8_ISA == 3
    return (v16i)_mm512_dpbusd_epi32((__m512i)acc, (__m512i)u, (__m512i)s);
#elif INT8_ISA >= 1
    __m256i a[2], w[2], x[2];
    memcpy(a, &acc, 64);
    memcpy(w, &u, 64);
    memcpy(x, &s, 64);
    for (int h = 0; h < 2; h++) {
#if INT8_ISA == 2
        a[h] = _mm256_dpbusd_avx_epi32(a[h], w[h], x[h]);
#else
        x[h] = _mm256_sign_epi8(x[h], w[h]);  /* no-op for q4_1: its bytes are positive or 0 */
        const __m256i pairs = _mm256_maddubs_epi16(_mm256_sign_epi8(w[h], w[h]), x[h]);
        a[h] = _mm256_add_epi32(a[h], _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
#endif
    }
    memcpy(&acc, a, 64);
    return acc;
#else
    for (int t = 0; t < 4; t++)  /* byte t of each lane: sign-extended in s, not in u */
        acc += ((s << (24 - 8 * t)) >> 24) * ((u >> (8 * t)) & 255);
    return acc;
#endif
}

/* q4_1's 4 bytes -> values 4j .. 4j + 3 (low nibbles, j < 4) or 4j - 16 .. (high nibbles);
   q8_0's, offset if Q8_OFFSET. */
static inline v16i weight_bytes(int kind, v16i bytes4, int j) {
    if (kind == Q4_1) return (j < 4 ? bytes4 : bytes4 >> 4) & 0x0f0f0f0f;
    return bytes4 ^ (Q8_OFFSET ? (int32_t)0x80808080u : 0);
}

/* Tile: NRI weight rows x GM groups of 16 activation rows, NRI <= 8, GM <= 4. kind, NRI
   and GM are constants at each call (the arrays stay in registers). */
static inline __attribute__((always_inline)) void tile_i8(
    int kind, const uint8_t *w, int64_t row_bytes, int nr, int64_t nb, const int32_t *A,
    const float *D, const int32_t *Q, const float *T, int NRI, int GM, float *y,
    int64_t ldy, int64_t rows, const float *bias) {
    const int64_t bytes = block_bytes(kind);
    v16 acc[8][4];
    for (int r = 0; r < NRI; r++)
        for (int g = 0; g < GM; g++) acc[r][g] = (v16){0};
    const uint8_t *row[8];
    for (int r = 0; r < NRI; r++) row[r] = w + (r < nr ? r : nr - 1) * row_bytes;
    for (int64_t b = 0; b < nb; b++) {
        for (int r = 0; r < NRI; r++) __builtin_prefetch(row[r] + b * bytes + PREFETCH);
        v16i dot[8][4];
        for (int r = 0; r < NRI; r++)
            for (int g = 0; g < GM; g++) dot[r][g] = (v16i){0};
        #pragma GCC unroll 8
        for (int j = 0; j < GROUPS; j++)
            for (int r = 0; r < NRI; r++) {
                /* The row's 4 bytes for these values, in every lane (a broadcast load);
                   q4_1's values j and j + 16 share byte j. */
                const uint8_t *p = row[r] + b * bytes;
                int32_t bytes4;
                memcpy(&bytes4, kind == Q4_1 ? p + 4 + 4 * (j & 3) : p + 2 + 4 * j, 4);
                const v16i u = weight_bytes(kind, (v16i){0} + bytes4, j);
                for (int g = 0; g < GM; g++)
                    dot[r][g] = dot4(dot[r][g], u,
                                     load16i(A + ((g * nb + b) * GROUPS + j) * LANES));
            }
        for (int g = 0; g < GM; g++) {
            const int64_t gb = (g * nb + b) * LANES;
            const v16 dx = load16(D + gb);
            if (kind == Q4_1) {
                const v16 t = load16(T + gb);
                for (int r = 0; r < NRI; r++) {
                    const uint8_t *p = row[r] + b * bytes;
                    acc[r][g] = fma16(__builtin_convertvector(dot[r][g], v16),
                                      dx * splat16(fp16(p)),
                                      fma16(t, splat16(fp16(p + 2)), acc[r][g]));
                }
            } else {
                const v16i q128 = Q8_OFFSET ? load16i(Q + gb) << 7 : (v16i){0};
                for (int r = 0; r < NRI; r++)
                    acc[r][g] = fma16(__builtin_convertvector(dot[r][g] - q128, v16),
                                      dx * splat16(fp16(row[r] + b * bytes)), acc[r][g]);
            }
        }
    }
    for (int g = 0; g < GM; g++)
        for (int l = 0; l < LANES && g * LANES + l < rows; l++)
            for (int r = 0; r < nr; r++)
                y[(g * LANES + l) * ldy + r] = acc[r][g][l] + (bias ? bias[r] : 0.f);
}

/* dwords[i] = the 4 bytes at w + i rb, i < 16 (one gather with AVX-512). */
static inline __attribute__((always_inline)) v16i gather16(const uint8_t *w, int64_t rb) {
#if INT8_ISA == 3
    const __m512i i = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    return (v16i)_mm512_i32gather_epi32(_mm512_mullo_epi32(i, _mm512_set1_epi32((int)rb)), w, 1);
#else
    v16i g;
    for (int i = 0; i < LANES; i++) memcpy(&g[i], w + i * rb, 4);
    return g;
#endif
}

/* col[c][i] = dword c of the 16 bytes at w + i rb, i < 16: the 16 rows' 4-byte groups
   transposed (with AVX-512, 4 x 4 transposes in the 128-bit lanes of 4 vectors that hold the
   rows i = 4 L + e in lane L of vector e: 4 loads and 12 inserts, 8 unpacks, where 4 gathers
   took 1.2x the time). */
static inline __attribute__((always_inline)) void columns4(const uint8_t *w, int64_t rb,
                                                           v16i col[4]) {
#if INT8_ISA == 3
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
#else
    for (int i = 0; i < LANES; i++)
        for (int c = 0; c < 4; c++) memcpy(&col[c][i], w + i * rb + 4 * c, 4);
#endif
}

/* fp16 halves of 16 dwords as floats: the low ones (hi = 0) or the high ones. */
static inline v16 halves16(v16i x, int hi) {
    if (hi) x = (v16i)((v16u)x >> 16);
#if defined(__AVX512F__)
    return (v16)_mm512_cvtph_ps(_mm512_cvtepi32_epi16((__m512i)x));
#else
    v16 f;
    for (int i = 0; i < LANES; i++) {
        const uint16_t h = (uint16_t)x[i];
        f[i] = fp16((const uint8_t *)&h);
    }
    return f;
#endif
}

/* Where half h of a block's values starts: q4_1's 16 bytes of nibbles, or q8_0's first or
   last 16 bytes. */
static inline int64_t block_qs(int kind, int h) { return kind == Q4_1 ? 4 : 2 + 16 * h; }

/* Tile: 16 weight rows (the lanes; row i at w + i rb) x MF activation rows (lanes = MF in A,
   D, Q, T), MF <= FEW_ROWS_MAX a constant at each call; the first nr rows are stored. */
static inline __attribute__((always_inline)) void tile_i8_few(
    int kind, const uint8_t *w, int64_t rb, int nr, int64_t nb, const int32_t *A,
    const float *D, const int32_t *Q, const float *T, int MF, float *y, int64_t ldy,
    const float *bias) {
    const int64_t bytes = block_bytes(kind);
    const int CH = MF == 1 ? 4 : MF == 2 ? 2 : 1;
    /* The weight side of a block (its scales' gather, its columns) depends on nothing
       computed, but issued in the block it serves, its latency held up that block's dot
       products and float recurrence. So a block's scales are gathered one block ahead, and
       q4_1's columns too while the registers allow (4 vectors more beside 2 MF of sums).
       On the 2-core Sapphire Rapids VM, one thread, against both in their block: scales
       ahead 0.87-0.93x the time at 2-16 rows; q4_1's columns ahead as well 0.8-0.9x more at
       1-8 rows, 1.03-1.06x at 13-16 (spills); q8_0's 8 column vectors ahead made the LM head
       (memory-bound at 1-2 rows) 1.1-1.3x slower there. The last block "gathers ahead" its
       own scales again (pn = p): nothing is read past the weight. */
    const int HALVES = kind == Q4_1 ? 1 : 2, AHEAD = kind == Q4_1 && 2 * MF + 8 <= 28;
    v16 acc[FEW_ROWS_MAX];
    for (int m = 0; m < MF; m++) acc[m] = (v16){0};
    v16i dm_next = gather16(w, rb), cols_next[2][4];
    if (AHEAD)
        for (int h = 0; h < HALVES; h++) columns4(w + block_qs(kind, h), rb, cols_next[h]);
    for (int64_t b = 0; b < nb; b++) {
        const int64_t p = b * bytes, pn = b + 1 < nb ? p + bytes : p;  /* next block's */
        const v16i dm = dm_next;
        dm_next = gather16(w + pn, rb);
        v16i cols[2][4];
        for (int h = 0; h < HALVES; h++) {
            if (!AHEAD) {
                columns4(w + p + block_qs(kind, h), rb, cols[h]);
                continue;
            }
            memcpy(cols[h], cols_next[h], sizeof cols[h]);
            columns4(w + pn + block_qs(kind, h), rb, cols_next[h]);
        }
        /* The tile's rows are one run of 16 rb bytes, read at 16 bytes per block: the
           prefetches run through it at that pace, into the next tiles (4 PREFETCH ahead: in the
           30 layers + head of bench/bench_quant_kernels.py, 0.8x the time of PREFETCH ahead). */
        for (int64_t i = 0; i < LANES * bytes; i += 64)
            __builtin_prefetch(w + LANES * p + i + 4 * PREFETCH);
        /* CH chains of dot products per row, added at the end (exactly): with one, a row's
           8 dependent vpdpbusd per block would bound the time at 1 or 2 rows. */
        v16i isum[FEW_ROWS_MAX][4];
        for (int m = 0; m < MF; m++)
            for (int c = 0; c < CH; c++) isum[m][c] = (v16i){0};
        for (int h = 0; h < HALVES; h++) {
            const v16i *col = cols[h];
            for (int j = 0; j < (kind == Q4_1 ? GROUPS : 4); j++) {
                /* q4_1's values j and j + 16 share byte j */
                const int group = kind == Q4_1 ? j : 4 * h + j;
                const v16i u = weight_bytes(kind, col[j & 3], group);
                for (int m = 0; m < MF; m++)
                    isum[m][group % CH] = dot4(isum[m][group % CH], u,
                                               (v16i){0} + A[(b * GROUPS + group) * MF + m]);
            }
        }
        for (int m = 0; m < MF; m++)
            for (int c = 1; c < CH; c++) isum[m][0] += isum[m][c];
        const v16 d = halves16(dm, 0);
        const v16 mw = kind == Q4_1 ? halves16(dm, 1) : (v16){0};
        for (int m = 0; m < MF; m++) {
            const v16 dxd = splat16(D[b * MF + m]) * d;
            if (kind == Q4_1)
                acc[m] = fma16(__builtin_convertvector(isum[m][0], v16), dxd,
                               fma16(splat16(T[b * MF + m]), mw, acc[m]));
            else
                acc[m] = fma16(
                    __builtin_convertvector(isum[m][0] - (Q8_OFFSET ? Q[b * MF + m] * 128 : 0), v16),
                    dxd, acc[m]);
        }
    }
    for (int m = 0; m < MF; m++) {
        float sums[LANES];  /* (indexing acc by r would keep acc in memory throughout) */
        memcpy(sums, &acc[m], 64);
        for (int r = 0; r < nr; r++) y[m * ldy + r] = sums[r] + (bias ? bias[r] : 0.f);
    }
}

#define TILE_I8(KIND_, NRI_, GM_) \
    tile_i8(KIND_, wn, row_bytes, nr, nb, Am, Dm, Qm, Tm, NRI_, GM_, ym, ldy, M - m0, bn)
/* Two groups (32 rows) of 6 weight rows use 24 vector registers (12 products in flight, 12
   sums); with a single group, 8 weight rows keep enough products in flight. Three or four
   groups at once would run out of registers. */
#define TILES_I8(KIND_)                                 \
    if (nri == 8) TILE_I8(KIND_, 8, 1);                 \
    else if (gm == 2) TILE_I8(KIND_, 6, 2);             \
    else TILE_I8(KIND_, 6, 1);

#define TILE_FEW(KIND_, MF_) \
    tile_i8_few(KIND_, wn, row_bytes, nr, nb, j->A, j->D, j->Q, j->T, MF_, j->y + n0, ldy, bn)
#define TILES_FEW(KIND_)                   \
    switch (M) {                           \
        case 1: TILE_FEW(KIND_, 1); break; \
        case 2: TILE_FEW(KIND_, 2); break; \
        case 3: TILE_FEW(KIND_, 3); break; \
        case 4: TILE_FEW(KIND_, 4); break; \
        case 5: TILE_FEW(KIND_, 5); break; \
        case 6: TILE_FEW(KIND_, 6); break; \
        case 7: TILE_FEW(KIND_, 7); break; \
        case 8: TILE_FEW(KIND_, 8); break; \
        case 9: TILE_FEW(KIND_, 9); break; \
        case 10: TILE_FEW(KIND_, 10); break; \
        case 11: TILE_FEW(KIND_, 11); break; \
        case 12: TILE_FEW(KIND_, 12); break; \
        case 13: TILE_FEW(KIND_, 13); break; \
        case 14: TILE_FEW(KIND_, 14); break; \
        case 15: TILE_FEW(KIND_, 15); break; \
        default: TILE_FEW(KIND_, 16);       \
    }

/* The int8 path's call: the activations quantized (see quantize_row), then tiles. */
struct job_i8 {
    const uint8_t *w;
    int64_t N, nb, row_bytes, M, G, lanes, per_group;
    const float *x;
    int64_t ldx;
    const float *bias;
    float *y;
    int64_t ldy;
    int nri;                  /* weight rows per tile; LANES: tile_i8_few */
    const uint8_t *edge;      /* tile_i8_few's last 16 rows, when N % 16 rows are left:
                                 those, then the last one repeated */
    int32_t *A, *Q;
    float *D, *T;
};

/* The activations quantized, on the calling thread (as transpose_x, and for the same reason).
   How many rows hold values that are not finite. */
static int64_t quantize_rows(const struct job_i8 *j) {
    int64_t nonfinite = 0;
    for (int64_t m = 0; m < j->M; m++)
        nonfinite += quantize_row(j->x + m * j->ldx, j->nb, m, j->lanes, j->A, j->D, j->Q, j->T);
    return nonfinite;
}

/* Tiles t0 .. t1 - 1 (nri weight rows each), every group of activation rows. */
static inline __attribute__((always_inline)) void i8_tiles(int kind, const struct job_i8 *j,
                                                           int64_t t0, int64_t t1) {
    const int64_t nb = j->nb, row_bytes = j->row_bytes, G = j->G, M = j->M, ldy = j->ldy;
    const int nri = j->nri;
    for (int64_t n0 = t0 * nri; n0 < t1 * nri && n0 < j->N; n0 += nri) {
        const int nr = j->N - n0 < nri ? (int)(j->N - n0) : nri;
        const uint8_t *wn = j->w + n0 * row_bytes;
        const float *bn = j->bias ? j->bias + n0 : NULL;
        if (M <= FEW_ROWS_MAX) {
            if (nr < LANES) wn = j->edge;
            if (kind == Q4_1) {
                TILES_FEW(Q4_1)
            } else {
                TILES_FEW(Q8_0)
            }
            continue;
        }
        for (int64_t g0 = 0; g0 < G; g0 += 2) {
            const int64_t m0 = g0 * LANES, o = g0 * j->per_group;
            const int32_t *Am = j->A + o * GROUPS, *Qm = j->Q + o;
            const float *Dm = j->D + o, *Tm = j->T + o;
            float *ym = j->y + m0 * ldy + n0;
            const int gm = G - g0 < 2 ? 1 : 2;
            if (kind == Q4_1) {
                TILES_I8(Q4_1)
            } else {
                TILES_I8(Q8_0)
            }
        }
    }
}

#define I8_BODY(KIND) i8_tiles(KIND, c, b, e)
RANGE_FNS(i8, I8_BODY)

/* tile_i8_few's tiles per item: 32 weight rows, so a 576-row matmul splits evenly enough
   over 2 threads (TILES_PER_ITEM's 128 rows would give 4.5 items). */
enum { FEW_TILES_PER_ITEM = 2 };

/* As v1_q_linear_f32, through int8 activations. 0, or -1 without scratch memory. A row
   holding inf or NaN is computed by the fp32 path: quantized, it would be NaN throughout
   (its scale inf), where torch gives +-inf or NaN element by element. Up to FEW_ROWS_MAX rows
   take tile_i8_few, more tile_i8: the same numbers for each row either way (see above). */
V1_API int32_t v1_q_linear_i8(int32_t kind, const uint8_t *w, int64_t N, int64_t K,
                              const float *x, int64_t ldx, int64_t M, const float *bias,
                              float *y, int64_t ldy, int32_t nthreads) {
    const int few = M <= FEW_ROWS_MAX;
    struct job_i8 j = {.w = w, .N = N, .nb = K / QK, .M = M, .x = x, .ldx = ldx,
                       .bias = bias, .y = y, .ldy = ldy};
    j.row_bytes = j.nb * block_bytes(kind);
    j.lanes = few ? M : LANES;
    j.G = (M + j.lanes - 1) / j.lanes;
    j.per_group = j.nb * j.lanes;
    /* A, then D, Q, T (4-byte elements all); rows past M stay 0. */
    j.A = calloc((size_t)(j.G * j.per_group * (GROUPS + 3)), 4);
    if (!j.A) return -1;
    j.Q = j.A + j.G * j.per_group * GROUPS;
    j.D = (float *)(j.Q + j.G * j.per_group);
    j.T = j.D + j.G * j.per_group;
    j.nri = few ? LANES : j.G == 1 ? 8 : 6;
    uint8_t *edge = NULL;
    if (few && N % LANES) {
        if (!(edge = malloc((size_t)(LANES * j.row_bytes)))) {
            free(j.A);
            return -1;
        }
        const int64_t n0 = N / LANES * LANES;
        for (int64_t r = 0; r < LANES; r++)
            memcpy(edge + r * j.row_bytes, w + (n0 + r < N ? n0 + r : N - 1) * j.row_bytes,
                   (size_t)j.row_bytes);
        j.edge = edge;
    }
    const int64_t nonfinite = quantize_rows(&j);
    v1_parallel_for(nthreads, (N + j.nri - 1) / j.nri, few ? FEW_TILES_PER_ITEM : TILES_PER_ITEM,
                    kind == Q4_1 ? i8_q4_1 : i8_q8_0, &j);
    free(edge);
    free(j.A);
    for (int64_t m = 0; nonfinite && m < M; m++) {
        const float *xm = x + m * ldx;
        int64_t k = 0;
        while (k < K && isfinite(xm[k])) k++;
        if (k < K && v1_q_linear_f32(kind, w, N, K, xm, ldx, 1, bias, y + m * ldy, ldy, nthreads))
            return -1;
    }
    return 0;
}

/* The whole weight as fp32 out[N, K], for batches big enough that a dense GEMM pays. */
struct job_dq {
    int kind;
    const uint8_t *w;
    int64_t nb;
    float *out;
};

static void dequantize_rows(void *c, int64_t n0, int64_t n1, int thread) {
    const struct job_dq *j = c;
    const int64_t bb = block_bytes(j->kind), K = j->nb * QK;
    (void)thread;
    for (int64_t n = n0; n < n1; n++) {
        for (int64_t b = 0; b < j->nb; b++) {
            v16 lo, hi;
            dequant_block(j->kind, j->w + (n * j->nb + b) * bb, &lo, &hi);
            memcpy(j->out + n * K + b * QK, &lo, 64);
            memcpy(j->out + n * K + b * QK + 16, &hi, 64);
        }
    }
}

V1_API void v1_q_dequantize(int32_t kind, const uint8_t *w, int64_t N, int64_t K, float *out,
                            int32_t nthreads) {
    struct job_dq j = {.kind = kind, .w = w, .nb = K / QK, .out = out};
    v1_parallel_for(nthreads, N, 16, dequantize_rows, &j);
}

/* Which integer dot product the int8 path compiled to: INT8_ISA. */
V1_API int32_t v1_q_int8_isa(void) { return INT8_ISA; }
