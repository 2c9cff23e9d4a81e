/* The paged decode kernel and the cache write, for one cache dtype: included by
   paged_decode_f32.c, _bf16.c and _f16.c after they define
     KV_T          the cache's element type
     KV_ROW        a K/V row as fp32 (kv_rows.h: row_f32, row_bf16, row_f16)
     STORE_ROW     fp32 values into the cache's dtype (store_f32, store_bf16, store_f16)
     PAGED_DECODE  the entry point's name.
   One translation unit per dtype: in one, three callers of vec8.h's helpers made GCC stop
   inlining them (the fp32 kernel ran 1.3-3x slower). */
#include "kernels.h"
#include "kv_rows.h"
#include "pool.h"

/* The cache write: token i's K/V rows (fp32, row i at k + i * k_row: each row's KVH * D
   values contiguous) into slot step->slots[i] of the cache [2, num_blocks, B, KVH, D],
   converted once into its dtype. Serial: a step writes a few rows per layer, and parallel
   regions cost more than that to start. */
static void kv_write(const struct decode_step *step, const float *k, int64_t k_row,
                     const float *v, int64_t v_row, KV_T *cache) {
    const int64_t row = step->KVH * step->D;
    for (int64_t i = 0; i < step->num_slots; i++) {
        if (step->slots[i] < 0) continue;  /* padding */
        STORE_ROW(cache + step->slots[i] * row, k + i * k_row, row);
        STORE_ROW(cache + step->half + step->slots[i] * row, v + i * v_row, row);
    }
}

/* Paged attention for requests with one query token each (decodes), reading K/V in place.

   q[tok[r] * q_row + h * D + d]                  query of request r, head h (fp32)
   k, v: [num_blocks, B, KVH, D], contiguous      the layer's cache halves (KV_T each)
   table[table_rows[r] * table_row + i]           block of positions [i * B, (i + 1) * B)
   [start[r], end[r])                             the key positions request r attends to
   out[tok[r] * out_row + h * D + d]              the output (fp32)
   lse[tok[r] * H + h] (if lse is not NULL)       logsumexp of the scaled scores

   (all but q, H, the cache, out and lse from the step's `struct decode_step`; with k_new,
   kv_write stores the step's K/V first; without q, that is all.)
   Query head h reads kv head h / (H / KVH). One task per entry: it streams the
   request's blocks once, chunk by chunk (TMAX keys), keeping a running max m, sum l and
   unnormalised output acc per head (the online softmax). Each K/V row of a kv head is
   read as fp32 once (KV_ROW) for the G query heads that use it; all the arithmetic is
   fp32. D must be a multiple of 8. Entries are spread over the pool's threads (pool.h), one
   at a time; a single one runs on the calling thread. */

enum { TMAX = 32 };

/* One call's arguments, for the pool's range function. */
struct decode_call {
    const struct decode_step *step;
    const float *q;
    int64_t q_row, H;
    const KV_T *k, *v;
    float scale;
    float *out;
    int64_t out_row;
    float *lse;
};

static void decode_entries(void *ctx, int64_t r0, int64_t r1, int thread) {
    const struct decode_call *c = ctx;
    const struct decode_step *step = c->step;
    const float *q = c->q, scale = c->scale;
    const int64_t q_row = c->q_row, H = c->H, out_row = c->out_row;
    float *out = c->out, *lse = c->lse;
    const int32_t *table = step->table;
    const int64_t table_row = step->table_row, *table_rows = step->table_rows, *tok = step->tok;
    const int64_t *start = step->start, *end = step->end;
    const int64_t KVH = step->KVH, D = step->D, B = step->B;
    const KV_T *k = c->k, *v = c->v;
    const int64_t G = H / KVH, NV = D / 8, row = KVH * D;
    (void)thread;
    for (int64_t r = r0; r < r1; r++) {
        v8 qv[H][NV], acc[H][NV];
        float m[H], l[H];
        float s[H][TMAX + 8] __attribute__((aligned(32)));
        float wide[D] __attribute__((aligned(32)));  /* a widened K/V row (16-bit caches) */
        const int32_t *blocks = table + table_rows[r] * table_row;
        for (int64_t h = 0; h < H; h++) {
            const float *qp = q + tok[r] * q_row + h * D;
            for (int64_t i = 0; i < NV; i++) {
                qv[h][i] = load8(qp + 8 * i) * scale;
                acc[h][i] = (v8){0};
            }
            m[h] = -FLT_MAX;
            l[h] = 0.f;
        }
        for (int64_t t0 = start[r]; t0 < end[r];) {
            /* The next chunk: row pointers of up to TMAX keys, across block boundaries. */
            const KV_T *kr[TMAX], *vr[TMAX];
            int64_t n = 0;
            while (n < TMAX && t0 + n < end[r]) {
                int64_t t = t0 + n, first = (int64_t)blocks[t / B] * B + t % B;
                int64_t count = B - t % B;
                if (count > end[r] - t) count = end[r] - t;
                if (count > TMAX - n) count = TMAX - n;
                for (int64_t c = 0; c < count; c++) {
                    kr[n + c] = k + (first + c) * row;
                    vr[n + c] = v + (first + c) * row;
                }
                n += count;
            }
            /* Scores s[h][t] = scale * q_h . k_t, each key row loaded once for its heads. */
            for (int64_t t = 0; t < n; t++)
                for (int64_t j = 0; j < KVH; j++) {
                    const float *kp = KV_ROW(kr[t] + j * D, wide, D);
                    for (int64_t h = j * G; h < (j + 1) * G; h++) {
                        v8 a = load8(kp) * qv[h][0];
                        for (int64_t i = 1; i < NV; i++) a += load8(kp + 8 * i) * qv[h][i];
                        s[h][t] = hsum(a);
                    }
                }
            /* Online softmax: new running max, rescale what came before, p = e^(s - m). */
            for (int64_t h = 0; h < H; h++) {
                float mx = m[h];
                for (int64_t t = 0; t < n; t++) mx = s[h][t] > mx ? s[h][t] : mx;
                float correction = expf(m[h] - mx);
                v8 sum = {0};
                for (int64_t t = 0; t < n; t += 8) {
                    v8 p = exp8(load8(&s[h][t]) - mx);
                    store8(&s[h][t], p);
                    if (t + 8 <= n)
                        sum += p;
                    else
                        for (int64_t u = t; u < n; u++) sum[0] += s[h][u];
                }
                l[h] = l[h] * correction + hsum(sum);
                for (int64_t i = 0; i < NV; i++) acc[h][i] *= correction;
                m[h] = mx;
            }
            /* acc_h += p_h[t] * v_t */
            for (int64_t t = 0; t < n; t++)
                for (int64_t j = 0; j < KVH; j++) {
                    const float *vp = KV_ROW(vr[t] + j * D, wide, D);
                    for (int64_t h = j * G; h < (j + 1) * G; h++) {
                        v8 p = {0};
                        p += s[h][t];
                        for (int64_t i = 0; i < NV; i++) acc[h][i] += load8(vp + 8 * i) * p;
                    }
                }
            t0 += n;
        }
        for (int64_t h = 0; h < H; h++) {
            float inv = l[h] > 0.f ? 1.f / l[h] : 0.f;
            float *op = out + tok[r] * out_row + h * D;
            for (int64_t i = 0; i < NV; i++) store8(op + 8 * i, acc[h][i] * inv);
            if (lse) lse[tok[r] * H + h] = l[h] > 0.f ? m[h] + logf(l[h]) : -INFINITY;
        }
    }
}

V1_API void PAGED_DECODE(const struct decode_step *step, const float *q, int64_t q_row,
                         int64_t H, const float *k_new, int64_t k_row, const float *v_new,
                         int64_t v_row, KV_T *cache, float scale, float *out, int64_t out_row,
                         float *lse) {
    if (k_new) kv_write(step, k_new, k_row, v_new, v_row, cache);
    if (!q) return;
    struct decode_call c = {.step = step, .q = q, .q_row = q_row, .H = H, .k = cache,
                            .v = cache + step->half, .scale = scale, .out = out,
                            .out_row = out_row, .lse = lse};
    v1_parallel_for((int)step->nthreads, step->R, 1, decode_entries, &c);
}
