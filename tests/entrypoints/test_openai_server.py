"""The OpenAI-compatible server end to end: one real `python -m v1 serve` process for the
module (the default model, small engine options), driven with the `openai` client and httpx."""

import asyncio
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.engine.mp_utils import PROMPTLY_S, wait_until

pytestmark = [pytest.mark.model, pytest.mark.slow]

MODEL, ALIAS = "smol", "smol-alias"  # --served-model-name: responses report the first
MAX_MODEL_LEN = 1024
REPO = Path(__file__).resolve().parents[2]  # where `tests.engine.engine_hooks` imports from
PROMPT = "The capital of France is"
MESSAGES = [{"role": "user", "content": "Name three colors."}]


class Server:
    def __init__(self, proc: subprocess.Popen, port: int, log: Path) -> None:
        self.proc, self.port, self.log = proc, port, log
        self.url = f"http://127.0.0.1:{port}"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _port_is_free(port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # TIME_WAIT does not count
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def _descendants(pid: int) -> set[int]:
    """The live processes below `pid` (the engine core and its helpers), from /proc."""
    parents: dict[int, int] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[0] != "Z":
            parents[int(stat.parent.name)] = int(fields[1])
    found, frontier = set(), {pid}
    while frontier:
        frontier = {p for p, parent in parents.items() if parent in frontier} - found
        found |= frontier
    return found


def wait_healthy(proc: subprocess.Popen, url: str, log: Path, timeout: float = 300) -> None:
    """Until `url`/health answers 200; fails, showing the log, if the server exits first
    (or after `timeout`: a start takes seconds, more on a busy machine)."""
    deadline = time.monotonic() + timeout
    while True:
        assert proc.poll() is None, f"the server exited:\n{log.read_text()}"
        assert time.monotonic() < deadline, f"the server did not start:\n{log.read_text()}"
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.2)


@contextlib.contextmanager
def serve(
    model_path: Path, log: Path, *options: str, env: dict[str, str] | None = None
) -> Iterator[Server]:
    """A `python -m v1 serve` process on a free port, killed at the end if still running;
    `env`: variables to set in its environment."""
    port = free_port()
    cmd = [
        sys.executable, "-m", "v1", "serve", "--model", str(model_path), "--port", str(port),
        "--uvicorn-log-level", "warning", *options,
    ]
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            cmd, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})}
        )
    server = Server(proc, port, log)
    try:
        wait_healthy(proc, server.url, log)
        yield server
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@contextlib.contextmanager
def serve_client(
    model_path: Path, tmp_path_factory: pytest.TempPathFactory, name: str, *options: str
) -> Iterator[openai.OpenAI]:
    """`serve` under the name MODEL, with its log in a fresh temp dir; yields an `openai`
    client of it."""
    log = tmp_path_factory.mktemp(name) / "server.log"
    with serve(model_path, log, "--served-model-name", MODEL, *options) as server:
        yield openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0)


@pytest.fixture(scope="module")
def server(default_model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    log = tmp_path_factory.mktemp("openai_server") / "server.log"
    with serve(
        default_model_path, log, "--served-model-name", MODEL, ALIAS,
        "--max-model-len", str(MAX_MODEL_LEN), "--num-gpu-blocks", "256",
        env={"VLLM_SERVER_DEV_MODE": "1"},  # vLLM's /pause, /resume, /reset_prefix_cache
    ) as server:
        yield server  # test_shutdown stops it


@pytest.fixture(scope="module")
def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0)


def _metrics(server: Server) -> dict[str, float]:
    """The samples with no label but the model's (no histogram buckets), by name."""
    families = text_string_to_metric_families(httpx.get(f"{server.url}/metrics").text)
    return {
        s.name: s.value for f in families for s in f.samples if s.labels.keys() == {"model_name"}
    }


def _wait_idle(server: Server, timeout: float = 60.0) -> dict[str, float]:
    """Metrics once nothing runs, waits or holds a KV block (fails after `timeout`, a bound
    for a hang: aborts arrive asynchronously, in well under a second)."""
    deadline = time.monotonic() + timeout
    while True:
        m = _metrics(server)
        idle = m["vllm:num_requests_running"] == m["vllm:num_requests_waiting"] == 0
        if (idle and m["vllm:kv_cache_usage_perc"] == 0) or time.monotonic() > deadline:
            assert m["vllm:num_requests_running"] == m["vllm:num_requests_waiting"] == 0, m
            assert m["vllm:kv_cache_usage_perc"] == 0, m
            return m
        time.sleep(0.05)


def test_served_model_names(client: openai.OpenAI) -> None:
    """Every --served-model-name is listed and accepted; responses report the first."""
    assert [m.id for m in client.models.list().data] == [MODEL, ALIAS]
    for name in (MODEL, ALIAS):
        completion = client.completions.create(model=name, prompt=PROMPT, max_tokens=1)
        assert completion.model == MODEL
        chat = client.chat.completions.create(model=name, messages=MESSAGES, max_tokens=1)
        assert chat.model == MODEL


def test_completion_greedy(client: openai.OpenAI) -> None:
    first, second = (
        client.completions.create(
            model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0, logprobs=1
        )
        for _ in range(2)
    )
    choice = first.choices[0]
    assert choice.text and choice.text == second.choices[0].text
    assert choice.finish_reason == "length"
    # Greedy: every token is the most likely one.
    lp = choice.logprobs
    for token, token_lp, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert top == {token: pytest.approx(token_lp)}
    usage = first.usage
    assert usage.completion_tokens == 8 == len(lp.tokens)
    assert usage.total_tokens == usage.prompt_tokens + 8 and usage.prompt_tokens > 0
    assert usage.prompt_tokens_details.cached_tokens == 0


def test_prompt_forms(client: openai.OpenAI) -> None:
    """A string, a list of one string, token ids and a list of one list of ids."""

    def text(prompt) -> str:
        return client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=4, temperature=0
        ).choices[0].text

    assert text([PROMPT]) == text(PROMPT)
    ids = [504, 3575, 282, 4649, 314]  # any in-vocabulary ids
    assert text([ids]) == text(ids) != ""


def test_chat_stream_matches_non_stream(client: openai.OpenAI) -> None:
    kwargs = dict(model=MODEL, messages=MESSAGES, temperature=0, max_completion_tokens=16)
    full = client.chat.completions.create(**kwargs)
    chunks = list(
        client.chat.completions.create(
            **kwargs, stream=True, stream_options={"include_usage": True}
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content != ""
    finish = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finish[-1] == full.choices[0].finish_reason and not any(finish[:-1])
    assert chunks[-1].choices == []
    usage, full_usage = chunks[-1].usage, full.usage
    assert (usage.prompt_tokens, usage.completion_tokens) == (
        full_usage.prompt_tokens, full_usage.completion_tokens)


CONTINUOUS = {"include_usage": True, "continuous_usage_stats": True}


def test_continuous_usage_stats(client: openai.OpenAI) -> None:
    """vLLM's stream_options.continuous_usage_stats (guidellm sends it): every chunk carries
    its choice's usage so far (its prompt's tokens, the choice's tokens up to and including
    this chunk; 0 in chat's role chunk), and the last chunk the whole request's."""
    sampling = dict(max_tokens=5, temperature=0, extra_body={"ignore_eos": True})

    def check(chunks: list[Any], prompt_tokens: dict[int, int], num_choices: int) -> None:
        seen: dict[int, int] = {}
        for chunk in chunks[:-1]:
            (choice,) = chunk.choices
            usage = chunk.usage
            assert usage.prompt_tokens == prompt_tokens[choice.index]
            assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
            assert usage.completion_tokens >= seen.get(choice.index, 0)  # never goes back
            seen[choice.index] = usage.completion_tokens
            if choice.finish_reason is not None:
                assert usage.completion_tokens == 5
        assert seen == {i: 5 for i in range(num_choices)}
        assert chunks[-1].choices == []
        assert chunks[-1].usage.completion_tokens == 5 * num_choices

    chat = list(client.chat.completions.create(
        model=MODEL, messages=MESSAGES, n=2, stream=True, stream_options=CONTINUOUS, **sampling
    ))
    num_prompt = chat[-1].usage.prompt_tokens  # one prompt for both choices
    roles = [c for c in chat if c.choices and c.choices[0].delta.role]
    assert len(roles) == 2 and all(c.usage.completion_tokens == 0 for c in roles)
    check(chat, {0: num_prompt, 1: num_prompt}, 2)

    prompts = [PROMPT, "Once upon a time, in a land far away,"]
    lengths = [
        client.completions.create(model=MODEL, prompt=p, max_tokens=1).usage.prompt_tokens
        for p in prompts
    ]
    completion = list(client.completions.create(
        model=MODEL, prompt=prompts, stream=True, stream_options=CONTINUOUS, **sampling
    ))
    check(completion, dict(enumerate(lengths)), 2)
    assert completion[-1].usage.prompt_tokens == sum(lengths)

    # As vLLM: without include_usage it asks for nothing.
    quiet = list(client.completions.create(
        model=MODEL, prompt=PROMPT, stream=True,
        stream_options={"continuous_usage_stats": True}, **sampling
    ))
    assert all(c.usage is None for c in quiet) and all(c.choices for c in quiet)


def test_n_and_seed(client: openai.OpenAI) -> None:
    sampling = dict(n=2, max_tokens=4, temperature=1.0, seed=7, extra_body={"ignore_eos": True})

    def run():
        return client.completions.create(model=MODEL, prompt=PROMPT, **sampling)

    first, second = run(), run()
    assert sorted(c.index for c in first.choices) == [0, 1]
    assert [c.text for c in first.choices] == [c.text for c in second.choices]
    assert first.usage.completion_tokens == 8

    chat = client.chat.completions.create(model=MODEL, messages=MESSAGES, **sampling)
    assert sorted(c.index for c in chat.choices) == [0, 1]
    assert all(c.message.content for c in chat.choices)


def _complete(client: openai.OpenAI, stream: bool, **kwargs: Any) -> tuple[str, str, Any]:
    """A greedy completion's text, finish_reason and stop_reason, streamed or not."""
    kwargs = {"model": MODEL, "max_tokens": 12, "temperature": 0, **kwargs}
    if not stream:
        choice = client.completions.create(**kwargs).choices[0]
        return choice.text, choice.finish_reason, choice.model_extra["stop_reason"]
    chunks = [c.choices[0] for c in client.completions.create(**kwargs, stream=True)]
    assert not any(c.finish_reason for c in chunks[:-1])
    last = chunks[-1]
    return "".join(c.text for c in chunks), last.finish_reason, last.model_extra["stop_reason"]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "sse"])
def test_stop_strings(client: openai.OpenAI, stream: bool) -> None:
    text, _, _ = _complete(client, False, prompt=PROMPT)
    stop = text.strip().split()[1]  # the second word: something is generated before it
    cut = text.index(stop)
    for value in (stop, [stop, "never seen"]):
        assert _complete(client, stream, prompt=PROMPT, stop=value) == (text[:cut], "stop", stop)
    included = _complete(
        client, stream, prompt=PROMPT, stop=stop, extra_body={"include_stop_str_in_output": True}
    )
    assert included == (text[: cut + len(stop)], "stop", stop)


# Prompts whose greedy completion holds a character of several UTF-8 bytes (and tokens).
NON_ASCII_PROMPTS = ["The French word for coffee is", "The Chinese word for hello is"]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "sse"])
@pytest.mark.parametrize("prompt", NON_ASCII_PROMPTS)
def test_non_ascii_stop_strings(client: openai.OpenAI, prompt: str, stream: bool) -> None:
    text, _, _ = _complete(client, False, prompt=prompt)
    cut = next((i for i, ch in enumerate(text) if ord(ch) > 127), None)
    assert cut, f"the greedy output {text!r} has no non-ASCII character after its start"
    stop = text[cut - 1 : cut + 1]  # the character and the one before it
    assert _complete(client, stream, prompt=prompt, stop=stop) == (text[: cut - 1], "stop", stop)
    included = _complete(
        client, stream, prompt=prompt, stop=stop, extra_body={"include_stop_str_in_output": True}
    )
    assert included == (text[: cut + 1], "stop", stop)


def test_logprobs(client: openai.OpenAI) -> None:
    k = 3
    choice = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=5, temperature=0, logprobs=k
    ).choices[0]
    lp = choice.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 5
    assert "".join(lp.tokens) == choice.text
    offsets = [0]
    for token in lp.tokens[:-1]:
        offsets.append(offsets[-1] + len(token))
    assert lp.text_offset == offsets
    for token_lp, top in zip(lp.token_logprobs, lp.top_logprobs):
        assert 1 <= len(top) <= k and token_lp <= 0
        assert max(top.values()) == pytest.approx(token_lp)  # greedy
    # logprobs=0: the sampled token alone (as OpenAI and vLLM: "up to logprobs + 1").
    lp = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=3, temperature=0, logprobs=0
    ).choices[0].logprobs
    assert lp.top_logprobs == [{t: pytest.approx(x)} for t, x in zip(lp.tokens, lp.token_logprobs)]

    # Streamed, the offsets run on across chunks.
    stream = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=5, temperature=0, logprobs=k, stream=True
    )
    chunks = [c.choices[0].logprobs for c in stream]
    assert sum((c.text_offset for c in chunks), []) == offsets

    chat = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=5, temperature=0, logprobs=True,
        top_logprobs=2,
    ).choices[0]
    content = chat.logprobs.content
    assert len(content) == 5 and "".join(t.token for t in content) == chat.message.content
    for t in content:
        assert len(t.top_logprobs) == 2 and t.top_logprobs[0].logprob == pytest.approx(t.logprob)
        assert bytes(t.bytes) == t.token.encode()


@pytest.fixture(scope="module")
def tokenizer(default_model_path: Path) -> Any:
    from v1.models.model_files import hf_dir_of, load_tokenizer

    return load_tokenizer(hf_dir_of(default_model_path))


def test_sampling_options(client: openai.OpenAI, tokenizer: Any) -> None:
    """vLLM's extra sampling options each change the output as they should, so dropping any
    of them fails here."""
    prompt = "Once upon a time"

    def complete(**body: Any) -> Any:
        return client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=8, extra_body=body
        ).choices[0]

    greedy = complete(temperature=0, logprobs=0)
    # Hot sampling (with a fixed seed) leaves greedy; a filter that keeps only the most likely
    # token brings it back.
    hot = {"temperature": 1.5, "seed": 3}
    assert complete(**hot).text != greedy.text
    for keep_the_top in ({"top_k": 1}, {"min_p": 1.0}, {"top_p": 1e-6}):
        assert complete(**hot, **keep_the_top).text == greedy.text, keep_the_top

    # A stop token id that greedy produces as its 4th token ends the output there.
    tokens = greedy.logprobs.tokens
    stop_ids = tokenizer.encode(tokens[3], add_special_tokens=False)
    assert len(stop_ids) == 1 and tokens[3] not in tokens[:3], tokens
    stopped = complete(temperature=0, stop_token_ids=stop_ids)
    assert (stopped.finish_reason, stopped.model_extra["stop_reason"]) == ("stop", stop_ids[0])
    assert stopped.text.startswith("".join(tokens[:3]))
    # min_tokens keeps the stop token from being sampled before it: here never, in 8.
    longer = complete(temperature=0, stop_token_ids=stop_ids, min_tokens=8)
    assert longer.text.startswith("".join(tokens[:3])) and longer.finish_reason == "length"


def test_prefix_cache_hits_in_usage(client: openai.OpenAI) -> None:
    prompt = "A long shared prefix to be cached in full blocks. " * 4  # > 2 blocks of 16
    first, second = (
        client.completions.create(model=MODEL, prompt=prompt, max_tokens=1) for _ in range(2)
    )
    assert first.usage.prompt_tokens >= 32
    assert second.usage.prompt_tokens_details.cached_tokens >= 32


def test_metrics(server: Server, client: openai.OpenAI) -> None:
    """vLLM's metric names, labelled with the served model name; the token counters move
    by the usage a request reports (tests/entrypoints/test_prometheus_metrics.py: the rest)."""
    response = httpx.get(f"{server.url}/metrics")
    assert response.headers["content-type"].startswith("text/plain; version=0.0.4")
    types = {f.name: f.type for f in text_string_to_metric_families(response.text)}
    assert types["vllm:num_requests_running"] == types["vllm:kv_cache_usage_perc"] == "gauge"
    assert types["vllm:prompt_tokens"] == types["vllm:prefix_cache_hits"] == "counter"
    assert types["vllm:e2e_request_latency_seconds"] == "histogram"
    before = _wait_idle(server)
    usage = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3).usage
    after = _metrics(server)
    assert usage is not None
    assert after["vllm:generation_tokens_total"] - before["vllm:generation_tokens_total"] == (
        usage.completion_tokens
    )
    assert after["vllm:prompt_tokens_total"] - before["vllm:prompt_tokens_total"] == (
        usage.prompt_tokens
    )
    assert after["vllm:e2e_request_latency_seconds_count"] == (
        before["vllm:e2e_request_latency_seconds_count"] + 1
    )


def test_burst_of_concurrent_requests(server: Server) -> None:
    num = 200

    async def one(http: httpx.AsyncClient, i: int) -> httpx.Response:
        if i % 4 == 0:
            body = {"messages": [{"role": "user", "content": f"Count to {i}."}], "max_tokens": 4}
            return await http.post("/v1/chat/completions", json=body)
        body = {"prompt": f"Request {i} says", "max_tokens": 4, "stream": i % 4 == 1}
        return await http.post("/v1/completions", json=body)

    async def burst() -> list[httpx.Response]:
        limits = httpx.Limits(max_connections=num)
        async with httpx.AsyncClient(base_url=server.url, limits=limits, timeout=300) as http:
            return await asyncio.gather(*(one(http, i) for i in range(num)))

    responses = asyncio.run(burst())
    assert [r.status_code for r in responses] == [200] * num
    streamed = [r.text for i, r in enumerate(responses) if i % 4 == 1]
    assert all(t.endswith("data: [DONE]\n\n") for t in streamed)
    assert all(r.json()["choices"][0]["text"] for i, r in enumerate(responses) if i % 4 > 1)
    _wait_idle(server)


# (endpoint, body, expected status, param in the error (None: not checked))
BAD_REQUESTS = {
    "malformed json": ("completions", b'{"prompt": "hi", ', 400, None),
    "not an object": ("completions", b"[1, 2]", 400, None),
    "no prompt": ("completions", {"max_tokens": 3}, 400, "prompt"),
    "prompt wrong type": ("completions", {"prompt": 5}, 400, "prompt"),
    "max_tokens string": ("completions", {"prompt": "hi", "max_tokens": "5"}, 400, "max_tokens"),
    "max_tokens 0": ("completions", {"prompt": "hi", "max_tokens": 0}, 400, None),
    "max_tokens negative": ("completions", {"prompt": "hi", "max_tokens": -3}, 400, None),
    "temperature negative": ("completions", {"prompt": "hi", "temperature": -1}, 400, None),
    "top_p 0": ("completions", {"prompt": "hi", "top_p": 0}, 400, None),
    "top_p 2": ("completions", {"prompt": "hi", "top_p": 2}, 400, None),
    "n 0": ("completions", {"prompt": "hi", "n": 0}, 400, None),
    "n bool": ("completions", {"prompt": "hi", "n": True}, 400, "n"),
    "stop wrong type": ("completions", {"prompt": "hi", "stop": 5}, 400, "stop"),
    "logprobs too large": ("completions", {"prompt": "hi", "logprobs": 21}, 400, None),
    "logprobs negative": ("completions", {"prompt": "hi", "logprobs": -1}, 400, "logprobs"),
    "token id out of vocab": ("completions", {"prompt": [1, 10**6]}, 400, None),
    "negative token id": ("completions", {"prompt": [1, -2]}, 400, None),
    "empty prompt": ("completions", {"prompt": ""}, 400, None),
    "prompt over max_model_len": ("completions", {"prompt": "hello " * 1100}, 400, None),
    "min_tokens over max_tokens": (
        "completions", {"prompt": "hi", "max_tokens": 2, "min_tokens": 5}, 400, None),
    "stream_options without stream": (
        "completions", {"prompt": "hi", "stream_options": {"include_usage": True}}, 400, None),
    "unknown model": ("completions", {"prompt": "hi", "model": "gpt-4"}, 404, "model"),
    "empty messages": ("chat/completions", {"messages": []}, 400, None),
    "messages missing role": (
        "chat/completions", {"messages": [{"content": "hi"}]}, 400, "messages.0.role"),
    "messages not a list": ("chat/completions", {"messages": "hi"}, 400, "messages"),
    "image content": (
        "chat/completions",
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
        400, "messages.0.content"),
    "top_logprobs without logprobs": (
        "chat/completions", {"messages": MESSAGES, "top_logprobs": 2}, 400, None),
    "top_logprobs too large": (
        "chat/completions", {"messages": MESSAGES, "logprobs": True, "top_logprobs": 50},
        400, None),
    "max_completion_tokens 0": (
        "chat/completions", {"messages": MESSAGES, "max_completion_tokens": 0}, 400, None),
    # "yes" is a boolean to vLLM's (lax) models, and so here: "maybe" is not.
    "stream wrong type": ("chat/completions", {"messages": MESSAGES, "stream": "maybe"}, 400,
                          "stream"),
    "unsupported suffix": ("completions", {"prompt": "hi", "suffix": "!"}, 400, "suffix"),
    "tool without function": (
        "chat/completions", {"messages": MESSAGES, "tools": [{"type": "function"}]}, 400,
        "tools.0.function"),
    # As vLLM: "auto" (the default with tools) needs --enable-auto-tool-choice.
    "auto tool choice not enabled": (
        "chat/completions",
        {"messages": MESSAGES, "tools": [{"type": "function", "function": {"name": "f"}}]},
        400, None),
}


@pytest.mark.parametrize("case", BAD_REQUESTS.values(), ids=BAD_REQUESTS.keys())
def test_bad_request(server: Server, case: tuple) -> None:
    endpoint, body, status, param = case
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    response = httpx.post(
        f"{server.url}/v1/{endpoint}", content=content,
        headers={"content-type": "application/json"},
    )
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert error["code"] == status
    assert error["type"] == {400: "BadRequestError", 404: "NotFoundError"}[status]
    if param is not None:
        assert error["param"] == param
    # The server is unharmed.
    assert httpx.get(f"{server.url}/health").status_code == 200
    ok = httpx.post(f"{server.url}/v1/completions", json={"prompt": "hi", "max_tokens": 1})
    assert ok.status_code == 200 and ok.json()["choices"][0]["text"]


def test_openai_client_raises_on_bad_request(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        client.completions.create(model=MODEL, prompt="hi", max_tokens=0)
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-4", messages=MESSAGES)


TOOL = {"type": "function", "function": {"name": "now", "parameters": {"type": "object"}}}
# field: the openai client's arguments that set it to something this server does not
# implement (vLLM's own fields go in extra_body).
UNSUPPORTED_CHAT = {
    "functions": {"functions": [TOOL["function"]]},
    "function_call": {"function_call": "auto"},
    "reasoning_effort": {"reasoning_effort": "low"},
    "guided_json": {"extra_body": {"guided_json": {"type": "object"}}},
    "use_beam_search": {"extra_body": {"use_beam_search": True}},  # completions only
    "return_prompt_text": {"extra_body": {"return_prompt_text": True}},
}
UNSUPPORTED_COMPLETION = {
    "suffix": {"suffix": " and so on."},
    "best_of": {"best_of": 2},
    "truncate_prompt_tokens": {"extra_body": {"truncate_prompt_tokens": 3}},
    "logprob_token_ids": {"extra_body": {"logprob_token_ids": [5, 6]}},
    "watermarking": {"extra_body": {"watermarking": "true"}},
    "repetition_detection": {"extra_body": {"repetition_detection": {"min_pattern_size": 2}}},
}


@pytest.mark.parametrize(
    ("endpoint", "field", "kwargs"),
    [pytest.param("chat", f, kw, id=f"chat-{f}") for f, kw in UNSUPPORTED_CHAT.items()]
    + [pytest.param("completion", f, kw, id=f) for f, kw in UNSUPPORTED_COMPLETION.items()],
)
def test_unsupported_field_is_refused(
    client: openai.OpenAI, endpoint: str, field: str, kwargs: dict[str, Any]
) -> None:
    """A field the server does not implement, set to anything but its default, gets a 400
    naming it instead of an answer that ignored it."""
    if endpoint == "chat":
        create, base = client.chat.completions.create, {"messages": MESSAGES}
    else:
        create, base = client.completions.create, {"prompt": PROMPT}
    with pytest.raises(openai.BadRequestError) as error:
        create(model=MODEL, max_tokens=2, **base, **kwargs)
    assert error.value.param == field and field in error.value.message


def test_booleans_are_as_lenient_as_vllms(server: Server) -> None:
    """vLLM's request models are pydantic's lax mode: a boolean field takes "true", "no", 1
    (clients written against vLLM send them); other types stay strict."""
    from v1.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest

    body = {"prompt": PROMPT, "max_tokens": 2, "temperature": 0, "echo": "true",
            "skip_special_tokens": "yes", "ignore_eos": 1, "stream": "false"}
    response = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60)
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["text"].startswith(PROMPT)
    request = CompletionRequest(prompt="hi", echo="False", ignore_eos="on", stream=0)
    assert (request.echo, request.ignore_eos, request.stream) == (False, True, False)
    assert ChatCompletionRequest(messages=MESSAGES, include_reasoning="no").include_reasoning \
        is False
    # An unimplemented boolean is refused by its value, however it is spelled.
    ChatCompletionRequest(messages=MESSAGES, return_token_ids="false")
    with pytest.raises(ValueError, match="return_token_ids"):
        ChatCompletionRequest(messages=MESSAGES, return_token_ids="true")
    for field, value in (("stream", "maybe"), ("stream", 2), ("max_tokens", "5"), ("n", True)):
        with pytest.raises(ValueError, match=field):
            CompletionRequest(prompt="hi", **{field: value})


def test_batch_chat_completions(server: Server) -> None:
    """vLLM's /v1/chat/completions/batch, driven as its example script drives it: choice i
    is conversation i's answer (the single endpoint's, greedy), the usage their sum, the
    request's other fields (a regex constraint here) applied to each; n > 1 and streaming
    refused, as vLLM refuses them."""
    conversations = [[{"role": "user", "content": "Is the sky blue? Answer yes or no."}],
                     [{"role": "user", "content": "Is fire cold? Answer yes or no."}]]
    fields = {"model": MODEL, "max_tokens": 4, "temperature": 0,
              "structured_outputs": {"regex": "(yes|no)"}}
    batch = httpx.post(f"{server.url}/v1/chat/completions/batch",
                       json={**fields, "messages": conversations}, timeout=120)
    assert batch.status_code == 200, batch.text
    singles = [httpx.post(f"{server.url}/v1/chat/completions",
                          json={**fields, "messages": c}, timeout=120).json()
               for c in conversations]
    body = batch.json()
    assert body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-")
    assert [c["index"] for c in body["choices"]] == [0, 1]
    assert [c["message"] for c in body["choices"]] == [s["choices"][0]["message"]
                                                       for s in singles]
    assert {c["message"]["content"] for c in body["choices"]} <= {"yes", "no"}
    for key in ("prompt_tokens", "completion_tokens", "total_tokens"):
        assert body["usage"][key] == sum(s["usage"][key] for s in singles)
    for extra in ({"n": 2}, {"stream": True}, {"messages": [[]]}):
        r = httpx.post(f"{server.url}/v1/chat/completions/batch",
                       json={**fields, "messages": conversations, **extra}, timeout=60)
        assert r.status_code == 400, r.text


@pytest.mark.parametrize("limit", ["max_completion_prompts", "max_request_sequences"])
def test_batch_chat_conversations_are_bounded(limit: str) -> None:
    """Each conversation of a batch chat is a prompt and a sequence: over either limit, a
    ValueError (a 400) naming it, before any conversation starts."""
    from types import SimpleNamespace

    from v1.entrypoints.openai.protocol import BatchChatCompletionRequest
    from v1.entrypoints.openai.serving import ServerLimits
    from v1.entrypoints.openai.serving_chat_batch import create_batch_chat_completion

    serving = SimpleNamespace(limits=ServerLimits(**{limit: 2}))  # no engine: nothing starts
    request = BatchChatCompletionRequest(messages=[MESSAGES] * 3)
    with pytest.raises(ValueError, match=f"3 conversations, more than {limit} \\(2\\)"):
        asyncio.run(create_batch_chat_completion(serving, request))  # type: ignore[arg-type]


def test_best_of_equal_to_n_is_accepted(client: openai.OpenAI) -> None:
    """vLLM's benchmark clients send best_of=1 on every completion: no different output."""
    for n in (1, 2):
        completion = client.completions.create(
            model=MODEL, prompt=PROMPT, max_tokens=2, n=n, best_of=n
        )
        assert len(completion.choices) == n


PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}


def test_response_format_json_schema(client: openai.OpenAI) -> None:
    chat = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=80, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON}},
    )
    assert chat.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(chat.choices[0].message.content), PERSON)


def test_structured_outputs_extra_body_and_bad_formats(client: openai.OpenAI) -> None:
    choices = ["Rome", "Paris"]
    out = client.completions.create(
        model=MODEL, prompt="The capital of Italy is", max_tokens=5, temperature=0.9, n=3,
        seed=1, extra_body={"structured_outputs": {"choice": choices}},
    )
    assert all(c.text in choices for c in out.choices)
    for bad in (
        {"extra_body": {"response_format": {"type": "xml"}}},
        {"extra_body": {"response_format": {"type": "json_object"},
                        "structured_outputs": {"regex": "a"}}},
        {"extra_body": {"structured_outputs": {"regex": "(unclosed"}}},
    ):
        with pytest.raises(openai.BadRequestError):
            client.completions.create(model=MODEL, prompt="Hi", max_tokens=2, **bad)


def test_defaults_and_ignored_fields_are_accepted(server: Server, client: openai.OpenAI) -> None:
    """Unimplemented fields at their defaults change nothing, so they pass; fields that do not
    change the output (`user`) and unknown ones are ignored with a warning, as vLLM does."""
    kwargs = {"model": MODEL, "messages": MESSAGES, "max_tokens": 6, "temperature": 0}
    plain = client.chat.completions.create(**kwargs).choices[0].message.content
    at_defaults = client.chat.completions.create(
        **kwargs, presence_penalty=0, frequency_penalty=0.0, tool_choice="none", user="someone",
        extra_body={"repetition_penalty": 1.0, "add_generation_prompt": True,
                    "no_such_field": 1},
    )
    assert at_defaults.choices[0].message.content == plain
    wait_until(lambda: "['no_such_field', 'user']" in server.log.read_text())


def test_prompt_plus_max_tokens_over_max_model_len(client: openai.OpenAI) -> None:
    """A request that cannot get all the tokens it asks for is refused with both numbers, not
    cut short at max_model_len."""
    text = "hello " * 990
    requests = {
        "prompt": (client.completions.create, {"prompt": text}),
        "messages": (client.chat.completions.create,
                     {"messages": [{"role": "user", "content": text}]}),
    }
    for source, (create, body) in requests.items():
        num_prompt = create(model=MODEL, max_tokens=1, **body).usage.prompt_tokens
        room = MAX_MODEL_LEN - num_prompt
        assert room > 1, num_prompt
        full = create(model=MODEL, max_tokens=room, extra_body={"ignore_eos": True}, **body)
        assert full.usage.completion_tokens == room
        with pytest.raises(openai.BadRequestError) as error:
            create(model=MODEL, max_tokens=room + 1, **body)
        numbers = [MAX_MODEL_LEN, MAX_MODEL_LEN + 1, num_prompt, room + 1]
        assert all(str(n) in error.value.message for n in numbers), error.value.message
        assert source in error.value.message


def _post(body: dict[str, Any]) -> bytes:
    """A completion's POST as its bytes on the wire."""
    payload = json.dumps(body).encode()
    return (b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
            b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(payload)
            + payload)


@contextlib.contextmanager
def _posted_then_left(server: Server, body: dict[str, Any], pipelined: bool = False
                      ) -> Iterator[None]:
    """A completion POSTed on a raw connection (`pipelined`: a second request sent right
    after it on the same connection), closed (the client leaves without an answer) when the
    block ends."""
    with socket.create_connection(("127.0.0.1", server.port)) as conn:
        conn.sendall(_post(body) + (_post({**body, "max_tokens": 1}) if pipelined else b""))
        yield


def test_disconnect_aborts(server: Server) -> None:
    """A client that leaves mid-stream, or gives up waiting for a whole completion, has its
    request aborted: the engine stops generating and frees its blocks. Each on its own."""
    max_tokens = 1000  # ignore_eos: far more than either may generate once its client left
    body = {"prompt": PROMPT, "max_tokens": max_tokens, "ignore_eos": True}
    before = _metrics(server)
    with httpx.Client(base_url=server.url) as http:
        with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
            lines = r.iter_lines()
            assert next(lines).startswith("data: ")
            assert _metrics(server)["vllm:num_requests_running"] == 1
    after_stream = _wait_idle(server)
    # A whole completion answers only at its end: leave once it has begun to generate; then
    # again with a second request pipelined behind it (the close reached the queued one only,
    # and the first generated all its tokens for nobody, under uvicorn's httptools).
    ends = [before, after_stream]
    for pipelined in (False, True):
        with _posted_then_left(server, body, pipelined):
            generated = ends[-1]["vllm:generation_tokens_total"]
            _wait_for(server, lambda m, g=generated: m["vllm:generation_tokens_total"] > g)
        ends.append(_wait_idle(server))
    for start, end in zip(ends, ends[1:]):
        generated = end["vllm:generation_tokens_total"] - start["vllm:generation_tokens_total"]
        assert 0 < generated < max_tokens // 2


def raw_exchange(server: Server, request: bytes) -> tuple[str, dict]:
    """Send `request` as raw bytes, read the answer until the server closes; its status line
    and JSON body."""
    with socket.create_connection(("127.0.0.1", server.port), timeout=60) as conn:
        conn.sendall(request)
        answer = b""
        while chunk := conn.recv(65536):
            answer += chunk
    head, _, body = answer.partition(b"\r\n\r\n")
    assert b"content-type: application/json" in head.lower(), head
    return head.split(b"\r\n")[0].decode(), json.loads(body)


def test_request_headers_are_bounded(server: Server) -> None:
    """A request whose headers pass 16 KiB is answered with a 400 naming the limit, its
    connection closed (with no bound, 400 MB of them grew the frontend by 400 MB)."""
    request = b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n" + b"X-Pad: " + b"x" * 20_000
    status, body = raw_exchange(server, request)
    assert status == "HTTP/1.1 400 Bad Request"
    assert body["error"]["message"] == "the request's headers are over 16384 bytes (the limit)"


def test_an_unparsable_request_gets_a_json_400(server: Server) -> None:
    status, body = raw_exchange(server, b"NOT HTTP AT ALL\r\n\r\n")
    assert status == "HTTP/1.1 400 Bad Request"
    assert body["error"]["message"].startswith("invalid HTTP request: ")
    assert body["error"]["type"] == "BadRequestError" and body["error"]["code"] == 400
    assert httpx.get(f"{server.url}/health", timeout=60).status_code == 200


def test_pause_resume_and_reset_prefix_cache(server: Server, one_at_a_time: Server) -> None:
    """vLLM's development routes (VLLM_SERVER_DEV_MODE=1; else 404), as an RL trainer
    drives them around a weight update: /pause?mode=keep freezes a stream (no token while
    paused) and queues new requests (not refused; one whose client leaves meanwhile is
    aborted); /resume lets them finish. mode=wait answers once the request in flight has
    finished; the default mode aborts it (finish_reason "abort"). /reset_prefix_cache with
    a request running preempts it, and it still finishes."""
    assert httpx.post(f"{one_at_a_time.url}/pause").status_code == 404
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 24, "ignore_eos": True}
    http = httpx.Client(base_url=server.url, timeout=60)
    assert http.get("/is_paused").json() == {"is_paused": False}

    def stream(first: threading.Event) -> list[dict]:
        chunks = []
        with httpx.stream("POST", f"{server.url}/v1/completions", timeout=60,
                          json={**body, "stream": True}) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    chunks.append(json.loads(line[len("data: "):]))
                    first.set()
        return chunks

    def finish_reason(chunks: list[dict]) -> str:
        return chunks[-1]["choices"][0]["finish_reason"]

    def waiting(n: int) -> None:
        _wait_for(server, lambda m: m["vllm:num_requests_waiting"] == n)

    with ThreadPoolExecutor(2) as pool:
        first = threading.Event()
        streaming = pool.submit(stream, first)
        assert first.wait(60)
        r = http.post("/pause", params={"mode": "keep", "clear_cache": False})
        assert (r.status_code, r.json()) == (200, {"status": "paused"})
        assert http.get("/is_paused").json() == {"is_paused": True}
        queued = pool.submit(http.post, "/v1/completions", json=body)
        waiting(1)
        with _posted_then_left(server, body):
            waiting(2)
        waiting(1)  # its client left: aborted, paused as the engine is
        generated = _metrics(server)["vllm:generation_tokens_total"]
        time.sleep(0.3)
        assert _metrics(server)["vllm:generation_tokens_total"] == generated
        assert not streaming.done() and not queued.done()
        assert http.post("/resume").json() == {"status": "resumed"}
        assert finish_reason(streaming.result(60)) == "length"
        assert queued.result(60).json()["choices"][0]["finish_reason"] == "length"

        for mode, reason in (("wait", "length"), ("abort", "abort")):
            first = threading.Event()
            streaming = pool.submit(stream, first)
            assert first.wait(60)
            assert http.post("/pause", params={"mode": mode}).status_code == 200
            assert finish_reason(streaming.result(60)) == reason
            assert http.post("/resume").status_code == 200
        assert http.post("/pause", params={"mode": "sleep"}).status_code == 400

        preemptions = _metrics(server)["vllm:num_preemptions_total"]
        first = threading.Event()
        streaming = pool.submit(stream, first)
        assert first.wait(60)
        r = http.post("/reset_prefix_cache", params={"reset_running_requests": True})
        assert r.status_code == 200
        assert finish_reason(streaming.result(60)) == "length"
    assert _wait_idle(server)["vllm:num_preemptions_total"] == preemptions + 1


def test_resume_while_a_pause_drains_is_a_409() -> None:
    """/resume while a pause (mode "wait") still drains: the engine's refusal is a 409 with
    a JSON body (was a 500); a dead engine is still a dead engine."""
    from types import SimpleNamespace

    from v1.engine.exceptions import EngineDeadError
    from v1.entrypoints.openai.api_server import resume_generation

    def route_with(error: Exception) -> Any:
        async def refuse() -> None:
            raise error
        engine = SimpleNamespace(resume_generation=refuse)
        raw = SimpleNamespace(app=SimpleNamespace(state=SimpleNamespace(
            serving=SimpleNamespace(engine=engine))))
        return asyncio.run(resume_generation(raw))  # type: ignore[arg-type]

    response = route_with(RuntimeError("a pause is still in progress"))
    assert response.status_code == 409
    assert json.loads(response.body)["error"]["message"] == "a pause is still in progress"
    with pytest.raises(EngineDeadError):
        route_with(EngineDeadError("gone"))


def test_shutdown_stops_engine_and_frees_port(server: Server) -> None:
    """Last: SIGINT shuts the server down gracefully, engine process included."""
    children = _descendants(server.proc.pid)
    server.proc.send_signal(signal.SIGINT)
    assert server.proc.wait(timeout=120) == 0, server.log.read_text()
    wait_until(lambda: not any(Path(f"/proc/{pid}").exists() for pid in children))
    assert _port_is_free(server.port)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_while_the_model_loads_stops_the_server_at_once(
    sig: signal.Signals, default_model_path: Path, tmp_path: Path
) -> None:
    """docker stop (SIGTERM) or Ctrl-C while the engine starts (here, a hook makes it take
    30 s more): the server and its engine end within seconds, not once it has started."""
    started = tmp_path / "started"
    env = {**os.environ, "V1_ENGINE_CORE_HOOK": "tests.engine.engine_hooks:slow_start",
           "V1_TEST_HOOK_FILE": str(started)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "v1", "serve", "--model", str(default_model_path),
         "--port", str(free_port()), "--max-model-len", "256", "--num-gpu-blocks", "64"],
        env=env, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )
    try:
        wait_until(started.exists)
        children = _descendants(proc.pid)
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=PROMPTLY_S)
        assert proc.returncode != 0 and "KeyboardInterrupt" in err, err
        wait_until(lambda: not any(Path(f"/proc/{pid}").exists() for pid in children))
    finally:
        proc.kill()
        proc.wait()


@pytest.fixture(scope="module")
def one_at_a_time(
    default_model_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Server]:
    """A second server that runs one request at a time, by priority (test_real_engine_death
    kills its engine)."""
    log = tmp_path_factory.mktemp("openai_server_priority") / "server.log"
    with serve(
        default_model_path, log, "--scheduling-policy", "priority", "--max-num-seqs", "1",
        "--max-model-len", "512", "--num-gpu-blocks", "64",
    ) as server:
        yield server


def _wait_for(server: Server, condition: Any, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not condition(_metrics(server)):
        assert time.monotonic() < deadline, _metrics(server)
        time.sleep(0.02)


def test_priority_reaches_the_scheduler(one_at_a_time: Server) -> None:
    """Two requests wait behind a running one; the later one, with the better (lower)
    priority, runs first. Were priority dropped, first come would be first served."""
    server = one_at_a_time

    def body(priority: int, max_tokens: int) -> dict[str, Any]:
        return {"prompt": PROMPT, "max_tokens": max_tokens, "ignore_eos": True,
                "priority": priority}

    def complete(priority: int) -> float:
        response = httpx.post(f"{server.url}/v1/completions", json=body(priority, 4),
                              timeout=120)
        assert response.status_code == 200, response.text
        return time.monotonic()

    with ThreadPoolExecutor(2) as pool, httpx.Client(base_url=server.url, timeout=120) as http:
        # Runs until its stream is left (far longer than the others take to queue).
        with http.stream("POST", "/v1/completions", json={**body(0, 400), "stream": True}) as r:
            events = r.iter_lines()  # held: a dropped iterator closes the connection
            assert next(events).startswith("data: ")
            worse = pool.submit(complete, 10)
            _wait_for(server, lambda m: m["vllm:num_requests_waiting"] == 1)
            better = pool.submit(complete, 1)
            _wait_for(server, lambda m: m["vllm:num_requests_waiting"] == 2)
            assert _metrics(server)["vllm:num_requests_running"] == 1
        assert better.result() < worse.result()


def _engine_core_pid(server: Server) -> int:
    """The engine core: the server's child process (forked or spawned) that is not
    multiprocessing's resource tracker."""
    pids = [
        pid for pid in _descendants(server.proc.pid)
        if Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1]
        == str(server.proc.pid)
        and b"resource_tracker" not in Path(f"/proc/{pid}/cmdline").read_bytes()
    ]
    assert len(pids) == 1, pids
    return pids[0]


def test_real_engine_death(one_at_a_time: Server) -> None:
    """SIGKILL the real engine core behind the server: the streamed request in flight ends
    with an in-band 500 error, the one waiting gets a 500, so does the next one, and /health
    answers 503; the server itself stays up to say so."""
    server = one_at_a_time
    body = {"prompt": PROMPT, "max_tokens": 400, "ignore_eos": True}
    with ThreadPoolExecutor(1) as pool, httpx.Client(base_url=server.url, timeout=60) as http:
        with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as stream:
            events = stream.iter_lines()
            assert json.loads(next(events).removeprefix("data: "))["choices"]
            waiting = pool.submit(http.post, "/v1/completions", json=body)
            _wait_for(server, lambda m: m["vllm:num_requests_waiting"] == 1)
            os.kill(_engine_core_pid(server), signal.SIGKILL)
            rest = [e.removeprefix("data: ") for e in events if e]
        assert rest.pop() == "[DONE]"
        error = json.loads(rest[-1])["error"]
        assert error["code"] == 500 and "died" in error["message"], error
        for response in (waiting.result(), http.post("/v1/completions", json=body)):
            assert response.status_code == 500, response.text
            assert response.json()["error"]["type"] == "InternalServerError"
        assert http.get("/health").status_code == 503
    assert server.proc.poll() is None


def test_engine_death_answers_500_and_503(monkeypatch: pytest.MonkeyPatch) -> None:
    """An engine that dies after a request's first token: the request gets 500 (in-band,
    when streaming) and /health 503. A stand-in engine here: killing the real one would
    leave the module's server unusable."""
    from fastapi.testclient import TestClient

    from v1.config import EngineArgs
    from v1.engine.exceptions import EngineDeadError
    from v1.engine.processor import Processor
    from v1.entrypoints.openai import api_server
    from v1.outputs import CompletionOutput, RequestOutput

    class DyingEngine:
        model_name, max_model_len, model_dir = "dying", 64, "/nonexistent"
        dead_engines: dict[int, str] = {}  # AsyncLLM's: no data parallelism here
        processor = Processor(None, max_model_len, vocab_size=100, eos_token_id=None)

        def __init__(self) -> None:
            self.stat_loggers: list = []

        @classmethod
        def from_engine_args(cls, args: EngineArgs) -> "DyingEngine":
            return cls()

        async def generate(self, prompt, params, request_id, priority=0, dp_rank=None,
                           lora_request=None):
            first = CompletionOutput(0, "Hi", [5], None, None)
            yield RequestOutput(request_id, None, prompt, [first], finished=False)
            raise EngineDeadError("the engine core process died")

        async def check_health(self) -> None:
            raise EngineDeadError("the engine core process died")

        async def run_in_pool(self, fn, *args, **kwargs):  # AsyncLLM's, here on the loop
            return fn(*args, **kwargs)

        def shutdown(self) -> None:
            pass

    monkeypatch.setattr(api_server, "AsyncLLM", DyingEngine)
    with TestClient(api_server.build_app(EngineArgs())) as http:
        assert http.get("/health").status_code == 503
        body = {"prompt": [1, 2], "max_tokens": 2}
        response = http.post("/v1/completions", json=body)
        assert response.status_code == 500
        assert response.json()["error"]["type"] == "InternalServerError"
        events = http.post("/v1/completions", json={**body, "stream": True}).text.split("\n\n")
        assert json.loads(events[0].removeprefix("data: "))["choices"][0]["text"] == "Hi"
        assert json.loads(events[1].removeprefix("data: "))["error"]["code"] == 500
        assert events[2:] == ["data: [DONE]", ""]
