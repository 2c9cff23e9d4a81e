/* The model's elementwise ops for decode-sized steps, fp32, one thread each (see
   v1.models.layers.ops, and v1/kernels/elementwise.py for the bindings' checks). Rows are
   their views' strides apart; n needs no alignment. Built with -ffp-contract=off: a * b + c
   rounds twice, as the torch ops do. */
#include "kernels.h"
#include "vec8.h"

#include <math.h>
#include <stdint.h>

/* h = res + x (stored back into res) or h = res when x is NULL; out = w * (h * 1/sqrt(mean(h^2)
   + eps)), in the order of operations of the torch reference. */
V1_API void v1_rms_norm(const struct v1_view *x, const struct v1_view *res, const float *w,
                        float eps, const struct v1_view *out) {
    const int64_t rows = res->rows, n = res->cols;
    for (int64_t r = 0; r < rows; r++) {
        float *h = (float *)res->data + r * res->stride, *o = (float *)out->data + r * out->stride;
        if (x) {
            const float *xr = (const float *)x->data + r * x->stride;
            for (int64_t i = 0; i < n; i++) h[i] += xr[i];
        }
        v8 acc = {0};
        int64_t i = 0;
        for (; i + 8 <= n; i += 8) { v8 v = load8(h + i); acc += v * v; }
        float sq = hsum(acc);
        for (; i < n; i++) sq += h[i] * h[i];
        const float inv = 1.f / sqrtf(sq / (float)n + eps);
        for (i = 0; i < n; i++) o[i] = w[i] * (h[i] * inv);
    }
}

/* In place on rows of heads vectors of D: x * cos + cat(x2, x1) * sin, where cos and sin
   hold D values per row (cat(cos, cos) and cat(-sin, sin)). */
V1_API void v1_rope(const struct v1_view *x, int64_t D, const float *cos, const float *sin) {
    const int64_t half = D / 2, heads = x->cols / D;
    for (int64_t r = 0; r < x->rows; r++) {
        const float *c = cos + r * D, *s = sin + r * D;
        for (int64_t h = 0; h < heads; h++) {
            float *p = (float *)x->data + r * x->stride + h * D;
            for (int64_t i = 0; i < half; i++) {
                const float a = p[i], b = p[i + half];
                p[i] = a * c[i] + b * s[i];
                p[i + half] = b * c[i + half] + a * s[i + half];
            }
        }
    }
}

/* out = silu(gate) * up = gate / (1 + e^-gate) * up, with gate and up the two halves (n each,
   n = out->cols) of a row of gate_up. */
V1_API void v1_silu_and_mul(const struct v1_view *gate_up, const struct v1_view *out) {
    const int64_t n = out->cols;
    for (int64_t r = 0; r < out->rows; r++) {
        const float *g = (const float *)gate_up->data + r * gate_up->stride, *u = g + n;
        float *o = (float *)out->data + r * out->stride;
        int64_t i = 0;
        for (; i + 8 <= n; i += 8) {
            v8 gv = load8(g + i);
            v8 silu = gv / (1.f + exp8(-gv));
            /* -inf: -inf / (1 + e^inf) is NaN (as expf and torch give it), not the clamped
               exp8's -inf. */
            silu = v8_select(gv == splat(-INFINITY), splat(NAN), silu);
            store8(o + i, silu * load8(u + i));
        }
        for (; i < n; i++) o[i] = g[i] / (1.f + expf(-g[i])) * u[i];
    }
}
