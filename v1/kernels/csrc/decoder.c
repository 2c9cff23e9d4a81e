/* Every decoder layer of an all-decode step in one call: the ops of
   v1.models.decoder.PreNormDecoderLayer (pre-norm, silu-gated MLP, no q/k norms, one RoPE
   table, block-quantized projections), each through the same entry point the per-op path
   calls from Python, in the same order and on the same shapes, so the results are the same
   bits. At batch 1 a layer is ~10 calls of a few to ~25 us each, and Python's modules,
   checks and ctypes conversions around them took about as long again (issue 22); here they
   are paid once per step. The bindings (v1/kernels/decoder.py) check everything below
   before the call. */
#include "kernels.h"
#include "kv_rows.h"

#include <stddef.h>
#include <stdint.h>

/* One projection: its blocks [N, K / 32 * block bytes] (quant.c's kind), its bias [N] or
   NULL. */
struct decoder_proj {
    const uint8_t *w;
    const float *bias;
    int32_t kind;
};

/* One layer (`LayerStruct` mirrors it): its norms' weights [hidden] and eps, its
   projections, its attention's score scale. */
struct decoder_layer {
    const float *input_norm, *post_norm;
    float input_eps, post_eps, scale;
    struct decoder_proj qkv, o, gate_up, down;
};

/* The shapes every layer shares. */
struct decoder_dims {
    int64_t hidden, H, KVH, D, I;
};

/* Per-step buffers of T rows each (row strides: their widths): x [hidden] a norm's output,
   qkv [(H + 2 KVH) D], attn [H D], h [hidden] a block's output (o_proj's, then down's),
   gate_up [2 I], act [I]. */
struct decoder_scratch {
    float *x, *qkv, *attn, *h, *gate_up, *act;
};

enum { KV_F32 = 0, KV_BF16 = 1, KV_F16 = 2 };  /* v1.kernels.decoder.KV_CODES */

/* Whether this build has the paged decode kernel of a cache dtype. */
static int has_decode(int32_t kv_dtype) {
#ifdef __F16C__
    if (kv_dtype == KV_F16) return 1;
#endif
    return kv_dtype == KV_F32 || kv_dtype == KV_BF16;
}

/* The paged decode kernel of the cache's dtype (one has_decode accepts): stores the step's
   k, v rows, then attends q into out. */
static void decode(int32_t kv_dtype, const struct decode_step *step, const float *q,
                   int64_t q_row, int64_t H, const float *k, const float *v, int64_t kv_row,
                   void *cache, float scale, float *out, int64_t out_row) {
    switch (kv_dtype) {
    case KV_F32:
        v1_paged_decode_f32(step, q, q_row, H, k, kv_row, v, kv_row, cache, scale, out,
                            out_row, NULL);
        break;
    case KV_BF16:
        v1_paged_decode_bf16(step, q, q_row, H, k, kv_row, v, kv_row, cache, scale, out,
                             out_row, NULL);
        break;
#ifdef __F16C__
    case KV_F16:
        v1_paged_decode_f16(step, q, q_row, H, k, kv_row, v, kv_row, cache, scale, out,
                            out_row, NULL);
        break;
#endif
    }
}

/* The layers on T rows: `residual` [T, hidden] holds the embeddings on entry and the
   residual stream before the last layer's block output on return; that output is left in
   scratch->h (the caller's final norm adds the two). cos, sin [T, D] per row (the RoPE
   tables), `step` the paged decode kernel's bound step (every query row an entry of it, its
   K/V written by it: the step's slots are rows 0 .. num_slots - 1), kv_caches[l] layer l's
   cache. int8: every projection through v1_q_linear_i8, else v1_q_linear_f32 (the rows'
   path, v1.models.layers.quant.path_for_rows). 0; -1 when a matmul had no scratch memory (the
   layers before it are done: the caller gives up on the step); -2 for a cache dtype this
   build has no kernel for (nothing done). */
V1_API int32_t v1_decoder_decode(const struct decoder_layer *layers, int64_t L,
                                 const struct decoder_dims *dims, int64_t T, float *residual,
                                 const float *cos, const float *sin,
                                 const struct decode_step *step, void *const *kv_caches,
                                 int32_t kv_dtype, const struct decoder_scratch *s,
                                 int32_t int8, int32_t nthreads) {
    if (!has_decode(kv_dtype)) return -2;
    const int64_t n = dims->hidden, H = dims->H, KVH = dims->KVH, D = dims->D, I = dims->I;
    const int64_t nqkv = (H + 2 * KVH) * D;
    int32_t (*const linear)(int32_t, const uint8_t *, int64_t, int64_t, const float *,
                            int64_t, int64_t, const float *, float *, int64_t, int32_t) =
        int8 ? v1_q_linear_i8 : v1_q_linear_f32;
    for (int64_t l = 0; l < L; l++) {
        const struct decoder_layer *y = layers + l;
        /* Attention: x = norm(residual += h) (the first layer: norm(residual)), q | k | v,
           RoPE on q and k in place, the kernel stores k and v and attends, o_proj. */
        v1_rms_norm(l ? s->h : NULL, n, residual, n, y->input_norm, y->input_eps, s->x, n, T,
                    n);
        if (linear(y->qkv.kind, y->qkv.w, nqkv, n, s->x, n, T, y->qkv.bias, s->qkv, nqkv,
                   nthreads))
            return -1;
        v1_rope(s->qkv, nqkv, H + KVH, D, cos, sin, T);
        decode(kv_dtype, step, s->qkv, nqkv, H, s->qkv + H * D, s->qkv + (H + KVH) * D, nqkv,
               kv_caches[l], y->scale, s->attn, H * D);
        if (linear(y->o.kind, y->o.w, n, H * D, s->attn, H * D, T, y->o.bias, s->h, n,
                   nthreads))
            return -1;
        /* MLP: x = norm(residual += h), down(silu(gate) * up). */
        v1_rms_norm(s->h, n, residual, n, y->post_norm, y->post_eps, s->x, n, T, n);
        if (linear(y->gate_up.kind, y->gate_up.w, 2 * I, n, s->x, n, T, y->gate_up.bias,
                   s->gate_up, 2 * I, nthreads))
            return -1;
        v1_silu_and_mul(s->gate_up, 2 * I, s->act, I, T, I);
        if (linear(y->down.kind, y->down.w, n, I, s->act, I, T, y->down.bias, s->h, n,
                   nthreads))
            return -1;
    }
    return 0;
}
