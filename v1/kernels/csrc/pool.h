/* The kernels' worker pool, one per library: every parallel kernel (the quantized matmuls,
   paged attention) runs its loops here, never on OpenMP's threads. See pool.c. */
#ifndef V1_POOL_H
#define V1_POOL_H

#include <stdint.h>

/* Threads a job may use, the caller included. */
enum { V1_MAX_THREADS = 64 };

/* fn(ctx, begin, end, thread): items [begin, end) on thread 0 .. nthreads - 1 (for per-thread
   scratch). */
typedef void (*v1_range_fn)(void *ctx, int64_t begin, int64_t end, int thread);

/* The number of threads a job asking for `nthreads` gets at most: nthreads clamped to
   [1, V1_MAX_THREADS]. Callers size per-thread scratch with it. */
static inline int v1_pool_width(int nthreads) {
    return nthreads < 1 ? 1 : nthreads > V1_MAX_THREADS ? V1_MAX_THREADS : nthreads;
}

/* fn over items [0, n) in runs of whole chunks of `chunk` (a share of those left, see
   pool.c; with chunk 1, one item at a time: items of uneven cost), claimed by the caller
   and up to nthreads - 1 workers as they come free; returns when all are done. nthreads:
   the caller's torch thread count (the Python bindings pass torch.get_num_threads()). */
void v1_parallel_for(int nthreads, int64_t n, int64_t chunk, v1_range_fn fn, void *ctx);

#endif
