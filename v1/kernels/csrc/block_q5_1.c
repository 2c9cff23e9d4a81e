/* GGUF q5_1 blocks, tuned (block_tiles.h): 32 values as fp16 d, fp16 m, a dword of fifth
   bits, 16 bytes of nibbles (block_nibbles.h); x = d q + m. */
#define BT_FN(f) block_q5_1_##f
#define BT_ROWS 1
#define BT_BYTES 24
#define BT_MIN 1
#define BT_QH 4
#define BT_QS 8
#define BT_ZERO 0
#define BT_COLS_AHEAD 1

#include "block_nibbles.h"
