"""vLLM's server features beyond OpenAI's API, end to end on one real `python -m v1 serve`
process: the model as a positional argument, --api-key, --chat-template and the request's
template options, batched completion prompts, cache_salt, /tokenize, /detokenize, /version
and vLLM's engine-option spellings."""

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from tests.entrypoints.test_llm_chat import TEMPLATE
from tests.entrypoints.test_openai_server import Server, free_port, wait_healthy

pytestmark = [pytest.mark.model, pytest.mark.slow]

API_KEY = "sk-fidelity"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
MAX_MODEL_LEN = 1024
QUESTION = {"role": "user", "content": "What color is the sky?"}
RENDERED = "<|im_start|>user\nWhat color is the sky?<|im_end|>\n<|im_start|>assistant\n"


@pytest.fixture(scope="module")
def server(default_model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    tmp = tmp_path_factory.mktemp("openai_fidelity")
    template, log = tmp / "template.jinja", tmp / "server.log"
    template.write_text(TEMPLATE)
    port = free_port()
    cmd = [
        sys.executable, "-m", "v1", "serve", str(default_model_path), "--port", str(port),
        "--api-key", API_KEY, "--chat-template", str(template),
        "--max-model-len", str(MAX_MODEL_LEN), "--num-gpu-blocks-override", "256",
        "--gpu-memory-utilization", "0.5", "--uvicorn-log-level", "warning",
    ]
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
    try:
        wait_healthy(proc, f"http://127.0.0.1:{port}", log)
        yield Server(proc, port, log)
    finally:
        proc.kill()
        proc.wait()


@pytest.fixture(scope="module")
def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0)


@pytest.fixture(scope="module")
def http(server: Server) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, timeout=60) as http:
        yield http


def test_positional_model_is_served(client: openai.OpenAI, default_model_path: Path) -> None:
    # Served under its file's name, as with --model (no model: SmolLM2-135M-Instruct).
    assert [card.id for card in client.models.list().data] == [default_model_path.stem]
    # Two different models are an error, before anything loads.
    both = subprocess.run(
        [sys.executable, "-m", "v1", "serve", "a", "--model", "b"], capture_output=True,
        text=True, timeout=60,
    )
    assert both.returncode == 2 and "two models given" in both.stderr


def test_api_key(server: Server, http: httpx.Client) -> None:
    """/v1 needs the key (401 with an error body otherwise, as vLLM); the rest stays open."""
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY}):
        response = http.get("/v1/models", headers=headers)
        assert response.status_code == 401
        assert response.json()["error"]["code"] == 401
    assert http.get("/v1/models", headers=AUTH).status_code == 200
    assert http.get("/health").status_code == 200
    wrong = openai.OpenAI(base_url=f"{server.url}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        wrong.completions.create(model=None, prompt="Hi", max_tokens=1)  # type: ignore[arg-type]


def rendered(http: httpx.Client, **body) -> str:
    """The conversation as the server renders it: /tokenize, then /detokenize."""
    tokens = http.post("/tokenize", json={"messages": [QUESTION], **body})
    assert tokens.status_code == 200, tokens.text
    text = http.post("/detokenize", json={"tokens": tokens.json()["tokens"]})
    assert text.status_code == 200, text.text
    return text.json()["prompt"]


def test_chat_template_options(http: httpx.Client) -> None:
    assert rendered(http) == RENDERED  # --chat-template's, not the model's (a system prompt)
    assert rendered(http, add_generation_prompt=False) == RENDERED.removesuffix(
        "<|im_start|>assistant\n")
    assert rendered(http, chat_template_kwargs={"prefill": "Blue"}) == RENDERED + "Blue"
    continued = rendered(
        http, messages=[QUESTION, {"role": "assistant", "content": "The sky is"}],
        add_generation_prompt=False, continue_final_message=True,
    )
    assert continued == RENDERED + "The sky is"
    both = http.post(
        "/tokenize", json={"messages": [QUESTION], "continue_final_message": True}
    )
    assert both.status_code == 400 and "continue_final_message" in both.json()["error"]["message"]


def test_chat_completion_uses_the_template_options(
    client: openai.OpenAI, http: httpx.Client
) -> None:
    options = {"chat_template_kwargs": {"prefill": "The sky is"}}
    expected = http.post("/tokenize", json={"messages": [QUESTION], **options}).json()
    chat = client.chat.completions.create(
        model=None, messages=[QUESTION], max_tokens=1, extra_body=options,  # type: ignore
    )
    assert chat.usage.prompt_tokens == expected["count"] == len(expected["tokens"])


def test_tokenize_detokenize_version(http: httpx.Client, client: openai.OpenAI) -> None:
    tokens = http.post("/tokenize", json={"prompt": "Hello world"}).json()
    assert tokens["count"] == len(tokens["tokens"]) > 0
    assert tokens["max_model_len"] == MAX_MODEL_LEN
    completion = client.completions.create(model=None, prompt="Hello world", max_tokens=1)  # type: ignore
    assert completion.usage.prompt_tokens == tokens["count"]
    assert http.post("/detokenize", json={"tokens": tokens["tokens"]}).json() == {
        "prompt": "Hello world"
    }
    assert http.post("/detokenize", json={"tokens": [10**7]}).status_code == 400
    assert http.get("/version").json() == {"version": "0.1.0"}


def test_several_prompts_in_one_completion(client: openai.OpenAI) -> None:
    """Each prompt gets n choices, numbered prompt by prompt, as vLLM; usage sums them."""
    prompts = ["The capital of France is", "1, 2, 3,"]
    kwargs = {"model": None, "max_tokens": 4, "temperature": 0}
    alone = [client.completions.create(prompt=p, **kwargs) for p in prompts]  # type: ignore
    batch = client.completions.create(prompt=prompts, n=2, **kwargs)  # type: ignore
    assert [c.index for c in batch.choices] == [0, 1, 2, 3]
    assert [c.text for c in batch.choices] == [a.choices[0].text for a in alone for _ in "ab"]
    assert batch.usage.prompt_tokens == sum(a.usage.prompt_tokens for a in alone)
    assert batch.usage.completion_tokens == 16
    stream = client.completions.create(prompt=prompts, stream=True, **kwargs)  # type: ignore
    texts = ["", ""]
    for chunk in stream:
        for choice in chunk.choices:
            texts[choice.index] += choice.text
    assert texts == [a.choices[0].text for a in alone]


def test_cache_salt(client: openai.OpenAI) -> None:
    """Only requests with the same salt (or none) share prefix-cache blocks."""
    prompt = "Salted prompt, long enough to fill a few KV blocks: " + "one two three " * 20

    def cached(salt: str | None) -> int:
        body = {} if salt is None else {"cache_salt": salt}
        completion = client.completions.create(
            model=None, prompt=prompt, max_tokens=1, extra_body=body,  # type: ignore
        )
        return completion.usage.prompt_tokens_details.cached_tokens

    cached(None)
    assert cached(None) > 0
    assert cached("alice") == 0
    assert cached("alice") > 0
    assert cached("bob") == 0
    with pytest.raises(openai.BadRequestError, match="cache_salt"):
        cached("")
