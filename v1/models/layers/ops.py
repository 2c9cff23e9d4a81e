"""The model's elementwise ops (RMSNorm, RoPE, SiLU-and-mul), one set per step (`ops_for_step`,
called by the step plan's builder).

`TorchOps` is the reference, rounded as transformers rounds. fp32 on CPU with the kernels runs
`NativeOps` at every step size (a row's result must not depend on its step's size); otherwise
steps of at most SMALL_STEP_MAX_TOKENS rows run `TorchOps(serial=True)` on one thread. Why and
how much: docs/benchmarks.md, "Elementwise ops".
"""

import torch
import torch.nn.functional as F

from v1.kernels.elementwise import NativeOps

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

StepOps = TorchOps | NativeOps


def ops_for_step(
    device: torch.device, dtype: torch.dtype, num_tokens: int, native: NativeOps | None
) -> StepOps:
    """The ops of a forward over `num_tokens` activation rows of `dtype` on `device`, given
    the library's C ops (`native_ops()`, None without kernels; see the module docstring)."""
    if device.type != "cpu":
        return TORCH_OPS
    if dtype == torch.float32 and native is not None:
        return native
    if num_tokens > SMALL_STEP_MAX_TOKENS:
        return TORCH_OPS
    return TorchOps(serial=torch.get_num_threads() > 1)
