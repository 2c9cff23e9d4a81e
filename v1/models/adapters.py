"""Architectures as their base-model checkpoints: transformers' `LlamaModel`, `Qwen3Model`, ...
(what a sentence-transformers folder of a decoder holds: the transformer without its LM head,
tensors named `layers.0...` rather than `model.layers.0...`). Only the pooling runner runs
them (`EngineArgs.runner`): there is no head to compute logits with."""

import functools
from collections.abc import Iterable

import torch

from v1.models.decoder import DecoderForCausalLM
from v1.models.layers.quantized import QuantizedWeight

_PREFIX = "model."


@functools.cache
def as_base_model(cls: type[DecoderForCausalLM]) -> type[DecoderForCausalLM]:
    """`cls` without its LM head, loading tensors named as the base model names them."""

    def load_weights(
        self: DecoderForCausalLM,
        weights: Iterable[tuple[str, torch.Tensor | QuantizedWeight]],
        quantize: str | None = None,
    ) -> None:
        renamed = (
            (name if name.startswith(_PREFIX) else _PREFIX + name, tensor)
            for name, tensor in weights
        )
        cls.load_weights(self, renamed, quantize)

    name = cls.__name__.removesuffix("ForCausalLM") + "Model"
    return type(name, (cls,), {"has_lm_head": False, "load_weights": load_weights,
                               "__doc__": f"{cls.__name__} as a base model (no LM head)."})
