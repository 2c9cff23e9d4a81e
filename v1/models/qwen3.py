"""Qwen3: Llama's structure with a per-head RMSNorm on q and k before RoPE, an explicit
`head_dim` (not hidden_size / heads: Qwen3-0.6B has 16 heads of 128 in a 1024 model), biases
only by `attention_bias`, and the Qwen sliding-window rule."""

from dataclasses import replace
from typing import Any

from v1.models.decoder import LayerSpec
from v1.models.llama import LlamaForCausalLM
from v1.models.qwen2 import qwen_sliding_window


class Qwen3ForCausalLM(LlamaForCausalLM):
    def layer_spec(self, config: Any, layer_idx: int) -> LayerSpec:
        return replace(super().layer_spec(config, layer_idx), qk_norm=True)

    def sliding_window(self, config: Any, layer_idx: int) -> int | None:
        return qwen_sliding_window(config, layer_idx)
