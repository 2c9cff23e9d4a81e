/* GGUF q8_0 blocks, tuned (block_tiles.h): 32 values as fp16 d, 32 signed bytes; x = d q. */
#include "isa.h"
#include "vec16.h"

#include <stdint.h>
#include <string.h>

#define BT_FN(f) block_q8_0_##f
#define BT_BYTES 34
#define BT_MIN 0
#define BT_SIGNED 1
#define BT_HALVES 2
/* Its 8 column vectors ahead made the memory-bound LM head slower (docs/kernels.md). */
#define BT_COLS_AHEAD 0

/* Bytes are widened to int32 before float: GCC 12 converts bytes straight to float one at
   a time, and widens only unsigned bytes in one instruction (vpmovzxbd), so the signed bytes
   go through uint8 (q ^ 0x80 = q + 128). */
static inline __attribute__((always_inline)) void bt_values(const uint8_t *p, v16 *lo,
                                                            v16 *hi) {
    u8x16 a, b;
    memcpy(&a, p + 2, 16);
    memcpy(&b, p + 18, 16);
    *lo = __builtin_convertvector(__builtin_convertvector(a ^ 0x80, v16i) - 128, v16);
    *hi = __builtin_convertvector(__builtin_convertvector(b ^ 0x80, v16i) - 128, v16);
}

#if WIDEN16_FROM_MEMORY
static inline __attribute__((always_inline)) void bt_values_dot1(const uint8_t *p, v16 *lo,
                                                                 v16 *hi) {
    *lo = __builtin_convertvector(widen16_s8_avx512(p + 2), v16);
    *hi = __builtin_convertvector(widen16_s8_avx512(p + 18), v16);
}
#else
#define bt_values_dot1 bt_values
#endif

static inline const uint8_t *bt_group4(const uint8_t *p, int j) { return p + 2 + 4 * j; }
/* + 128 where dot4 needs unsigned weights (block_tiles.h's W_OFFSET). */
static inline v16i bt_weight_bytes(v16i bytes4, int j) {
    (void)j;
    return bytes4 ^ (INT8_SIGNED_WEIGHTS ? 0 : (int32_t)0x80808080u);
}
static inline int64_t bt_qs(int h) { return 2 + 16 * h; }

#include "block_tiles.h"
