"""vLLM's `vllm.engine.async_llm_engine`: `AsyncLLMEngine`, vLLM V1's alias of `AsyncLLM`."""

from v1.engine.async_llm import AsyncLLM

AsyncLLMEngine = AsyncLLM

__all__ = ["AsyncLLMEngine"]
