/* A weight's blocks moved between GGUF's layout and an interleaved one (the layouts:
   v1/models/layers/quantized.py's `_relayout`), once per weight at load, where numpy's
   strided copy of 4-byte items was a large share of a 1B model's load (docs/benchmarks.md,
   "Model sizes"). */
#include "pool.h"
#include "v1.h"

#include <string.h>

enum { MAX_ROWS = 16 };  /* rows a group may interleave (the binding checks) */

/* Each group of `rows` rows: GGUF's [row, block, bytes], where a block is `lead` bytes, then
   `dwords` 4-byte words, then the bytes past them (no lead: `rest` of them), against ours
   [block, dword, row] (4 bytes each), then [block, row, `rest` bytes: the lead, or those past
   the dwords]. */
struct relayout {
    const uint8_t *src;
    uint8_t *dst;
    int64_t blocks;  /* per row */
    int32_t rows, size, lead, dwords, rest;
    int32_t interleave;  /* 1: GGUF's layout to ours; 0: back */
};

/* One block of each of a group's rows: `plain` [rows] point at GGUF's blocks, `mixed` at
   ours. `interleave` is a constant where this is inlined: each direction its own loop. */
static inline void move_block(const struct relayout *r, uint8_t *const *plain, uint8_t *mixed,
                              const int interleave) {
    const int64_t rows = r->rows, rest = r->rest;
    const int64_t rest_at = r->lead ? 0 : 4 * (int64_t)r->dwords;  /* the plain block's rest */
    for (int64_t w = 0; w < r->dwords; w++) {
        uint8_t *m = mixed + w * rows * 4;
        for (int64_t row = 0; row < rows; row++) {
            uint8_t *p = plain[row] + r->lead + 4 * w;
            if (interleave)
                memcpy(m + 4 * row, p, 4);
            else
                memcpy(p, m + 4 * row, 4);
        }
    }
    uint8_t *m = mixed + rows * r->dwords * 4;
    for (int64_t row = 0; row < rows; row++) {
        if (interleave)
            memcpy(m + row * rest, plain[row] + rest_at, (size_t)rest);
        else
            memcpy(plain[row] + rest_at, m + row * rest, (size_t)rest);
    }
}

static void move_groups(void *ctx, int64_t begin, int64_t end, int thread) {
    (void)thread;
    const struct relayout *r = ctx;
    const int64_t rows = r->rows, size = r->size, group_bytes = rows * r->blocks * size;
    /* The plain side's address in whichever buffer it is (written only when it is dst). */
    uint8_t *plain_base = r->interleave ? (uint8_t *)r->src : r->dst;
    uint8_t *mixed_base = r->interleave ? r->dst : (uint8_t *)r->src;
    uint8_t *plain[MAX_ROWS];
    for (int64_t g = begin; g < end; g++) {
        for (int64_t b = 0; b < r->blocks; b++) {
            for (int64_t row = 0; row < rows; row++)
                plain[row] = plain_base + g * group_bytes + (row * r->blocks + b) * size;
            uint8_t *mixed = mixed_base + g * group_bytes + b * rows * size;
            if (r->interleave)
                move_block(r, plain, mixed, 1);
            else
                move_block(r, plain, mixed, 0);
        }
    }
}

/* src and dst: [groups * rows, blocks * size] bytes each, not overlapping. */
V1_API void v1_relayout(const uint8_t *src, uint8_t *dst, int64_t groups, int64_t blocks,
                        int32_t rows, int32_t size, int32_t lead, int32_t dwords,
                        int32_t rest, int32_t interleave, int32_t nthreads) {
    const struct relayout r = {src, dst, blocks, rows, size, lead, dwords, rest, interleave};
    const int64_t group_bytes = (int64_t)rows * blocks * size;
    if (groups < 1 || group_bytes < 1) return;
    /* ~256 KiB a chunk: few claims, and every thread gets some of a 1 MiB weight. */
    int64_t chunk = (256 << 10) / group_bytes;
    v1_parallel_for(nthreads, groups, chunk < 1 ? 1 : chunk, move_groups, (void *)&r);
}
