/* GGUF bf16 weights, tuned: block_f16.c's kernels, each half the high 16 bits of a float. */
#define HALF_BF16 1
#define HALF_FN(f) block_bf16_##f
#include "block_f16.c"
