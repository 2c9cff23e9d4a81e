/* GGUF q4_1 blocks, tuned (block_tiles.h): 32 values as fp16 d, fp16 m, 16 bytes of nibbles
   (value j < 16 the low nibble of byte j, j + 16 its high nibble); x = d q + m. A block is 5
   dwords (d and m, then the nibbles' 4): dword f at p + 4 BT_ROWS f, so block_q4_1x8.c
   builds the same kernels for 8 rows interleaved. */
#include "isa.h"
#include "vec.h"

#include <stdint.h>
#include <string.h>

#ifndef BT_ROWS
#define BT_ROWS 1
#define BT_FN(f) block_q4_1_##f
#endif
#define BT_BYTES 20
#define BT_MIN 1
#define BT_SIGNED 0
#define BT_WMAX 15
#define BT_HALVES 1
/* The next block's columns ahead: 4 vectors more beside 2 MF sums fit the registers
   (docs/kernels.md). */
#define BT_COLS_AHEAD 1

/* Values VL c .. VL c + VL - 1 of the block before scaling, as floats: the low nibbles of
   bytes VL c .. for the first half of the chunks, then the high ones (as int32: GCC's vector
   extensions would split bytes emulating a byte shift). */
static inline __attribute__((always_inline)) vf bt_chunk(const uint8_t *p, int c) {
    const int at = VL * (c % (BV / 2));  /* the first of the nibbles' bytes */
    vi q;
    if (BT_ROWS > 1) {
        q = widen_u8_dwords(p + 4 * BT_ROWS * (1 + at / 4), 4 * BT_ROWS);
    } else {
#if WIDEN_FROM_MEMORY
        q = widen_u8(p + 4 + at);
#else
        u8v b;
        memcpy(&b, p + 4 + at, VL);
        q = __builtin_convertvector(b, vi);
#endif
    }
    return __builtin_convertvector(c < BV / 2 ? q & 15 : (vi)((vu)q >> 4), vf);
}

/* Values j and j + 16 share byte j: groups j and j + 4 read the same 4 bytes. */
static inline const uint8_t *bt_group4(const uint8_t *p, int j) {
    return p + 4 * BT_ROWS * (1 + (j & 3));
}
static inline vi bt_weight_bytes(vi bytes4, int j) {
    return (j < 4 ? bytes4 : bytes4 >> 4) & 0x0f0f0f0f;
}
static inline int64_t bt_qs(int h) { (void)h; return 4 * BT_ROWS; }

#include "block_tiles.h"
