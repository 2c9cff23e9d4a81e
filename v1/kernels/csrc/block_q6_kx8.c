/* q6_k superblocks with 8 rows interleaved: each group of 8 rows stores its superblocks b
   together, as 52 runs of 8 dwords (dword f of the 8 rows: the low nibbles' 32, the high
   parts' 16, the scales' 4), then the 8 rows' fp16 d (16 bytes, row by row: the 2 bytes past
   a superblock's last whole dword), the same bytes as q6_k's, moved (block_matmul.py's
   `interleave`). The int8 path puts VL weight rows in the lanes of a vector (AVX-512: two
   groups, joined): a value's 6 bits come from a dword of nibbles and one of high parts by
   shifts and masks in each lane, go into dot4 against 4 activation bytes broadcast from
   memory, a sum per lane per 16 values times its signed scale, and the 8 rows' d is one
   conversion of the group's tail: no gather, no transpose, no reduction across lanes.
   dequantize and linear_f32 are q6_k's on each superblock's bytes gathered back. */
#define KT_ROWS 8
#define KT_FN(f) block_q6_kx8_##f
/* Activation rows per pass over a set's weights: the values' decode is shared by them (8 ran
   faster than 4 on AVX2 and AVX-512 at 64 and 512 rows, 16 registers or 32: docs/kernels.md). */
#define KT_TILE_M 8
#include "block_q6_k.c"

/* The 4 products of 4 6-bit values and 4 activation bytes, summed per lane (pair sums as
   int16 where the ISA keeps them so: 2 of them stay within 2 x 2 x 63 x 127), and such sums
   times a signed scale per lane, exactly. */
/* Signed byte k of each lane of v, as the lane's int32. */
static inline vi k6_sbyte(vi v, int k) { return (v << (24 - 8 * k)) >> 24; }

/* Signed bytes a and b of each lane of v as the lane's low and high word (AVX2: one byte
   shuffle, then the words shifted down, where shifts, masks and an or took 5). */
static inline vi k6_words(vi v, int a, int b) {
#if VL == 8 && defined(__AVX2__)
    const int ia = 0x0101 * a, ib = 0x01010000 * b, r = 0x04040404;
    const __m256i spread = _mm256_setr_epi32(ia | ib, (ia | ib) + r, (ia | ib) + 2 * r,
                                             (ia | ib) + 3 * r, ia | ib, (ia | ib) + r,
                                             (ia | ib) + 2 * r, (ia | ib) + 3 * r);
    return (vi)_mm256_srai_epi16(_mm256_shuffle_epi8((__m256i)v, spread), 8);
#else
    return (k6_sbyte(v, a) & 0xffff) | k6_sbyte(v, b) << 16;
#endif
}

#ifdef dot4_i16
#define K6_DOT dot4_i16
enum { K6_DEPTH = 2 };  /* dot4s per sum */
/* sums times the signed scale byte k of each lane of s */
static inline vi k6_scaled(vi sums, vi s, int k) { return madd16(sums, k6_words(s, k, k)); }
#else
#define K6_DOT dot4
enum { K6_DEPTH = 4 };
static inline vi k6_scaled(vi sums, vi s, int k) { return sums * k6_sbyte(s, k); }
#endif

/* The fp16 d of VL rows: the 2-byte tails at t (lane0's group; AVX-512: t2 for the next 8). */
static inline vf k6_d(const uint8_t *t, const uint8_t *t2) {
    uint8_t h[2 * VL];
    memcpy(h, t, VL < 8 ? 2 * VL : 16);
    if (VL == 16) memcpy(h + 16, t2, 16);
    return fp16v(h);
}

enum { K6_NIBBLES = 0, K6_HIGH = 32, K6_SCALES = 48, K6_TAIL = 4 * KT_ROWS * KT_DWORDS };

/* The most activation rows a tile takes k6_few for: its 2 sums per row and value pair fit
   4 rows in 32 registers, 2 in 16 (4 spilled there, slower than k6_many's order). */
#if NREGS >= 32
#define K6_FEW 4
#else
#define K6_FEW 2
#endif

/* The superblock at p, p2 against MG <= K6_FEW activation rows (at x, K bytes apart):
   isum[m] = the scaled sums. Streams the weights once, in order: each dword of nibbles is
   loaded once for both its values (t, t + 2) with the dword of high parts beside it, and a
   block's sums are scaled as they complete (kt_set's big-M order loads each dword per value
   and keeps more live than 16 registers hold). */
static inline __attribute__((always_inline)) void k6_few(const uint8_t *p, const uint8_t *p2,
                                                        const int8_t *x, int64_t K, int MG,
                                                        vi *isum) {
    for (int m = 0; m < MG; m++) isum[m] = (vi){0};
#pragma GCC unroll 2
    for (int h = 0; h < 2; h++) {
        /* scales of blocks 8 h .. 8 h + 3 (t < 2), 8 h + 4 .. 8 h + 7 (t >= 2) */
        const vi sc[2] = {kt_lanes(p, p2, K6_SCALES + 2 * h),
                          kt_lanes(p, p2, K6_SCALES + 2 * h + 1)};
#pragma GCC unroll 2
        for (int tp = 0; tp < 2; tp++)  /* values t = tp and t = tp + 2 */
#pragma GCC unroll 2
            for (int half = 0; half < 2; half++)
#pragma GCC unroll 2
                for (int c0 = 4 * half; c0 < 4 * half + 4; c0 += K6_DEPTH) {
                    vi part[2][K6_FEW];
                    for (int m = 0; m < MG; m++) part[0][m] = part[1][m] = (vi){0};
#pragma GCC unroll 4
                    for (int c = c0; c < c0 + K6_DEPTH; c++) {  /* l = 4 c .. 4 c + 3 */
                        const vi ql = kt_lanes(p, p2, K6_NIBBLES + 16 * h + 8 * tp + c);
                        const vi qh = kt_lanes(p, p2, K6_HIGH + 8 * h + c);
                        const vi q[2] = {
                            (ql & 0x0f0f0f0f) | ((qh << (4 - 2 * tp)) & 0x30303030),
                            ((vi)((vu)ql >> 4) & 0x0f0f0f0f) |
                                ((tp ? (vi)((vu)qh >> 2) : qh) & 0x30303030)};
                        for (int u = 0; u < 2; u++)
                            for (int m = 0; m < MG; m++)
                                part[u][m] = K6_DOT(part[u][m], q[u],
                                                    kt_bcast4(x + m * K + 128 * h +
                                                              32 * (tp + 2 * u) + 4 * c));
                    }
                    for (int u = 0; u < 2; u++)
                        for (int m = 0; m < MG; m++)
                            isum[m] += k6_scaled(part[u][m], sc[u], 2 * tp + half);
                }
    }
}

/* The superblock at p, p2 against MG activation rows (at x, K bytes apart): isum[m] = the
   scaled sums. A value's decode is shared by the MG rows. */
static inline __attribute__((always_inline)) void k6_many(const uint8_t *p, const uint8_t *p2,
                                                         const int8_t *x, int64_t K, int MG,
                                                         vi *isum) {
    for (int m = 0; m < MG; m++) isum[m] = (vi){0};
    /* value 128 h + 32 t + l (l < 32): nibble t / 2 of byte 64 h + 32 (t % 2) + l, and
       bits 2 t, 2 t + 1 of high-part byte 32 h + l; its block of 16 (scale g) is
       8 h + 2 t + l / 16 */
#pragma GCC unroll 2
    for (int h = 0; h < 2; h++)
#pragma GCC unroll 4
        for (int t = 0; t < 4; t++)
#pragma GCC unroll 2
            for (int half = 0; half < 2; half++) {
                const int g = 8 * h + 2 * t + half;
                const vi sc = kt_lanes(p, p2, K6_SCALES + g / 4);
#pragma GCC unroll 2
                for (int c0 = 4 * half; c0 < 4 * half + 4; c0 += K6_DEPTH) {
                    vi part[KT_TILE_M];
                    for (int m = 0; m < MG; m++) part[m] = (vi){0};
#pragma GCC unroll 4
                    for (int c = c0; c < c0 + K6_DEPTH; c++) {  /* l = 4 c .. 4 c + 3 */
                        const vi ql = kt_lanes(p, p2, K6_NIBBLES + 16 * h + 8 * (t % 2) + c);
                        const vi qh = kt_lanes(p, p2, K6_HIGH + 8 * h + c);
                        const vi lo = (t / 2 ? (vi)((vu)ql >> 4) : ql) & 0x0f0f0f0f;
                        const vi hi = t == 3 ? (vi)((vu)qh >> 2) : qh << (4 - 2 * t);
                        const vi q = lo | (hi & 0x30303030);
                        for (int m = 0; m < MG; m++) {
                            part[m] = K6_DOT(part[m], q,
                                             kt_bcast4(x + m * K + 128 * h + 32 * t + 4 * c));
                            keep_sum(part[m]);
                        }
                    }
                    for (int m = 0; m < MG; m++) {
                        isum[m] += k6_scaled(part[m], sc, g % 4);
                        keep_sum(isum[m]);
                    }
                }
            }
}

static inline __attribute__((always_inline)) void kt_set(const struct kt_job_i8 *j,
                                                          const uint8_t *p, const uint8_t *p2,
                                                          int lane0, int64_t m0, int MG,
                                                          float *y, const float *bias,
                                                          int rows) {
    const int64_t K = j->K, nsb = j->nsb;
    vf acc[KT_TILE_M];
    for (int m = 0; m < MG; m++) acc[m] = (vf){0};
    /* the next set's superblock b (its groups follow this set's) */
    const int64_t ahead = (VL < 8 ? 8 : VL) * j->row_bytes;
    for (int64_t b = 0; b < nsb; b++, p += KT_ROWS * KT_BYTES, p2 += KT_ROWS * KT_BYTES) {
#pragma GCC unroll 32
        for (int i = 0; i < KT_ROWS * KT_BYTES; i += 64) {
            __builtin_prefetch(p + ahead + i);
            if (VL == 16) __builtin_prefetch(p2 + ahead + i);
        }
        vi isum[KT_TILE_M];
        const int8_t *x = j->xq + m0 * K + b * QK_K;
        if (MG <= K6_FEW)
            k6_few(p, p2, x, K, MG, isum);
        else
            k6_many(p, p2, x, K, MG, isum);
        /* imin = 32 sum_g sc_g s_g: the scales of blocks 2 i, 2 i + 1 as the words of a lane
           against s_2i, s_2i+1 */
        vi pairs[8];
        for (int i = 0; i < 8; i++)
            pairs[i] = k6_words(kt_lanes(p, p2, K6_SCALES + i / 2), 2 * (i % 2), 2 * (i % 2) + 1);
        const vf d = k6_d(p - 2 * lane0 + K6_TAIL, p2 + K6_TAIL);
        for (int m = 0; m < MG; m++) {
            const int16_t *s = j->XW + ((m0 + m) * nsb + b) * KT_GROUPS;
            vi imin = (vi){0};
            for (int i = 0; i < 8; i++) imin += madd16(pairs[i], kt_bcast4(s + 2 * i));
            const int64_t g = (m0 + m) / VL, l = (m0 + m) % VL;
            const vf dx = splatv(j->XD[(g * nsb + b) * VL + l]);
            acc[m] = fmav(__builtin_convertvector(isum[m] - 32 * imin, vf), dx * d, acc[m]);
        }
    }
    for (int m = 0; m < MG; m++) {
        float out[VL];
        memcpy(out, &acc[m], sizeof out);
        for (int l = 0; l < rows; l++) y[m * j->ldy + l] = out[l] + (bias ? bias[l] : 0.f);
    }
}

/* kt_set with the tile's row count a constant (its loops unrolled per count). */
#define K6_SET(MG_) kt_set(j, p, p2, lane0, m0, MG_, y, bias, rows)
static void kt_tile(const struct kt_job_i8 *j, const uint8_t *p, const uint8_t *p2, int lane0,
                    int64_t m0, int mt, float *y, const float *bias, int rows) {
    switch (mt) {
        case 1: K6_SET(1); break;
        case 2: K6_SET(2); break;
        case 3: K6_SET(3); break;
        case 4: K6_SET(4); break;
        case 5: K6_SET(5); break;
        case 6: K6_SET(6); break;
        case 7: K6_SET(7); break;
        default: K6_SET(KT_TILE_M);
    }
}
#undef K6_SET
