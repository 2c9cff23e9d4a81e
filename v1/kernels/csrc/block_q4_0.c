/* GGUF q4_0 blocks, tuned (block_tiles.h): 32 values as fp16 d, 16 bytes of nibbles
   (block_nibbles.h); x = d (q - 8). */
#define BT_FN(f) block_q4_0_##f
#define BT_ROWS 1
#define BT_BYTES 18
#define BT_MIN 0
#define BT_QS 2
#define BT_ZERO 8
#define BT_QH 0
#define BT_COLS_AHEAD 1

#include "block_nibbles.h"
