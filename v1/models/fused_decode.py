"""The decoder layers of a decode step as one C call (`v1.kernels.decoder`), where that
computes exactly what the per-op path computes.

At batch 1 the default model's 30 layers are ~300 small C calls a token (norms, matmuls,
RoPE, attention), and the Python around them (modules, argument checks, ctypes conversions)
cost about as much as the calls themselves (issue 22: ~4.3 of 9.6 ms a forward). The fused
step runs the same kernels in the same order on the same shapes from C, so its hidden
states are the per-op path's, bit for bit, and Python pays its checks once per step.

It runs a step only where all of these hold, else the per-op path runs, unchanged:
- V1_FUSED_DECODE is not 0 (read per forward, like V1_CPU_KERNELS; "1" or unset: on);
- the step's ops are the C ones (`NativeOps`: fp32 on CPU, a decode-sized step, kernels
  loaded), and the library has the fused entry point;
- every row is a generated token's (no prompt rows: `quant.has_prompt_rows`), and the
  matmul path of the step's row count is "fp32" or "int8" (`quant.path_for_rows`, the rule
  the per-op path follows: whatever it says, both follow it);
- every layer qualifies (`PreNormDecoderLayer.fused_weights`: plain pre-norm layers, silu
  MLP, no q/k or unit-offset norms, GGUF blocks in plain `Linear`s, so no LoRA) and all
  use one RoPE table;
- the attention plan is the C decode kernel's alone (`AttentionPlan.native_only`: no SDPA
  decodes or prefills, no cascade groups), the same plan for every layer.

The layers' descriptors are built on first use and kept while the modules they come from
are the same objects and every tensor keeps its stamp (`DecoderLayers.unchanged`); else
they are built again.
"""

import os
from collections.abc import Sequence

import torch
from torch import nn

from v1.attention.backends.abstract import AttentionMetadata
from v1.attention.backends.torch_plan import AttentionPlan
from v1.kernels.decoder import DecoderLayers, LayerWeights, fused_decoder
from v1.kernels.elementwise import NativeOps
from v1.models.layers.ops import StepOps
from v1.models.layers.quant import has_prompt_rows, path_for_rows

_ON = ("", "1", "true", "yes", "on")
_OFF = ("0", "false", "no", "off")


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
        self._built: DecoderLayers | None = None
        # What `_built` was made from: per layer, its weights (the identity of each module
        # and tensor they come from).
        self._sources: list[tuple] | None = None
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
        if not isinstance(ops, NativeOps) or has_prompt_rows() or not fused_decode_enabled():
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
        """The layers' descriptors, built again where their weights changed; None where a
        layer does not qualify."""
        sources = []
        for layer in self._layers:
            fused_weights = getattr(layer, "fused_weights", None)
            weights = fused_weights() if fused_weights is not None else None
            if weights is None:
                return None
            sources.append(_identity(weights))
        built = self._built
        if built is not None and sources == self._sources and built.unchanged():
            return built
        self._built = self._sources = None
        rope_keys = {layer.rope_key for layer in self._layers}
        impls = [layer.self_attn.attn for layer in self._layers]
        shapes = {(impl.num_heads, impl.num_kv_heads, impl.head_size) for impl in impls}
        if len(rope_keys) != 1 or len(shapes) != 1:
            return None
        ((num_heads, num_kv_heads, head_dim),) = shapes
        self._built = DecoderLayers(
            [layer.fused_weights() for layer in self._layers], num_heads, num_kv_heads,
            head_dim,
        )
        self._sources = sources
        self._rope_key = rope_keys.pop()
        self._attn = sorted({(impl.num_heads, impl.sliding_window) for impl in impls},
                            key=repr)
        return self._built


def _identity(weights: LayerWeights) -> tuple:
    """What `weights` is made of, each tensor by identity: equal for the same weights."""
    return (
        id(weights.input_norm), weights.input_eps, id(weights.post_norm), weights.post_eps,
        weights.scale,
        *((id(p.blocks.tensor), id(p.bias)) for p in (weights.qkv, weights.o, weights.gate_up,
                                                       weights.down)),
    )
