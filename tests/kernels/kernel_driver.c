/* Every tuned block kernel of a kernel library against its plain C reference, in C alone:
   for libraries the Python tests cannot load (an AArch64 build run under qemu-user on an x86
   machine) and for the sanitizer builds. tests/kernels/kernel_check.py builds and runs it.

   Usage: kernel_driver LIBRARY[=INT8_ISA]...
   Each library is loaded (dlopen) and, for every row of its kernel table (v1_block_types)
   and every kernel the row has, the tuned kernel and the reference run on the same
   pseudo-random blocks and activations, at shapes that reach every tile: M (activation rows)
   1 .. 70, N (weight rows) never a multiple of the vector width (but a multiple of the rows
   a type interleaves, the kernels' contract: at most half a vector then), K 1 .. 6 blocks
   (superblocks 1, 2), with and without a bias, on 1 and 2 threads. linear_i8 must give the
   same bits, linear_f32 and dequantize agree within rounding (and the reference linear_f32
   with a double-precision product of the reference dequantize); neither may write outside
   its output. With =INT8_ISA the library must report that integer dot product
   (v1_block_int8_isa: isa.h's INT8_ISA).
   Prints a line per library; exits 0 if all pass, 1 on a mismatch, 2 on a library or
   kernel it cannot check. */
#include "block_types.h"
#include "v1.h"

#include <dlfcn.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef const struct v1_block_type *(*types_fn)(int32_t *count);
typedef const char *(*kernel_name_fn)(int32_t kernel);
typedef int32_t (*run_fn)(int32_t kernel, int32_t reference, const struct v1_matmul *call);
typedef int32_t (*int8_isa_fn)(void);

/* Where each type's fp16 fields sit in a block (d, and m where x = d q + m; the K-quants'
   d and dmin, q6_k's d at its end, q8_0x8's moved there; f16's one value), -1 after the
   last: these get reasonable scales; every other byte is random. A type missing here cannot
   be checked. (bf16: such a half's bits read as bfloat16, finite: tiny, or 2^-71 .. 2^-31.) */
static const struct {
    const char *name;
    int halves[3];
} HEADERS[] = {{"q4_1", {0, 2, -1}}, {"q4_1x8", {0, 2, -1}}, {"q8_0", {0, -1}},
               {"q8_0x8", {32, -1}}, {"q4_0", {0, -1}},      {"q5_0", {0, -1}},
               {"q5_1", {0, 2, -1}}, {"f16", {0, -1}},       {"bf16", {0, -1}},
               {"q4_k", {0, 2, -1}}, {"q4_kx8", {0, 2, -1}}, {"q5_k", {0, 2, -1}},
               {"q6_k", {208, -1}},  {"q6_kx8", {208, -1}}};

/* M: every dot tile (1-4 rows), the few-row int8 tile's chains (1, 2, more) with and without
   columns ahead (up to 16 rows), then beyond it the outer-product tiles of 1-4 vectors of
   rows at every vector width (VL 4: 17, 40, 76 end on 1, 2, 3 vectors); N: a last partial
   tile at VL 4, 8 and 16. */
static const int64_t MS[] = {1, 2, 3, 4, 5, 8, 16, 17, 40, 76};
static const int64_t NS[] = {1, 13, 37, 70};
/* K: blocks per row (K = KS block_elems); superblocks (block_elems above 32) 1 or 2, their
   kernels loop over them the same way at any count (and the references are slow under qemu). */
static const int64_t KS[] = {1, 2, 5, 6};
enum { NM = sizeof MS / sizeof MS[0], NN = sizeof NS / sizeof NS[0], NK = sizeof KS / sizeof KS[0] };
enum { PAD = 3 };  /* columns past each output row, which no kernel may write */

static uint64_t next(uint64_t *s) {  /* splitmix64 */
    uint64_t z = (*s += 0x9e3779b97f4a7c15u);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9u;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebu;
    return z ^ (z >> 31);
}

static float uniform(uint64_t *s) { return (float)(next(s) >> 40) / (float)(1 << 24) * 2.f - 1.f; }

/* A scale: mostly 2^-8 .. 2^-3 in magnitude, sometimes 0 or subnormal, either sign. */
static uint16_t random_half(uint64_t *s) {
    const uint64_t r = next(s);
    const uint16_t sign = (uint16_t)((r & 1) << 15), man = (uint16_t)((r >> 1) & 0x3ff);
    switch ((r >> 11) & 31) {
        case 0: return sign;
        case 1: case 2: return sign | man;
        default: return sign | (uint16_t)((7 + (r >> 16) % 5) << 10) | man;
    }
}

/* Bits a kernel never writes: an output cell still holding them was not written. */
static const uint32_t SENTINEL = 0x7fc0deadu;

static float *sentinels(int64_t n) {
    float *p = malloc((size_t)n * sizeof *p);
    for (int64_t i = 0; p && i < n; i++) memcpy(p + i, &SENTINEL, 4);
    return p;
}

static int is_sentinel(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    return u == SENTINEL;
}

/* What was checked and what failed, for one library. */
struct tally {
    long cases, failures;
};

static void fail(struct tally *t, const char *type, const char *kernel, int64_t M, int64_t N,
                 int64_t K, const char *what) {
    if (t->failures++ < 20)
        printf("  MISMATCH %s %s M=%lld N=%lld K=%lld: %s\n", type, kernel, (long long)M,
               (long long)N, (long long)K, what);
}

/* Cells [rows, cols] of out (stride ld) written, and its PAD columns past them not. */
static int written_within(const float *out, int64_t rows, int64_t cols, int64_t ld) {
    for (int64_t r = 0; r < rows; r++)
        for (int64_t c = 0; c < ld; c++)
            if (is_sentinel(out[r * ld + c]) != (c >= cols)) return 0;
    return 1;
}

/* Kernel k, tuned (out[0]) and reference (out[1]; only that one without a tuned kernel), on
   `call`, each into a fresh output of `cells` floats: 0, or the first nonzero status (-3: no
   memory for an output). */
static int32_t run_both(run_fn run, const struct v1_block_type *row, int32_t k,
                        struct v1_matmul *call, int64_t cells, float *out[2]) {
    out[0] = out[1] = NULL;
    for (int ref = row->kernels[k] ? 0 : 1; ref < 2; ref++) {
        if (!(out[ref] = sentinels(cells))) return -3;
        call->out.data = out[ref];
        const int32_t status = run(k, ref, call);
        if (status) return status;
    }
    return 0;
}

/* Where byte `at` of row n's block b sits, `rows` rows interleaved (rb bytes a row, bb a
   block): in its dword, or past the block's whole dwords, in the group's tail row by row. */
static int64_t byte_at(int64_t n, int64_t b, int64_t rb, int64_t bb, int rows, int at) {
    const int64_t block = n / rows * rows * rb + b * bb * rows, i = n % rows, dwords = bb / 4;
    if (rows == 1) return n * rb + b * bb + at;
    if (at < 4 * dwords) return block + 4 * (rows * (at / 4) + i) + at % 4;
    return block + 4 * rows * dwords + bb % 4 * i + at - 4 * dwords;
}

/* N rows of K / be blocks of bb bytes, `rows` rows interleaved (block_types.h): random
   bytes, the fp16 fields at the offsets `halves` (-1 ends them) of each block random scales. */
static uint8_t *random_blocks(int64_t N, int64_t K, int64_t be, int64_t bb, int rows,
                              const int *halves, uint64_t *seed) {
    const int64_t rb = K / be * bb;
    uint8_t *w = malloc((size_t)(N * rb));
    for (int64_t i = 0; w && i < N * rb; i++) w[i] = (uint8_t)next(seed);
    for (int64_t n = 0; w && n < N; n++)
        for (int64_t b = 0; b < K / be; b++)
            for (int h = 0; halves[h] >= 0; h++) {
                const uint16_t d = random_half(seed);
                memcpy(w + byte_at(n, b, rb, bb, rows, halves[h]), &d, 2);
            }
    return w;
}

/* M rows of K activations, ldx apart: each row at its own scale, some blocks of 32 all 0
   (their int8 scale is 0). */
static float *random_activations(int64_t M, int64_t K, int64_t ldx, uint64_t *seed) {
    float *x = malloc((size_t)(M * ldx) * sizeof *x);
    for (int64_t m = 0; x && m < M; m++) {
        const float scale = ldexpf(1.f, (int)(next(seed) % 7) - 3);
        for (int64_t i = 0; i < ldx; i++) x[m * ldx + i] = uniform(seed) * scale;
        for (int64_t b = 0; b < K / 32; b++)
            if (next(seed) % 8 == 0) memset(x + m * ldx + 32 * b, 0, 32 * sizeof *x);
    }
    return x;
}

/* The tuned weight deq[0] against the reference's deq[1] ([N, K]): within 1e-6 of the row's
   largest value (d q + m is one FMA in the tuned kernels, two roundings in the reference).
   Describes the first difference in `what`. */
static void compare_weights(float *const deq[2], int64_t N, int64_t K, char *what, size_t size) {
    for (int64_t n = 0; n < N; n++) {
        float amax = 0.f;
        for (int64_t i = 0; i < K; i++) amax = fmaxf(amax, fabsf(deq[1][n * K + i]));
        for (int64_t i = 0; i < K; i++) {
            const float a = deq[0][n * K + i], b = deq[1][n * K + i];
            if (!(fabsf(a - b) <= 1e-6f * amax)) {
                snprintf(what, size, "w[%lld][%lld] %.9g, reference %.9g", (long long)n,
                         (long long)i, a, b);
                return;
            }
        }
    }
}

/* The tuned y[0] against the reference y[1] ([M, N], ldy apart) for x [M, K] (ldx apart),
   the weight W [N, K] and bias: the same bits (`exact`), or else both within 4e-5 of the
   sum of the products' magnitudes (each weight counted at least at its row's largest: d q
   and m round apart) of the double-precision result: above either sum's worst-case
   rounding at these K. Describes the first difference in `what`. */
static void compare_outputs(float *const y[2], int64_t ldy, const float *x, int64_t ldx,
                            const float *W, const float *bias, int64_t M, int64_t N, int64_t K,
                            int exact, char *what, size_t size) {
    for (int64_t n = 0; n < N; n++) {
        float wmax = 0.f;
        for (int64_t i = 0; !exact && i < K; i++) wmax = fmaxf(wmax, fabsf(W[n * K + i]));
        for (int64_t m = 0; m < M; m++) {
            const float a = y[0][m * ldy + n], b = y[1][m * ldy + n];
            if (exact) {
                if (memcmp(&a, &b, 4)) {
                    snprintf(what, size, "y[%lld][%lld] %.9g, reference %.9g (not the same "
                             "bits)", (long long)m, (long long)n, a, b);
                    return;
                }
                continue;
            }
            double sum = bias ? bias[n] : 0., mag = bias ? fabs(bias[n]) : 0.;
            for (int64_t i = 0; i < K; i++) {
                const double xi = x[m * ldx + i], wi = W[n * K + i];
                sum += wi * xi;
                mag += (fabs(wi) + wmax) * fabs(xi);
            }
            const double tol = 4e-5 * mag;
            if (!(fabs((double)a - b) <= tol) || !(fabs(b - sum) <= tol)) {
                snprintf(what, size, "y[%lld][%lld] %.9g, reference %.9g, exact %.9g "
                         "(tolerance %.3g)", (long long)m, (long long)n, a, b, sum, tol);
                return;
            }
        }
    }
}

/* Checks one row of the table (its index `code`; its blocks' fp16 fields at `halves`):
   0, 1 on a mismatch, 2 where it cannot be checked. */
static int check_type(run_fn run, const struct v1_block_type *row, int32_t code,
                      const int *halves,
                      const char *const *names, int nkernels, struct tally *t) {
    int32_t ki8 = -1, kdq = -1;
    for (int32_t k = 0; k < nkernels; k++) {
        if (!strcmp(names[k], "linear_i8")) ki8 = k;
        else if (!strcmp(names[k], "dequantize")) kdq = k;
        else if (strcmp(names[k], "linear_f32") && row->kernels[k]) {
            printf("  %s %s: this driver does not know how to check it\n", row->name, names[k]);
            return 2;
        }
        if (row->kernels[k] && !row->reference[k]) {
            printf("  %s %s: a tuned kernel without a reference\n", row->name, names[k]);
            return 2;
        }
    }
    if (kdq < 0 || !row->reference[kdq]) {  /* the linear kernels are checked against it */
        printf("  %s: no reference dequantize\n", row->name);
        return 2;
    }
    const long failures = t->failures;
    uint64_t seed = 0x5eed0000u + (uint64_t)code;
    int threads = 1;
    for (int in = 0; in < NN; in++)
        for (int ik = 0; ik < NK; ik++) {
            const int64_t R = row->interleave;
            const int64_t N = (NS[in] + R - 1) / R * R;
            const int64_t K = (row->block_elems > 32 ? 1 + ik % 2 : KS[ik]) * row->block_elems;
            const int64_t rb = K / row->block_elems * row->block_bytes;
            uint8_t *w = random_blocks(N, K, row->block_elems, row->block_bytes, (int)R, halves,
                                       &seed);
            struct v1_matmul call = {.w = {w, N, K, rb}, .out = {NULL, N, K, K}, .type = code,
                                     .nthreads = 1};
            char what[160] = "";
            float *deq[2] = {NULL, NULL};
            const int32_t status = w ? run_both(run, row, kdq, &call, N * K + PAD, deq) : -3;
            if (status) {
                snprintf(what, sizeof what, "failed (%d)", status);
            } else if (row->kernels[kdq]) {
                t->cases++;
                if (!written_within(deq[0], 1, N * K, N * K + PAD) ||
                    !written_within(deq[1], 1, N * K, N * K + PAD))
                    snprintf(what, sizeof what, "wrote outside its output");
                else
                    compare_weights(deq, N, K, what, sizeof what);
            }
            if (*what) fail(t, row->name, "dequantize", 0, N, K, what);
            for (int im = 0; im < NM && !status; im++) {
                const int64_t M = MS[im], ldx = K + PAD, ldy = N + PAD;
                float *x = random_activations(M, K, ldx, &seed), *bias = NULL;
                if ((in + ik + im) % 2 && (bias = malloc((size_t)N * sizeof *bias)))
                    for (int64_t n = 0; n < N; n++) bias[n] = uniform(&seed);
                call.x = (struct v1_view){x, M, K, ldx};
                call.bias = bias;
                call.out = (struct v1_view){NULL, M, N, ldy};
                call.nthreads = threads = 3 - threads;
                for (int32_t k = 0; x && k < nkernels; k++) {
                    if (k == kdq || !row->kernels[k]) continue;
                    float *y[2];
                    *what = 0;
                    t->cases++;
                    const int32_t ran = run_both(run, row, k, &call, M * ldy, y);
                    if (ran)
                        snprintf(what, sizeof what, "failed (%d)", ran);
                    else if (!written_within(y[0], M, N, ldy) || !written_within(y[1], M, N, ldy))
                        snprintf(what, sizeof what, "wrote outside its output");
                    else
                        compare_outputs(y, ldy, x, ldx, deq[1], bias, M, N, K, k == ki8, what,
                                        sizeof what);
                    if (*what) fail(t, row->name, names[k], M, N, K, what);
                    free(y[0]);
                    free(y[1]);
                }
                free(x);
                free(bias);
            }
            free(deq[0]);
            free(deq[1]);
            free(w);
        }
    return t->failures > failures;
}

static int check_library(const char *arg) {
    char path[4096];
    snprintf(path, sizeof path, "%s", arg);
    int expected_isa = -1;
    char *eq = strrchr(path, '=');
    if (eq) {
        *eq = 0;
        expected_isa = atoi(eq + 1);
    }
    void *h = dlopen(path, RTLD_NOW | RTLD_LOCAL);
    if (!h) {
        printf("ERROR %s: %s\n", path, dlerror());
        return 2;
    }
    const types_fn types = (types_fn)dlsym(h, "v1_block_types");
    const kernel_name_fn kernel_name = (kernel_name_fn)dlsym(h, "v1_block_kernel_name");
    const int8_isa_fn int8_isa = (int8_isa_fn)dlsym(h, "v1_block_int8_isa");
    const run_fn run = (run_fn)dlsym(h, "v1_block_run");
    if (!types || !kernel_name || !int8_isa || !run) {
        printf("ERROR %s: not a kernel library (no v1_block_* entry points)\n", path);
        return 2;
    }
    const char *names[16];
    int nkernels = 0;
    while (nkernels < 16 && (names[nkernels] = kernel_name(nkernels))) nkernels++;
    if (nkernels != V1_KERNEL_COUNT) {
        printf("ERROR %s: %d kernels per row, this driver was built for %d\n", path, nkernels,
               V1_KERNEL_COUNT);
        return 2;
    }
    const int isa = int8_isa();
    if (expected_isa >= 0 && isa != expected_isa) {
        printf("FAIL %s: INT8_ISA %d, expected %d\n", path, isa, expected_isa);
        return 1;
    }
    int32_t count = 0;
    const struct v1_block_type *rows = types(&count);
    struct tally t = {0, 0};
    int worst = 0;
    char checked[256] = "";
    for (int32_t code = 0; code < count; code++) {
        const int *halves = NULL;
        for (size_t i = 0; i < sizeof HEADERS / sizeof HEADERS[0]; i++)
            if (!strcmp(HEADERS[i].name, rows[code].name)) halves = HEADERS[i].halves;
        if (!halves) {
            printf("  %s: no block header known to this driver (add it to HEADERS)\n",
                   rows[code].name);
            worst = 2;
            continue;
        }
        const int r = check_type(run, &rows[code], code, halves, names, nkernels, &t);
        worst = r > worst ? r : worst;
        snprintf(checked + strlen(checked), sizeof checked - strlen(checked), "%s%s",
                 code ? " " : "", rows[code].name);
    }
    printf("%s %s: INT8_ISA %d, types %s, %ld cases, %ld mismatches\n",
           worst == 0 ? "PASS" : worst == 1 ? "FAIL" : "ERROR", path, isa, checked, t.cases,
           t.failures);
    return worst;
}

int main(int argc, char **argv) {
    if (argc < 2) {
        fprintf(stderr, "usage: %s LIBRARY[=INT8_ISA]...\n", argv[0]);
        return 2;
    }
    int worst = 0;
    for (int i = 1; i < argc; i++) {
        const int r = check_library(argv[i]);
        worst = r > worst ? r : worst;
    }
    return worst;
}
