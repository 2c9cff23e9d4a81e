/* The block kernels' entry points: the table itself, and one call of a kernel of it. The
   bindings (v1/kernels/block_matmul.py) check every argument before it gets here. */
#include "block_types.h"
#include "isa.h"

#include <math.h>
#include <stddef.h>
#include <stdint.h>

/* The table and its length, for the bindings. */
V1_API const struct v1_block_type *v1_block_types(int32_t *count) {
    *count = v1_block_table_size;
    return v1_block_table;
}

/* The names of the kernels a row holds, in their order, for the bindings. */
V1_API const char *v1_block_kernel_name(int32_t kernel) {
    static const char *const names[V1_KERNEL_COUNT] = {
        [V1_LINEAR_F32] = "linear_f32", [V1_LINEAR_I8] = "linear_i8",
        [V1_DEQUANTIZE] = "dequantize"};
    return kernel >= 0 && kernel < V1_KERNEL_COUNT ? names[kernel] : NULL;
}

/* Kernel `kernel` of call->type's row (its reference if `reference`): its result, or -2
   where the row has no such kernel. */
V1_API int32_t v1_block_run(int32_t kernel, int32_t reference, const struct v1_matmul *call) {
    const struct v1_block_type *t = &v1_block_table[call->type];
    const v1_block_kernel fn = reference ? t->reference[kernel] : t->kernels[kernel];
    return fn ? fn(call) : -2;
}

/* Which integer dot product the int8 path compiled to: INT8_ISA (isa.h). */
V1_API int32_t v1_block_int8_isa(void) { return INT8_ISA; }

int32_t v1_rerun_nonfinite_rows(const struct v1_matmul *call, v1_block_kernel linear_f32) {
    const int64_t K = call->x.cols;
    for (int64_t m = 0; m < call->x.rows; m++) {
        const float *xm = (const float *)call->x.data + m * call->x.stride;
        int64_t k = 0;
        while (k < K && isfinite(xm[k])) k++;
        if (k == K) continue;
        struct v1_matmul row = *call;
        row.x.data = (void *)xm;
        row.x.rows = row.out.rows = 1;
        row.out.data = (float *)call->out.data + m * call->out.stride;
        if (linear_f32(&row)) return -1;
    }
    return 0;
}
