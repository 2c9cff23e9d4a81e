"""Qwen2 / Qwen2.5: Llama's structure with biases on q, k and v (not on o), and the Qwen
sliding-window rule.

The window (`sliding_window`) applies only with `use_sliding_window`, and then only to layers
from `max_window_layers` on; transformers 5 spells that out as `layer_types`, which we read
when present (its config fills it from the other two).
"""

from dataclasses import replace
from typing import Any

from v1.models.decoder import LayerSpec
from v1.models.llama import LlamaForCausalLM


def qwen_sliding_window(config: Any, layer_idx: int) -> int | None:
    """The window of layer `layer_idx` under the Qwen2/Qwen3 rule (see the module doc)."""
    if not getattr(config, "use_sliding_window", False):
        return None
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None:
        return window if layer_types[layer_idx] == "sliding_attention" else None
    return window if layer_idx >= getattr(config, "max_window_layers", 0) else None


class Qwen2ForCausalLM(LlamaForCausalLM):
    def layer_spec(self, config: Any, layer_idx: int) -> LayerSpec:
        return replace(super().layer_spec(config, layer_idx), qkv_bias=True, o_bias=False)

    def sliding_window(self, config: Any, layer_idx: int) -> int | None:
        return qwen_sliding_window(config, layer_idx)
