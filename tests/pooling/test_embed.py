"""Embeddings (runner="pooling") against sentence-transformers on tiny random decoders saved
as sentence-transformers folders: Qwen3 with last-token pooling and Normalize (the
Qwen3-Embedding recipe), Llama with mean pooling and no Normalize. Cosine >= 0.999 per
prompt, many prompts at once, the same vectors under chunked prefill (a 16-token budget: a
prompt spans several steps), every block free afterwards; PoolingParams' dimensions and
truncate_prompt_tokens; the runner choice.
"""

from pathlib import Path

import numpy as np
import pytest
import torch

from tests.pooling.st_models import (
    llama_config,
    qwen3_config,
    random_text,
    save_sentence_transformer,
    word_tokenizer,
)
from v1 import LLM, SamplingParams
from v1.pooling_params import PoolingParams

pytest.importorskip("sentence_transformers")

NUM_PROMPTS = 24


def _qwen3() -> object:
    from transformers import Qwen3Model

    return Qwen3Model(qwen3_config())


def _llama() -> object:
    from transformers import LlamaModel

    return LlamaModel(llama_config())


@pytest.fixture(scope="module")
def qwen3_last(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("st") / "qwen3-last"
    return save_sentence_transformer(folder, _qwen3, word_tokenizer("$A <eos>"), "lasttoken", True)


@pytest.fixture(scope="module")
def llama_mean(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("st") / "llama-mean"
    return save_sentence_transformer(folder, _llama, word_tokenizer("$A"), "mean", False, seed=1)


@pytest.fixture(scope="module")
def texts() -> list[str]:
    rng = torch.Generator().manual_seed(0)
    lengths = torch.randint(1, 80, (NUM_PROMPTS,), generator=rng).tolist()
    return [random_text(rng, n) for n in lengths]


def st_encode(folder: Path, texts: list[str]) -> np.ndarray:
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(folder), device="cpu").encode(texts, convert_to_numpy=True)


def pooling_llm(folder: Path, **kwargs) -> LLM:
    kwargs.setdefault("max_model_len", 256)
    kwargs.setdefault("kv_cache_memory", 1 << 22)
    return LLM(str(folder), runner="pooling", multiprocess=False, **kwargs)


def embeddings(llm: LLM, texts: list[str], **kwargs) -> np.ndarray:
    return np.array([o.outputs.embedding for o in llm.embed(texts, use_tqdm=False, **kwargs)])


def cosine(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return (a * b).sum(-1) / np.linalg.norm(a, axis=-1) / np.linalg.norm(b, axis=-1)


def assert_idle(llm: LLM) -> None:
    llm.llm_engine.client.call_utility("check_integrity")
    stats = llm.get_stats()
    assert stats.kv_cache_usage == 0.0 and stats.num_running_reqs == 0
    assert stats.num_generation_tokens == 0  # pooled, never sampled


@pytest.mark.parametrize("budget", [None, 16])
def test_last_token_normalized_matches_sentence_transformers(qwen3_last, texts, budget):
    ref = st_encode(qwen3_last, texts)
    with pooling_llm(qwen3_last, max_num_batched_tokens=budget) as llm:
        got = embeddings(llm, texts)
        assert_idle(llm)
        if budget is not None:  # the prompts were prefilled in chunks: several steps each
            assert llm.get_stats().num_prompt_tokens > 4 * budget
    assert got.shape == ref.shape == (NUM_PROMPTS, 64)
    assert cosine(got, ref).min() >= 0.999
    np.testing.assert_allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-5)


def test_mean_pooling_unnormalized_matches_across_chunk_sizes(llama_mean, texts):
    ref = st_encode(llama_mean, texts)
    results = []
    for budget in (2048, 16, 7):
        with pooling_llm(llama_mean, max_num_batched_tokens=budget,
                         long_prefill_token_threshold=5 if budget == 16 else 0) as llm:
            results.append(embeddings(llm, texts))
            assert_idle(llm)
    for got in results:
        assert cosine(got, ref).min() >= 0.999
        # Not normalized: the lengths are sentence-transformers' too.
        np.testing.assert_allclose(np.linalg.norm(got, axis=1), np.linalg.norm(ref, axis=1),
                                   rtol=1e-3)
    np.testing.assert_allclose(results[1], results[0], rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(results[2], results[0], rtol=1e-4, atol=1e-5)


def test_prefix_caching_by_pooling_type(qwen3_last, llama_mean, texts):
    # LAST on a causal model keeps prefix caching (a repeated prompt hits, and pools the
    # same); MEAN turns it off (cached tokens' hidden states would be missing).
    with pooling_llm(qwen3_last) as llm:
        first = embeddings(llm, texts[:4])
        again = embeddings(llm, texts[:4])
        assert llm.get_stats().prefix_cache_hits > 0
        np.testing.assert_allclose(again, first, rtol=1e-5, atol=1e-6)
        assert_idle(llm)
    with pooling_llm(llama_mean) as llm:
        embeddings(llm, texts[:4])
        embeddings(llm, texts[:4])
        assert llm.get_stats().prefix_cache_hits == 0
        assert llm.llm_engine.client.engine_core.cache_config.enable_prefix_caching is False


def test_preemption_in_a_tiny_kv_pool(llama_mean, texts):
    # 8 blocks of 16 tokens for 6 prompts of 60-79 tokens that advance 8 tokens a step
    # together: they outgrow the pool, are preempted, and pool from scratch when they resume.
    rng = torch.Generator().manual_seed(3)
    texts = [random_text(rng, 60 + 3 * i) for i in range(6)]
    ref = st_encode(llama_mean, texts)
    with pooling_llm(llama_mean, num_gpu_blocks=8, max_model_len=128,
                     max_num_batched_tokens=48, long_prefill_token_threshold=8) as llm:
        got = embeddings(llm, texts)
        assert llm.get_stats().num_preemptions > 0
        assert_idle(llm)
    assert cosine(got, ref).min() >= 0.999


def test_truncate_prompt_tokens_keeps_the_last_tokens(qwen3_last):
    text = " ".join(f"w{i}" for i in range(30))
    with pooling_llm(qwen3_last) as llm:
        truncated = embeddings(llm, [text], truncate_prompt_tokens=5)
        # The tokenizer appends <eos>: the last 5 tokens are w26..w29 <eos>.
        tail = embeddings(llm, ["w26 w27 w28 w29"])
        whole = embeddings(llm, [text])
        outs = llm.embed([text], truncate_prompt_tokens=5, use_tqdm=False)
        assert len(outs[0].prompt_token_ids) == 5
        with pytest.raises(ValueError, match="truncate_prompt_tokens"):
            PoolingParams(truncate_prompt_tokens=0)
        with pytest.raises(ValueError, match="exceeds max_model_len"):
            llm.embed([text], truncate_prompt_tokens=1000, use_tqdm=False)
    np.testing.assert_allclose(truncated, tail, rtol=1e-5, atol=1e-6)
    assert cosine(truncated, whole)[0] < 0.99


def test_dimensions_need_a_matryoshka_model(tmp_path, qwen3_last, texts):
    with pooling_llm(qwen3_last) as llm:
        with pytest.raises(ValueError, match="does not support matryoshka"):
            llm.embed(texts[:1], pooling_params=PoolingParams(dimensions=16), use_tqdm=False)
    # The same weights, declared Matryoshka in config.json.
    import json
    import shutil

    folder = tmp_path / "matryoshka"
    shutil.copytree(qwen3_last, folder)
    config = json.loads((folder / "config.json").read_text())
    config["matryoshka_dimensions"] = [16, 32, 64]
    (folder / "config.json").write_text(json.dumps(config))
    with pooling_llm(folder) as llm:
        full = embeddings(llm, texts[:3])
        cut = embeddings(llm, texts[:3], pooling_params=PoolingParams(dimensions=16))
        with pytest.raises(ValueError, match="only supports"):
            llm.embed(texts[:1], pooling_params=PoolingParams(dimensions=20), use_tqdm=False)
    assert cut.shape == (3, 16)
    expected = full[:, :16] / np.linalg.norm(full[:, :16], axis=1, keepdims=True)
    np.testing.assert_allclose(cut, expected, rtol=1e-5, atol=1e-6)


def test_encode_gives_the_pooled_vector_and_normalize_false(qwen3_last, texts):
    with pooling_llm(qwen3_last) as llm:
        raw = llm.encode(texts[:2], use_tqdm=False)
        embedded = embeddings(llm, texts[:2])
        unnormalized = embeddings(llm, texts[:2], pooling_params=PoolingParams(normalize=False))
    data = torch.stack([o.outputs.data for o in raw]).numpy()
    np.testing.assert_allclose(data, unnormalized, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(data / np.linalg.norm(data, axis=1, keepdims=True), embedded,
                               rtol=1e-5, atol=1e-6)
    assert not np.allclose(np.linalg.norm(data, axis=1), 1.0)


def test_runner_choice(qwen3_last):
    # A base-model checkpoint (Qwen3Model: no LM head): "auto" pools it, "generate" refuses.
    with LLM(str(qwen3_last), runner="auto", multiprocess=False, max_model_len=64,
             kv_cache_memory=1 << 22) as llm:
        assert len(llm.embed(["w1 w2"], use_tqdm=False)[0].outputs.embedding) == 64
        with pytest.raises(ValueError, match="pooling model"):
            llm.generate(["w1"], SamplingParams(max_tokens=2), use_tqdm=False)
    with pytest.raises(ValueError, match="no LM head"):
        LLM(str(qwen3_last), multiprocess=False, max_model_len=64, kv_cache_memory=1 << 22)
    with pytest.raises(ValueError, match="runner must be one of"):
        LLM(str(qwen3_last), runner="embed")
    with pytest.raises(ValueError, match="async_scheduling"):
        pooling_llm(qwen3_last, async_scheduling=True)


def test_pooling_calls_need_a_pooling_engine(tmp_path):
    from transformers import Qwen3ForCausalLM

    folder = tmp_path / "causal"
    torch.manual_seed(0)
    Qwen3ForCausalLM(qwen3_config()).save_pretrained(folder)
    word_tokenizer("$A <eos>").save_pretrained(folder)
    with LLM(str(folder), multiprocess=False, max_model_len=64, kv_cache_memory=1 << 22) as llm:
        with pytest.raises(ValueError, match="runner='pooling'"):
            llm.embed(["w1 w2"], use_tqdm=False)
    # The same causal LM as a pooling model: vLLM's defaults, last token, normalized.
    with pooling_llm(folder) as llm:
        vec = np.array(llm.embed(["w1 w2"], use_tqdm=False)[0].outputs.embedding)
    np.testing.assert_allclose(np.linalg.norm(vec), 1.0, atol=1e-5)


def test_many_requests_through_the_process_engine(qwen3_last, texts):
    # The engine core in its own process (ZMQ): vectors travel in EngineCoreOutputs.
    ref = st_encode(qwen3_last, texts)
    with LLM(str(qwen3_last), runner="pooling", max_model_len=256,
             kv_cache_memory=1 << 22) as llm:
        got = embeddings(llm, texts)
    assert cosine(got, ref).min() >= 0.999


def test_pooler_config_overrides_the_folder(qwen3_last, texts):
    # The Qwen3 weights pooled by mean, unnormalized, against sentence-transformers' mean
    # Pooling on the same transformer.
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.base.modules import Transformer
    from sentence_transformers.sentence_transformer.modules import Pooling

    transformer = Transformer(str(qwen3_last.parent / f"{qwen3_last.name}-hf"))
    st = SentenceTransformer(modules=[transformer, Pooling(64, "mean")], device="cpu")
    ref = st.encode(texts[:6], convert_to_numpy=True)
    with pooling_llm(qwen3_last, max_num_batched_tokens=16,
                     pooler_config={"pooling_type": "MEAN", "normalize": False}) as llm:
        got = embeddings(llm, texts[:6])
    assert cosine(got, ref).min() >= 0.999
    np.testing.assert_allclose(np.linalg.norm(got, axis=1), np.linalg.norm(ref, axis=1),
                               rtol=1e-3)
    with pytest.raises(ValueError, match="pooling_type must be LAST, CLS or MEAN"):
        pooling_llm(qwen3_last, pooler_config={"pooling_type": "MAX"})
    with pytest.raises(ValueError, match="unknown pooler_config keys"):
        pooling_llm(qwen3_last, pooler_config={"pooling": "MEAN"})
    with pytest.raises(ValueError, match="needs runner='pooling'"):
        LLM(str(qwen3_last), pooler_config={"pooling_type": "MEAN"})


def test_sentence_transformers_configs(tmp_path):
    import json

    from v1.models.pooler import read_sentence_transformers_pooling

    def write(pooling: dict, *modules: str) -> Path:
        folder = tmp_path / str(len(list(tmp_path.iterdir())))
        (folder / "1_Pooling").mkdir(parents=True)
        (folder / "1_Pooling" / "config.json").write_text(json.dumps(pooling))
        entries = [{"path": "1_Pooling" if m.endswith("Pooling") else "", "type": m}
                   for m in modules]
        (folder / "modules.json").write_text(json.dumps(entries))
        return folder

    st, pooling = "sentence_transformers.models.Transformer", "sentence_transformers.models.Pooling"
    norm = "sentence_transformers.models.Normalize"
    # sentence-transformers < 3's flags, and 3+'s pooling_mode.
    legacy = {"word_embedding_dimension": 8, "pooling_mode_cls_token": True,
              "pooling_mode_mean_tokens": False}
    assert read_sentence_transformers_pooling(write(legacy, st, pooling, norm)) == ("CLS", True)
    assert read_sentence_transformers_pooling(
        write({"pooling_mode": "mean"}, st, pooling)) == ("MEAN", False)
    assert read_sentence_transformers_pooling(
        write({"pooling_mode": ["lasttoken"]}, st, pooling, norm)) == ("LAST", True)
    assert read_sentence_transformers_pooling(tmp_path) is None  # no modules.json
    for bad, message in (
        (write({"pooling_mode": "max"}, st, pooling), "pooling mode 'max'"),
        (write({"pooling_mode": ["cls", "mean"]}, st, pooling), "pooling mode"),
        (write({"pooling_mode": "mean", "include_prompt": False}, st, pooling), "include_prompt"),
        (write({"pooling_mode": "mean"}, st, pooling, "sentence_transformers.models.Dense"),
         "Dense"),
    ):
        with pytest.raises(ValueError, match=message):
            read_sentence_transformers_pooling(bad)
