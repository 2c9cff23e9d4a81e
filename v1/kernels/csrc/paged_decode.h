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
static void kv_write(const struct paged_decode_step *step, const float *k, int64_t k_row,
                     const float *v, int64_t v_row, KV_T *cache) {
    const int64_t row = step->KVH * step->D;
    for (int64_t i = 0; i < step->num_slots; i++) {
        if (step->slots[i] < 0) continue;  /* padding */
        STORE_ROW(cache + step->slots[i] * row, k + i * k_row, row);
        STORE_ROW(cache + step->half + step->slots[i] * row, v + i * v_row, row);
    }
}

/* Paged attention for requests with one query token each (decodes), reading K/V in place.

   q[tok[r] * q_row + h * D + d]                  query of entry r, head h (fp32)
   k, v: [num_blocks, B, KVH, D], contiguous      the layer's cache halves (KV_T each)
   table[table_rows[r] * table_row + i]           block of positions [i * B, (i + 1) * B)
   [start[r], end[r])                             the key positions entry r attends to
   out[tok[r] * out_row + h * D + d]              the output (fp32)
   lse[tok[r] * H + h] (if lse is not NULL)       logsumexp of the scaled scores

   (q, out, lse, the cache and the scale from `struct paged_decode_io`, the rest from the
   step's `struct paged_decode_step`; with k, kv_write stores the step's K/V first; without
   q, that is all.)

   Query head h reads kv head h / (H / KVH). An entry's keys are cut into parts of PART_KEYS
   from its start (the last shorter); within a part, its keys go chunk by chunk (TMAX keys),
   keeping a running max m, sum l and unnormalised output acc per head (the online softmax).
   All the arithmetic is fp32.

   Consecutive entries of one table row and start (a verify step's rows: a generated token and
   its drafts, ends one apart) form a group of up to group_rows() entries, and a task is one part
   of a group: each chunk's K/V rows are gathered (and widened, KV_ROW) once for the group's
   rows, and a key row loaded once scores two queries. The parts of a group line up (they are cut
   from the same start), and so do the chunks of a part, so each entry sees the same chunks in a
   group as alone: its own, the last cut at its end. Every value an entry computes follows the
   same operations in the same order whatever else its task or call holds: a score is 8 FMA lanes
   reduced by hsum8's fixed tree (AVX-512: 16 folded to 8); the chunk's max over the entry's keys
   only; p.v summed in key order. An entry of one part is written by its task; the parts of a
   longer one are merged after all tasks, in part order. So an entry's result is the same bits in
   any step (a batch-1 decode, a verify step's rows, a batch) and at any thread count: parts are
   what lets one long decode use every thread. A call of fewer tasks than threads (a lone decode
   of up to PART_KEYS keys is one) runs each task as one per kv head instead, which computes each
   head as the whole task does. D must be a multiple of 8. Tasks are spread over the pool's
   threads (pool.h).

       entries  r0 r1 r2 (one request: a token and 2 drafts; end = e, e + 1, e + 2)
       keys     | part 0: 128 | part 1: 128 | part 2: e - 256 + (0, 1, 2) |
       tasks    (group, part 0)  (group, part 1)  (group, part 2)  -> merge r0, r1, r2 */

enum { TMAX = 32, PART_KEYS = 128, GROUP_ROWS = 8, GROUP_FLOATS = 8192 };

/* The most entries a group holds: a task keeps each one's query and sums (2 H D floats) on
   its thread's stack. */
static inline int64_t group_rows(int64_t H, int64_t D) {
    const int64_t n = GROUP_FLOATS / (H * D);
    return n < 1 ? 1 : n > GROUP_ROWS ? GROUP_ROWS : n;
}

/* Entry r's parts: its keys cut into PART_KEYS from its start (an empty entry has one). */
static inline int64_t entry_parts(const struct paged_decode_step *step, int64_t r) {
    const int64_t keys = step->end[r] - step->start[r];
    return keys <= PART_KEYS ? 1 : (keys + PART_KEYS - 1) / PART_KEYS;
}

/* One call's arguments, for the pool's range function. */
struct decode_call {
    const struct paged_decode_step *step;
    const float *q;
    int64_t q_row, H;
    const KV_T *k, *v;
    float scale;
    float *out;
    int64_t out_row;
    float *lse;
    /* NULL (no scratch): each entry a group of its own and a task, whole. Else group i is
       entries [group_first[i], group_first[i + 1]); task t is part task_part[t] of group
       task_group[t]; an entry of several parts keeps part p's m[H], l[H], acc[H D] at
       partial + (partial_at[r] + p) * H (2 + D). */
    const int64_t *group_first, *task_group, *task_part, *partial_at;
    float *partial;
    /* Each (group, part) is this many tasks, one per range of KVH / heads_split kv heads
       (1 or KVH: see PAGED_DECODE); a head's arithmetic is the same in any range. */
    int64_t heads_split;
};

/* rows[t] for t in [0, n) (n <= TMAX): kv head j's row of key t as fp32 (16-bit caches
   widened into wide[t * D ...]), then up to a multiple of 8 more, all key 0's row: a group
   of 8 keys reads valid rows whatever n is, and its extra lanes are never used. */
static inline void chunk_rows(const KV_T *const *kv, int64_t n, int64_t j, int64_t D, float *wide,
                              const float **rows) {
    for (int64_t t = 0; t < n; t++) rows[t] = KV_ROW(kv[t] + j * D, wide + t * D, D);
    for (int64_t t = n; t % 8; t++) rows[t] = rows[0];
}

/* The tiles below keep their sums in registers: a score tile 8 per query, a p.v tile W per
   query. Two queries at a time (each row loaded once for both) need 16 sums and more beside:
   with 16 registers they spilled, so there scores take one query at a time and p.v tiles
   4 vectors (a verify step's 2-13 rows attended in 0.92-0.95x the time on Zen 3:
   docs/kernels.md). A score's or an output's arithmetic is the same either way. */
enum { SCORE_QN = V8_REGS >= 32 ? 2 : 1, PV_W = V8_REGS >= 32 ? 8 : 4 };

#if defined(__AVX512F__)
typedef float v16 __attribute__((vector_size(64)));

/* score_tile's scores with AVX-512 where D is a multiple of 16: per query and key a 16-lane
   chain over the dimensions, lanes l and l + 8 then added and the 8 keys' vectors reduced by
   hsum8. Other bits than the 8-lane chains, and again the same for an entry whatever else
   its call computes; half the FMAs. */
static inline __attribute__((always_inline)) void score_tile16(const v8 *const *q, float *const *s,
                                                               int QN, const float *const *rows,
                                                               int64_t n, int64_t NV) {
    for (int64_t t = 0; t < n; t += 8) {
        v16 a[2][8], k, qx;
        for (int u = 0; u < 8; u++) {
            __builtin_memcpy(&k, rows[t + u], 64);
            for (int x = 0; x < QN; x++) {
                __builtin_memcpy(&qx, q[x], 64);
                a[x][u] = k * qx;
            }
        }
        for (int64_t i = 1; i < NV / 2; i++)
            for (int u = 0; u < 8; u++) {
                __builtin_memcpy(&k, rows[t + u] + 16 * i, 64);
                for (int x = 0; x < QN; x++) {
                    __builtin_memcpy(&qx, q[x] + 2 * i, 64);
                    a[x][u] += k * qx;
                }
            }
        for (int x = 0; x < QN; x++) {
            v8 h[8];
            for (int u = 0; u < 8; u++)
                h[u] = __builtin_shufflevector(a[x][u], a[x][u], 0, 1, 2, 3, 4, 5, 6, 7) +
                       __builtin_shufflevector(a[x][u], a[x][u], 8, 9, 10, 11, 12, 13, 14, 15);
            store8(&s[x][t], hsum8(h));
        }
    }
}
#endif

/* s[x][t] = q[x] . rows[t] for QN <= 2 queries (a constant where inlined) and t < n rounded
   up to 8: per query, 8 keys' running vectors (one FMA lane chain each, dimensions in order)
   reduced together by hsum8; each key row loaded once for both queries. */
static inline __attribute__((always_inline)) void score_tile(const v8 *const *q, float *const *s,
                                                             int QN, const float *const *rows,
                                                             int64_t n, int64_t NV) {
#if defined(__AVX512F__)
    if (NV % 2 == 0) {
        score_tile16(q, s, QN, rows, n, NV);
        return;
    }
#endif
    for (int64_t t = 0; t < n; t += 8) {
        v8 a[2][8];
        for (int u = 0; u < 8; u++) {
            const v8 k = load8(rows[t + u]);
            for (int x = 0; x < QN; x++) a[x][u] = k * q[x][0];
        }
        for (int64_t i = 1; i < NV; i++)
            for (int u = 0; u < 8; u++) {
                const v8 k = load8(rows[t + u] + 8 * i);
                for (int x = 0; x < QN; x++) a[x][u] += k * q[x][i];
            }
        for (int x = 0; x < QN; x++) store8(&s[x][t], hsum8(a[x]));
    }
}

/* acc[x][0..W) += sum over t < n of p[x][t] * rows[t][8 (off + i) ...], in key order, for
   QN <= 2 queries and W <= 8 (constants where inlined): the vectors stay in registers across
   the keys, and each row's vectors are loaded once for both queries. */
static inline __attribute__((always_inline)) void pv_tile(v8 *const *acc, const float *const *p,
                                                          int QN, const float *const *rows,
                                                          int64_t n, int64_t off, int W) {
    v8 a[2][8];
    for (int x = 0; x < QN; x++)
        for (int i = 0; i < W; i++) a[x][i] = acc[x][off + i];
    for (int64_t t = 0; t < n; t++) {
        v8 pt[2];
        for (int x = 0; x < QN; x++) pt[x] = splat(p[x][t]);
        for (int i = 0; i < W; i++) {
            const v8 vt = load8(rows[t] + 8 * (off + i));
            for (int x = 0; x < QN; x++) a[x][i] += vt * pt[x];
        }
    }
    for (int x = 0; x < QN; x++)
        for (int i = 0; i < W; i++) acc[x][off + i] = a[x][i];
}

#if defined(__AVX512F__)
/* pv_tile on 16-lane vectors, each a pair of the acc's v8 (W pairs from v8 `off`): every lane
   takes the same operations in the same order as in pv_tile, so the same bits, in half the
   instructions. */
enum { PV16_W = 4 };

static inline __attribute__((always_inline)) void pv_tile16(v8 *const *acc, const float *const *p,
                                                            int QN, const float *const *rows,
                                                            int64_t n, int64_t off, int W) {
    v16 a[2][PV16_W];
    for (int x = 0; x < QN; x++)
        for (int i = 0; i < W; i++) __builtin_memcpy(&a[x][i], acc[x] + off + 2 * i, 64);
    for (int64_t t = 0; t < n; t++) {
        v16 pt[2];
        for (int x = 0; x < QN; x++) pt[x] = (v16){0} + p[x][t];
        for (int i = 0; i < W; i++) {
            v16 vt;
            __builtin_memcpy(&vt, rows[t] + 8 * (off + 2 * i), 64);
            for (int x = 0; x < QN; x++) a[x][i] += vt * pt[x];
        }
    }
    for (int x = 0; x < QN; x++)
        for (int i = 0; i < W; i++) __builtin_memcpy(acc[x] + off + 2 * i, &a[x][i], 64);
}
#endif

/* acc[x][...] += p[x] . rows for two queries (QN = 2) or one, over n keys, every vector. */
static void pv_queries(v8 *const *acc, const float *const *p, int QN, const float *const *rows,
                       int64_t n, int64_t NV) {
    int64_t i = 0;
#if defined(__AVX512F__)
    if (QN == 2) {
        for (; i + 2 * PV16_W <= NV; i += 2 * PV16_W) pv_tile16(acc, p, 2, rows, n, i, PV16_W);
        for (; i + 2 <= NV; i += 2) pv_tile16(acc, p, 2, rows, n, i, 1);
    } else {
        for (; i + 2 * PV16_W <= NV; i += 2 * PV16_W) pv_tile16(acc, p, 1, rows, n, i, PV16_W);
        for (; i + 2 <= NV; i += 2) pv_tile16(acc, p, 1, rows, n, i, 1);
    }
#endif
    if (QN == 2) {
        for (; i + PV_W <= NV; i += PV_W) pv_tile(acc, p, 2, rows, n, i, PV_W);
        for (; i < NV; i++) pv_tile(acc, p, 2, rows, n, i, 1);
    } else {
        for (; i + 8 <= NV; i += 8) pv_tile(acc, p, 1, rows, n, i, 8);
        for (; i < NV; i++) pv_tile(acc, p, 1, rows, n, i, 1);
    }
}

/* The online softmax's step for one query over a chunk's n scores s[0..n) (in place: they
   become p = e^(s - m')), with its running m, l and acc[NV]. The max takes lanes of 8 (a
   max is the same whatever its order); p's sum is 8 lanes of whole groups, then the rest in
   key order into lane 0. */
static void softmax_step(float *s, int64_t n, float *m, float *l, v8 *acc, int64_t NV) {
    v8 mv = splat(*m);
    for (int64_t t = 0; t < n; t += 8) {
        v8 x = load8(s + t);
        if (t + 8 > n)
            for (int64_t u = n - t; u < 8; u++) x[u] = -FLT_MAX;
        mv = v8_select(x > mv, x, mv);
    }
    float mx = mv[0];
    for (int u = 1; u < 8; u++) mx = mv[u] > mx ? mv[u] : mx;
    const float correction = expf(*m - mx);
    v8 sum = {0};
    for (int64_t t = 0; t < n; t += 8) {
        const v8 p = exp8(load8(s + t) - mx);
        store8(s + t, p);
        if (t + 8 <= n)
            sum += p;
        else
            for (int64_t u = t; u < n; u++) sum[0] += s[u];
    }
    *l = *l * correction + hsum(sum);
    for (int64_t i = 0; i < NV; i++) acc[i] *= correction;
    *m = mx;
}

/* The online softmax of g entries of one group (entries rows[i], keys [t_begin, ends[i]),
   each ends[i] > t_begin or the whole of an empty entry) for the query heads of kv heads
   [j0, j1) into m[i H + h], l[i H + h] and acc[(i H + h) NV + v] (unnormalised), from
   m = -FLT_MAX, l = 0, acc = 0 (the other heads' left as they are). */
static void attend_group(const struct decode_call *c, const int64_t *rows, const int64_t *ends,
                         int64_t g, int64_t t_begin, int64_t j0, int64_t j1, float *m, float *l,
                         v8 *acc) {
    const struct paged_decode_step *step = c->step;
    const int64_t H = c->H, KVH = step->KVH, D = step->D, B = step->B;
    const int64_t G = H / KVH, NV = D / 8, row = KVH * D;
    const KV_T *k = c->k, *v = c->v;
    v8 qv[g * H][NV];
    float s[g * H][TMAX + 8] __attribute__((aligned(32)));
    float wide[TMAX * D] __attribute__((aligned(32)));  /* a chunk's K/V rows (16-bit caches) */
    const float *kv_rows[TMAX + 8];
    const int32_t *blocks = step->table + step->table_rows[rows[0]] * step->table_row;
    int64_t t_end = t_begin;
    for (int64_t i = 0; i < g; i++) {
        t_end = ends[i] > t_end ? ends[i] : t_end;
        for (int64_t h = j0 * G; h < j1 * G; h++) {
            const float *qp = c->q + step->tok[rows[i]] * c->q_row + h * D;
            for (int64_t x = 0; x < NV; x++) {
                qv[i * H + h][x] = load8(qp + 8 * x) * c->scale;
                acc[(i * H + h) * NV + x] = (v8){0};
            }
            m[i * H + h] = -FLT_MAX;
            l[i * H + h] = 0.f;
        }
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
        /* Entry i's keys of this chunk: its own chunk, cut at its end (0: it has ended). */
        int64_t keys[g];
        for (int64_t i = 0; i < g; i++) {
            const int64_t left = ends[i] - t0;
            keys[i] = left < 0 ? 0 : left < n ? left : n;
        }
        /* Scores s[i H + h][t] = scale * q . k_t over the whole chunk (lanes past an entry's
           keys are never read), the queries of a kv head SCORE_QN at a time. */
        for (int64_t j = j0; j < j1; j++) {
            chunk_rows(kr, n, j, D, wide, kv_rows);
            int64_t qs[g * G], nq = 0;
            for (int64_t i = 0; i < g; i++)
                for (int64_t h = j * G; keys[i] && h < (j + 1) * G; h++) qs[nq++] = i * H + h;
            int64_t x = 0;
            for (; SCORE_QN == 2 && x + 2 <= nq; x += 2) {
                const v8 *q2[2] = {qv[qs[x]], qv[qs[x + 1]]};
                float *s2[2] = {s[qs[x]], s[qs[x + 1]]};
                score_tile(q2, s2, 2, kv_rows, n, NV);
            }
            for (; x < nq; x++) {
                const v8 *q1[1] = {qv[qs[x]]};
                float *s1[1] = {s[qs[x]]};
                score_tile(q1, s1, 1, kv_rows, n, NV);
            }
        }
        for (int64_t i = 0; i < g; i++)
            for (int64_t h = j0 * G; keys[i] && h < j1 * G; h++)
                softmax_step(s[i * H + h], keys[i], &m[i * H + h], &l[i * H + h],
                             acc + (i * H + h) * NV, NV);
        /* acc += p . v over each entry's own keys, a kv head's queries of an entry in pairs. */
        for (int64_t j = j0; j < j1; j++) {
            chunk_rows(vr, n, j, D, wide, kv_rows);
            for (int64_t i = 0; i < g; i++) {
                int64_t h = j * G;
                for (; keys[i] && h < (j + 1) * G; h += 2) {
                    const int QN = h + 1 < (j + 1) * G ? 2 : 1;
                    v8 *a[2] = {acc + (i * H + h) * NV, acc + (i * H + h + QN - 1) * NV};
                    const float *p[2] = {s[i * H + h], s[i * H + h + QN - 1]};
                    pv_queries(a, p, QN, kv_rows, keys[i], NV);
                }
            }
        }
        t0 += n;
    }
}

/* Entry r's output and lse of heads [h0, h1) from its m, l and acc. */
static void finish(const struct decode_call *c, int64_t r, const float *m, const float *l,
                   const v8 *acc, int64_t h0, int64_t h1) {
    const int64_t H = c->H, NV = c->step->D / 8, tok = c->step->tok[r];
    for (int64_t h = h0; h < h1; h++) {
        float inv = l[h] > 0.f ? 1.f / l[h] : 0.f;
        float *op = c->out + tok * c->out_row + h * NV * 8;
        for (int64_t i = 0; i < NV; i++) store8(op + 8 * i, acc[h * NV + i] * inv);
        if (c->lse) c->lse[tok * H + h] = l[h] > 0.f ? m[h] + logf(l[h]) : -INFINITY;
    }
}

static void decode_tasks(void *ctx, int64_t t0, int64_t t1, int thread) {
    const struct decode_call *c = ctx;
    const struct paged_decode_step *step = c->step;
    const int64_t H = c->H, NV = step->D / 8, gmax = group_rows(H, step->D);
    (void)thread;
    const int64_t split = c->heads_split, per = step->KVH / split, G = H / step->KVH;
    for (int64_t task = t0; task < t1; task++) {
        float m[gmax * H], l[gmax * H];
        v8 acc[gmax * H * NV];
        const int64_t t = task / split, j0 = task % split * per, h0 = j0 * G, h1 = h0 + per * G;
        const int64_t grp = c->task_group ? c->task_group[t] : t;
        const int64_t first = c->group_first ? c->group_first[grp] : grp;
        const int64_t last = c->group_first ? c->group_first[grp + 1] : grp + 1;
        const int64_t part = c->task_group ? c->task_part[t] : 0;
        const int64_t begin = step->start[first] + part * PART_KEYS;
        /* The group's entries with a part here, each cut to it (whole without scratch). */
        int64_t rows[GROUP_ROWS], ends[GROUP_ROWS], g = 0;
        for (int64_t r = first; r < last; r++) {
            if (c->task_group && part >= entry_parts(step, r)) continue;
            const int64_t stop = begin + PART_KEYS;
            rows[g] = r;
            ends[g++] = c->task_group && stop < step->end[r] ? stop : step->end[r];
        }
        attend_group(c, rows, ends, g, begin, j0, j0 + per, m, l, acc);
        for (int64_t i = 0; i < g; i++) {
            const int64_t r = rows[i];
            if (!c->task_group || c->partial_at[r] < 0) {  /* the entry whole */
                finish(c, r, m + i * H, l + i * H, acc + i * H * NV, h0, h1);
                continue;
            }
            float *p = c->partial + (c->partial_at[r] + part) * H * (2 + step->D);
            memcpy(p + h0, m + i * H + h0, (h1 - h0) * sizeof(float));
            memcpy(p + H + h0, l + i * H + h0, (h1 - h0) * sizeof(float));
            memcpy(p + 2 * H + h0 * step->D, acc + (i * H + h0) * NV,
                   (h1 - h0) * NV * sizeof(v8));
        }
    }
}

/* The parts of entry r (partial_at[r] .. + parts - 1) into one: m = max m_p,
   l = sum l_p e^(m_p - m), acc = sum acc_p e^(m_p - m), in part order. */
static void merge_parts(const struct decode_call *c, int64_t r, int64_t parts) {
    const int64_t H = c->H, NV = c->step->D / 8, stride = H * (2 + NV * 8);
    const float *partial = c->partial + c->partial_at[r] * stride;
    float m[H], l[H];
    v8 acc[H * NV];
    for (int64_t h = 0; h < H; h++) {
        float mx = -FLT_MAX;
        for (int64_t p = 0; p < parts; p++) {
            const float mp = partial[p * stride + h];
            mx = mp > mx ? mp : mx;
        }
        float sum = 0.f;
        v8 a[NV];
        for (int64_t i = 0; i < NV; i++) a[i] = (v8){0};
        for (int64_t p = 0; p < parts; p++) {
            const float *part = partial + p * stride;
            const float w = expf(part[h] - mx);
            sum += part[H + h] * w;
            for (int64_t i = 0; i < NV; i++) a[i] += load8(part + 2 * H + (h * NV + i) * 8) * w;
        }
        m[h] = mx;
        l[h] = sum;
        for (int64_t i = 0; i < NV; i++) acc[h * NV + i] = a[i];
    }
    finish(c, r, m, l, acc, 0, H);
}

V1_API void PAGED_DECODE(const struct paged_decode_step *step,
                         const struct paged_decode_io *io) {
    KV_T *cache = io->cache;
    if (io->k.data)
        kv_write(step, io->k.data, io->k.stride, io->v.data, io->v.stride, cache);
    if (!io->q.data || step->R == 0) return;
    const int64_t H = io->q.cols / step->D;
    struct decode_call c = {.step = step, .q = io->q.data, .q_row = io->q.stride, .H = H,
                            .k = cache, .v = cache + step->half, .scale = io->scale,
                            .out = io->out.data, .out_row = io->out.stride, .lse = io->lse,
                            .heads_split = 1};
    const int64_t R = step->R, gmax = group_rows(H, step->D);
    /* Scratch: at most R groups and as many tasks as parts, partial slots for the entries of
       several parts. */
    int64_t parts_in_all = 0, slots = 0;
    for (int64_t r = 0; r < R; r++) {
        const int64_t parts = entry_parts(step, r);
        parts_in_all += parts;
        slots += parts > 1 ? parts : 0;
    }
    int64_t *index = malloc((size_t)(R + 1 + 2 * parts_in_all + R) * sizeof(int64_t));
    c.partial = slots ? malloc((size_t)slots * (size_t)(H * (2 + step->D)) * sizeof(float)) : NULL;
    if (!index || (slots && !c.partial)) {
        /* Without scratch, whole entries, one task each: the same as one part each, but for
           entries past PART_KEYS the sums run in another order. */
        free(index);
        free(c.partial);
        c.partial = NULL;
        v1_parallel_for((int)step->nthreads, R, 1, decode_tasks, &c);
        return;
    }
    int64_t *group_first = index, *task_group = index + R + 1;
    int64_t *task_part = task_group + parts_in_all, *partial_at = task_part + parts_in_all;
    /* Groups: runs of up to gmax entries of one table row and start. */
    int64_t groups = 0;
    for (int64_t r = 0, slot = 0; r < R; r++) {
        const int64_t first = groups ? group_first[groups - 1] : 0;
        if (!groups || r - first == gmax || step->table_rows[r] != step->table_rows[first] ||
            step->start[r] != step->start[first])
            group_first[groups++] = r;
        const int64_t parts = entry_parts(step, r);
        partial_at[r] = parts > 1 ? slot : -1;
        slot += parts > 1 ? parts : 0;
    }
    group_first[groups] = R;
    /* Tasks: each part of each group that some entry of it has. */
    int64_t tasks = 0;
    for (int64_t grp = 0; grp < groups; grp++) {
        int64_t most = 0;
        for (int64_t r = group_first[grp]; r < group_first[grp + 1]; r++) {
            const int64_t parts = entry_parts(step, r);
            most = parts > most ? parts : most;
        }
        for (int64_t p = 0; p < most; p++, tasks++) {
            task_group[tasks] = grp;
            task_part[tasks] = p;
        }
    }
    c.group_first = group_first;
    c.task_group = task_group;
    c.task_part = task_part;
    c.partial_at = partial_at;
    /* Fewer tasks than threads (a lone decode of up to PART_KEYS keys is one): each is
       split by kv head, so the others' threads are not idle through it. */
    if (tasks < step->nthreads) c.heads_split = step->KVH;
    v1_parallel_for((int)step->nthreads, tasks * c.heads_split, 1, decode_tasks, &c);
    for (int64_t r = 0; r < R; r++)
        if (partial_at[r] >= 0) merge_parts(&c, r, entry_parts(step, r));
    free(index);
    free(c.partial);
}
