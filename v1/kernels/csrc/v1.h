/* What every kernel source shares: the mark of an exported entry point (the library is built
   with -fvisibility=hidden: only these are symbols ctypes can find) and the tensor view that
   entry points take instead of a pointer and its shape as separate arguments. Every struct
   an entry point takes is listed in layout.c, which the bindings check their mirrors
   against at load. */
#ifndef V1_H
#define V1_H

#include <stdint.h>

#define V1_API __attribute__((visibility("default")))

/* A 2-D tensor: `rows` rows of `cols` elements, row i at data + i * stride (in elements of
   the tensor's type; in bytes for block-quantized weights, whose cols count the values). */
struct v1_view {
    void *data;
    int64_t rows, cols, stride;
};

#endif
