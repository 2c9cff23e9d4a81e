"""The decoder layers of a decode step as one C call (`v1.kernels.fused_step`), bit for bit what
the per-op path computes: the same kernels, in the same order, on the same shapes. The call
also runs the final norm, and where they are GGUF blocks the token embedding's lookup and the
LM head (a step the runner samples every row of: `StepPlan.logits`).

Whether the layers can run fused is decided once, at load (`replan`), and again only by an
explicit `replan` (LoRA's wrappers); when they cannot, one INFO line says why. Which steps run
fused is the step plan's business. Why: docs/benchmarks.md, "Fused decode step".
"""

import logging
from collections.abc import Mapping, Sequence
from typing import NamedTuple

import torch
from torch import nn

from v1.kernels.attention import BoundStep, PagedDecodeKernel
from v1.kernels.block_matmul import QuantBlocks, kernels
from v1.kernels.fused_step import (
    DecoderLayers,
    FusedDecoder,
    LayerWeights,
    ModelEnds,
    fused_decoder,
)
from v1.models.layers.linear import Linear, VocabEmbedding
from v1.models.layers.norm import RMSNorm
from v1.models.layers.quantized import block_weights

logger = logging.getLogger("v1")


class FusedStep(NamedTuple):
    """What the fused decode step takes from the step: the planner's library's entry point,
    the C attention kernel, its entries bound to the caches, the matmul path of every row,
    and the LM head's ("int8" or "fp32"; None: the step runs no head)."""

    decoder: FusedDecoder
    kernel: PagedDecodeKernel
    entries: BoundStep
    int8: bool
    head: str | None = None


class FusedDecode:
    """A decoder's layers as the fused step runs them, with its final norm and where they
    qualify its token embedding (`embedding`; None: looked up by the caller, as where a factor
    scales it) and LM head (the `replan` argument). Layers that can be fused have
    `fused_weights() -> LayerWeights | None` and `rope_key`, their attention module
    `self_attn` with its backend `attn`."""

    def __init__(self, layers: Sequence[nn.Module], rotary_embs: Mapping[str, nn.Module],
                 final_norm: RMSNorm, embedding: nn.Module | None) -> None:
        self._layers = layers
        self._rotary_embs = rotary_embs
        self._final_norm = final_norm
        self._embedding = embedding
        # The descriptors the step runs with (None: the layers do not qualify). They point
        # into the weights as they were at the last `replan` (the layers', the final norm's,
        # the embedding's and head's, the RoPE tables): whoever gives the model new weights,
        # tables or modules, or changes their storage in place (resize_, set_,
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

    def replan(self, head: nn.Module | None = None) -> None:
        """Decides (again) whether the layers run fused, from what they are now, `head` the
        LM head whose output alone makes the logits (None: none runs in the step); logs the
        decision at INFO, with the reason where they do not qualify."""
        self.layers, self.reason = self._make(head)
        if self.layers is None:
            logger.info("fused decode step: off (%s)", self.reason)
        else:
            ends = [part for part, on in (("embedding", self.layers.embeds),
                                          ("LM head", self.layers.vocab)) if on]
            logger.info("fused decode step: on (%d layers%s)", len(self._layers),
                        "".join(f", {part}" for part in ends))

    def run(
        self, input_ids: torch.Tensor, embeddings: torch.Tensor | None, positions: torch.Tensor,
        kv_caches: list[torch.Tensor], fused: FusedStep,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The model's last hidden states (after the final norm) from the tokens
        `input_ids` at `positions`, or from their `embeddings` where the layers do not look
        them up, through the step's bound C attention entries, K/V stored into `kv_caches`;
        and the LM head's output where the step runs it (`fused.head`; else None)."""
        assert self.layers is not None
        logits = (None if fused.head is None
                  else torch.empty(input_ids.shape[0], self.layers.vocab))
        hidden = fused.decoder(
            self.layers, embeddings, positions, fused.entries, fused.kernel, kv_caches,
            fused.int8, ids=input_ids if embeddings is None else None, logits=logits,
            head_int8=fused.head == "int8")
        return hidden, logits

    def _make(self, head: nn.Module | None) -> tuple[DecoderLayers | None, str]:
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
        rotary = self._rotary_embs[self.rope_key]
        self.attention = sorted({(impl.num_heads, impl.sliding_window) for impl in impls},
                                key=repr)
        if self._final_norm.unit_offset:
            return None, "the final norm has a unit offset"
        ends = ModelEnds(self._final_norm.weight, self._final_norm.eps,
                         _blocks(self._embedding, "dequantize"),
                         _blocks(head, "linear_f32", "linear_i8"))
        try:
            return DecoderLayers(weights, num_heads, num_kv_heads, head_dim,
                                 (rotary.cos_table, rotary.sin_table), ends=ends), ""
        except ValueError as e:  # e.g. a block type whose linear kernels this library lacks
            return None, str(e)


def _blocks(module: nn.Module | None, *needs: str) -> QuantBlocks | None:
    """The blocks of `module`'s weight where it is one GGUF weight with no bias in a plain
    `Linear` or `VocabEmbedding` and this process's library has the kernels `needs` for
    them; else None."""
    if type(module) not in (Linear, VocabEmbedding) or module.bias is not None:
        return None
    weights = block_weights(module.kernel)
    q = kernels()
    if len(weights) != 1 or q is None or not all(q.has(weights[0].kind, n) for n in needs):
        return None
    return weights[0].kernel_blocks()


def _why_not(layer: nn.Module) -> str:
    """Why a layer's `fused_weights` gave None, in words."""
    projections = [getattr(getattr(layer, part, None), name, None)
                   for part, name in (("self_attn", "qkv_proj"), ("self_attn", "o_proj"),
                                      ("mlp", "gate_up_proj"), ("mlp", "down_proj"))]
    if not all(type(p) is Linear and block_weights(p.kernel) for p in projections):
        return "its projections are not GGUF blocks in plain Linears (float weights, LoRA)"
    return ("not a plain pre-norm block with silu and no q/k or unit-offset norms on the "
            "torch attention backend")
