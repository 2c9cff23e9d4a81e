"""The decoder layers of a decode step as one C call (`v1.kernels.fused_step`), bit for bit what
the per-op path computes: the same kernels, in the same order, on the same shapes.

Whether the layers can run fused is decided once, at load (`replan`), and again only by an
explicit `replan` (LoRA's wrappers); when they cannot, one INFO line says why. Which steps run
fused is the step plan's business. Why: docs/benchmarks.md, "Fused decode step".
"""

import logging
from collections.abc import Sequence
from typing import NamedTuple

import torch
from torch import nn

from v1.kernels.attention import BoundStep, PagedDecodeKernel
from v1.kernels.fused_step import DecoderLayers, FusedDecoder, LayerWeights, fused_decoder
from v1.models.layers.linear import Linear
from v1.models.layers.quantized import block_weights

logger = logging.getLogger("v1")


class FusedStep(NamedTuple):
    """What the fused decode step takes from the step: the planner's library's entry point,
    the C attention kernel, its entries bound to the caches, and the matmul path of every
    row."""

    decoder: FusedDecoder
    kernel: PagedDecodeKernel
    entries: BoundStep
    int8: bool


class FusedDecode:
    """A decoder's layers as the fused step runs them. Layers that can be fused have
    `fused_weights() -> LayerWeights | None` and `rope_key`, their attention module
    `self_attn` with its backend `attn`."""

    def __init__(self, layers: Sequence[nn.Module]) -> None:
        self._layers = layers
        # The descriptors the step runs with (None: the layers do not qualify). They point
        # into the weights as they were at the last `replan`: whoever gives the layers new
        # weights or modules, or changes a weight's storage in place (resize_, set_,
        # share_memory_), re-plans (`load_weights`, LoRA's manager do), as a CUDA graph is
        # captured again. They hold the weights' storage, so a weight replaced (`.data =`, a
        # new Parameter) without a re-plan is not seen, never read freed. (Checking every
        # weight's address each step took ~540 calls a step, each on caches the weights had
        # just streamed through: bench/bench_cold_host.py.)
        self.layers: DecoderLayers | None = None
        self.reason = "the weights are not loaded"  # why not, where they do not
        self.rope_key = ""
        # The layers' distinct (heads, window): the attention plans the step needs.
        self.attention: list[tuple[int, int | None]] = []

    def replan(self) -> None:
        """Decides (again) whether the layers run fused, from what they are now; logs the
        decision at INFO, with the reason where they do not qualify."""
        self.layers, self.reason = self._make()
        if self.layers is None:
            logger.info("fused decode step: off (%s)", self.reason)
        else:
            logger.info("fused decode step: on (%d layers)", len(self._layers))

    def run(
        self, hidden_states: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
        kv_caches: list[torch.Tensor], fused: FusedStep,
    ) -> torch.Tensor:
        """Every layer on `hidden_states` (left, in place, the residual stream before the
        last block output, which is returned) through the step's bound C attention entries;
        K/V stored into `kv_caches`."""
        assert self.layers is not None
        cos, sin = rope
        return fused.decoder(self.layers, hidden_states, cos, sin, fused.entries, fused.kernel,
                             kv_caches, fused.int8)

    def _make(self) -> tuple[DecoderLayers | None, str]:
        if fused_decoder() is None:
            return None, "the kernel library has no fused decode step"
        weights: list[LayerWeights] = []
        for i, layer in enumerate(self._layers):
            fused_weights = getattr(layer, "fused_weights", None)
            layer_weights = fused_weights() if fused_weights is not None else None
            if layer_weights is None:
                return None, f"layer {i} ({type(layer).__name__}): {_why_not(layer)}"
            weights.append(layer_weights)
        rope_keys = {layer.rope_key for layer in self._layers}
        impls = [layer.self_attn.attn for layer in self._layers]
        shapes = {(impl.num_heads, impl.num_kv_heads, impl.head_size) for impl in impls}
        if len(rope_keys) != 1 or len(shapes) != 1:
            return None, "the layers differ in RoPE table or head shape"
        ((num_heads, num_kv_heads, head_dim),) = shapes
        self.rope_key = rope_keys.pop()
        self.attention = sorted({(impl.num_heads, impl.sliding_window) for impl in impls},
                                key=repr)
        try:
            return DecoderLayers(weights, num_heads, num_kv_heads, head_dim), ""
        except ValueError as e:  # e.g. a block type whose linear kernels this library lacks
            return None, str(e)


def _why_not(layer: nn.Module) -> str:
    """Why a layer's `fused_weights` gave None, in words."""
    projections = [getattr(getattr(layer, part, None), name, None)
                   for part, name in (("self_attn", "qkv_proj"), ("self_attn", "o_proj"),
                                      ("mlp", "gate_up_proj"), ("mlp", "down_proj"))]
    if not all(type(p) is Linear and block_weights(p.kernel) for p in projections):
        return "its projections are not GGUF blocks in plain Linears (float weights, LoRA)"
    return ("not a plain pre-norm block with silu and no q/k or unit-offset norms on the "
            "torch attention backend")
