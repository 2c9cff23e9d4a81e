"""Tool calling for chat completions: OpenAI's `tools` and `tool_choice`, as vLLM serves them.

"none" (plain text), a named function (the output constrained to its `parameters` schema),
"required" (a JSON array of calls, each one of the tools with its schema) and "auto" (the
server's `--tool-call-parser`, one of `TOOL_CALL_PARSERS`, lifts the model's calls out of
free text; with hermes, `strict` functions are held to their schema by a structural tag):
docs/serving.md. Each choice's text goes through one incremental extractor (`feed` deltas,
then `finish`), so a non-streamed response is the sum of the same deltas as the streamed one;
"required" and every "auto" format share one skeleton, `MarkedJsonToolParser`.
"""

import dataclasses
import json
import re
import uuid
from abc import ABC, abstractmethod
from typing import Any, ClassVar, NamedTuple

from v1.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    ChatCompletionTool,
    DeltaFunctionCall,
    DeltaToolCall,
    FunctionCall,
    ToolCall,
)
from v1.reasoning import partial_tag_len
from v1.sampling_params import SamplingParams, StructuredOutputsParams


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


class _NotACall:
    """`_item`'s answer for text that is no call (as opposed to one not yet complete)."""


NOT_A_CALL = _NotACall()


class MarkedJsonToolParser(ToolCallExtractor):
    """The streaming skeleton of the "auto" parsers (`TOOL_CALL_PARSERS`): free text is
    content until one of `OPENERS`, then calls, each a JSON object with a string "name" and
    one of `ARGUMENT_KEYS` (`_item` may read another form), with `SEPARATORS` or further
    openers between them, until `CLOSE` (then text again) or, without one, until text that
    starts no call. With `AT_START`, an opener counts only at the start of the output.

    Streamed: content goes out as it comes, except a tail that may begin an opener (held
    back until it is not) and the whitespace around calls (dropped). A block that holds no
    valid call, or a call past `max_calls`, is content as written: nothing the model wrote is
    lost. An opener that begins with "{" is the call's own JSON, not consumed."""

    OPENERS: ClassVar[tuple[str, ...]]
    CLOSE: ClassVar[str] = ""
    AT_START: ClassVar[bool] = False
    SEPARATORS: ClassVar[str] = ""
    ARGUMENT_KEYS: ClassVar[tuple[str, ...]] = ("arguments",)

    def __init__(self, max_calls: int | None = None) -> None:
        super().__init__()
        self._max_calls = max_calls
        self._buffer = ""
        # The open block's text not yet made a call (None: in free text), and its calls.
        self._block: str | None = None
        self._block_calls = 0
        # The buffer's length when its JSON object last failed to decode (0: not pending).
        self._undecoded = 0
        self._space_before = ""  # the whitespace before the open block
        self._after_call = False  # whitespace after a call is dropped, in whatever deltas
        self._started = False  # past the output's start: AT_START openers no longer count
        self._content: list[str] = []  # what this feed / finish gives out
        self._calls: list[DeltaToolCall] = []

    def feed(self, text: str) -> ToolDelta:
        self._buffer += text
        while True:
            if self._block is not None:
                if not self._read_block(final=False):
                    break
                continue
            if self._after_call:
                self._buffer = self._buffer.lstrip()
                self._after_call = not self._buffer
            opened = self._find_opener()
            if opened is None:
                self._emit_text(len(self._buffer) - self._held_back(self._buffer))
                break
            start, opener = opened
            head = self._buffer[:start]
            if self._longer_opener_may_follow(self._buffer[start:], opener):
                self._emit_text(len(head.rstrip()))
                break
            self._content.append(head.rstrip())
            self._space_before = head[len(head.rstrip()):]
            body = start if opener.startswith("{") else start + len(opener)
            self._block, self._buffer = self._buffer[start:body], self._buffer[body:]
            self._block_calls, self._started = 0, True
        return self._take()

    def finish(self) -> ToolDelta:
        if self._block is not None:
            self._read_block(final=True)
        rest, self._buffer = self._buffer, ""
        if self._block is not None:  # cut off inside a block: what is not a call is text
            rest, self._block = self._block + rest, None
            rest = "" if self._block_calls and self._is_filler(rest) else self._space_before + rest
        self._content.append("" if self.num_calls and not rest.strip() else rest)
        return self._take()

    # -- the part a format may change --------------------------------------------------------

    def _item(self, text: str) -> tuple[str, str, str] | _NotACall | None:
        """The call at the start of `text` as (name, its arguments' JSON text, the text after
        it); NOT_A_CALL; or None while it may still become one."""
        if not text.startswith("{"):
            return NOT_A_CALL
        decoded = _decode_prefix(text)
        if decoded is None:
            return None
        value, rest = decoded
        if not isinstance(value, dict) or not isinstance(value.get("name"), str):
            return NOT_A_CALL
        key = next((k for k in self.ARGUMENT_KEYS if k in value), None)
        if key is None:
            return NOT_A_CALL
        return value["name"], _arguments_text(value[key]), rest

    # -- the skeleton ------------------------------------------------------------------------

    def _take(self) -> ToolDelta:
        got = ToolDelta("".join(self._content), self._calls)
        self._content, self._calls = [], []
        return got

    def _emit_text(self, end: int) -> None:
        """The buffer's text up to `end` is content; the rest is held back."""
        self._content.append(self._buffer[:end])
        self._started |= bool(self._buffer[:end].strip())
        self._buffer = self._buffer[end:]

    def _find_opener(self) -> tuple[int, str] | None:
        """The first opener in the buffer (the longest one where several start), and where."""
        if self.AT_START:
            stripped = self._buffer.lstrip()
            openers = [o for o in self.OPENERS if stripped.startswith(o)]
            if self._started or not openers:
                return None
            return len(self._buffer) - len(stripped), max(openers, key=len)
        found = [(i, o) for o in self.OPENERS if (i := self._buffer.find(o)) >= 0]
        return min(found, key=lambda f: (f[0], -len(f[1]))) if found else None

    def _longer_opener_may_follow(self, text: str, opener: str) -> bool:
        """Whether `text`, which starts with `opener`, may still become a longer opener."""
        return any(len(o) > len(text) and o.startswith(text) for o in self.OPENERS
                   if len(o) > len(opener))

    def _held_back(self, text: str) -> int:
        """How much of the text's end to hold back: what may begin an opener, and the
        whitespace before it (dropped if a call follows)."""
        if self.AT_START:
            if self._started:
                return 0
            stripped = text.lstrip()
            return len(text) if any(o.startswith(stripped) for o in self.OPENERS) else 0
        tag = max(partial_tag_len(text, o) for o in self.OPENERS)
        head = text[: len(text) - tag]
        return tag + len(head) - len(head.rstrip())

    def _read_block(self, final: bool) -> bool:
        """Reads the open block's calls; True when the block ended (free text follows),
        False when it waits for more text."""
        assert self._block is not None
        if self.CLOSE:
            end = self._buffer.find(self.CLOSE)
            if end < 0 and not final:
                return False
            body = self._buffer if end < 0 else self._buffer[:end]
            self._buffer = "" if end < 0 else self._buffer[end + len(self.CLOSE):]
            item = self._read_item(body.strip())
            if isinstance(item, tuple) and not item[2].strip() and self._room():
                self._add_call(item[0], item[1])
            else:
                self._block += body + ("" if end < 0 else self.CLOSE)
            self._end_block()
            return True
        while True:
            skipped = self._skip_between_calls()
            if skipped is None and not final:  # maybe an opener, not yet whole
                return False
            self._block += skipped or ""
            if not self._buffer:
                return False
            # A call's object that did not decode decodes only once a "}" has come: not
            # decoded again before (each try reads the whole buffer: quadratic in a long
            # call). Without a "{" yet, other text may still decide (Mistral's name{...}).
            if not final and self._undecoded and "}" not in self._buffer[self._undecoded:]:
                return False
            item = self._read_item(self._buffer)
            if item is None and not final:
                self._undecoded = len(self._buffer) if "{" in self._buffer else 0
                return False
            self._undecoded = 0
            if not isinstance(item, tuple) or not self._room():
                self._end_block()
                return True
            name, arguments, self._buffer = item
            self._add_call(name, arguments)

    def _read_item(self, text: str) -> tuple[str, str, str] | _NotACall | None:
        """`_item`, where JSON nested deeper than Python's decoder (or encoder) goes is no
        call: the model's text, not an error out of the response."""
        try:
            return self._item(text)
        except RecursionError:
            return NOT_A_CALL

    def _skip_between_calls(self) -> str | None:
        """Takes the whitespace, separators and (non-JSON) openers at the buffer's start and
        returns them; None when the buffer may be the start of an opener."""
        taken = ""
        openers = [o for o in self.OPENERS if not o.startswith("{")]
        while self._buffer:
            if any(len(o) > len(self._buffer) and o.startswith(self._buffer) for o in openers):
                self._buffer = taken + self._buffer
                return None
            opener = max((o for o in openers if self._buffer.startswith(o)), key=len, default="")
            if opener:
                taken, self._buffer = taken + opener, self._buffer[len(opener):]
            elif self._buffer[0].isspace() or self._buffer[0] in self.SEPARATORS:
                taken, self._buffer = taken + self._buffer[0], self._buffer[1:]
            else:
                break
        return taken

    def _is_filler(self, text: str) -> bool:
        """Only separators, whitespace and openers: what is left of a block around calls."""
        for opener in self.OPENERS:
            text = text.replace(opener, "")
        return all(c.isspace() or c in self.SEPARATORS for c in text)

    def _room(self) -> bool:
        return self._max_calls is None or self.num_calls < self._max_calls

    def _add_call(self, name: str, arguments: str) -> None:
        self._calls.append(self._call(name, arguments))
        self._block, self._space_before, self._after_call = "", "", True
        self._block_calls += 1

    def _end_block(self) -> None:
        """Back to free text; the block's text that made no call is content (what is left of
        it around calls, separators and openers, is dropped)."""
        assert self._block is not None
        written, self._block = self._block, None
        if written and not (self._block_calls and self._is_filler(written)):
            self._content.append(self._space_before + written)


class RequiredToolCalls(MarkedJsonToolParser):
    """tool_choice "required": the output is a JSON array of {"name", "parameters"} objects
    (the grammar guarantees it); each object becomes a call as soon as it is complete."""

    OPENERS = ("[",)
    AT_START = True
    SEPARATORS = ",]"
    ARGUMENT_KEYS = ("parameters",)


class HermesToolParser(MarkedJsonToolParser):
    """Hermes (Qwen2.5 / Qwen3 and most tool-tuned models): `<tool_call>{"name": ...,
    "arguments": ...}</tool_call>` blocks in free text, one call each."""

    OPENERS = ("<tool_call>",)
    CLOSE = "</tool_call>"


class Llama3JsonToolParser(MarkedJsonToolParser):
    """Llama 3.x JSON tool calls: the output (after an optional `<|python_tag|>`) is calls,
    `{"name": ..., "parameters": ...}` (or "arguments"), separated by ";"."""

    OPENERS = ("<|python_tag|>", "{")
    AT_START = True
    SEPARATORS = ";"
    ARGUMENT_KEYS = ("arguments", "parameters")


class MistralToolParser(MarkedJsonToolParser):
    """Mistral: text, then `[TOOL_CALLS]` and a JSON array of {"name", "arguments"} objects,
    or (newer tokenizers) `[TOOL_CALLS]name{arguments}` per call."""

    OPENERS = ("[TOOL_CALLS]",)
    SEPARATORS = "[],"
    _NAMED = re.compile(r"([A-Za-z0-9_.-]+)\s*(\{|$)")

    def _item(self, text: str) -> tuple[str, str, str] | _NotACall | None:
        named = self._NAMED.match(text)
        if named is None or text.startswith("{"):
            return super()._item(text)
        if not named.group(2):
            return None  # the name so far: its arguments have not begun
        decoded = _decode_prefix(text[named.start(2):])
        if decoded is None:
            return None
        arguments, rest = decoded
        if not isinstance(arguments, dict):
            return NOT_A_CALL
        return named.group(1), _arguments_text(arguments), rest


class XLAMToolParser(MarkedJsonToolParser):
    """xLAM (Salesforce): a JSON array of {"name", "arguments"} objects, bare or in a
    ```json fenced block, with any text around it content."""

    OPENERS = ("```json", "```", "[")
    SEPARATORS = "[],`"


# --tool-call-parser's names (vLLM's) -> the parser of each format.
TOOL_CALL_PARSERS: dict[str, type[MarkedJsonToolParser]] = {
    "hermes": HermesToolParser,
    "llama3_json": Llama3JsonToolParser,
    "mistral": MistralToolParser,
    "xlam": XLAMToolParser,
}


def hermes_structural_tag(tools: list[ChatCompletionTool]) -> StructuredOutputsParams:
    """Free text, but once the model opens `<tool_call>` it must write a call to one of the
    tools in the Hermes parser's format, with arguments that follow the function's schema
    (strict functions) or any JSON object (the others): OpenAI's `strict` under "auto"."""
    tags = [
        {
            "type": "tag",
            "begin": f'{HermesToolParser.OPENERS[0]}\n{{"name": {json.dumps(tool.function.name)}, '
            '"arguments": ',
            "content": {"type": "json_schema", "json_schema": (
                tool.function.parameters or {"type": "object"}
                if tool.function.strict else {"type": "object"}
            )},
            "end": f"}}\n{HermesToolParser.CLOSE}",
        }
        for tool in tools
    ]
    return StructuredOutputsParams(structural_tag=json.dumps({
        "type": "structural_tag",
        "format": {"type": "triggered_tags", "triggers": list(HermesToolParser.OPENERS),
                   "tags": tags},
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
        return TOOL_CALL_PARSERS[parser](None if request.parallel_tool_calls else 1)
    return NamedToolCall(choice.function.name)


def constrain_auto_tool_calls(
    request: ChatCompletionRequest, params: SamplingParams, parser: str | None
) -> SamplingParams:
    """Under "auto", strict functions are held to their schemas (structured output), in the
    hermes format: with another parser, a ValueError rather than a promise not kept."""
    tools = request.tools or []
    if request.effective_tool_choice != "auto" or not any(t.function.strict for t in tools):
        return params
    if parser != "hermes":
        raise ValueError(
            f'strict functions under tool_choice "auto" are enforced with the hermes tool-call '
            f"parser only, and this server's is {parser or 'none (no auto tool choice)'}"
        )
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
