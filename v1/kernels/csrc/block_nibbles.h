/* block_tiles.h's format hooks for GGUF's 4- and 5-bit blocks of 32 values (q4_0, q4_1, q5_0,
   q5_1): an fp16 scale d (and min m), 16 bytes of nibbles at BT_QS (value j < 16 the low
   nibble of byte j, j + 16 its high nibble) and, with 5 bits, a little-endian dword of fifth
   bits at BT_QH (bit j is value j's 16). x = d (q - BT_ZERO) (+ m). A format's file defines
   BT_QS, BT_QH (0: no fifth bits) and BT_ZERO beside block_tiles.h's BT_*, then includes this.
   Offsets are bytes in a block of one row; with BT_ROWS rows interleaved (q4_1x8), dword f of
   a block is at p + 4 BT_ROWS f, so offset o (a multiple of 4) at p + BT_ROWS o. */
#include "isa.h"
#include "vec.h"

#include <stdint.h>
#include <string.h>

#define BT_SIGNED 0
#define BT_WMAX (BT_QH ? 31 : 15)
#define BT_HALVES 1
_Static_assert(BT_ROWS == 1 || (BT_QS % 4 == 0 && !BT_QH), "interleaved: dwords, no fifth bits");

/* The fifth bits of values VL c .. VL c + VL - 1, as 16 or 0. */
static inline __attribute__((always_inline)) vi fifth_bits(const uint8_t *p, int c) {
    uint32_t qh;
    memcpy(&qh, p + BT_QH, 4);
    vu bit;
    for (int l = 0; l < VL; l++) bit[l] = 1u << (VL * c + l);
    return ((((vu){0} + qh) & bit) != 0) & 16;
}

/* Values VL c .. VL c + VL - 1 of the block before scaling, as floats: the low nibbles of
   bytes VL c .. for the first half of the chunks, then the high ones (as int32: GCC's vector
   extensions would split bytes emulating a byte shift). */
static inline __attribute__((always_inline)) vf bt_chunk(const uint8_t *p, int c) {
    const int at = VL * (c % (BV / 2));  /* the first of the nibbles' bytes */
    vi q;
    if (BT_ROWS > 1) {
        q = widen_u8_dwords(p + BT_ROWS * (BT_QS + at), 4 * BT_ROWS);
    } else {
#if WIDEN_FROM_MEMORY
        q = widen_u8(p + BT_QS + at);
#else
        u8v b;
        memcpy(&b, p + BT_QS + at, VL);
        q = __builtin_convertvector(b, vi);
#endif
    }
    q = c < BV / 2 ? q & 15 : (vi)((vu)q >> 4);
    if (BT_QH) q |= fifth_bits(p, c);
    return __builtin_convertvector(BT_ZERO ? q - BT_ZERO : q, vf);
}

/* Values j and j + 16 share byte j: groups j and j + 4 read the same 4 bytes. */
static inline const uint8_t *bt_group4(const uint8_t *p, int j) {
    return p + BT_ROWS * (BT_QS + 4 * (j & 3));
}
/* The nibbles of group j, and its 4 fifth bits (qh's bits 4j ..) as bit 4 of each byte: the
   product puts copies of those 4 bits 4, 11, 18 and 25 places up, which do not overlap. */
static inline vi bt_weight_bytes(vi bytes4, vi qh, int j) {
    vi u = (j < 4 ? bytes4 : bytes4 >> 4) & 0x0f0f0f0f;
    if (BT_QH) u |= (vi)((((vu)qh >> (4 * j)) & 15) * 0x02040810u & 0x10101010u);
    return u;
}
static inline int64_t bt_qs(int h) { (void)h; return BT_ROWS * BT_QS; }

#include "block_tiles.h"
