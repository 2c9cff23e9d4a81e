/* Which version of each block-kernel primitive this build compiles to: the best one the
   compiler targets (the variant's -march, variants.py), else the plain C of isa_generic.h.
   The one place that chooses: adding an ISA is adding its file of primitives and its lines
   here. */
#ifndef V1_ISA_H
#define V1_ISA_H

#include "isa_generic.h"
#if defined(__x86_64__) || defined(__i386__)
#include "isa_x86.h"
#elif defined(__aarch64__)
#include "isa_arm.h"
#endif

#ifdef __F16C__
#define fp16 fp16_f16c
#elif defined(__aarch64__)
#define fp16 fp16_neon
#else
#define fp16 fp16_generic
#endif
#if VL == 16
#define fp16v fp16v_avx512
#elif VL == 8 && defined(__F16C__)
#define fp16v fp16v_f16c
#elif defined(__aarch64__)
#define fp16v fp16v_neon
#else
#define fp16v fp16v_generic
#endif

#if VL == 16
#define fmav fmav_avx512
#define halves halves_avx512
#define gatherv gatherv_avx512
#define columns4 columns4_avx512
#define join_halves join_halves_avx512
#elif VL == 8 && defined(__AVX2__) && defined(__F16C__) && defined(__FMA__)
#define fmav fmav_fma
#define halves halves_avx2
#define gatherv gatherv_avx2
#define columns4 columns4_avx2
#define join_halves join_halves_generic
#elif defined(__aarch64__)
#define fmav fmav_neon
#define halves halves_neon
#define gatherv gatherv_generic  /* already 4 loads and 3 inserts */
#define columns4 columns4_neon
#define join_halves join_halves_generic
#else
#define fmav fmav_generic
#define halves halves_generic
#define gatherv gatherv_generic
#define columns4 columns4_generic
#define join_halves join_halves_generic
#endif

/* The integer dot product of 4 unsigned weight bytes and 4 signed activation bytes per lane
   (dot4; where the ISA has them, dot4s for signed weight bytes, and dot4_i16 + widen_i16 with
   the pair sums kept as int16 until a block's end), by INT8_ISA (v1_block_int8_isa();
   INT8_ISAS in block_matmul.py): 3 vpdpbusd on 16 lanes (AVX-512 VNNI), 2 vpdpbusd on 8
   (AVX-VNNI), 1 AVX2's vpmaddubsw + vpmaddwd on 8, 4 SDOT on 4 (AArch64's dot-product
   extension), 5 NEON's widening multiplies and pairwise adds on 4 (AArch64 without it), 0
   plain C. Both AArch64 forms are signed x signed: there dot4's unsigned weight bytes must be
   below 128, as q4_1's nibbles are. */
#if VL == 16 && defined(__AVX512VNNI__)
#define INT8_ISA 3
#define dot4 dot4_avx512vnni
#elif VL == 8 && defined(__AVXVNNI__)
#define INT8_ISA 2
#define dot4 dot4_avxvnni
#elif VL == 8 && defined(__AVX2__)
#define INT8_ISA 1
#define dot4 dot4_avx2
#define dot4s dot4s_avx2
#define dot4_i16 dot4_i16_avx2
#define widen_i16 widen_i16_avx2
#elif defined(__aarch64__) && defined(__ARM_FEATURE_DOTPROD)
#define INT8_ISA 4
#define dot4 sdot_neon_dotprod
#define dot4s sdot_neon_dotprod
#elif defined(__aarch64__)
#define INT8_ISA 5
#define dot4 sdot_neon
#define dot4s sdot_neon
#else
#define INT8_ISA 0
#define dot4 dot4_generic
#endif

/* keep_sum(v): the integer sum v is in a register here, so its adds stay one chain. AVX2's
   dot4 forms end in a plain add, and GCC reassociated a sum's adds over a block into a tree:
   every product of a tile's rows was then live at once, and with 16 registers they spilled
   (tile_i8_few at 8 rows: 124 stack accesses a block, 18 kept). The other ISAs' forms are
   one instruction taking the sum: no tree forms there. */
#if INT8_ISA == 1
#define keep_sum(v) __asm__("" : "+x"(v))
#else
#define keep_sum(v) ((void)0)
#endif

/* Whether signed weight bytes go into dot4s as they are (else a signed format's bytes go
   into dot4 + 128, and 128 * sum(x) comes off after). */
#ifdef dot4s
enum { INT8_SIGNED_WEIGHTS = 1 };
#else
enum { INT8_SIGNED_WEIGHTS = 0 };
#endif

/* Widening VL bytes from memory in one instruction (NEON: a load and two), else the formats'
   plain conversions; widen_u8_dwords gathers them 4 at a time first (rows interleaved). */
#if VL == 16 && defined(__F16C__)
#define WIDEN_FROM_MEMORY 1
#define widen_u8 widen_u8_avx512
#define widen_s8 widen_s8_avx512
#define widen_u8_dwords widen_u8_dwords_avx512
#elif VL == 8 && defined(__AVX2__)
#define WIDEN_FROM_MEMORY 1
#define widen_u8 widen_u8_avx2
#define widen_s8 widen_s8_avx2
#define widen_u8_dwords widen_u8_dwords_avx2
#elif defined(__aarch64__)
#define WIDEN_FROM_MEMORY 1
#define widen_u8 widen_u8_neon
#define widen_s8 widen_s8_neon
#define widen_u8_dwords widen_u8_dwords_generic
#else
#define WIDEN_FROM_MEMORY 0
#define widen_u8_dwords widen_u8_dwords_generic
#endif

/* The K-quant tiles' integer primitives (block_ktiles.h). */
#if VL == 16 && defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define dot_sc dot_sc_avx512
#define madd16 madd16_avx512
#define words8 words8_avx512
#define bcast32 bcast32_avx512
#elif VL == 8 && defined(__AVX2__) && defined(__F16C__) && defined(__FMA__)
#define dot_sc dot_sc_avx2
#define madd16 madd16_avx2
#define words8 words8_avx2
#define bcast32 bcast32_generic
#else
#define dot_sc dot_sc_generic
#define madd16 madd16_generic
#define words8 words8_generic
#define bcast32 bcast32_generic
#endif

#endif
