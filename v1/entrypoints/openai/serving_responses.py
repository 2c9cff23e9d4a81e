"""POST /v1/responses (OpenAI's Responses API, text only, stateless) over the chat machinery
of `OpenAIServing`: the same chat template, length check, model defaults, engine request,
disconnect handling and server-sent events, with the Responses API's shapes around them."""

import time
import uuid
from collections.abc import AsyncIterator
from typing import Any, TypeVar

from v1.engine.processor import PromptTooLongError
from v1.entrypoints.openai.protocol import UsageInfo
from v1.entrypoints.openai.responses_protocol import (
    IncompleteDetails,
    InputTokensDetails,
    ResponseContentPartEvent,
    ResponseErrorEvent,
    ResponseLifecycleEvent,
    ResponseOutputItemEvent,
    ResponseOutputMessage,
    ResponseOutputText,
    ResponsesRequest,
    ResponsesResponse,
    ResponseStatus,
    ResponseStreamEvent,
    ResponseTextDeltaEvent,
    ResponseTextDoneEvent,
    ResponseUsage,
)
from v1.entrypoints.openai.serving import (
    OpenAIServing,
    StartedRequest,
    StreamDeltas,
    StreamUsage,
    collect,
    error_for,
    sse_stream,
)
from v1.sampling_params import SamplingParams

E = TypeVar("E", bound=ResponseStreamEvent)


class OpenAIServingResponses:
    """vLLM's class of the same name, without its store: every response is made, returned
    and forgotten (`store` is echoed false)."""

    def __init__(self, serving: OpenAIServing) -> None:
        self.serving = serving

    async def create_responses(
        self, request: ResponsesRequest
    ) -> ResponsesResponse | AsyncIterator[str]:
        serving = self.serving
        lora = serving.check_model(request.model)  # a LoRA adapter's name picks it
        engine = serving.engine
        params = request.to_sampling_params(engine.processor.limits)
        text, token_ids = await engine.run_in_pool(self._prompt, request, params.max_tokens)
        params = serving.with_defaults(request, params)
        model = serving.served_model_names[0] if lora is None else lora.lora_name
        head = _Head(request, params, model)
        outputs = await StartedRequest.start(
            engine, [serving.engine_prompt(request, text, token_ids)], params, head.id, request,
            lora,
        )
        if request.stream:
            events = _EventStream(head)
            return sse_stream(outputs, events.of(outputs), events.error, named=True)
        choices, usage = await collect(outputs)
        (choice,) = choices
        status = _status(choice.finish_reason)
        message = _message(status, [ResponseOutputText(text=choice.text)])
        return head.response(status, [message], usage)

    def _prompt(self, request: ResponsesRequest, max_tokens: int | None) -> tuple[str, list[int]]:
        """The conversation rendered and tokenized (CPU work for the engine's pool), checked
        to leave room for max_output_tokens. With truncation "auto", as OpenAI's, the fewest
        leading input items are dropped that make it fit (found by bisection, as fewer
        items render shorter); the last item is never dropped."""
        render = self.serving.render_chat
        if request.truncation == "disabled":
            text, token_ids = render(request.messages())
        else:
            last = len(request.input) - 1
            fitting = self._if_fits(request, 0, max_tokens)
            if fitting is None:
                low, high = 1, last  # the fewest items to drop, if any, are in here
                while low <= high:
                    mid = (low + high) // 2
                    shorter = self._if_fits(request, mid, max_tokens)
                    if shorter is not None:
                        fitting, high = shorter, mid - 1
                    else:
                        low = mid + 1
            # Nothing fits: the last item alone, rendered again for check_length's error.
            text, token_ids = fitting or render(request.messages(last))
        self.serving.check_length(len(token_ids), max_tokens, "input", "max_output_tokens")
        return text, token_ids

    def _if_fits(
        self, request: ResponsesRequest, num_dropped: int, max_tokens: int | None
    ) -> tuple[str, list[int]] | None:
        """The conversation less its first `num_dropped` input items, rendered and tokenized,
        or None if it leaves no room for max_tokens (too many characters to tokenize
        included: such an item is what truncation drops)."""
        try:
            text, token_ids = self.serving.render_chat(request.messages(num_dropped))
        except PromptTooLongError:
            return None
        return (text, token_ids) if self.serving.fits(len(token_ids), max_tokens) else None


class _Head:
    """What a request's response objects share: its id, creation time, model and the
    request's parameters echoed (sampling ones as the engine got them, as vLLM's)."""

    def __init__(self, request: ResponsesRequest, params: SamplingParams, model: str) -> None:
        self.id = f"resp_{uuid.uuid4().hex}"
        self._fields: dict[str, Any] = {
            "id": self.id,
            "created_at": int(time.time()),
            "model": model,
            "instructions": request.instructions,
            "max_output_tokens": params.max_tokens,
            "metadata": request.metadata,
            "temperature": params.temperature,
            "top_p": params.top_p,
            "text": request.echoed_text(),
            "tool_choice": request.tool_choice,
            "parallel_tool_calls": request.parallel_tool_calls,
            "truncation": request.truncation,
            "user": request.user,
        }

    def response(
        self, status: ResponseStatus, output: list[ResponseOutputMessage],
        usage: UsageInfo | None,
    ) -> ResponsesResponse:
        incomplete = IncompleteDetails(reason="max_output_tokens")
        return ResponsesResponse(
            **self._fields,
            status=status,
            incomplete_details=incomplete if status == "incomplete" else None,
            output=output,
            usage=None if usage is None else _usage(usage),
        )


def _status(finish_reason: str | None) -> ResponseStatus:
    # "length": max_output_tokens (or max_model_len) ran out, OpenAI's incomplete response.
    return "incomplete" if finish_reason == "length" else "completed"


def _message(
    status: ResponseStatus, content: list[ResponseOutputText], item_id: str | None = None
) -> ResponseOutputMessage:
    return ResponseOutputMessage(
        id=item_id or f"msg_{uuid.uuid4().hex}",
        status=status,
        content=content,
    )


def _usage(usage: UsageInfo) -> ResponseUsage:
    return ResponseUsage(
        input_tokens=usage.prompt_tokens,
        input_tokens_details=InputTokensDetails(
            cached_tokens=usage.prompt_tokens_details.cached_tokens
        ),
        output_tokens=usage.completion_tokens,
        total_tokens=usage.total_tokens,
    )


class _EventStream:
    """A streamed response's events in OpenAI's order, numbered from 0: created,
    in_progress, the message's output_item.added and content_part.added, its text's
    deltas, output_text.done, content_part.done, output_item.done, then completed (or
    incomplete, with the usage)."""

    def __init__(self, head: _Head) -> None:
        self._head = head
        self._sequence_number = 0

    def _next(self, event_class: type[E], event_type: str, **fields: Any) -> E:
        event = event_class(type=event_type, sequence_number=self._sequence_number, **fields)
        self._sequence_number += 1
        return event

    def error(self, exc: Exception) -> ResponseErrorEvent:
        """An error once the stream has begun, as OpenAI's `error` event."""
        info = error_for(exc).error
        return self._next(ResponseErrorEvent, "error", code=info.type, message=info.message)

    async def of(self, outputs: StartedRequest) -> AsyncIterator[ResponseStreamEvent]:
        head = self._head
        started = head.response("in_progress", [], None)
        yield self._next(ResponseLifecycleEvent, "response.created", response=started)
        yield self._next(ResponseLifecycleEvent, "response.in_progress", response=started)
        message = _message("in_progress", [])
        yield self._next(
            ResponseOutputItemEvent, "response.output_item.added", output_index=0, item=message
        )
        where = {"item_id": message.id, "output_index": 0, "content_index": 0}
        yield self._next(
            ResponseContentPartEvent, "response.content_part.added", **where,
            part=ResponseOutputText(text=""),
        )
        deltas = StreamDeltas(outputs, StreamUsage(final=True, continuous=False))
        pieces: list[str] = []
        finish_reason = None
        async for delta in deltas:
            finish_reason = delta.finish_reason
            if delta.text:
                pieces.append(delta.text)
                yield self._next(
                    ResponseTextDeltaEvent, "response.output_text.delta", **where,
                    delta=delta.text,
                )
        text = "".join(pieces)
        status = _status(finish_reason)
        yield self._next(ResponseTextDoneEvent, "response.output_text.done", **where, text=text)
        part = ResponseOutputText(text=text)
        yield self._next(ResponseContentPartEvent, "response.content_part.done", **where,
                         part=part)
        message = _message(status, [part], message.id)
        yield self._next(
            ResponseOutputItemEvent, "response.output_item.done", output_index=0, item=message
        )
        done = head.response(status, [message], deltas.final_usage())
        yield self._next(ResponseLifecycleEvent, f"response.{status}", response=done)
