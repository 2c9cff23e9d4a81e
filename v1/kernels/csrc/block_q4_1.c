/* GGUF q4_1 blocks, tuned (block_tiles.h): 32 values as fp16 d, fp16 m, 16 bytes of nibbles
   (block_nibbles.h); x = d q + m. A block is 5 dwords (d and m, then the nibbles' 4): dword f
   at p + 4 BT_ROWS f, so block_q4_1x8.c builds the same kernels for 8 rows interleaved. */
#ifndef BT_ROWS
#define BT_ROWS 1
#define BT_FN(f) block_q4_1_##f
#endif
#define BT_BYTES 20
#define BT_MIN 1
#define BT_QS 4
#define BT_QH 0
#define BT_ZERO 0
/* The next block's columns ahead: 4 vectors more beside 2 MF sums fit the registers
   (docs/kernels.md). */
#define BT_COLS_AHEAD 1

#include "block_nibbles.h"
