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

#if defined(__AVX512F__)
#define fma16 fma16_avx512
#define halves16 halves16_avx512
#elif defined(__FMA__)
#define fma16 fma16_fma
#else
#define fma16 fma16_generic
#endif
#if !defined(__AVX512F__) && defined(__F16C__)
#define halves16 halves16_f16c
#elif !defined(__AVX512F__)
#define halves16 halves16_generic
#endif

/* The integer dot product, by INT8_ISA (v1_block_int8_isa(); INT8_ISAS in block_matmul.py):
   3 vpdpbusd on 16 lanes (AVX-512 VNNI), 2 on two halves of 8 (AVX-VNNI), 1 AVX2's
   vpmaddubsw + vpmaddwd, 0 plain C. */
#if defined(__AVX512VNNI__) && defined(__AVX512F__)
#define INT8_ISA 3
#define dot4 dot4_avx512vnni
#define gather16 gather16_avx512
#define columns4 columns4_avx512
#elif defined(__AVXVNNI__)
#define INT8_ISA 2
#define dot4 dot4_avxvnni
#elif defined(__AVX2__)
#define INT8_ISA 1
#define dot4 dot4_avx2
#else
#define INT8_ISA 0
#define dot4 dot4_generic
#endif
#if INT8_ISA != 3
#define gather16 gather16_generic
#define columns4 columns4_generic
#endif

/* Whether dot4 takes signed weight bytes as they are (else a signed format's bytes go in
   + 128, and 128 * sum(x) comes off after). */
enum { INT8_SIGNED_WEIGHTS = INT8_ISA == 1 };

/* Widening 16 bytes from memory in one instruction: with AVX-512 (else the formats' plain
   conversions). */
#if defined(__AVX512F__) && defined(__F16C__)
#define WIDEN16_FROM_MEMORY 1
#else
#define WIDEN16_FROM_MEMORY 0
#endif

#endif
