"""Scoring text pairs, shared by `LLM.score` and the server's /score and /rerank (vLLM's
semantics): `text_1` against each of `text_2` (1 -> N) or pairwise (N -> N).

An embedding model scores a pair by the cosine similarity of the two texts' embeddings (each
distinct text embedded once); a cross-encoder (a classification head with one label) reads
the pair as one input, `tokenizer(text_1, text_2)`, and its head's logit through a sigmoid
is the score.
"""

from collections.abc import Sequence
from dataclasses import dataclass

from v1.engine.processor import Processor, PromptType
from v1.outputs import PoolingOutput, PoolingRequestOutput
from v1.pooling_params import PoolerInfo


def pair_score_inputs(
    data_1: str | Sequence[str], data_2: str | Sequence[str]
) -> tuple[list[str], list[str]]:
    """The pairs to score, as two lists of equal length; ValueError for any other shape."""
    texts_1 = [data_1] if isinstance(data_1, str) else list(data_1)
    texts_2 = [data_2] if isinstance(data_2, str) else list(data_2)
    if not texts_1 or not texts_2:
        raise ValueError("scoring needs at least one text on each side")
    for text in texts_1 + texts_2:
        if not isinstance(text, str):
            raise ValueError(f"scoring takes texts, got {type(text).__name__}")
    if len(texts_1) == 1:
        texts_1 = texts_1 * len(texts_2)
    elif len(texts_1) != len(texts_2):
        raise ValueError(
            f"scoring pairs 1 text with N, or N with N: got {len(texts_1)} and {len(texts_2)}"
        )
    return texts_1, texts_2


@dataclass(slots=True)
class ScorePlan:
    """What to pool for a batch of pairs, and how its outputs become one score per pair."""

    prompts: list[PromptType]
    task: str  # "embed" or "score"
    # Per pair, the indices into `prompts` of its two texts (embedding models only).
    pairs: list[tuple[int, int]] | None = None

    def scores(self, outputs: Sequence[PoolingRequestOutput[PoolingOutput]]) -> list[float]:
        if self.pairs is None:
            return [float(o.outputs.data.reshape(-1)[0]) for o in outputs]
        import torch.nn.functional as F  # loaded already: the outputs are tensors

        return [
            float(F.cosine_similarity(outputs[a].outputs.data, outputs[b].outputs.data, dim=0))
            for a, b in self.pairs
        ]

    def prompt_token_ids(
        self, outputs: Sequence[PoolingRequestOutput[PoolingOutput]], pair: int
    ) -> list[int]:
        """The tokens pair `pair` was scored on."""
        if self.pairs is None:
            return outputs[pair].prompt_token_ids
        a, b = self.pairs[pair]
        return outputs[a].prompt_token_ids + outputs[b].prompt_token_ids


def plan_scores(
    pooler: PoolerInfo, processor: Processor, texts_1: list[str], texts_2: list[str]
) -> ScorePlan:
    if pooler.num_labels is None:
        unique = list(dict.fromkeys(texts_1 + texts_2))
        index = {t: i for i, t in enumerate(unique)}
        return ScorePlan(
            list(unique), "embed", [(index[a], index[b]) for a, b in zip(texts_1, texts_2)]
        )
    if pooler.num_labels != 1:
        raise ValueError(f"scoring needs a cross-encoder (one label); this model's "
                         f"classification head has {pooler.num_labels}")
    return ScorePlan(
        [processor.encode_pair(a, b) for a, b in zip(texts_1, texts_2, strict=True)], "score"
    )
