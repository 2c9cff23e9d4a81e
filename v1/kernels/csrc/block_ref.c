/* The reference kernels of the table: plain C, one value at a time, as the GGUF formats
   define the arithmetic. They are what a tuned kernel is tested against (the int8 path
   bit for bit, the fp32 one within rounding) and what a new type's row can start with. */
#include "block_types.h"

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

enum { QK = 32 };

/* A block read as integers: x_j = d q_j + m, or with no min (`min` 0) x_j = d q_j (+ 0
   would turn d q = -0 into +0). */
struct block_ints {
    float d, m;
    int min;
    int32_t q[QK];
};

/* Value j of a block, rounded as gguf rounds it. */
static float value(const struct block_ints *b, int j) {
    const float x = b->d * (float)b->q[j];
    return b->min ? x + b->m : x;
}

/* IEEE half at p as float (no ISA: F16C converts the same). */
static float half(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    const uint32_t sign = (uint32_t)(h & 0x8000) << 16, e = (h >> 10) & 0x1f, man = h & 0x3ff;
    if (e == 0) {
        const float f = (float)man * 5.9604644775390625e-8f;
        return sign ? -f : f;
    }
    const uint32_t bits = sign | (e == 0x1f ? 0x7f800000u : (e + 112) << 23) | (man << 13);
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

static void read_q4_1(const uint8_t *p, struct block_ints *b) {
    b->d = half(p);
    b->m = half(p + 2);
    b->min = 1;
    for (int j = 0; j < QK / 2; j++) {
        b->q[j] = p[4 + j] & 15;
        b->q[j + QK / 2] = p[4 + j] >> 4;
    }
}

static void read_q8_0(const uint8_t *p, struct block_ints *b) {
    b->d = half(p);
    b->m = 0.f;
    b->min = 0;
    for (int j = 0; j < QK; j++) b->q[j] = (int8_t)p[2 + j];
}

/* q4_0, q5_0, q5_1 after their scale(s): the high bits qh (with 5 bits: bit j is value j's
   16) then the nibbles at qs (value j < 16 the low nibble of byte j, j + 16 its high one);
   q = the 4 or 5 bits - zero. */
static void read_nibbles(const uint8_t *p, struct block_ints *b, int qs, int qh, int zero) {
    uint32_t high = 0;
    if (qh) memcpy(&high, p + qh, 4);
    for (int j = 0; j < QK; j++) {
        const int nibble = j < QK / 2 ? p[qs + j] & 15 : p[qs + j - QK / 2] >> 4;
        b->q[j] = (nibble | (int)(qh ? (high >> j & 1) << 4 : 0)) - zero;
    }
}

static void read_q4_0(const uint8_t *p, struct block_ints *b) {
    b->d = half(p);
    b->m = 0.f;
    b->min = 0;
    read_nibbles(p, b, 2, 0, 8);
}

static void read_q5_0(const uint8_t *p, struct block_ints *b) {
    b->d = half(p);
    b->m = 0.f;
    b->min = 0;
    read_nibbles(p, b, 6, 2, 16);
}

static void read_q5_1(const uint8_t *p, struct block_ints *b) {
    b->d = half(p);
    b->m = half(p + 2);
    b->min = 1;
    read_nibbles(p, b, 8, 4, 0);
}

/* A type's reader and layout: block bytes, rows interleaved (block_tiles.h's BT_ROWS) and
   the block's leading bytes moved past its dwords where interleaved (block_matmul.py's
   LEADING: q8_0x8's d). */
struct block_format {
    void (*read)(const uint8_t *p, struct block_ints *b);
    int bytes, rows, lead;
};

enum { MAX_BYTES = 34 };

/* Row n's block b: in place, or with rows interleaved its bytes gathered into tmp: dword f of
   row i at 4 (rows f + i) from the group's block, then the bytes past them row by row (the
   block's leading ones, or else its last ones). */
static const uint8_t *block_at(const struct v1_matmul *c, int64_t n, int64_t b,
                               struct block_format f, uint8_t tmp[MAX_BYTES]) {
    const uint8_t *w = c->w.data;
    if (f.rows == 1) return w + n * c->w.stride + b * f.bytes;
    const uint8_t *g = w + (n - n % f.rows) * c->w.stride + b * f.rows * f.bytes;
    const int i = (int)(n % f.rows), dwords = (f.bytes - f.lead) / 4;
    const int rest = f.bytes - 4 * dwords, at = f.lead ? 0 : 4 * dwords;
    for (int d = 0; d < dwords; d++) memcpy(tmp + f.lead + 4 * d, g + 4 * (f.rows * d + i), 4);
    memcpy(tmp + at, g + 4 * f.rows * dwords + rest * i, (size_t)rest);
    return tmp;
}

static int32_t dequantize(const struct v1_matmul *c, struct block_format f) {
    const int64_t K = c->w.cols;
    for (int64_t n = 0; n < c->w.rows; n++)
        for (int64_t b = 0; b < K / QK; b++) {
            struct block_ints blk;
            uint8_t tmp[MAX_BYTES];
            f.read(block_at(c, n, b, f, tmp), &blk);
            float *o = (float *)c->out.data + n * c->out.stride + b * QK;
            for (int j = 0; j < QK; j++) o[j] = value(&blk, j);
        }
    return 0;
}

static int32_t linear_f32(const struct v1_matmul *c, struct block_format f) {
    const int64_t K = c->w.cols;
    for (int64_t m = 0; m < c->x.rows; m++) {
        const float *x = (const float *)c->x.data + m * c->x.stride;
        float *y = (float *)c->out.data + m * c->out.stride;
        for (int64_t n = 0; n < c->w.rows; n++) {
            float acc = 0.f;
            for (int64_t b = 0; b < K / QK; b++) {
                struct block_ints blk;
                uint8_t tmp[MAX_BYTES];
                f.read(block_at(c, n, b, f, tmp), &blk);
                for (int j = 0; j < QK; j++) acc += value(&blk, j) * x[b * QK + j];
            }
            y[n] = acc + (c->bias ? c->bias[n] : 0.f);
        }
    }
    return 0;
}

/* The int8 path's definition: per block of 32 activations, dx = max|x| / 127,
   q = roundf(x / dx) (as x * (1 / dx)), then per (row, weight row), over the blocks in order,
   acc = fma(q . qw, dx d, fma(dx sum(q), m, acc)) (m = 0 without a min: the inner fma is then
   acc exactly); y = acc + bias. A row holding inf or NaN takes linear_f32. */
static int32_t linear_i8(const struct v1_matmul *c, struct block_format f, v1_block_kernel f32) {
    const int64_t K = c->w.cols, nb = K / QK;
    /* A row's blocks quantized once (for every weight row): the quants, then per block the
       sum of the quants; dx per block. */
    int32_t *qx = malloc((size_t)(K + nb) * sizeof *qx);
    float *dx = malloc((size_t)nb * sizeof *dx);
    if (!qx || !dx) {
        free(qx);
        free(dx);
        return -1;
    }
    int32_t *sums = qx + K;
    for (int64_t m = 0; m < c->x.rows; m++) {
        const float *x = (const float *)c->x.data + m * c->x.stride;
        float *y = (float *)c->out.data + m * c->out.stride;
        int finite = 1;
        for (int64_t k = 0; k < K; k++) finite &= isfinite(x[k]) != 0;
        if (!finite) continue;  /* linear_f32's, below */
        for (int64_t b = 0; b < nb; b++) {
            const float *xb = x + b * QK;
            float amax = 0.f;
            for (int j = 0; j < QK; j++) amax = fabsf(xb[j]) > amax ? fabsf(xb[j]) : amax;
            dx[b] = amax / 127.f;
            const float id = dx[b] > 0.f ? 1.f / dx[b] : 0.f;
            sums[b] = 0;
            for (int j = 0; j < QK; j++) sums[b] += qx[b * QK + j] = (int32_t)roundf(xb[j] * id);
        }
        for (int64_t n = 0; n < c->w.rows; n++) {
            float acc = 0.f;
            for (int64_t b = 0; b < nb; b++) {
                struct block_ints blk;
                uint8_t tmp[MAX_BYTES];
                f.read(block_at(c, n, b, f, tmp), &blk);
                int32_t isum = 0;
                for (int j = 0; j < QK; j++) isum += blk.q[j] * qx[b * QK + j];
                acc = fmaf((float)isum, dx[b] * blk.d, fmaf(dx[b] * (float)sums[b], blk.m, acc));
            }
            y[n] = acc + (c->bias ? c->bias[n] : 0.f);
        }
    }
    free(qx);
    free(dx);
    return v1_rerun_nonfinite_rows(c, f32);
}

#define REFERENCE(TYPE, READ, BYTES, ROWS, LEAD)                                            \
    int32_t ref_##TYPE##_linear_f32(const struct v1_matmul *c) {                           \
        return linear_f32(c, (struct block_format){READ, BYTES, ROWS, LEAD});              \
    }                                                                                      \
    int32_t ref_##TYPE##_linear_i8(const struct v1_matmul *c) {                            \
        return linear_i8(c, (struct block_format){READ, BYTES, ROWS, LEAD},                \
                         ref_##TYPE##_linear_f32);                                         \
    }                                                                                      \
    int32_t ref_##TYPE##_dequantize(const struct v1_matmul *c) {                           \
        return dequantize(c, (struct block_format){READ, BYTES, ROWS, LEAD});              \
    }
REFERENCE(q4_0, read_q4_0, 18, 1, 0)
REFERENCE(q4_1, read_q4_1, 20, 1, 0)
REFERENCE(q4_1x8, read_q4_1, 20, 8, 0)
REFERENCE(q5_0, read_q5_0, 22, 1, 0)
REFERENCE(q5_1, read_q5_1, 24, 1, 0)
REFERENCE(q8_0, read_q8_0, 34, 1, 0)
REFERENCE(q8_0x8, read_q8_0, 34, 8, 2)

/* f16 and bf16: one value per 2 bytes (`block_elems` 1), any K, converted exactly. */
static float bfloat16(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    const uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

static int32_t dequantize_halves(const struct v1_matmul *c, float (*convert)(const uint8_t *)) {
    for (int64_t n = 0; n < c->w.rows; n++)
        for (int64_t k = 0; k < c->w.cols; k++)
            ((float *)c->out.data)[n * c->out.stride + k] =
                convert((const uint8_t *)c->w.data + n * c->w.stride + 2 * k);
    return 0;
}

static int32_t linear_halves(const struct v1_matmul *c, float (*convert)(const uint8_t *)) {
    for (int64_t m = 0; m < c->x.rows; m++) {
        const float *x = (const float *)c->x.data + m * c->x.stride;
        for (int64_t n = 0; n < c->w.rows; n++) {
            const uint8_t *w = (const uint8_t *)c->w.data + n * c->w.stride;
            float acc = 0.f;
            for (int64_t k = 0; k < c->w.cols; k++) acc += convert(w + 2 * k) * x[k];
            ((float *)c->out.data)[m * c->out.stride + n] = acc + (c->bias ? c->bias[n] : 0.f);
        }
    }
    return 0;
}

int32_t ref_f16_linear_f32(const struct v1_matmul *c) { return linear_halves(c, half); }
int32_t ref_f16_dequantize(const struct v1_matmul *c) { return dequantize_halves(c, half); }
int32_t ref_bf16_linear_f32(const struct v1_matmul *c) { return linear_halves(c, bfloat16); }
int32_t ref_bf16_dequantize(const struct v1_matmul *c) { return dequantize_halves(c, bfloat16); }
