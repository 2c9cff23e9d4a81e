/* The tuned kernels of a K-quant type (GGUF's superblocks of 256 values in 16 blocks of 16,
   each with its own integer scale), for the kernel table (block_types.c): included by a
   type's file (block_q4_k.c, ...) after it defines
     KT_FN(f)      the name of this type's kernel f (block_<type>_f)
     KT_BYTES      bytes per superblock
     KT_MIN        1: x = d sc q - dmin m (a min per 32 values); 0: x = d sc (q - 32) (q6_k)
     KT_ROWS       rows interleaved (optional; 1: GGUF's layout): each group of KT_ROWS rows
                   stores its superblocks b together, dword f of row i at 4 (KT_ROWS f + i);
                   the includer then defines KT_TILE_M and kt_tile, the int8 path's tile
                   (block_q4_kx8.c, block_q6_kx8.c: see the end of this file)
   and after this file, the inline functions declared below (kt_piece, kt_piece64,
   kt_read_scales).

   The int8 path (the same bits for a row whatever M, on every variant; block_ref_k.c is its
   definition): the activations are quantized per superblock, dx = max|x| / 127,
   qx = roundf(x / dx) (as x * (1 / dx)), with s_i the sum of the qx of block i (16 values).
   A weight's values enter the integer dot products unsigned (u = q, or q + 32 for q6_k), and
   per superblock, exactly in int32,
     isum = sum over i of sc_i (u . qx over block i)      (vpmaddubsw, then vpmaddwd or
                                                           vpdpwssd with the scales as words)
     imin = sum over i of mw_i s_i    (mw_i: the min m of block i's 32 values; q6_k: 32 sc_i)
   then per (activation row, weight row), over the superblocks in order,
     KT_MIN: acc = fma(isum, dx d, fma(imin, dx (-dmin), acc))
     else:   acc = fma(isum - imin, dx d, acc)
   and y = acc + bias. A tile is one weight row against a group of up to VL activation rows
   (lanes): each row's isum is a vector of partial sums per (row, superblock), reduced with
   the group's others into one vector of a lane per row (kt_reduce), so that the float
   recurrence runs on the group's rows at once. imin too is a vector per (row, superblock),
   reduced with isum's where both fit the lanes (2 M <= VL; else computed in the rows' lanes
   from the block sums stored transposed); q6_k's is taken off isum's before the reduction.
   dequantize gives gguf's values bit for bit (d sc and dmin m rounded to fp32, then (d sc) q
   rounded, then the min subtracted: this file is compiled without FMA contraction);
   linear_f32 multiplies those with x. */
#include "block_types.h"
#include "isa.h"
#include "pool.h"
#include "vec.h"

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#ifndef KT_ROWS
#define KT_ROWS 1
#endif

enum { QK_K = 256, KT_CHUNKS = QK_K / (4 * VL), KT_GROUPS = 16, KT_PAIRS = KT_GROUPS / 2 };
/* Bytes prefetched ahead of each weight row read (as block_tiles.h). */
enum { KT_PREFETCH = 8192 };

typedef uint8_t kt_b32 __attribute__((vector_size(32)));
typedef uint16_t kt_w32 __attribute__((vector_size(32)));
typedef uint8_t kt_b16 __attribute__((vector_size(16)));
typedef int16_t kt_h16 __attribute__((vector_size(32)));
typedef uint8_t kt_b64 __attribute__((vector_size(64)));
typedef uint16_t kt_w64 __attribute__((vector_size(64)));

/* The 32 bytes at p in both halves of 64 (a broadcast load; kt_piece64 is for VL 16). */
static inline kt_b64 kt_twice32(const uint8_t *p) {
    const vi v = bcast32(p);
    kt_b64 b;
    memcpy(&b, &v, sizeof b < sizeof v ? sizeof b : sizeof v);
    return b;
}

/* Words shifted right by a in the low half of 64 bytes, by b in the high half. */
static inline kt_b64 kt_shift_halves(kt_b64 v, int a, int b) {
    kt_w64 n;
    for (int i = 0; i < 32; i++) n[i] = (uint16_t)(i < 16 ? a : b);
    return (kt_b64)((kt_w64)v >> n);
}

/* A superblock's scales: per block of 16 values its scale sc and its min's weight mw (both
   as the words the integer path multiplies), d and dmin (0 without a min). */
struct kt_scales {
    int16_t sc[KT_GROUPS] __attribute__((aligned(32)));
    kt_h16 mw;
    float d, dmin;
};

/* Values 32 t .. 32 t + 31 of the superblock at p as unsigned bytes (t < 8), and with 16
   lanes values 64 h .. 64 h + 63 (h < 4), each half of them from the same bytes as the
   pieces but by one variable shift, where an insert of two pieces would take a shuffle. */
static inline kt_b32 kt_piece(const uint8_t *p, int t);
static inline kt_b64 kt_piece64(const uint8_t *p, int h);
static inline void kt_read_scales(const uint8_t *p, struct kt_scales *s);

static inline kt_b32 kt_load32(const uint8_t *p) {
    kt_b32 v;
    memcpy(&v, p, 32);
    return v;
}

/* Bytes 8 h .. 8 h + 7 of v, each twice, as 16 words (q4_k and q5_k's per-32 scales and
   mins per block of 16). */
#define KT_TWICE(v, h)                                                                     \
    __builtin_convertvector(__builtin_shufflevector(v, v, 8 * h, 8 * h, 8 * h + 1, 8 * h + 1, \
                                                    8 * h + 2, 8 * h + 2, 8 * h + 3,       \
                                                    8 * h + 3, 8 * h + 4, 8 * h + 4,       \
                                                    8 * h + 5, 8 * h + 5, 8 * h + 6,       \
                                                    8 * h + 6, 8 * h + 7, 8 * h + 7),      \
                            kt_h16)

/* q4_k and q5_k's 12 bytes of 6-bit scales and mins: 8 of each, as words per block of 16. */
static inline void kt_scales_6bit(const uint8_t *s12, struct kt_scales *s) {
    uint32_t a, b, c;
    memcpy(&a, s12, 4);
    memcpy(&b, s12 + 4, 4);
    memcpy(&c, s12 + 8, 4);
    /* scales 0-3 and mins 0-3: the low 6 bits of a and b; 4-7: c's nibbles, with the top
       2 bits of a's and b's bytes above them. */
    const uint64_t sc = (a & 0x3f3f3f3fu) |
                        (uint64_t)((c & 0x0f0f0f0fu) | ((a >> 2) & 0x30303030u)) << 32;
    const uint64_t m = (b & 0x3f3f3f3fu) |
                       (uint64_t)(((c >> 4) & 0x0f0f0f0fu) | ((b >> 2) & 0x30303030u)) << 32;
    typedef uint64_t u64x2 __attribute__((vector_size(16)));
    const kt_b16 both = (kt_b16)(u64x2){sc, m};  /* in registers: no store to reload */
    const kt_h16 scv = KT_TWICE(both, 0), mv = KT_TWICE(both, 1);
    memcpy(s->sc, &scv, sizeof scv);
    s->mw = mv;
}

/* Values 4 VL c .. 4 VL c + 4 VL - 1 of the superblock as unsigned bytes (c < KT_CHUNKS). */
static inline __attribute__((always_inline)) vi kt_chunk(const uint8_t *p, int c) {
#if VL == 16
    return (vi)kt_piece64(p, c);
#elif VL == 8
    return (vi)kt_piece(p, c);
#else
    const kt_b32 a = kt_piece(p, c / 2);
    const kt_b16 lo = __builtin_shufflevector(a, a, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13,
                                              14, 15);
    const kt_b16 hi = __builtin_shufflevector(a, a, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26,
                                              27, 28, 29, 30, 31);
    return (vi)(c % 2 ? hi : lo);
#endif
}

/* VL unsigned bytes at p as int32 lanes. */
static inline vi kt_widen(const uint8_t *p) {
#if WIDEN_FROM_MEMORY
    return widen_u8(p);
#else
    u8v b;
    memcpy(&b, p, VL);
    return __builtin_convertvector(b, vi);
#endif
}

/* ---- dequantize, and linear_f32 from the dequantized values ----------------------------- */

/* Superblock b of row n: in place, or with rows interleaved its dwords (and its bytes past
   the last whole dword, KT_TAIL of them: stored after the group's dwords, row by row)
   gathered into tmp. */
enum { KT_TAIL = KT_BYTES % 4, KT_DWORDS = KT_BYTES / 4 };
static inline const uint8_t *kt_superblock(const uint8_t *w, int64_t row_bytes, int64_t n,
                                           int64_t b, uint8_t tmp[KT_BYTES]) {
    if (KT_ROWS == 1) return w + n * row_bytes + b * KT_BYTES;
    const uint8_t *g = w + (n - n % KT_ROWS) * row_bytes + b * KT_ROWS * KT_BYTES;
    for (int f = 0; f < KT_DWORDS; f++)
        memcpy(tmp + 4 * f, g + 4 * (KT_ROWS * f + n % KT_ROWS), 4);
    memcpy(tmp + 4 * KT_DWORDS, g + 4 * KT_ROWS * KT_DWORDS + KT_TAIL * (n % KT_ROWS), KT_TAIL);
    return tmp;
}

/* The superblock at p as 256 floats, gguf's bits. */
static inline __attribute__((always_inline)) void kt_dequant(const uint8_t *p, float *out) {
    struct kt_scales s;
    kt_read_scales(p, &s);
    uint8_t q[QK_K];
    for (int c = 0; c < KT_CHUNKS; c++) {
        const vi v = kt_chunk(p, c);
        memcpy(q + 4 * VL * c, &v, sizeof v);
    }
    for (int i = 0; i < KT_GROUPS; i++) {
        const float f = s.d * (float)s.sc[i], mn = s.dmin * (float)s.mw[i];
        for (int k = 0; k < 16; k += VL) {
            vf v = __builtin_convertvector(kt_widen(q + 16 * i + k), vf);
            v = KT_MIN ? v * f - mn : (v - 32.f) * f;
            memcpy(out + 16 * i + k, &v, sizeof v);
        }
    }
}

struct kt_job_dq {
    const uint8_t *w;
    int64_t row_bytes, K;
    float *out;
    int64_t ldo;
};

static void kt_dequantize_rows(void *ctx, int64_t n0, int64_t n1, int thread) {
    const struct kt_job_dq *j = ctx;
    (void)thread;
    for (int64_t n = n0; n < n1; n++)
        for (int64_t b = 0; b < j->K / QK_K; b++) {
            uint8_t tmp[KT_BYTES];
            __builtin_prefetch(j->w + n * j->row_bytes + b * KT_BYTES + KT_PREFETCH);
            kt_dequant(kt_superblock(j->w, j->row_bytes, n, b, tmp),
                       j->out + n * j->ldo + b * QK_K);
        }
}

/* The weight [N, K] into out [N, K]; x is not read. */
int32_t KT_FN(dequantize)(const struct v1_matmul *c) {
    struct kt_job_dq j = {.w = c->w.data, .row_bytes = c->w.stride, .K = c->w.cols,
                          .out = c->out.data, .ldo = c->out.stride};
    v1_parallel_for(c->nthreads, c->w.rows, 16, kt_dequantize_rows, &j);
    return 0;
}

struct kt_job_f32 {
    const uint8_t *w;
    int64_t row_bytes, K, M;
    const float *x;
    int64_t ldx;
    const float *bias;
    float *y;
    int64_t ldy;
    float *rows;  /* a dequantized row per thread */
};

/* Weight rows n0 .. n1 - 1, each dequantized once, against every activation row. */
static void kt_f32_rows(void *ctx, int64_t n0, int64_t n1, int thread) {
    const struct kt_job_f32 *j = ctx;
    const int64_t K = j->K;
    float *wrow = j->rows + thread * K;
    for (int64_t n = n0; n < n1; n++) {
        for (int64_t b = 0; b < K / QK_K; b++) {
            uint8_t tmp[KT_BYTES];
            __builtin_prefetch(j->w + n * j->row_bytes + b * KT_BYTES + KT_PREFETCH);
            kt_dequant(kt_superblock(j->w, j->row_bytes, n, b, tmp), wrow + b * QK_K);
        }
        for (int64_t m = 0; m < j->M; m++) {
            const float *x = j->x + m * j->ldx;
            vf acc[4] = {{0}};
            for (int64_t k = 0; k < K; k += 4 * VL)
                for (int a = 0; a < 4; a++)
                    acc[a] = fmav(loadv(wrow + k + a * VL), loadv(x + k + a * VL), acc[a]);
            j->y[m * j->ldy + n] = hsumv((acc[0] + acc[1]) + (acc[2] + acc[3])) +
                                   (j->bias ? j->bias[n] : 0.f);
        }
    }
}

/* y[M, N] = x[M, K] @ W[N, K].T (+ bias) through the dequantized weights. 0, or -1 when
   scratch memory cannot be had. */
int32_t KT_FN(linear_f32)(const struct v1_matmul *c) {
    const int64_t K = c->w.cols;
    struct kt_job_f32 j = {.w = c->w.data, .row_bytes = c->w.stride, .K = K, .M = c->x.rows,
                           .x = c->x.data, .ldx = c->x.stride, .bias = c->bias,
                           .y = c->out.data, .ldy = c->out.stride};
    j.rows = aligned_alloc(64, (size_t)(v1_pool_width(c->nthreads) * K) * sizeof(float));
    if (!j.rows) return -1;
    v1_parallel_for(c->nthreads, c->w.rows, 16, kt_f32_rows, &j);
    free(j.rows);
    return 0;
}

/* ---- int8 activations ------------------------------------------------------------------- */

/* The activations of one call, quantized (see the top), for groups of VL rows (lane l of group
   g: row VL g + l; rows past M are 0):
     xq[m * K + k]                         qx of row m, in order
     XD[(g * nsb + b) * VL + l]            dx of superblock b
     XS[((g * nsb + b) * 8 + i) * VL + l]  s_2i and s_2i+1 as the low and high word
     XW[(m * nsb + b) * 16 + i]            s_i (int16)
     XP[(m * nsb + b) * 4 + p]             with rows interleaved (the includer's tile): the
                                           sums of 32 values S_j = s_2j + s_2j+1 in pairs as
                                           low and high word, (S_0, S_2), (S_1, S_3),
                                           (S_4, S_6), (S_5, S_7) (kx_mins' order) */
struct kt_job_i8 {
    const uint8_t *w;
    int64_t row_bytes, K, nsb, M, G, N;
    const float *bias;
    float *y;
    int64_t ldy;
    int8_t *xq;
    float *XD;
    int32_t *XS;
    int16_t *XW;
    int32_t *XP;
};

/* Row m of x quantized into the job's arrays; 1 if it holds a value that is not finite (its
   superblocks are then stored as 0: the caller recomputes the row), else 0. */
static int kt_quantize_row(const struct kt_job_i8 *j, const float *x, int64_t m) {
    const int64_t g = m / VL, l = m % VL;
    int nonfinite = 0;
    for (int64_t b = 0; b < j->nsb; b++) {
        vf xv[QK_K / VL];
        vi amax = {0};
        for (int c = 0; c < QK_K / VL; c++) {
            xv[c] = loadv(x + b * QK_K + c * VL);
            amax = maxvi2(amax, (vi)xv[c] & 0x7fffffff);  /* |x| compare as integers */
        }
        int32_t amax_bits = maxvi(amax);
        if (amax_bits >= 0x7f800000) {  /* inf or NaN */
            nonfinite = 1;
            amax_bits = 0;
            for (int c = 0; c < QK_K / VL; c++) xv[c] = (vf){0};
        }
        float amaxf;
        memcpy(&amaxf, &amax_bits, 4);
        const float d = amaxf / 127.f, id = d > 0.f ? 1.f / d : 0.f;
        int32_t sums[KT_GROUPS] = {0};
        for (int c = 0; c < QK_K / VL; c++) {
            const vi qc = roundv(xv[c] * id);
            sums[c * VL / 16] += sumvi(qc);
            const u8v bytes = __builtin_convertvector(qc & 255, u8v);
            memcpy(j->xq + m * j->K + b * QK_K + c * VL, &bytes, VL);
        }
        const int64_t gb = g * j->nsb + b;
        j->XD[gb * VL + l] = d;
        for (int i = 0; i < KT_GROUPS; i++)
            j->XW[(m * j->nsb + b) * KT_GROUPS + i] = (int16_t)sums[i];
        for (int i = 0; i < KT_PAIRS; i++)
            j->XS[(gb * KT_PAIRS + i) * VL + l] =
                (int32_t)((uint32_t)(uint16_t)sums[2 * i] | (uint32_t)sums[2 * i + 1] << 16);
#if KT_ROWS > 1
        for (int p = 0; p < 4; p++) {
            const int a = 2 * (p / 2 * 4 + p % 2);  /* s index of S_j, j = 0, 1, 4, 5 */
            j->XP[(m * j->nsb + b) * 4 + p] =
                (int32_t)((uint32_t)(uint16_t)(sums[a] + sums[a + 1]) |
                          (uint32_t)(sums[a + 4] + sums[a + 5]) << 16);
        }
#endif
    }
    return nonfinite;
}

/* The shuffles of kt_reduce's stages: the first (LO) and second (HI) s lanes of every 2 s of
   a, then of b (b's lanes numbered from VL); SWAP: lane i from lane i ^ s. */
#if VL == 16
#define KT_LO8 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23
#define KT_HI8 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31
#define KT_LO4 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27
#define KT_HI4 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31
#define KT_LO2 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29
#define KT_HI2 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31
#define KT_LO1 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30
#define KT_HI1 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31
#define KT_SWAP8 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7
#define KT_SWAP4 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11
#define KT_SWAP2 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13
#define KT_SWAP1 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14
#elif VL == 8
#define KT_LO4 0, 1, 2, 3, 8, 9, 10, 11
#define KT_HI4 4, 5, 6, 7, 12, 13, 14, 15
#define KT_LO2 0, 1, 4, 5, 8, 9, 12, 13
#define KT_HI2 2, 3, 6, 7, 10, 11, 14, 15
#define KT_LO1 0, 2, 4, 6, 8, 10, 12, 14
#define KT_HI1 1, 3, 5, 7, 9, 11, 13, 15
#define KT_SWAP4 4, 5, 6, 7, 0, 1, 2, 3
#define KT_SWAP2 2, 3, 0, 1, 6, 7, 4, 5
#define KT_SWAP1 1, 0, 3, 2, 5, 4, 7, 6
#else
#define KT_LO2 0, 1, 4, 5
#define KT_HI2 2, 3, 6, 7
#define KT_LO1 0, 2, 4, 6
#define KT_HI1 1, 3, 5, 7
#define KT_SWAP2 2, 3, 0, 1
#define KT_SWAP1 1, 0, 3, 2
#endif

/* Lane r (r < n) of the result: the sum of v[r]'s lanes (v is overwritten). Each stage halves
   the lanes per vector and pairs the vectors (an odd last one with itself), in order. With
   `spread`, once one vector is left its groups of lanes are summed in place instead (a
   shuffle a stage, not two), and v[r]'s sum is in lane r G, G = VL >> (the stages paired). */
static inline __attribute__((always_inline)) vi kt_reduce(vi *v, int n, int spread) {
#define KT_STAGE(S)                                                                      \
    if (spread && n == 1) {                                                              \
        v[0] += __builtin_shufflevector(v[0], v[0], KT_SWAP##S);                         \
    } else {                                                                             \
        for (int r = 0; r < (n + 1) / 2; r++) {                                          \
            const vi a = v[2 * r], b = v[2 * r + 1 < n ? 2 * r + 1 : 2 * r];             \
            v[r] = __builtin_shufflevector(a, b, KT_LO##S) +                             \
                   __builtin_shufflevector(a, b, KT_HI##S);                              \
        }                                                                                \
        n = (n + 1) / 2;                                                                 \
    }
#if VL == 16
    KT_STAGE(8)
#endif
#if VL >= 8
    KT_STAGE(4)
#endif
    KT_STAGE(2)
    KT_STAGE(1)
#undef KT_STAGE
    return v[0];
}

/* v's lanes from lane s on, in lanes 0 .. (s a constant at each call, s <= VL / 2). */
#define KT_ROT(S) __builtin_shufflevector(v, v, KT_ROT_LANES(S))
#if VL == 16
#define KT_ROT_LANES(S) ((S) + 0) % 16, ((S) + 1) % 16, ((S) + 2) % 16, ((S) + 3) % 16,         \
    ((S) + 4) % 16, ((S) + 5) % 16, ((S) + 6) % 16, ((S) + 7) % 16, ((S) + 8) % 16,             \
    ((S) + 9) % 16, ((S) + 10) % 16, ((S) + 11) % 16, ((S) + 12) % 16, ((S) + 13) % 16,         \
    ((S) + 14) % 16, ((S) + 15) % 16
#elif VL == 8
#define KT_ROT_LANES(S) ((S) + 0) % 8, ((S) + 1) % 8, ((S) + 2) % 8, ((S) + 3) % 8,             \
    ((S) + 4) % 8, ((S) + 5) % 8, ((S) + 6) % 8, ((S) + 7) % 8
#else
#define KT_ROT_LANES(S) ((S) + 0) % 4, ((S) + 1) % 4, ((S) + 2) % 4, ((S) + 3) % 4
#endif
static inline __attribute__((always_inline)) vi kt_rotate(vi v, int s) {
    switch (s) {
        case 1: return KT_ROT(1);
        case 2: return KT_ROT(2);
#if VL >= 8
        case 3: return KT_ROT(3);
        case 4: return KT_ROT(4);
#endif
#if VL >= 16
        case 5: return KT_ROT(5);
        case 6: return KT_ROT(6);
        case 7: return KT_ROT(7);
        case 8: return KT_ROT(8);
#endif
        default: return v;
    }
}

/* The 16 products a_i b_i (b: 16 words at p), summed in pairs into lanes (their total: the
   dot product). */
static inline __attribute__((always_inline)) vi kt_dot16(kt_h16 a, const int16_t *p) {
    kt_h16 b;
    memcpy(&b, p, sizeof b);
#if VL == 16
    typedef int16_t h32 __attribute__((vector_size(64)));
    const kt_h16 z = {0};
#define KT_WIDE(x) __builtin_shufflevector(x, z, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, \
                                           14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26, \
                                           27, 28, 29, 30, 31)
    const h32 a2 = KT_WIDE(a), b2 = KT_WIDE(b);
#undef KT_WIDE
    return madd16((vi)a2, (vi)b2);
#elif VL == 8
    return madd16((vi)a, (vi)b);
#else
    typedef int16_t h8 __attribute__((vector_size(16)));
    const h8 alo = __builtin_shufflevector(a, a, 0, 1, 2, 3, 4, 5, 6, 7);
    const h8 ahi = __builtin_shufflevector(a, a, 8, 9, 10, 11, 12, 13, 14, 15);
    const h8 blo = __builtin_shufflevector(b, b, 0, 1, 2, 3, 4, 5, 6, 7);
    const h8 bhi = __builtin_shufflevector(b, b, 8, 9, 10, 11, 12, 13, 14, 15);
    return madd16((vi)alo, (vi)blo) + madd16((vi)ahi, (vi)bhi);
#endif
}

/* One weight row (`row`) against group `g`'s MG rows (a constant at each call): y[m * ldy] for
   m < MG. */
static inline __attribute__((always_inline)) void kt_row(const struct kt_job_i8 *j,
                                                          const uint8_t *row, int64_t g, int MG,
                                                          float *y, float bias) {
    const int64_t K = j->K, nsb = j->nsb;
    const int8_t *xq = j->xq + g * VL * K;
    const float *XD = j->XD + g * nsb * VL;
    const int32_t *XS = j->XS + g * nsb * KT_PAIRS * VL;
    const int16_t *XW = j->XW + g * VL * nsb * KT_GROUPS;
    /* imin per (row, m) beside isum, reduced with it, where both fit a vector's lanes (else
       in the rows' lanes from XS); without a min, taken off isum before the reduction. */
    const int joint = KT_MIN && 2 * MG <= VL;
    vf acc = {0};
    for (int64_t b = 0; b < nsb; b++) {
        const uint8_t *p = row + b * KT_BYTES;
        for (int i = 0; i < KT_BYTES; i += 64) __builtin_prefetch(p + KT_PREFETCH + i);
        struct kt_scales s;
        kt_read_scales(p, &s);
        /* words8 then broadcasts from memory (a load), not from the register (a shuffle) */
        __asm__("" : "+m"(s.sc));
        vi isum[VL];
        for (int m = 0; m < MG; m++) isum[m] = (vi){0};
        for (int m = 0; joint && m < MG; m++)
            isum[MG + m] = kt_dot16(s.mw, XW + (m * nsb + b) * KT_GROUPS);
        for (int c = 0; c < KT_CHUNKS; c++) {
            const vi wv = kt_chunk(p, c), k = words8(s.sc + c * VL / 4);
            for (int m = 0; m < MG; m++)
                isum[m] = dot_sc(isum[m], wv, loadvi(xq + m * K + b * QK_K + c * 4 * VL), k);
        }
        for (int m = 0; !KT_MIN && m < MG; m++)
            isum[m] -= kt_dot16(s.mw, XW + (m * nsb + b) * KT_GROUPS);
        /* One activation row: its sums spread (isum in lane 0, imin in lane VL / 2). */
        const vi sum = kt_reduce(isum, joint ? 2 * MG : MG, MG == 1);
        const vf dx = loadv(XD + b * VL);
        if (KT_MIN) {
            vi imin = kt_rotate(sum, MG == 1 ? VL / 2 : MG);
            if (!joint) {
                const int16_t *mw = (const int16_t *)&s.mw;
                imin = (vi){0};
                for (int i = 0; i < KT_PAIRS; i++) {
                    int32_t mw2;
                    memcpy(&mw2, mw + 2 * i, 4);
                    imin += madd16(loadvi(XS + (b * KT_PAIRS + i) * VL), (vi){0} + mw2);
                }
            }
            acc = fmav(__builtin_convertvector(sum, vf), dx * splatv(s.d),
                       fmav(__builtin_convertvector(imin, vf), dx * splatv(-s.dmin), acc));
        } else {
            acc = fmav(__builtin_convertvector(sum, vf), dx * splatv(s.d), acc);
        }
    }
    float out[VL];
    memcpy(out, &acc, sizeof out);
    for (int m = 0; m < MG; m++) y[m * j->ldy] = out[m] + bias;
}

#if KT_ROWS == 1
#define KT_ROW(MG_) kt_row(j, row, g, MG_, y, bias)

/* Weight rows n0 .. n1 - 1, against every group of activation rows. */
static void kt_i8_rows(void *ctx, int64_t n0, int64_t n1, int thread) {
    const struct kt_job_i8 *j = ctx;
    (void)thread;
    for (int64_t n = n0; n < n1; n++) {
        const uint8_t *row = j->w + n * j->row_bytes;
        const float bias = j->bias ? j->bias[n] : 0.f;
        for (int64_t g = 0; g < j->G; g++) {
            float *y = j->y + g * VL * j->ldy + n;
            const int64_t rows = j->M - g * VL;
            switch (rows < VL ? rows : VL) {
                case 1: KT_ROW(1); break;
                case 2: KT_ROW(2); break;
                case 3: KT_ROW(3); break;
#if VL >= 8
                case 4: KT_ROW(4); break;
                case 5: KT_ROW(5); break;
                case 6: KT_ROW(6); break;
                case 7: KT_ROW(7); break;
#endif
#if VL >= 16
                case 8: KT_ROW(8); break;
                case 9: KT_ROW(9); break;
                case 10: KT_ROW(10); break;
                case 11: KT_ROW(11); break;
                case 12: KT_ROW(12); break;
                case 13: KT_ROW(13); break;
                case 14: KT_ROW(14); break;
                case 15: KT_ROW(15); break;
#endif
                default: KT_ROW(VL);
            }
        }
    }
}
#else
/* The includer's tile over sets of VL weight rows. */
static void kt_i8_sets(void *ctx, int64_t s0, int64_t s1, int thread);
#endif

/* As linear_f32, through int8 activations (see the top). 0, or -1 without scratch memory. A
   row holding inf or NaN is computed by linear_f32 (quantized, it would be NaN throughout). */
int32_t KT_FN(linear_i8)(const struct v1_matmul *c) {
    const int64_t N = c->w.rows, K = c->w.cols, M = c->x.rows;
    const float *x = c->x.data;
    struct kt_job_i8 j = {.w = c->w.data, .row_bytes = c->w.stride, .K = K, .nsb = K / QK_K,
                          .M = M, .G = (M + VL - 1) / VL, .N = N, .bias = c->bias,
                          .y = c->out.data, .ldy = c->out.stride};
    const int64_t rows = j.G * VL;
    /* xq, then XD and XS (4-byte elements both, after K bytes per row: K is a multiple of
       256), then XW, then with rows interleaved XP. */
    j.xq = calloc((size_t)(rows * K + rows * j.nsb * ((1 + KT_PAIRS) * 4 + KT_GROUPS * 2 +
                                                      (KT_ROWS > 1 ? 16 : 0))), 1);
    if (!j.xq) return -1;
    j.XD = (float *)(j.xq + rows * K);
    j.XS = (int32_t *)(j.XD + rows * j.nsb);
    j.XW = (int16_t *)(j.XS + rows * j.nsb * KT_PAIRS);
    j.XP = (int32_t *)(j.XW + rows * j.nsb * KT_GROUPS);
    int64_t nonfinite = 0;
    for (int64_t m = 0; m < M; m++) nonfinite += kt_quantize_row(&j, x + m * c->x.stride, m);
#if KT_ROWS == 1
    v1_parallel_for(c->nthreads, N, 16, kt_i8_rows, &j);
#else
    v1_parallel_for(c->nthreads, (N + VL - 1) / VL, (16 + VL - 1) / VL, kt_i8_sets, &j);
#endif
    free(j.xq);
    return nonfinite ? v1_rerun_nonfinite_rows(c, KT_FN(linear_f32)) : 0;
}

/* ---- rows interleaved: a lane per weight row (KT_ROWS 8) ---------------------------------
   For an includer with KT_ROWS > 1 that defines KT_TILE_M (activation rows per tile) and,
   after this file, kt_tile: VL weight rows in the lanes of a vector against up to KT_TILE_M
   activation rows (block_q4_kx8.c, block_q6_kx8.c). This file gives it the sets' driver
   (kt_i8_sets) and the loads. */
#if KT_ROWS > 1

/* Dword f of VL rows' superblock (p: the first row's dword 0 in its group; AVX-512: p2, the
   next group's, or p again for a last group alone). */
static inline __attribute__((always_inline)) vi kt_lanes(const uint8_t *p, const uint8_t *p2,
                                                          int f) {
#if VL == 16
    return join_halves(p + 4 * KT_ROWS * f, p2 + 4 * KT_ROWS * f);
#else
    (void)p2;
    return loadvi(p + 4 * KT_ROWS * f);
#endif
}

/* 4 bytes at p in every lane (a broadcast load). */
static inline vi kt_bcast4(const void *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return (vi){0} + v;
}

/* VL weight rows (their superblocks at p, p2 as kt_lanes's; lane0: the first one's row in its
   group, `rows` of them real) against activation rows m0 .. m0 + mt - 1 (mt <= KT_TILE_M):
   y[m * ldy + lane] for each. */
static void kt_tile(const struct kt_job_i8 *j, const uint8_t *p, const uint8_t *p2, int lane0,
                    int64_t m0, int mt, float *y, const float *bias, int rows);

/* Sets of VL weight rows s0 .. s1 - 1 (rows VL s ..; a last set on AVX-512 may be one group),
   each against every activation row, KT_TILE_M at a time. */
static void kt_i8_sets(void *ctx, int64_t s0, int64_t s1, int thread) {
    const struct kt_job_i8 *j = ctx;
    (void)thread;
    for (int64_t s = s0; s < s1; s++) {
        const int64_t n0 = s * VL;
        const uint8_t *p = j->w + (n0 - n0 % KT_ROWS) * j->row_bytes + n0 % KT_ROWS * 4;
        const int rows = (int)(j->N - n0 < VL ? j->N - n0 : VL);
        const uint8_t *p2 = rows > KT_ROWS ? p + KT_ROWS * j->row_bytes : p;
        const float *bias = j->bias ? j->bias + n0 : NULL;
        for (int64_t m0 = 0; m0 < j->M; m0 += KT_TILE_M)
            kt_tile(j, p, p2, (int)(n0 % KT_ROWS), m0,
                    (int)(j->M - m0 < KT_TILE_M ? j->M - m0 : KT_TILE_M),
                    j->y + m0 * j->ldy + n0, bias, rows);
    }
}
#endif
