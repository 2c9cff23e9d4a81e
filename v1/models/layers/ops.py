"""The model's elementwise ops (RMSNorm, RoPE, SiLU-and-mul), chosen once per forward.

`TorchOps` is the reference: each op in torch, rounded as transformers rounds it. On CPU:
- with fp32 activations and the kernels, every step takes `NativeOps` (`v1.kernels.elementwise`):
  each op one call into a small C kernel, single-threaded, RMSNorm fused with the residual add
  before it, RoPE in place. RoPE and the add are bit-identical to torch; the norm's sum and
  SiLU's exp round differently (~1 ulp). Every step, not only decode-sized ones: a row's result
  must not depend on how many rows its step has, or a prompt prefilled cold (one big step) and
  the same prompt's uncached tail after a prefix-cache hit (a small one) would give different
  hidden states, and greedy tokens that differ at a near-tie (issue 22: a 143-token chat did).
  At a decode-sized step these calls also beat torch's dispatch and OpenMP wake-ups; at a
  2,048-token prefill step one thread's elementwise work is a few percent of the step.
- without the kernels (V1_CPU_KERNELS=0) or with 16-bit activations, a decode-sized step (at
  most SMALL_STEP_MAX_TOKENS rows) runs `TorchOps(serial=True)`, the torch ops on one thread: a
  parallel op wakes the other OpenMP threads and waits for them, a few us when they spin, ~80 us
  when they sleep (OMP_WAIT_POLICY=PASSIVE, the sensible setting on a shared machine), up to a
  time slice on an oversubscribed one; larger steps run them on all threads.
The GEMMs and attention between these ops keep all threads in every case.
"""

import torch
import torch.nn.functional as F

from v1.kernels.elementwise import NativeOps, native_ops

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


def ops_for_step(hidden_states: torch.Tensor) -> StepOps:
    """The ops for a forward over `hidden_states` [T, hidden] (see the module docstring)."""
    if hidden_states.device.type != "cpu":
        return TORCH_OPS
    if hidden_states.dtype == torch.float32 and (native := native_ops()) is not None:
        return native
    if hidden_states.shape[0] > SMALL_STEP_MAX_TOKENS:
        return TORCH_OPS
    return TorchOps(serial=torch.get_num_threads() > 1)
