/* Which version of each block-kernel primitive this build compiles to: the best one the
   compiler targets (the variant's -march, variants.py), else the plain C of isa_generic.h.
   The one place that chooses: adding an ISA is adding its file of primitives and its lines
   here. */
#ifndef V1_ISA_H
#define V1_ISA_H

#include "isa_generic.h"
#if defined(__x86_64__) || defined(__i386__)
#include "isa_x86.h"
#endif

#ifdef __F16C__
#define fp16 fp16_f16c
#else
#define fp16 fp16_generic
#endif

#if VL == 16
#define fmav fmav_avx512
#define halves halves_avx512
#define gatherv gatherv_avx512
#define columns4 columns4_avx512
#elif VL == 8 && defined(__AVX2__) && defined(__F16C__) && defined(__FMA__)
#define fmav fmav_fma
#define halves halves_avx2
#define gatherv gatherv_avx2
#define columns4 columns4_avx2
#else
#define fmav fmav_generic
#define halves halves_generic
#define gatherv gatherv_generic
#define columns4 columns4_generic
#endif

/* The integer dot product of 4 unsigned weight bytes and 4 signed activation bytes per lane
   (dot4; with AVX2 also dot4_i16 + widen_i16, its pair sums kept as int16 until a block's
   end, and dot4s for signed weight bytes), by INT8_ISA (v1_block_int8_isa(); INT8_ISAS in block_matmul.py): 3 vpdpbusd on 16 lanes
   (AVX-512 VNNI), 2 vpdpbusd on 8 (AVX-VNNI), 1 AVX2's vpmaddubsw + vpmaddwd on 8, 0 plain
   C. */
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
#else
#define INT8_ISA 0
#define dot4 dot4_generic
#endif

/* Whether signed weight bytes go into dot4s as they are (else a signed format's bytes go
   into dot4 + 128, and 128 * sum(x) comes off after). */
#ifdef dot4s
enum { INT8_SIGNED_WEIGHTS = 1 };
#else
enum { INT8_SIGNED_WEIGHTS = 0 };
#endif

/* Widening VL bytes from memory in one instruction (else the formats' plain conversions). */
#if VL == 16 && defined(__F16C__)
#define WIDEN_FROM_MEMORY 1
#define widen_u8 widen_u8_avx512
#define widen_s8 widen_s8_avx512
#elif VL == 8 && defined(__AVX2__)
#define WIDEN_FROM_MEMORY 1
#define widen_u8 widen_u8_avx2
#define widen_s8 widen_s8_avx2
#else
#define WIDEN_FROM_MEMORY 0
#endif

#endif
