"""Which model class runs a checkpoint: `config.json`'s `architectures`, as in vLLM.

Classes are imported on first use, so listing an architecture costs nothing. A config without
`architectures` (one built in code) falls back on its `model_type`. Base-model checkpoints of
the decoders (`LlamaModel`, `Qwen3Model`, ...: sentence-transformers folders) run as their
architecture without an LM head (`v1.models.adapters`); they, and every architecture in
`_POOLING_ONLY`, are pooling models: `runner="auto"` pools them (`is_pooling_only`).
"""

import importlib
from typing import TYPE_CHECKING, Any

from v1.models.decoder import DecoderForCausalLM

if TYPE_CHECKING:
    from v1.models.bert import BertModel

# HF architecture name -> the module under v1.models defining the class of that name.
_MODELS: dict[str, str] = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Gemma3ForCausalLM": "gemma3",
    "Phi3ForCausalLM": "phi3",
}

# Base-model checkpoints -> the architecture they are the body of.
_BASE_MODELS: dict[str, str] = {
    "LlamaModel": "LlamaForCausalLM",
    "MistralModel": "MistralForCausalLM",
    "Qwen2Model": "Qwen2ForCausalLM",
    "Qwen3Model": "Qwen3ForCausalLM",
    "Gemma3TextModel": "Gemma3ForCausalLM",
    "Phi3Model": "Phi3ForCausalLM",
}

# Architectures that have no LM head at all (encoders, classifiers).
_POOLING_ONLY: dict[str, str] = {
    "BertModel": "bert",
    "RobertaModel": "bert",
    "XLMRobertaModel": "bert",
    "BertForSequenceClassification": "bert",
    "XLMRobertaForSequenceClassification": "bert",
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
    return [*_MODELS, *_BASE_MODELS, *_POOLING_ONLY]


def _architectures(config: Any) -> list[str]:
    architectures = list(getattr(config, "architectures", None) or [])
    if not architectures:
        fallback = _BY_MODEL_TYPE.get(getattr(config, "model_type", None) or "")
        architectures = [fallback] if fallback else []
    return architectures


def is_pooling_only(config: Any) -> bool:
    """Whether the checkpoint has no LM head (what `runner="auto"` pools)."""
    return any(a in _BASE_MODELS or a in _POOLING_ONLY for a in _architectures(config))


def get_model_cls(config: Any) -> "type[DecoderForCausalLM | BertModel]":
    """The class for `config` (an HF PretrainedConfig); ValueError listing the supported
    architectures when none of the config's is one of them."""
    architectures = _architectures(config)
    for arch in architectures:
        if arch in _MODELS:
            module = importlib.import_module(f"v1.models.{_MODELS[arch]}")
            return getattr(module, arch)
        if arch in _POOLING_ONLY:
            module = importlib.import_module(f"v1.models.{_POOLING_ONLY[arch]}")
            return getattr(module, arch)
        if arch in _BASE_MODELS:
            from v1.models.adapters import as_base_model

            full = _BASE_MODELS[arch]
            module = importlib.import_module(f"v1.models.{_MODELS[full]}")
            return as_base_model(getattr(module, full))
    raise ValueError(
        f"unsupported model architecture {architectures or getattr(config, 'model_type', None)!r}"
        f"; supported: {', '.join(supported_architectures())}"
    )
