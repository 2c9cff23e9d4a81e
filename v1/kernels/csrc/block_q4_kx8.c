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
/* Activation rows per tile: each pass over a set's superblock holds its weights in registers
   while every row of the tile meets them, and the tile's sums live in memory (a load and a
   store per row and sub-block pass, against 8 or 16 dot products). */
#define KT_TILE_M 32
#include "block_q4_k.c"

/* Sub-blocks of 32 values per pass: both nibbles of a run of 8 loads (16 registers of
   weights) with 32 registers; with 16, one (8 registers). */
#if NREGS >= 32
#define KX_SUBS 2
#else
#define KX_SUBS 1
#endif

/* The 4 products of 4 nibbles and 4 activation bytes, summed per lane (pair sums as int16
   where the ISA keeps them so: 8 of them stay within 8 x 2 x 15 x 127), and such sums over
   32 values times a scale per lane (below 64; kx_scale: in the form kx_scaled takes),
   exactly. */
#ifdef dot4_i16
#define KX_DOT dot4_i16
static inline vi kx_scale(vi sc) { return sc | sc << 16; }
static inline vi kx_scaled(vi sums, vi k) { return madd16(sums, k); }
#else
#define KX_DOT dot4
static inline vi kx_scale(vi sc) { return sc; }
static inline vi kx_scaled(vi sums, vi k) { return sums * k; }
#endif

/* KX_DOT against the 4 activation bytes at x in every lane. With AVX-512 the broadcast is
   vpdpbusd's own memory operand ({1to16}: one fused uop, where GCC issues a separate
   broadcast load for each; 5-10% of the time at 512 rows). */
static inline __attribute__((always_inline)) vi kx_dot(vi acc, vi w, const int8_t *x) {
#if VL == 16 && defined(__AVX512VNNI__)
    __asm__("vpdpbusd %1%{1to16%}, %2, %0" : "+v"(acc) : "m"(*(const int8_t(*)[4])x), "v"(w));
    return acc;
#else
    return KX_DOT(acc, w, kt_bcast4(x));
#endif
}

/* Byte k of each lane of v, as the lane's int32. */
static inline vi kx_byte(vi v, int k) { return (vi)((vu)v >> (8 * k)) & 0xff; }

/* Activation rows whose dot products run together in kx_pass (independent chains:
   vpdpbusd's latency would otherwise bound a row's 8 dependent ones; vpmaddubsw's pair sums
   add in one cycle, and with AVX2's 16 registers a second row measured slower), and the most
   rows a tile takes kx_few for. */
#ifdef dot4_i16
#define KX_MG 1
#define KX_FEW 2
#else
#define KX_MG 4
#define KX_FEW 4
#endif

/* Sub-block s's nibbles (values 32 s + 4 t .. 32 s + 4 t + 3 of VL rows) from q, the dword
   4 + 8 (s / 2) + t that holds them. */
static inline vi kx_nibbles(vi q, int s) { return (s % 2 ? (vi)((vu)q >> 4) : q) & 0x0f0f0f0f; }

/* Activation rows 0 .. MG - 1 (at x, K bytes apart, from value 32 s of their superblock)
   against sub-blocks s .. s + SUBS - 1 of the superblock at p, p2 (their scale words k[]):
   isum[m] += the scaled sums (= with `first`). The nibbles are w's (kx_pass unpacked them
   once for its groups of rows) or, w NULL, loaded here as the dot products take them (a tile
   of at most KX_FEW rows: too few to share them). */
static inline __attribute__((always_inline)) void kx_rows(const uint8_t *p, const uint8_t *p2,
                                                          int s, int SUBS, const vi (*w)[8],
                                                          const vi *k, const int8_t *x,
                                                          int64_t K, int MG, int first,
                                                          vi *isum) {
    vi d[KX_FEW][2];
    for (int m = 0; m < MG; m++)
        for (int u = 0; u < SUBS; u++) d[m][u] = (vi){0};
    for (int t = 0; t < 8; t++) {
        const vi q = w ? (vi){0} : kt_lanes(p, p2, 4 + 8 * (s / 2) + t);
        for (int u = 0; u < SUBS; u++) {
            const vi wt = w ? w[u][t] : kx_nibbles(q, s + u);
            for (int m = 0; m < MG; m++) {
                d[m][u] = kx_dot(d[m][u], wt, x + m * K + 32 * u + 4 * t);
                keep_sum(d[m][u]);
            }
        }
    }
    for (int m = 0; m < MG; m++) {
        vi sum = first ? (vi){0} : isum[m];
        for (int u = 0; u < SUBS; u++) sum += kx_scaled(d[m][u], k[u]);
        isum[m] = sum;
    }
}

/* The scale words of sub-blocks s .. s + n - 1 (sc: the scales' bytes, 0-3 then 4-7). */
static inline void kx_scales(const vi sc[2], int s, int n, vi *k) {
    for (int u = 0; u < n; u++) k[u] = kx_scale(kx_byte(sc[(s + u) / 4], (s + u) % 4));
}

#define KX_ROWS(MG_) kx_rows(p, p2, s, KX_SUBS, w, k, x + m * K + 32 * s, K, MG_, first, isum + m)

/* Sub-blocks s .. s + KX_SUBS - 1 of the superblock at p, p2 against activation rows
   0 .. mt - 1 of the tile (row m's superblock at x + m K), KX_MG at a time: isum[m] += the
   scaled sums (= in the superblock's first pass, `first`). */
static inline __attribute__((always_inline)) void kx_pass(const uint8_t *p, const uint8_t *p2,
                                                          int s, const int8_t *x, int64_t K,
                                                          int mt, int first, const vi sc[2],
                                                          vi *isum) {
    vi k[KX_SUBS], w[KX_SUBS][8];
    kx_scales(sc, s, KX_SUBS, k);
    for (int t = 0; t < 8; t++) {
        const vi q = kt_lanes(p, p2, 4 + 8 * (s / 2) + t);
        for (int u = 0; u < KX_SUBS; u++) w[u][t] = kx_nibbles(q, s + u);
    }
    int m = 0;
    for (; m + KX_MG <= mt; m += KX_MG) KX_ROWS(KX_MG);
#if KX_MG == 4
    switch (mt - m) {
        case 1: KX_ROWS(1); break;
        case 2: KX_ROWS(2); break;
        case 3: KX_ROWS(3); break;
        default: break;
    }
#endif
}

/* The whole superblock at p, p2 against a tile of MG <= KX_FEW rows (at x, K bytes apart),
   both nibbles of each load at once: isum[m] = the scaled sums. */
static inline __attribute__((always_inline)) void kx_few(const uint8_t *p, const uint8_t *p2,
                                                         const int8_t *x, int64_t K, int MG,
                                                         const vi sc[2], vi *isum) {
#pragma GCC unroll 4
    for (int s = 0; s < 8; s += 2) {
        vi k[2];
        kx_scales(sc, s, 2, k);
        kx_rows(p, p2, s, 2, NULL, k, x + 32 * s, K, MG, s == 0, isum);
    }
}

/* imin of one activation row: the mins of the 8 sub-blocks, as words in pairs (mp: (m_0,
   m_2), (m_1, m_3), (m_4, m_6), (m_5, m_7)), against the row's sums S_j in the same pairs
   (XP). */
static inline vi kx_mins(const vi mp[4], const int32_t *xp) {
    vi imin = madd16(mp[0], kt_bcast4(xp));
    for (int i = 1; i < 4; i++) imin += madd16(mp[i], kt_bcast4(xp + i));
    return imin;
}

static void kt_tile(const struct kt_job_i8 *j, const uint8_t *p, const uint8_t *p2, int lane0,
                    int64_t m0, int mt, float *y, const float *bias, int rows) {
    (void)lane0;
    const int64_t K = j->K, nsb = j->nsb;
    vf acc[KT_TILE_M];
    vi isum[KT_TILE_M];
    for (int m = 0; m < mt; m++) acc[m] = (vf){0};
    /* the next set's superblock b (its groups follow this set's) */
    const int64_t ahead = (VL < 8 ? 8 : VL) * j->row_bytes;
    for (int64_t b = 0; b < nsb; b++, p += 8 * KT_BYTES, p2 += 8 * KT_BYTES) {
        for (int i = 0; i < 8 * KT_BYTES; i += 64) {
            __builtin_prefetch(p + ahead + i);
            if (VL == 16) __builtin_prefetch(p2 + ahead + i);
        }
        /* the scales' and mins' 12 bytes per lane (kt_scales_6bit): 0-3, then 4-7 */
        const vi s0 = kt_lanes(p, p2, 1), s1 = kt_lanes(p, p2, 2), s2 = kt_lanes(p, p2, 3);
        const vi sc[2] = {s0 & 0x3f3f3f3f, (s2 & 0x0f0f0f0f) | ((s0 >> 2) & 0x30303030)};
        const int8_t *x = j->xq + m0 * K + b * QK_K;
        switch (mt) {
            case 1: kx_few(p, p2, x, K, 1, sc, isum); break;
            case 2: kx_few(p, p2, x, K, 2, sc, isum); break;
#if KX_FEW == 4
            case 3: kx_few(p, p2, x, K, 3, sc, isum); break;
            case 4: kx_few(p, p2, x, K, 4, sc, isum); break;
#endif
            default:
                kx_pass(p, p2, 0, x, K, mt, 1, sc, isum);
                for (int s = KX_SUBS; s < 8; s += KX_SUBS) kx_pass(p, p2, s, x, K, mt, 0, sc, isum);
        }
        const vi mn[2] = {s1 & 0x3f3f3f3f,
                          ((vi)((vu)s2 >> 4) & 0x0f0f0f0f) | ((s1 >> 2) & 0x30303030)};
        const vi mp[4] = {mn[0] & 0x00ff00ff, (vi)((vu)mn[0] >> 8) & 0x00ff00ff,
                          mn[1] & 0x00ff00ff, (vi)((vu)mn[1] >> 8) & 0x00ff00ff};
        const vi dd = kt_lanes(p, p2, 0);
        const vf d = halves(dd, 0), dmin = halves(dd, 1);
        for (int m = 0; m < mt; m++) {
            const vi imin = kx_mins(mp, j->XP + ((m0 + m) * nsb + b) * 4);
            const int64_t g = (m0 + m) / VL, l = (m0 + m) % VL;
            const vf dx = splatv(j->XD[(g * nsb + b) * VL + l]);
            acc[m] = fmav(__builtin_convertvector(isum[m], vf), dx * d,
                          fmav(__builtin_convertvector(imin, vf), dx * -dmin, acc[m]));
        }
    }
    for (int m = 0; m < mt; m++) {
        float out[VL];
        memcpy(out, &acc[m], sizeof out);
        for (int l = 0; l < rows; l++) y[m * j->ldy + l] = out[l] + (bias ? bias[l] : 0.f);
    }
}

