"""The model's linear layers with LoRA: each row gets its own adapter's delta.

Each adapted `Linear` is wrapped in a `LinearWithLoRA` of `max_loras` slots: A matrices
stacked along the rank ("shrink", [slots, n * R, in]), B block-diagonal ("expand",
[slots, n * R, out]), R = max_lora_rank, smaller ranks zero-padded, the scale folded into B.
For the step's rows x:

    y        = base(x)
    y[rows] += (x[rows] @ shrink[s].T) @ expand[s]      for each slot s in use, its rows

Rows are selected, never masked by multiplying with 0: another slot's weights never touch a
row (NaN * 0 is NaN, so a mask would let one adapter's overflow poison every row of the
step). A row without an adapter gets base(x) exactly; a step without adapter rows skips
LoRA; a step whose rows all run one adapter in slot 0 needs no selection.
"""

from dataclasses import dataclass

import torch
from torch import nn

from v1.models.layers.linear import Linear
from v1.models.layers.quantized import MatmulRows


@dataclass(slots=True)
class LoRABatch:
    """The step's adapter rows, shared by every wrapped layer: `num_slots` (k) slots in use
    (0: no adapter row, the LoRA path is skipped), `rows` (slot, the indices of its rows
    [n]) for each slot with rows; None with k = 1 when every row runs slot 0's adapter."""

    num_slots: int = 0
    rows: list[tuple[int, torch.Tensor]] | None = None


class LinearWithLoRA(nn.Module):
    """A `Linear` plus `max_loras` adapter slots (see the module docstring for the layout).
    `sub_sizes`: the output sizes of the sub-projections the fused weight stacks (q, k, v),
    in order; one entry for an unfused projection."""

    def __init__(
        self,
        base_layer: Linear,
        sub_sizes: tuple[int, ...],
        batch: LoRABatch,
        max_loras: int,
        max_rank: int,
    ) -> None:
        super().__init__()
        if sum(sub_sizes) != base_layer.out_features:
            raise ValueError(f"sub-projections {sub_sizes} do not add up to "
                             f"{base_layer.out_features} outputs")
        self.base_layer = base_layer
        self.sub_sizes = sub_sizes
        self.batch = batch
        self.max_rank = max_rank
        self.width = len(sub_sizes) * max_rank  # rank columns per slot
        device, dtype = self._device_dtype(base_layer)
        self.shrink = torch.zeros(
            max_loras, self.width, base_layer.in_features, device=device, dtype=dtype
        )
        self.expand = torch.zeros(
            max_loras, self.width, base_layer.out_features, device=device, dtype=dtype
        )

    @staticmethod
    def _device_dtype(layer: Linear) -> tuple[torch.device, torch.dtype]:
        if layer.bias is not None:
            return layer.bias.device, layer.bias.dtype
        if layer.weight is not None:
            return layer.weight.device, layer.weight.dtype
        return torch.device("cpu"), torch.float32  # packed or blocks: CPU fp32 only

    def forward(self, x: torch.Tensor, rows: MatmulRows | None = None) -> torch.Tensor:
        y = self.base_layer(x, rows)
        if self.batch.num_slots == 0:
            return y
        rows = self.batch.rows
        if rows is None:
            return y.addmm_(x @ self.shrink[0].T, self.expand[0])
        for slot, index in rows:
            delta = (x.index_select(0, index) @ self.shrink[slot].T) @ self.expand[slot]
            y.index_add_(0, index, delta)
        return y

    def set_slot(
        self, slot: int, modules: list[tuple[torch.Tensor, torch.Tensor, float] | None]
    ) -> None:
        """Write an adapter into `slot`: per sub-projection (A [r, in], B [out, r], scale),
        or None where the adapter leaves it alone (zeros)."""
        shrink, expand = self.shrink[slot], self.expand[slot]
        shrink.zero_()
        expand.zero_()
        out_start = 0
        for i, (size, module) in enumerate(zip(self.sub_sizes, modules, strict=True)):
            if module is not None:
                a, b, scale = module
                rank = a.shape[0]
                rows = slice(i * self.max_rank, i * self.max_rank + rank)
                shrink[rows] = a
                expand[rows, out_start : out_start + size] = b.T * scale
            out_start += size

    def clear_slot(self, slot: int) -> None:
        self.shrink[slot].zero_()
        self.expand[slot].zero_()
