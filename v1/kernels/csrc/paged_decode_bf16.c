/* The paged decode kernel for bf16 caches (see paged_decode.h). */
#define KV_T uint16_t
#define KV_ROW row_bf16
#define STORE_ROW store_bf16
#define PAGED_DECODE v1_paged_decode_bf16
#include "paged_decode.h"
