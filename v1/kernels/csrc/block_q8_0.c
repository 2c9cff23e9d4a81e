/* GGUF q8_0 blocks, tuned (block_tiles.h): 32 values as fp16 d, 32 signed bytes; x = d q.
   With BT_ROWS rows interleaved (block_q8_0x8.c) a block's d is moved past its 8 dwords of
   quants: dword f (values 4 f .. 4 f + 3) of row i at p + 4 BT_ROWS f, the rows' d row by row
   after the group's dwords (BT_SCALES). */
#include "isa.h"
#include "vec.h"

#include <stdint.h>
#include <string.h>

#ifndef BT_ROWS
#define BT_ROWS 1
#define BT_FN(f) block_q8_0_##f
#endif
#define BT_BYTES 34
#define BT_SCALES (BT_ROWS > 1 ? 4 * BT_ROWS * 8 : 0)
#define BT_MIN 0
#define BT_SIGNED 1
#define BT_WMAX 127
#define BT_HALVES 2
/* Its 8 column vectors ahead made the memory-bound LM head slower (docs/kernels.md). */
#define BT_COLS_AHEAD 0

/* Values VL c .. VL c + VL - 1 of the block before scaling, as floats. Bytes are widened to
   int32 before float: GCC 12 converts bytes straight to float one at a time, and widens only
   unsigned bytes in one instruction (vpmovzxbd), so without a widening load the signed bytes
   go through uint8 (q ^ 0x80 = q + 128). */
static inline __attribute__((always_inline)) vf bt_chunk(const uint8_t *p, int c) {
#if BT_ROWS > 1
    /* VL / 4 dwords, BT_ROWS dwords apart, widened unsigned, then signed */
    const vi q = widen_u8_dwords(p + 4 * BT_ROWS * (VL / 4) * c, 4 * BT_ROWS);
    return __builtin_convertvector((q ^ 0x80) - 0x80, vf);
#elif WIDEN_FROM_MEMORY
    return __builtin_convertvector(widen_s8(p + 2 + VL * c), vf);
#else
    u8v b;
    memcpy(&b, p + 2 + VL * c, VL);
    return __builtin_convertvector(__builtin_convertvector(b ^ 0x80, vi) - 128, vf);
#endif
}

static inline const uint8_t *bt_group4(const uint8_t *p, int j) {
    return BT_ROWS > 1 ? p + 4 * BT_ROWS * j : p + 2 + 4 * j;
}
/* + 128 where the weights go into dot4, unsigned (block_tiles.h's W_OFFSET). */
static inline vi bt_weight_bytes(vi bytes4, vi qh, int j) {
    (void)qh, (void)j;
    return bytes4 ^ (INT8_SIGNED_WEIGHTS ? 0 : (int32_t)0x80808080u);
}
static inline int64_t bt_qs(int h) { return BT_ROWS > 1 ? 16 * BT_ROWS * h : 2 + 16 * h; }

#include "block_tiles.h"
