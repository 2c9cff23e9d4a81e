"""Classification and scoring: a tiny random BertForSequenceClassification as a cross-encoder
(one label) against sentence-transformers' `CrossEncoder.predict` (pairs read together,
token type 1 on the second text, sigmoid), and with three labels against transformers'
softmax; `LLM.score` of an embedding model is the cosine similarity of the embeddings.
"""

from pathlib import Path

import numpy as np
import pytest
import torch

from tests.pooling.st_models import (
    bert_config,
    save_hf_model,
    word_tokenizer,
    xlm_roberta_config,
)
from tests.pooling.test_embed import assert_idle, embeddings, pooling_llm, qwen3_last  # noqa: F401

pytest.importorskip("sentence_transformers")

PAIR = ("[CLS] $A [SEP]", "[CLS] $A [SEP] $B:1 [SEP]:1")
QUERY = "w1 w2 w3"
DOCS = ["w1 w2", "w9 w8 w7 w6", "w3 w2 w1 w5 w5", "w100", "w1 w2 w3"]


def _classifier(num_labels: int):
    from transformers import BertForSequenceClassification

    return lambda: BertForSequenceClassification(bert_config(num_labels=num_labels))


@pytest.fixture(scope="module")
def cross_encoder(tmp_path_factory) -> Path:
    return save_hf_model(tmp_path_factory.mktemp("ce") / "ce", _classifier(1),
                         word_tokenizer(*PAIR))


@pytest.fixture(scope="module")
def classifier(tmp_path_factory) -> Path:
    return save_hf_model(tmp_path_factory.mktemp("cls") / "cls", _classifier(3),
                         word_tokenizer(*PAIR), seed=4)


def test_cross_encoder_scores_match_sentence_transformers(cross_encoder):
    from sentence_transformers import CrossEncoder

    ref = CrossEncoder(str(cross_encoder), device="cpu").predict([(QUERY, d) for d in DOCS])
    with pooling_llm(cross_encoder) as llm:
        one_to_many = llm.score(QUERY, DOCS, use_tqdm=False)
        pairwise = llm.score([QUERY] * len(DOCS), DOCS, use_tqdm=False)
        with pytest.raises(ValueError, match="1 text with N"):
            llm.score(["a", "b"], ["c", "d", "e"], use_tqdm=False)
        with pytest.raises(ValueError, match="does not support pooling task 'embed'"):
            llm.embed([QUERY], use_tqdm=False)
        assert_idle(llm)
    got = np.array([o.outputs.score for o in one_to_many])
    np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose([o.outputs.score for o in pairwise], got, rtol=1e-6)
    assert got.std() > 0.01  # the pairs are told apart (token types and order matter)
    # The pair's tokens: [CLS] query [SEP] doc [SEP].
    assert one_to_many[0].prompt_token_ids == [2, 6, 7, 8, 3, 6, 7, 3]


def test_xlm_roberta_cross_encoder_matches_sentence_transformers(tmp_path):
    # RoBERTa's head (dense, tanh, out_proj on <s>), positions from pad_token_id + 1, pairs
    # as "<s> a </s></s> b </s>".
    from sentence_transformers import CrossEncoder
    from transformers import XLMRobertaForSequenceClassification

    folder = save_hf_model(
        tmp_path / "xlmr-ce",
        lambda: XLMRobertaForSequenceClassification(xlm_roberta_config(num_labels=1)),
        word_tokenizer("[CLS] $A [SEP]", "[CLS] $A [SEP] [SEP] $B [SEP]"), seed=6,
    )
    ref = CrossEncoder(str(folder), device="cpu").predict([(QUERY, d) for d in DOCS])
    with pooling_llm(folder) as llm:
        got = np.array([o.outputs.score for o in llm.score(QUERY, DOCS, use_tqdm=False)])
    np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-5)
    assert got.std() > 0.01


def test_classify_matches_transformers_softmax(classifier):
    from transformers import AutoTokenizer, BertForSequenceClassification

    hf = BertForSequenceClassification.from_pretrained(classifier).eval()
    tokenizer = AutoTokenizer.from_pretrained(classifier)
    with torch.no_grad():
        ref = [torch.softmax(hf(**tokenizer(d, return_tensors="pt")).logits[0], -1).numpy()
               for d in DOCS]
    with pooling_llm(classifier) as llm:
        outs = llm.classify(DOCS, use_tqdm=False)
        with pytest.raises(ValueError, match="one label"):
            llm.score(QUERY, DOCS, use_tqdm=False)
    got = np.array([o.outputs.probs for o in outs])
    assert outs[0].outputs.num_classes == 3
    np.testing.assert_allclose(got, np.array(ref), rtol=1e-4, atol=1e-5)


def test_embedding_model_scores_by_cosine(qwen3_last):  # noqa: F811
    with pooling_llm(qwen3_last) as llm:
        scores = [o.outputs.score for o in llm.score(QUERY, DOCS, use_tqdm=False)]
        vectors = embeddings(llm, [QUERY, *DOCS])
        with pytest.raises(ValueError, match="classify"):
            llm.classify([QUERY], use_tqdm=False)
    np.testing.assert_allclose(scores, vectors[1:] @ vectors[0], rtol=1e-5, atol=1e-6)
    assert scores[-1] == pytest.approx(1.0, abs=1e-5)  # the query itself
