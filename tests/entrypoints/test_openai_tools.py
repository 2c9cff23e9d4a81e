"""Tool calling over HTTP with the real model and the `openai` client (the shared server runs
with `--enable-auto-tool-choice --tool-call-parser hermes`), and the parsers on their own."""

import json
from typing import Any

import httpx
import jsonschema
import openai
import pytest
from openai.types import Completion
from openai.types.chat import ChatCompletion

from tests.entrypoints.test_openai_server import MODEL
from v1.entrypoints.openai.protocol import ChatCompletionRequest
from v1.entrypoints.openai.tool_calls import (
    TOOL_CALL_PARSERS,
    HermesToolParser,
    NamedToolCall,
    RequiredToolCalls,
    ToolCallExtractor,
    constrain_auto_tool_calls,
    merge_tool_calls,
    tool_call_extractor,
)

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 20},
        "unit": {"enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TIME = {
    "type": "object",
    "properties": {"timezone": {"type": "string", "maxLength": 12}},
    "required": ["timezone"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "The weather in a city", "parameters": WEATHER}},
    {"type": "function", "function": {
        "name": "get_time", "description": "The time in a timezone", "parameters": TIME}},
]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
MESSAGES = [{"role": "user", "content": "What is the weather like in Paris?"}]


def run(extractor: ToolCallExtractor, text: str, chunk: int) -> tuple[str, list[tuple[str, str]]]:
    """Feed `text` in pieces of `chunk` characters: the content and the whole calls."""
    content, deltas = "", []
    for i in range(0, len(text), chunk):
        got = extractor.feed(text[i : i + chunk])
        content, deltas = content + got.content, deltas + got.tool_calls
    got = extractor.finish()
    calls = merge_tool_calls(deltas + got.tool_calls)
    return content + got.content, [(c.function.name, c.function.arguments) for c in calls]


HERMES = (
    'Let me check. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", '
    '"unit": "celsius"}}\n</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": '
    '{"timezone": "CET"}}\n</tool_call>\n'
)


@pytest.mark.parametrize("chunk", [1, 2, 3, 5, 11, len(HERMES)])
def test_hermes_parser_any_chunking(chunk: int) -> None:
    assert run(HermesToolParser(), HERMES, chunk) == ("Let me check.", [
        ("get_weather", '{"city": "Paris", "unit": "celsius"}'),
        ("get_time", '{"timezone": "CET"}'),
    ])


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("a < b <tool", ("a < b <tool", [])),  # looked like a tag, was not
        ("x <tool_call>{not json}</tool_call> y", ("x <tool_call>{not json}</tool_call> y", [])),
        ('x <tool_call>{"name": "f"}</tool_call>', ('x <tool_call>{"name": "f"}</tool_call>', [])),
        # Cut off before the end tag (max_tokens): a call if its JSON is whole, else text.
        ('<tool_call>{"name": "f", "arguments": {}}', ("", [("f", "{}")])),
        ('ok <tool_call>{"name": "f", "argu', ('ok <tool_call>{"name": "f", "argu', [])),
    ],
)
def test_hermes_parser_keeps_what_is_not_a_call(text: str, expected: tuple) -> None:
    for chunk in (1, 4, len(text)):
        assert run(HermesToolParser(), text, chunk) == expected


def test_hermes_parser_text_after_a_call_at_any_delta_boundary() -> None:
    """The whitespace after a call is dropped whichever delta it comes in (a delta boundary
    right after `</tool_call>` once kept it, so streamed and whole content differed)."""
    text = '<tool_call>{"name": "f", "arguments": {}}</tool_call>\n Done.'
    cut = text.index("\n Done")
    for pieces in ([text], [text[:cut], text[cut:]], [text[:cut], "\n", " ", "Done."]):
        extractor, content, deltas = HermesToolParser(), "", []
        for piece in pieces:
            got = extractor.feed(piece)
            content, deltas = content + got.content, deltas + got.tool_calls
        got = extractor.finish()
        calls = merge_tool_calls(deltas + got.tool_calls)
        assert (content + got.content, [(c.function.name, c.function.arguments) for c in calls]) \
            == ("Done.", [("f", "{}")]), pieces


def test_streamed_and_whole_messages_agree_when_cut_off() -> None:
    """A "required" choice cut off (max_tokens) before its first call is its text as written,
    streamed or not (the stream once lost the opening bracket)."""
    from v1.entrypoints.openai.serving import _ChatParsers
    from v1.outputs import CompletionOutput

    request = ChatCompletionRequest(messages=MESSAGES, tools=TOOLS, tool_choice="required")
    text = ' [{"name": "get_time", "param'
    whole = _ChatParsers(request, None, None).message(
        CompletionOutput(0, text, [], None, [], "length")
    )
    tool_calls = _ChatParsers(request, None, None)
    streamed = "".join(
        tool_calls.delta(CompletionOutput(0, piece, [], None, [], finish)).content or ""
        for piece, finish in ((text[:3], None), (text[3:], "length"))
    )
    assert whole.content == streamed == text and whole.tool_calls == []


def test_hermes_parser_max_calls_leaves_the_rest_as_text() -> None:
    content, calls = run(HermesToolParser(max_calls=1), HERMES, 3)
    assert [name for name, _ in calls] == ["get_weather"]
    assert content.startswith("Let me check.") and '"get_time"' in content


def test_required_and_named_extractors() -> None:
    array = ' [{"name": "get_time", "parameters": {"timezone": "UTC"}}, {"name": "g", ' \
        '"parameters": {"a": [1, {"b": "]"}]}}]'
    for chunk in (1, 3, len(array)):
        assert run(RequiredToolCalls(), array, chunk) == (
            "", [("get_time", '{"timezone": "UTC"}'), ("g", '{"a": [1, {"b": "]"}]}')]
        )
    assert run(RequiredToolCalls(), '[{"name": "g", "param', 2) == ('[{"name": "g", "param', [])
    assert run(NamedToolCall("f"), '{"x": 1}', 2) == ("", [("f", '{"x": 1}')])


def test_required_schema_has_each_tool_and_parallel_limit() -> None:
    def schema(**kwargs: Any) -> dict[str, Any]:
        request = ChatCompletionRequest(messages=MESSAGES, tools=TOOLS, **kwargs)
        params = request.to_sampling_params()
        assert params.structured_outputs is not None
        return params.structured_outputs.json  # type: ignore[return-value]

    required = schema(tool_choice="required")
    jsonschema.validate([{"name": "get_time", "parameters": {"timezone": "UTC"}}], required)
    with pytest.raises(jsonschema.ValidationError):  # another tool's parameters
        jsonschema.validate([{"name": "get_time", "parameters": {"city": "Rome"}}], required)
    with pytest.raises(jsonschema.ValidationError):  # no call
        jsonschema.validate([], required)
    two = [{"name": "get_time", "parameters": {"timezone": "UTC"}}] * 2
    jsonschema.validate(two, required)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(two, schema(tool_choice="required", parallel_tool_calls=False))
    named = {"type": "function", "function": {"name": "get_time"}}
    assert schema(tool_choice=named) == TIME


def test_tool_messages_reach_the_template(hf_tokenizer) -> None:
    """An assistant's earlier call (arguments as an object) and the tool's answer are what a
    tool-aware template renders, and the tools too."""
    template = (
        "{% for t in tools %}TOOL {{ t.function.name }};{% endfor %}"
        "{% for m in messages %}[{{ m.role }}]"
        "{% for c in m.tool_calls or [] %}CALL {{ c.function.name }} "
        "{{ c.function.arguments.city }};{% endfor %}"
        "{% if m.tool_call_id %}({{ m.tool_call_id }}){% endif %}{{ m.content }}{% endfor %}"
    )
    request = ChatCompletionRequest(messages=[
        *MESSAGES,
        {"role": "assistant", "tool_calls": [{"id": "c1", "type": "function", "function": {
            "name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "18 degrees"},
    ], tools=TOOLS)
    text = hf_tokenizer.apply_chat_template(
        [m.to_template_dict() for m in request.messages], chat_template=template,
        tools=request.template_tools(), tokenize=False,
    )
    assert text == (
        "TOOL get_weather;TOOL get_time;[user]What is the weather like in Paris?"
        "[assistant]CALL get_weather Paris;[tool](c1)18 degrees"
    )


def test_lenient_tool_fields_as_vllm() -> None:
    """As vLLM: a tool's and a named choice's `type` may be left out, and an earlier call's
    empty arguments reach the template as {} (they were a 400)."""
    request = ChatCompletionRequest(
        messages=[*MESSAGES, {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "now", "arguments": ""}}]}],
        tools=[{"function": {"name": "now"}}], tool_choice={"function": {"name": "now"}},
    )
    assert request.messages[-1].to_template_dict()["tool_calls"][0]["function"] == {
        "name": "now", "arguments": {}
    }
    assert request.template_tools() == [{"type": "function", "function": {"name": "now"}}]


@pytest.mark.parametrize(
    ("fields", "match"),
    [
        ({"tool_choice": "required"}, "tools"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
         "nope"),
        ({"messages": [{"role": "tool", "content": "18"}]}, "tool_call_id"),
        ({"messages": [{"role": "user", "content": "x", "tool_calls": []}]}, "assistant"),
    ],
)
def test_bad_tool_requests_are_refused(fields: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        ChatCompletionRequest(**{"messages": MESSAGES, **fields})


# ---- over HTTP, with the real model ------------------------------------------------------



@pytest.fixture
def client(extras_client: openai.OpenAI) -> openai.OpenAI:
    return extras_client


def chat(client: openai.OpenAI, **kwargs: Any) -> Any:
    kwargs = {"model": MODEL, "messages": MESSAGES, "tools": TOOLS, "max_tokens": 60, **kwargs}
    return client.chat.completions.create(**kwargs)


def streamed(client: openai.OpenAI, **kwargs: Any) -> tuple[str, list[tuple[str, str]], str]:
    """A streamed chat's content, calls (put together from their deltas) and finish reason."""
    content, calls, finish = "", {}, None
    for chunk in chat(client, stream=True, **kwargs):
        choice = chunk.choices[0]
        content += choice.delta.content or ""
        for delta in choice.delta.tool_calls or []:
            if delta.id is not None:
                assert delta.type == "function" and delta.function.name
                calls[delta.index] = [delta.function.name, delta.function.arguments or ""]
            else:
                calls[delta.index][1] += delta.function.arguments or ""
        finish = choice.finish_reason or finish
    return content, [tuple(c) for c in calls.values()], finish


@pytest.mark.model
@pytest.mark.slow
def test_named_tool_always_yields_valid_arguments(client: openai.OpenAI) -> None:
    named = {"type": "function", "function": {"name": "get_weather"}}
    out = chat(client, tool_choice=named, n=4, temperature=1.0, seed=7)
    for choice in out.choices:
        assert choice.finish_reason == "stop"  # as vLLM: a named call ends with "stop"
        assert choice.message.content is None
        [call] = choice.message.tool_calls
        assert call.type == "function" and call.id.startswith("chatcmpl-tool-")
        assert call.function.name == "get_weather"
        jsonschema.validate(json.loads(call.function.arguments), WEATHER)
    greedy = chat(client, tool_choice=named, temperature=0).choices[0].message.tool_calls[0]
    content, calls, finish = streamed(client, tool_choice=named, temperature=0)
    assert (content, calls, finish) == (
        "", [("get_weather", greedy.function.arguments)], "stop"
    )


@pytest.mark.model
@pytest.mark.slow
def test_required_tool_calls_validate(client: openai.OpenAI) -> None:
    out = chat(client, tool_choice="required", n=3, temperature=1.0, seed=3, max_tokens=120,
               parallel_tool_calls=False)
    for choice in out.choices:
        assert choice.finish_reason == "tool_calls", choice.message
        [call] = choice.message.tool_calls
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
    greedy = chat(client, tool_choice="required", temperature=0, max_tokens=120,
                  parallel_tool_calls=False).choices[0].message.tool_calls
    assert streamed(client, tool_choice="required", temperature=0, max_tokens=120,
                    parallel_tool_calls=False) == (
        "", [(c.function.name, c.function.arguments) for c in greedy], "tool_calls"
    )


@pytest.mark.model
@pytest.mark.slow
def test_auto_parses_the_models_hermes_calls(client: openai.OpenAI) -> None:
    """"auto" reads whatever the model writes; the model is steered into a Hermes call with a
    regex here (a 135M model rarely makes one), so the parser runs on real token deltas."""
    regex = (
        r'Sure\. <tool_call>\n\{"name": "get_weather", "arguments": \{"city": "(Paris|Lyon)", '
        r'"unit": "celsius"\}\}\n</tool_call>'
    )
    kwargs = {
        "temperature": 0, "max_tokens": 100, "extra_body": {"structured_outputs": {"regex": regex}}
    }
    out = chat(client, **kwargs).choices[0]
    assert out.finish_reason == "tool_calls"
    assert out.message.content == "Sure."
    [call] = out.message.tool_calls
    assert call.function.name == "get_weather"
    arguments = json.loads(call.function.arguments)
    assert arguments["city"] in ("Paris", "Lyon")
    assert streamed(client, **kwargs) == (
        "Sure.", [("get_weather", call.function.arguments)], "tool_calls"
    )
    # Without a call, "auto" is plain text, exactly as without tools.
    plain = chat(client, temperature=0, max_tokens=12).choices[0]
    without = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=12, temperature=0
    ).choices[0]
    assert plain.message.tool_calls == [] and plain.message.content == without.message.content


@pytest.mark.model
@pytest.mark.slow
def test_tool_choice_none_and_tool_results(client: openai.OpenAI) -> None:
    """"none" leaves the output alone; a conversation with a call and its result is accepted
    and rendered with the tool's answer (the default template shows it as a `tool` turn)."""
    none = chat(client, tool_choice="none", temperature=0, max_tokens=12).choices[0]
    assert none.message.tool_calls == [] and none.message.content
    messages = [
        *MESSAGES,
        {"role": "assistant", "content": None, "tool_calls": [{
            "id": "call-1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call-1", "content": "18 degrees and sunny"},
    ]
    answer = chat(client, messages=messages, tool_choice="none", temperature=0, max_tokens=8)
    assert answer.choices[0].message.content
    url = str(client.base_url).removesuffix("/v1/")
    tokens = httpx.post(f"{url}/tokenize", json={"messages": messages, "tools": TOOLS}).json()
    detokenized = httpx.post(f"{url}/detokenize", json={"tokens": tokens["tokens"]}).json()
    assert "<|im_start|>tool\n18 degrees and sunny<|im_end|>" in detokenized["prompt"]


@pytest.mark.model
@pytest.mark.slow
def test_tool_choice_with_response_format_is_refused(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError, match="constrains"):
        chat(client, tool_choice="required", response_format={"type": "json_object"})
    with pytest.raises(openai.BadRequestError, match="not in tools"):
        chat(client, tool_choice={"type": "function", "function": {"name": "nope"}})


@pytest.mark.model
@pytest.mark.slow
def test_logprobs_of_ruled_out_tokens_are_numbers(client: openai.OpenAI) -> None:
    """A token the grammar rules out has logprob -inf, which JSON cannot hold (it became null,
    which OpenAI's types refuse): -9999.0, as vLLM."""
    url = str(client.base_url).rstrip("/")
    named = {"type": "function", "function": {"name": "get_weather"}}
    chat = httpx.post(f"{url}/chat/completions", timeout=60, json={
        "model": MODEL, "messages": MESSAGES, "tools": TOOLS, "tool_choice": named,
        "logprobs": True, "top_logprobs": 5, "max_tokens": 8, "temperature": 0,
    }).json()
    content = chat["choices"][0]["logprobs"]["content"]
    top = [t["logprob"] for entry in content for t in entry["top_logprobs"]]
    assert -9999.0 in top and None not in top
    ChatCompletion.model_validate(chat)
    completion = httpx.post(f"{url}/completions", timeout=60, json={
        "model": MODEL, "prompt": "Yes or no?", "max_tokens": 2, "logprobs": 5, "temperature": 0,
        "structured_outputs": {"choice": ["yes"]},
    }).json()
    Completion.model_validate(completion)
    assert -9999.0 in [v for top in completion["choices"][0]["logprobs"]["top_logprobs"]
                       for v in top.values()]


def test_strict_tools_under_auto_are_held_to_their_schema(hf_tokenizer) -> None:
    """OpenAI's `strict` with "auto": free text, but an opened call must name a tool and
    follow its schema (compiled as the engine compiles it, matched token by token)."""
    import xgrammar as xgr

    from v1.entrypoints.openai.tool_calls import hermes_structural_tag

    strict = [{**tool, "function": {**tool["function"], "strict": True}} for tool in TOOLS]
    request = ChatCompletionRequest(messages=MESSAGES, tools=strict)
    params = constrain_auto_tool_calls(request, request.to_sampling_params(), "hermes")
    assert params.structured_outputs == hermes_structural_tag(request.tools)
    info = xgr.TokenizerInfo.from_huggingface(hf_tokenizer)
    grammar = xgr.GrammarCompiler(info).compile_structural_tag(
        params.structured_outputs.structural_tag
    )

    def accepted(text: str) -> bool:
        matcher = xgr.GrammarMatcher(grammar)
        return all(matcher.accept_token(t) for t in hf_tokenizer.encode(text))

    call = '<tool_call>\n{"name": "get_time", "arguments": %s}\n</tool_call>'
    assert accepted("Let me check. " + call % '{"timezone": "CET"}' + " Done.")
    assert not accepted(call % '{"city": "Rome"}')  # another tool's arguments
    assert not accepted(call.replace("get_time", "get_date") % "{}")  # no such tool
    # Without strict, "auto" is unconstrained; with other constraints, strict is refused.
    loose = ChatCompletionRequest(messages=MESSAGES, tools=TOOLS)
    assert constrain_auto_tool_calls(
        loose, loose.to_sampling_params(), "hermes"
    ).structured_outputs is None
    both = ChatCompletionRequest(
        messages=MESSAGES, tools=strict, response_format={"type": "json_object"}
    )
    with pytest.raises(ValueError, match="strict"):
        constrain_auto_tool_calls(both, both.to_sampling_params(), "hermes")
    # Other formats have no grammar here: strict is refused, not silently unenforced.
    with pytest.raises(ValueError, match="enforced with the hermes tool-call parser only"):
        constrain_auto_tool_calls(request, request.to_sampling_params(), "mistral")


@pytest.mark.model
@pytest.mark.slow
def test_strict_auto_is_constrained_by_the_server(client: openai.OpenAI) -> None:
    """The server applies the strict tools' constraint: it cannot be stacked on another."""
    strict = [{**tool, "function": {**tool["function"], "strict": True}} for tool in TOOLS]
    with pytest.raises(openai.BadRequestError, match="strict tools"):
        chat(client, tools=strict, extra_body={"structured_outputs": {"regex": "a+"}})
    assert chat(client, tools=TOOLS, max_tokens=2,
                extra_body={"structured_outputs": {"regex": "a+"}}).choices[0].message.content


@pytest.mark.model
@pytest.mark.slow
def test_strict_auto_calls_are_held_to_the_schema_by_the_engine(client: openai.OpenAI) -> None:
    """Shown calls whose `unit` is outside the schema's enum, the model copies one (greedy);
    with the tools strict, the engine holds the call it writes to the schema."""

    def shot(city: str) -> list[dict[str, str]]:
        call = {"name": "get_weather", "arguments": {"city": city, "unit": "kelvin"}}
        return [{"role": "user", "content": f"What is the weather like in {city}?"},
                {"role": "assistant", "content": f"<tool_call>\n{json.dumps(call)}\n</tool_call>"}]

    messages = [*shot("Rome"), *shot("Oslo"), *shot("Lima"), *MESSAGES]
    strict = [{**tool, "function": {**tool["function"], "strict": True}} for tool in TOOLS]
    calls = {}
    for name, tools in (("loose", TOOLS), ("strict", strict)):
        choice = chat(client, messages=messages, tools=tools, temperature=0).choices[0]
        assert choice.finish_reason == "tool_calls", choice.message
        [call] = choice.message.tool_calls
        assert call.function.name == "get_weather"
        calls[name] = json.loads(call.function.arguments)
    assert calls["loose"]["unit"] == "kelvin"  # what the model writes unconstrained
    jsonschema.validate(calls["strict"], WEATHER)


# ---- the other --tool-call-parser formats (vLLM's names), on the shared skeleton ------------

WEATHER_CALL = ("get_weather", '{"city": "Paris", "unit": "celsius"}')
TIME_CALL = ("get_time", '{"timezone": "CET"}')
ARGS = '{"city": "Paris", "unit": "celsius"}'


@pytest.mark.parametrize(("name", "text", "expected"), [
    ("llama3_json", f'{{"name": "get_weather", "parameters": {ARGS}}}; '
     '{"name": "get_time", "parameters": {"timezone": "CET"}}', ("", [WEATHER_CALL, TIME_CALL])),
    ("llama3_json", f'<|python_tag|>{{"name": "get_weather", "arguments": {ARGS}}}',
     ("", [WEATHER_CALL])),
    # Only at the start of the output.
    ("llama3_json", 'It is {"name": "x", "parameters": {}}',
     ('It is {"name": "x", "parameters": {}}', [])),
    ("mistral", f'Checking. [TOOL_CALLS][{{"name": "get_weather", "arguments": {ARGS}}}, '
     '{"name": "get_time", "arguments": {"timezone": "CET"}}]', ("Checking.", [WEATHER_CALL,
                                                                               TIME_CALL])),
    ("mistral", f'[TOOL_CALLS]get_weather{ARGS}[TOOL_CALLS]get_time{{"timezone": "CET"}}',
     ("", [WEATHER_CALL, TIME_CALL])),
    ("mistral", "[1, 2] [TOOL_CALLS] is a token", ("[1, 2] [TOOL_CALLS] is a token", [])),
    ("xlam", f'[{{"name": "get_weather", "arguments": {ARGS}}}]', ("", [WEATHER_CALL])),
    ("xlam", f'Sure.\n```json\n[{{"name": "get_weather", "arguments": {ARGS}}}]\n```\nDone.',
     ("Sure.Done.", [WEATHER_CALL])),
    ("xlam", "Lists [1, 2] are fine.", ("Lists [1, 2] are fine.", [])),
])
def test_each_format_at_any_chunking(name: str, text: str, expected: tuple) -> None:
    """vLLM's formats: Llama 3's JSON calls (at the output's start, ";" between, "parameters"
    or "arguments"), Mistral's [TOOL_CALLS] (a JSON array, or name{arguments} per call) and
    xLAM's JSON array (bare or fenced); text that is no call stays content, whatever the
    deltas."""
    for chunk in (1, 2, 3, 7, len(text)):
        assert run(TOOL_CALL_PARSERS[name](), text, chunk) == expected, chunk


@pytest.mark.parametrize("parser", [*TOOL_CALL_PARSERS, "required"])
def test_calls_nested_too_deep_for_json_stay_text(parser: str) -> None:
    """Arguments nested deeper than Python's json decodes (a RecursionError) are no call:
    the model's text, not an error out of the response or its stream."""
    deep = "[" * 5000 + "]" * 5000
    opener = {"hermes": "<tool_call>", "mistral": "[TOOL_CALLS]"}.get(parser, "")
    closer = "</tool_call>" if parser == "hermes" else ""
    key = "parameters" if parser == "required" else "arguments"
    call = f'{{"name": "get_time", "{key}": {deep}}}'
    text = opener + (f"[{call}]" if parser in ("xlam", "required") else call) + closer
    extractor = RequiredToolCalls() if parser == "required" else TOOL_CALL_PARSERS[parser]()
    for chunk in (1000, len(text)):
        content, calls = run(extractor, text, chunk)
        assert calls == [] and deep in content, chunk


@pytest.mark.parametrize(("parser", "opener"), [
    ("llama3_json", '{"name": "get_time", "arguments": '), ("mistral", "[TOOL_CALLS]get_time"),
    ("xlam", '[{"name": "get_time", "arguments": '), ("required", '[{"name": "get_time", '
                                                                 '"parameters": '),
])
def test_a_long_call_is_decoded_when_it_may_end(parser: str, opener: str, monkeypatch) -> None:
    """Each delta of a call's JSON tried to decode the whole call so far: quadratic in its
    length (a 32k-token call: seconds of the event loop). It is tried again only once a "}"
    comes, which the object needs to end; streamed or whole, the same call."""
    from v1.entrypoints.openai import tool_calls

    decodes = []
    decode = tool_calls._decode_prefix
    monkeypatch.setattr(tool_calls, "_decode_prefix",
                        lambda text: decodes.append(text) or decode(text))
    value = "x" * 4000
    deltas = [opener, '{"timezone": "', *value, '"}', "}" if parser != "mistral" else ""]
    extractor = RequiredToolCalls() if parser == "required" else TOOL_CALL_PARSERS[parser]()
    content, calls = run(extractor, "".join(deltas), 1)
    assert calls == [("get_time", json.dumps({"timezone": value}))] and not content.strip("]")
    assert len(decodes) < 20


def test_auto_picks_the_servers_parser_and_max_calls() -> None:
    request = ChatCompletionRequest(messages=MESSAGES, tools=TOOLS, parallel_tool_calls=False)
    extractor = tool_call_extractor(request, "xlam")
    assert isinstance(extractor, TOOL_CALL_PARSERS["xlam"])
    text = f'[{{"name": "get_weather", "arguments": {ARGS}}}, {{"name": "get_time", ' \
        '"arguments": {}}]'
    content, calls = run(extractor, text, 5)
    assert calls == [WEATHER_CALL] and content.startswith('{"name": "get_time"')


def test_serve_takes_each_parser_name() -> None:
    """`v1 serve --tool-call-parser NAME` takes every registered format, and
    `--reasoning-parser` (an engine option) vLLM's names."""
    from v1.config import EngineArgs
    from v1.entrypoints.openai.api_server import make_parser

    parser = make_parser()
    for name in TOOL_CALL_PARSERS:
        args = parser.parse_args(["--enable-auto-tool-choice", "--tool-call-parser", name,
                                  "--reasoning-parser", "qwen3"])
        assert args.tool_call_parser == name
        assert EngineArgs.from_cli_args(args).reasoning_parser == "qwen3"
