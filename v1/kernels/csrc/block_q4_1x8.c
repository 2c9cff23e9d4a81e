/* q4_1 blocks with 8 rows interleaved (block_tiles.h's BT_ROWS): each group of 8 rows
   stores its blocks b together, as 5 runs of 8 dwords (the rows' d and m, then dword c of
   their nibbles, c < 4), so tile_i8_few loads its VL rows' scales and columns plainly where
   q4_1 gathers and transposes them. The same bytes as q4_1's, moved (block_matmul.py's
   `interleave`). */
#define BT_ROWS 8
#define BT_FN(f) block_q4_1x8_##f
#include "block_q4_1.c"
