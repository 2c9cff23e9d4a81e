/* The fused decode step's structs (fused_decode_step.c; fused_step.py mirrors them). */
#ifndef V1_FUSED_DECODE_STEP_H
#define V1_FUSED_DECODE_STEP_H

#include "kernels.h"

#include <stdint.h>

/* A projection's rows [r, r + rows) (a shard): their blocks [rows, K / block_elems *
   block_bytes] of the kernel table's row `type`, their bias [rows] or NULL. */
struct decoder_proj {
    const uint8_t *w;
    const float *bias;
    int64_t rows;
    int32_t type;
};

/* A projection is up to DECODER_SHARDS shards in row order, the first with rows 0 ending the
   list: one, or a fused projection's parts stored in different types (q | k | v, gate | up). */
enum { DECODER_SHARDS = 3 };

/* One layer (`_Layer` mirrors it): its norms' weights [hidden] and eps, its projections, its
   attention's score scale. */
struct decoder_layer {
    const float *input_norm, *post_norm;
    float input_eps, post_eps, scale;
    struct decoder_proj qkv[DECODER_SHARDS], o[DECODER_SHARDS], gate_up[DECODER_SHARDS],
        down[DECODER_SHARDS];
};

/* The shapes every layer shares. */
struct decoder_dims {
    int64_t hidden, H, KVH, D, I;
};

/* Per-step buffers of T rows each (row strides: their widths): x [hidden] a norm's output,
   qkv [(H + 2 KVH) D], attn [H D], h [hidden] a block's output (o_proj's, then down's),
   gate_up [2 I], act [I], cos and sin [D] (the rows' RoPE tables); and group
   [interleave, hidden], one group of the embedding's rows (NULL without `decoder_ends.ids`). */
struct decoder_scratch {
    float *x, *qkv, *attn, *h, *gate_up, *act, *cos, *sin, *group;
};

/* What runs around the layers in the same call (`_Ends` mirrors it), each part optional.
   ids [T] (NULL: `residual` holds the embeddings on entry): the token ids whose rows of
   `embed` (rows: the vocabulary) become the embeddings. final_norm [hidden] (NULL: no ends
   run): out [T, hidden] = norm(residual + h), the model's last hidden states, residual
   updated. head (one shard, head[1].rows 0), where logits is not NULL: logits
   [T, head[0].rows] = out @ head.T through kernel head_kernel (V1_LINEAR_F32 or
   V1_LINEAR_I8). */
struct decoder_ends {
    const int64_t *ids;
    struct decoder_proj embed;
    const float *final_norm;
    float final_eps;
    float *out;
    int32_t head_kernel;
    struct decoder_proj head[DECODER_SHARDS];
    float *logits;
};

/* One call: the layers on T rows. `residual` [T, hidden] holds the embeddings on entry (or
   gets them from `ends`) and the residual stream before the last layer's block output on
   return; that output is left in scratch->h (the final norm adds the two: the caller's, or
   `ends`' when it has one). cos, sin [max_position, D]: the RoPE tables, row positions[t]
   row t's (positions [T]); `step` the paged decode kernel's bound step (every query row an
   entry of it, its K/V written by it: the step's slots are rows 0 .. num_slots - 1),
   kv_caches[l] layer l's cache of dtype kv_dtype (KV_CODES in fused_step.py). int8: every
   projection through its type's linear_i8, else linear_f32 (the rows' path, from the step
   plan: v1.models.step_plan).
   ends: NULL, or the model's ends around the layers. */
struct fused_step_call {
    const struct decoder_layer *layers;
    int64_t num_layers;
    const struct decoder_dims *dims;
    int64_t T;
    float *residual;
    const float *cos, *sin;
    const int64_t *positions;
    int64_t max_position;
    const struct paged_decode_step *step;
    void *const *kv_caches;
    const struct decoder_scratch *scratch;
    int32_t kv_dtype, int8, nthreads;
    const struct decoder_ends *ends;
};

#endif
