"""Gemma 3, text only (`Gemma3ForCausalLM`: gemma-3-1b and -270m; the multimodal
`Gemma3ForConditionalGeneration` is not supported).

What differs from Llama (docs/models.md, "Architectures"): scaled embeddings, `(1 + w)` fp32
RMSNorms, four norms per layer, q/k norms, a gelu-tanh gate, local (windowed, own RoPE base) and
global layers, optional final logit soft-capping. Configs setting `attn_logit_softcapping` or
`use_bidirectional_attention` are refused.
"""

from dataclasses import replace
from typing import Any

import torch

from v1.attention.backends.abstract import AttentionImpl
from v1.models.decoder import LayerSpec, PreNormDecoderLayer, build_norm
from v1.models.layers.rotary import rope_parameters
from v1.models.llama import LlamaForCausalLM
from v1.models.step_plan import StepPlan

SLIDING = "sliding_attention"
FULL = "full_attention"


def gemma3_layer_types(config: Any) -> list[str]:
    """Each layer's type: `config.layer_types`, or for configs written before that existed,
    every `sliding_window_pattern`-th layer (default 6) global and the others local."""
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None:
        return list(layer_types)
    pattern = getattr(config, "sliding_window_pattern", None) or 6
    return [SLIDING if (i + 1) % pattern else FULL for i in range(config.num_hidden_layers)]


class Gemma3DecoderLayer(PreNormDecoderLayer):
    """x + post_norm(attn(norm(x))), then x + post_norm(mlp(pre_norm(x))), with each residual
    add fused into the norm after it as in `PreNormDecoderLayer`."""

    def __init__(
        self,
        spec: LayerSpec,
        attn_impl_cls: type[AttentionImpl],
        device: torch.device,
        dtype: torch.dtype,
    ) -> None:
        super().__init__(spec, attn_impl_cls, device, dtype)
        self.pre_feedforward_layernorm = build_norm(spec, device, dtype)
        self.post_feedforward_layernorm = build_norm(spec, device, dtype)

    def forward(
        self,
        rope: tuple[torch.Tensor, torch.Tensor],
        hidden_states: torch.Tensor,
        residual: torch.Tensor | None,
        kv_cache: torch.Tensor,
        step: StepPlan,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        ops = step.ops
        x, residual = self.input_layernorm(hidden_states, residual, ops)
        x = self.self_attn(rope, x, kv_cache, step)
        x = self.post_attention_layernorm(x, None, ops)[0]
        x, residual = self.pre_feedforward_layernorm(x, residual, ops)
        x = self.mlp(x, step)
        return self.post_feedforward_layernorm(x, None, ops)[0], residual


class Gemma3ForCausalLM(LlamaForCausalLM):
    layer_cls = Gemma3DecoderLayer

    def check_config(self, config: Any) -> None:
        if getattr(config, "attn_logit_softcapping", None) is not None:
            raise ValueError(
                "Gemma 3 with attn_logit_softcapping is not supported: the attention kernels "
                "do not soft-cap scores"
            )
        if getattr(config, "use_bidirectional_attention", False):
            raise ValueError("Gemma 3 with use_bidirectional_attention is not supported")

    def layer_spec(self, config: Any, layer_idx: int) -> LayerSpec:
        layer_type = gemma3_layer_types(config)[layer_idx]
        return replace(
            super().layer_spec(config, layer_idx),
            hidden_act=getattr(config, "hidden_activation", None) or "gelu_pytorch_tanh",
            mlp_bias=False,
            qk_norm=True,
            norm_unit_offset=True,
            scale=config.query_pre_attn_scalar**-0.5,
            sliding_window=config.sliding_window if layer_type == SLIDING else None,
            rope_key=layer_type,
        )

    def rope_parameters_for(self, config: Any, rope_key: str) -> dict[str, Any]:
        nested = getattr(config, "rope_parameters", None)
        if isinstance(nested, dict) and isinstance(nested.get(rope_key), dict):
            return rope_parameters(config, rope_key)
        # A config from before per-layer-type rope parameters: `rope_theta` and
        # `rope_scaling` are the global layers', `rope_local_base_freq` the local ones'.
        if rope_key == SLIDING:
            theta = getattr(config, "rope_local_base_freq", None) or 10000.0
            return {"rope_type": "default", "rope_theta": theta}
        return rope_parameters(config)

    def embed_scale(self, config: Any) -> float | None:
        return config.hidden_size**0.5

    @property
    def final_logit_softcapping(self) -> float | None:
        return getattr(self.config, "final_logit_softcapping", None)
