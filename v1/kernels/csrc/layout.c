/* The layout of every struct an entry point takes, for the bindings: at load they compare
   their ctypes mirrors with it (sizes and offsets), and refuse a library that disagrees
   rather than pass it fields where it reads others. */
#include "block_types.h"
#include "fused_decode_step.h"
#include "kernels.h"

#include <stddef.h>
#include <stdint.h>

/* A field of a struct; field NULL: the struct's whole size. */
struct v1_field {
    const char *type, *field;
    int64_t offset, size;
};

#define STRUCT(T) {#T, NULL, 0, sizeof(struct T)}
#define FIELD(T, F) {#T, #F, offsetof(struct T, F), sizeof(((struct T *)0)->F)}

static const struct v1_field fields[] = {
    STRUCT(v1_view), FIELD(v1_view, data), FIELD(v1_view, rows), FIELD(v1_view, cols),
    FIELD(v1_view, stride),
    STRUCT(v1_matmul), FIELD(v1_matmul, w), FIELD(v1_matmul, x), FIELD(v1_matmul, bias),
    FIELD(v1_matmul, out), FIELD(v1_matmul, type), FIELD(v1_matmul, nthreads),
    STRUCT(v1_block_type), FIELD(v1_block_type, name), FIELD(v1_block_type, block_elems),
    FIELD(v1_block_type, block_bytes), FIELD(v1_block_type, interleave),
    FIELD(v1_block_type, repack), FIELD(v1_block_type, kernels),
    FIELD(v1_block_type, reference),
    STRUCT(paged_decode_step), FIELD(paged_decode_step, table),
    FIELD(paged_decode_step, table_row), FIELD(paged_decode_step, table_rows),
    FIELD(paged_decode_step, tok), FIELD(paged_decode_step, start),
    FIELD(paged_decode_step, end), FIELD(paged_decode_step, R), FIELD(paged_decode_step, slots),
    FIELD(paged_decode_step, num_slots), FIELD(paged_decode_step, KVH),
    FIELD(paged_decode_step, D), FIELD(paged_decode_step, B), FIELD(paged_decode_step, half),
    FIELD(paged_decode_step, nthreads),
    STRUCT(paged_decode_io), FIELD(paged_decode_io, q), FIELD(paged_decode_io, k),
    FIELD(paged_decode_io, v), FIELD(paged_decode_io, out), FIELD(paged_decode_io, lse),
    FIELD(paged_decode_io, cache), FIELD(paged_decode_io, scale),
    STRUCT(decoder_proj), FIELD(decoder_proj, w), FIELD(decoder_proj, bias),
    FIELD(decoder_proj, rows), FIELD(decoder_proj, type),
    STRUCT(decoder_layer), FIELD(decoder_layer, input_norm), FIELD(decoder_layer, post_norm),
    FIELD(decoder_layer, input_eps), FIELD(decoder_layer, post_eps),
    FIELD(decoder_layer, scale), FIELD(decoder_layer, qkv), FIELD(decoder_layer, o),
    FIELD(decoder_layer, gate_up), FIELD(decoder_layer, down),
    STRUCT(decoder_dims), FIELD(decoder_dims, hidden), FIELD(decoder_dims, H),
    FIELD(decoder_dims, KVH), FIELD(decoder_dims, D), FIELD(decoder_dims, I),
    STRUCT(decoder_scratch), FIELD(decoder_scratch, x), FIELD(decoder_scratch, qkv),
    FIELD(decoder_scratch, attn), FIELD(decoder_scratch, h), FIELD(decoder_scratch, gate_up),
    FIELD(decoder_scratch, act), FIELD(decoder_scratch, cos), FIELD(decoder_scratch, sin),
    FIELD(decoder_scratch, group),
    STRUCT(decoder_ends), FIELD(decoder_ends, ids), FIELD(decoder_ends, embed),
    FIELD(decoder_ends, final_norm), FIELD(decoder_ends, final_eps), FIELD(decoder_ends, out),
    FIELD(decoder_ends, head_kernel), FIELD(decoder_ends, head), FIELD(decoder_ends, logits),
    STRUCT(fused_step_call), FIELD(fused_step_call, layers),
    FIELD(fused_step_call, num_layers), FIELD(fused_step_call, dims), FIELD(fused_step_call, T),
    FIELD(fused_step_call, residual), FIELD(fused_step_call, cos), FIELD(fused_step_call, sin),
    FIELD(fused_step_call, positions), FIELD(fused_step_call, max_position),
    FIELD(fused_step_call, step), FIELD(fused_step_call, kv_caches),
    FIELD(fused_step_call, scratch), FIELD(fused_step_call, kv_dtype),
    FIELD(fused_step_call, int8), FIELD(fused_step_call, nthreads),
    FIELD(fused_step_call, ends),
};

V1_API const struct v1_field *v1_layout(int32_t *count) {
    *count = sizeof fields / sizeof fields[0];
    return fields;
}
