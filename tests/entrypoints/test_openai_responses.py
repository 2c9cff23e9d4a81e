"""POST /v1/responses (OpenAI's Responses API, text only, stateless) through the real `openai`
client and raw HTTP, against the `python -m v1 serve` process shared with the other
single-field modules (--max-model-len 512)."""

import json
from types import SimpleNamespace
from typing import Any

import httpx
import jsonschema
import openai
import pytest

from tests.entrypoints.conftest import SYSTEM
from tests.entrypoints.test_openai_server import MODEL, PERSON, _metrics, _wait_idle
from v1.entrypoints.openai.responses_protocol import ResponsesRequest

pytestmark = [pytest.mark.model, pytest.mark.slow]

MAX_MODEL_LEN = 512  # extras_client's
QUESTION = "Name three colors."
EVENT_ORDER = [
    "response.created", "response.in_progress", "response.output_item.added",
    "response.content_part.added", "response.output_text.delta", "response.output_text.done",
    "response.content_part.done", "response.output_item.done",
]


@pytest.fixture
def client(extras_client: openai.OpenAI) -> openai.OpenAI:
    return extras_client


@pytest.fixture
def url(client: openai.OpenAI) -> str:
    return str(client.base_url).removesuffix("/").removesuffix("/v1")


def chat(client: openai.OpenAI, messages: list[dict[str, Any]], max_tokens: int):
    return client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=max_tokens, temperature=0
    )


def respond(client: openai.OpenAI, input: Any, max_output_tokens: int = 12, **kwargs: Any):
    return client.responses.create(
        model=MODEL, input=input, max_output_tokens=max_output_tokens, temperature=0, **kwargs
    )


def test_text_is_the_chat_completions_answer(client: openai.OpenAI) -> None:
    """A string input is one user message: greedy, the same text and token counts as chat's,
    in OpenAI's response shape."""
    response = respond(client, QUESTION)
    expected = chat(client, [{"role": "user", "content": QUESTION}], 12)
    assert response.output_text and response.output_text == expected.choices[0].message.content
    assert response.id.startswith("resp_") and response.object == "response"
    assert response.model == MODEL and response.created_at > 0
    [message] = response.output
    assert message.type == "message" and message.role == "assistant"
    assert message.id.startswith("msg_")
    [part] = message.content
    assert part.type == "output_text" and part.annotations == []
    usage, chat_usage = response.usage, expected.usage
    assert usage.input_tokens == chat_usage.prompt_tokens
    assert usage.output_tokens == chat_usage.completion_tokens
    assert usage.total_tokens == usage.input_tokens + usage.output_tokens
    assert usage.input_tokens_details.cached_tokens >= 0
    assert usage.output_tokens_details.reasoning_tokens == 0


def test_instructions_and_message_items_make_the_conversation(client: openai.OpenAI) -> None:
    """`instructions` are the system message; message items (string content or
    input_text / output_text parts, an earlier output sent back) are the chat's messages."""
    question = "When do you open on Saturday?"
    response = respond(client, question, instructions=SYSTEM)
    expected = chat(client, [{"role": "system", "content": SYSTEM},
                             {"role": "user", "content": question}], 12)
    assert response.output_text == expected.choices[0].message.content
    assert response.instructions == SYSTEM
    items = [
        {"role": "developer", "content": [{"type": "input_text", "text": "Be brief. "},
                                          {"type": "input_text", "text": "Be kind."}]},
        {"role": "user", "content": "Hello"},
        {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
         "content": [{"type": "output_text", "text": "Hi!", "annotations": []}]},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": question}]},
    ]
    # Parts' texts joined by newlines, as chat's (and vLLM's).
    messages = [{"role": "developer", "content": "Be brief. \nBe kind."},
                {"role": "user", "content": "Hello"},
                {"role": "assistant", "content": "Hi!"},
                {"role": "user", "content": question}]
    response = respond(client, items)
    assert response.output_text == chat(client, messages, 12).choices[0].message.content


def test_stream_events_in_order_add_up_to_the_response(client: openai.OpenAI) -> None:
    whole = respond(client, QUESTION, max_output_tokens=20)
    events = list(respond(client, QUESTION, max_output_tokens=20, stream=True))
    types = [event.type for event in events]
    num_deltas = types.count("response.output_text.delta")
    assert num_deltas >= 2
    expected = EVENT_ORDER[:4] + EVENT_ORDER[4:5] * num_deltas + EVENT_ORDER[5:]
    assert types == [*expected, f"response.{whole.status}"]
    assert [event.sequence_number for event in events] == list(range(len(events)))
    deltas = "".join(event.delta for event in events if event.type.endswith(".delta"))
    assert deltas == whole.output_text
    item_id = events[2].item.id
    assert all(event.item_id == item_id for event in events[3:-2])
    assert events[-2].item.id == item_id and events[-2].item.content[0].text == deltas
    assert events[5 + num_deltas - 1].text == deltas  # output_text.done
    for started in events[:2]:
        assert started.response.status == "in_progress" and started.response.output == []
    done = events[-1].response
    assert done.id == events[0].response.id and done.output_text == deltas
    assert done.status == whole.status and done.usage.output_tokens == whole.usage.output_tokens


def test_stream_wire_format_names_each_event(url: str) -> None:
    """As OpenAI sends them: `event: <type>` before each `data:` line, no [DONE] at the end."""
    body = {"model": MODEL, "input": QUESTION, "max_output_tokens": 3, "stream": True}
    response = httpx.post(f"{url}/v1/responses", json=body, timeout=120)
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/event-stream")
    blocks = response.text.strip().split("\n\n")
    for block in blocks:
        event_line, data_line = block.split("\n")
        assert event_line.removeprefix("event: ") == json.loads(data_line[6:])["type"]
    assert "[DONE]" not in response.text and blocks[-1].startswith("event: response.incomplete")


def test_incomplete_at_max_output_tokens_and_completed_at_a_stop(client: openai.OpenAI) -> None:
    cut = respond(client, QUESTION, max_output_tokens=3)
    assert cut.status == "incomplete" and cut.incomplete_details.reason == "max_output_tokens"
    assert cut.output[0].status == "incomplete" and cut.usage.output_tokens == 3
    assert cut.max_output_tokens == 3
    # A schema-bound answer ends by itself (json_schema is the structured-output machinery's).
    fmt = {"type": "json_schema", "name": "person", "schema": PERSON, "strict": True}
    person = respond(client, "Invent a person.", max_output_tokens=80, text={"format": fmt})
    assert person.status == "completed" and person.incomplete_details is None
    assert person.output[0].status == "completed"
    jsonschema.validate(json.loads(person.output_text), PERSON)
    assert person.text.format.type == "json_schema" and person.text.format.schema_ == PERSON


def test_parameters_are_echoed_and_nothing_is_stored(client: openai.OpenAI) -> None:
    """`store: true` (OpenAI's default) is accepted, as vLLM does without its store, and the
    response says it was not stored."""
    response = client.responses.create(
        model=MODEL, input="Hi", max_output_tokens=2, temperature=0.5, top_p=0.9, store=True,
        metadata={"ticket": "42"}, user="someone", truncation="disabled", tool_choice="none",
    )
    assert response.model_extra["store"] is False and response.previous_response_id is None
    assert response.metadata == {"ticket": "42"} and response.user == "someone"
    assert (response.temperature, response.top_p, response.max_output_tokens) == (0.5, 0.9, 2)
    assert response.truncation == "disabled" and response.tool_choice == "none"
    assert response.tools == [] and response.text.format.type == "text"


def test_truncation_auto_drops_the_oldest_items(client: openai.OpenAI) -> None:
    items = [{"role": "user", "content": "hello " * 250},
             {"role": "assistant", "content": "hi " * 250},
             {"role": "user", "content": "What is 2+2?"}]
    with pytest.raises(openai.BadRequestError, match=str(MAX_MODEL_LEN)):
        respond(client, items, max_output_tokens=10)  # truncation "disabled", the default
    response = respond(client, items, max_output_tokens=10, truncation="auto")
    # The fewest items went (the whole did not fit): it is what the last two alone get.
    alone = respond(client, items[1:], max_output_tokens=10)
    assert response.usage.input_tokens == alone.usage.input_tokens
    assert response.output_text == alone.output_text and response.truncation == "auto"
    with pytest.raises(openai.BadRequestError, match="max_output_tokens"):
        respond(client, items[2:], max_output_tokens=MAX_MODEL_LEN, truncation="auto")


def test_truncation_auto_drops_an_item_too_long_to_tokenize(client: openai.OpenAI) -> None:
    """An item with more characters than max_model_len tokens can cover (refused untokenized
    when it is sent alone) is dropped by truncation "auto", not answered with a 400."""
    items = [{"role": "user", "content": "hello " * 20_000},
             {"role": "user", "content": "What is 2+2?"}]
    with pytest.raises(openai.BadRequestError, match="characters"):
        respond(client, items, max_output_tokens=10)
    response = respond(client, items, max_output_tokens=10, truncation="auto")
    alone = respond(client, items[1:], max_output_tokens=10)
    assert response.usage.input_tokens == alone.usage.input_tokens
    assert response.output_text == alone.output_text


def test_request_to_conversation_and_sampling_params() -> None:
    """The model's default sampling parameters fill what the request left out: max_output_tokens
    counts as max_tokens given, temperature left out does not."""
    request = ResponsesRequest.model_validate({
        "input": [{"role": "user", "content": [{"type": "input_text", "text": "a"},
                                               {"type": "input_text", "text": "b"}]},
                  {"role": "assistant", "content": "c"}],
        "instructions": "be brief", "max_output_tokens": 5, "top_k": 3,
    })
    assert request.messages() == [{"role": "system", "content": "be brief"},
                                  {"role": "user", "content": "a\nb"},  # as chat's
                                  {"role": "assistant", "content": "c"}]
    assert request.messages(1) == [{"role": "system", "content": "be brief"},
                                   {"role": "assistant", "content": "c"}]
    given = request.sampling_fields_set
    assert {"max_tokens", "top_k"} <= given and "temperature" not in given
    params = request.to_sampling_params()
    assert (params.max_tokens, params.top_k, params.structured_outputs) == (5, 3, None)


BAD_REQUESTS: dict[str, tuple[dict[str, Any] | bytes, str | None]] = {
    "previous_response_id": ({"previous_response_id": "resp_123"}, "previous_response_id"),
    "input a number": ({"input": 5}, "input"),
    "input empty": ({"input": []}, "input"),
    "input missing": ({"input": None}, "input"),
    "image part": (
        {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
        "input.0.content.0"),
    "function_call item": (
        {"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"}]},
        "input.0"),
    "unknown role": ({"input": [{"role": "bot", "content": "hi"}]}, "input.0.role"),
    "max_output_tokens over max_model_len": ({"max_output_tokens": 100_000}, None),
    "max_output_tokens 0": ({"max_output_tokens": 0}, None),
    "max_output_tokens a string": ({"max_output_tokens": "8"}, "max_output_tokens"),
    "temperature negative": ({"temperature": -1.0}, None),
    "stream not a bool": ({"stream": "maybe"}, "stream"),  # "yes" is one, as to vLLM
    "tools": ({"tools": [{"type": "function", "name": "f"}]}, "tools"),
    "tool_choice required": ({"tool_choice": "required"}, "tool_choice"),
    "background": ({"background": True}, "background"),
    "text format xml": ({"text": {"format": {"type": "xml"}}}, "text.format"),
    "json_schema without schema": (
        {"text": {"format": {"type": "json_schema", "name": "x"}}},
        "text.format.json_schema.schema"),  # (the format tried, then its field)
    "metadata value not a string": ({"metadata": {"a": 1}}, "metadata.a"),
    "metadata too many pairs": ({"metadata": {str(i): "v" for i in range(17)}}, "metadata"),
    "truncation unknown": ({"truncation": "middle"}, "truncation"),
    "malformed JSON": (b'{"input": "hi",', None),
}


@pytest.mark.parametrize("case", BAD_REQUESTS.values(), ids=BAD_REQUESTS.keys())
def test_bad_request(url: str, case: tuple[dict[str, Any] | bytes, str | None]) -> None:
    fields, param = case
    if isinstance(fields, bytes):
        content = fields
    else:
        body = {"model": MODEL, "input": "hi", "max_output_tokens": 4, **fields}
        content = json.dumps({k: v for k, v in body.items() if v is not None}).encode()
    response = httpx.post(f"{url}/v1/responses", content=content,
                          headers={"content-type": "application/json"}, timeout=120)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "BadRequestError" and error["code"] == 400 and error["message"]
    if param is not None:
        assert error["param"] == param, error


def test_openai_client_raises_on_bad_request(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as error:
        client.responses.create(model=MODEL, input="Hi", previous_response_id="resp_1")
    assert error.value.param == "previous_response_id"
    with pytest.raises(openai.BadRequestError) as error:
        respond(client, QUESTION, max_output_tokens=MAX_MODEL_LEN)
    assert "max_output_tokens" in error.value.message and str(MAX_MODEL_LEN) in error.value.message
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model="gpt-5", input="Hi")


def test_disconnect_aborts(url: str) -> None:
    """A client that leaves a stream has its request aborted: the engine stops generating
    and frees its blocks."""
    server = SimpleNamespace(url=url)  # all the metrics helpers read of a Server
    max_output_tokens = 400  # far more than is generated before the abort lands
    # The end-of-turn tokens banned (vLLM's logit_bias): only the abort can end it early.
    stops = httpx.post(f"{url}/tokenize", json={"prompt": "<|im_end|><|endoftext|>"}).json()
    assert len(stops["tokens"]) == 2  # special tokens, one each
    body = {"model": MODEL, "input": QUESTION, "max_output_tokens": max_output_tokens,
            "stream": True, "logit_bias": {str(t): -100 for t in stops["tokens"]}}
    before = _wait_idle(server)  # type: ignore[arg-type]
    with httpx.stream("POST", f"{url}/v1/responses", json=body, timeout=120) as response:
        lines = response.iter_lines()
        assert next(lines) == "event: response.created"
        assert _metrics(server)["vllm:num_requests_running"] == 1  # type: ignore[arg-type]
    after = _wait_idle(server)  # type: ignore[arg-type]
    generated = after["vllm:generation_tokens_total"] - before["vllm:generation_tokens_total"]
    assert 0 < generated < max_output_tokens // 2
