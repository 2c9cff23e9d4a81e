"""Model architectures over the paged KV cache, and the registry that picks one per checkpoint.

`registry.get_model_cls(hf_config)` maps `config.json`'s `architectures` to a class;
`decoder.py` is the decoder they all are, `layers/` the pieces they share, and each
`<arch>.py` holds only what its architecture changes.
"""

from v1.models.decoder import DecoderForCausalLM, head_dim_of
from v1.models.registry import get_model_cls, supported_architectures

__all__ = ["DecoderForCausalLM", "get_model_cls", "head_dim_of", "supported_architectures"]
