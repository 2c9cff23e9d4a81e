"""v1: a compact LLM inference engine with the architecture of vLLM's V1.

The top-level names are vLLM's (`from v1 import LLM, SamplingParams, EngineArgs, ...`). Those
that need torch are imported at first use, so that `import v1.core` stays torch-free.
"""

from typing import TYPE_CHECKING, Any

from v1.inputs import PromptType, TextPrompt, TokensPrompt
from v1.sampling_params import RequestOutputKind, SamplingParams, StructuredOutputsParams

if TYPE_CHECKING:
    from v1.config import EngineArgs
    from v1.engine.arg_utils import AsyncEngineArgs
    from v1.engine.async_llm import AsyncLLM as AsyncLLMEngine
    from v1.engine.llm_engine import LLMEngine
    from v1.entrypoints.llm import LLM
    from v1.outputs import (
        ClassificationOutput,
        ClassificationRequestOutput,
        CompletionOutput,
        EmbeddingOutput,
        EmbeddingRequestOutput,
        PoolingOutput,
        PoolingRequestOutput,
        RequestOutput,
        ScoringOutput,
        ScoringRequestOutput,
    )
    from v1.pooling_params import PoolingParams

# name -> (module, attribute): imported at first use.
_LAZY = {
    "LLM": ("v1.entrypoints.llm", "LLM"),
    "LLMEngine": ("v1.engine.llm_engine", "LLMEngine"),
    "AsyncLLMEngine": ("v1.engine.async_llm", "AsyncLLM"),  # vLLM V1's alias of AsyncLLM
    "EngineArgs": ("v1.config", "EngineArgs"),
    "AsyncEngineArgs": ("v1.engine.arg_utils", "AsyncEngineArgs"),
    "RequestOutput": ("v1.outputs", "RequestOutput"),
    "CompletionOutput": ("v1.outputs", "CompletionOutput"),
    "PoolingParams": ("v1.pooling_params", "PoolingParams"),
    **{name: ("v1.outputs", name) for name in (
        "PoolingOutput", "PoolingRequestOutput", "EmbeddingOutput", "EmbeddingRequestOutput",
        "ClassificationOutput", "ClassificationRequestOutput", "ScoringOutput",
        "ScoringRequestOutput",
    )},
}

__all__ = [
    "LLM", "LLMEngine", "AsyncLLMEngine", "EngineArgs", "AsyncEngineArgs", "RequestOutput",
    "CompletionOutput", "PromptType", "TextPrompt", "TokensPrompt", "RequestOutputKind",
    "SamplingParams", "StructuredOutputsParams", "PoolingParams", "PoolingOutput",
    "PoolingRequestOutput", "EmbeddingOutput", "EmbeddingRequestOutput", "ClassificationOutput",
    "ClassificationRequestOutput", "ScoringOutput", "ScoringRequestOutput",
]


def __getattr__(name: str) -> Any:
    if name == "__version__":  # vLLM's `vllm.__version__`: the installed package's
        import importlib.metadata

        return importlib.metadata.version("v1")
    if name in _LAZY:
        import importlib

        from v1.startup_gc import paused_for_import

        module, attribute = _LAZY[name]
        with paused_for_import(module):  # v1/startup_gc.py
            return getattr(importlib.import_module(module), attribute)
    raise AttributeError(f"module 'v1' has no attribute {name!r}")
