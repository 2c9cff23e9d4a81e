/* The kernel table's rows (block_types.h): one per weight type. */
#include "block_types.h"
#include "vec.h"

#include <stddef.h>

#define KERNELS(PREFIX, TYPE) \
    {PREFIX##_##TYPE##_linear_f32, PREFIX##_##TYPE##_linear_i8, PREFIX##_##TYPE##_dequantize}
/* f16, bf16: no linear_i8 (the fp32 path takes them). */
#define HALF_KERNELS(PREFIX, TYPE) \
    {PREFIX##_##TYPE##_linear_f32, NULL, PREFIX##_##TYPE##_dequantize}

/* q4_1, q8_0, q4_k and q6_k interleaved by 8 rows where that measured faster (AVX2 and
   AVX-512: docs/kernels.md); the SSE2 and NEON builds keep GGUF's layout. q6_k stays in it on
   AVX2 without VNNI: on a Zen 3 EPYC q6_kx8 took up to 2.6x q6_k's time on the 1B shapes,
   ahead only on a small k/v weight at 1 to 4 rows (docs/kernels.md, "Interleaved layouts"). */
#if VL >= 8
#define Q4_1_REPACK "q4_1x8"
#define Q8_0_REPACK "q8_0x8"
#define Q4_K_REPACK "q4_kx8"
#else
#define Q4_1_REPACK NULL
#define Q8_0_REPACK NULL
#define Q4_K_REPACK NULL
#endif
#if VL >= 16 || (VL == 8 && defined(__AVXVNNI__))
#define Q6_K_REPACK "q6_kx8"
#else
#define Q6_K_REPACK NULL
#endif

const struct v1_block_type v1_block_table[] = {
    {"q4_1", 32, 20, 1, Q4_1_REPACK, KERNELS(block, q4_1), KERNELS(ref, q4_1)},
    {"q4_1x8", 32, 20, 8, NULL, KERNELS(block, q4_1x8), KERNELS(ref, q4_1x8)},
    {"q8_0", 32, 34, 1, Q8_0_REPACK, KERNELS(block, q8_0), KERNELS(ref, q8_0)},
    {"q8_0x8", 32, 34, 8, NULL, KERNELS(block, q8_0x8), KERNELS(ref, q8_0x8)},
    {"q4_0", 32, 18, 1, NULL, KERNELS(block, q4_0), KERNELS(ref, q4_0)},
    {"q5_0", 32, 22, 1, NULL, KERNELS(block, q5_0), KERNELS(ref, q5_0)},
    {"q5_1", 32, 24, 1, NULL, KERNELS(block, q5_1), KERNELS(ref, q5_1)},
    {"f16", 1, 2, 1, NULL, HALF_KERNELS(block, f16), HALF_KERNELS(ref, f16)},
    {"bf16", 1, 2, 1, NULL, HALF_KERNELS(block, bf16), HALF_KERNELS(ref, bf16)},
    {"q4_k", 256, 144, 1, Q4_K_REPACK, KERNELS(block, q4_k), KERNELS(ref, q4_k)},
    {"q4_kx8", 256, 144, 8, NULL, KERNELS(block, q4_kx8), KERNELS(ref, q4_kx8)},
    {"q5_k", 256, 176, 1, NULL, KERNELS(block, q5_k), KERNELS(ref, q5_k)},
    {"q6_k", 256, 210, 1, Q6_K_REPACK, KERNELS(block, q6_k), KERNELS(ref, q6_k)},
    {"q6_kx8", 256, 210, 8, NULL, KERNELS(block, q6_kx8), KERNELS(ref, q6_kx8)},
};
const int32_t v1_block_table_size = sizeof v1_block_table / sizeof v1_block_table[0];
