"""`LLM`'s pooling calls (an engine made with runner="pooling"), as vLLM's: `encode`, `embed`,
`classify` and `score`.

Each call sends one pooling request per prompt through the same scheduler as generation
(prefill only, chunked under the token budget where attention is causal) and returns one
output per prompt, in order. `score` pairs texts: with an embedding model it is the cosine
similarity of the two embeddings; with a cross-encoder (a classification head with one
label) the model reads each pair as one input and its head gives the score.
"""

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch.nn.functional as F

from v1.engine.processor import PromptType
from v1.outputs import (
    ClassificationRequestOutput,
    EmbeddingRequestOutput,
    PoolingOutput,
    PoolingRequestOutput,
    ScoringOutput,
    ScoringRequestOutput,
)
from v1.pooling_params import PoolerInfo, PoolingParams

if TYPE_CHECKING:
    from v1.engine.llm_engine import LLMEngine


class PoolingMixin:
    """The pooling half of `LLM` (it needs `llm_engine` and `_run`)."""

    llm_engine: "LLMEngine"
    _run: Callable[..., list[Any]]  # LLM's: (prompts, params, priority, use_tqdm, ranks)

    def _pooler(self) -> PoolerInfo:
        pooler = self.llm_engine.processor.pooler
        if pooler is None:
            raise ValueError("this engine generates: pooling calls (encode, embed, classify, "
                             "score) need LLM(model, runner='pooling')")
        return pooler

    def encode(
        self,
        prompts: PromptType | Sequence[PromptType],
        pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
        *,
        truncate_prompt_tokens: int | None = None,
        use_tqdm: bool = True,
        pooling_task: str = "encode",
    ) -> list[PoolingRequestOutput[PoolingOutput]]:
        """The pooled vector of each prompt (`.outputs.data`, a tensor). `pooling_task`
        (vLLM's name) is what the vectors are: "encode" (as pooled), "embed", "classify"
        or "score"; one PoolingParams for all prompts, or one each."""
        self._pooler()
        if isinstance(prompts, str | dict) or (
            isinstance(prompts, Sequence) and prompts and isinstance(prompts[0], int)
        ):
            prompts = [prompts]  # type: ignore[list-item]  (one prompt)
        prompts = list(prompts)  # type: ignore[arg-type]
        if pooling_params is None or isinstance(pooling_params, PoolingParams):
            params = [pooling_params or PoolingParams()] * len(prompts)
        else:
            params = list(pooling_params)
            if len(params) != len(prompts):
                raise ValueError(f"got {len(params)} pooling params for {len(prompts)} prompts")
        checked = []
        for p in params:
            if not isinstance(p, PoolingParams):
                raise ValueError(f"pooling_params must be PoolingParams, got {type(p)}")
            p = PoolingParams(
                p.truncate_prompt_tokens if truncate_prompt_tokens is None
                else truncate_prompt_tokens,
                p.dimensions, p.normalize, p.use_activation, p.task or pooling_task,
            )
            p.verify(pooling_task, self._pooler())
            checked.append(p)
        return self._run(prompts, checked, None, use_tqdm, [None] * len(prompts))

    def embed(
        self,
        prompts: PromptType | Sequence[PromptType],
        *,
        truncate_prompt_tokens: int | None = None,
        use_tqdm: bool = True,
        pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
    ) -> list[EmbeddingRequestOutput]:
        """Each prompt's embedding (`.outputs.embedding`, a list of floats): pooled as the
        model says, normalized unless `PoolingParams(normalize=False)`, truncated to
        `dimensions` for Matryoshka models."""
        outputs = self.encode(
            prompts, pooling_params, truncate_prompt_tokens=truncate_prompt_tokens,
            use_tqdm=use_tqdm, pooling_task="embed",
        )
        return [EmbeddingRequestOutput.from_base(o) for o in outputs]  # type: ignore[misc]

    def classify(
        self,
        prompts: PromptType | Sequence[PromptType],
        *,
        use_tqdm: bool = True,
        pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
    ) -> list[ClassificationRequestOutput]:
        """Each prompt's class probabilities (`.outputs.probs`), for a model with a
        classification head (`*ForSequenceClassification`)."""
        outputs = self.encode(prompts, pooling_params, use_tqdm=use_tqdm, pooling_task="classify")
        return [ClassificationRequestOutput.from_base(o) for o in outputs]  # type: ignore[misc]

    def score(
        self,
        data_1: str | Sequence[str],
        data_2: str | Sequence[str],
        /,
        *,
        truncate_prompt_tokens: int | None = None,
        use_tqdm: bool = True,
        pooling_params: PoolingParams | None = None,
    ) -> list[ScoringRequestOutput]:
        """Scores of text pairs, as vLLM's: one text against many (1 -> N), or pairwise
        (N -> N). An embedding model scores by the cosine similarity of the embeddings; a
        cross-encoder (one-label classification head) reads each pair together."""
        texts_1 = [data_1] if isinstance(data_1, str) else list(data_1)
        texts_2 = [data_2] if isinstance(data_2, str) else list(data_2)
        if not texts_1 or not texts_2:
            raise ValueError("score needs at least one text on each side")
        if len(texts_1) == 1:
            texts_1 = texts_1 * len(texts_2)
        elif len(texts_1) != len(texts_2):
            raise ValueError(
                f"score pairs 1 text with N, or N with N: got {len(texts_1)} and {len(texts_2)}"
            )
        pooler = self._pooler()
        if pooler.num_labels is None:
            return self._embedding_score(texts_1, texts_2, truncate_prompt_tokens, use_tqdm,
                                         pooling_params)
        if pooler.num_labels != 1:
            raise ValueError(f"score needs a cross-encoder (one label); this model's "
                             f"classification head has {pooler.num_labels}")
        processor = self.llm_engine.processor
        pairs = [processor.encode_pair(a, b) for a, b in zip(texts_1, texts_2, strict=True)]
        outputs = self.encode(
            pairs, pooling_params, truncate_prompt_tokens=truncate_prompt_tokens,
            use_tqdm=use_tqdm, pooling_task="score",
        )
        return [ScoringRequestOutput.from_base(o) for o in outputs]  # type: ignore[misc]

    def _embedding_score(
        self,
        texts_1: list[str],
        texts_2: list[str],
        truncate_prompt_tokens: int | None,
        use_tqdm: bool,
        pooling_params: PoolingParams | None,
    ) -> list[ScoringRequestOutput]:
        # Each distinct text embedded once (1 -> N repeats the first), normalized: the dot
        # product is then the cosine similarity.
        unique = list(dict.fromkeys(texts_1 + texts_2))
        params = PoolingParams(normalize=True) if pooling_params is None else pooling_params
        embedded = self.encode(unique, params, truncate_prompt_tokens=truncate_prompt_tokens,
                               use_tqdm=use_tqdm, pooling_task="embed")
        by_text = dict(zip(unique, embedded, strict=True))
        results = []
        for a, b in zip(texts_1, texts_2, strict=True):
            out_a, out_b = by_text[a], by_text[b]
            score = F.cosine_similarity(out_a.outputs.data, out_b.outputs.data, dim=0)
            results.append(ScoringRequestOutput(
                f"{out_a.request_id}_{out_b.request_id}", ScoringOutput(float(score)),
                out_a.prompt_token_ids + out_b.prompt_token_ids, True,
            ))
        return results
