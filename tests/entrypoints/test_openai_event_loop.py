"""The server's event loop only routes: while one request's input processing is stuck (a
tokenizer whose `encode` waits for the test to let it go), `/health` answers and another user's
stream gets every chunk. The whole app runs in this process, on uvicorn in a thread, so that
the test knows when the stuck request is being processed; ordering is asserted, not timing."""

import json
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any, NamedTuple

import httpx
import pytest
import uvicorn

from tests.engine.mp_utils import SMALL_ENGINE
from v1.config import EngineArgs
from v1.engine.async_llm import AsyncLLM
from v1.entrypoints.openai.api_server import build_app

pytestmark = [pytest.mark.model, pytest.mark.slow]

MARKER = "zqx-stuck-request"  # text holding it tokenizes only once the test releases it
# Generous: /health answers in milliseconds and 16 tokens stream in about a second here.
TIMEOUT = 30.0


class StuckTokenizer:
    """The model's tokenizer, except that `encode` of a text holding MARKER signals `entered`
    and waits for `release`: a request whose input processing lasts as long as the test wants.
    The other tokenizer methods (chat templates, decoding) are the model's."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self.entered = threading.Event()
        self.release = threading.Event()

    def encode(self, text: str, *args: Any, **kwargs: Any) -> list[int]:
        if MARKER in text:
            self.entered.set()
            self.release.wait(10 * TIMEOUT)  # the test sets it; this only bounds a broken run
        return self._tokenizer.encode(text, *args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._tokenizer, name)


class InProcessServer(NamedTuple):
    url: str
    tokenizer: StuckTokenizer


@pytest.fixture(scope="module")
def server(default_model_path: Any) -> Iterator[InProcessServer]:
    """The real app (`build_app`) on uvicorn in a thread, its engine's input tokenizer (the
    frontend's; the engine core's detokenizer is its own) a StuckTokenizer."""
    start_engine = AsyncLLM.from_engine_args
    tokenizers: list[StuckTokenizer] = []

    def stuck_engine(args: EngineArgs) -> AsyncLLM:
        engine = start_engine(args)
        tokenizers.append(StuckTokenizer(engine.tokenizer))
        engine.tokenizer = engine.processor.tokenizer = tokenizers[0]
        return engine

    app = build_app(EngineArgs(**SMALL_ENGINE))
    uv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning"))
    with pytest.MonkeyPatch.context() as patch:  # for the app's start (its lifespan) only
        patch.setattr(AsyncLLM, "from_engine_args", stuck_engine)
        thread = threading.Thread(target=uv.run, name="uvicorn", daemon=True)
        thread.start()
        for _ in range(int(10 * TIMEOUT / 0.1)):
            if uv.started or not thread.is_alive():
                break
            time.sleep(0.1)
    assert uv.started, "the in-process server did not start"
    port = uv.servers[0].sockets[0].getsockname()[1]
    try:
        yield InProcessServer(f"http://127.0.0.1:{port}", tokenizers[0])
    finally:
        tokenizers[0].release.set()
        uv.should_exit = True  # the lifespan's end shuts the engine down
        thread.join(TIMEOUT)


def stream_completion(url: str) -> tuple[int, int]:
    """Another user's streamed 16-token completion: its chunks with text, and its tokens."""
    payload = {
        "prompt": "The capital of France is", "max_tokens": 16, "temperature": 0,
        "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True},
    }
    chunks, tokens = 0, 0
    with httpx.stream("POST", f"{url}/v1/completions", json=payload, timeout=TIMEOUT) as resp:
        assert resp.status_code == 200
        for line in resp.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            assert "error" not in chunk, chunk
            chunks += any(c["text"] for c in chunk["choices"])
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
    return chunks, tokens


# Each stuck in a different place: the completion's and the chat's prompt (serving tokenizes
# them), /tokenize, and `bad_words` (tokenized by the processor in AsyncLLM.generate).
STUCK_REQUESTS = {
    "completion": ("/v1/completions", {"prompt": f"Say {MARKER}", "max_tokens": 2}),
    "chat": (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": f"Say {MARKER}"}], "max_tokens": 2},
    ),
    "tokenize": ("/tokenize", {"prompt": f"Say {MARKER}"}),
    "bad_words": ("/v1/completions", {"prompt": "Hi", "max_tokens": 2, "bad_words": [MARKER]}),
}


@pytest.mark.parametrize("kind", STUCK_REQUESTS)
def test_a_stuck_request_stalls_no_one(server: InProcessServer, kind: str) -> None:
    path, body = STUCK_REQUESTS[kind]
    tokenizer = server.tokenizer
    tokenizer.entered.clear()
    tokenizer.release.clear()
    with ThreadPoolExecutor(1) as client:
        stuck = client.submit(httpx.post, server.url + path, json=body, timeout=3 * TIMEOUT)
        try:
            assert tokenizer.entered.wait(TIMEOUT), "the request never reached the tokenizer"
            # All of this happens while the request is being processed (its encode waits).
            assert httpx.get(f"{server.url}/health", timeout=TIMEOUT).status_code == 200
            chunks, tokens = stream_completion(server.url)
            assert tokens == 16 and chunks > 1
            assert not stuck.done()
        finally:
            tokenizer.release.set()
        response = stuck.result()
    assert response.status_code == 200, response.text
