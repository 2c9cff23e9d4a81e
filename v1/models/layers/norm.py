"""RMSNorm, in the two flavours the supported architectures use: `w * norm(x)` (Llama, Qwen,
Mistral, Phi-3) and Gemma's `(1 + w) * norm(x)` in fp32 (`unit_offset=True`, the checkpoint's
`w` centred on 0). Both take the residual stream too: `norm(residual + x)`, the add fused into
the norm (`StepOps.rms_norm`).
"""

import torch
from torch import nn

from v1.models.layers.ops import StepOps


class RMSNorm(nn.Module):
    """The weight and eps of an RMSNorm; the step's `ops.rms_norm` applies them."""

    def __init__(
        self,
        hidden_size: int,
        eps: float,
        device: torch.device,
        dtype: torch.dtype,
        *,
        unit_offset: bool = False,
    ) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(hidden_size, device=device, dtype=dtype))
        self.eps = eps
        self.unit_offset = unit_offset
        # Gemma's fp32 `1 + w`, rebuilt when the weight changes (new weights loaded).
        self._scale_key: tuple[int, int] | None = None
        self._scale: torch.Tensor | None = None

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None, ops: StepOps
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(residual + x), residual + x); with no residual, (norm(x), x). `x` is
        [rows, hidden_size] (per-head norms pass heads as rows)."""
        if not self.unit_offset:
            return ops.rms_norm(x, residual, self.weight, self.eps)
        scale = self._unit_offset_scale()
        if x.dtype == torch.float32:
            # fp32: (1 + w) * norm(x) is the product transformers computes, just commuted.
            return ops.rms_norm(x, residual, scale, self.eps)
        # 16-bit: transformers multiplies in fp32 and casts once; the ops would cast first.
        if residual is not None:
            x = residual + x
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (x32 * scale).to(x.dtype), x

    def _unit_offset_scale(self) -> torch.Tensor:
        key = (self.weight.data_ptr(), self.weight._version)
        if key != self._scale_key or self._scale is None:
            self._scale = 1.0 + self.weight.detach().float()
            self._scale_key = key
        return self._scale
