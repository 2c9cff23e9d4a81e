"""Model architectures over the paged KV cache, the registry that picks one per checkpoint
(`registry.get_model_cls`), and loading them (`loader`, `gguf_conversion`). `decoder.py` is the
decoder they all are, `layers/` the pieces they share, each `<arch>.py` only what its
architecture changes. Nothing here imports `v1.worker`: the runner hands a model its step's
plan (`step_plan.StepPlan`), never itself.
"""

from v1.models.decoder import DecoderForCausalLM, head_dim_of, num_kv_heads_of
from v1.models.registry import get_model_cls, supported_architectures

__all__ = [
    "DecoderForCausalLM", "get_model_cls", "head_dim_of", "num_kv_heads_of",
    "supported_architectures",
]
