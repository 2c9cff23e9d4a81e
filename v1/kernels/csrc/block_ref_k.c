/* The reference kernels of the K-quant rows (q4_k, q5_k, q6_k): plain C, one value at a time,
   as GGUF defines the superblocks and block_ktiles.h the int8 path. What the tuned kernels
   are tested against (dequantize and the int8 path bit for bit, linear_f32 within rounding).
   Compiled without FMA contraction: each product and sum rounds as written. */
#include "block_types.h"
#include "isa_generic.h"  /* fp16_generic: IEEE half to float in plain C */

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

enum { QK_K = 256, GROUPS = 16 };

/* A superblock read as integers: x_i = (d sc_g) u_i - dmin mw_g with g = i / 16 (q4_k,
   q5_k: mw the min m of the 32 values), or (d sc_g) (u_i - 32) (q6_k, where the int8 path
   takes mw_g = 32 sc_g). */
struct kblock {
    float d, dmin;
    int32_t sc[GROUPS], mw[GROUPS];
    int32_t u[QK_K];
    int min;  /* 1: x = d sc u - dmin m */
};

/* q4_k and q5_k's header: d, dmin, then 12 bytes holding 8 6-bit scales and 8 6-bit mins. */
static void read_header(const uint8_t *p, struct kblock *k) {
    const uint8_t *s = p + 4;
    k->d = fp16_generic(p);
    k->dmin = fp16_generic(p + 2);
    k->min = 1;
    for (int j = 0; j < 8; j++) {
        int sc, m;
        if (j < 4) {
            sc = s[j] & 63;
            m = s[j + 4] & 63;
        } else {
            sc = (s[j + 4] & 15) | (s[j - 4] >> 6) << 4;
            m = (s[j + 4] >> 4) | (s[j] >> 6) << 4;
        }
        k->sc[2 * j] = k->sc[2 * j + 1] = sc;
        k->mw[2 * j] = k->mw[2 * j + 1] = m;
    }
}

/* Value 64 h + l (l < 32) in the low nibble of qs[32 h + l], value 64 h + 32 + l in its high. */
static void read_q4_k(const uint8_t *p, struct kblock *k) {
    read_header(p, k);
    for (int i = 0; i < QK_K; i++) {
        const uint8_t q = p[16 + 32 * (i / 64) + i % 32];
        k->u[i] = i % 64 < 32 ? q & 15 : q >> 4;
    }
}

/* As q4_k (the nibbles at 48), value 32 t + l's fifth bit bit t of qh[l] (at 16). */
static void read_q5_k(const uint8_t *p, struct kblock *k) {
    read_header(p, k);
    for (int i = 0; i < QK_K; i++) {
        const uint8_t q = p[48 + 32 * (i / 64) + i % 32];
        k->u[i] = (i % 64 < 32 ? q & 15 : q >> 4) | ((p[16 + i % 32] >> (i / 32)) & 1) << 4;
    }
}

/* Half h of 128 values: value 32 t + l (t < 4, l < 32) has the low (t < 2) or high nibble of
   ql[64 h + 32 (t % 2) + l] and bits 2 t, 2 t + 1 of qh[32 h + l] above it; scales at 192, d
   at 208. */
static void read_q6_k(const uint8_t *p, struct kblock *k) {
    for (int i = 0; i < QK_K; i++) {
        const int h = i / 128, t = i % 128 / 32, l = i % 32;
        const uint8_t ql = p[64 * h + 32 * (t % 2) + l], qh = p[128 + 32 * h + l];
        k->u[i] = (t < 2 ? ql & 15 : ql >> 4) | ((qh >> (2 * t)) & 3) << 4;
    }
    for (int g = 0; g < GROUPS; g++) {
        k->sc[g] = (int8_t)p[192 + g];
        k->mw[g] = 32 * k->sc[g];
    }
    k->d = fp16_generic(p + 208);
    k->dmin = 0.f;
    k->min = 0;
}

static float value(const struct kblock *k, int i) {
    const int g = i / 16;
    const float f = k->d * (float)k->sc[g];
    return k->min ? f * (float)k->u[i] - k->dmin * (float)k->mw[g] : f * (float)(k->u[i] - 32);
}

struct kformat {
    void (*read)(const uint8_t *p, struct kblock *k);
    int bytes;
    int rows;  /* rows interleaved: dword f of row i of a group's superblock at 4 (rows f + i),
                  its bytes past the last whole dword after the group's dwords, row by row */
};

enum { MAX_BYTES = 210 };

/* Superblock b of row n, its bytes gathered into tmp where rows are interleaved. */
static const uint8_t *superblock(const struct v1_matmul *c, int64_t n, int64_t b,
                                 struct kformat f, uint8_t tmp[MAX_BYTES]) {
    const uint8_t *w = c->w.data;
    if (f.rows == 1) return w + n * c->w.stride + b * f.bytes;
    const uint8_t *g = w + (n - n % f.rows) * c->w.stride + b * f.rows * f.bytes;
    const int i = (int)(n % f.rows), dwords = f.bytes / 4, tail = f.bytes % 4;
    for (int d = 0; d < dwords; d++) memcpy(tmp + 4 * d, g + 4 * (f.rows * d + i), 4);
    memcpy(tmp + 4 * dwords, g + 4 * f.rows * dwords + tail * i, (size_t)tail);
    return tmp;
}

static int32_t dequantize(const struct v1_matmul *c, struct kformat f) {
    for (int64_t n = 0; n < c->w.rows; n++)
        for (int64_t b = 0; b < c->w.cols / QK_K; b++) {
            struct kblock k;
            uint8_t tmp[MAX_BYTES];
            f.read(superblock(c, n, b, f, tmp), &k);
            float *o = (float *)c->out.data + n * c->out.stride + b * QK_K;
            for (int i = 0; i < QK_K; i++) o[i] = value(&k, i);
        }
    return 0;
}

static int32_t linear_f32(const struct v1_matmul *c, struct kformat f) {
    for (int64_t m = 0; m < c->x.rows; m++) {
        const float *x = (const float *)c->x.data + m * c->x.stride;
        float *y = (float *)c->out.data + m * c->out.stride;
        for (int64_t n = 0; n < c->w.rows; n++) {
            float acc = 0.f;
            for (int64_t b = 0; b < c->w.cols / QK_K; b++) {
                struct kblock k;
                uint8_t tmp[MAX_BYTES];
                f.read(superblock(c, n, b, f, tmp), &k);
                for (int i = 0; i < QK_K; i++) acc += value(&k, i) * x[b * QK_K + i];
            }
            y[n] = acc + (c->bias ? c->bias[n] : 0.f);
        }
    }
    return 0;
}

/* The int8 path (block_ktiles.h's definition): per superblock of x, dx = max|x| / 127,
   qx = roundf(x * (1 / dx)), s_g the sum of block g's qx; per weight superblock
   isum = sum_g sc_g (u . qx over block g), imin = sum_g mw_g s_g, and
   acc = fma(isum, dx d, fma(imin, dx (-dmin), acc)) with a min, else
   acc = fma(isum - imin, dx d, acc); y = acc + bias. A row holding inf or NaN takes
   linear_f32. */
static int32_t linear_i8(const struct v1_matmul *c, struct kformat f, v1_block_kernel f32) {
    const int64_t K = c->w.cols, nsb = K / QK_K;
    int32_t *qx = malloc((size_t)K * sizeof *qx), *sums = malloc((size_t)K / 16 * sizeof *sums);
    float *dx = malloc((size_t)nsb * sizeof *dx);
    if (!qx || !sums || !dx) {
        free(qx);
        free(sums);
        free(dx);
        return -1;
    }
    for (int64_t m = 0; m < c->x.rows; m++) {
        const float *x = (const float *)c->x.data + m * c->x.stride;
        float *y = (float *)c->out.data + m * c->out.stride;
        int finite = 1;
        for (int64_t i = 0; i < K; i++) finite &= isfinite(x[i]) != 0;
        if (!finite) continue;  /* linear_f32's, below */
        for (int64_t b = 0; b < nsb; b++) {
            const float *xb = x + b * QK_K;
            float amax = 0.f;
            for (int i = 0; i < QK_K; i++) amax = fabsf(xb[i]) > amax ? fabsf(xb[i]) : amax;
            dx[b] = amax / 127.f;
            const float id = dx[b] > 0.f ? 1.f / dx[b] : 0.f;
            for (int g = 0; g < GROUPS; g++) {
                int32_t s = 0;
                for (int i = 16 * g; i < 16 * g + 16; i++)
                    s += qx[b * QK_K + i] = (int32_t)roundf(xb[i] * id);
                sums[b * GROUPS + g] = s;
            }
        }
        for (int64_t n = 0; n < c->w.rows; n++) {
            float acc = 0.f;
            for (int64_t b = 0; b < nsb; b++) {
                struct kblock k;
                uint8_t tmp[MAX_BYTES];
                f.read(superblock(c, n, b, f, tmp), &k);
                int32_t isum = 0, imin = 0;
                for (int g = 0; g < GROUPS; g++) {
                    int32_t dot = 0;
                    for (int i = 16 * g; i < 16 * g + 16; i++) dot += k.u[i] * qx[b * QK_K + i];
                    isum += k.sc[g] * dot;
                    imin += k.mw[g] * sums[b * GROUPS + g];
                }
                if (k.min)
                    acc = fmaf((float)isum, dx[b] * k.d,
                               fmaf((float)imin, dx[b] * -k.dmin, acc));
                else
                    acc = fmaf((float)(isum - imin), dx[b] * k.d, acc);
            }
            y[n] = acc + (c->bias ? c->bias[n] : 0.f);
        }
    }
    free(qx);
    free(sums);
    free(dx);
    return v1_rerun_nonfinite_rows(c, f32);
}

#define REFERENCE(TYPE, READ, BYTES, ROWS)                                                  \
    int32_t ref_##TYPE##_linear_f32(const struct v1_matmul *c) {                           \
        return linear_f32(c, (struct kformat){READ, BYTES, ROWS});                         \
    }                                                                                      \
    int32_t ref_##TYPE##_linear_i8(const struct v1_matmul *c) {                            \
        return linear_i8(c, (struct kformat){READ, BYTES, ROWS},                           \
                         ref_##TYPE##_linear_f32);                                         \
    }                                                                                      \
    int32_t ref_##TYPE##_dequantize(const struct v1_matmul *c) {                           \
        return dequantize(c, (struct kformat){READ, BYTES, ROWS});                         \
    }
REFERENCE(q4_k, read_q4_k, 144, 1)
REFERENCE(q4_kx8, read_q4_k, 144, 8)
REFERENCE(q5_k, read_q5_k, 176, 1)
REFERENCE(q6_k, read_q6_k, 210, 1)
REFERENCE(q6_kx8, read_q6_k, 210, 8)
