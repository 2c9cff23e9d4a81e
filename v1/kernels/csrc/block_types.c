/* The kernel table's rows (block_types.h): one per weight type. */
#include "block_types.h"

#define KERNELS(PREFIX, TYPE) \
    {PREFIX##_##TYPE##_linear_f32, PREFIX##_##TYPE##_linear_i8, PREFIX##_##TYPE##_dequantize}

const struct v1_block_type v1_block_table[] = {
    {"q4_1", 32, 20, KERNELS(block, q4_1), KERNELS(ref, q4_1)},
    {"q8_0", 32, 34, KERNELS(block, q8_0), KERNELS(ref, q8_0)},
};
const int32_t v1_block_table_size = sizeof v1_block_table / sizeof v1_block_table[0];
