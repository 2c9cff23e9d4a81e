/* The kernel table: per weight type, its block layout and its kernels (tuned for this
   build's ISA, and a plain C reference of each), the one description of the block formats
   that the C dispatch (block_matmul.c, fused_decode_step.c) and the Python bindings
   (v1/kernels/block_matmul.py, which reads it through v1_block_types) both go by. Adding a
   weight type is adding its kernel functions and a row in block_types.c; docs/kernels.md
   says how. */
#ifndef V1_BLOCK_TYPES_H
#define V1_BLOCK_TYPES_H

#include "v1.h"

#include <stdint.h>

/* One call of a block kernel. w: the weight's blocks, rows N, cols K (values, a multiple of
   the type's block_elems), stride the bytes per row (K / block_elems * block_bytes);
   x: fp32 activations [M, K] (stride in floats); bias: fp32 [N] or NULL; out: fp32 [M, N]
   (stride in floats). dequantize reads w and writes out [N, K] (x, bias unused). */
struct v1_matmul {
    struct v1_view w, x;
    const float *bias;
    struct v1_view out;
    int32_t type;      /* the row of the table */
    int32_t nthreads;  /* the worker pool's threads for this call (pool.h) */
};

/* 0; -1 when scratch memory cannot be had. */
typedef int32_t (*v1_block_kernel)(const struct v1_matmul *call);

/* The kernels a type may have: out = x @ W.T (+ bias) through fp32 activations, through
   activations quantized to int8 per block (the same bits for a row whatever M and whichever
   variant: see block_tiles.h), and W itself as fp32. */
enum { V1_LINEAR_F32 = 0, V1_LINEAR_I8 = 1, V1_DEQUANTIZE = 2, V1_KERNEL_COUNT = 3 };

struct v1_block_type {
    const char *name;                          /* GGUF's name of the type, or ours */
    int32_t block_elems, block_bytes;          /* values per block, bytes per block */
    /* Rows whose blocks are stored interleaved (1: GGUF's layout, a row's blocks in a run;
       N is then a multiple of it: block_tiles.h's BT_ROWS). */
    int32_t interleave;
    /* The row whose layout this build's kernels run this type's blocks faster in (the same
       bytes, moved: v1/kernels/block_matmul.py interleaves them at load); NULL: this one. */
    const char *repack;
    v1_block_kernel kernels[V1_KERNEL_COUNT];  /* tuned; NULL: none */
    v1_block_kernel reference[V1_KERNEL_COUNT];/* plain C (block_ref.c); NULL: none */
};

/* The int8 paths' rows of call->x that hold a value that is not finite, each computed again by
   `linear_f32` (the type's; one row a call): quantized, such a row would be NaN throughout
   where torch gives +-inf or NaN element by element. 0, or -1 without scratch memory. */
int32_t v1_rerun_nonfinite_rows(const struct v1_matmul *call, v1_block_kernel linear_f32);

extern const struct v1_block_type v1_block_table[];
extern const int32_t v1_block_table_size;

/* The kernels of each type: block_<type>.c (tuned), block_ref.c (reference). */
int32_t block_q4_1_linear_f32(const struct v1_matmul *call);
int32_t block_q4_1_linear_i8(const struct v1_matmul *call);
int32_t block_q4_1_dequantize(const struct v1_matmul *call);
int32_t block_q8_0_linear_f32(const struct v1_matmul *call);
int32_t block_q8_0_linear_i8(const struct v1_matmul *call);
int32_t block_q8_0_dequantize(const struct v1_matmul *call);
int32_t ref_q4_1_linear_f32(const struct v1_matmul *call);
int32_t ref_q4_1_linear_i8(const struct v1_matmul *call);
int32_t ref_q4_1_dequantize(const struct v1_matmul *call);
int32_t block_q4_1x8_linear_f32(const struct v1_matmul *call);
int32_t block_q4_1x8_linear_i8(const struct v1_matmul *call);
int32_t block_q4_1x8_dequantize(const struct v1_matmul *call);
int32_t ref_q4_1x8_linear_f32(const struct v1_matmul *call);
int32_t ref_q4_1x8_linear_i8(const struct v1_matmul *call);
int32_t ref_q4_1x8_dequantize(const struct v1_matmul *call);
int32_t block_q8_0x8_linear_f32(const struct v1_matmul *call);
int32_t block_q8_0x8_linear_i8(const struct v1_matmul *call);
int32_t block_q8_0x8_dequantize(const struct v1_matmul *call);
int32_t ref_q8_0x8_linear_f32(const struct v1_matmul *call);
int32_t ref_q8_0x8_linear_i8(const struct v1_matmul *call);
int32_t ref_q8_0x8_dequantize(const struct v1_matmul *call);
int32_t ref_q8_0_linear_f32(const struct v1_matmul *call);
int32_t ref_q8_0_linear_i8(const struct v1_matmul *call);
int32_t ref_q8_0_dequantize(const struct v1_matmul *call);
/* q4_0, q5_0, q5_1, f16, bf16 (f16 and bf16: no linear_i8). */
int32_t block_q4_0_linear_f32(const struct v1_matmul *call);
int32_t block_q4_0_linear_i8(const struct v1_matmul *call);
int32_t block_q4_0_dequantize(const struct v1_matmul *call);
int32_t ref_q4_0_linear_f32(const struct v1_matmul *call);
int32_t ref_q4_0_linear_i8(const struct v1_matmul *call);
int32_t ref_q4_0_dequantize(const struct v1_matmul *call);
int32_t block_q5_0_linear_f32(const struct v1_matmul *call);
int32_t block_q5_0_linear_i8(const struct v1_matmul *call);
int32_t block_q5_0_dequantize(const struct v1_matmul *call);
int32_t ref_q5_0_linear_f32(const struct v1_matmul *call);
int32_t ref_q5_0_linear_i8(const struct v1_matmul *call);
int32_t ref_q5_0_dequantize(const struct v1_matmul *call);
int32_t block_q5_1_linear_f32(const struct v1_matmul *call);
int32_t block_q5_1_linear_i8(const struct v1_matmul *call);
int32_t block_q5_1_dequantize(const struct v1_matmul *call);
int32_t ref_q5_1_linear_f32(const struct v1_matmul *call);
int32_t ref_q5_1_linear_i8(const struct v1_matmul *call);
int32_t ref_q5_1_dequantize(const struct v1_matmul *call);
int32_t block_f16_linear_f32(const struct v1_matmul *call);
int32_t block_f16_dequantize(const struct v1_matmul *call);
int32_t ref_f16_linear_f32(const struct v1_matmul *call);
int32_t ref_f16_dequantize(const struct v1_matmul *call);
int32_t block_bf16_linear_f32(const struct v1_matmul *call);
int32_t block_bf16_dequantize(const struct v1_matmul *call);
int32_t ref_bf16_linear_f32(const struct v1_matmul *call);
int32_t ref_bf16_dequantize(const struct v1_matmul *call);
/* The K-quants: block_q<n>_k.c (block_ktiles.h), block_ref_k.c. */
int32_t block_q4_k_linear_f32(const struct v1_matmul *call);
int32_t block_q4_k_linear_i8(const struct v1_matmul *call);
int32_t block_q4_k_dequantize(const struct v1_matmul *call);
int32_t block_q4_kx8_linear_f32(const struct v1_matmul *call);
int32_t block_q4_kx8_linear_i8(const struct v1_matmul *call);
int32_t block_q4_kx8_dequantize(const struct v1_matmul *call);
int32_t block_q5_k_linear_f32(const struct v1_matmul *call);
int32_t block_q5_k_linear_i8(const struct v1_matmul *call);
int32_t block_q5_k_dequantize(const struct v1_matmul *call);
int32_t block_q6_k_linear_f32(const struct v1_matmul *call);
int32_t block_q6_k_linear_i8(const struct v1_matmul *call);
int32_t block_q6_k_dequantize(const struct v1_matmul *call);
int32_t block_q6_kx8_linear_f32(const struct v1_matmul *call);
int32_t block_q6_kx8_linear_i8(const struct v1_matmul *call);
int32_t block_q6_kx8_dequantize(const struct v1_matmul *call);
int32_t ref_q4_k_linear_f32(const struct v1_matmul *call);
int32_t ref_q4_k_linear_i8(const struct v1_matmul *call);
int32_t ref_q4_k_dequantize(const struct v1_matmul *call);
int32_t ref_q4_kx8_linear_f32(const struct v1_matmul *call);
int32_t ref_q4_kx8_linear_i8(const struct v1_matmul *call);
int32_t ref_q4_kx8_dequantize(const struct v1_matmul *call);
int32_t ref_q5_k_linear_f32(const struct v1_matmul *call);
int32_t ref_q5_k_linear_i8(const struct v1_matmul *call);
int32_t ref_q5_k_dequantize(const struct v1_matmul *call);
int32_t ref_q6_k_linear_f32(const struct v1_matmul *call);
int32_t ref_q6_k_linear_i8(const struct v1_matmul *call);
int32_t ref_q6_k_dequantize(const struct v1_matmul *call);
int32_t ref_q6_kx8_linear_f32(const struct v1_matmul *call);
int32_t ref_q6_kx8_linear_i8(const struct v1_matmul *call);
int32_t ref_q6_kx8_dequantize(const struct v1_matmul *call);

#endif
