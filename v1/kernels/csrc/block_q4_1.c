/* GGUF q4_1 blocks, tuned (block_tiles.h): 32 values as fp16 d, fp16 m, 16 bytes of nibbles
   (value j < 16 the low nibble of byte j, j + 16 its high nibble); x = d q + m. */
#include "isa.h"
#include "vec16.h"

#include <stdint.h>
#include <string.h>

#define BT_FN(f) block_q4_1_##f
#define BT_BYTES 20
#define BT_MIN 1
#define BT_SIGNED 0
#define BT_HALVES 1
/* The next block's columns ahead: 4 vectors more beside 2 MF sums fit the registers
   (docs/kernels.md). */
#define BT_COLS_AHEAD 1

/* The 16 bytes are widened to int32 once and split into nibbles as int32 (GCC's vector
   extensions split them as bytes, emulating a byte shift). */
static inline __attribute__((always_inline)) void bt_values(const uint8_t *p, v16 *lo,
                                                            v16 *hi) {
    u8x16 q;
    memcpy(&q, p + 4, 16);
    *lo = __builtin_convertvector(__builtin_convertvector(q & 15, v16i), v16);
    *hi = __builtin_convertvector(__builtin_convertvector(q >> 4, v16i), v16);
}

#if WIDEN16_FROM_MEMORY
static inline __attribute__((always_inline)) void bt_values_dot1(const uint8_t *p, v16 *lo,
                                                                 v16 *hi) {
    const v16i q = widen16_u8_avx512(p + 4);
    *lo = __builtin_convertvector(q & 15, v16);
    *hi = __builtin_convertvector((v16i)((v16u)q >> 4), v16);
}
#else
#define bt_values_dot1 bt_values
#endif

/* Values j and j + 16 share byte j: groups j and j + 4 read the same 4 bytes. */
static inline const uint8_t *bt_group4(const uint8_t *p, int j) { return p + 4 + 4 * (j & 3); }
static inline v16i bt_weight_bytes(v16i bytes4, int j) {
    return (j < 4 ? bytes4 : bytes4 >> 4) & 0x0f0f0f0f;
}
static inline int64_t bt_qs(int h) { (void)h; return 4; }

#include "block_tiles.h"
