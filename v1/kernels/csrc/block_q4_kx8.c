/* q4_k superblocks with 8 rows interleaved: each group of 8 rows stores its superblocks b
   together, as 36 runs of 8 dwords (dword f of the 8 rows: d and dmin, the 3 of scales and
   mins, then the nibbles' 32), the same bytes as q4_k's, moved (block_matmul.py's
   `interleave`). The int8 path puts VL weight rows in the lanes of a vector: a run is one
   plain load (AVX-512: two runs, of two groups), its nibbles go into dot4 against 4 values of
   an activation row broadcast from memory, and the 6-bit scales and mins unpack in each lane
   with shifts and masks: no gather, no transpose, no reduction across lanes (q4_k's tile
   spends a third of its instructions on shuffles). dequantize and linear_f32 are q4_k's on
   each superblock's dwords gathered back. */
#define KT_ROWS 8
#define KT_FN(f) block_q4_kx8_##f
#include "block_q4_k.c"

/* Activation rows per pass over a set's weights (their sums stay in registers). */
#if NREGS >= 32
#define KX_MG 4
#else
#define KX_MG 2
#endif

/* Dword f of VL rows' superblock (p: the first row's dword 0 in its group; AVX-512: p2, the
   next group's, or p again for a last group alone). */
static inline __attribute__((always_inline)) vi kx_dwords(const uint8_t *p, const uint8_t *p2,
                                                          int f) {
#if VL == 16
    return join_halves(p + 32 * f, p2 + 32 * f);
#else
    (void)p2;
    return loadvi(p + 32 * f);
#endif
}

/* 4 bytes at p in every lane (a broadcast load). */
static inline vi kx_bcast(const void *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return (vi){0} + v;
}

/* The 4 products of 4 nibbles and 4 activation bytes, summed per lane (pair sums as int16
   where the ISA keeps them so: 8 of them stay within 8 x 2 x 15 x 127), and such sums over
   32 values times a scale per lane (below 64), exactly. */
#ifdef dot4_i16
#define KX_DOT dot4_i16
static inline vi kx_scaled(vi sums, vi sc) { return madd16(sums, sc | sc << 16); }
#else
#define KX_DOT dot4
static inline vi kx_scaled(vi sums, vi sc) { return sums * sc; }
#endif

/* Byte k of each lane of v, as the lane's int32. */
static inline vi kx_byte(vi v, int k) { return (vi)((vu)v >> (8 * k)) & 0xff; }

/* VL weight rows (their superblocks at p, p2; `rows` of them real) against activation rows
   m0 .. m0 + MG - 1: y[m * ldy + lane] for each. */
static inline __attribute__((always_inline)) void kx_set(const struct kt_job_i8 *j,
                                                          const uint8_t *p, const uint8_t *p2,
                                                          int64_t m0, int MG, float *y,
                                                          const float *bias, int rows) {
    const int64_t K = j->K, nsb = j->nsb;
    vf acc[KX_MG];
    for (int m = 0; m < MG; m++) acc[m] = (vf){0};
    /* the next set's superblock b (its groups follow this set's) */
    const int64_t ahead = (VL < 8 ? 8 : VL) * j->row_bytes;
    for (int64_t b = 0; b < nsb; b++, p += 8 * KT_BYTES, p2 += 8 * KT_BYTES) {
        for (int i = 0; i < 8 * KT_BYTES; i += 64) {
            __builtin_prefetch(p + ahead + i);
            if (VL == 16) __builtin_prefetch(p2 + ahead + i);
        }
        /* the scales' and mins' 12 bytes per lane (kt_scales_6bit): 0-3, then 4-7 */
        const vi s0 = kx_dwords(p, p2, 1), s1 = kx_dwords(p, p2, 2), s2 = kx_dwords(p, p2, 3);
        const vi sc[2] = {s0 & 0x3f3f3f3f, (s2 & 0x0f0f0f0f) | ((s0 >> 2) & 0x30303030)};
        vi isum[KX_MG];
        for (int m = 0; m < MG; m++) isum[m] = (vi){0};
        for (int h = 0; h < 4; h++) {  /* values 64 h .. 64 h + 63: sub-blocks 2 h, 2 h + 1 */
            vi lo[KX_MG], hi[KX_MG];
            for (int m = 0; m < MG; m++) lo[m] = hi[m] = (vi){0};
            for (int t = 0; t < 8; t++) {
                const vi q = kx_dwords(p, p2, 4 + 8 * h + t);
                const vi ql = q & 0x0f0f0f0f, qh = (vi)((vu)q >> 4) & 0x0f0f0f0f;
                for (int m = 0; m < MG; m++) {
                    const int8_t *x = j->xq + (m0 + m) * K + b * QK_K + 64 * h + 4 * t;
                    lo[m] = KX_DOT(lo[m], ql, kx_bcast(x));
                    hi[m] = KX_DOT(hi[m], qh, kx_bcast(x + 32));
                }
            }
            const vi sl = kx_byte(sc[h / 2], 2 * (h % 2)), sh = kx_byte(sc[h / 2], 2 * (h % 2) + 1);
            for (int m = 0; m < MG; m++) isum[m] += kx_scaled(lo[m], sl) + kx_scaled(hi[m], sh);
        }
        const vi mn[2] = {s1 & 0x3f3f3f3f,
                          ((vi)((vu)s2 >> 4) & 0x0f0f0f0f) | ((s1 >> 2) & 0x30303030)};
        const vi dd = kx_dwords(p, p2, 0);
        const vf d = halves(dd, 0), dmin = halves(dd, 1);
        for (int m = 0; m < MG; m++) {
            /* imin: the min of sub-block i (both words) against s_2i and s_2i+1 */
            const int16_t *s = j->XW + ((m0 + m) * nsb + b) * KT_GROUPS;
            vi imin = (vi){0};
            for (int i = 0; i < 8; i++) {
                const vi w = kx_byte(mn[i / 4], i % 4);
                imin += madd16(w | w << 16, kx_bcast(s + 2 * i));
            }
            const int64_t g = (m0 + m) / VL, l = (m0 + m) % VL;
            const vf dx = splatv(j->XD[(g * nsb + b) * VL + l]);
            acc[m] = fmav(__builtin_convertvector(isum[m], vf), dx * d,
                          fmav(__builtin_convertvector(imin, vf), dx * -dmin, acc[m]));
        }
    }
    for (int m = 0; m < MG; m++) {
        float out[VL];
        memcpy(out, &acc[m], sizeof out);
        for (int l = 0; l < rows; l++) y[m * j->ldy + l] = out[l] + (bias ? bias[l] : 0.f);
    }
}

#define KX_SET(MG_) kx_set(j, p, p2, m0, MG_, y, bias, rows)

/* Sets of VL weight rows s0 .. s1 - 1 (rows VL s ..; a last set on AVX-512 may be one group),
   each against every activation row, KX_MG at a time. */
static void kt_i8_sets(void *ctx, int64_t s0, int64_t s1, int thread) {
    const struct kt_job_i8 *j = ctx;
    (void)thread;
    for (int64_t s = s0; s < s1; s++) {
        const int64_t n0 = s * VL;
        const uint8_t *p = j->w + (n0 - n0 % 8) * j->row_bytes + n0 % 8 * 4;
        const int rows = (int)(j->N - n0 < VL ? j->N - n0 : VL);
        const uint8_t *p2 = rows > 8 ? p + 8 * j->row_bytes : p;
        const float *bias = j->bias ? j->bias + n0 : NULL;
        for (int64_t m0 = 0; m0 < j->M; m0 += KX_MG) {
            float *y = j->y + m0 * j->ldy + n0;
            switch (j->M - m0 < KX_MG ? j->M - m0 : KX_MG) {
                case 1: KX_SET(1); break;
#if KX_MG == 4
                case 2: KX_SET(2); break;
                case 3: KX_SET(3); break;
#endif
                default: KX_SET(KX_MG);
            }
        }
    }
}
