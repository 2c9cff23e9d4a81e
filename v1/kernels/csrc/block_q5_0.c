/* GGUF q5_0 blocks, tuned (block_tiles.h): 32 values as fp16 d, a dword of fifth bits, 16
   bytes of nibbles (block_nibbles.h); x = d (q - 16). */
#define BT_FN(f) block_q5_0_##f
#define BT_ROWS 1
#define BT_BYTES 22
#define BT_MIN 0
#define BT_QH 2
#define BT_QS 6
#define BT_ZERO 16
#define BT_COLS_AHEAD 1

#include "block_nibbles.h"
