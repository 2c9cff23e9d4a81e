"""The decoder layers of a decode step as one C call (`v1.kernels.decoder`), where that
computes exactly what the per-op path computes.

At batch 1 the default model's 30 layers are ~300 small C calls a token (norms, matmuls,
RoPE, attention), and the Python around them (modules, argument checks, ctypes conversions)
cost about as much as the calls themselves (issue 22: ~4.3 of 9.6 ms a forward). The fused
step runs the same kernels in the same order on the same shapes from C, so its hidden
states are the per-op path's, bit for bit, and Python pays its checks once per step.

It runs a step only where all of these hold, else the per-op path runs, unchanged:
- V1_FUSED_DECODE is not 0 (read per forward, like V1_CPU_KERNELS; "1" or unset: on);
- the step's ops are the C ones (`NativeOps`: fp32 on CPU, kernels loaded), and the library
  has the fused entry point;
- every row of the step takes one matmul path, "fp32" or "int8" (`quant.path_for_rows`, the
  rule the per-op path follows: whatever it says, both follow it; None where prompt rows and
  generated rows take different paths, as with V1_QUANT_ALL_INT8=0);
- every layer qualifies (`PreNormDecoderLayer.fused_weights`: plain pre-norm layers, silu
  MLP, no q/k or unit-offset norms, GGUF blocks in plain `Linear`s, so no LoRA) and all
  use one RoPE table;
- the attention plan is the C decode kernel's alone (`AttentionPlan.native_only`: no SDPA
  decodes or prefills, no cascade groups), the same plan for every layer.

The layers' descriptors (or the finding that a layer does not qualify) are made on first use
and kept while nothing they come from changed: no submodule or parameter was assigned to any
module since (torch's global registration hooks count those: LoRA's wrappers, reloaded
norms), every `Linear` of the layers holds the same weight object (its loading methods swap
`kernel`, a plain attribute), and every tensor read keeps its stamp (`DecoderLayers.unchanged`,
`tensors.stamp`). Walking the modules instead cost ~0.3 ms a step, nn.Module's attribute
lookups; these checks cost a tenth of that.
"""

import os
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn
from torch.nn.modules.module import (
    register_module_module_registration_hook,
    register_module_parameter_registration_hook,
)

from v1.attention.backends.abstract import AttentionMetadata
from v1.attention.backends.torch_plan import AttentionPlan
from v1.kernels.elementwise import NativeOps
from v1.kernels.fused_step import DecoderLayers, LayerWeights, fused_decoder
from v1.models.layers.linear import Linear
from v1.models.layers.ops import StepOps
from v1.models.layers.quant import QuantizedWeight, path_for_rows

_ON = ("", "1", "true", "yes", "on")
_OFF = ("0", "false", "no", "off")


# Submodule and parameter assignments in this process so far (see the module docstring).
_assignments = 0


def _count_assignment(module: nn.Module, name: str, value: Any) -> None:
    global _assignments
    _assignments += 1


register_module_module_registration_hook(_count_assignment)
register_module_parameter_registration_hook(_count_assignment)


def fused_decode_enabled() -> bool:
    """V1_FUSED_DECODE: unset, 1 or on (default), 0 or off."""
    value = os.environ.get("V1_FUSED_DECODE", "").strip().lower()
    if value in _ON:
        return True
    if value in _OFF:
        return False
    raise ValueError(f"V1_FUSED_DECODE={value!r}: expected 0 or 1")


class FusedDecode:
    """A decoder's layers run as one C call per qualifying step (see the module docstring).
    Layers that can be fused have `fused_weights() -> LayerWeights | None` and `rope_key`,
    their attention module `self_attn` with its backend `attn`."""

    def __init__(self, layers: Sequence[nn.Module]) -> None:
        self._layers = layers
        self._built: DecoderLayers | None = None  # None: a layer does not qualify
        # What `_built` was made at: `_assignments` then (-1: never made), and each Linear's
        # weight object with its blocks.
        self._made_at = -1
        self._kernels: list[tuple[Linear, Any, torch.Tensor | None]] = []
        self._rope_key = ""
        self._attn: list[tuple[int, int | None]] = []  # distinct (heads, window)

    def __call__(
        self,
        hidden_states: torch.Tensor,
        ropes: dict[str, tuple[torch.Tensor, torch.Tensor]],
        kv_caches: list[torch.Tensor],
        attn_metadata: AttentionMetadata,
        ops: StepOps,
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(last layer's block output, residual stream) as the layers' loop would return
        them, or None where the step does not qualify (nothing done then)."""
        if not isinstance(ops, NativeOps) or not fused_decode_enabled():
            return None
        path = path_for_rows(hidden_states.shape[0])
        fused = fused_decoder()
        if path not in ("fp32", "int8") or fused is None:
            return None
        layers = self._current()
        if layers is None:
            return None
        plans = [AttentionPlan.for_step(attn_metadata, kv_caches[0], heads, window)
                 for heads, window in self._attn]
        native = plans[0].native_only() if all(p is plans[0] for p in plans) else None
        if native is None:
            return None
        cos, sin = ropes[self._rope_key]
        out = fused(layers, hidden_states, cos, sin, native.bound(kv_caches[0]), native.kernel,
                    kv_caches, path == "int8")
        return out, hidden_states

    def _current(self) -> DecoderLayers | None:
        """The layers' descriptors, made again where what they come from changed (see the
        module docstring); None where a layer does not qualify."""
        built = self._built
        if (
            self._made_at == _assignments
            and all(linear.kernel is kernel and (blocks is None or kernel.blocks is blocks)
                    for linear, kernel, blocks in self._kernels)
            and (built is None or built.unchanged())
        ):
            return built
        self._made_at = _assignments
        self._kernels = [
            (m, m.kernel, m.kernel.blocks if isinstance(m.kernel, QuantizedWeight) else None)
            for layer in self._layers for m in layer.modules() if isinstance(m, Linear)
        ]
        self._built = self._make()
        return self._built

    def _make(self) -> DecoderLayers | None:
        weights: list[LayerWeights] = []
        for layer in self._layers:
            fused_weights = getattr(layer, "fused_weights", None)
            layer_weights = fused_weights() if fused_weights is not None else None
            if layer_weights is None:
                return None
            weights.append(layer_weights)
        rope_keys = {layer.rope_key for layer in self._layers}
        impls = [layer.self_attn.attn for layer in self._layers]
        shapes = {(impl.num_heads, impl.num_kv_heads, impl.head_size) for impl in impls}
        if len(rope_keys) != 1 or len(shapes) != 1:
            return None
        ((num_heads, num_kv_heads, head_dim),) = shapes
        self._rope_key = rope_keys.pop()
        self._attn = sorted({(impl.num_heads, impl.sliding_window) for impl in impls},
                            key=repr)
        return DecoderLayers(weights, num_heads, num_kv_heads, head_dim)
