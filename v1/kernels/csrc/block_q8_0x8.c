/* q8_0 blocks with 8 rows interleaved (block_tiles.h's BT_ROWS): each group of 8 rows stores
   its blocks b together, as 8 runs of 8 dwords (dword f of the rows' quants, f < 8), then the
   8 rows' fp16 d (16 bytes, row by row), so tile_i8_few loads its VL rows' quants and scales
   plainly where q8_0 gathers and transposes them. The same bytes as q8_0's, moved
   (`_interleave` in v1/models/layers/quantized.py, d first moved past the quants:
   block_matmul.py's LEADING). */
#define BT_ROWS 8
#define BT_FN(f) block_q8_0x8_##f
#include "block_q8_0.c"
