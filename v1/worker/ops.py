"""The model's elementwise ops (RMSNorm, RoPE, SiLU-and-mul), chosen once per forward.

`TorchOps` is the reference: each op in torch, rounded as transformers rounds it. On CPU a
decode-sized step (at most SMALL_STEP_MAX_TOKENS rows) spends more time dispatching these ops
and waking OpenMP threads than computing them, so for such steps:
- `NativeOps` runs each as one call into a small C kernel (`_SOURCE`, built by `v1.native`),
  single-threaded, RMSNorm fused with the residual add before it, RoPE in place. RoPE and the
  add are bit-identical to torch; the norm's sum and SiLU's exp round differently (~1 ulp).
- without a compiler (or with V1_CPU_KERNELS=0), `TorchOps(serial=True)` runs the torch ops on
  one thread: a parallel op wakes the other OpenMP threads and waits for them, a few us when
  they spin, ~80 us when they sleep (OMP_WAIT_POLICY=PASSIVE, the sensible setting on a
  shared machine), up to a time slice on an oversubscribed one.
The GEMMs and attention between these ops keep all threads in every case.
"""

import ctypes
import functools

import torch
import torch.nn.functional as F

from v1 import native

SMALL_STEP_MAX_TOKENS = 128


class TorchOps:
    """The reference ops; `serial=True` runs them on one thread (see the module docstring)."""

    __slots__ = ("serial", "_threads")

    def __init__(self, serial: bool = False) -> None:
        self.serial = serial
        self._threads = 1

    def __enter__(self) -> None:
        if self.serial:
            self._threads = torch.get_num_threads()
            torch.set_num_threads(1)

    def __exit__(self, *exc: object) -> None:
        if self.serial:
            torch.set_num_threads(self._threads)

    def rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(residual + x), residual + x); with no residual, (norm(x), x)."""
        with self:
            if residual is not None:
                x = residual + x
            # Normalise in fp32 even for a bf16 model, then scale in the model dtype (as HF).
            x32 = x.float()
            x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
            return weight * x32.to(x.dtype), x

    def rope(self, qk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """qk [T, heads, D] rotated: x * cos + cat(x2, x1) * sin, where the tables [T, 1, D]
        are cat(cos, cos) and cat(-sin, sin) (the sign of rotate_half sits in the table).
        Each element is x1 * c - x2 * s or x2 * c + x1 * s, rounded as transformers does."""
        with self:
            x1, x2 = qk.chunk(2, dim=-1)
            return qk * cos + torch.cat((x2, x1), dim=-1) * sin

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        with self:
            gate, up = gate_up.chunk(2, dim=-1)
            return F.silu(gate) * up


TORCH_OPS = TorchOps()

_SOURCE = native.VECTOR_C + r"""
#include <math.h>

/* fp32, one thread. Rows are n floats apart by their own stride; n needs no alignment. */

/* h = res + x (stored back into res) or h = res when x is NULL; out = w * (h * 1/sqrt(mean(h^2)
   + eps)), in the order of operations of the torch reference. */
void v1_rms_norm(const float *x, int64_t x_row, float *res, int64_t res_row, const float *w,
                 float eps, float *out, int64_t out_row, int64_t rows, int64_t n) {
    for (int64_t r = 0; r < rows; r++) {
        float *h = res + r * res_row, *o = out + r * out_row;
        if (x) {
            const float *xr = x + r * x_row;
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

/* In place on rows of `heads` vectors of D: x * cos + cat(x2, x1) * sin, where cos and sin
   hold D values per row (cat(cos, cos) and cat(-sin, sin)). */
void v1_rope(float *x, int64_t x_row, int64_t heads, int64_t D, const float *cos,
             const float *sin, int64_t rows) {
    const int64_t half = D / 2;
    for (int64_t r = 0; r < rows; r++) {
        const float *c = cos + r * D, *s = sin + r * D;
        for (int64_t h = 0; h < heads; h++) {
            float *p = x + r * x_row + h * D;
            for (int64_t i = 0; i < half; i++) {
                const float a = p[i], b = p[i + half];
                p[i] = a * c[i] + b * s[i];
                p[i + half] = b * c[i + half] + a * s[i + half];
            }
        }
    }
}

/* out = silu(gate) * up = gate / (1 + e^-gate) * up, with gate and up the two halves (n each)
   of a row of gate_up. */
void v1_silu_and_mul(const float *gate_up, int64_t in_row, float *out, int64_t out_row,
                     int64_t rows, int64_t n) {
    for (int64_t r = 0; r < rows; r++) {
        const float *g = gate_up + r * in_row, *u = g + n;
        float *o = out + r * out_row;
        int64_t i = 0;
        for (; i + 8 <= n; i += 8) {
            v8 gv = load8(g + i);
            store8(o + i, gv / (1.f + exp8(-gv)) * load8(u + i));
        }
        for (; i < n; i++) o[i] = g[i] / (1.f + expf(-g[i])) * u[i];
    }
}
"""


class NativeOps:
    """The same ops as `TorchOps`, each one C call. For fp32 CPU tensors whose rows are
    contiguous; `ops_for_step` hands it out only for such steps."""

    __slots__ = ("_norm", "_rope", "_silu_and_mul")

    def __init__(self, lib: ctypes.CDLL) -> None:
        p, i64, f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
        self._norm = lib.v1_rms_norm
        self._norm.argtypes = [p, i64, p, i64, p, f32, p, i64, i64, i64]
        self._rope = lib.v1_rope
        self._rope.argtypes = [p, i64, i64, i64, p, p, i64]
        self._silu_and_mul = lib.v1_silu_and_mul
        self._silu_and_mul.argtypes = [p, i64, p, i64, i64, i64]
        for fn in (self._norm, self._rope, self._silu_and_mul):
            fn.restype = None

    def rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """As TorchOps.rms_norm; the sum residual + x is written into `residual` in place."""
        rows, n = x.shape
        out = torch.empty_like(x)
        if residual is None:
            residual, x_ptr, x_row = x, None, 0
        else:
            x_ptr, x_row = x.data_ptr(), x.stride(0)
        self._norm(x_ptr, x_row, residual.data_ptr(), residual.stride(0), weight.data_ptr(),
                   eps, out.data_ptr(), n, rows, n)
        return out, residual

    def rope(self, qk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """As TorchOps.rope, in place."""
        rows, heads, head_dim = qk.shape
        self._rope(qk.data_ptr(), qk.stride(0), heads, head_dim, cos.data_ptr(),
                   sin.data_ptr(), rows)
        return qk

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        rows, n2 = gate_up.shape
        out = gate_up.new_empty(rows, n2 // 2)
        self._silu_and_mul(gate_up.data_ptr(), gate_up.stride(0), out.data_ptr(), n2 // 2,
                           rows, n2 // 2)
        return out


StepOps = TorchOps | NativeOps


def ops_for_step(hidden_states: torch.Tensor) -> StepOps:
    """The ops for a forward over `hidden_states` [T, hidden] (see the module docstring)."""
    if hidden_states.device.type != "cpu" or hidden_states.shape[0] > SMALL_STEP_MAX_TOKENS:
        return TORCH_OPS
    if hidden_states.dtype == torch.float32:
        # fp-contract=off: a * b + c rounds twice, as the torch ops do.
        lib = native.load("elementwise", _SOURCE, ("-ffp-contract=off",))
        if lib is not None:
            return _native_ops(lib)
    return TorchOps(serial=torch.get_num_threads() > 1)


@functools.cache
def _native_ops(lib: ctypes.CDLL) -> NativeOps:
    return NativeOps(lib)
