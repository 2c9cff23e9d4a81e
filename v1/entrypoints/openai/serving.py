"""The OpenAI endpoints over AsyncLLM: requests in, engine calls, responses or SSE out."""

import asyncio
import dataclasses
import logging
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Sequence
from contextlib import aclosing
from typing import Any, NamedTuple

from pydantic import BaseModel, ValidationError

from v1.config.limits import check_limit_fields, limit_field
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
    ChatTemplateRequest,
    ChatTokenLogprob,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    DeltaMessage,
    DetokenizeRequest,
    DetokenizeResponse,
    EngineRequest,
    ErrorResponse,
    ModelList,
    PromptTokensDetails,
    SamplingRequest,
    TokenizeChatRequest,
    TokenizeRequest,
    TokenizeResponse,
    UsageInfo,
    clamp_logprob,
)
from v1.entrypoints.openai.serving_beam_search import (
    beam_choices,
    beam_search_params,
    run_beam_search,
)
from v1.entrypoints.openai.serving_models import ModelNotFoundError, OpenAIServingModels
from v1.entrypoints.openai.tool_calls import (
    ToolCallExtractor,
    ToolDelta,
    constrain_auto_tool_calls,
    merge_tool_calls,
    tool_call_extractor,
)
from v1.lora.request import LoRARequest
from v1.outputs import CompletionOutput, Logprob, PromptLogprobs, RequestOutput
from v1.reasoning import ReasoningDelta, ReasoningParser, ReasoningParserManager
from v1.sampling_params import RequestOutputKind, SamplingParams

logger = logging.getLogger("v1.entrypoints.openai")


class _Echo(NamedTuple):
    """What `echo` puts before a completion: the prompt's text, token ids and (with logprobs)
    their logprobs; the first token has none, and no Logprob carries its text."""

    text: str
    token_ids: list[int]
    logprobs: list[dict[int, Logprob] | None]
    first_token_text: str

    def prepend(
        self, c: CompletionOutput
    ) -> tuple[str, list[int], list[dict[int, Logprob] | None]]:
        if self is _NO_ECHO:  # the common case: no copies per streamed delta
            return c.text, c.token_ids, c.logprobs or []
        logprobs = [*self.logprobs, *(c.logprobs or [])]
        return self.text + c.text, self.token_ids + c.token_ids, logprobs


_NO_ECHO = _Echo("", [], [], "")


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
    """The DELTA outputs of a request's prompts (one, or a completion's batch), merged as they
    come, with a batch's choices numbered on (prompt i's choice j is i * n + j, as vLLM).
    Waiting for every prompt's first output makes bad input raise its ValueError before the
    response starts, so it can still get a 400. Closing it (early) aborts them in the engine."""

    def __init__(
        self, streams: list[AsyncGenerator[RequestOutput, None]], firsts: list[RequestOutput],
        n: int,
    ) -> None:
        self._streams = streams
        self._last = firsts  # per prompt, its latest output (for usage)
        # Per prompt, its prompt logprobs once an output had them (only one does, in delta mode).
        self._prompt_logprobs = [output.prompt_logprobs for output in firsts]
        self._n = n
        self._pending: dict[asyncio.Future[RequestOutput], int] = {}  # next output: prompt

    @classmethod
    async def start(
        cls, engine: AsyncLLM, prompts: list[PromptType], params: SamplingParams,
        request_id: str, request: EngineRequest, lora_request: LoRARequest | None = None,
    ) -> "StartedRequest":
        # Streamed or not, every response is built from the deltas.
        params = dataclasses.replace(params, output_kind=RequestOutputKind.DELTA)
        streams = [
            engine.generate(
                prompt, params, f"{request_id}-{i}", request.priority, request.data_parallel_rank,
                lora_request,
            )
            for i, prompt in enumerate(prompts)
        ]
        firsts = [asyncio.ensure_future(anext(stream)) for stream in streams]
        try:
            await asyncio.gather(*firsts)
        except BaseException:  # bad input, or the client left: abort every prompt
            for task in firsts:
                task.cancel()
            await asyncio.wait(firsts)
            for stream in streams:
                await stream.aclose()
            raise
        return cls(streams, [task.result() for task in firsts], params.n)

    @property
    def num_choices(self) -> int:
        return self._n * len(self._streams)

    async def __aiter__(self) -> AsyncIterator[RequestOutput]:
        for i, first in enumerate(self._last):
            yield self._numbered(i, first)
        self._pending = {
            asyncio.ensure_future(anext(stream)): i for i, stream in enumerate(self._streams)
        }
        while self._pending:
            done, _ = await asyncio.wait(self._pending, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                i = self._pending.pop(task)
                try:
                    output = task.result()
                except StopAsyncIteration:
                    continue
                self._last[i] = output
                if output.prompt_logprobs is not None:
                    self._prompt_logprobs[i] = output.prompt_logprobs
                yield self._numbered(i, output)
                self._pending[asyncio.ensure_future(anext(self._streams[i]))] = i

    def _numbered(self, i: int, output: RequestOutput) -> RequestOutput:
        if i == 0:
            return output
        outputs = [dataclasses.replace(c, index=i * self._n + c.index) for c in output.outputs]
        return dataclasses.replace(output, outputs=outputs)

    def prompt_of(self, choice_index: int) -> tuple[RequestOutput, PromptLogprobs | None]:
        """A choice's prompt: the latest output of it (its text and token ids) and its prompt
        logprobs."""
        i = choice_index // self._n
        return self._last[i], self._prompt_logprobs[i]

    def usage(self, num_generated: int, choice_index: int | None = None) -> UsageInfo:
        """The usage of every prompt, or of `choice_index`'s alone (a streamed chunk's
        continuous usage), with `num_generated` completion tokens."""
        prompts = self._last if choice_index is None else [self.prompt_of(choice_index)[0]]
        num_prompt = sum(len(output.prompt_token_ids) for output in prompts)
        return UsageInfo(
            prompt_tokens=num_prompt,
            completion_tokens=num_generated,
            total_tokens=num_prompt + num_generated,
            prompt_tokens_details=PromptTokensDetails(
                cached_tokens=sum(output.num_cached_tokens for output in prompts)
            ),
        )

    async def aclose(self) -> None:
        # A stream with an output pending is running: cancel that first (it aborts then).
        for task in self._pending:
            task.cancel()
        if self._pending:
            await asyncio.wait(self._pending)
        self._pending = {}
        for stream in self._streams:
            await stream.aclose()


@dataclasses.dataclass(frozen=True, slots=True)
class ServerLimits:
    """What one HTTP request may be, beyond the engine's `InputLimits` (server flags of the
    same names)."""

    max_request_body_bytes: int = limit_field(
        16 * 1024 * 1024, "the largest request body, in bytes: a larger one is refused "
        "before more is read (the body is JSON the server parses whole)",
    )
    max_completion_prompts: int = limit_field(
        1024, "the most prompts one completion request may batch, each n sequences in the "
        "engine (vLLM's VLLM_MAX_COMPLETION_PROMPTS)",
    )
    max_request_sequences: int = limit_field(
        1024, "the most sequences one request may start: its prompts times n (best_of is n), "
        "which max_completion_prompts and max_n_sequences alone bound only by their product",
    )
    max_request_prompt_logprobs: int = limit_field(
        256 * 1024, "the most prompt logprobs one request may ask for: its prompts' tokens "
        "times (prompt_logprobs + 1) entries, held until the request ends",
    )
    max_request_json_values: int = limit_field(
        1024 * 1024, "the most values (numbers, strings, array elements, object members) a "
        "request body's JSON may hold, counted by the commas between them before it is "
        "parsed: parsing and validating them runs on the event loop every stream shares "
        "(~0.3 us each; 5M token ids stalled every stream for 3.5 s)",
    )
    max_body_bytes_in_flight: int = limit_field(
        256 * 1024 * 1024, "the most bytes of request bodies the server holds for requests "
        "whose response has not started (parsed, validated, tokenized, queued), counted as "
        "they arrive: a request whose body would pass it is refused with a 503, before its "
        "body is read where its Content-Length says so",
    )
    max_request_body_seconds: int = limit_field(
        60, "the most seconds a request's body may take to arrive: a slower one gets a 408 "
        "(clients that announce a body and send it slowly, or never, would otherwise hold "
        "their bytes of max_body_bytes_in_flight and a connection indefinitely)",
    )

    def __post_init__(self) -> None:
        check_limit_fields(self)
        if self.max_body_bytes_in_flight < self.max_request_body_bytes:  # one could never pass
            raise ValueError(
                f"max_body_bytes_in_flight ({self.max_body_bytes_in_flight}) must be at least "
                f"max_request_body_bytes ({self.max_request_body_bytes})"
            )


class OpenAIServing:
    def __init__(
        self, engine: AsyncLLM, served_model_names: list[str], chat_template: str | None = None,
        tool_parser: str | None = None, default_sampling_params: dict[str, Any] | None = None,
        limits: ServerLimits = ServerLimits(), model_path: str = "",
        reasoning_parser: str | None = None,
    ) -> None:
        self.engine = engine
        self.limits = limits
        self.served_model_names = served_model_names
        # The base model's names and the LoRA adapters: what a request's `model` may name.
        self.serving_models = OpenAIServingModels(engine, served_model_names, model_path)
        self.chat_template = chat_template  # None: the model's own
        self.tool_parser = tool_parser  # None: no "auto" tool choice
        # None: chat replies are all content.
        self.reasoning_parser = (
            None if reasoning_parser is None
            else ReasoningParserManager.get_reasoning_parser(reasoning_parser)
        )
        # For the fields a request does not set: generation_config.json's (vLLM's "auto").
        self.default_sampling_params = default_sampling_params or {}

    def models(self) -> ModelList:
        return self.serving_models.models()

    async def create_completion(
        self, request: CompletionRequest
    ) -> CompletionResponse | AsyncIterator[str]:
        head, lora = self._head(request, "cmpl")
        # In the pool: SamplingParams checks every listed token id (up to max_request_token_ids).
        params = await self.engine.run_in_pool(
            request.to_sampling_params, self.engine.processor.limits
        )
        prompts = await self.engine.run_in_pool(self._completion_prompts, request, params)
        params = self.with_defaults(request, params)
        if request.use_beam_search:
            return await self._beam_search_completion(request, head, lora, params, prompts)
        outputs = await StartedRequest.start(
            self.engine, prompts, params, head["id"], request, lora
        )
        k = request.logprobs
        if request.stream:
            echo = None
            if request.echo:
                def echo(i: int) -> _Echo:
                    return self._echo(*outputs.prompt_of(i), k)
            chunks = _completion_chunks(outputs, head, k, StreamUsage.of(request), echo)
            return sse_stream(outputs, chunks)
        choices, usage = await collect(outputs)
        return CompletionResponse(
            **head,
            choices=[
                self._completion_choice(c, *outputs.prompt_of(c.index), request) for c in choices
            ],
            usage=usage,
        )

    async def _beam_search_completion(
        self, request: CompletionRequest, head: dict[str, Any], lora: LoRARequest | None,
        params: SamplingParams, prompts: list[PromptType],
    ) -> CompletionResponse:
        """vLLM's `use_beam_search`: each prompt's n best sequences by beam search."""
        search = beam_search_params(request, params)
        outputs = await run_beam_search(self.engine, prompts, search, head["id"], request, lora)
        prompt_lens = [len(p["prompt_token_ids"]) for p in prompts]  # type: ignore[index]
        choices, num_generated = beam_choices(
            outputs, prompt_lens, search.beam_width, self.engine.tokenizer.decode,
            params.skip_special_tokens,
        )
        num_prompt = sum(prompt_lens)
        usage = UsageInfo(prompt_tokens=num_prompt, completion_tokens=num_generated,
                          total_tokens=num_prompt + num_generated,
                          prompt_tokens_details=PromptTokensDetails(cached_tokens=0))
        return CompletionResponse(**head, choices=choices, usage=usage)

    def _completion_prompts(
        self, request: CompletionRequest, params: SamplingParams
    ) -> list[PromptType]:
        """The request's prompts, tokenized once (the engine takes the ids) and each checked
        to leave room for max_tokens."""
        engine_prompts = request.engine_prompts()
        if len(engine_prompts) > self.limits.max_completion_prompts:
            raise ValueError(
                f"prompt has {len(engine_prompts)} prompts, more than max_completion_prompts "
                f"({self.limits.max_completion_prompts})"
            )
        num_sequences = len(engine_prompts) * params.n
        # n alone over max_n_sequences: the processor refuses it, naming that limit.
        n_fits = params.n <= self.engine.processor.limits.max_n_sequences
        if n_fits and num_sequences > self.limits.max_request_sequences:
            raise ValueError(
                f"the request asks for {num_sequences} sequences ({len(engine_prompts)} "
                f"prompts times n={params.n}), more than max_request_sequences "
                f"({self.limits.max_request_sequences})"
            )
        prompts: list[PromptType] = []
        num_prompt_tokens = 0
        for engine_prompt in engine_prompts:
            text, token_ids = self.engine.processor.tokenize_prompt(engine_prompt)
            self.check_length(len(token_ids), params.max_tokens, "prompt")
            num_prompt_tokens += len(token_ids)
            self.check_prompt_logprobs(num_prompt_tokens, params)
            prompts.append(self.engine_prompt(request, text, token_ids))
        return prompts

    def check_prompt_logprobs(self, num_prompt_tokens: int, params: SamplingParams) -> None:
        """Refuse prompt logprobs over `max_request_prompt_logprobs`: `num_prompt_tokens`
        (the request's prompts' so far) times the k + 1 entries each position holds."""
        k = params.prompt_logprobs
        if k is None or num_prompt_tokens * (k + 1) <= self.limits.max_request_prompt_logprobs:
            return
        raise ValueError(
            f"prompt_logprobs={k} over at least {num_prompt_tokens} prompt tokens asks for "
            f"{num_prompt_tokens * (k + 1)} logprobs, more than max_request_prompt_logprobs "
            f"({self.limits.max_request_prompt_logprobs})"
        )

    def _completion_choice(
        self,
        c: CompletionOutput,
        prompt: RequestOutput,
        prompt_logprobs: PromptLogprobs | None,
        request: CompletionRequest,
    ) -> CompletionChoice:
        """A finished choice; with `echo`, its prompt's text (and tokens' logprobs) first."""
        k = request.logprobs
        echo = _NO_ECHO
        if request.echo:
            echo = self._echo(prompt, prompt_logprobs, k)
        text, token_ids, logprobs = echo.prepend(c)
        return CompletionChoice(
            index=c.index,
            text=text,
            logprobs=(
                None if k is None
                else _completion_logprobs(token_ids, logprobs, k, 0, echo.first_token_text)
            ),
            finish_reason=c.finish_reason,
            stop_reason=c.stop_reason,
            prompt_logprobs=prompt_logprobs,
        )

    def _echo(
        self, prompt: RequestOutput, prompt_logprobs: PromptLogprobs | None, k: int | None
    ) -> "_Echo":
        """A prompt as echoed: its text and token ids, with logprobs their prompt logprobs
        (asked for with k, see `CompletionRequest.to_sampling_params`)."""
        tokenizer = self.engine.tokenizer
        prompt_ids = prompt.prompt_token_ids
        text = prompt.prompt
        if text is None:  # given as token ids
            text = tokenizer.decode(prompt_ids)
        if k is None:
            return _Echo(text, prompt_ids, [], "")
        assert prompt_logprobs is not None
        first_token_text = tokenizer.decode(prompt_ids[:1], skip_special_tokens=False)
        return _Echo(text, prompt_ids, list(prompt_logprobs), first_token_text)

    async def create_chat_completion(
        self, request: ChatCompletionRequest
    ) -> ChatCompletionResponse | AsyncIterator[str]:
        head, lora = self._head(request, "chatcmpl")
        params = constrain_auto_tool_calls(request, await self.engine.run_in_pool(
            request.to_sampling_params, self.engine.processor.limits
        ), self.tool_parser)
        tool_calls = _ChatParsers(
            request, self.tool_parser, reasoning_parser_for(params, self.reasoning_parser)
        )
        text, token_ids = await self.engine.run_in_pool(self._chat_prompt, request)
        self.check_length(len(token_ids), params.max_tokens, "messages")
        self.check_prompt_logprobs(len(token_ids), params)
        params = self.with_defaults(request, params)
        outputs = await StartedRequest.start(
            self.engine, [self.engine_prompt(request, text, token_ids)], params, head["id"],
            request, lora,
        )
        k = params.logprobs
        echo = request.echoed_content()
        if request.stream:
            chunks = _chat_chunks(outputs, head, k, StreamUsage.of(request), tool_calls, echo)
            return sse_stream(outputs, chunks)
        choices, usage = await collect(outputs)
        messages = [tool_calls.message(c) for c in choices]
        if echo:
            for message in messages:
                message.content = echo + (message.content or "")
        return ChatCompletionResponse(
            **head,
            choices=[
                ChatChoice(
                    index=c.index,
                    message=message,
                    logprobs=None if k is None else _chat_logprobs(c, k),
                    finish_reason=tool_calls.finish_reason(c),
                    stop_reason=c.stop_reason,
                )
                for c, message in zip(choices, messages, strict=True)
            ],
            usage=usage,
            prompt_logprobs=outputs.prompt_of(0)[1],
        )

    async def tokenize(self, request: TokenizeRequest) -> TokenizeResponse:
        """A prompt's token ids as a completion would get them, or a conversation's as a chat
        completion would."""
        self.check_model(request.model)
        if isinstance(request, TokenizeChatRequest):
            _, token_ids = await self.engine.run_in_pool(self._chat_prompt, request)
        else:
            processor = self.engine.processor
            _, token_ids = await self.engine.run_in_pool(processor.tokenize_prompt, request.prompt)
        return TokenizeResponse(
            count=len(token_ids), max_model_len=self.engine.max_model_len, tokens=token_ids
        )

    async def detokenize(self, request: DetokenizeRequest) -> DetokenizeResponse:
        self.check_model(request.model)
        return DetokenizeResponse(prompt=await self.engine.run_in_pool(self._decode, request))

    def _decode(self, request: DetokenizeRequest) -> str:
        _, token_ids = self.engine.processor.tokenize_prompt(request.tokens)  # in vocabulary
        return self.engine.tokenizer.decode(token_ids)

    def _chat_prompt(self, request: ChatTemplateRequest) -> tuple[str, list[int]]:
        return self.render_chat(
            [m.to_template_dict() for m in request.messages],
            request.add_generation_prompt,
            request.continue_final_message,
            request.chat_template_kwargs,
            request.template_tools(),
        )

    def render_chat(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template_kwargs: dict[str, Any] | None = None,
        tools: list[dict[str, Any]] | None = None,
    ) -> tuple[str, list[int]]:
        """A conversation (template dicts) rendered with the server's chat template and
        tokenized: CPU work for `AsyncLLM.run_in_pool`."""
        text = self.engine.processor.apply_chat_template(
            messages, self.chat_template, add_generation_prompt, continue_final_message,
            chat_template_kwargs, tools,
        )
        return text, self.engine.processor.encode_conversation(text)

    @staticmethod
    def engine_prompt(
        request: EngineRequest, text: str | None, token_ids: list[int]
    ) -> PromptType:
        return {"prompt": text, "prompt_token_ids": token_ids, "cache_salt": request.cache_salt}

    def check_model(self, model: str | None) -> LoRARequest | None:
        """The LoRA adapter `model` names (None: the base model); 404 for an unknown name."""
        return self.serving_models.lora_for(model)

    def _head(
        self, request: SamplingRequest, id_prefix: str
    ) -> tuple[dict[str, Any], LoRARequest | None]:
        """The fields every response and chunk of this request starts with, and its adapter."""
        lora = self.check_model(request.model)
        request_id = f"{id_prefix}-{uuid.uuid4().hex}"
        # Any served name is accepted; responses report the first, as vLLM documents (an
        # adapter's own name for an adapter, as vLLM's).
        model = self.served_model_names[0] if lora is None else lora.lora_name
        return {"id": request_id, "created": int(time.time()), "model": model}, lora

    def with_defaults(self, request: EngineRequest, params: SamplingParams) -> SamplingParams:
        """`params` with the model's default sampling parameters for the fields `request` did
        not set, as vLLM's. Applied after the length check, which holds a request to its own
        max_tokens: a default one only caps what is generated (at most up to max_model_len)."""
        given = request.sampling_fields_set
        defaults = {k: v for k, v in self.default_sampling_params.items() if k not in given}
        return dataclasses.replace(params, **defaults) if defaults else params

    def fits(self, num_prompt_tokens: int, max_tokens: int | None) -> bool:
        """Whether a prompt leaves room for max_tokens (None: for one token at least)."""
        return _tokens_needed(num_prompt_tokens, max_tokens) <= self.engine.max_model_len

    def check_length(
        self, num_prompt_tokens: int, max_tokens: int | None, source: str,
        max_tokens_name: str = "max_tokens",
    ) -> None:
        """Refuse a request that cannot get the tokens it asks for, rather than cut it short
        at max_model_len (None asks for the room left, which must be at least one token).
        `source` and `max_tokens_name` are the request's names for its prompt and limit."""
        if self.fits(num_prompt_tokens, max_tokens):
            return
        requested = _tokens_needed(num_prompt_tokens, max_tokens)
        raise ValueError(
            f"This model's maximum context length is {self.engine.max_model_len} tokens, but "
            f"this request needs {requested}: {num_prompt_tokens} in the {source} and "
            f"{requested - num_prompt_tokens} to generate. Shorten the {source} or lower "
            f"{max_tokens_name}."
        )


def _tokens_needed(num_prompt_tokens: int, max_tokens: int | None) -> int:
    return num_prompt_tokens + (1 if max_tokens is None else max_tokens)


async def sse_stream(
    outputs: StartedRequest, events: AsyncIterator[BaseModel],
    on_error: Callable[[Exception], BaseModel] = error_for, named: bool = False,
) -> AsyncIterator[str]:
    """Server-sent events: `data: JSON` lines, ending with [DONE]; or, `named` (the Responses
    API's), each after an `event: <its type>` line and no [DONE], as OpenAI sends them. An
    error once the response has begun is reported in-band, as `on_error` makes it. Closing
    this stream (the client went away) closes `outputs`, which aborts the request in the
    engine."""

    def encode(event: BaseModel) -> str:
        data = f"data: {event.model_dump_json()}\n\n"
        # Named events are the Responses API's, which all have a type.
        return f"event: {event.type}\n{data}" if named else data  # type: ignore[attr-defined]

    async with aclosing(outputs):
        try:
            async for event in events:
                yield encode(event)
        except Exception as e:
            logger.exception("error while streaming a response")
            yield encode(on_error(e))
    if not named:
        yield "data: [DONE]\n\n"


def _has_news(delta: CompletionOutput) -> bool:
    # A token may add no text yet (half a UTF-8 character, or held back as a possible start of
    # a stop string): send a chunk only with text, logprobs or the end.
    return bool(delta.text or delta.logprobs or delta.finish_reason)


class StreamUsage(NamedTuple):
    """What a stream reports of its usage (`stream_options`): a last chunk with the whole
    request's, and with `continuous` also each chunk its choice's so far (vLLM's)."""

    final: bool
    continuous: bool

    @classmethod
    def of(cls, request: SamplingRequest) -> "StreamUsage":
        return cls(request.include_usage, request.continuous_usage)


class StreamDeltas:
    """A streamed request's deltas worth a chunk (`_has_news`), counting every generated
    token on the way (per choice) for the usage blocks."""

    def __init__(self, outputs: StartedRequest, usage: StreamUsage) -> None:
        self._outputs = outputs
        self._usage = usage
        self._num_generated: dict[int, int] = {}  # per choice index

    async def __aiter__(self) -> AsyncIterator[CompletionOutput]:
        async for output in self._outputs:
            for delta in output.outputs:
                num = self._num_generated.get(delta.index, 0) + len(delta.token_ids)
                self._num_generated[delta.index] = num
                if _has_news(delta):
                    yield delta

    def chunk_usage(self, choice_index: int) -> UsageInfo | None:
        """A chunk's usage: its choice's so far when continuous (as vLLM: before the choice's
        first token, 0 completion tokens), else none."""
        if not self._usage.continuous:
            return None
        return self._outputs.usage(self._num_generated.get(choice_index, 0), choice_index)

    def final_usage(self) -> UsageInfo | None:
        """The last chunk's usage, the whole request's, if asked for."""
        if not self._usage.final:
            return None
        return self._outputs.usage(sum(self._num_generated.values()))


async def _completion_chunks(
    outputs: StartedRequest, head: dict[str, Any], k: int | None, usage: StreamUsage,
    echo: Callable[[int], _Echo] | None,
) -> AsyncIterator[CompletionResponse]:
    """With `echo` (choice index -> its prompt), each choice's first chunk starts with it."""
    offsets: dict[int, int] = {}  # per choice, its tokens' text length so far (text_offset)
    started: set[int] = set()
    deltas = StreamDeltas(outputs, usage)
    async for delta in deltas:
        echoed = _NO_ECHO
        if echo is not None and delta.index not in started:
            echoed = echo(delta.index)
        started.add(delta.index)
        text, token_ids, lps = echoed.prepend(delta)
        logprobs = None
        if k is not None:
            offset = offsets.get(delta.index, 0)
            logprobs = _completion_logprobs(token_ids, lps, k, offset, echoed.first_token_text)
            offsets[delta.index] = offset + sum(map(len, logprobs.tokens))
        choice = CompletionChoice(
            index=delta.index,
            text=text,
            logprobs=logprobs,
            finish_reason=delta.finish_reason,
            stop_reason=delta.stop_reason,
        )
        yield CompletionResponse(**head, choices=[choice], usage=deltas.chunk_usage(delta.index))
    final_usage = deltas.final_usage()
    if final_usage is not None:
        yield CompletionResponse(**head, choices=[], usage=final_usage)


def reasoning_parser_for(
    params: SamplingParams, parser: type[ReasoningParser] | None
) -> type[ReasoningParser] | None:
    """The reasoning parser of a chat request's output: none when a grammar holds the output
    from its first token (a response_format, a named or required tool choice), which leaves
    no reasoning to split off; a structural tag (strict tools under "auto") allows free text."""
    structured = params.structured_outputs
    if structured is not None and structured.structural_tag is None:
        return None
    return parser


class _ChatParsers:
    """A chat request's output parsers, per choice: its reasoning parser (with
    --reasoning-parser), then its tool-call extractor (none without tool calling) over the
    text after the reasoning; and what they make of the choice's message and finish
    reason."""

    def __init__(
        self, request: ChatCompletionRequest, parser: str | None,
        reasoning_parser: type[ReasoningParser] | None,
    ) -> None:
        self._request, self._parser = request, parser
        self._reasoning_parser = reasoning_parser
        self._reasoning: dict[int, ReasoningParser] = {}
        # Bad input (an "auto" choice the server was not started for) raises here, up front.
        self._extractors = {0: tool_call_extractor(request, parser)}

    def extractor(self, index: int) -> ToolCallExtractor | None:
        if index not in self._extractors:
            self._extractors[index] = tool_call_extractor(self._request, self._parser)
        return self._extractors[index]

    def _split_reasoning(self, c: CompletionOutput) -> ReasoningDelta:
        if self._reasoning_parser is None:
            return ReasoningDelta("", c.text)
        parser = self._reasoning.get(c.index)
        if parser is None:
            parser = self._reasoning[c.index] = self._reasoning_parser(
                self._request.chat_template_kwargs
            )
        got = parser.feed(c.text)
        if c.finish_reason is not None:
            rest = parser.finish()
            got = ReasoningDelta(got.reasoning + rest.reasoning, got.content + rest.content)
        return got

    def _parse(self, c: CompletionOutput) -> tuple[DeltaMessage, str]:
        """A delta's message, and its text after the reasoning."""
        reasoning, text = self._split_reasoning(c)
        # Both names: vLLM's `reasoning`, and `reasoning_content` that clients still read.
        shown = reasoning if reasoning and self._request.include_reasoning else None
        extractor = self.extractor(c.index)
        if extractor is None:
            return DeltaMessage(
                content=text or None, reasoning=shown, reasoning_content=shown
            ), text
        got = extractor.feed(text)
        if c.finish_reason is not None:
            rest = extractor.finish()
            got = ToolDelta(got.content + rest.content, got.tool_calls + rest.tool_calls)
        return DeltaMessage(
            content=got.content or None, tool_calls=got.tool_calls or None,
            reasoning=shown, reasoning_content=shown,
        ), text

    def delta(self, c: CompletionOutput) -> DeltaMessage:
        """A streamed delta's message: its text, or what the choice's parsers made of it."""
        return self._parse(c)[0]

    def message(self, c: CompletionOutput) -> AssistantMessage:
        """A whole choice's message: the sum of its deltas, as if streamed."""
        delta, text = self._parse(c)
        calls = merge_tool_calls(delta.tool_calls or [])
        # Content as written (nothing held back), unless calls were lifted out of it.
        content = delta.content if calls else text or (None if self._reasoning_parser else text)
        return AssistantMessage(
            content=content, tool_calls=calls, reasoning=delta.reasoning,
            reasoning_content=delta.reasoning_content,
        )

    def finish_reason(self, c: CompletionOutput) -> str | None:
        # A stopped choice that made calls ended to have them run (as vLLM, not a named one).
        extractor = self.extractor(c.index)
        made_calls = extractor is not None and extractor.num_calls > 0
        if c.finish_reason == "stop" and made_calls and extractor.finishes_with_tool_calls:
            return "tool_calls"
        return c.finish_reason


async def _chat_chunks(
    outputs: StartedRequest, head: dict[str, Any], k: int | None, usage: StreamUsage,
    tool_calls: _ChatParsers, echo: str,
) -> AsyncIterator[ChatCompletionChunk]:
    deltas = StreamDeltas(outputs, usage)

    def chunk(choice: ChatStreamChoice) -> ChatCompletionChunk:
        return ChatCompletionChunk(
            **head, choices=[choice], usage=deltas.chunk_usage(choice.index)
        )

    # As OpenAI, each choice's first chunk gives the role alone; then the echo (vLLM's).
    for i in range(outputs.num_choices):
        yield chunk(ChatStreamChoice(index=i, delta=DeltaMessage(role="assistant", content="")))
    for i in range(outputs.num_choices if echo else 0):
        yield chunk(ChatStreamChoice(index=i, delta=DeltaMessage(content=echo)))
    async for delta in deltas:
        message = tool_calls.delta(delta)
        if not (message.content or message.tool_calls or message.reasoning or delta.logprobs
                or delta.finish_reason):
            continue  # all held back (a possible start of a tag)
        yield chunk(ChatStreamChoice(
            index=delta.index,
            delta=message,
            logprobs=None if k is None else _chat_logprobs(delta, k),
            finish_reason=tool_calls.finish_reason(delta),
            stop_reason=delta.stop_reason,
        ))
    final_usage = deltas.final_usage()
    if final_usage is not None:
        yield ChatCompletionChunk(**head, choices=[], usage=final_usage)


async def collect(outputs: StartedRequest) -> tuple[list[CompletionOutput], UsageInfo]:
    """A non-streamed request's choices, put together from its deltas, and its usage."""
    choices = [CompletionOutput(i, "", [], None, []) for i in range(outputs.num_choices)]
    async with aclosing(outputs):
        async for output in outputs:
            for delta in output.outputs:
                c = choices[delta.index]
                c.text += delta.text
                c.token_ids += delta.token_ids
                c.logprobs += delta.logprobs or []  # type: ignore[operator]
                c.finish_reason, c.stop_reason = delta.finish_reason, delta.stop_reason
    return choices, outputs.usage(sum(len(c.token_ids) for c in choices))


def _top(logprobs: dict[int, Logprob], k: int) -> list[Logprob]:
    # The dict holds the sampled token and the top k; the sampled one may rank below k.
    return sorted(logprobs.values(), key=lambda lp: lp.rank or 0)[:k]


def _completion_logprobs(
    token_ids: list[int],
    logprobs: Sequence[dict[int, Logprob] | None],
    k: int,
    offset: int,
    first_token_text: str = "",
) -> CompletionLogprobs:
    """None in `logprobs` is an echoed prompt's first token: its logprob and top are null, as
    OpenAI's, and `first_token_text` is its text (no Logprob carries it)."""
    result = CompletionLogprobs()
    for token_id, logprobs_at in zip(token_ids, logprobs, strict=True):
        if logprobs_at is None:
            token = first_token_text
            result.token_logprobs.append(None)
            result.top_logprobs.append(None)
        else:
            given = logprobs_at[token_id]
            token = given.decoded_token or ""
            result.token_logprobs.append(clamp_logprob(given.logprob))
            # The token itself, then the top k (OpenAI's "up to logprobs + 1"; vLLM's order).
            top = [given, *(lp for lp in _top(logprobs_at, k) if lp is not given)]
            result.top_logprobs.append(
                {lp.decoded_token or "": clamp_logprob(lp.logprob) for lp in top}
            )
        result.tokens.append(token)
        result.text_offset.append(offset)
        offset += len(token)
    return result


def _chat_logprob(lp: Logprob) -> dict[str, Any]:
    token = lp.decoded_token or ""
    return {"token": token, "logprob": clamp_logprob(lp.logprob), "bytes": list(token.encode())}


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
