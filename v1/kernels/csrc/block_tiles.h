/* The tuned block-quantized matmuls of one weight format, for the kernel table
   (block_types.c): included by a format's file (block_q4_1.c, ...) after it defines
     BT_FN(f)          the name of this format's kernel f (block_<type>_f)
     BT_BYTES          bytes per block of QK values
     BT_MIN            1: x = d q + m (a per-block min, fp16 after d); 0: x = d q
     BT_SIGNED         1: quants are signed bytes (they go into dot4 + 128 unless
                       INT8_SIGNED_WEIGHTS); 0: unsigned
     BT_WMAX           the largest unsigned weight byte (q4_1's nibbles: 15)
     BT_ZERO           (optional, 0) the weight byte that means 0: x = d (q - BT_ZERO)
                       (q4_0: 8); taken off a block's integer sum as BT_ZERO times the sum
                       of its activation quants
     BT_QH             (optional, 0: none) where the block's dword of high bits is (q5_0,
                       q5_1: the fifth bit of each value), handed to bt_weight_bytes
     BT_HALVES         the block's runs of 16 quant bytes (bt_qs(h), h < BT_HALVES)
     BT_COLS_AHEAD     1: tile_i8_few loads the next block's columns ahead (see there)
     BT_ROWS           rows interleaved (1: GGUF's layout, a row's blocks one after the
                       other); > 1: each group of BT_ROWS rows stores its blocks b together,
                       dword f of the block of row i at 4 (BT_ROWS f + i), so tile_i8_few
                       reads VL rows' dwords with plain loads (bt_row)
     BT_SCALES         (optional, 0) with rows interleaved, where a group's block keeps its
                       rows' fp16 d, row by row (bytes from the block's start); 0: each
                       row's d (and m) in its first dword
   and the inline functions
     bt_chunk(p, c)              values VL c .. VL c + VL - 1 of the block before scaling,
                                 as floats (c < BV)
     bt_group4(p, j)             the 4 bytes that hold values 4j .. 4j + 3 (j < 8)
     bt_weight_bytes(b4, qh, j)  those 4 bytes as dot4's unsigned (or signed) weight bytes,
                                 given the block's high-bits dword qh (BT_QH; else 0)
     bt_qs(h)                    where run h of quant bytes starts in the block.
   A row's block starts at p = bt_row(w, n, row_bytes) + b BT_ROWS BT_BYTES, its scale d (and
   min m) at bt_scale(p, n) (and + 2): p, but with BT_SCALES.
   The tiling is the same for every format: only these differ. Each kernel takes a
   `struct v1_matmul` (block_types.h), whose shapes the bindings checked. */
#include "block_types.h"
#include "isa.h"
#include "pool.h"
#include "vec.h"

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#ifndef BT_ZERO
#define BT_ZERO 0
#endif
#ifndef BT_QH
#define BT_QH 0
#endif
#ifndef BT_SCALES
#define BT_SCALES 0
#endif
_Static_assert(!BT_SCALES || (BT_ROWS > 1 && !BT_MIN), "scales apart: interleaved, no min");

/* Weights stream from memory once per call; the kernels prefetch this many bytes ahead of
   each weight row they read (the hardware prefetchers alone left a one-row LM head waiting
   on memory most of the time: docs/kernels.md). */
enum { PREFETCH = 8192 };

/* The tiling below is for blocks of 32 values. */
enum { QK = 32 };

/* Where row n of the weight w starts: its first block's first dword (bytes apart from those of
   the other rows of its group where BT_ROWS > 1). A row's blocks are BLOCK_STEP bytes apart. */
enum { BLOCK_STEP = BT_BYTES * BT_ROWS };
static inline const uint8_t *bt_row(const uint8_t *w, int64_t n, int64_t row_bytes) {
    return w + n / BT_ROWS * BT_ROWS * row_bytes + 4 * (n % BT_ROWS);
}
/* Where the block at p (in row n) keeps its d (and m, 2 bytes on). */
static inline const uint8_t *bt_scale(const uint8_t *p, int64_t n) {
    return BT_SCALES ? p - 4 * (n % BT_ROWS) + BT_SCALES + 2 * (n % BT_ROWS) : p;
}

/* ---- fp32 activations: blocks dequantized to fp32, FMA with the activations ------------- */

/* Chunk c of a block's values, given its scale d and min m. d * q + m is one FMA here where
   the ISA has it, and yet gguf's bits (it rounds d q, then the sum): d q is exact in fp32 (an
   fp16 d's 11 significant bits times a quant's 8 at most). */
static inline __attribute__((always_inline)) vf dequant_chunk(const uint8_t *p, int c, float d,
                                                              float m) {
    return BT_MIN ? bt_chunk(p, c) * d + m : bt_chunk(p, c) * d;
}

/* Three tiles, by the number of activation rows M:
   - M <= DOT_ROWS_MAX, dot products: NR weight rows x up to MR activation rows. Each chunk
     of a block of the NR rows is dequantized into registers and meets the activation rows
     there; each of the NR x MR sums is spread over a vector and reduced at the end.
   - otherwise outer products: a few weight rows are dequantized once into a scratch buffer
     `wb` (L1-sized for K up to ~1.5k); the activations, transposed once per call into `xt`,
     run against it, weight values broadcast, so each loaded vector serves every row of the
     tile. Up to PAIR_ROWS_MAX rows a vector holds VL / 2 activation rows x 2 consecutive k (a
     broadcast weight pair serves VL products; with VL rows x 1 k, VL / 2 rows would leave
     half of each vector idle), NL_PAIRS weight rows per tile; beyond, VL rows x 1 k, NL weight
     rows and up to MV vectors of activation rows per tile.
   Each way the weight is read and dequantized once per call (for up to VL MV rows). The tile
   sizes fill the registers: NREGS vectors (vec.h). */
#if NREGS >= 32
enum { NR = 4, NR1 = 4, NL_PAIRS = 12, NL = 6, MV = 4 };
#else
enum { NR = 2, NR1 = 4, NL_PAIRS = 6, NL = 6, MV = 2 };
#endif
/* Dot tiles take MR rows a pass, their weights dequantized once a pass: AVX-512 up to two
   passes (at 8 rows the outer products took 1.5x their time on Zen 5, docs/kernels.md), AVX2
   one (there two would take ~1.1x the outer products' time; NEON unmeasured). */
enum { MR = 4, DOT_ROWS_MAX = VL >= 16 ? 2 * MR : MR, PAIR_ROWS_MAX = VL,
       NL_MAX = NL_PAIRS > NL ? NL_PAIRS : NL };

/* y[m][r] = x[m] . W[n0 + r] (+ bias[r]) for r < nr, m < mr; rows past nr repeat the last one. */
static inline __attribute__((always_inline)) void tile_dot(
    const uint8_t *w, int64_t row_bytes, int64_t n0, int nr, int64_t nb, const float *x,
    int64_t ldx, int mr, float *y, int64_t ldy, const float *bias) {
    const int64_t bytes = BLOCK_STEP;
    const uint8_t *row[NR];
    for (int r = 0; r < NR; r++) row[r] = bt_row(w, n0 + (r < nr ? r : nr - 1), row_bytes);
    vf acc[NR][MR] = {{{0}}};
    for (int64_t b = 0; b < nb; b++) {
        float d[NR], mins[NR];
        for (int r = 0; r < NR; r++) {
            const uint8_t *p = row[r] + b * bytes;
            __builtin_prefetch(p + PREFETCH);
            d[r] = fp16(bt_scale(p, n0 + (r < nr ? r : nr - 1)));
            mins[r] = BT_MIN ? fp16(p + 2) : 0.f;
        }
        for (int c = 0; c < BV; c++) {
            vf wv[NR];
            for (int r = 0; r < NR; r++) wv[r] = dequant_chunk(row[r] + b * bytes, c, d[r], mins[r]);
            for (int m = 0; m < mr; m++) {
                const vf xv = loadv(x + m * ldx + b * QK + c * VL);
                for (int r = 0; r < NR; r++) acc[r][m] += wv[r] * xv;
            }
        }
    }
    for (int m = 0; m < mr; m++)
        for (int r = 0; r < nr; r++) y[m * ldy + r] = hsumv(acc[r][m]) + (bias ? bias[r] : 0.f);
}

/* tile_dot for one activation row and NR1 weight rows, with fewer operations per block:
   d (q . x), plus with a min m sum(x), the block sums of x given in sx (batch 1 is where the
   kernel's arithmetic, not memory, bounds the time). */
static inline __attribute__((always_inline)) void tile_dot1(
    const uint8_t *w, int64_t row_bytes, int64_t n0, int nr, int64_t nb, const float *x,
    const float *sx, float *y, const float *bias) {
    const int64_t bytes = BLOCK_STEP;
    const uint8_t *row[NR1];
    for (int r = 0; r < NR1; r++) row[r] = bt_row(w, n0 + (r < nr ? r : nr - 1), row_bytes);
    vf acc[NR1] = {{0}};
    float offsets[NR1] = {0};
    for (int64_t b = 0; b < nb; b++) {
        vf xv[BV];
        for (int c = 0; c < BV; c++) xv[c] = loadv(x + b * QK + c * VL);
        for (int r = 0; r < NR1; r++) {
            const uint8_t *p = row[r] + b * bytes;
            __builtin_prefetch(p + PREFETCH);
            vf t = bt_chunk(p, 0) * xv[0];
            for (int c = 1; c < BV; c++) t += bt_chunk(p, c) * xv[c];
            acc[r] += t * fp16(bt_scale(p, n0 + (r < nr ? r : nr - 1)));
            if (BT_MIN) offsets[r] += fp16(p + 2) * sx[b];
        }
    }
    for (int r = 0; r < nr; r++) y[r] = hsumv(acc[r]) + offsets[r] + (bias ? bias[r] : 0.f);
}

/* Where x[m][k] goes in xt: lane (m % VL) of vector m / VL at row k, or with pairs, lane
   2 (m % (VL / 2)) + k % 2 of vector m / (VL / 2) at row k / 2. */
static inline int64_t xt_index(int64_t m, int64_t k, int pairs, int64_t ldxt) {
    return pairs ? k / 2 * ldxt + m / (VL / 2) * VL + m % (VL / 2) * 2 + k % 2 : k * ldxt + m;
}

/* y[m][r] = x[m] . wb[r] (+ bias[r]) for r < nr, m < rows (at most VL mv, VL / 2 mv with
   pairs); nl weight rows, mv vectors of activations. */
static inline __attribute__((always_inline)) void tile_outer(
    const float *wb, int64_t K, const float *xt, int64_t ldxt, int nl, int mv, int pairs,
    float *y, int64_t ldy, int nr, int64_t rows, const float *bias) {
    vf acc[NL_MAX][MV] = {{{0}}};
    for (int64_t k = 0; k < K; k += 1 + pairs) {
        vf xv[MV];
        for (int v = 0; v < mv; v++) xv[v] = loadv(xt + (k >> pairs) * ldxt + VL * v);
        for (int r = 0; r < nl; r++) {
            vf wk;
            if (pairs) {  /* wb[r][k], wb[r][k + 1], repeated: one broadcast load */
                double t;
                memcpy(&t, wb + r * K + k, 8);
                wk = (vf)(t - (vd){0});
            } else {
                wk = splatv(wb[r * K + k]);
            }
            for (int v = 0; v < mv; v++) acc[r][v] += xv[v] * wk;
        }
    }
    const int per = VL >> pairs;  /* activation rows per vector */
    for (int v = 0; v < mv; v++)
        for (int l = 0; l < per && per * v + l < rows; l++)
            for (int r = 0; r < nr; r++) {
                const float sum = pairs ? acc[r][v][2 * l] + acc[r][v][2 * l + 1] : acc[r][v][l];
                y[(per * v + l) * ldy + r] = sum + (bias ? bias[r] : 0.f);
            }
}

/* nl rows from row n0 of `w` into wb (rows past nr repeat the last one). */
static inline __attribute__((always_inline)) void dequant_rows(
    const uint8_t *w, int64_t row_bytes, int64_t n0, int nl, int nr, int64_t K, float *wb) {
    const int64_t bytes = BLOCK_STEP;
    for (int r = 0; r < nl; r++) {
        const int64_t n = n0 + (r < nr ? r : nr - 1);
        const uint8_t *row = bt_row(w, n, row_bytes);
        for (int64_t b = 0; b < K / QK; b++) {
            const uint8_t *p = row + b * bytes;
            __builtin_prefetch(p + PREFETCH);
            const float d = fp16(bt_scale(p, n)), m = BT_MIN ? fp16(p + 2) : 0.f;
            for (int c = 0; c < BV; c++) {
                const vf v = dequant_chunk(p, c, d, m);
                memcpy(wb + r * K + b * QK + c * VL, &v, sizeof v);
            }
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
    const float *sx;          /* then with a min, the block sums of x (its offsets) */
    int pairs, nl;            /* outer products: the tile (see above) */
    float *xt;                /* outer: transposed activations, then a wb per thread */
    int64_t ldxt, xt_floats;
};

/* Dot tiles t0 .. t1 - 1 (NR weight rows each, NR1 with tile_dot1). */
static inline __attribute__((always_inline)) void dot_tiles(const struct job *j,
                                                            int64_t t0, int64_t t1) {
    const int step = j->dot1 ? NR1 : NR;
    for (int64_t n0 = t0 * step; n0 < t1 * step && n0 < j->N; n0 += step) {
        const int nr = j->N - n0 < step ? (int)(j->N - n0) : step;
        const uint8_t *w = j->w;
        const float *bn = j->bias ? j->bias + n0 : NULL;
        float *yn = j->y + n0;
        const int64_t rb = j->row_bytes, nb = j->nb, ldx = j->ldx, ldy = j->ldy;
        if (j->dot1) {
            tile_dot1(w, rb, n0, nr, nb, j->x, j->sx, yn, bn);
            continue;
        }
        for (int64_t m0 = 0; m0 < j->M; m0 += MR) {  /* MR rows a pass, the weights in cache */
            const float *xm = j->x + m0 * ldx;
            float *ym = yn + m0 * ldy;
            switch (j->M - m0) {
                case 1: tile_dot(w, rb, n0, nr, nb, xm, ldx, 1, ym, ldy, bn); break;
                case 2: tile_dot(w, rb, n0, nr, nb, xm, ldx, 2, ym, ldy, bn); break;
                case 3: tile_dot(w, rb, n0, nr, nb, xm, ldx, 3, ym, ldy, bn); break;
                default: tile_dot(w, rb, n0, nr, nb, xm, ldx, MR, ym, ldy, bn);
            }
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
    const struct job *j, int64_t t0, int64_t t1, int thread) {
    const int64_t K = j->K, M = j->M, ldxt = j->ldxt, ldy = j->ldy;
    const int nl = j->nl;
    const float *xt = j->xt;
    float *wb = j->xt + j->xt_floats + thread * nl * K, *y = j->y;
    for (int64_t n0 = t0 * nl; n0 < t1 * nl && n0 < j->N; n0 += nl) {
        const int nr = j->N - n0 < nl ? (int)(j->N - n0) : nl;
        const float *bn = j->bias ? j->bias + n0 : NULL;
        dequant_rows(j->w, j->row_bytes, n0, nl, nr, K, wb);
        if (j->pairs) {
            const int64_t m0 = 0;
            if (M > VL / 2) TILE_OUTER(NL_PAIRS, 2, 1);
            else TILE_OUTER(NL_PAIRS, 1, 1);
            continue;
        }
        for (int64_t m0 = 0; m0 < M; m0 += VL * MV) {
            const int64_t vectors = (M - m0 + VL - 1) / VL;
            switch (vectors < MV ? vectors : MV) {
                case 1: TILE_OUTER(NL, 1, 0); break;
                case 2: TILE_OUTER(NL, 2, 0); break;
                case 3: TILE_OUTER(NL, MV < 3 ? MV : 3, 0); break;
                default: TILE_OUTER(NL, MV, 0);
            }
        }
    }
}

/* The pool's entry points. */
static void dot_range(void *c, int64_t b, int64_t e, int t) { (void)t; dot_tiles(c, b, e); }
static void outer_range(void *c, int64_t b, int64_t e, int t) { outer_tiles(c, b, e, t); }

/* Weight rows per item, so items are a few tiles: threads take items as they come free (on
   a shared machine one may lose its core for a while; the other then takes the rest). */
enum { TILES_PER_ITEM = 8 };

/* y[M, N] = x[M, K] @ W[N, K].T (+ bias). 0, or -1 when scratch memory cannot be had.

   Non-finite activations give what torch's x @ dequantize().T gives, at every M: each
   product is a dequantized weight times x, except in tile_dot1's d (q . x) + m sum(x), which
   turns q4_1's x = inf against q = 0 into NaN (0 x inf) where w x = m x is +-inf. So a row
   whose block sums are not all finite takes tile_dot (one row) instead. (Without a min,
   w = d q is 0 exactly where q is: NaN both ways.) */
int32_t BT_FN(linear_f32)(const struct v1_matmul *c) {
    const int64_t N = c->w.rows, K = c->w.cols, M = c->x.rows;
    const int nthreads = c->nthreads;
    const float *x = c->x.data;
    struct job j = {.w = c->w.data, .N = N, .K = K, .nb = K / QK, .x = x, .ldx = c->x.stride,
                    .M = M, .bias = c->bias, .y = c->out.data, .ldy = c->out.stride};
    j.row_bytes = c->w.stride;
    if (M <= DOT_ROWS_MAX) {
        float *sx = NULL;
        if (M == 1 && BT_MIN) {
            if (!(sx = malloc((size_t)j.nb * sizeof(float)))) return -1;
            int finite = 1;
            for (int64_t b = 0; b < j.nb; b++) {
                vf sum = loadv(x + b * QK);
                for (int c = 1; c < BV; c++) sum += loadv(x + b * QK + c * VL);
                sx[b] = hsumv(sum);
                finite &= isfinite(sx[b]) != 0;
            }
            j.sx = sx;
            j.dot1 = finite;
        } else {
            j.dot1 = M == 1;
        }
        v1_parallel_for(nthreads, (N + NR - 1) / NR, TILES_PER_ITEM, dot_range, &j);
        free(sx);
        return 0;
    }
    j.pairs = M <= PAIR_ROWS_MAX;
    j.nl = j.pairs ? NL_PAIRS : NL;
    j.ldxt = j.pairs ? (M + VL / 2 - 1) / (VL / 2) * VL : (M + VL - 1) / VL * VL;
    j.xt_floats = (j.pairs ? K / 2 : K) * j.ldxt;
    /* xt, then a weight buffer per thread (64-byte aligned: K is a multiple of 32, ldxt of
       VL). */
    j.xt = aligned_alloc(64, (size_t)(j.xt_floats + v1_pool_width(nthreads) * j.nl * K) * 4);
    if (!j.xt) return -1;
    memset(j.xt, 0, (size_t)j.xt_floats * sizeof(float));
    transpose_x(&j);
    v1_parallel_for(nthreads, (N + j.nl - 1) / j.nl, TILES_PER_ITEM, outer_range, &j);
    free(j.xt);
    return 0;
}

/* ---- int8 activations: integer dot products, as llama.cpp ------------------------------- */

/* Activations are quantized per block of 32 as q8_0 (dx = max|x| / 127, q = round(x / dx))
   and laid out so that `lanes` rows' 4 consecutive values sit side by side:
     A[((g * nb + b) * 8 + j) * lanes + l]   int8 x 4: row lanes g + l, values 32 b + 4 j .. + 3
     D, Q, T[(g * nb + b) * lanes + l]       dx, sum of the q, dx * sum (float)
   (tile_i8_few's last group, where shorter, as wide as its rows: `width` in quantize_row).
   Two tiles read them. tile_i8 (lanes = VL): a weight's 4 bytes for the same values,
   broadcast, meet VL activation rows in one u8 x s8 dot product (dot4). tile_i8_few
   (lanes = M in one group, or groups of lanes <= SPLIT_ROWS rows, the last one maybe
   shorter): VL weight rows' 4 bytes, transposed into one vector, meet one activation row's 4
   bytes, broadcast; each weight byte then serves every row of its group with none of
   tile_i8's idle lanes. Weights must be the unsigned side (but
   with INT8_SIGNED_WEIGHTS, where signed ones go into dot4s as they are): q4_1's nibbles are;
   q8_0's bytes are offset by 128 (q ^ 0x80), taken back as 128 * sum(q) per block
   (W_OFFSET), as q4_0's and q5_0's zero points (8, 16) are. Rows past M are 0.

   Both give every row the same numbers, whatever M and whichever tile serves it (what
   v1.models.layers.quantized's per-row path choice rests on): a block's integer dot product is
   exact, and each (activation row, weight row) then runs the same float recurrence over its
   blocks in order, with explicit FMAs (no contraction left to the compiler):
     q4_1: acc = fma(isum_b, dx_b * d_b, fma(t_b, m_b, acc))    (t_b = dx_b * sum q_b)
     q8_0: acc = fma(isum_b, dx_b * d_b, acc)    (isum_b less W_OFFSET * sum q_b, exactly)
   then y = acc + bias. Every variant of the library computes these bit for bit.

   tile_i8_few serves up to FEW_ROWS_MAX rows in one group (more would not fit its sums in
   registers), up to GROUPED_ROWS_MAX in groups of at most SPLIT_ROWS, each group meeting a
   tile's weights while the cache still holds them (L1 for K up to a few thousand). Grouped,
   it beat tile_i8 at 9-64 rows with AVX2 (lost at 96) and 17-128 with AVX-512 (lost at
   256); with AVX-512 groups of 12 beat groups of 16 (a 16-row group's sums fill the
   registers), with AVX2 groups of 8 beat 6 (docs/kernels.md, "Figures"). NEON takes the
   first set, SSE2 the second: not measured. tile_i8 (more rows: groups of VL activation rows)
   runs I8_ROWS weight rows x GM_MAX groups. */
#if NREGS >= 32
enum { FEW_ROWS_MAX = 16, SPLIT_ROWS = 12, GROUPED_ROWS_MAX = 128, I8_ROWS = 6, GM_MAX = 2 };
#else
enum { FEW_ROWS_MAX = 8, SPLIT_ROWS = 8, GROUPED_ROWS_MAX = 64, I8_ROWS = 3, GM_MAX = 2 };
#endif
_Static_assert(SPLIT_ROWS <= FEW_ROWS_MAX, "a group's rows are tile_i8_few's MF");
enum { GROUPS = QK / 4, W_OFFSET = BT_SIGNED && !INT8_SIGNED_WEIGHTS ? 128 : BT_ZERO };
_Static_assert(!(BT_MIN && W_OFFSET), "a format with a min has no zero point");

/* A block's integer sums, a group of 4 bytes per lane at a time: dot4 for this format's
   weight bytes (signed ones go to dot4s where the ISA takes them), or where the ISA has a
   cheaper form keeping pair sums as int16 (dot4_i16) and the format's 8 groups' pair sums fit
   int16 (q4_1: 8 x 2 x 15 x 127), that, widened once per block (block_sum). */
#ifdef dot4_i16
enum { I16_SUMS = !BT_SIGNED && GROUPS * 2 * BT_WMAX * 127 <= 32767 };
#else
enum { I16_SUMS = 0 };
#endif

static inline __attribute__((always_inline)) vi dot4w(vi acc, vi w, vi s) {
#ifdef dot4_i16
    if (I16_SUMS) return dot4_i16(acc, w, s);
#endif
#ifdef dot4s
    if (BT_SIGNED) return dot4s(acc, w, s);
#endif
    return dot4(acc, w, s);
}

static inline __attribute__((always_inline)) vi block_sum(vi sums) {
#ifdef widen_i16
    if (I16_SUMS) return widen_i16(sums);
#endif
    return sums;
}

/* Row `row` of x quantized, in the layout for `lanes` rows; 1 if it holds a value that is not
   finite (its blocks are then stored as 0: the caller recomputes the row), else 0. */
static int quantize_row(const float *x, int64_t nb, int64_t g, int64_t l, int64_t lanes,
                        int64_t width, int32_t *A, float *D, int32_t *Q, float *T) {
    int nonfinite = 0;
    /* group g's place (every group before it `lanes` wide), then lane l of `width` */
    A += g * nb * GROUPS * lanes;
    D += g * nb * lanes;
    Q += g * nb * lanes;
    T += g * nb * lanes;
    for (int64_t b = 0; b < nb; b++) {
        vf xv[BV];
        vi amax = {0};
        for (int c = 0; c < BV; c++) {
            xv[c] = loadv(x + b * QK + c * VL);
            amax = maxvi2(amax, (vi)xv[c] & 0x7fffffff);  /* |x| compare as integers */
        }
        int32_t amax_bits = maxvi(amax);
        if (amax_bits >= 0x7f800000) {  /* inf or NaN */
            nonfinite = 1;
            amax_bits = 0;
            for (int c = 0; c < BV; c++) xv[c] = (vf){0};
        }
        float amaxf;
        memcpy(&amaxf, &amax_bits, 4);
        const float d = amaxf / 127.f, id = d > 0.f ? 1.f / d : 0.f;
        vi qsum = {0};
        uint8_t q[QK];
        for (int c = 0; c < BV; c++) {
            const vi qc = roundv(xv[c] * id);
            qsum += qc;
            const u8v bytes = __builtin_convertvector(qc & 255, u8v);
            memcpy(q + c * VL, &bytes, VL);
        }
        const int32_t sum = sumvi(qsum);
        for (int j = 0; j < GROUPS; j++) memcpy(A + (b * GROUPS + j) * width + l, q + 4 * j, 4);
        D[b * width + l] = d;
        Q[b * width + l] = sum;
        T[b * width + l] = d * (float)sum;
    }
    return nonfinite;
}

/* Tile: NRI weight rows from n0 x GM groups of VL activation rows, NRI <= I8_ROWS, GM <= GM_MAX.
   NRI and GM are constants at each call (the arrays stay in registers). */
static inline __attribute__((always_inline)) void tile_i8(
    const uint8_t *w, int64_t row_bytes, int64_t n0, int nr, int64_t nb, const int32_t *A,
    const float *D, const int32_t *Q, const float *T, int NRI, int GM, float *y,
    int64_t ldy, int64_t rows, const float *bias) {
    const int64_t bytes = BLOCK_STEP;
    vf acc[I8_ROWS][GM_MAX];
    for (int r = 0; r < NRI; r++)
        for (int g = 0; g < GM; g++) acc[r][g] = (vf){0};
    const uint8_t *row[I8_ROWS];
    for (int r = 0; r < NRI; r++) row[r] = bt_row(w, n0 + (r < nr ? r : nr - 1), row_bytes);
    for (int64_t b = 0; b < nb; b++) {
        for (int r = 0; r < NRI; r++) __builtin_prefetch(row[r] + b * bytes + PREFETCH);
        vi dot[I8_ROWS][GM_MAX];
        for (int r = 0; r < NRI; r++)
            for (int g = 0; g < GM; g++) dot[r][g] = (vi){0};
        #pragma GCC unroll 8
        for (int j = 0; j < GROUPS; j++)
            for (int r = 0; r < NRI; r++) {
                /* The row's 4 bytes for these values, in every lane (a broadcast load);
                   q4_1's values j and j + 16 share byte j. */
                const uint8_t *p = row[r] + b * bytes;
                int32_t bytes4, qh = 0;
                memcpy(&bytes4, bt_group4(p, j), 4);
                if (BT_QH) memcpy(&qh, p + BT_QH, 4);
                const vi u = bt_weight_bytes((vi){0} + bytes4, (vi){0} + qh, j);
                for (int g = 0; g < GM; g++) {
                    dot[r][g] = dot4w(dot[r][g], u, loadvi(A + ((g * nb + b) * GROUPS + j) * VL));
                    keep_sum(dot[r][g]);
                }
            }
        for (int r = 0; r < NRI; r++)
            for (int g = 0; g < GM; g++) dot[r][g] = block_sum(dot[r][g]);
        for (int g = 0; g < GM; g++) {
            const int64_t gb = (g * nb + b) * VL;
            const vf dx = loadv(D + gb);
            if (BT_MIN) {
                const vf t = loadv(T + gb);
                for (int r = 0; r < NRI; r++) {
                    const uint8_t *p = row[r] + b * bytes;
                    acc[r][g] = fmav(__builtin_convertvector(dot[r][g], vf), dx * splatv(fp16(p)),
                                     fmav(t, splatv(fp16(p + 2)), acc[r][g]));
                }
            } else {
                const vi offset = W_OFFSET ? loadvi(Q + gb) * W_OFFSET : (vi){0};
                for (int r = 0; r < NRI; r++) {
                    const uint8_t *d = bt_scale(row[r] + b * bytes, n0 + (r < nr ? r : nr - 1));
                    acc[r][g] = fmav(__builtin_convertvector(dot[r][g] - offset, vf),
                                     dx * splatv(fp16(d)), acc[r][g]);
                }
            }
        }
    }
    for (int g = 0; g < GM; g++)
        for (int l = 0; l < VL && g * VL + l < rows; l++)
            for (int r = 0; r < nr; r++)
                y[(g * VL + l) * ldy + r] = acc[r][g][l] + (bias ? bias[r] : 0.f);
}

/* The dwords at p of a tile's VL rows as one vector, row i's in lane i (p is in the tile's
   first row, at bt_row(w, n0, rb) + an offset within its block): gathered, one row rb bytes
   from the next; with rows interleaved, plain loads of VL (or BT_ROWS) consecutive dwords. */
static inline __attribute__((always_inline)) vi tile_dwords(const uint8_t *p, int64_t rb) {
#if BT_ROWS == 1
    return gatherv(p, rb);
#else
    _Static_assert(VL <= 2 * BT_ROWS, "a tile's rows are in one or two groups");
    if (VL > BT_ROWS) return join_halves(p, p + BT_ROWS * rb);
    vi v;
    memcpy(&v, p, sizeof v);
    return v;
#endif
}

/* col[c] = dword c of the 16 quant bytes at p (bt_qs) of the tile's rows, as tile_dwords. */
static inline __attribute__((always_inline)) void tile_columns(const uint8_t *p, int64_t rb,
                                                               vi col[4]) {
#if BT_ROWS == 1
    columns4(p, rb, col);
#else
    for (int c = 0; c < 4; c++) col[c] = tile_dwords(p + 4 * BT_ROWS * c, rb);
#endif
}

/* The fp16 d of VL rows kept apart (BT_SCALES), the first one's at p, as floats. */
static inline __attribute__((always_inline)) vf tile_scales(const uint8_t *p, int64_t rb) {
    uint8_t h[2 * VL];
    memcpy(h, p, 2 * (VL < BT_ROWS ? VL : BT_ROWS));
    if (VL > BT_ROWS) memcpy(h + 2 * BT_ROWS, p + BT_ROWS * rb, 2 * BT_ROWS);
    return fp16v(h);
}

/* Tile: VL weight rows (the lanes; from w = bt_row(weight, n0, rb), lane0 = n0 % BT_ROWS)
   x MF activation rows (lanes = MF in A, D, Q, T), MF <= FEW_ROWS_MAX a constant at each
   call; the first nr weight rows are stored. */
static inline __attribute__((always_inline)) void tile_i8_few(
    const uint8_t *w, int lane0, int64_t rb, int nr, int64_t nb, const int32_t *A,
    const float *D, const int32_t *Q, const float *T, int MF, float *y, int64_t ldy,
    const float *bias) {
    const int64_t bytes = BLOCK_STEP;
    const int CH = MF == 1 ? 4 : MF == 2 ? 2 : 1;
    /* The weight side of a block (its scales' gather, its columns) depends on nothing
       computed, but issued in the block it serves, its latency held up that block's dot
       products and float recurrence. So a block's scales (and high bits) are gathered one
       block ahead, and its columns too where the format asks (BT_COLS_AHEAD) and the
       registers allow (4 vectors more beside 2 MF of sums): docs/kernels.md has the figures.
       The last block "gathers ahead" its own scales again (pn = p): nothing is read past the
       weight. */
    const int HALVES = BT_HALVES, AHEAD = BT_COLS_AHEAD && 2 * MF + 8 <= NREGS - 4;
    vf acc[FEW_ROWS_MAX];
    for (int m = 0; m < MF; m++) acc[m] = (vf){0};
    vi dm_next = BT_SCALES ? (vi){0} : tile_dwords(w, rb);
    vi qh_next = BT_QH ? tile_dwords(w + BT_QH, rb) : (vi){0};
    vi cols_next[2][4];
    if (AHEAD)
        for (int h = 0; h < HALVES; h++) tile_columns(w + bt_qs(h), rb, cols_next[h]);
    for (int64_t b = 0; b < nb; b++) {
        const int64_t p = b * bytes, pn = b + 1 < nb ? p + bytes : p;  /* next block's */
        const vi dm = dm_next, qh = qh_next;
        if (!BT_SCALES) dm_next = tile_dwords(w + pn, rb);
        if (BT_QH) qh_next = tile_dwords(w + pn + BT_QH, rb);
        vi cols[2][4];
        for (int h = 0; h < HALVES; h++) {
            if (!AHEAD) {
                tile_columns(w + p + bt_qs(h), rb, cols[h]);
                continue;
            }
            memcpy(cols[h], cols_next[h], sizeof cols[h]);
            tile_columns(w + pn + bt_qs(h), rb, cols_next[h]);
        }
        /* The tile's rows are runs of RUN rb bytes (one run of VL rows; with rows
           interleaved, a group each), read at RUN BT_BYTES bytes per block: the prefetches run
           through them at that pace, into the next tiles (4 PREFETCH ahead, which beat
           PREFETCH ahead: docs/kernels.md). */
        enum { RUN = BT_ROWS == 1 ? VL : BT_ROWS, RUNS = VL > RUN ? VL / RUN : 1 };
        for (int r = 0; r < RUNS; r++)
            for (int64_t i = 0; i < RUN * BT_BYTES; i += 64)
                __builtin_prefetch(w + r * RUN * rb + RUN * b * BT_BYTES + i + 4 * PREFETCH);
        /* CH chains of dot products per row, added at the end (exactly): with one, a row's
           8 dependent dot products per block would bound the time at 1 or 2 rows. From 2
           rows on each chain is kept one (keep_sum), and the groups are unrolled (the
           columns then stay in registers, not in an array indexed at run time): with AVX2,
           2-64 rows took 0.73-0.92x the time (docs/kernels.md). One row's four chains are
           left to the compiler: kept, they ran slower. */
        vi isum[FEW_ROWS_MAX][4];
        for (int m = 0; m < MF; m++)
            for (int c = 0; c < CH; c++) isum[m][c] = (vi){0};
        for (int h = 0; h < HALVES; h++) {
            const vi *col = cols[h];
            #pragma GCC unroll 8
            for (int j = 0; j < GROUPS / HALVES; j++) {
                /* q4_1's values j and j + 16 share byte j */
                const int group = GROUPS / HALVES * h + j;
                const vi u = bt_weight_bytes(col[j & 3], qh, group);
                for (int m = 0; m < MF; m++) {
                    isum[m][group % CH] = dot4w(isum[m][group % CH], u,
                                                (vi){0} + A[(b * GROUPS + group) * MF + m]);
                    if (MF > 1) keep_sum(isum[m][group % CH]);
                }
            }
        }
        for (int m = 0; m < MF; m++) {
            isum[m][0] = block_sum(isum[m][0]);
            for (int c = 1; c < CH; c++) isum[m][0] += block_sum(isum[m][c]);
        }
        const vf d = BT_SCALES ? tile_scales(bt_scale(w + p, lane0), rb) : halves(dm, 0);
        const vf mw = BT_MIN ? halves(dm, 1) : (vf){0};
        for (int m = 0; m < MF; m++) {
            const vf dxd = splatv(D[b * MF + m]) * d;
            if (BT_MIN)
                acc[m] = fmav(__builtin_convertvector(isum[m][0], vf), dxd,
                              fmav(splatv(T[b * MF + m]), mw, acc[m]));
            else
                acc[m] = fmav(__builtin_convertvector(
                                  isum[m][0] - (W_OFFSET ? Q[b * MF + m] * W_OFFSET : 0), vf),
                              dxd, acc[m]);
        }
    }
    for (int m = 0; m < MF; m++) {
        float sums[VL];  /* (indexing acc by r would keep acc in memory throughout) */
        memcpy(sums, &acc[m], sizeof sums);
        for (int r = 0; r < nr; r++) y[m * ldy + r] = sums[r] + (bias ? bias[r] : 0.f);
    }
}

#define TILE_I8(NRI_, GM_) \
    tile_i8(j->w, row_bytes, n0, nr, nb, Am, Dm, Qm, Tm, NRI_, GM_, ym, ldy, M - m0, bn)
/* With 32 registers, two groups of 6 weight rows use 24 (12 products in flight, 12 sums);
   three or four groups at once would run out of registers. With 16, two groups of 3 (1.5x
   faster at 64 rows than one group of 4 on an AVX2 build). A last odd group runs alone. */
#define TILES_I8()                           \
    if (gm == 2) TILE_I8(I8_ROWS, GM_MAX);   \
    else TILE_I8(I8_ROWS, 1);

/* MF beyond FEW_ROWS_MAX never comes (the constant keeps the arrays' bounds). Group g of
   the call's `lanes` rows each but a last, shorter one: its mv rows, mv lanes wide
   (quantize_rows), so 13 rows are groups of 7 and 6, not two of 7 with a row of zeros. */
#define TILE_FEW(MF_)                                                                        \
    tile_i8_few(wn, (int)(n0 % BT_ROWS), row_bytes, nr, nb, j->A + o * GROUPS, j->D + o,    \
                j->Q + o, j->T + o, (MF_) < FEW_ROWS_MAX ? (MF_) : FEW_ROWS_MAX,            \
                j->y + g * lanes * ldy + n0, ldy, bn)
#define TILES_FEW()                      \
    switch (mv) {                        \
        case 1: TILE_FEW(1); break;      \
        case 2: TILE_FEW(2); break;      \
        case 3: TILE_FEW(3); break;      \
        case 4: TILE_FEW(4); break;      \
        case 5: TILE_FEW(5); break;      \
        case 6: TILE_FEW(6); break;      \
        case 7: TILE_FEW(7); break;      \
        case 8: TILE_FEW(8); break;      \
        case 9: TILE_FEW(9); break;      \
        case 10: TILE_FEW(10); break;    \
        case 11: TILE_FEW(11); break;    \
        case 12: TILE_FEW(12); break;    \
        case 13: TILE_FEW(13); break;    \
        case 14: TILE_FEW(14); break;    \
        case 15: TILE_FEW(15); break;    \
        default: TILE_FEW(16);           \
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
    int nri;                  /* weight rows per tile; VL: tile_i8_few */
    const uint8_t *edge;      /* tile_i8_few's last VL rows, when N % VL rows are left:
                                 those, then the last one repeated */
    int32_t *A, *Q;
    float *D, *T;
};

/* The activations quantized, on the calling thread (as transpose_x, and for the same reason).
   How many rows hold values that are not finite. */
static int64_t quantize_rows(const struct job_i8 *j) {
    int64_t nonfinite = 0;
    for (int64_t m = 0; m < j->M; m++) {
        /* A group is `lanes` wide; tile_i8_few's last one only as wide as its rows (tile_i8
           reads VL lanes: its rows past M stay 0). */
        const int64_t g = m / j->lanes, rest = j->M - g * j->lanes;
        const int64_t width = j->M <= GROUPED_ROWS_MAX && rest < j->lanes ? rest : j->lanes;
        nonfinite += quantize_row(j->x + m * j->ldx, j->nb, g, m % j->lanes, j->lanes, width,
                                  j->A, j->D, j->Q, j->T);
    }
    return nonfinite;
}

/* Tiles t0 .. t1 - 1 (nri weight rows each), every group of activation rows. */
static inline __attribute__((always_inline)) void i8_tiles(const struct job_i8 *j, int64_t t0,
                                                           int64_t t1) {
    const int64_t nb = j->nb, row_bytes = j->row_bytes, G = j->G, M = j->M, ldy = j->ldy;
    const int nri = j->nri;
    for (int64_t n0 = t0 * nri; n0 < t1 * nri && n0 < j->N; n0 += nri) {
        const int nr = j->N - n0 < nri ? (int)(j->N - n0) : nri;
        const float *bn = j->bias ? j->bias + n0 : NULL;
        if (M <= GROUPED_ROWS_MAX) {  /* tile_i8_few, G groups of `lanes` rows */
            /* Each group meets the tile's weights, from memory for the first one only (a
               tile is VL rows of K: still cached for the next). */
            const uint8_t *wn = nr < VL ? j->edge : bt_row(j->w, n0, row_bytes);
            const int64_t lanes = j->lanes;
            for (int64_t g = 0; g < G; g++) {
                const int64_t o = g * j->per_group;
                const int mv = (int)(M - g * lanes < lanes ? M - g * lanes : lanes);
                TILES_FEW()
            }
            continue;
        }
        for (int64_t g0 = 0; g0 < G; g0 += GM_MAX) {
            const int64_t m0 = g0 * VL, o = g0 * j->per_group;
            const int32_t *Am = j->A + o * GROUPS, *Qm = j->Q + o;
            const float *Dm = j->D + o, *Tm = j->T + o;
            float *ym = j->y + m0 * ldy + n0;
            const int gm = G - g0 < GM_MAX ? (int)(G - g0) : GM_MAX;
            TILES_I8()
        }
    }
}

static void i8_range(void *c, int64_t b, int64_t e, int t) { (void)t; i8_tiles(c, b, e); }

/* tile_i8_few's tiles per item: 32 weight rows, so a 576-row matmul splits evenly enough
   over 2 threads (TILES_PER_ITEM's 128 rows would give 4.5 items). */
enum { FEW_TILES_PER_ITEM = 32 / VL };

/* As linear_f32, through int8 activations. 0, or -1 without scratch memory. A row
   holding inf or NaN is computed by the fp32 path: quantized, it would be NaN throughout
   (its scale inf), where torch gives +-inf or NaN element by element. Up to GROUPED_ROWS_MAX
   rows take tile_i8_few (past FEW_ROWS_MAX in groups of the same lanes <= SPLIT_ROWS rows,
   the last one maybe shorter), more tile_i8: the same numbers for each row either way (see
   above). */
int32_t BT_FN(linear_i8)(const struct v1_matmul *c) {
    const int64_t N = c->w.rows, K = c->w.cols, M = c->x.rows;
    const uint8_t *w = c->w.data;
    const float *x = c->x.data;
    const int few = M <= GROUPED_ROWS_MAX;
    const int64_t groups = M <= FEW_ROWS_MAX ? 1 : (M + SPLIT_ROWS - 1) / SPLIT_ROWS;
    struct job_i8 j = {.w = w, .N = N, .nb = K / QK, .M = M, .x = x, .ldx = c->x.stride,
                       .bias = c->bias, .y = c->out.data, .ldy = c->out.stride};
    j.row_bytes = c->w.stride;
    j.lanes = few ? (M + groups - 1) / groups : VL;
    j.G = (M + j.lanes - 1) / j.lanes;
    j.per_group = j.nb * j.lanes;
    /* A, then D, Q, T (4-byte elements all); rows past M stay 0. */
    j.A = calloc((size_t)(j.G * j.per_group * (GROUPS + 3)), 4);
    if (!j.A) return -1;
    j.Q = j.A + j.G * j.per_group * GROUPS;
    j.D = (float *)(j.Q + j.G * j.per_group);
    j.T = j.D + j.G * j.per_group;
    j.nri = few ? VL : I8_ROWS;
    uint8_t *edge = NULL;
    if (few && N % VL) {  /* (N is a multiple of BT_ROWS: the bindings check) */
        if (!(edge = malloc((size_t)(VL * j.row_bytes)))) {
            free(j.A);
            return -1;
        }
        const int64_t n0 = N / VL * VL;
        for (int64_t r = 0; r < VL; r += BT_ROWS)  /* a group of rows at a time */
            memcpy(edge + r * j.row_bytes,
                   w + (n0 + r < N ? n0 + r : N - BT_ROWS) * j.row_bytes,
                   (size_t)(BT_ROWS * j.row_bytes));
        j.edge = edge;
    }
    const int64_t nonfinite = quantize_rows(&j);
    v1_parallel_for(c->nthreads, (N + j.nri - 1) / j.nri,
                    few ? FEW_TILES_PER_ITEM : TILES_PER_ITEM, i8_range, &j);
    free(edge);
    free(j.A);
    return nonfinite ? v1_rerun_nonfinite_rows(c, BT_FN(linear_f32)) : 0;
}

/* The whole weight as fp32 out[N, K], for batches big enough that a dense GEMM pays. */
struct job_dq {
    const uint8_t *w;
    int64_t nb;
    float *out;
};

static void dequantize_rows(void *c, int64_t n0, int64_t n1, int thread) {
    const struct job_dq *j = c;
    (void)thread;
    dequant_rows(j->w, j->nb * BT_BYTES, n0, (int)(n1 - n0), (int)(n1 - n0), j->nb * QK,
                 j->out + n0 * j->nb * QK);
}

/* The weight [N, K] into out [N, K] (its stride K); x is not read. */
int32_t BT_FN(dequantize)(const struct v1_matmul *c) {
    struct job_dq j = {.w = c->w.data, .nb = c->w.cols / QK, .out = c->out.data};
    v1_parallel_for(c->nthreads, c->w.rows, 16, dequantize_rows, &j);
    return 0;
}
