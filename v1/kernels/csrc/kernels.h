/* The entry points that another kernel calls too (decoder.c runs a decoder layer's ops in
   one call): declared once here and included where they are defined, so that the compiler
   checks that the definitions and the calls agree. */
#ifndef V1_KERNELS_H
#define V1_KERNELS_H

#include "v1.h"

#include <stdint.h>

struct decode_step;  /* kv_rows.h */

/* elementwise.c */
V1_API void v1_rms_norm(const float *x, int64_t x_row, float *res, int64_t res_row,
                        const float *w, float eps, float *out, int64_t out_row, int64_t rows,
                        int64_t n);
V1_API void v1_rope(float *x, int64_t x_row, int64_t heads, int64_t D, const float *cos,
                    const float *sin, int64_t rows);
V1_API void v1_silu_and_mul(const float *gate_up, int64_t in_row, float *out, int64_t out_row,
                            int64_t rows, int64_t n);

/* quant.c: y[M, N] = x[M, K] @ W[N, K].T (+ bias); 0, or -1 without scratch memory. */
V1_API int32_t v1_q_linear_f32(int32_t kind, const uint8_t *w, int64_t N, int64_t K,
                               const float *x, int64_t ldx, int64_t M, const float *bias,
                               float *y, int64_t ldy, int32_t nthreads);
V1_API int32_t v1_q_linear_i8(int32_t kind, const uint8_t *w, int64_t N, int64_t K,
                              const float *x, int64_t ldx, int64_t M, const float *bias,
                              float *y, int64_t ldy, int32_t nthreads);

/* paged_decode_*.c (paged_decode.h); fp16 only where the compiler targets F16C. */
V1_API void v1_paged_decode_f32(const struct decode_step *step, const float *q, int64_t q_row,
                                int64_t H, const float *k_new, int64_t k_row,
                                const float *v_new, int64_t v_row, float *cache, float scale,
                                float *out, int64_t out_row, float *lse);
V1_API void v1_paged_decode_bf16(const struct decode_step *step, const float *q,
                                 int64_t q_row, int64_t H, const float *k_new, int64_t k_row,
                                 const float *v_new, int64_t v_row, uint16_t *cache,
                                 float scale, float *out, int64_t out_row, float *lse);
#ifdef __F16C__
V1_API void v1_paged_decode_f16(const struct decode_step *step, const float *q, int64_t q_row,
                                int64_t H, const float *k_new, int64_t k_row,
                                const float *v_new, int64_t v_row, uint16_t *cache,
                                float scale, float *out, int64_t out_row, float *lse);
#endif

#endif
