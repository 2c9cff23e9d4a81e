"""Llama (and SmolLM2, the default model): the baseline the other architectures change.

Pre-norm blocks of attention and a SiLU-gated MLP, RMSNorm `w * x`, biases only where the
config asks (`attention_bias` on q/k/v/o, `mlp_bias`), full attention in every layer: the
transformers Llama passes no sliding window even if a config carries one.
"""

from typing import Any

from v1.models.decoder import DEFAULT_ROPE, DecoderForCausalLM, LayerSpec, head_dim_of


class LlamaForCausalLM(DecoderForCausalLM):
    def layer_spec(self, config: Any, layer_idx: int) -> LayerSpec:
        head_dim = head_dim_of(config)
        bias = bool(getattr(config, "attention_bias", False))
        return LayerSpec(
            hidden_size=config.hidden_size,
            num_heads=config.num_attention_heads,
            num_kv_heads=config.num_key_value_heads,
            head_dim=head_dim,
            intermediate_size=config.intermediate_size,
            hidden_act=getattr(config, "hidden_act", "silu"),
            rms_norm_eps=config.rms_norm_eps,
            qkv_bias=bias,
            o_bias=bias,
            mlp_bias=bool(getattr(config, "mlp_bias", False)),
            qk_norm=False,
            norm_unit_offset=False,
            scale=head_dim**-0.5,
            sliding_window=self.sliding_window(config, layer_idx),
            rope_key=DEFAULT_ROPE,
        )

    def sliding_window(self, config: Any, layer_idx: int) -> int | None:
        return None
