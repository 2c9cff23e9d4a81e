"""Mistral: Llama's structure, with `config.sliding_window` (when set) in every layer, as
transformers' Mistral applies it (it ignores any `layer_types`; Ministral is another model)."""

from typing import Any

from v1.models.llama import LlamaForCausalLM


class MistralForCausalLM(LlamaForCausalLM):
    def sliding_window(self, config: Any, layer_idx: int) -> int | None:
        return getattr(config, "sliding_window", None)
