"""The gated MLP every supported architecture uses: down(act(gate(x)) * up(x)).

gate and up are one `gate_up_proj` matmul (weight rows: gate, then up), which the loader fills
from the checkpoint's separate `gate_proj` / `up_proj` (or takes whole where the checkpoint
fuses them already, as Phi-3's does).
"""

import torch
import torch.nn.functional as F
from torch import nn

from v1.models.layers.linear import Linear
from v1.models.step_plan import StepPlan

# transformers' activation names -> whether we have them (the gelu is tanh-approximated).
SUPPORTED_ACTIVATIONS = ("silu", "gelu_pytorch_tanh")


class GatedMLP(nn.Module):
    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        hidden_act: str,
        bias: bool,
        device: torch.device,
        dtype: torch.dtype,
    ) -> None:
        super().__init__()
        if hidden_act not in SUPPORTED_ACTIVATIONS:
            raise ValueError(
                f"unsupported activation {hidden_act!r} (supported: "
                f"{', '.join(SUPPORTED_ACTIVATIONS)})"
            )
        self.hidden_act = hidden_act
        self.intermediate_size = intermediate_size
        self.gate_up_proj = Linear(
            hidden_size, 2 * intermediate_size, bias=bias, device=device, dtype=dtype
        )
        self.down_proj = Linear(
            intermediate_size, hidden_size, bias=bias, device=device, dtype=dtype
        )

    def forward(self, x: torch.Tensor, step: StepPlan) -> torch.Tensor:
        gate_up = self.gate_up_proj(x, step.rows)
        if self.hidden_act == "silu":
            return self.down_proj(step.ops.silu_and_mul(gate_up), step.rows)
        gate, up = gate_up.chunk(2, dim=-1)
        return self.down_proj(F.gelu(gate, approximate="tanh") * up, step.rows)
