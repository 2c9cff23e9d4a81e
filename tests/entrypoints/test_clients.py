"""The clients vLLM's users point at a server, against ours (the shared server of
tests/entrypoints/conftest.py, which serves as MODEL with hermes tool calling): LangChain's
`ChatOpenAI`, litellm's openai provider and guidellm's benchmark CLI, each as it sends its
requests by default. Offline: nothing may phone home (tracing, cost maps, hub look-ups)."""

import functools
import json
import operator
import os
import subprocess
import sys
from pathlib import Path

import openai
import pytest

from tests.entrypoints.test_openai_server import MODEL

pytestmark = [pytest.mark.model, pytest.mark.slow]

# What keeps these libraries off the network (tracing, telemetry, litellm's price list, the
# Hugging Face hub); set before they are imported, and passed to guidellm's processes.
OFFLINE_ENV = {
    "LANGSMITH_TRACING": "false",
    "LANGCHAIN_TRACING_V2": "false",
    "LITELLM_LOCAL_MODEL_COST_MAP": "True",
    "LITELLM_TELEMETRY": "False",
    "HF_HUB_OFFLINE": "1",
    "HF_DATASETS_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "DO_NOT_TRACK": "1",
}


@pytest.fixture
def offline(monkeypatch: pytest.MonkeyPatch) -> None:
    for key, value in OFFLINE_ENV.items():
        monkeypatch.setenv(key, value)


@pytest.fixture
def base_url(extras_client: openai.OpenAI) -> str:
    return str(extras_client.base_url).rstrip("/")


def test_langchain_chat_openai(offline: None, base_url: str) -> None:
    langchain_openai = pytest.importorskip("langchain_openai")
    from langchain_core.messages import HumanMessage, SystemMessage, ToolMessage
    from langchain_core.tools import tool
    from pydantic import BaseModel, Field

    llm = langchain_openai.ChatOpenAI(
        model=MODEL, base_url=base_url, api_key="x", max_tokens=12, temperature=0,
        max_retries=0, stream_usage=True,
    )
    whole = llm.invoke("Name three colors.")
    assert whole.content and whole.usage_metadata["output_tokens"] > 0
    chunks = list(llm.stream("Name three colors."))
    streamed = functools.reduce(operator.add, chunks)
    assert streamed.content == whole.content
    counts = ("input_tokens", "output_tokens", "total_tokens")  # the usage chunk's
    assert [streamed.usage_metadata[k] for k in counts] == [whole.usage_metadata[k] for k in counts]

    class City(BaseModel):
        name: str = Field(max_length=20)
        country: str = Field(max_length=20)

    prompt = "Name a city in France."
    for method in ("json_schema", "function_calling"):  # response_format, a named tool
        city = llm.with_structured_output(City, method=method).bind(max_tokens=40).invoke(prompt)
        assert isinstance(city, City), method

    @tool
    def get_weather(city: str) -> str:
        """The weather in a city."""
        return "sunny"

    # A forced tool, then its result back in the conversation (a named user, as agent
    # frameworks send: `name` goes to the chat template).
    messages = [SystemMessage("You are helpful."),
                HumanMessage("What is the weather in Paris?", name="alice")]
    call = llm.bind_tools([get_weather], tool_choice="get_weather").invoke(messages)
    [tool_call] = call.tool_calls
    assert tool_call["name"] == "get_weather" and isinstance(tool_call["args"]["city"], str)
    messages += [call, ToolMessage("sunny", tool_call_id=tool_call["id"])]
    assert llm.bind_tools([get_weather]).invoke(messages).content


def test_litellm_openai_provider(offline: None, base_url: str) -> None:
    litellm = pytest.importorskip("litellm")
    kwargs = dict(
        model=f"openai/{MODEL}", api_base=base_url, api_key="x", max_tokens=8, temperature=0
    )
    messages = [{"role": "user", "content": "Name three colors."}]
    whole = litellm.completion(messages=messages, **kwargs)
    text = whole.choices[0].message.content
    assert text and whole.usage.completion_tokens > 0
    chunks = list(litellm.completion(
        messages=messages, stream=True, stream_options={"include_usage": True}, **kwargs
    ))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    completion = litellm.text_completion(prompt="The capital of France is", **kwargs)
    assert completion.choices[0].text


def test_guidellm_concurrent_run(
    offline: None, base_url: str, default_model_path: Path, tmp_path: Path
) -> None:
    """A short concurrent benchmark through guidellm's own CLI: every request succeeds
    (its chat requests ask for continuous_usage_stats, which once got a 400)."""
    pytest.importorskip("guidellm")
    from v1.models.gguf_cache import convert_gguf

    tokenizer_dir = convert_gguf(default_model_path)  # the server's: local tokenizer files
    num_requests, output_tokens = 8, 4
    report = tmp_path / "guidellm.json"
    env = {
        **os.environ,
        "GUIDELLM__MAX_WORKER_PROCESSES": "1",  # one process is enough for 4 streams
        "GUIDELLM__LOGGING__LOG_FILE": str(tmp_path / "guidellm.log"),
    }
    target = base_url.removesuffix("/v1")
    run = subprocess.run(
        [
            sys.executable, "-m", "guidellm", "run",
            "--backend", f"kind=openai_http,target={target},model={MODEL}",
            "--profile", "kind=concurrent,streams=4",
            "--constraint", f"kind=max_requests,count={num_requests}",
            "--data", f"kind=synthetic_text,prompt_tokens=16,output_tokens={output_tokens}",
            "--tokenizer", f"kind=huggingface_auto,model={tokenizer_dir}",
            "--output", f"kind=json,path={report}",
            "--disable-console",
        ],
        env=env, cwd=tmp_path, capture_output=True, text=True, timeout=600,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    [benchmark] = json.loads(report.read_text())["benchmarks"]
    requests = benchmark["requests"]
    assert (len(requests["errored"]), len(requests["incomplete"])) == (0, 0), requests["errored"]
    assert len(requests["successful"]) == num_requests
    for request in requests["successful"]:
        body = json.loads(request["request_args"])["body"]
        assert body["stream_options"]["continuous_usage_stats"] is True
        assert request["output_metrics"]["text_tokens"] == output_tokens


def test_message_name_reaches_the_chat_template() -> None:
    from v1.entrypoints.openai.protocol import ChatMessage

    message = ChatMessage(role="user", content="hi", name="alice")
    assert message.to_template_dict() == {"role": "user", "content": "hi", "name": "alice"}
