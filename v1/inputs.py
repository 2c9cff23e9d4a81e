"""The prompt types, with vLLM's names (`vllm.inputs`): what `LLM.generate`,
`LLMEngine.add_request` and `AsyncLLM.generate` take as one prompt. Plain typing only."""

from collections.abc import Mapping, Sequence
from typing import Any, NotRequired, TypedDict


class TextPrompt(TypedDict):
    """A prompt as text, tokenized by the engine."""

    prompt: str


class TokensPrompt(TypedDict):
    """A prompt as token ids, used as they are; `prompt` (optional) is their text, which
    outputs then report as the prompt."""

    prompt_token_ids: list[int]
    prompt: NotRequired[str]


# Text, token ids, or one of the dicts above (any mapping with their keys).
PromptType = str | Sequence[int] | TextPrompt | TokensPrompt | Mapping[str, Any]
