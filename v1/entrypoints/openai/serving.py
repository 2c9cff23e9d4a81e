"""The OpenAI endpoints over AsyncLLM: requests in, engine calls, responses or SSE out."""

import logging
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator
from contextlib import aclosing
from typing import Any

import jinja2
from pydantic import BaseModel, ValidationError

from v1.engine.async_llm import AsyncLLM
from v1.engine.exceptions import EngineDeadError
from v1.engine.processor import PromptType
from v1.entrypoints.openai.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatChoiceLogprobs,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogprob,
    ChatStreamChoice,
    ChatTokenLogprob,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    DeltaMessage,
    ErrorResponse,
    ModelCard,
    ModelList,
    PromptTokensDetails,
    SamplingRequest,
    UsageInfo,
)
from v1.outputs import CompletionOutput, Logprob, RequestOutput
from v1.sampling_params import SamplingParams

logger = logging.getLogger("v1.entrypoints.openai")


class ModelNotFoundError(Exception):
    def __init__(self, model: str) -> None:
        super().__init__(f"The model `{model}` does not exist.")


def error_for(exc: Exception) -> ErrorResponse:
    """The OpenAI error for an exception: bad input 400, unknown model 404, else 500."""
    if isinstance(exc, ModelNotFoundError):
        return ErrorResponse.make(404, str(exc), "model")
    # pydantic's ValidationError is a ValueError too, but one here is our bug, not the user's.
    if isinstance(exc, ValueError) and not isinstance(exc, ValidationError):
        return ErrorResponse.make(400, str(exc))
    if isinstance(exc, EngineDeadError):
        return ErrorResponse.make(500, f"the engine has died: {exc}")
    return ErrorResponse.make(500, f"internal server error ({type(exc).__name__})")


class StartedRequest:
    """A request's DELTA outputs, from its first one on. Waiting for that first output makes
    bad input raise its ValueError before the response starts, so it can still get a 400.
    Closing it (early) aborts the request in the engine."""

    def __init__(self, outputs: AsyncGenerator[RequestOutput, None], first: RequestOutput):
        self._outputs = outputs
        self._first = first

    @classmethod
    async def start(
        cls, engine: AsyncLLM, prompt: PromptType, params: SamplingParams, request_id: str,
        priority: int,
    ) -> "StartedRequest":
        outputs = engine.generate(prompt, params, request_id, priority)
        return cls(outputs, await anext(outputs))

    async def __aiter__(self) -> AsyncIterator[RequestOutput]:
        yield self._first
        async for output in self._outputs:
            yield output

    async def aclose(self) -> None:
        await self._outputs.aclose()


class OpenAIServing:
    def __init__(self, engine: AsyncLLM, served_model_names: list[str]) -> None:
        self.engine = engine
        self.served_model_names = served_model_names

    def models(self) -> ModelList:
        created = int(time.time())
        return ModelList(
            data=[
                ModelCard(id=name, created=created, max_model_len=self.engine.max_model_len)
                for name in self.served_model_names
            ]
        )

    async def create_completion(
        self, request: CompletionRequest
    ) -> CompletionResponse | AsyncIterator[str]:
        head = self._head(request, "cmpl")
        params = request.to_sampling_params()
        text, token_ids = self.engine.processor.tokenize_prompt(request.engine_prompt())
        self._check_length(len(token_ids), params.max_tokens, "prompt")
        prompt = {"prompt": text, "prompt_token_ids": token_ids}
        outputs = await StartedRequest.start(
            self.engine, prompt, params, head["id"], request.priority
        )
        k = request.logprobs
        if request.stream:
            return _sse(outputs, _completion_chunks(outputs, head, k, request.include_usage))
        choices, final = await _collect(outputs, params.n)
        return CompletionResponse(
            **head,
            choices=[
                CompletionChoice(
                    index=c.index,
                    text=c.text,
                    logprobs=None if k is None else _completion_logprobs(c, k, 0),
                    finish_reason=c.finish_reason,
                    stop_reason=c.stop_reason,
                )
                for c in choices
            ],
            usage=_usage(final, sum(len(c.token_ids) for c in choices)),
        )

    async def create_chat_completion(
        self, request: ChatCompletionRequest
    ) -> ChatCompletionResponse | AsyncIterator[str]:
        head = self._head(request, "chatcmpl")
        params = request.to_sampling_params()
        try:
            text = self.engine.processor.apply_chat_template(
                [m.to_template_dict() for m in request.messages]
            )
        except jinja2.TemplateError as e:  # the template refused the conversation
            raise ValueError(f"the chat template failed: {e}") from e
        # The template holds the special tokens already: no second BOS (as LLM.chat).
        token_ids = self.engine.tokenizer.encode(text, add_special_tokens=False)
        self._check_length(len(token_ids), params.max_tokens, "messages")
        prompt = {"prompt": text, "prompt_token_ids": token_ids}
        outputs = await StartedRequest.start(
            self.engine, prompt, params, head["id"], request.priority
        )
        k = params.logprobs
        if request.stream:
            chunks = _chat_chunks(outputs, head, params.n, k, request.include_usage)
            return _sse(outputs, chunks)
        choices, final = await _collect(outputs, params.n)
        return ChatCompletionResponse(
            **head,
            choices=[
                ChatChoice(
                    index=c.index,
                    message=AssistantMessage(content=c.text),
                    logprobs=None if k is None else _chat_logprobs(c, k),
                    finish_reason=c.finish_reason,
                    stop_reason=c.stop_reason,
                )
                for c in choices
            ],
            usage=_usage(final, sum(len(c.token_ids) for c in choices)),
        )

    def _head(self, request: SamplingRequest, id_prefix: str) -> dict[str, Any]:
        """The fields every response and chunk of this request starts with."""
        if request.model is not None and request.model not in self.served_model_names:
            raise ModelNotFoundError(request.model)
        request_id = f"{id_prefix}-{uuid.uuid4().hex}"
        # Any served name is accepted; responses report the first, as vLLM documents.
        return {"id": request_id, "created": int(time.time()), "model": self.served_model_names[0]}

    def _check_length(self, num_prompt_tokens: int, max_tokens: int | None, source: str) -> None:
        """Refuse a request that cannot get the tokens it asks for, rather than cut it short
        at max_model_len (None asks for the room left, which must be at least one token)."""
        max_model_len = self.engine.max_model_len
        num_completion_tokens = 1 if max_tokens is None else max_tokens
        requested = num_prompt_tokens + num_completion_tokens
        if requested > max_model_len:
            raise ValueError(
                f"This model's maximum context length is {max_model_len} tokens, but this "
                f"request needs {requested}: {num_prompt_tokens} in the {source} and "
                f"{num_completion_tokens} to generate. Shorten the {source} or lower max_tokens."
            )


async def _sse(outputs: StartedRequest, events: AsyncIterator[BaseModel]) -> AsyncIterator[str]:
    """Server-sent events, ending with [DONE]. Closing this stream (the client went away)
    closes `outputs`, which aborts the request in the engine."""
    async with aclosing(outputs):
        try:
            async for event in events:
                yield f"data: {event.model_dump_json()}\n\n"
        except Exception as e:  # the response has begun: report the error in-band, as OpenAI
            logger.exception("error while streaming a response")
            yield f"data: {error_for(e).model_dump_json()}\n\n"
    yield "data: [DONE]\n\n"


def _has_news(delta: CompletionOutput) -> bool:
    # A token may add no text yet (half a UTF-8 character, or held back as a possible start of
    # a stop string): send a chunk only with text, logprobs or the end.
    return bool(delta.text or delta.logprobs or delta.finish_reason)


class _StreamDeltas:
    """A streamed request's deltas worth a chunk (`_has_news`), counting every generated
    token on the way for the usage block."""

    def __init__(self, outputs: StartedRequest) -> None:
        self._outputs = outputs
        self._last: RequestOutput | None = None
        self._num_generated = 0

    async def __aiter__(self) -> AsyncIterator[CompletionOutput]:
        async for output in self._outputs:
            self._last = output
            for delta in output.outputs:
                self._num_generated += len(delta.token_ids)
                if _has_news(delta):
                    yield delta

    def usage(self) -> UsageInfo:
        assert self._last is not None, "usage before the request's first output"
        return _usage(self._last, self._num_generated)


async def _completion_chunks(
    outputs: StartedRequest, head: dict[str, Any], k: int | None, include_usage: bool
) -> AsyncIterator[CompletionResponse]:
    offsets: dict[int, int] = {}  # per choice, its text length so far (for text_offset)
    deltas = _StreamDeltas(outputs)
    async for delta in deltas:
        logprobs = None
        if k is not None:
            logprobs = _completion_logprobs(delta, k, offsets.get(delta.index, 0))
            offsets[delta.index] = offsets.get(delta.index, 0) + sum(map(len, logprobs.tokens))
        choice = CompletionChoice(
            index=delta.index,
            text=delta.text,
            logprobs=logprobs,
            finish_reason=delta.finish_reason,
            stop_reason=delta.stop_reason,
        )
        yield CompletionResponse(**head, choices=[choice])
    if include_usage:
        yield CompletionResponse(**head, choices=[], usage=deltas.usage())


async def _chat_chunks(
    outputs: StartedRequest, head: dict[str, Any], n: int, k: int | None, include_usage: bool
) -> AsyncIterator[ChatCompletionChunk]:
    for i in range(n):  # as OpenAI, each choice's first chunk gives the role alone
        role = DeltaMessage(role="assistant", content="")
        yield ChatCompletionChunk(**head, choices=[ChatStreamChoice(index=i, delta=role)])
    deltas = _StreamDeltas(outputs)
    async for delta in deltas:
        choice = ChatStreamChoice(
            index=delta.index,
            delta=DeltaMessage(content=delta.text),
            logprobs=None if k is None else _chat_logprobs(delta, k),
            finish_reason=delta.finish_reason,
            stop_reason=delta.stop_reason,
        )
        yield ChatCompletionChunk(**head, choices=[choice])
    if include_usage:
        yield ChatCompletionChunk(**head, choices=[], usage=deltas.usage())


async def _collect(
    outputs: StartedRequest, n: int
) -> tuple[list[CompletionOutput], RequestOutput]:
    """A non-streamed request's n choices, put together from its deltas, and its last output."""
    choices = [CompletionOutput(i, "", [], None, []) for i in range(n)]
    async with aclosing(outputs):
        async for output in outputs:
            for delta in output.outputs:
                c = choices[delta.index]
                c.text += delta.text
                c.token_ids += delta.token_ids
                c.logprobs += delta.logprobs or []  # type: ignore[operator]
                c.finish_reason, c.stop_reason = delta.finish_reason, delta.stop_reason
    return choices, output


def _usage(final: RequestOutput, num_generated: int) -> UsageInfo:
    num_prompt = len(final.prompt_token_ids)
    return UsageInfo(
        prompt_tokens=num_prompt,
        completion_tokens=num_generated,
        total_tokens=num_prompt + num_generated,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=final.num_cached_tokens),
    )


def _top(logprobs: dict[int, Logprob], k: int) -> list[Logprob]:
    # The dict holds the sampled token and the top k; the sampled one may rank below k.
    return sorted(logprobs.values(), key=lambda lp: lp.rank or 0)[:k]


def _completion_logprobs(c: CompletionOutput, k: int, offset: int) -> CompletionLogprobs:
    result = CompletionLogprobs()
    for token_id, logprobs in zip(c.token_ids, c.logprobs or [], strict=True):
        sampled = logprobs[token_id]
        token = sampled.decoded_token or ""
        result.tokens.append(token)
        result.token_logprobs.append(sampled.logprob)
        result.top_logprobs.append({lp.decoded_token or "": lp.logprob for lp in _top(logprobs, k)})
        result.text_offset.append(offset)
        offset += len(token)
    return result


def _chat_logprob(lp: Logprob) -> dict[str, Any]:
    token = lp.decoded_token or ""
    return {"token": token, "logprob": lp.logprob, "bytes": list(token.encode())}


def _chat_logprobs(c: CompletionOutput, k: int) -> ChatChoiceLogprobs:
    return ChatChoiceLogprobs(
        content=[
            ChatTokenLogprob(
                **_chat_logprob(logprobs[token_id]),
                top_logprobs=[ChatLogprob(**_chat_logprob(lp)) for lp in _top(logprobs, k)],
            )
            for token_id, logprobs in zip(c.token_ids, c.logprobs or [], strict=True)
        ]
    )
