/* The paged decode kernel for f32 caches (see paged_decode.h). */
#define KV_T float
#define KV_ROW row_f32
#define STORE_ROW store_f32
#define PAGED_DECODE v1_paged_decode_f32
#include "paged_decode.h"
