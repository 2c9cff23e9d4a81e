"""Model architectures over the paged KV cache, the registry that picks one per checkpoint,
and loading them.

`registry.get_model_cls(hf_config)` maps `config.json`'s `architectures` to a class;
`decoder.py` is the decoder they all are, `layers/` the pieces they share (elementwise ops
included), and each `<arch>.py` holds only what its architecture changes. `loader.py` finds
a model and loads its weights, config and tokenizer; `gguf_conversion.py` turns a GGUF file
into an HF directory.

Below the worker, above attention and the kernels: nothing here imports `v1.worker` (the
runner hands a model its step's plan, `step_plan.StepPlan`, never itself).
"""

from v1.models.decoder import DecoderForCausalLM, head_dim_of, num_kv_heads_of
from v1.models.registry import get_model_cls, supported_architectures

__all__ = [
    "DecoderForCausalLM", "get_model_cls", "head_dim_of", "num_kv_heads_of",
    "supported_architectures",
]
