/* The paged decode kernel for fp16 caches (see paged_decode.h); none without F16C. */
#ifdef __F16C__
#define KV_T uint16_t
#define KV_ROW row_f16
#define STORE_ROW store_f16
#define PAGED_DECODE v1_paged_decode_f16
#include "paged_decode.h"
#endif
