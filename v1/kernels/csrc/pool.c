#include "pool.h"
#include "v1.h"

#include <limits.h>
#include <linux/futex.h>
#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <stdatomic.h>
#include <sys/prctl.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

/* The kernels' worker pool (see pool.h).

   Every parallel loop of the library runs on these workers, not on OpenMP's: OpenMP's threads
   (torch's libgomp) sleep between parallel regions under OMP_WAIT_POLICY=PASSIVE, and waking
   them takes longer than a batch-1 matmul of one layer takes (~40 us against ~25 us, 120
   times a step). A worker here polls for the next job for SPIN_NS after its last one: for
   PAUSE_NS with the CPU's spin-wait hint (the gaps between a layer's parallel loops are a
   few us: its norms, RoPE, activations' quantization), then yielding its CPU between polls
   (so it keeps no runnable thread off that CPU for long), then sleeps on a futex: a
   forward's back-to-back calls find it awake, an idle engine costs nothing. (Yielding from
   the first poll, each a system call, the layers of a 135M batch-1 step took 1.4% longer
   on a 2-core EPYC over 100 paired rounds: bench/results/fused_step_pause_zen3.txt.) The
   caller waits for the job's last workers the same way.
   One job at a time: a caller that finds the pool busy (another Python thread in a kernel)
   runs its job alone. The caller waits only for the workers that joined its job, not for
   all of them: on a shared machine a worker may be off its CPU (asleep, or behind another
   process) for a time slice or more, and the caller, which takes whatever items are left,
   can finish alone meanwhile.
   A thread claims a share of the items left, 1 / (2 nthreads) of them in whole chunks (at
   least one): each claim moves the counter's cache line between the cores, and a chunk each
   made ~100 claims of a batch-1 MLP matmul; the last claims are single chunks, so no thread
   is left holding much when the others finish (a 135M batch-1 fused step took 0.959x the
   time over 100 paired rounds on a 2-core EPYC: bench/results/fused_step_guided_zen3.txt,
   chunk_each the library built before this). Items whose chunk is 1 are claimed one at a
   time: attention's tasks, of uneven cost (a prompt chunk's beside decodes), where a share
   taken at the start could hold most of the work. */
enum { MAX_WORKERS = V1_MAX_THREADS - 1 };
static const int64_t PAUSE_NS = 30000, SPIN_NS = 200000;

/* One poll of a wait begun `waited` ns ago: for PAUSE_NS the CPU's spin-wait hint (the other
   hardware thread of the core runs meanwhile; the loop exits without a pipeline flush), then
   a yield of the CPU. */
static inline void poll_pause(int64_t waited) {
    if (waited >= PAUSE_NS) {
        sched_yield();
        return;
    }
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield");
#endif
}

static struct {
    pthread_mutex_t lock;       /* held by the caller whose job runs */
    int nworkers;               /* started (threads 1 .. nworkers) */
    _Atomic uint32_t gen;       /* bumped per job; workers wait for it to change */
    _Atomic int32_t sleeping;   /* workers in (or entering) futex wait */
    /* Threads in the current job, the caller included; 0: closed (none may join). The
       job's fields stay as they are while it is above 0. */
    _Atomic int32_t members;
    _Atomic int64_t next;       /* first unclaimed item of the current job */
    v1_range_fn fn;
    void *ctx;
    int64_t n, chunk;
    int nthreads;               /* threads taking items in the current job */
} pool = {.lock = PTHREAD_MUTEX_INITIALIZER};

static int64_t now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (int64_t)t.tv_sec * 1000000000 + t.tv_nsec;
}

static void run_items(int thread) {
    int64_t b = atomic_load(&pool.next);
    while (b < pool.n) {
        int64_t take = pool.chunk;
        if (take > 1) {  /* (a chunk of 1: tasks of uneven cost, one at a time; see above) */
            take = (pool.n - b) / (2 * pool.nthreads) / pool.chunk * pool.chunk;
            if (take < pool.chunk) take = pool.chunk;
        }
        if (!atomic_compare_exchange_weak(&pool.next, &b, b + take)) continue;  /* b reread */
        pool.fn(pool.ctx, b, b + take < pool.n ? b + take : pool.n, thread);
        b = atomic_load(&pool.next);
    }
}

/* Count this worker into the open job, if one is: then the job's fields are its to read. */
static int join(void) {
    int32_t m = atomic_load(&pool.members);
    while (m > 0)
        if (atomic_compare_exchange_weak(&pool.members, &m, m + 1)) return 1;
    return 0;
}

static void *worker(void *arg) {
    const int thread = (int)(intptr_t)arg;
    sigset_t all;
    sigfillset(&all);
    pthread_sigmask(SIG_BLOCK, &all, NULL);  /* signals go to the interpreter's threads */
    prctl(PR_SET_NAME, "v1-pool");  /* told apart in top, ps (and the tests) */
    uint32_t seen = atomic_load(&pool.gen);  /* a job under way is left to the others */
    for (;;) {
        const int64_t t0 = now_ns();
        uint32_t g;
        while ((g = atomic_load(&pool.gen)) == seen) {
            const int64_t idle = now_ns() - t0;
            if (idle < SPIN_NS) {
                poll_pause(idle);
                continue;
            }
            /* A job published after this increment wakes us; one published before it
               changed gen, and the wait returns at once. */
            atomic_fetch_add(&pool.sleeping, 1);
            syscall(SYS_futex, &pool.gen, FUTEX_WAIT_PRIVATE, seen, NULL, NULL, 0);
            atomic_fetch_sub(&pool.sleeping, 1);
        }
        seen = g;
        if (!join()) continue;  /* late: the caller finished the job */
        if (thread < pool.nthreads) run_items(thread);
        atomic_fetch_sub(&pool.members, 1);
    }
    return NULL;
}

/* A forked child has none of the parent's workers (and maybe a lock some parent thread
   held): start over. */
static void pool_after_fork(void) {
    pthread_mutex_init(&pool.lock, NULL);
    pool.nworkers = 0;
    atomic_store(&pool.sleeping, 0);
}

__attribute__((constructor)) static void pool_init(void) {
    pthread_atfork(NULL, NULL, pool_after_fork);
}

void v1_parallel_for(int nthreads, int64_t n, int64_t chunk, v1_range_fn fn, void *ctx) {
    const int want = v1_pool_width(nthreads);
    if (n <= chunk || want <= 1 || pthread_mutex_trylock(&pool.lock) != 0) {
        fn(ctx, 0, n, 0);
        return;
    }
    const uint32_t gen = atomic_load(&pool.gen);
    while (pool.nworkers < want - 1) {
        pthread_t t;
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        const int failed = pthread_create(&t, &attr, worker, (void *)(intptr_t)(pool.nworkers + 1));
        pthread_attr_destroy(&attr);
        if (failed) break;  /* run on those there are */
        pool.nworkers++;
    }
    pool.fn = fn;
    pool.ctx = ctx;
    pool.n = n;
    pool.chunk = chunk;
    pool.nthreads = want < pool.nworkers + 1 ? want : pool.nworkers + 1;
    atomic_store(&pool.next, 0);
    atomic_store(&pool.members, 1);
    atomic_store(&pool.gen, gen + 1);
    if (atomic_load(&pool.sleeping) > 0)
        syscall(SYS_futex, &pool.gen, FUTEX_WAKE_PRIVATE, INT_MAX, NULL, NULL, 0);
    run_items(0);
    /* Every item is taken: close the job to workers yet to join, wait for those in it. */
    atomic_fetch_sub(&pool.members, 1);
    for (int64_t t0 = now_ns(); atomic_load(&pool.members) > 0;) poll_pause(now_ns() - t0);
    pthread_mutex_unlock(&pool.lock);
}


/* The digest of the sources this library was built from (see v1/kernels/variants.py). */
V1_API const char *v1_sources_hash(void) { return V1_SOURCES_HASH; }
