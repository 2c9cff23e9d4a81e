"""Phi-3 / Phi-3.5: Llama's structure; the checkpoint stores q/k/v as one `qkv_proj` and gate/up
as one `gate_up_proj` already (rows in our order, so they load whole), and `sliding_window`
applies to every layer when set, as in transformers' Phi-3.

Not supported: `longrope` scaling (the 128k variants; see `layers/rotary.py`) and
`partial_rotary_factor` < 1 (Phi-4-mini): both raise at load.
"""

from typing import Any

from v1.models.llama import LlamaForCausalLM


class Phi3ForCausalLM(LlamaForCausalLM):
    def sliding_window(self, config: Any, layer_idx: int) -> int | None:
        return getattr(config, "sliding_window", None)
