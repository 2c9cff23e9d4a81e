"""v1: a compact LLM inference engine with the architecture of vLLM's V1."""

from typing import TYPE_CHECKING

from v1.sampling_params import SamplingParams, StructuredOutputsParams

if TYPE_CHECKING:
    from v1.entrypoints.llm import LLM

__all__ = ["LLM", "SamplingParams", "StructuredOutputsParams"]


def __getattr__(name: str):
    # Lazy: `import v1.core` must not pull in torch through the package.
    if name == "LLM":
        from v1.entrypoints.llm import LLM

        return LLM
    raise AttributeError(f"module 'v1' has no attribute {name!r}")
