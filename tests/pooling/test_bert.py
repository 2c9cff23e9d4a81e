"""The BERT family as pooling models (bidirectional attention: the torch backend's
encoder-only mode) against sentence-transformers on tiny random encoders saved as
sentence-transformers folders: BertModel with CLS pooling and Normalize, XLM-RoBERTa with
mean pooling (its positions start after the padding id). Many prompts of different lengths
in one engine; chunked prefill and prefix caching are off for them, and an engine step never
splits a sequence.
"""

from pathlib import Path

import numpy as np
import pytest
import torch

from tests.pooling.st_models import (
    bert_config,
    random_text,
    save_sentence_transformer,
    word_tokenizer,
    xlm_roberta_config,
)
from tests.pooling.test_embed import assert_idle, cosine, embeddings, pooling_llm, st_encode

pytest.importorskip("sentence_transformers")

CLS_SEP = "[CLS] $A [SEP]"


@pytest.fixture(scope="module")
def texts() -> list[str]:
    rng = torch.Generator().manual_seed(5)
    lengths = torch.randint(1, 100, (20,), generator=rng).tolist()
    return [random_text(rng, n) for n in lengths]


@pytest.fixture(scope="module")
def bert_cls(tmp_path_factory) -> Path:
    from transformers import BertModel

    folder = tmp_path_factory.mktemp("st") / "bert-cls"
    return save_sentence_transformer(
        folder, lambda: BertModel(bert_config()), word_tokenizer(CLS_SEP), "cls", True
    )


@pytest.fixture(scope="module")
def xlmr_mean(tmp_path_factory) -> Path:
    from transformers import XLMRobertaModel

    folder = tmp_path_factory.mktemp("st") / "xlmr-mean"
    return save_sentence_transformer(
        folder, lambda: XLMRobertaModel(xlm_roberta_config()), word_tokenizer(CLS_SEP),
        "mean", False, seed=2,
    )


def test_bert_cls_normalized_matches_sentence_transformers(bert_cls, texts):
    ref = st_encode(bert_cls, texts)
    # A 64-token budget: the engine raises it to max_model_len, since a sequence is never split.
    with pooling_llm(bert_cls, max_model_len=128, max_num_batched_tokens=64) as llm:
        core = llm.llm_engine.client.engine_core
        assert core.scheduler_config.enable_chunked_prefill is False
        assert core.scheduler_config.max_num_batched_tokens == 128
        assert core.cache_config.enable_prefix_caching is False
        got = embeddings(llm, texts)
        again = embeddings(llm, texts[:3])
        assert llm.get_stats().prefix_cache_hits == 0
        assert_idle(llm)
    assert cosine(got, ref).min() >= 0.999
    np.testing.assert_allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-5)
    np.testing.assert_allclose(again, got[:3], rtol=1e-5, atol=1e-6)


def test_xlm_roberta_mean_matches_sentence_transformers(xlmr_mean, texts):
    ref = st_encode(xlmr_mean, texts)
    with pooling_llm(xlmr_mean) as llm:
        assert llm.llm_engine.max_model_len == 256  # 258 positions, from pad_token_id + 1
        got = embeddings(llm, texts)
        assert_idle(llm)
    assert cosine(got, ref).min() >= 0.999
    np.testing.assert_allclose(np.linalg.norm(got, axis=1), np.linalg.norm(ref, axis=1),
                               rtol=1e-3)


def test_encoder_attention_refuses_a_split_sequence():
    from v1.attention.backends.abstract import AttentionMetadata, AttentionType
    from v1.attention.backends.torch_attn import TorchAttentionImpl

    impl = TorchAttentionImpl(2, 8, 2, 0.3, attn_type=AttentionType.ENCODER_ONLY)
    q = torch.randn(5, 2, 8)
    # One sequence of 8 tokens whose last 5 are this step's: a chunk, which it cannot attend.
    metadata = AttentionMetadata.build(np.array([5]), np.array([8]), np.zeros((1, 1), np.int32),
                                       np.arange(5))
    with pytest.raises(ValueError, match="whole in one step"):
        impl.forward(q, q, q, torch.empty(0), metadata)
    with pytest.raises(ValueError, match="attn_type"):
        TorchAttentionImpl(2, 8, 2, 0.3, attn_type="cross")
    # Whole sequences: bidirectional, each over itself only.
    metadata = AttentionMetadata.build(np.array([2, 3]), np.array([2, 3]),
                                       np.zeros((2, 1), np.int32), np.arange(5))
    out = impl.forward(q, q, q, torch.empty(0), metadata)
    for s, e in ((0, 2), (2, 5)):
        x = q[s:e].transpose(0, 1)
        ref = torch.softmax(x @ x.transpose(1, 2) * 0.3, -1) @ x
        torch.testing.assert_close(out[s:e], ref.transpose(0, 1))
