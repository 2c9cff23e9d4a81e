"""Reasoning parsers (`--reasoning-parser`): text split into reasoning and content, the same
whatever the deltas; and the chat API's messages and streamed deltas made of them."""

import pytest

from v1.config import EngineArgs
from v1.entrypoints.openai.protocol import ChatCompletionRequest
from v1.entrypoints.openai.serving import _ChatParsers, reasoning_parser_for
from v1.entrypoints.openai.tool_calls import constrain_auto_tool_calls
from v1.outputs import CompletionOutput
from v1.reasoning import (
    REASONING_PARSERS,
    DeepSeekR1ReasoningParser,
    Qwen3ReasoningParser,
    ReasoningParser,
    ReasoningParserManager,
)

MESSAGES = [{"role": "user", "content": "2 + 2?"}]


def split(parser: ReasoningParser, pieces: list[str]) -> tuple[str, str]:
    reasoning = content = ""
    for piece in pieces:
        got = parser.feed(piece)
        reasoning, content = reasoning + got.reasoning, content + got.content
    got = parser.finish()
    return reasoning + got.reasoning, content + got.content


def every_split(text: str) -> list[list[str]]:
    """The text whole, a character at a time, and cut in two at every place."""
    return [[text], list(text)] + [[text[:i], text[i:]] for i in range(1, len(text))]


@pytest.mark.parametrize(("text", "expected"), [
    ("<think>\nSum it.\n</think>\n\nIt is 4.", ("\nSum it.\n", "\n\nIt is 4.")),
    ("\n<think>a < b</think>4", ("a < b", "4")),  # a `<` that starts no tag
    ("Sum it.</think>4", ("Sum it.", "4")),  # the template opened <think> in the prompt
    ("<think>Still thinking, cut off", ("Still thinking, cut off", "")),  # max_tokens
    ("<think>x</think>", ("x", "")),
    ("<thinker></think>y", ("<thinker>", "y")),  # looked like the start tag, was not
])
@pytest.mark.parametrize("parser", [DeepSeekR1ReasoningParser, Qwen3ReasoningParser])
def test_think_tags_split_the_same_whatever_the_deltas(parser, text, expected) -> None:
    for pieces in every_split(text):
        assert split(parser(), pieces) == expected, pieces


def test_qwen3_with_thinking_off_is_all_content() -> None:
    """enable_thinking=False: Qwen3's template closes the reasoning in the prompt."""
    text = "It is 4. </think> is a tag."
    off = Qwen3ReasoningParser({"enable_thinking": False})
    assert split(off, [text]) == ("", text)
    assert split(DeepSeekR1ReasoningParser({"enable_thinking": False}), [text]) == (
        "It is 4. ", " is a tag."
    )


def test_registry_has_vllms_names() -> None:
    """The names `--reasoning-parser` (an engine option, as vLLM's) takes."""
    assert {"deepseek_r1", "qwen3"} <= set(REASONING_PARSERS)
    assert EngineArgs(reasoning_parser="deepseek_r1").reasoning_parser == "deepseek_r1"
    with pytest.raises(ValueError, match="reasoning_parser must be one of"):
        EngineArgs(reasoning_parser="r1")
    assert ReasoningParserManager.get_reasoning_parser("qwen3") is Qwen3ReasoningParser
    with pytest.raises(KeyError, match="not registered"):
        ReasoningParserManager.get_reasoning_parser("nope")


def chat(request: ChatCompletionRequest, text: str, tool_parser: str | None = None):
    """The message of the whole text, and the deltas of it streamed in 3-character pieces."""
    whole = _ChatParsers(request, tool_parser, Qwen3ReasoningParser).message(
        CompletionOutput(0, text, [], None, [], "stop")
    )
    parsers = _ChatParsers(request, tool_parser, Qwen3ReasoningParser)
    pieces = [text[i:i + 3] for i in range(0, len(text), 3)]
    deltas = [
        parsers.delta(CompletionOutput(0, p, [], None, [], "stop" if i == len(pieces) - 1
                                       else None))
        for i, p in enumerate(pieces)
    ]
    return whole, deltas


def test_chat_message_and_stream_carry_reasoning_under_both_names() -> None:
    whole, deltas = chat(ChatCompletionRequest(messages=MESSAGES),
                         "<think>Add them.</think>\n\nIt is 4.")
    assert (whole.reasoning, whole.reasoning_content, whole.content) == (
        "Add them.", "Add them.", "\n\nIt is 4."
    )
    assert "".join(d.reasoning or "" for d in deltas) == "Add them."
    assert all(d.reasoning == d.reasoning_content for d in deltas)
    assert "".join(d.content or "" for d in deltas) == "\n\nIt is 4."
    # vLLM's include_reasoning=False: the reasoning is left out.
    whole, deltas = chat(ChatCompletionRequest(messages=MESSAGES, include_reasoning=False),
                         "<think>Add them.</think>4")
    assert whole.reasoning is None and whole.content == "4"
    assert not any(d.reasoning for d in deltas)
    # All reasoning (cut off): no content at all, as vLLM.
    whole, _ = chat(ChatCompletionRequest(messages=MESSAGES), "<think>Add")
    assert (whole.reasoning, whole.content) == ("Add", None)


def test_tool_calls_are_parsed_after_the_reasoning() -> None:
    """A <tool_call> written while reasoning is reasoning; after it, a call."""
    tools = [{"type": "function", "function": {"name": "add", "parameters": {}}}]
    request = ChatCompletionRequest(messages=MESSAGES, tools=tools, tool_choice="auto")
    text = ('<think>I could use <tool_call> here.</think>\n<tool_call>{"name": "add", '
            '"arguments": {"a": 2}}</tool_call>')
    whole, deltas = chat(request, text, "hermes")
    assert whole.reasoning == "I could use <tool_call> here."
    assert [(c.function.name, c.function.arguments) for c in whole.tool_calls] == [
        ("add", '{"a": 2}')
    ]
    assert not whole.content and not any(d.content for d in deltas)



def test_a_grammar_constrained_reply_is_not_split() -> None:
    """A reply held to a grammar from its first token (a named or required tool choice, a
    response_format) has no reasoning: no parser splits it; free text (strict tools under
    "auto" included: their grammar starts at a tag) does."""
    tools = [{"type": "function", "function": {"name": "add", "parameters": {}}}]
    strict = [{"type": "function", "function": {"name": "add", "parameters": {},
                                                "strict": True}}]
    for kwargs, expected in [
        ({}, Qwen3ReasoningParser),
        ({"tools": tools, "tool_choice": "required"}, None),
        ({"response_format": {"type": "json_object"}}, None),
        ({"tools": strict, "tool_choice": "auto"}, Qwen3ReasoningParser),
    ]:
        request = ChatCompletionRequest(messages=MESSAGES, **kwargs)
        params = constrain_auto_tool_calls(request, request.to_sampling_params(), "hermes")
        assert reasoning_parser_for(params, Qwen3ReasoningParser) is expected, kwargs
