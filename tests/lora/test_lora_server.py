"""LoRA on the OpenAI server: `--enable-lora --lora-modules`, adapters listed by /v1/models
and picked by `model`, vLLM's /v1/load_lora_adapter and /v1/unload_lora_adapter; greedy
tokens equal transformers + peft's merged models'."""

import json

import httpx
import openai
import pytest

from tests.entrypoints.test_openai_server import serve
from tests.lora.conftest import LoRAFixture
from tests.lora.test_lora import PROMPTS, N

pytestmark = pytest.mark.slow


def _complete(client: openai.OpenAI, model: str, prompt: list[int]) -> tuple[str, list[str]]:
    out = client.completions.create(
        model=model, prompt=prompt, max_tokens=N, temperature=0.0,
        extra_body={"ignore_eos": True},
    )
    return out.model, out.choices[0].text.split()


def test_server_serves_adapters_by_name(lora_fixture: LoRAFixture, tmp_path, monkeypatch):
    from transformers import AutoTokenizer

    monkeypatch.setenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "1")
    fx = lora_fixture
    root = tmp_path / "adapters"
    (root / "empty").mkdir(parents=True)
    a1, a2 = (str(d) for d in fx.adapter_dirs)
    tokenizer = AutoTokenizer.from_pretrained(fx.base_dir)

    def want(which: int | None, prompt: list[int]) -> list[str]:
        return tokenizer.decode(fx.greedy(which, prompt, N)).split()  # words: w<id>

    with serve(
        fx.base_dir, tmp_path / "server.log", "--served-model-name", "base", "--enable-lora",
        "--max-loras", "2", "--max-lora-rank", "8", "--num-gpu-blocks", "128",
        "--block-size", "4", "--lora-root", str(root), "--lora-modules", f"a1={a1}",
        json.dumps({"name": "a2", "path": a2, "base_model_name": "base"}),
    ) as server:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0)
        cards = {m.id: m for m in client.models.list().data}
        assert set(cards) == {"base", "a1", "a2"}
        assert cards["a1"].parent == "base" and cards["a1"].root == a1
        assert cards["base"].parent is None

        prompt = PROMPTS[0]
        for model, which in (("a1", 0), ("a2", 1), ("base", None)):
            assert _complete(client, model, prompt) == (model, want(which, prompt))
        with pytest.raises(openai.NotFoundError, match="The model `a3` does not exist"):
            _complete(client, "a3", prompt)

        http = httpx.Client(base_url=server.url, timeout=60)
        r = http.post("/v1/load_lora_adapter", json={"lora_name": "a3", "lora_path": a2})
        assert r.status_code == 200, r.text
        assert _complete(client, "a3", prompt) == ("a3", want(1, prompt))
        assert "a3" in {m.id for m in client.models.list().data}
        # Errors: a taken name, a folder that is no adapter, a body that is not vLLM's.
        for body, message in (
            ({"lora_name": "a3", "lora_path": a2}, "has already been loaded"),
            ({"lora_name": "bad", "lora_path": str(root / "empty")}, "no adapter_config.json"),
            ({"lora_name": "out", "lora_path": str(tmp_path)}, "inside the server's LoRA"),
            ({"lora_name": "x"}, "lora_path"),
        ):
            r = http.post("/v1/load_lora_adapter", json=body)
            assert r.status_code == 400, r.text
            assert message in r.json()["error"]["message"]
        r = http.post("/v1/unload_lora_adapter", json={"lora_name": "a3"})
        assert r.status_code == 200, r.text
        assert "a3" not in {m.id for m in client.models.list().data}
        with pytest.raises(openai.NotFoundError):
            _complete(client, "a3", prompt)
        r = http.post("/v1/unload_lora_adapter", json={"lora_name": "a3"})
        assert r.status_code == 404 and "a3" in r.json()["error"]["message"]
        # The adapters still serve after all that.
        assert _complete(client, "a1", PROMPTS[1]) == ("a1", want(0, PROMPTS[1]))


def test_runtime_lora_routes_are_off_by_default(lora_fixture: LoRAFixture, tmp_path, monkeypatch):
    """Without VLLM_ALLOW_RUNTIME_LORA_UPDATING no client can load or unload an adapter
    (404, as a route the server does not have); --lora-modules still serve."""
    monkeypatch.delenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", raising=False)
    fx = lora_fixture
    a1, a2 = (str(d) for d in fx.adapter_dirs)
    with serve(
        fx.base_dir, tmp_path / "server.log", "--served-model-name", "base", "--enable-lora",
        "--max-lora-rank", "8", "--num-gpu-blocks", "64", "--block-size", "4",
        "--lora-modules", f"a1={a1}",
    ) as server:
        http = httpx.Client(base_url=server.url, timeout=60)
        r = http.post("/v1/load_lora_adapter", json={"lora_name": "a2", "lora_path": a2})
        assert r.status_code == 404, r.text
        r = http.post("/v1/unload_lora_adapter", json={"lora_name": "a1"})
        assert r.status_code == 404, r.text
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0)
        assert {m.id for m in client.models.list().data} == {"base", "a1"}
        assert _complete(client, "a1", PROMPTS[0])[0] == "a1"
