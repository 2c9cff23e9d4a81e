/* GGUF f16 weights, tuned: a row is K IEEE halves (any K), converted to fp32 in registers
   (F16C / AVX-512's vcvtph2ps, NEON's fcvtl) and multiplied with the fp32 activations.
   block_bf16.c builds the same kernels for bfloat16 (HALF_BF16: a half's 16 bits become a
   float's high ones). No linear_i8: such weights take the fp32 path.

   linear_f32 is dot products at every M: NH weight rows (NH1 at one activation row) x up to
   MH activation rows, each VL values of the rows converted once and met by every activation
   row there; a tile of weight rows serves the call's activation rows MH at a time while it
   stays in L1 (NH rows of K halves: 16 KiB at K = 2048 with AVX-512). K % VL values at a
   row's end are read into a zero-padded vector (0 x 0 adds nothing, whatever the row holds).
   Beyond a few activation rows the caller's dense path (dequantize, then a GEMM) is faster. */
#include "block_types.h"
#include "isa.h"
#include "pool.h"
#include "vec.h"

#include <stdint.h>
#include <string.h>

#ifndef HALF_BF16
#define HALF_BF16 0
#define HALF_FN(f) block_f16_##f
#endif

/* Ahead of each weight row read (as block_tiles.h's PREFETCH). */
enum { PREFETCH = 8192 };

#if NREGS >= 32
enum { NH = 4, NH1 = 8 };
#else
enum { NH = 2, NH1 = 4 };
#endif
enum { MH = 4, NH_MAX = NH1 > NH ? NH1 : NH, TILES_PER_ITEM = 8 };

/* VL halves at p as floats. */
static inline __attribute__((always_inline)) vf halfv(const uint8_t *p) {
#if HALF_BF16
    typedef uint16_t u16v __attribute__((vector_size(2 * VL)));
    u16v h;
    memcpy(&h, p, sizeof h);
    return (vf)(__builtin_convertvector(h, vu) << 16);
#else
    return fp16v(p);
#endif
}

/* The n values at p (n < VL) as a vector, zero-padded. */
static inline __attribute__((always_inline)) vf halfv_tail(const uint8_t *p, int n) {
    uint8_t h[2 * VL] = {0};
    memcpy(h, p, 2 * (size_t)n);
    return halfv(h);
}

/* y[m][r] = x[m] . W[r] (+ bias[r]) for r < nr, m < mr: NT weight rows from w (rows past nr
   repeat the last one), MT (constants at each call) activation rows. */
static inline __attribute__((always_inline)) void tile_halves(
    const uint8_t *w, int64_t rb, int nr, int NT, int64_t K, const float *x, int64_t ldx,
    int MT, float *y, int64_t ldy, const float *bias) {
    const uint8_t *row[NH_MAX];
    for (int r = 0; r < NT; r++) row[r] = w + (r < nr ? r : nr - 1) * rb;
    vf acc[NH_MAX][MH] = {{{0}}};
    int64_t k = 0;
    for (; k + VL <= K; k += VL) {
        vf wv[NH_MAX];
        for (int r = 0; r < NT; r++) {
            __builtin_prefetch(row[r] + 2 * k + PREFETCH);
            wv[r] = halfv(row[r] + 2 * k);
        }
        for (int m = 0; m < MT; m++) {
            const vf xv = loadv(x + m * ldx + k);
            for (int r = 0; r < NT; r++) acc[r][m] += wv[r] * xv;
        }
    }
    if (k < K) {
        const int n = (int)(K - k);
        vf wv[NH_MAX];
        for (int r = 0; r < NT; r++) wv[r] = halfv_tail(row[r] + 2 * k, n);
        for (int m = 0; m < MT; m++) {
            float t[VL] = {0};
            memcpy(t, x + m * ldx + k, 4 * (size_t)n);
            const vf xv = loadv(t);
            for (int r = 0; r < NT; r++) acc[r][m] += wv[r] * xv;
        }
    }
    for (int m = 0; m < MT; m++)
        for (int r = 0; r < nr; r++) y[m * ldy + r] = hsumv(acc[r][m]) + (bias ? bias[r] : 0.f);
}

struct job {
    const uint8_t *w;
    int64_t N, K, rb;
    const float *x;
    int64_t ldx, M;
    const float *bias;
    float *y;
    int64_t ldy;
    int nt;  /* weight rows per tile */
};

#define TILE(NT_, MT_) \
    tile_halves(w, j->rb, nr, NT_, j->K, j->x + m0 * ldx, ldx, MT_, y + m0 * ldy, ldy, bn)

/* Tiles t0 .. t1 - 1, every activation row. */
static void tiles(void *c, int64_t t0, int64_t t1, int thread) {
    const struct job *j = c;
    (void)thread;
    const int64_t ldx = j->ldx, ldy = j->ldy;
    for (int64_t n0 = t0 * j->nt; n0 < t1 * j->nt && n0 < j->N; n0 += j->nt) {
        const int nr = j->N - n0 < j->nt ? (int)(j->N - n0) : j->nt;
        const uint8_t *w = j->w + n0 * j->rb;
        const float *bn = j->bias ? j->bias + n0 : NULL;
        float *y = j->y + n0;
        if (j->M == 1) {
            const int64_t m0 = 0;
            TILE(NH1, 1);
            continue;
        }
        for (int64_t m0 = 0; m0 < j->M; m0 += MH) {
            switch (j->M - m0 < MH ? j->M - m0 : MH) {
                case 1: TILE(NH, 1); break;
                case 2: TILE(NH, 2); break;
                case 3: TILE(NH, 3); break;
                default: TILE(NH, MH);
            }
        }
    }
}

/* y[M, N] = x[M, K] @ W[N, K].T (+ bias). 0. */
int32_t HALF_FN(linear_f32)(const struct v1_matmul *c) {
    struct job j = {.w = c->w.data, .N = c->w.rows, .K = c->w.cols, .rb = c->w.stride,
                    .x = c->x.data, .ldx = c->x.stride, .M = c->x.rows, .bias = c->bias,
                    .y = c->out.data, .ldy = c->out.stride};
    j.nt = j.M == 1 ? NH1 : NH;
    v1_parallel_for(c->nthreads, (j.N + j.nt - 1) / j.nt, TILES_PER_ITEM, tiles, &j);
    return 0;
}

/* Rows n0 .. n1 - 1 of the weight as fp32. */
static void dequantize_rows(void *c, int64_t n0, int64_t n1, int thread) {
    const struct v1_matmul *call = c;
    (void)thread;
    const int64_t K = call->w.cols;
    for (int64_t n = n0; n < n1; n++) {
        const uint8_t *p = (const uint8_t *)call->w.data + n * call->w.stride;
        float *o = (float *)call->out.data + n * call->out.stride;
        int64_t k = 0;
        for (; k + VL <= K; k += VL) {
            const vf v = halfv(p + 2 * k);
            memcpy(o + k, &v, sizeof v);
        }
        if (k < K) {
            const vf v = halfv_tail(p + 2 * k, (int)(K - k));
            memcpy(o + k, &v, 4 * (size_t)(K - k));
        }
    }
}

/* The weight [N, K] into out [N, K]; x is not read. Every value converted exactly. */
int32_t HALF_FN(dequantize)(const struct v1_matmul *c) {
    v1_parallel_for(c->nthreads, c->w.rows, 16, dequantize_rows, (void *)c);
    return 0;
}
