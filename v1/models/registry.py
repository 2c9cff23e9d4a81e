"""Which model class runs a checkpoint: `config.json`'s `architectures`, as in vLLM.

Classes are imported on first use, so listing an architecture costs nothing. A config without
`architectures` (one built in code) falls back on its `model_type`.
"""

import importlib
from typing import Any

from v1.models.decoder import DecoderForCausalLM

# HF architecture name -> the module under v1.models defining the class of that name.
_MODELS: dict[str, str] = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Gemma3ForCausalLM": "gemma3",
    "Phi3ForCausalLM": "phi3",
}

_BY_MODEL_TYPE: dict[str, str] = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
    "phi3": "Phi3ForCausalLM",
}


def supported_architectures() -> list[str]:
    return list(_MODELS)


def get_model_cls(config: Any) -> type[DecoderForCausalLM]:
    """The class for `config` (an HF PretrainedConfig); ValueError listing the supported
    architectures when none of the config's is one of them."""
    architectures = list(getattr(config, "architectures", None) or [])
    if not architectures:
        fallback = _BY_MODEL_TYPE.get(getattr(config, "model_type", None) or "")
        architectures = [fallback] if fallback else []
    for arch in architectures:
        if arch in _MODELS:
            module = importlib.import_module(f"v1.models.{_MODELS[arch]}")
            return getattr(module, arch)
    raise ValueError(
        f"unsupported model architecture {architectures or getattr(config, 'model_type', None)!r}"
        f"; supported: {', '.join(_MODELS)}"
    )
