/* The entry points that another kernel calls too (fused_decode_step.c runs a decoder layer's
   ops in one call), and the structs they take: declared once here and included where they
   are defined, so that the compiler checks that the definitions and the calls agree. The
   block matmuls are reached through the kernel table (block_types.h). */
#ifndef V1_KERNELS_H
#define V1_KERNELS_H

#include "v1.h"

#include <stdint.h>

/* elementwise.c: fp32 rows, each contiguous, their views' strides apart. */
/* h = res + x (stored back into res; x NULL: h = res), out = w * (h / rms(h)); [rows, n]. */
V1_API void v1_rms_norm(const struct v1_view *x, const struct v1_view *res, const float *w,
                        float eps, const struct v1_view *out);
/* x [rows, heads * D] rotated in place by the RoPE tables cos, sin [rows, D]. */
V1_API void v1_rope(const struct v1_view *x, int64_t D, const float *cos, const float *sin);
/* out [rows, n] = silu(gate) * up, gate_up [rows, 2n] = [gate | up]. */
V1_API void v1_silu_and_mul(const struct v1_view *gate_up, const struct v1_view *out);

/* What the plan fixes for every layer of a step's paged decode (`PagedDecodeStep` mirrors
   it): the kernel's entries, the step's slots, the shapes. */
struct paged_decode_step {
    const int32_t *table;       /* [num_reqs, table_row], the step's block table */
    int64_t table_row;
    const int64_t *table_rows;  /* per entry: its request's row of the table */
    const int64_t *tok;         /* per entry: its query row */
    const int64_t *start;       /* per entry: the key positions [start, end) it attends to */
    const int64_t *end;
    int64_t R;                  /* entries */
    const int64_t *slots;       /* per new token: its flat cache slot; < 0: padding */
    int64_t num_slots;
    int64_t KVH, D, B;
    int64_t half;               /* elements in one cache half: V = K + half */
    int64_t nthreads;           /* threads for the entries (torch's thread count) */
};

/* One layer's call of the paged decode kernel (`PagedDecodeIO` mirrors it): q [T, H D]
   (data NULL: store only), k, v [n, KVH D] (data NULL: nothing to store), out [T, H D] and
   lse [T, H] (NULL: not wanted) fp32, the layer's cache [2, num_blocks, B, KVH, D] in the
   kernel's dtype, the scores' scale. Row strides in floats; H = q.cols / D. */
struct paged_decode_io {
    struct v1_view q, k, v, out;
    float *lse;
    void *cache;
    float scale;
};

/* paged_decode_*.c (paged_decode.h); fp16 only where the compiler targets F16C. */
typedef void (*v1_paged_decode_fn)(const struct paged_decode_step *step,
                                   const struct paged_decode_io *io);
V1_API void v1_paged_decode_f32(const struct paged_decode_step *step,
                                const struct paged_decode_io *io);
V1_API void v1_paged_decode_bf16(const struct paged_decode_step *step,
                                 const struct paged_decode_io *io);
#ifdef __F16C__
V1_API void v1_paged_decode_f16(const struct paged_decode_step *step,
                                const struct paged_decode_io *io);
#endif

#endif
