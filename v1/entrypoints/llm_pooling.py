"""`LLM`'s pooling calls (runner="pooling"), as vLLM's: `encode`, `embed`, `classify`, `score`.
One pooling request per prompt through the same scheduler as generation, one output per
prompt, in order; `score` pairs texts (`score_utils`).
"""

import dataclasses
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from v1.engine.processor import PromptType, prompt_list
from v1.entrypoints.score_utils import pair_score_inputs, plan_scores
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
    _run: Callable[..., list[Any]]  # LLM's: (prompts, params, priority, use_tqdm, ranks, loras)

    def _pooler(self) -> PoolerInfo:
        return self.llm_engine.processor.require_pooler()

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
        prompts = prompt_list(prompts)
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
            p = dataclasses.replace(
                p, task=p.task or pooling_task,
                truncate_prompt_tokens=p.truncate_prompt_tokens if truncate_prompt_tokens is None
                else truncate_prompt_tokens,
            )
            p.verify(pooling_task, self._pooler())
            checked.append(p)
        no_ranks_or_loras = [None] * len(prompts)
        return self._run(prompts, checked, None, use_tqdm, no_ranks_or_loras, no_ranks_or_loras)

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
        """Scores of text pairs (`.outputs.score`), as vLLM's: one text against many
        (1 -> N), or pairwise (N -> N); see `v1.entrypoints.score_utils` for how."""
        texts_1, texts_2 = pair_score_inputs(data_1, data_2)
        plan = plan_scores(self._pooler(), self.llm_engine.processor, texts_1, texts_2)
        outputs = self.encode(
            plan.prompts, pooling_params, truncate_prompt_tokens=truncate_prompt_tokens,
            use_tqdm=use_tqdm, pooling_task=plan.task,
        )
        return [
            ScoringRequestOutput(str(i), ScoringOutput(score), plan.prompt_token_ids(outputs, i),
                                 True)
            for i, score in enumerate(plan.scores(outputs))
        ]
