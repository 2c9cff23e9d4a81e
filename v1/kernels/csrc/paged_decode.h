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

#include <stdlib.h>
#include <string.h>

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
   Query head h reads kv head h / (H / KVH). An entry's keys are cut into parts of PART_KEYS
   (the last shorter), one task each: a task streams its keys once, chunk by chunk (TMAX
   keys), keeping a running max m, sum l and unnormalised output acc per head (the online
   softmax). Each K/V row of a kv head is read as fp32 once (KV_ROW) for the G query heads
   that use it; all the arithmetic is fp32. Scores are taken 8 keys at a time and reduced
   together (hsum8), each key's by the same tree whatever its place in the chunk. An entry of one part is written by its task; the
   parts of a longer one are merged after all tasks, in part order. The cut depends on the
   entry's own keys only, never on the other entries or the thread count, so an entry's
   result is the same bits in any step (a batch-1 decode, a verify step's rows, a batch):
   parts are what lets one long decode use every thread. D must be a multiple of 8. Tasks
   are spread over the pool's threads (pool.h). */

enum { TMAX = 32, PART_KEYS = 128 };

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
    /* NULL: one task per entry (no entry has more than PART_KEYS keys, or no scratch).
       Else per task: its entry, its part, and its partial m[H], l[H], acc[H D]. */
    const int64_t *task_entry, *task_part;
    float *partial;
};

static inline int64_t entry_parts(int64_t keys) {
    return keys <= PART_KEYS ? 1 : (keys + PART_KEYS - 1) / PART_KEYS;
}

/* rows[t] for t in [0, n) (n <= TMAX): kv head j's row of key t as fp32 (16-bit caches
   widened into wide[t * D ...]), then up to a multiple of 8 more, all key 0's row: a group
   of 8 keys reads valid rows whatever n is, and its extra lanes are never used. */
static inline void chunk_rows(const KV_T *const *kv, int64_t n, int64_t j, int64_t D, float *wide,
                              const float **rows) {
    for (int64_t t = 0; t < n; t++) rows[t] = KV_ROW(kv[t] + j * D, wide + t * D, D);
    for (int64_t t = n; t % 8; t++) rows[t] = rows[0];
}

/* acc[0..W) += sum over t < n of p[t] * rows[t][8 (off + i) ...], in key order: W <= 8
   (a constant where inlined) vectors kept in registers across the chunk's keys. */
static inline __attribute__((always_inline)) void pv_tile(v8 *acc, const float *const *rows,
                                                          const float *p, int64_t n,
                                                          int64_t off, int W) {
    v8 a[8];
    for (int i = 0; i < W; i++) a[i] = acc[i];
    for (int64_t t = 0; t < n; t++) {
        const v8 pt = splat(p[t]);
        for (int i = 0; i < W; i++) a[i] += load8(rows[t] + 8 * (off + i)) * pt;
    }
    for (int i = 0; i < W; i++) acc[i] = a[i];
}

/* The online softmax of entry r's query over keys [t_begin, t_end): m[h], l[h] and
   acc[h * NV + i] (unnormalised), from m = -FLT_MAX, l = 0, acc = 0. */
static void attend(const struct decode_call *c, int64_t r, int64_t t_begin, int64_t t_end,
                   float *m, float *l, v8 *acc) {
    const struct decode_step *step = c->step;
    const int64_t H = c->H, KVH = step->KVH, D = step->D, B = step->B;
    const int64_t G = H / KVH, NV = D / 8, row = KVH * D;
    const KV_T *k = c->k, *v = c->v;
    v8 qv[H][NV];
    float s[H][TMAX + 8] __attribute__((aligned(32)));
    float wide[TMAX * D] __attribute__((aligned(32)));  /* a chunk's K/V rows (16-bit caches) */
    const float *rows[TMAX + 8];
    const int32_t *blocks = step->table + step->table_rows[r] * step->table_row;
    for (int64_t h = 0; h < H; h++) {
        const float *qp = c->q + step->tok[r] * c->q_row + h * D;
        for (int64_t i = 0; i < NV; i++) {
            qv[h][i] = load8(qp + 8 * i) * c->scale;
            acc[h * NV + i] = (v8){0};
        }
        m[h] = -FLT_MAX;
        l[h] = 0.f;
    }
    for (int64_t t0 = t_begin; t0 < t_end;) {
        /* The next chunk: row pointers of up to TMAX keys, across block boundaries. */
        const KV_T *kr[TMAX], *vr[TMAX];
        int64_t n = 0;
        while (n < TMAX && t0 + n < t_end) {
            int64_t t = t0 + n, first = (int64_t)blocks[t / B] * B + t % B;
            int64_t count = B - t % B;
            if (count > t_end - t) count = t_end - t;
            if (count > TMAX - n) count = TMAX - n;
            for (int64_t i = 0; i < count; i++) {
                kr[n + i] = k + (first + i) * row;
                vr[n + i] = v + (first + i) * row;
            }
            n += count;
        }
        /* Scores s[h][t] = scale * q_h . k_t, 8 keys at a time: 8 running vectors, reduced
           together (hsum8). Lanes past n hold key 0's score again (chunk_rows). */
        for (int64_t j = 0; j < KVH; j++) {
            chunk_rows(kr, n, j, D, wide, rows);
            for (int64_t h = j * G; h < (j + 1) * G; h++)
                for (int64_t t = 0; t < n; t += 8) {
                    v8 a[8];
                    for (int u = 0; u < 8; u++) {
                        a[u] = load8(rows[t + u]) * qv[h][0];
                        for (int64_t i = 1; i < NV; i++) a[u] += load8(rows[t + u] + 8 * i) * qv[h][i];
                    }
                    store8(&s[h][t], hsum8(a));
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
            for (int64_t i = 0; i < NV; i++) acc[h * NV + i] *= correction;
            m[h] = mx;
        }
        /* acc_h += p_h[t] * v_t, in key order, 8 of acc_h's vectors in registers at a time. */
        for (int64_t j = 0; j < KVH; j++) {
            chunk_rows(vr, n, j, D, wide, rows);
            for (int64_t h = j * G; h < (j + 1) * G; h++) {
                int64_t i = 0;
                for (; i + 8 <= NV; i += 8) pv_tile(acc + h * NV + i, rows, s[h], n, i, 8);
                for (; i < NV; i++) pv_tile(acc + h * NV + i, rows, s[h], n, i, 1);
            }
        }
        t0 += n;
    }
}

/* Entry r's output and lse from its m, l and acc. */
static void finish(const struct decode_call *c, int64_t r, const float *m, const float *l,
                   const v8 *acc) {
    const int64_t H = c->H, NV = c->step->D / 8, tok = c->step->tok[r];
    for (int64_t h = 0; h < H; h++) {
        float inv = l[h] > 0.f ? 1.f / l[h] : 0.f;
        float *op = c->out + tok * c->out_row + h * NV * 8;
        for (int64_t i = 0; i < NV; i++) store8(op + 8 * i, acc[h * NV + i] * inv);
        if (c->lse) c->lse[tok * H + h] = l[h] > 0.f ? m[h] + logf(l[h]) : -INFINITY;
    }
}

static void decode_tasks(void *ctx, int64_t t0, int64_t t1, int thread) {
    const struct decode_call *c = ctx;
    const struct decode_step *step = c->step;
    const int64_t H = c->H, NV = step->D / 8;
    (void)thread;
    for (int64_t t = t0; t < t1; t++) {
        float m[H], l[H];
        v8 acc[H * NV];
        const int64_t r = c->task_entry ? c->task_entry[t] : t;
        if (!c->task_entry || entry_parts(step->end[r] - step->start[r]) == 1) {
            attend(c, r, step->start[r], step->end[r], m, l, acc);  /* the entry whole */
            finish(c, r, m, l, acc);
            continue;
        }
        const int64_t begin = step->start[r] + c->task_part[t] * PART_KEYS;
        const int64_t stop = begin + PART_KEYS < step->end[r] ? begin + PART_KEYS : step->end[r];
        float *p = c->partial + t * H * (2 + NV * 8);
        attend(c, r, begin, stop, p, p + H, acc);
        memcpy(p + 2 * H, acc, sizeof(acc));
    }
}

/* The parts of entry r (tasks first .. first + parts - 1) into one: m = max m_p,
   l = sum l_p e^(m_p - m), acc = sum acc_p e^(m_p - m), in part order. */
static void merge_parts(const struct decode_call *c, int64_t r, int64_t first, int64_t parts) {
    const int64_t H = c->H, NV = c->step->D / 8, stride = H * (2 + NV * 8);
    float m[H], l[H];
    v8 acc[H * NV];
    for (int64_t h = 0; h < H; h++) {
        float mx = -FLT_MAX;
        for (int64_t p = 0; p < parts; p++) {
            const float mp = c->partial[(first + p) * stride + h];
            mx = mp > mx ? mp : mx;
        }
        float sum = 0.f;
        v8 a[NV];
        for (int64_t i = 0; i < NV; i++) a[i] = (v8){0};
        for (int64_t p = 0; p < parts; p++) {
            const float *part = c->partial + (first + p) * stride;
            const float w = expf(part[h] - mx);
            sum += part[H + h] * w;
            for (int64_t i = 0; i < NV; i++) a[i] += load8(part + 2 * H + (h * NV + i) * 8) * w;
        }
        m[h] = mx;
        l[h] = sum;
        for (int64_t i = 0; i < NV; i++) acc[h * NV + i] = a[i];
    }
    finish(c, r, m, l, acc);
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
    int64_t tasks = 0;
    for (int64_t r = 0; r < step->R; r++) tasks += entry_parts(step->end[r] - step->start[r]);
    int64_t *task_entry = NULL;
    if (tasks > step->R) {
        /* Without scratch, whole entries on one thread each: the same as one part each, but
           for entries past PART_KEYS the sums run in another order. */
        task_entry = malloc((size_t)tasks * 2 * sizeof(int64_t));
        c.partial = malloc((size_t)tasks * (size_t)(H * (2 + step->D)) * sizeof(float));
        if (!task_entry || !c.partial) {
            free(task_entry);
            free(c.partial);
            task_entry = NULL;
            c.partial = NULL;
        }
    }
    if (!task_entry) {
        v1_parallel_for((int)step->nthreads, step->R, 1, decode_tasks, &c);
        return;
    }
    int64_t *task_part = task_entry + tasks;
    for (int64_t r = 0, t = 0; r < step->R; r++)
        for (int64_t p = 0, n = entry_parts(step->end[r] - step->start[r]); p < n; p++, t++) {
            task_entry[t] = r;
            task_part[t] = p;
        }
    c.task_entry = task_entry;
    c.task_part = task_part;
    v1_parallel_for((int)step->nthreads, tasks, 1, decode_tasks, &c);
    for (int64_t r = 0, t = 0; r < step->R; r++) {
        const int64_t n = entry_parts(step->end[r] - step->start[r]);
        if (n > 1) merge_parts(&c, r, t, n);
        t += n;
    }
    free(task_entry);
    free(c.partial);
}
