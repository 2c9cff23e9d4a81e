"""The pooling endpoints of `python -m v1 serve --runner pooling`, on the tiny Qwen3
sentence-transformers folder: /v1/embeddings through the openai client (float and base64,
dimensions, many inputs at once), vLLM's /pooling, /score and /rerank, and 400s for bad
input; the same routes on a generating server answer 400.
"""

import asyncio
import base64
import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest
import torch

from tests.entrypoints.test_openai_server import serve
from tests.pooling.st_models import qwen3_config, save_sentence_transformer, word_tokenizer
from tests.pooling.test_embed import cosine, st_encode

pytest.importorskip("sentence_transformers")

TEXTS = ["w1 w2 w3", "w4 w5", "w6 " * 40 + "w7", "w8", "w9 w10 w11 w12", "w1 w2 w3"]
# The messages' contents one after another; the generation prompt is w199 (id 204).
CHAT_TEMPLATE = ("{% for m in messages %}{{ m.content }} {% endfor %}"
                 "{% if add_generation_prompt %}w199{% endif %}")


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    from transformers import Qwen3Model

    folder = tmp_path_factory.mktemp("st") / "qwen3"
    save_sentence_transformer(folder, lambda: Qwen3Model(qwen3_config()),
                              word_tokenizer("$A <eos>"), "lasttoken", True)
    config = json.loads((folder / "config.json").read_text())
    config["matryoshka_dimensions"] = [16, 64]
    (folder / "config.json").write_text(json.dumps(config))
    return folder


@pytest.fixture(scope="module")
def server(folder: Path, tmp_path_factory) -> Iterator[str]:
    log = tmp_path_factory.mktemp("pooling_server") / "server.log"
    with serve(folder, log, "--runner", "pooling", "--served-model-name", "emb",
               "--max-model-len", "128", "--num-gpu-blocks", "64",
               "--max-num-batched-tokens", "32", "--chat-template", CHAT_TEMPLATE) as server:
        yield server.url


@pytest.fixture(scope="module")
def client(server: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server}/v1", api_key="x", max_retries=0)


def test_embeddings_float_and_base64_match_sentence_transformers(client, folder):
    ref = st_encode(folder, TEXTS)
    as_float = client.embeddings.create(model="emb", input=TEXTS, encoding_format="float")
    # The openai client asks for base64 by default and decodes it.
    as_base64 = client.embeddings.create(model="emb", input=TEXTS)
    for response in (as_float, as_base64):
        got = np.array([d.embedding for d in response.data])
        assert [d.index for d in response.data] == list(range(len(TEXTS)))
        assert cosine(got, ref).min() >= 0.999
    np.testing.assert_allclose(
        np.array([d.embedding for d in as_base64.data]),
        np.array([d.embedding for d in as_float.data]), rtol=1e-6, atol=1e-7,
    )
    assert as_float.model == "emb" and as_float.object == "list"
    assert as_float.usage.prompt_tokens == sum(len(t.split()) + 1 for t in TEXTS)
    assert as_float.usage.total_tokens == as_float.usage.prompt_tokens


def test_raw_base64_and_dimensions(server, folder):
    body = {"model": "emb", "input": "w1 w2", "encoding_format": "base64", "dimensions": 16}
    r = httpx.post(f"{server}/v1/embeddings", json=body, timeout=60)
    assert r.status_code == 200, r.text
    vec = np.frombuffer(base64.b64decode(r.json()["data"][0]["embedding"]), dtype="<f4")
    full = st_encode(folder, ["w1 w2"])[0][:16]
    np.testing.assert_allclose(vec, full / np.linalg.norm(full), rtol=1e-4, atol=1e-5)
    # Token ids as input, one prompt and several.
    ids = {"model": "emb", "input": [[6, 7, 4], [8, 4]], "encoding_format": "float"}
    r = httpx.post(f"{server}/v1/embeddings", json=ids, timeout=60)
    assert r.status_code == 200 and len(r.json()["data"]) == 2


def _client_decode(binary: bytes, embed_dtype: str, endianness: str) -> np.ndarray:
    """What a client does with the bytes it asked for, written here from the formats'
    definitions (IEEE halves, bfloat16 as float32's high half, fp8 as one byte each)."""
    order = {"little": "<", "big": ">", "native": "="}[endianness]
    if embed_dtype == "float32":
        return np.frombuffer(binary, dtype=f"{order}f4").astype(np.float64)
    if embed_dtype == "float16":
        return np.frombuffer(binary, dtype=f"{order}f2").astype(np.float64)
    if embed_dtype == "bfloat16":
        halves = np.frombuffer(binary, dtype=f"{order}u2").astype(np.uint32)
        return (halves << 16).view(np.float32).astype(np.float64)
    fp8 = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}[embed_dtype]
    return torch.frombuffer(bytearray(binary), dtype=torch.uint8).view(fp8).double().numpy()


EMBED_DTYPES = ("float32", "float16", "bfloat16", "fp8_e4m3", "fp8_e5m2")


def test_embed_dtype_and_endianness_are_what_the_bytes_hold(client):
    """vLLM's `embed_dtype` and `endianness`: the base64 a client decodes with the dtype and
    byte order it asked for is the float answer rounded to that dtype (it was float32 whatever
    was asked: a client asking float16 decoded garbage)."""
    texts = ["w1 w2 w3", "w4 w5"]
    floats = [d.embedding for d in client.embeddings.create(
        model="emb", input=texts, encoding_format="float").data]
    for embed_dtype in EMBED_DTYPES:
        dtype = getattr(torch, embed_dtype.replace("fp8_e4m3", "float8_e4m3fn")
                        .replace("fp8_e5m2", "float8_e5m2"))
        expected = [torch.tensor(f).to(dtype).double().numpy() for f in floats]
        for endianness in ("native", "big", "little"):
            response = client.embeddings.create(
                model="emb", input=texts, encoding_format="base64",
                extra_body={"embed_dtype": embed_dtype, "endianness": endianness})
            for data, want in zip(response.data, expected, strict=True):
                got = _client_decode(base64.b64decode(data.embedding), embed_dtype, endianness)
                np.testing.assert_array_equal(got, want, err_msg=f"{embed_dtype} {endianness}")


def test_bytes_encoding_is_the_raw_vectors_with_metadata(server):
    """vLLM's `encoding_format: "bytes"`: the vectors back to back, described by a JSON
    `metadata` header (each one's dtype, byte order, byte range and shape); "bytes_only" is
    the same body without it."""
    texts = ["w1 w2 w3", "w4 w5", "w6"]
    floats = httpx.post(f"{server}/v1/embeddings", json={
        "model": "emb", "input": texts, "encoding_format": "float"}, timeout=60).json()
    body = {"model": "emb", "input": texts, "encoding_format": "bytes",
            "embed_dtype": "float16", "endianness": "big"}
    r = httpx.post(f"{server}/v1/embeddings", json=body, timeout=60)
    assert r.status_code == 200, r.text
    assert r.headers["content-type"] == "application/octet-stream"
    metadata = json.loads(r.headers["metadata"])
    assert metadata["model"] == "emb" and metadata["id"].startswith("embd-")
    assert metadata["usage"] == {"prompt_tokens": floats["usage"]["prompt_tokens"],
                                 "total_tokens": floats["usage"]["total_tokens"]}
    size = len(floats["data"][0]["embedding"])
    assert [(m["index"], m["embed_dtype"], m["endianness"], m["start"], m["end"], m["shape"])
            for m in metadata["data"]] == [
        (i, "float16", "big", 2 * size * i, 2 * size * (i + 1), [size]) for i in range(3)]
    for m, data in zip(metadata["data"], floats["data"], strict=True):
        got = _client_decode(r.content[m["start"]:m["end"]], "float16", "big")
        want = torch.tensor(data["embedding"]).half().double().numpy()
        np.testing.assert_array_equal(got, want)
    only = httpx.post(f"{server}/v1/embeddings",
                      json={**body, "encoding_format": "bytes_only"}, timeout=60)
    assert only.status_code == 200 and "metadata" not in only.headers
    assert only.content == r.content


def test_vllm_embedding_bytes_clients(server):
    """vLLM's two example clients of embed_dtype (embedding_requests_base64_online.py and
    embedding_requests_bytes_online.py), as they run: every dtype and byte order, decoded
    with vLLM's helpers at vLLM's paths (`vllm` read as `v1`); "bytes_only" read with the
    layout the client builds itself. Each decodes to the float answer in that dtype."""
    import requests

    from v1.entrypoints.pooling.utils import (
        MetadataItem,
        build_metadata_items,
        decode_pooling_output,
    )
    from v1.utils.serial_utils import EMBED_DTYPES, ENDIANNESS, binary2tensor

    model = requests.get(f"{server}/v1/models", timeout=60).json()["data"][0]["id"]
    texts = ["w1 w2 w3 w4"] * 2
    url = f"{server}/v1/embeddings"
    floats = torch.tensor([d["embedding"] for d in requests.post(
        url, json={"model": model, "input": texts}, timeout=60).json()["data"]])
    for embed_dtype, info in EMBED_DTYPES.items():
        expected = floats.to(info.torch_dtype).float()
        for endianness in ENDIANNESS:
            body = {"model": model, "input": texts, "embed_dtype": embed_dtype,
                    "endianness": endianness}
            data = requests.post(url, json={**body, "encoding_format": "base64"},
                                 timeout=60).json()["data"]
            got = torch.stack([binary2tensor(base64.b64decode(d["embedding"]), (-1,),
                                             embed_dtype, endianness).float() for d in data])
            assert torch.equal(got, expected), (embed_dtype, endianness)
            response = requests.post(url, json={**body, "encoding_format": "bytes"}, timeout=60)
            items = [MetadataItem(**x) for x in json.loads(response.headers["metadata"])["data"]]
            got = torch.stack(decode_pooling_output(items, response.content)).float()
            assert torch.equal(got, expected), (embed_dtype, endianness)
            response = requests.post(url, json={**body, "encoding_format": "bytes_only"},
                                     timeout=60)
            items = build_metadata_items(embed_dtype, endianness, (floats.shape[1],), len(texts))
            got = torch.stack(decode_pooling_output(items, response.content)).float()
            assert torch.equal(got, expected), (embed_dtype, endianness)


@pytest.mark.parametrize("body, message", [
    ({"input": "w1", "dimensions": 20}, "only supports"),
    ({"input": "w1", "dimensions": 0}, "dimensions"),
    ({"input": []}, "input is empty"),
    ({"input": "w1", "encoding_format": "int8"}, "encoding_format"),
    ({"input": "w1", "embed_dtype": "int8"}, "embed_dtype"),
    ({"input": "w1", "endianness": "middle"}, "endianness"),
    # vLLM's fields that would change the answer and are not implemented: refused by name.
    ({"input": "w1", "padding": "max_length"}, "padding"),
    ({"input": "w1", "truncation_side": "right"}, "truncation_side"),
    ({"input": "w1", "add_special_tokens": False}, "add_special_tokens"),
    ({"input": "w1", "request_id": "mine"}, "request_id"),
    ({"input": "w1", "normalize": True, "use_activation": False}, "use_activation"),
    ({"input": "w1", "messages": [{"role": "user", "content": "w1"}]}, "input or messages"),
    ({"input": "w1", "add_generation_prompt": True}, "are for messages"),
    ({"input": "w1 " * 200}, "max_model_len"),
    ({"input": [[100000]]}, "out of vocabulary"),
    ({"input": "w1", "truncate_prompt_tokens": 500}, "truncate_prompt_tokens"),
])
def test_bad_requests_get_400(server, body, message):
    r = httpx.post(f"{server}/v1/embeddings", json={"model": "emb", **body}, timeout=60)
    assert r.status_code == 400, r.text
    assert message in r.json()["error"]["message"]
    r = httpx.post(f"{server}/v1/embeddings", json={"model": "nope", "input": "w1"}, timeout=60)
    assert r.status_code == 404


def test_pooling_endpoint(server, folder):
    r = httpx.post(f"{server}/pooling", json={"model": "emb", "input": ["w1 w2", "w3"]},
                   timeout=60)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "list" and body["data"][0]["object"] == "pooling"
    raw = np.array([d["data"] for d in body["data"]])
    ref = st_encode(folder, ["w1 w2", "w3"])
    assert cosine(raw, ref).min() >= 0.999  # the pooled vector, not normalized
    assert not np.allclose(np.linalg.norm(raw, axis=1), 1.0)


def test_pooling_of_chat_messages_task_and_use_activation(server):
    """vLLM's chat-style `messages` on /pooling (and /v1/embeddings): the conversation as the
    chat template renders it, without the generation prompt unless asked; /pooling's `task`
    and `use_activation` (an embedding's normalization)."""
    def post(path: str, **body) -> list[list[float]]:
        r = httpx.post(f"{server}{path}", json={"model": "emb", **body}, timeout=60)
        assert r.status_code == 200, r.text
        return [d["data" if path == "/pooling" else "embedding"] for d in r.json()["data"]]

    messages = [{"role": "system", "content": "w1 w2"}, {"role": "user", "content": "w3"}]
    assert post("/pooling", messages=messages) == post("/pooling", input=[6, 7, 8])
    assert post("/pooling", messages=messages, add_generation_prompt=True) == post(
        "/pooling", input=[6, 7, 8, 204])
    assert post("/v1/embeddings", messages=messages) == post("/v1/embeddings", input=[6, 7, 8])
    embedded = post("/v1/embeddings", input="w1 w2")
    assert post("/pooling", input="w1 w2", task="embed") == embedded
    raw = post("/pooling", input="w1 w2")
    assert post("/v1/embeddings", input="w1 w2", use_activation=False) == raw != embedded
    r = httpx.post(f"{server}/classify", json={"model": "emb", "input": "w1"}, timeout=60)
    assert r.status_code == 400
    assert "does not support pooling task 'classify'" in r.json()["error"]["message"]


def test_classify_names_the_most_probable_label():
    """/classify's answer (vLLM's shape), from a classifier's outputs: without starting a
    classification server (the probabilities are `LLM.classify`'s, tests/pooling/test_score)."""
    from types import SimpleNamespace

    from v1.entrypoints.openai.protocol_pooling import ClassificationRequest
    from v1.entrypoints.openai.serving import OpenAIServing
    from v1.entrypoints.openai.serving_pooling import OpenAIServingPooling
    from v1.models.pooler import resolve_pooler_info
    from v1.outputs import PoolingOutput, PoolingRequestOutput

    config = SimpleNamespace(hidden_size=8, id2label={"0": "neg", "1": "neu", "2": "pos"})
    pooler = resolve_pooler_info(Path("/nonexistent"), config, False, 3)
    assert pooler.labels == ["neg", "neu", "pos"]
    probs = {"w1": [0.2, 0.1, 0.7], "w2 w3": [0.5, 0.3, 0.2]}

    async def encode(prompt, params, request_id, priority):
        assert params.task == "classify" and params.use_activation is True
        data = torch.tensor(probs[prompt])
        yield PoolingRequestOutput(request_id, PoolingOutput(data), [1] * len(prompt), True)

    engine = SimpleNamespace(processor=SimpleNamespace(require_pooler=lambda: pooler),
                             encode=encode)
    serving = OpenAIServingPooling(OpenAIServing(engine, ["cls"]))  # type: ignore[arg-type]
    response = asyncio.run(serving.create_classify(ClassificationRequest(input=["w1", "w2 w3"])))
    assert [(d.index, d.label, d.num_classes) for d in response.data] == [
        (0, "pos", 3), (1, "neg", 3)]
    assert [d.probs for d in response.data] == [pytest.approx(p) for p in probs.values()]
    assert response.id.startswith("classify-") and response.usage.prompt_tokens == 7


def test_score_and_rerank_by_embedding_similarity(server, folder):
    ref = st_encode(folder, ["w1 w2", "w1 w3", "w9 w8 w7", "w1 w2 w5"])
    expected = cosine(ref[:1], ref[1:])
    for path in ("/score", "/v1/score"):
        r = httpx.post(f"{server}{path}", json={
            "model": "emb", "text_1": "w1 w2", "text_2": ["w1 w3", "w9 w8 w7", "w1 w2 w5"],
        }, timeout=60)
        assert r.status_code == 200, r.text
        scores = [d["score"] for d in r.json()["data"]]
        np.testing.assert_allclose(scores, expected, rtol=1e-4, atol=1e-5)
    for path in ("/rerank", "/v1/rerank", "/v2/rerank"):
        r = httpx.post(f"{server}{path}", json={
            "model": "emb", "query": "w1 w2", "documents": ["w1 w3", "w9 w8 w7", "w1 w2 w5"],
            "top_n": 2,
        }, timeout=60)
        assert r.status_code == 200, r.text
        results = r.json()["results"]
        order = list(np.argsort(-expected)[:2])
        assert [x["index"] for x in results] == order
        assert results[0]["document"]["text"] == ["w1 w3", "w9 w8 w7", "w1 w2 w5"][order[0]]
    r = httpx.post(f"{server}/score", json={"model": "emb", "text_1": ["a", "b"],
                                            "text_2": ["c", "d", "e"]}, timeout=60)
    assert r.status_code == 400 and "1 text with N" in r.json()["error"]["message"]


def test_score_sides_by_vllm_names_and_refused_fields(server):
    """/score takes its sides as vLLM names them (queries and documents or items, data_1 and
    data_2, text_1 and text_2), 1 -> N or N -> N; /rerank a lone document; vLLM's scoring
    fields that would change the scores (not implemented) are 400s naming them."""
    def scores(**sides) -> list[float]:
        r = httpx.post(f"{server}/score", json={"model": "emb", **sides}, timeout=60)
        assert r.status_code == 200, r.text
        return [d["score"] for d in r.json()["data"]]

    docs = ["w1 w3", "w9 w8 w7"]
    expected = scores(text_1="w1 w2", text_2=docs)
    assert scores(queries="w1 w2", documents=docs) == expected
    assert scores(queries="w1 w2", items=docs) == expected
    assert scores(data_1="w1 w2", data_2=docs) == expected
    assert scores(queries=["w1 w2", "w1 w2"], documents=docs) == expected
    r = httpx.post(f"{server}/rerank", json={"model": "emb", "query": "w1 w2",
                                             "documents": "w1 w3"}, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["results"][0]["relevance_score"] == pytest.approx(expected[0])
    assert r.json()["usage"]["prompt_tokens"] == r.json()["usage"]["total_tokens"] == 6
    for path, body, param in (
        ("/score", {"queries": "w1", "documents": "w2", "text_1": "w1", "text_2": "w2"}, None),
        ("/score", {"queries": "w1"}, None),
        ("/score", {"text_1": "w1", "text_2": "w2", "max_tokens_per_doc": 3},
         "max_tokens_per_doc"),
        ("/rerank", {"query": "w1", "documents": ["w2"], "instruction": "x"}, "instruction"),
    ):
        r = httpx.post(f"{server}{path}", json={"model": "emb", **body}, timeout=60)
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == param


def test_scoring_and_long_inputs_are_bounded_before_tokenizing(server):
    """/score and /rerank count the pairs before tokenizing any (1025 pairs of two distinct
    texts were scored before), and every text, an embedding's input or a pair's, is held to
    the characters max_model_len tokens can hold before it is tokenized: this word-level
    tokenizer drops whitespace, so its vocabulary bounds none and
    max_chars_per_unbounded_token does (a 15 MB input was tokenized, 5M tokens, before its
    400)."""
    over = ("more than max_model_len (128) tokens can hold: max_chars_per_unbounded_token "
            "(100) characters each, as this model's vocabulary bounds none")
    for path, body, message in (
        ("/score", {"text_1": "w1", "text_2": ["w2"] * 1025},
         "the request has 1025 pairs to score, more than max_completion_prompts (1024)"),
        ("/rerank", {"query": "w1", "documents": ["w2"] * 1025},
         "the request has 1025 pairs to score, more than max_completion_prompts (1024)"),
        ("/rerank", {"query": "w1", "documents": ["w2", "w3 " * 5000]},
         f"the prompt has 15000 characters, {over}"),
        ("/v1/embeddings", {"input": "w1 " * 5_000_000},
         f"the prompt has 15000000 characters, {over}"),
    ):
        r = httpx.post(f"{server}{path}", json={"model": "emb", **body}, timeout=120)
        assert r.status_code == 400, r.text
        assert r.json()["error"]["message"] == message
    assert httpx.get(f"{server}/health", timeout=60).status_code == 200


def test_generation_routes_refuse_a_pooling_model(client):
    with pytest.raises(openai.BadRequestError, match="pooling model"):
        client.completions.create(model="emb", prompt="w1", max_tokens=2)


def test_pooling_routes_refuse_a_generating_engine():
    # What a generating server's pooling routes answer (its processor has no pooler), without
    # starting one: the serving object over an engine whose processor is a generating one's.
    from types import SimpleNamespace

    from v1.engine.processor import Processor
    from v1.entrypoints.openai.protocol_pooling import EmbeddingRequest
    from v1.entrypoints.openai.serving import OpenAIServing
    from v1.entrypoints.openai.serving_pooling import OpenAIServingPooling

    engine = SimpleNamespace(processor=Processor(None, 64, 256, None))
    serving = OpenAIServingPooling(OpenAIServing(engine, ["gen"]))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="--runner pooling"):
        asyncio.run(serving.create_embedding(EmbeddingRequest(input="w1")))


def test_many_clients_at_once(client, folder):
    # 12 requests in flight together (each of 2 inputs): the engine batches them; every
    # response holds its own inputs' embeddings.
    from concurrent.futures import ThreadPoolExecutor

    from tests.pooling.st_models import random_text

    rng = torch.Generator().manual_seed(9)
    batches = [[random_text(rng, 5 + 7 * i), random_text(rng, 40 - 3 * i)] for i in range(12)]
    ref = st_encode(folder, [t for b in batches for t in b]).reshape(12, 2, -1)

    def embed(batch: list[str]) -> np.ndarray:
        response = client.embeddings.create(model="emb", input=batch)
        return np.array([d.embedding for d in response.data])

    with ThreadPoolExecutor(12) as pool:
        results = list(pool.map(embed, batches))
    for got, expected in zip(results, ref, strict=True):
        assert cosine(got, expected).min() >= 0.999
