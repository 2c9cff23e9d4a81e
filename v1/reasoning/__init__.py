"""Reasoning parsers (vLLM's `vllm.reasoning`, `--reasoning-parser NAME`): a reasoning model's
text split into its reasoning and its answer, which the chat API returns as `reasoning` (and
`reasoning_content`, the field's older name) and `content`.

A parser reads one choice's text incrementally (`feed` each delta, then `finish`), so a
non-streamed message is exactly the sum of the streamed deltas. Text only: the tags are
matched in the decoded text, a tag split across deltas included (its start is held back
until it is known not to be one).
"""

from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from typing import Any, ClassVar, NamedTuple


class ReasoningDelta(NamedTuple):
    reasoning: str
    content: str


def partial_tag_len(text: str, tag: str) -> int:
    """The length of the longest end of `text` that is the start of `tag` (not all of it):
    what a stream must hold back until the next delta says whether the tag follows."""
    return next(
        (n for n in range(min(len(tag) - 1, len(text)), 0, -1) if tag.startswith(text[-n:])), 0
    )


class ReasoningParser(ABC):
    """One choice's text in, reasoning and content out. `chat_template_kwargs`: the
    request's (a parser may read a switch such as Qwen3's `enable_thinking`)."""

    def __init__(self, chat_template_kwargs: Mapping[str, Any] | None = None) -> None:
        self.chat_template_kwargs = dict(chat_template_kwargs or {})

    @abstractmethod
    def feed(self, text: str) -> ReasoningDelta: ...

    @abstractmethod
    def finish(self) -> ReasoningDelta:
        """Whatever was held back, the choice's text having ended."""


class ReasoningParserManager:
    """vLLM's registry of reasoning parsers, by the names `--reasoning-parser` takes."""

    reasoning_parsers: ClassVar[dict[str, type[ReasoningParser]]] = {}

    @classmethod
    def register_module(
        cls, name: str
    ) -> Callable[[type[ReasoningParser]], type[ReasoningParser]]:
        def register(parser: type[ReasoningParser]) -> type[ReasoningParser]:
            cls.reasoning_parsers[name] = parser
            return parser

        return register

    @classmethod
    def get_reasoning_parser(cls, name: str) -> type[ReasoningParser]:
        parser = cls.reasoning_parsers.get(name)
        if parser is None:
            raise KeyError(
                f"reasoning parser {name!r} is not registered "
                f"(known: {', '.join(sorted(cls.reasoning_parsers))})"
            )
        return parser


class ThinkingReasoningParser(ReasoningParser):
    """Reasoning between `START` and `END` tags, at the start of the output. The start tag is
    optional (chat templates often put it in the prompt): everything before the end tag is
    reasoning, everything after it content; a text that never closes its reasoning (cut off
    by max_tokens) is all reasoning."""

    START: ClassVar[str]
    END: ClassVar[str]

    def __init__(self, chat_template_kwargs: Mapping[str, Any] | None = None) -> None:
        super().__init__(chat_template_kwargs)
        self._buffer = ""
        self._reasoning = self.thinks()
        self._at_start = True  # the start tag may still come, after leading whitespace

    def thinks(self) -> bool:
        """Whether the output starts in reasoning (False: the request turned thinking off,
        and its output is all content)."""
        return True

    def feed(self, text: str) -> ReasoningDelta:
        if not self._reasoning:
            return ReasoningDelta("", text)
        self._buffer += text
        if self._at_start:
            stripped = self._buffer.lstrip()
            if stripped.startswith(self.START):
                self._buffer = stripped[len(self.START):]
                self._at_start = False
            elif self.START.startswith(stripped):
                return ReasoningDelta("", "")  # maybe the start tag: wait
            else:
                self._at_start = False
        end = self._buffer.find(self.END)
        if end >= 0:
            reasoning, content = self._buffer[:end], self._buffer[end + len(self.END):]
            self._buffer, self._reasoning = "", False
            return ReasoningDelta(reasoning, content)
        keep = partial_tag_len(self._buffer, self.END)
        reasoning = self._buffer[: len(self._buffer) - keep]
        self._buffer = self._buffer[len(self._buffer) - keep:]
        return ReasoningDelta(reasoning, "")

    def finish(self) -> ReasoningDelta:
        rest, self._buffer = self._buffer, ""
        return ReasoningDelta(rest, "")


@ReasoningParserManager.register_module("deepseek_r1")
class DeepSeekR1ReasoningParser(ThinkingReasoningParser):
    """DeepSeek-R1 (and its distilled Qwen / Llama models): `<think>...</think>`, the
    template opening `<think>` in the prompt."""

    START, END = "<think>", "</think>"


@ReasoningParserManager.register_module("qwen3")
class Qwen3ReasoningParser(ThinkingReasoningParser):
    """Qwen3: `<think>...</think>`; a request whose `chat_template_kwargs` set
    `enable_thinking: false` gets a template that closes the reasoning in the prompt, so its
    output is all content."""

    START, END = "<think>", "</think>"

    def thinks(self) -> bool:
        return self.chat_template_kwargs.get("enable_thinking", True) is not False


REASONING_PARSERS = tuple(ReasoningParserManager.reasoning_parsers)

__all__ = [
    "REASONING_PARSERS", "DeepSeekR1ReasoningParser", "Qwen3ReasoningParser", "ReasoningDelta",
    "ReasoningParser", "ReasoningParserManager", "ThinkingReasoningParser", "partial_tag_len",
]
