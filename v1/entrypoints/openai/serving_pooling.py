"""The pooling endpoints over AsyncLLM (a server started with --runner pooling): /v1/embeddings
(OpenAI's), /pooling, /classify, /score and /rerank (vLLM's).

Each input of a request becomes one pooling request in the engine, all in flight at once
(the scheduler batches them with every other client's); the response lists them in input
order. A client that disconnects cancels the gather, which aborts every request of it still
in the engine. On a generating server these routes answer 400, as vLLM's do.
"""

import asyncio
import base64
import dataclasses
import json
import time
import uuid
from collections.abc import Sequence
from typing import Any

from starlette.responses import Response

from v1.engine.processor import PromptType
from v1.entrypoints.openai.protocol_pooling import (
    ClassificationData,
    ClassificationRequest,
    ClassificationResponse,
    EmbeddingRequest,
    EmbeddingResponse,
    EmbeddingResponseData,
    EncodingRequest,
    InputOrMessagesRequest,
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
    ScoringRequest,
)
from v1.entrypoints.openai.serving import OpenAIServing
from v1.entrypoints.score_utils import pair_score_inputs, plan_scores
from v1.outputs import PoolingOutput, PoolingRequestOutput
from v1.pooling_params import PoolerInfo, PoolingParams
from v1.utils.serial_utils import encode_vectors, tensor2binary

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


def _vectors(outputs: Outputs, request: EncodingRequest) -> list[list[float] | str]:
    """Each output's vector as a JSON response carries it: floats, or base64 of its bytes in
    the request's dtype and byte order (encoded from the tensor, not from its list)."""
    if request.encoding_format == "base64":
        return [
            base64.b64encode(
                tensor2binary(o.outputs.data, request.embed_dtype, request.endianness)
            ).decode()
            for o in outputs
        ]
    return [o.outputs.data.tolist() for o in outputs]


def _bytes_response(
    outputs: Outputs, request: EncodingRequest, head: dict[str, Any], usage: PoolingUsage
) -> Response:
    """vLLM's "bytes" answer: the vectors back to back; "bytes" adds a `metadata` header (the
    response's head and usage, and where each vector is), "bytes_only" does not."""
    body, items = encode_vectors(
        [o.outputs.data for o in outputs], request.embed_dtype, request.endianness
    )
    headers = None
    if request.encoding_format == "bytes":
        headers = {"metadata": json.dumps({
            **head, "data": [dataclasses.asdict(item) for item in items],
            "usage": {"prompt_tokens": usage.prompt_tokens, "total_tokens": usage.total_tokens},
        })}
    return Response(body, headers=headers, media_type="application/octet-stream")


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

    async def _prompts(self, request: InputOrMessagesRequest) -> list[PromptType]:
        """The request's `input`, or its conversation rendered with the chat template."""
        if request.messages is None:
            assert request.input is not None  # the request's validator
            return _inputs(request.input)
        text, token_ids = await self.engine.run_in_pool(
            self.serving.render_chat, [m.to_template_dict() for m in request.messages],
            request.add_generation_prompt, request.continue_final_message,
            request.chat_template_kwargs,
        )
        return [{"prompt": text, "prompt_token_ids": token_ids}]

    async def create_embedding(self, request: EmbeddingRequest) -> EmbeddingResponse | Response:
        head = self._head(request, "embd")
        params = self._params(request, "embed", dimensions=request.dimensions,
                              normalize=request.normalize_embedding)
        outputs = await self._pool(head["id"], await self._prompts(request), params,
                                   request.priority)
        if request.encoding_format in ("bytes", "bytes_only"):
            return _bytes_response(outputs, request, head, self._usage(outputs))
        data = [
            EmbeddingResponseData(index=i, embedding=vector)
            for i, vector in enumerate(_vectors(outputs, request))
        ]
        return EmbeddingResponse(**head, data=data, usage=self._usage(outputs))

    async def create_pooling(self, request: PoolingRequest) -> PoolingResponse | Response:
        head = self._head(request, "pool")
        task = request.task or ("encode" if self._pooler().num_labels is None else "classify")
        # What the task does not take is refused by `PoolingParams.verify`, not dropped.
        if task == "classify":
            extra = {"use_activation": request.use_activation, "normalize": request.normalize}
        else:
            extra = {"normalize": request.normalize_embedding}
        params = self._params(request, task, dimensions=request.dimensions, **extra)
        outputs = await self._pool(head["id"], await self._prompts(request), params,
                                   request.priority)
        if request.encoding_format in ("bytes", "bytes_only"):
            return _bytes_response(outputs, request, head, self._usage(outputs))
        data = [
            PoolingResponseData(index=i, data=vector)
            for i, vector in enumerate(_vectors(outputs, request))
        ]
        return PoolingResponse(**head, data=data, usage=self._usage(outputs))

    async def create_classify(self, request: ClassificationRequest) -> ClassificationResponse:
        """Each prompt's class probabilities, and the most probable class's label."""
        head = self._head(request, "classify")
        params = self._params(request, "classify", use_activation=request.use_activation)
        outputs = await self._pool(head["id"], await self._prompts(request), params,
                                   request.priority)
        labels = self._pooler().labels
        data = []
        for i, output in enumerate(outputs):
            probs = output.outputs.data.tolist()
            best = max(range(len(probs)), key=probs.__getitem__)
            data.append(ClassificationData(
                index=i, label=labels[best] if labels else None, probs=probs,
                num_classes=len(probs),
            ))
        return ClassificationResponse(**head, data=data, usage=self._usage(outputs))

    async def _scores(
        self, request: ScoringRequest, request_id: str, texts_1: list[str],
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
        # A cross-encoder's activation is its sigmoid; a cosine ignores an embedding's norm.
        extra = {"use_activation": request.use_activation} if plan.task == "score" else {}
        params = self._params(request, plan.task, **extra)
        outputs = await self._pool(request_id, plan.prompts, params, request.priority)
        return plan.scores(outputs), self._usage(outputs).prompt_tokens

    async def create_score(self, request: ScoreRequest) -> ScoreResponse:
        head = self._head(request, "score")
        texts_1, texts_2 = pair_score_inputs(*request.sides)
        scores, num_tokens = await self._scores(request, head["id"], texts_1, texts_2)
        return ScoreResponse(
            **head,
            data=[ScoreResponseData(index=i, score=s) for i, s in enumerate(scores)],
            usage=PoolingUsage(prompt_tokens=num_tokens, total_tokens=num_tokens),
        )

    async def do_rerank(self, request: RerankRequest) -> RerankResponse:
        head = self._head(request, "rerank")
        documents = request.documents
        documents = [documents] if isinstance(documents, str) else documents
        if not documents:
            raise ValueError("documents is empty")
        texts_1, texts_2 = pair_score_inputs(request.query, documents)
        scores, num_tokens = await self._scores(request, head["id"], texts_1, texts_2)
        results = sorted(
            (RerankResult(index=i, document=RerankDocument(text=d), relevance_score=s)
             for i, (d, s) in enumerate(zip(documents, scores, strict=True))),
            key=lambda r: -r.relevance_score,
        )
        if request.top_n:
            results = results[: request.top_n]
        usage = RerankUsage(prompt_tokens=num_tokens, total_tokens=num_tokens)
        return RerankResponse(id=head["id"], model=head["model"], usage=usage, results=results)
