"""The pooling endpoints over AsyncLLM (a server started with --runner pooling): /v1/embeddings
(OpenAI's), /pooling, /score and /rerank (vLLM's).

Each input of a request becomes one pooling request in the engine, all in flight at once
(the scheduler batches them with every other client's); the response lists them in input
order. A client that disconnects cancels the gather, which aborts every request of it still
in the engine. On a generating server these routes answer 400, as vLLM's do.
"""

import asyncio
import base64
import time
import uuid
from collections.abc import Sequence
from typing import Any

from v1.engine.processor import PromptType
from v1.entrypoints.openai.protocol_pooling import (
    EmbeddingRequest,
    EmbeddingResponse,
    EmbeddingResponseData,
    PoolingBaseRequest,
    PoolingRequest,
    PoolingResponse,
    PoolingResponseData,
    PoolingUsage,
    RerankDocument,
    RerankRequest,
    RerankResponse,
    RerankResult,
    RerankUsage,
    ScoreRequest,
    ScoreResponse,
    ScoreResponseData,
)
from v1.entrypoints.openai.serving import OpenAIServing
from v1.entrypoints.score_utils import pair_score_inputs, plan_scores
from v1.outputs import PoolingOutput, PoolingRequestOutput
from v1.pooling_params import PoolerInfo, PoolingParams

Outputs = list[PoolingRequestOutput[PoolingOutput]]


def _inputs(value: str | list[str] | list[int] | list[list[int]]) -> list[PromptType]:
    """OpenAI's `input`: a text, texts, one prompt's token ids, or several prompts' ids."""
    if isinstance(value, str):
        return [value]
    if not value:
        raise ValueError("input is empty")
    if isinstance(value[0], int):
        return [value]  # type: ignore[list-item]
    return list(value)  # type: ignore[arg-type]


def _vectors(
    outputs: list[PoolingRequestOutput[PoolingOutput]], encoding_format: str
) -> list[list[float] | str]:
    """Each output's vector as a response carries it: floats, or OpenAI's base64 of
    little-endian float32s (encoded from the tensor, not from its list)."""
    if encoding_format == "base64":
        return [
            base64.b64encode(o.outputs.data.float().numpy().astype("<f4").tobytes()).decode()
            for o in outputs
        ]
    return [o.outputs.data.tolist() for o in outputs]


class OpenAIServingPooling:
    """The pooling routes, beside `OpenAIServing` (whose engine and model names they use)."""

    def __init__(self, serving: OpenAIServing) -> None:
        self.serving = serving
        self.engine = serving.engine

    def _pooler(self) -> PoolerInfo:
        return self.engine.processor.require_pooler()

    def _head(self, request: PoolingBaseRequest, prefix: str) -> dict[str, Any]:
        if self.serving.check_model(request.model) is not None:
            raise ValueError("LoRA adapters are for generation, not pooling requests")
        self._pooler()
        return {"id": f"{prefix}-{uuid.uuid4().hex}", "created": int(time.time()),
                "model": self.serving.served_model_names[0]}

    async def _pool(
        self,
        request_id: str,
        prompts: Sequence[PromptType],
        params: PoolingParams,
        priority: int,
    ) -> Outputs:
        """Every prompt's output, pooled concurrently; in prompt order."""
        if len(prompts) > self.serving.limits.max_completion_prompts:
            raise ValueError(
                f"the request has {len(prompts)} inputs, more than max_completion_prompts "
                f"({self.serving.limits.max_completion_prompts})"
            )

        async def one(i: int, prompt: PromptType) -> PoolingRequestOutput[PoolingOutput]:
            last = None
            async for out in self.engine.encode(prompt, params, f"{request_id}-{i}", priority):
                last = out
            if last is None:
                raise ValueError(f"input {i} was aborted")
            return last

        tasks = [asyncio.ensure_future(one(i, p)) for i, p in enumerate(prompts)]
        try:
            return list(await asyncio.gather(*tasks))
        finally:  # one failed, or the client left: the others end too (aborted in the engine)
            for task in tasks:
                task.cancel()
            await asyncio.wait(tasks)

    @staticmethod
    def _usage(outputs: Outputs) -> PoolingUsage:
        num = sum(len(o.prompt_token_ids) for o in outputs)
        return PoolingUsage(prompt_tokens=num, total_tokens=num)

    def _params(self, request: PoolingBaseRequest, task: str, **kwargs: Any) -> PoolingParams:
        params = PoolingParams(truncate_prompt_tokens=request.truncate_prompt_tokens,
                               task=task, **kwargs)
        params.verify(task, self._pooler(), f"model {self.serving.served_model_names[0]!r}")
        return params

    async def create_embedding(self, request: EmbeddingRequest) -> EmbeddingResponse:
        head = self._head(request, "embd")
        params = self._params(request, "embed", dimensions=request.dimensions,
                              normalize=request.normalize)
        outputs = await self._pool(head["id"], _inputs(request.input), params, request.priority)
        data = [
            EmbeddingResponseData(index=i, embedding=vector)
            for i, vector in enumerate(_vectors(outputs, request.encoding_format))
        ]
        return EmbeddingResponse(**head, data=data, usage=self._usage(outputs))

    async def create_pooling(self, request: PoolingRequest) -> PoolingResponse:
        head = self._head(request, "pool")
        task = "encode" if self._pooler().num_labels is None else "classify"
        extra = {} if task == "classify" else {
            "dimensions": request.dimensions, "normalize": request.normalize,
        }
        params = self._params(request, task, **extra)
        outputs = await self._pool(head["id"], _inputs(request.input), params, request.priority)
        data = [
            PoolingResponseData(index=i, data=vector)
            for i, vector in enumerate(_vectors(outputs, request.encoding_format))
        ]
        return PoolingResponse(**head, data=data, usage=self._usage(outputs))

    async def _scores(
        self, request: PoolingBaseRequest, request_id: str, texts_1: list[str],
        texts_2: list[str],
    ) -> tuple[list[float], int]:
        """The pairs' scores and the prompt tokens it took. The pairs are counted before any
        is tokenized."""
        if len(texts_1) > self.serving.limits.max_completion_prompts:
            raise ValueError(
                f"the request has {len(texts_1)} pairs to score, more than "
                f"max_completion_prompts ({self.serving.limits.max_completion_prompts})"
            )
        plan = await self.engine.run_in_pool(
            plan_scores, self._pooler(), self.engine.processor, texts_1, texts_2
        )
        params = self._params(request, plan.task)
        outputs = await self._pool(request_id, plan.prompts, params, request.priority)
        return plan.scores(outputs), self._usage(outputs).prompt_tokens

    async def create_score(self, request: ScoreRequest) -> ScoreResponse:
        head = self._head(request, "score")
        texts_1, texts_2 = pair_score_inputs(request.text_1, request.text_2)
        scores, num_tokens = await self._scores(request, head["id"], texts_1, texts_2)
        return ScoreResponse(
            **head,
            data=[ScoreResponseData(index=i, score=s) for i, s in enumerate(scores)],
            usage=PoolingUsage(prompt_tokens=num_tokens, total_tokens=num_tokens),
        )

    async def do_rerank(self, request: RerankRequest) -> RerankResponse:
        head = self._head(request, "rerank")
        if not request.documents:
            raise ValueError("documents is empty")
        texts_1, texts_2 = pair_score_inputs(request.query, request.documents)
        scores, num_tokens = await self._scores(request, head["id"], texts_1, texts_2)
        results = sorted(
            (RerankResult(index=i, document=RerankDocument(text=d), relevance_score=s)
             for i, (d, s) in enumerate(zip(request.documents, scores, strict=True))),
            key=lambda r: -r.relevance_score,
        )
        if request.top_n:
            results = results[: request.top_n]
        return RerankResponse(id=head["id"], model=head["model"],
                              usage=RerankUsage(total_tokens=num_tokens), results=results)
