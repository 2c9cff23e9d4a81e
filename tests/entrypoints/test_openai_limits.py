"""Requests over a limit, or that the engine cannot carry, get a 400 naming the field and
the limit (never a 500, never a stall of the server), and every limit is a server flag."""

import asyncio
import dataclasses
import json
import re
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from v1.config.limits import InputLimits

MESSAGES = [{"role": "user", "content": "Hi"}]


def nested(depth: int) -> dict[str, Any]:
    """A JSON schema of objects in objects, nested `depth` schema levels (twice as many JSON
    levels: each object's `properties`)."""
    schema: dict[str, Any] = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
    return schema


DEEP = nested(300)  # xgrammar took seconds on it, on the event loop
TOOL = {"type": "function", "function": {"name": "f", "parameters": DEEP}}

# (endpoint, body, what the error message says, its param (None: not checked))
OVER_LIMITS: dict[str, tuple[str, dict[str, Any], str, str | None]] = {
    "schema depth": (
        "v1/completions", {"prompt": "Hi", "structured_outputs": {"json": DEEP}},
        r"structured_outputs\.json nests more than max_json_schema_depth \(64\)", None),
    "response_format depth": (
        "v1/chat/completions",
        {"messages": MESSAGES,
         "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": DEEP}}},
        r"response_format\.json_schema\.schema nests more than max_json_schema_depth", None),
    "tool parameters depth": (
        "v1/chat/completions", {"messages": MESSAGES, "tools": [TOOL], "tool_choice": "required"},
        r"tools\[0\]\.function\.parameters nests more than max_json_schema_depth", None),
    "a 100k enum": (
        "v1/completions",
        {"prompt": "Hi",
         "structured_outputs": {"json": {"enum": [f"item{i}" for i in range(100_000)]}}},
        r"structured_outputs\.json has \d+ characters .*max_structured_output_len \(262144\)",
        None),
    "2000 choices": (
        "v1/completions",
        {"prompt": "Hi", "structured_outputs": {"choice": [f"c{i}" for i in range(2000)]}},
        r"choice has 2000 strings, more than max_structured_output_choices \(1024\)", None),
    "10000 bad_words": (
        "v1/completions", {"prompt": "Hi", "bad_words": [f"w{i}" for i in range(10_000)]},
        r"bad_words has 10000 strings, more than max_num_bad_words \(128\)", None),
    "a long bad word": (
        "v1/completions", {"prompt": "Hi", "bad_words": ["w" * 300]},
        r"bad_words has a string of 300 characters, more than max_bad_word_len \(256\)", None),
    "100 stop strings": (
        "v1/completions", {"prompt": "Hi", "stop": [f"s{i}" for i in range(100)]},
        r"stop has 100 strings, more than max_stop_strings \(64\)", None),
    "n 10000": (
        "v1/completions", {"prompt": "Hi", "n": 10_000},
        r"n is 10000, more than max_n_sequences \(128\)", None),
    "logprobs 21": (
        "v1/completions", {"prompt": "Hi", "logprobs": 21},
        r"logprobs is 21, more than max_logprobs \(20\)", None),
    "1025 prompts": (
        "v1/completions", {"prompt": [[1]] * 1025},
        r"prompt has 1025 prompts, more than max_completion_prompts \(1024\)", None),
    # Limits that multiply: each factor was within its own limit, the product unbounded.
    "513 prompts x n 2": (
        "v1/completions", {"prompt": [[1]] * 513, "n": 2, "max_tokens": 1},
        r"the request asks for 1026 sequences \(513 prompts times n=2\), more than "
        r"max_request_sequences \(1024\)", None),
    "prompt_logprobs x 20000 prompt tokens": (
        "v1/completions",
        {"prompt": [[1] * 200] * 100, "prompt_logprobs": 20, "max_tokens": 1},
        r"prompt_logprobs=20 over at least 12600 prompt tokens asks for 264600 logprobs, more "
        r"than max_request_prompt_logprobs \(262144\)", None),
    "150k allowed_token_ids x n 2": (
        "v1/completions",
        {"prompt": "Hi", "n": 2, "max_tokens": 1, "allowed_token_ids": [1] * 150_000},
        r"hold 150000 ids for each of n=2 sequences, 300000 in all, more than "
        r"max_request_token_ids \(262144\)", None),
    # Past int64: a 500 (OverflowError serializing to the engine core) before.
    "seed 2**70": ("v1/completions", {"prompt": "Hi", "seed": 2**70}, "less than or equal", "seed"),
    "priority 2**80": (
        "v1/completions", {"prompt": "Hi", "priority": 2**80}, "less than or equal", "priority"),
    "top_k 2**70": (
        "v1/completions", {"prompt": "Hi", "top_k": 2**70}, "less than or equal", "top_k"),
    "max_completion_tokens 2**64": (
        "v1/chat/completions", {"messages": MESSAGES, "max_completion_tokens": 2**64},
        "less than or equal", "max_completion_tokens"),
    # Lone surrogates: a 500 (TypeError from the tokenizer) before.
    "surrogate in a prompt": (
        "v1/completions", {"prompt": "Hi \ud800"},
        r"the prompt is not valid Unicode text: a lone surrogate \(U\+D800\)", None),
    "surrogate in a message": (
        "v1/chat/completions", {"messages": [{"role": "user", "content": "Hi \ud800"}]},
        r"the conversation .* is not valid Unicode text", None),
    "surrogate in bad_words": (
        "v1/completions", {"prompt": "Hi", "bad_words": ["\udfff"]},
        r"bad_words\[0\] is not valid Unicode text", None),
    "surrogate in stop": (
        "v1/completions", {"prompt": "Hi", "stop": ["x\ud800"]},
        r"stop\[0\] is not valid Unicode text", None),
    "surrogate to /tokenize": (
        "tokenize", {"prompt": "\ud800"}, r"the prompt is not valid Unicode text", None),
    "surrogate to /tokenize, chat": (
        "tokenize", {"messages": [{"role": "user", "content": "\ud800"}]},
        r"the conversation .* is not valid Unicode text", None),
    # A 500 (TypeError from jinja's render()) before.
    "chat_template_kwargs messages": (
        "v1/chat/completions", {"messages": MESSAGES, "chat_template_kwargs": {"messages": 5}},
        r"^the chat template failed: TypeError: .*'messages'", None),
    # Accepted silently before (the default policy is fcfs); vLLM's words.
    "priority under fcfs": (
        "v1/completions", {"prompt": "Hi", "priority": 1},
        r"^Got priority 1 but Priority scheduling is not enabled\.$", None),
    # 5 MB: 873k tokens and seconds of tokenizing before; 512 tokens of 81 characters at most.
    "5 MB to /tokenize": (
        "tokenize", {"prompt": "hello " * 900_000},
        r"the prompt has 5400000 characters, more than max_model_len \(512\) tokens can hold",
        None),
}


@pytest.fixture(scope="module")
def url(extras_client: openai.OpenAI) -> str:
    return str(extras_client.base_url).removesuffix("/").removesuffix("/v1")


@pytest.mark.model
@pytest.mark.slow
@pytest.mark.parametrize("case", OVER_LIMITS.values(), ids=OVER_LIMITS.keys())
def test_over_a_limit_is_a_400_naming_it(url: str, case: tuple) -> None:
    endpoint, body, message, param = case
    # json.dumps writes a lone surrogate as its \ud800 escape, as a client's JSON would.
    response = httpx.post(
        f"{url}/{endpoint}", content=json.dumps(body), timeout=60,
        headers={"content-type": "application/json"},
    )
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "BadRequestError" and error["code"] == 400
    assert re.search(message, error["message"]), error["message"]
    if param is not None:
        assert error["param"] == param
    assert httpx.get(f"{url}/health").status_code == 200


def test_every_limit_is_a_flag_with_its_default() -> None:
    from v1.entrypoints.openai.api_server import make_parser
    from v1.entrypoints.openai.serving import ServerLimits

    parser = make_parser()
    help_text = parser.format_help()
    docs = (Path(__file__).parents[2] / "docs" / "serving.md").read_text()
    for limits in (InputLimits(), ServerLimits()):
        for field in dataclasses.fields(limits):
            flag = "--" + field.name.replace("_", "-")
            assert flag in help_text and f"| `{flag}` |" in docs
            assert parser.get_default(field.name) == getattr(limits, field.name)
    args = parser.parse_args(["--max-n-sequences", "7", "--max-request-body-bytes", "99"])
    assert (args.max_n_sequences, args.max_request_body_bytes) == (7, 99)
    with pytest.raises(ValueError, match=r"max_body_bytes_in_flight \(10\) must be at least "
                                         r"max_request_body_bytes \(99\)"):
        ServerLimits(max_request_body_bytes=99, max_body_bytes_in_flight=10)


def _through_body_limits(
    app: Any, headers: list, chunks: list[bytes], max_json_values: int = 10**6,
) -> tuple[int, list[dict]]:
    """A request whose body comes in `chunks` through `_BodySizeLimit` (100 bytes, 1000 in
    flight) in front of `app`: how many messages the middleware read, and what it sent."""
    from v1.entrypoints.openai.api_server import _BodySizeLimit

    messages = [{"type": "http.request", "body": c, "more_body": True} for c in chunks]
    messages[-1]["more_body"] = False
    read, sent = 0, []

    async def receive() -> dict:
        nonlocal read
        read += 1
        return messages[read - 1] if read <= len(messages) else {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        sent.append(message)

    scope = {"type": "http", "method": "POST", "path": "/tokenize", "headers": headers}
    limit = _BodySizeLimit(app, 100, max_bytes_in_flight=1000, max_json_values=max_json_values,
                           max_seconds=60)
    asyncio.run(limit(scope, receive, send))
    return read, sent


def test_a_body_over_the_limit_is_refused_before_it_is_read() -> None:
    """By its Content-Length at once, or as a chunked body streams in: a 400 with OpenAI's
    error body before more than the limit is read, and the app never sees the request. At
    the limit, the app gets the body whole, then the connection's own messages."""
    seen: list[tuple[bytes, dict]] = []

    async def app(scope, receive, send) -> None:
        seen.append(((await receive())["body"], await receive()))

    for headers, chunks in (([(b"content-length", b"101")], [b"x" * 101]),
                            ([], [b"x" * 50] * 1000)):  # chunked
        read, sent = _through_body_limits(app, headers, chunks)
        assert read <= 3 and not seen
        assert sent[0]["status"] == 400
        assert json.loads(sent[1]["body"])["error"] == {
            "message": "the request body is larger than max_request_body_bytes (100)",
            "type": "BadRequestError", "param": None, "code": 400,
        }
    read, sent = _through_body_limits(app, [], [b"x" * 50, b"y" * 50])
    assert seen == [(b"x" * 50 + b"y" * 50, {"type": "http.disconnect"})]


def test_a_body_of_too_many_json_values_is_refused_before_it_is_parsed() -> None:
    """max_request_json_values counts the commas outside the body's strings: a body at the
    bound gets a 400 and the app never sees it (5M token ids, parsed and validated on the
    event loop, stalled every stream for 3.5 s); commas inside strings, escaped quotes
    included, are text and do not count."""
    seen: list[bytes] = []

    async def app(scope, receive, send) -> None:
        seen.append((await receive())["body"])

    def body(value: Any) -> list[bytes]:
        return [json.dumps({"prompt": value}, separators=(",", ":")).encode()]

    _, sent = _through_body_limits(app, [], body(list(range(11))), max_json_values=10)
    assert sent[0]["status"] == 400 and not seen
    assert json.loads(sent[1]["body"])["error"]["message"] == (
        "the request body holds more JSON values than max_request_json_values (10): send its "
        "prompts in several requests"
    )
    for value in (list(range(10)), ',"a\\",' * 4, ['a",,"'] * 4):  # 9 commas, then in strings
        _through_body_limits(app, [], body(value), max_json_values=10)
    assert seen == [body(v)[0] for v in (list(range(10)), ',"a\\",' * 4, ['a",,"'] * 4)]


def test_large_bodies_are_handed_on_one_per_turn_of_the_event_loop() -> None:
    """The app parses a body as soon as it reads it: bodies of LARGE_BODY_BYTES or more are
    handed on one per turn of the event loop, so that a stream's turn comes between them
    (24 parallel 15 MB bodies stalled a stream for 1.7 s); small ones as they come."""
    from v1.entrypoints.openai.api_server import _BodySizeLimit

    async def main() -> dict[bytes, int]:
        turn = 0
        read_at: dict[bytes, int] = {}

        async def ticker() -> None:
            nonlocal turn
            while True:
                await asyncio.sleep(0)  # one turn of the loop
                turn += 1

        async def app(scope, receive, send) -> None:
            body = (await receive())["body"]
            read_at[body[:2]] = turn

        size = _BodySizeLimit.LARGE_BODY_BYTES
        limit = _BodySizeLimit(app, max_bytes=size, max_bytes_in_flight=8 * size,
                               max_json_values=size, max_seconds=60)

        async def request(body: bytes) -> None:
            messages = [{"type": "http.request", "body": body, "more_body": False}]

            async def receive() -> dict:
                return messages.pop(0) if messages else {"type": "http.disconnect"}

            async def send(message: dict) -> None:
                pass

            headers = [(b"content-length", str(len(body)).encode())]
            await limit({"type": "http", "method": "POST", "path": "/", "headers": headers},
                        receive, send)

        ticking = asyncio.create_task(ticker())
        await asyncio.gather(*(request(bytes([65 + i]) * (size if i < 4 else 2))
                               for i in range(8)))
        ticking.cancel()
        return read_at

    read_at = asyncio.run(main())
    large = [read_at[bytes([65 + i]) * 2] for i in range(4)]
    small = [read_at[bytes([65 + i]) * 2] for i in range(4, 8)]
    assert len(set(large)) == 4 and len(set(small)) == 1 and min(large) == small[0]


def test_a_prompt_is_validated_against_the_one_form_its_first_element_names() -> None:
    """A prompt (and a pooling input) is a text, texts, token ids or lists of them: which
    one is told by its first element, so a bad element is one error, not one per element of
    every form the value is not (5M token ids took 2.7 s to validate as a plain union)."""
    from pydantic import ValidationError

    from v1.entrypoints.openai.protocol import CompletionRequest
    from v1.entrypoints.openai.protocol_pooling import EmbeddingRequest

    for model, field in ((CompletionRequest, "prompt"), (EmbeddingRequest, "input")):
        for value in ("a", ["a", "b"], [1, 2], [[1], [2, 3]], []):
            assert getattr(model.model_validate({field: value}), field) == value
        for value, loc in (([1] * 1000 + ["a"], (field, "ids", 1000)),
                           (["a"] * 1000 + [1], (field, "texts", 1000)),
                           ([[1]] * 1000 + [1], (field, "batch", 1000))):
            with pytest.raises(ValidationError) as info:
                model.model_validate({field: value})
            assert [e["loc"] for e in info.value.errors()] == [loc]
        with pytest.raises(ValidationError, match="should be a string, a list of strings"):
            model.model_validate({field: 5})


def test_bodies_in_flight_are_bounded_across_requests() -> None:
    """Bodies of requests whose response has not started count together against
    max_body_bytes_in_flight: one more gets a 503 before its body is read (many parallel
    16 MB bodies held as Python objects grew the frontend without bound); a response's start
    frees its body's share, and a refused or finished request holds nothing."""
    from v1.entrypoints.openai.api_server import _BodySizeLimit

    async def main() -> None:
        go: dict[bytes, asyncio.Event] = {}
        reads = {"read": 0}

        async def app(scope, receive, send) -> None:
            body = (await receive())["body"]
            await go.setdefault(body[:1], asyncio.Event()).wait()
            await send({"type": "http.response.start", "status": 200, "headers": []})
            await go[body[:1] + b"end"].wait()
            await send({"type": "http.response.body", "body": b"ok"})

        limit = _BodySizeLimit(app, max_bytes=100, max_bytes_in_flight=150, max_json_values=99,
                               max_seconds=60)

        async def request(body: bytes, chunked: bool = False) -> list[dict]:
            headers = [] if chunked else [(b"content-length", str(len(body)).encode())]
            parts = [body[:10], body[10:]] if chunked else [body]
            messages = [{"type": "http.request", "body": p, "more_body": True} for p in parts]
            messages[-1]["more_body"] = False
            sent: list[dict] = []

            async def receive() -> dict:
                reads["read"] += 1
                return messages.pop(0) if messages else {"type": "http.disconnect"}

            async def send(message: dict) -> None:
                sent.append(message)

            scope = {"type": "http", "method": "POST", "path": "/v1/completions",
                     "headers": headers}
            await limit(scope, receive, send)
            return sent

        for key in (b"a", b"aend", b"b", b"bend"):
            go[key] = asyncio.Event()
        a = asyncio.create_task(request(b"a" * 80))
        b = asyncio.create_task(request(b"b" * 60, chunked=True))
        await asyncio.sleep(0)
        for _ in range(100):  # let both be read in (no clock: a bounded number of turns)
            await asyncio.sleep(0)
        assert limit.bytes_in_flight == 140
        reads["read"] = 0
        refused = await request(b"c" * 20)  # 160 > 150: refused unread
        assert refused[0]["status"] == 503 and reads["read"] <= 1
        assert json.loads(refused[1]["body"])["error"]["message"] == (
            "the server holds max_body_bytes_in_flight (150) bytes of request bodies not yet "
            "answered: retry later"
        )
        go[b"a"].set()  # a's response starts: its 80 bytes are free again
        for _ in range(100):
            await asyncio.sleep(0)
        assert limit.bytes_in_flight == 60
        go[b"d"], go[b"dend"] = asyncio.Event(), asyncio.Event()
        d = asyncio.create_task(request(b"d" * 90))
        for _ in range(100):
            await asyncio.sleep(0)
        assert limit.bytes_in_flight == 150
        for key in (b"aend", b"b", b"bend", b"d", b"dend"):
            go[key].set()
        results = await asyncio.wait_for(asyncio.gather(a, b, d), 60)  # a hang guard
        assert all(r[0]["status"] == 200 for r in results)
        assert limit.bytes_in_flight == 0

    asyncio.run(main())


def test_a_body_is_held_as_it_arrives_and_one_too_slow_gets_a_408() -> None:
    """A body counts against max_body_bytes_in_flight by the bytes that have arrived, not by
    its Content-Length (16 clients announcing 16 MB and sending one byte each held the whole
    budget: every other request got a 503 until they left); a body not whole within
    max_request_body_seconds gets a 408 and holds nothing after."""
    from v1.entrypoints.openai.api_server import _BodySizeLimit

    async def main() -> None:
        seen: list[bytes] = []

        async def app(scope, receive, send) -> None:
            seen.append((await receive())["body"])
            await send({"type": "http.response.start", "status": 200, "headers": []})
            await send({"type": "http.response.body", "body": b"ok"})

        limit = _BodySizeLimit(app, max_bytes=100, max_bytes_in_flight=150, max_json_values=99,
                               max_seconds=0.5)

        async def request(announced: int, parts: list[bytes], stall: bool) -> list[dict]:
            """`parts` arrive, then (`stall`) nothing more: the client waits."""
            messages = [{"type": "http.request", "body": p, "more_body": True} for p in parts]
            if not stall:
                messages[-1]["more_body"] = False
            sent: list[dict] = []

            async def receive() -> dict:
                if messages:
                    return messages.pop(0)
                await asyncio.Event().wait()  # never: a client that sends no more
                raise AssertionError

            async def send(message: dict) -> None:
                sent.append(message)

            headers = [(b"content-length", str(announced).encode())]
            await limit({"type": "http", "method": "POST", "path": "/", "headers": headers},
                        receive, send)
            return sent

        stalled = [asyncio.create_task(request(100, [b"s"], stall=True)) for _ in range(3)]
        for _ in range(100):
            await asyncio.sleep(0)
        assert limit.bytes_in_flight == 3  # a byte each, not 300
        ok = await request(100, [b"o" * 100], stall=False)
        assert ok[0]["status"] == 200 and seen == [b"o" * 100]
        for sent in await asyncio.wait_for(asyncio.gather(*stalled), 60):  # a hang guard
            assert sent[0]["status"] == 408
            assert json.loads(sent[1]["body"])["error"]["message"] == (
                "the request body did not arrive within max_request_body_seconds (0.5): send it "
                "again"
            )
        assert limit.bytes_in_flight == 0 and seen == [b"o" * 100]

    asyncio.run(main())


def test_an_unclosed_string_is_dropped_to_the_end_in_one_pass() -> None:
    """The comma count's string pattern takes a string that never closes to the body's end:
    required to close, it was tried from every quote to the end (a body of a quote and 40,000
    escaped quotes held the event loop for 13 s), and the commas after it counted."""
    from v1.entrypoints.openai.api_server import _JSON_STRING

    assert _JSON_STRING.sub(b"", b'a,"\\",\\",') == b"a,"
    assert _JSON_STRING.sub(b"", b'{"a,b":1,"c\\"d":[1,2]}') == b"{:1,:[1,2]}"
    body = b"," * 1000 + b'"' + b'\\"' * 40_000  # took 13 s when each quote was a new start
    assert _JSON_STRING.sub(b"", body) == b"," * 1000
    assert _JSON_STRING.sub(b"", body + b"\\") == b"," * 1000  # a lone backslash last


def test_a_requests_lists_stop_at_their_first_bad_element() -> None:
    """Every list a request gives is validated up to its first bad element: one error, not
    one per element (a prompt of 1M floats built 1M errors, 3.9 s of the event loop)."""
    from pydantic import ValidationError

    from v1.entrypoints.openai.protocol import (
        BatchChatCompletionRequest,
        ChatCompletionRequest,
        CompletionRequest,
        DetokenizeRequest,
    )
    from v1.entrypoints.openai.protocol_pooling import EmbeddingRequest, ScoreRequest
    from v1.entrypoints.openai.responses_protocol import ResponsesRequest

    bad = [None] * 1000
    for model, body in (
        (CompletionRequest, {"prompt": [1.5] * 1000}),
        (CompletionRequest, {"prompt": [[None]] * 1000}),
        (CompletionRequest, {"prompt": ["a"] + bad}),
        (CompletionRequest, {"prompt": "a", "stop_token_ids": bad}),
        (CompletionRequest, {"prompt": "a", "allowed_token_ids": bad}),
        (CompletionRequest, {"prompt": "a", "bad_words": bad}),
        (ChatCompletionRequest, {"messages": bad}),
        (ChatCompletionRequest, {"messages": [{"role": "user", "content": bad}]}),
        (ChatCompletionRequest, {"messages": MESSAGES, "tools": bad}),
        (BatchChatCompletionRequest, {"messages": [bad]}),
        (BatchChatCompletionRequest, {"messages": bad}),  # the conversations' list too
        (DetokenizeRequest, {"tokens": bad}),
        (EmbeddingRequest, {"input": [1.5] * 1000}),
        (ScoreRequest, {"queries": "a", "documents": bad}),
        (ResponsesRequest, {"input": bad}),
    ):
        with pytest.raises(ValidationError) as info:
            model.model_validate(body)
        assert len(info.value.errors()) <= 2, (model.__name__, info.value.errors()[:3])


@pytest.mark.model
@pytest.mark.slow
def test_a_400_names_the_first_errors_only(url: str) -> None:
    """Values a request's lists do not stop at (an object's members) are named up to a few,
    then counted: a message naming each of a million was 52 MB."""
    body = {"prompt": "a", "logit_bias": {str(i): "x" for i in range(2000)}}
    response = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
    assert response.status_code == 400, response.text
    message = response.json()["error"]["message"]
    assert len(message) < 2000 and message.endswith(" more errors"), message


def test_unknown_fields_are_named_a_few_in_one_short_line(caplog) -> None:
    """The warning naming a request's unknown fields names the first 16 (each cut at 64
    characters), then counts: 1M unknown keys wrote 11.5 MB to the log per request."""
    import logging

    from v1.entrypoints.openai.protocol import CompletionRequest

    extra = {f"k{i:05d}": 1 for i in range(1000)} | {"a" * 1000: 1}
    with caplog.at_level(logging.WARNING, logger="v1.entrypoints.openai"):
        CompletionRequest.model_validate({"prompt": "a", **extra})
    [record] = [r for r in caplog.records if "ignoring fields" in r.getMessage()]
    message = record.getMessage()
    assert message.endswith("'k00014'] and 985 more") and len(message) < 500, message
    assert "'" + "a" * 64 + "...'" in message
