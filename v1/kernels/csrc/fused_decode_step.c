/* Every decoder layer of an all-decode step in one call: the ops of
   v1.models.decoder.PreNormDecoderLayer (pre-norm, silu-gated MLP, no q/k norms, one RoPE
   table, block-quantized projections), each through the same kernel the per-op path calls
   from Python, in the same order and on the same shapes, so the results are the same bits.
   At batch 1 a layer is ~10 calls of a few to ~25 us each, and the Python around them costs
   about as much again; here it is paid once per step. The bindings
   (v1/kernels/fused_step.py) check everything below before the call. */
#include "fused_decode_step.h"
#include "block_types.h"
#include "kernels.h"

#include <stddef.h>
#include <stdint.h>
#include <string.h>

/* The paged decode kernels by cache dtype code: f32, bf16, f16 (none without F16C). */
static const v1_paged_decode_fn paged_decode[] = {
    v1_paged_decode_f32,
    v1_paged_decode_bf16,
#ifdef __F16C__
    v1_paged_decode_f16,
#else
    NULL,
#endif
};
enum { KV_DTYPES = sizeof paged_decode / sizeof paged_decode[0] };

static struct v1_view rows(void *data, int64_t T, int64_t cols) {
    return (struct v1_view){.data = data, .rows = T, .cols = cols, .stride = cols};
}

/* out [T, N] = x [T, K] @ W.T (+ bias), W's shards p[0..] each by its own type's kernel into
   its columns of out (the calls the per-op path makes, one per shard): 0, -1 without scratch
   memory, -3 where a type has no such kernel. */
static int32_t project(const struct decoder_proj *p, int32_t kernel, float *x, int64_t K,
                       float *out, int64_t N, const struct fused_step_call *c) {
    int64_t row = 0;
    for (int s = 0; s < DECODER_SHARDS && p[s].rows; s++) {
        const struct v1_block_type *t = &v1_block_table[p[s].type];
        const v1_block_kernel fn = t->kernels[kernel];
        if (!fn) return -3;
        const struct v1_matmul m = {
            .w = {.data = (void *)p[s].w, .rows = p[s].rows, .cols = K,
                  .stride = K / t->block_elems * t->block_bytes},
            .x = rows(x, c->T, K), .bias = p[s].bias,
            .out = {.data = out + row, .rows = c->T, .cols = p[s].rows, .stride = N},
            .type = p[s].type, .nthreads = c->nthreads};
        const int32_t status = fn(&m);
        if (status) return status;
        row += p[s].rows;
    }
    return 0;
}

/* Each id's row of e->embed into residual [T, n], by the type's dequantize (the kernel the
   per-op lookup calls: an interleaved type's whole group of rows into `group`, then the row).
   0, or the kernel's status. */
static int32_t embed(const struct decoder_ends *e, float *residual, int64_t n, int64_t T,
                     float *group) {
    const struct v1_block_type *t = &v1_block_table[e->embed.type];
    const int64_t R = t->interleave, row_bytes = n / t->block_elems * t->block_bytes;
    for (int64_t i = 0; i < T; i++) {
        const int64_t id = e->ids[i], first = id - id % R;
        float *out = R == 1 ? residual + i * n : group;
        const struct v1_matmul m = {
            .w = {.data = (void *)(e->embed.w + first * row_bytes), .rows = R, .cols = n,
                  .stride = row_bytes},
            .out = rows(out, R, n), .type = e->embed.type, .nthreads = 1};
        const int32_t status = t->kernels[V1_DEQUANTIZE](&m);
        if (status) return status;
        if (R > 1) memcpy(residual + i * n, group + (id - first) * n, n * sizeof(float));
    }
    return 0;
}

/* 0; -1 when a matmul had no scratch memory, -3 when a projection's type lacks the kernel
   (the layers before it are done: the caller gives up on the step); -2 for a cache dtype
   this build has no kernel for, -4 for an id outside the embedding's rows, -5 for a position
   outside the RoPE tables (nothing done). */
V1_API int32_t v1_fused_decode_step(const struct fused_step_call *c) {
    if (c->kv_dtype < 0 || c->kv_dtype >= KV_DTYPES || !paged_decode[c->kv_dtype]) return -2;
    const struct decoder_ends *e = c->ends;
    if (e && e->ids)
        for (int64_t i = 0; i < c->T; i++)
            if (e->ids[i] < 0 || e->ids[i] >= e->embed.rows) return -4;
    for (int64_t i = 0; i < c->T; i++)
        if (c->positions[i] < 0 || c->positions[i] >= c->max_position) return -5;
    const v1_paged_decode_fn decode = paged_decode[c->kv_dtype];
    const struct decoder_scratch *s = c->scratch;
    const int64_t n = c->dims->hidden, H = c->dims->H, KVH = c->dims->KVH, D = c->dims->D;
    const int64_t I = c->dims->I, T = c->T, nqkv = (H + 2 * KVH) * D;
    const int32_t kernel = c->int8 ? V1_LINEAR_I8 : V1_LINEAR_F32;
    const struct v1_view residual = rows(c->residual, T, n), x = rows(s->x, T, n);
    const struct v1_view h = rows(s->h, T, n);
    const struct v1_view gate_up = rows(s->gate_up, T, 2 * I), act = rows(s->act, T, I);
    /* q | k | v as views of qkv: rows nqkv apart. */
    const struct v1_view q = {s->qkv, T, H * D, nqkv}, k = {s->qkv + H * D, T, KVH * D, nqkv};
    const struct v1_view v = {s->qkv + (H + KVH) * D, T, KVH * D, nqkv};
    const struct v1_view q_and_k = {s->qkv, T, (H + KVH) * D, nqkv};
    for (int64_t t = 0; t < T; t++) {  /* the rows' RoPE tables, which every layer reads */
        memcpy(s->cos + t * D, c->cos + c->positions[t] * D, D * sizeof(float));
        memcpy(s->sin + t * D, c->sin + c->positions[t] * D, D * sizeof(float));
    }
    int32_t status;
    if (e && e->ids && (status = embed(e, c->residual, n, T, s->group))) return status;
    for (int64_t l = 0; l < c->num_layers; l++) {
        const struct decoder_layer *y = c->layers + l;
        /* Attention: x = norm(residual += h) (the first layer: norm(residual)), q | k | v,
           RoPE on q and k in place, the kernel stores k and v and attends, o_proj. */
        v1_rms_norm(l ? &h : NULL, &residual, y->input_norm, y->input_eps, &x);
        if ((status = project(y->qkv, kernel, s->x, n, s->qkv, nqkv, c))) return status;
        v1_rope(&q_and_k, D, s->cos, s->sin);
        const struct paged_decode_io io = {.q = q, .k = k, .v = v,
                                           .out = rows(s->attn, T, H * D),
                                           .cache = c->kv_caches[l], .scale = y->scale};
        decode(c->step, &io);
        if ((status = project(y->o, kernel, s->attn, H * D, s->h, n, c))) return status;
        /* MLP: x = norm(residual += h), down(silu(gate) * up). */
        v1_rms_norm(&h, &residual, y->post_norm, y->post_eps, &x);
        if ((status = project(y->gate_up, kernel, s->x, n, s->gate_up, 2 * I, c)))
            return status;
        v1_silu_and_mul(&gate_up, &act);
        if ((status = project(y->down, kernel, s->act, I, s->h, n, c))) return status;
    }
    if (!e || !e->final_norm) return 0;
    v1_rms_norm(&h, &residual, e->final_norm, e->final_eps, &(struct v1_view){e->out, T, n, n});
    return e->logits ? project(e->head, e->head_kernel, e->out, n, e->logits, e->head[0].rows, c)
                     : 0;
}
