"""Tool calling for chat completions: OpenAI's `tools` and `tool_choice`, as vLLM serves them.

"none" (plain text), a named function (the output constrained to its `parameters` schema),
"required" (a JSON array of calls, each one of the tools with its schema) and "auto" (the
hermes parser lifts `<tool_call>` blocks out of free text; `strict` functions held to their
schema by a structural tag): docs/serving.md. Each choice's text goes through one incremental
extractor (`feed` deltas, then `finish`), so a non-streamed response is the sum of the same
deltas as the streamed one.
"""

import dataclasses
import json
import uuid
from abc import ABC, abstractmethod
from typing import Any, NamedTuple

from v1.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    ChatCompletionTool,
    DeltaFunctionCall,
    DeltaToolCall,
    FunctionCall,
    ToolCall,
)
from v1.sampling_params import SamplingParams, StructuredOutputsParams

TOOL_CALL_PARSERS = ("hermes",)


class ToolDelta(NamedTuple):
    content: str
    tool_calls: list[DeltaToolCall]


def _new_call(index: int, name: str, arguments: str) -> DeltaToolCall:
    return DeltaToolCall(
        index=index, id=f"chatcmpl-tool-{uuid.uuid4().hex}", type="function",
        function=DeltaFunctionCall(name=name, arguments=arguments),
    )


_DECODER = json.JSONDecoder()


def _decode_prefix(text: str) -> tuple[Any, str] | None:
    """The JSON value at the start of `text` and the text after it; None while incomplete."""
    try:
        value, end = _DECODER.raw_decode(text)
    except json.JSONDecodeError:
        return None
    return value, text[end:]


def _arguments_text(arguments: Any) -> str:
    return arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)


class ToolCallExtractor(ABC):
    """One choice's text in, content and tool-call deltas out."""

    # Whether the choice's finish reason becomes "tool_calls" once it made a call.
    finishes_with_tool_calls = True

    def __init__(self) -> None:
        self.num_calls = 0

    @abstractmethod
    def feed(self, text: str) -> ToolDelta: ...

    @abstractmethod
    def finish(self) -> ToolDelta:
        """Whatever is held back; text that never became a call is returned as content."""

    def _call(self, name: str, arguments: Any) -> DeltaToolCall:
        self.num_calls += 1
        return _new_call(self.num_calls - 1, name, _arguments_text(arguments))


class NamedToolCall(ToolCallExtractor):
    """The output is the arguments of one call to `name`: streamed as they come."""

    finishes_with_tool_calls = False  # as vLLM (OpenAI's named choice ends with "stop")

    def __init__(self, name: str) -> None:
        super().__init__()
        self._name = name

    def feed(self, text: str) -> ToolDelta:
        if self.num_calls == 0:
            return ToolDelta("", [self._call(self._name, text)])
        return ToolDelta("", [DeltaToolCall(index=0, function=DeltaFunctionCall(arguments=text))])

    def finish(self) -> ToolDelta:
        return self.feed("") if self.num_calls == 0 else ToolDelta("", [])


class RequiredToolCalls(ToolCallExtractor):
    """The output is a JSON array of {"name", "parameters"} objects (the grammar guarantees
    it); each object becomes a call as soon as it is complete."""

    def __init__(self) -> None:
        super().__init__()
        self._buffer = ""
        self._opened = False
        self._text = ""  # all of it, for a choice cut off before its first call

    def feed(self, text: str) -> ToolDelta:
        self._text += text
        self._buffer += text
        calls: list[DeltaToolCall] = []
        while True:
            self._buffer = self._buffer.lstrip()
            if not self._opened:
                if not self._buffer.startswith("["):
                    break
                self._opened = True
                self._buffer = self._buffer[1:]
                continue
            if self._buffer[:1] in (",", "]"):
                self._buffer = self._buffer[1:]
                continue
            decoded = _decode_prefix(self._buffer)
            if decoded is None:
                break
            value, self._buffer = decoded
            calls.append(self._call(value["name"], value["parameters"]))
        return ToolDelta("", calls)

    def finish(self) -> ToolDelta:
        rest, self._buffer = self._buffer, ""
        if self.num_calls == 0:  # cut off (max_tokens) before a call: the text as written
            return ToolDelta(self._text, [])
        return ToolDelta(rest, [])  # a cut-off call after others: kept as text, not lost


class HermesToolParser(ToolCallExtractor):
    """Free text with `<tool_call>{"name": ..., "arguments": ...}</tool_call>` blocks.

    Text is streamed as content, except a tail that may be the start of a tag (held back until
    it is not) and whitespace around calls (dropped). A block that is not such JSON, or a call
    past `max_calls`, is content as written: nothing the model wrote is lost."""

    START, END = "<tool_call>", "</tool_call>"

    def __init__(self, max_calls: int | None = None) -> None:
        super().__init__()
        self._max_calls = max_calls
        self._buffer = ""
        self._in_call = False
        self._space_before = ""  # the whitespace before the open block
        self._after_call = False  # whitespace after a call is dropped, in whatever deltas

    def feed(self, text: str) -> ToolDelta:
        self._buffer += text
        content, calls = "", []
        while True:
            if self._in_call:
                end = self._buffer.find(self.END)
                if end < 0:
                    break
                body, self._buffer = self._buffer[:end], self._buffer[end + len(self.END) :]
                self._in_call = False
                call = self._parse(body)
                if call is None:
                    content += self._space_before + self.START + body + self.END
                else:
                    calls.append(call)
                    self._after_call = True
                continue
            if self._after_call:
                self._buffer = self._buffer.lstrip()
                self._after_call = not self._buffer
            start = self._buffer.find(self.START)
            if start >= 0:
                head = self._buffer[:start]
                content += head.rstrip()
                self._space_before = head[len(head.rstrip()) :]
                self._buffer = self._buffer[start + len(self.START) :]
                self._in_call = True
                continue
            keep = self._held_back(self._buffer)
            content += self._buffer[: len(self._buffer) - keep]
            self._buffer = self._buffer[len(self._buffer) - keep :]
            break
        return ToolDelta(content, calls)

    def finish(self) -> ToolDelta:
        rest, self._buffer = self._buffer, ""
        if self._in_call:  # cut off before its end tag: a call if its JSON is whole
            self._in_call = False
            call = self._parse(rest)
            if call is not None:
                return ToolDelta("", [call])
            return ToolDelta(self._space_before + self.START + rest, [])
        return ToolDelta("" if self.num_calls and not rest.strip() else rest, [])

    def _held_back(self, text: str) -> int:
        """How much of the text's end to hold back: what may be the start of a tag, and the
        whitespace before it (dropped if a call follows)."""
        tag = next(
            (n for n in range(min(len(self.START) - 1, len(text)), 0, -1)
             if self.START.startswith(text[-n:])),
            0,
        )
        head = text[: len(text) - tag]
        return tag + len(head) - len(head.rstrip())

    def _parse(self, body: str) -> DeltaToolCall | None:
        if self._max_calls is not None and self.num_calls >= self._max_calls:
            return None
        decoded = _decode_prefix(body.strip())
        if decoded is None:
            return None
        value, rest = decoded
        if rest or not isinstance(value, dict) or not isinstance(value.get("name"), str):
            return None
        if "arguments" not in value:
            return None
        return self._call(value["name"], value["arguments"])


def hermes_structural_tag(tools: list[ChatCompletionTool]) -> StructuredOutputsParams:
    """Free text, but once the model opens `<tool_call>` it must write a call to one of the
    tools in the Hermes parser's format, with arguments that follow the function's schema
    (strict functions) or any JSON object (the others): OpenAI's `strict` under "auto"."""
    tags = [
        {
            "type": "tag",
            "begin": f'{HermesToolParser.START}\n{{"name": {json.dumps(tool.function.name)}, '
            '"arguments": ',
            "content": {"type": "json_schema", "json_schema": (
                tool.function.parameters or {"type": "object"}
                if tool.function.strict else {"type": "object"}
            )},
            "end": f"}}\n{HermesToolParser.END}",
        }
        for tool in tools
    ]
    return StructuredOutputsParams(structural_tag=json.dumps({
        "type": "structural_tag",
        "format": {"type": "triggered_tags", "triggers": [HermesToolParser.START], "tags": tags},
    }))


def tool_call_extractor(
    request: ChatCompletionRequest, parser: str | None
) -> ToolCallExtractor | None:
    """The extractor for a request's tool choice; None when its output is plain text."""
    choice = request.effective_tool_choice
    if choice == "none":
        return None
    if choice == "required":
        return RequiredToolCalls()
    if choice == "auto":
        if parser is None:
            raise ValueError(
                '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser '
                "to be set"
            )
        return HermesToolParser(None if request.parallel_tool_calls else 1)
    return NamedToolCall(choice.function.name)


def constrain_auto_tool_calls(
    request: ChatCompletionRequest, params: SamplingParams
) -> SamplingParams:
    """Under "auto", strict functions are held to their schemas (structured output)."""
    tools = request.tools or []
    if request.effective_tool_choice != "auto" or not any(t.function.strict for t in tools):
        return params
    if params.structured_outputs is not None:
        raise ValueError(
            "strict tools are enforced with structured output: they cannot be combined with "
            "response_format or structured_outputs"
        )
    return dataclasses.replace(params, structured_outputs=hermes_structural_tag(tools))


def merge_tool_calls(deltas: list[DeltaToolCall]) -> list[ToolCall]:
    """Whole calls from their streamed deltas (the first of each carries id and name)."""
    calls: list[ToolCall] = []
    for delta in deltas:
        if delta.id is not None:
            assert delta.function is not None and delta.function.name is not None
            calls.append(ToolCall(id=delta.id, function=FunctionCall(
                name=delta.function.name, arguments=delta.function.arguments or ""
            )))
        elif delta.function is not None and delta.function.arguments:
            calls[delta.index].function.arguments += delta.function.arguments
    return calls
