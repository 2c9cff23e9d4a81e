"""Turns the engine core's per-step token outputs into the user's RequestOutputs.

Runs in the frontend process: detokenizes, applies stop strings (telling the caller which
requests to abort in the core), converts logprobs, and gathers the n child requests of a
parent request back into one RequestOutput. Pure Python; an async frontend wraps it.

Its state is keyed by the internal request ids that the engine core knows, so outputs of a
request the caller has aborted never reach a new request under the same caller id; every
RequestOutput carries the caller's id, and callers abort by it.
"""

import copy
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple

from tokenizers import Tokenizer

from v1.engine.detokenizer import IncrementalDetokenizer, TokenTexts, get_backend_tokenizer
from v1.openmp import load_torch_passively
from v1.outputs import (
    CompletionOutput,
    EngineCoreOutput,
    Logprob,
    PoolingOutput,
    PoolingRequestOutput,
    PromptLogprobs,
    RequestMetrics,
    RequestOutput,
)
from v1.request import EngineCoreRequest
from v1.sampling_params import RequestOutputKind

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


@dataclass(slots=True)
class FinishedRequestStats:
    finish_reason: str
    e2e_latency: float  # arrival to finish, seconds
    queue_time: float | None  # in the scheduler's queue until first scheduled, seconds
    num_prompt_tokens: int
    num_generation_tokens: int


@dataclass(slots=True)
class IterationStats:
    """Per-request latencies seen while processing one batch of core outputs (for metrics);
    a parent's n children count as n requests, as in vLLM."""

    time_to_first_tokens: list[float] = field(default_factory=list)
    inter_token_latencies: list[float] = field(default_factory=list)
    finished_requests: list[FinishedRequestStats] = field(default_factory=list)


class OutputProcessorOutput(NamedTuple):
    # A pooling request's (runner="pooling") is a PoolingRequestOutput, once, when finished.
    request_outputs: list[RequestOutput | PoolingRequestOutput[PoolingOutput]]
    # Requests a stop string finished that are still running in the engine core.
    reqs_to_abort: list[str]


class ParentRequest:
    """A request with n > 1: the core runs n child requests; their outputs become one.

    Child i has id f"{i}_{parent_id}" (of the parent's internal id, so unique too), n = 1
    and, if the parent has a seed, seed + i, so the children differ from each other yet
    every run of the parent is reproducible.
    """

    def __init__(self, request: EngineCoreRequest, prompt: str | None) -> None:
        self.request = request
        self.request_id = request.request_id
        self.external_req_id = _external_req_id(request)
        self.prompt = prompt
        self.n = request.sampling_params.n
        self.output_kind = RequestOutputKind.FINAL_ONLY  # set by OutputProcessor.add_request
        self.child_ids = [self.child_request_id(i, self.request_id) for i in range(self.n)]
        # The latest output of each child; deltas not yet returned, in delta mode.
        self.completions = [CompletionOutput(i, "", [], None, None) for i in range(self.n)]
        self.deltas: list[CompletionOutput] = []
        self.num_finished = 0
        self.num_cached_tokens = 0
        self.metrics = RequestMetrics(arrival_time=request.arrival_time or time.monotonic())
        # The children share the prompt: the parent reports the first child's prompt logprobs.
        self.first_child: RequestState | None = None

    @staticmethod
    def child_request_id(index: int, parent_id: str) -> str:
        return f"{index}_{parent_id}"

    def make_child_requests(self) -> list[EngineCoreRequest]:
        children = []
        for i in range(self.n):
            params = copy.copy(self.request.sampling_params)  # keeps all_stop_token_ids
            params.n = 1
            if params.seed is not None:
                params.seed += i
            params.all_stop_token_ids = set(params.all_stop_token_ids)
            if i > 0:  # the children share the prompt: child 0 computes its logprobs alone
                params.prompt_logprobs = None
            child = copy.copy(self.request)
            child.request_id = self.child_ids[i]
            child.sampling_params = params
            child.arrival_time = self.metrics.arrival_time
            children.append(child)
        return children

    def record(self, completion: CompletionOutput | None, child: "RequestState") -> None:
        """Takes a child's latest output (None: nothing to show yet, in final mode)."""
        if child.index == 0:
            self.first_child = child
        if completion is not None:
            if self.output_kind is RequestOutputKind.DELTA:
                self.deltas.append(completion)
            else:
                self.completions[completion.index] = completion
        self.num_cached_tokens = max(self.num_cached_tokens, child.num_cached_tokens)
        _merge_metrics(self.metrics, child.metrics)
        if child.finish_reason is not None:
            self.num_finished += 1
            if self.finished:
                self.metrics.finished_time = child.metrics.finished_time

    @property
    def finished(self) -> bool:
        return self.num_finished == self.n

    def make_request_output(self) -> RequestOutput | None:
        if self.output_kind is RequestOutputKind.DELTA:
            outputs = sorted(self.deltas, key=lambda c: c.index)
            self.deltas = []
        elif self.output_kind is RequestOutputKind.FINAL_ONLY and not self.finished:
            return None
        else:
            outputs = list(self.completions)
        return RequestOutput(
            request_id=self.external_req_id,
            prompt=self.prompt,
            prompt_token_ids=self.request.prompt_token_ids,
            outputs=outputs,
            finished=self.finished,
            prompt_logprobs=(
                None if self.first_child is None else self.first_child.take_prompt_logprobs()
            ),
            num_cached_tokens=self.num_cached_tokens,
            metrics=_snapshot(self.metrics),
            lora_request=self.request.lora_request,
        )


class RequestState:
    """What the frontend tracks for one request the engine core runs."""

    def __init__(
        self,
        request: EngineCoreRequest,
        prompt: str | None,
        output_kind: RequestOutputKind,
        tokenizer: Tokenizer | None,
        token_texts: TokenTexts | None,
        parent: ParentRequest | None,
        index: int,
    ) -> None:
        self.request_id = request.request_id
        self.external_req_id = _external_req_id(request)
        self.prompt = prompt
        self.prompt_token_ids = request.prompt_token_ids
        self.lora_request = request.lora_request
        self.output_kind = output_kind
        self.parent = parent
        self.index = index  # in the parent's outputs
        self.pooling = request.pooling_params is not None  # no tokens: one pooled vector
        params = request.sampling_params
        if self.pooling or not params.detokenize:  # no text (and no token texts), as vLLM
            tokenizer, token_texts = None, None
        self.token_texts = token_texts
        self.detokenizer = (
            None
            if tokenizer is None
            else IncrementalDetokenizer(tokenizer, request.prompt_token_ids, params)
        )
        self.token_ids: list[int] = []
        self.logprobs: list[dict[int, Logprob]] | None = None
        self.cumulative_logprob: float | None = None
        if params.logprobs is not None:
            self.logprobs, self.cumulative_logprob = [], 0.0
        self.prompt_logprobs: PromptLogprobs | None = None  # once the core sends them
        self.num_tokens_sent = 0  # for delta outputs
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.num_cached_tokens = 0
        self.metrics = RequestMetrics(arrival_time=request.arrival_time or time.monotonic())

    def update(self, output: EngineCoreOutput, now: float, stats: IterationStats | None) -> bool:
        """Applies one core output; True when a stop string finished the request here."""
        new_ids, new_logprobs = output.new_token_ids, output.new_logprobs
        stop = None
        if self.detokenizer is not None:
            stop = self.detokenizer.update(
                new_ids,
                stop_terminated=output.finish_reason == "stop",
                finished=output.finish_reason is not None,
            )
        if stop is not None:
            # Tokens after the one that completed the stop string are not output.
            new_ids = new_ids[: stop[1]]
            if new_logprobs:
                new_logprobs = new_logprobs[: stop[1]]
        metrics = self.metrics
        if new_ids:
            if metrics.first_token_time is None:
                metrics.first_token_time = now
                if stats is not None:
                    stats.time_to_first_tokens.append(now - metrics.arrival_time)
            elif stats is not None:
                assert metrics.last_token_time is not None
                stats.inter_token_latencies.append(now - metrics.last_token_time)
            metrics.last_token_time = now
        self.token_ids += new_ids
        if output.queue_time is not None:
            metrics.time_in_queue = output.queue_time
        if output.num_cached_tokens:
            self.num_cached_tokens = output.num_cached_tokens
        if self.logprobs is not None and new_logprobs:
            self._add_logprobs(new_logprobs)
        if output.new_prompt_logprobs is not None:
            self.prompt_logprobs = [None]
            self.prompt_logprobs += map(self._logprob_dict, output.new_prompt_logprobs)

        self.finish_reason, self.stop_reason = output.finish_reason, output.stop_reason
        if stop is not None:
            self.finish_reason, self.stop_reason = "stop", stop[0]
        if self.finish_reason is not None:
            metrics.finished_time = now
            if stats is not None:
                stats.finished_requests.append(
                    FinishedRequestStats(
                        self.finish_reason, now - metrics.arrival_time, metrics.time_in_queue,
                        len(self.prompt_token_ids), len(self.token_ids),
                    )
                )
        return stop is not None

    def make_completion_output(self) -> CompletionOutput | None:
        """This request's output now, shaped by its kind; None when there is none to show."""
        finished = self.finish_reason is not None
        if self.output_kind is RequestOutputKind.FINAL_ONLY and not finished:
            return None
        delta = self.output_kind is RequestOutputKind.DELTA
        text = ""
        if self.detokenizer is not None:
            text = self.detokenizer.get_next_output_text(finished, delta)
        start = self.num_tokens_sent if delta else 0
        self.num_tokens_sent = len(self.token_ids)
        return CompletionOutput(
            index=self.index,
            text=text,
            token_ids=self.token_ids[start:],
            cumulative_logprob=self.cumulative_logprob,
            logprobs=None if self.logprobs is None else self.logprobs[start:],
            finish_reason=self.finish_reason,
            stop_reason=self.stop_reason,
            lora_request=self.lora_request,
        )

    def make_request_output(self, completion: CompletionOutput) -> RequestOutput:
        return RequestOutput(
            request_id=self.external_req_id,
            prompt=self.prompt,
            prompt_token_ids=self.prompt_token_ids,
            outputs=[completion],
            finished=self.finish_reason is not None,
            prompt_logprobs=self.take_prompt_logprobs(),
            num_cached_tokens=self.num_cached_tokens,
            metrics=_snapshot(self.metrics),
            lora_request=self.lora_request,
        )

    def take_prompt_logprobs(self) -> PromptLogprobs | None:
        """The prompt logprobs for an output: in delta mode only the first output with them
        carries them, as vLLM."""
        prompt_logprobs = self.prompt_logprobs
        if self.output_kind is RequestOutputKind.DELTA:
            self.prompt_logprobs = None
        return prompt_logprobs

    def _add_logprobs(self, new_logprobs: list[tuple[list[int], list[float], int]]) -> None:
        assert self.logprobs is not None and self.cumulative_logprob is not None
        for token_logprobs in new_logprobs:
            self.logprobs.append(self._logprob_dict(token_logprobs))
            self.cumulative_logprob += token_logprobs[1][0]

    def _logprob_dict(
        self, token_logprobs: tuple[list[int], list[float], int]
    ) -> dict[int, Logprob]:
        token_ids, logprobs, rank = token_logprobs
        decoded: list[str] | list[None] = [None] * len(token_ids)
        if self.token_texts is not None:
            decoded = self.token_texts(token_ids)
        # The given (sampled or prompt) token comes first with its own rank; the top tokens
        # follow, ranked 1..k. A given token that is also among them keeps its top-k entry.
        ranks = [rank, *range(1, len(token_ids))]
        return {
            tid: Logprob(lp, r, text)
            for tid, lp, r, text in zip(token_ids, logprobs, ranks, decoded, strict=True)
        }


class OutputProcessor:
    """Frontend side of the engine: EngineCoreOutputs in, RequestOutputs out."""

    def __init__(self, tokenizer: "PreTrainedTokenizerBase | Tokenizer | None") -> None:
        # None: the caller works with token ids only; no text, no stop strings.
        self.tokenizer = None if tokenizer is None else get_backend_tokenizer(tokenizer)
        self.token_texts = None if self.tokenizer is None else TokenTexts(self.tokenizer)
        self.request_states: dict[str, RequestState] = {}  # by internal (core) request id
        self.parent_requests: dict[str, ParentRequest] = {}  # by internal id
        # Caller's id -> internal id of its live request (or parent): one each at a time.
        self.external_req_ids: dict[str, str] = {}

    def add_request(
        self,
        request: EngineCoreRequest,
        prompt: str | None,
    ) -> list[EngineCoreRequest]:
        """Starts tracking a request; returns the requests to send to the engine core: the
        request itself, or its n child requests when n > 1. Its outputs are of its sampling
        params' `output_kind`.

        A caller's id may be used again once its request is over, not while it is live.
        """
        kind = request.sampling_params.output_kind
        if request.sampling_params.stop and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer")
        external_req_id = _external_req_id(request)
        if external_req_id in self.external_req_ids:
            raise ValueError(f"request id {external_req_id!r} is already in use")
        parent: ParentRequest | None = None
        core_requests = [request]
        if request.sampling_params.n > 1:
            parent = ParentRequest(request, prompt)
            parent.output_kind = kind
            core_requests = parent.make_child_requests()
            self.parent_requests[parent.request_id] = parent
        for index, core_request in enumerate(core_requests):
            self.request_states[core_request.request_id] = RequestState(
                core_request, prompt, kind, self.tokenizer, self.token_texts, parent, index
            )
        self.external_req_ids[external_req_id] = request.request_id
        return core_requests

    def process_outputs(
        self, outputs: Iterable[EngineCoreOutput], stats: IterationStats | None = None
    ) -> OutputProcessorOutput:
        """With `stats`, also records the requests' latencies there."""
        request_outputs: list[RequestOutput | PoolingRequestOutput[PoolingOutput]] = []
        reqs_to_abort: list[str] = []
        touched_parents: dict[str, ParentRequest] = {}
        now = time.monotonic()
        for output in outputs:
            state = self.request_states.get(output.request_id)
            if state is None:
                continue  # aborted, or finished here by a stop string before the core knew
            if state.pooling:
                if output.finish_reason is not None:
                    del self.request_states[state.request_id]
                    del self.external_req_ids[state.external_req_id]
                    request_outputs.append(_pooling_output(state, output))
                    if stats is not None:
                        stats.finished_requests.append(FinishedRequestStats(
                            output.finish_reason, now - state.metrics.arrival_time,
                            output.queue_time, len(state.prompt_token_ids), 0,
                        ))
                continue
            stopped_here = state.update(output, now, stats)
            if stopped_here and output.finish_reason is None:
                reqs_to_abort.append(state.request_id)
            if state.finish_reason is not None:
                del self.request_states[state.request_id]
                if state.parent is None:
                    del self.external_req_ids[state.external_req_id]
            completion = state.make_completion_output()
            if state.parent is not None:
                state.parent.record(completion, state)
                touched_parents[state.parent.request_id] = state.parent
            elif completion is not None:
                request_outputs.append(state.make_request_output(completion))
        for parent in touched_parents.values():
            if parent.finished:
                del self.parent_requests[parent.request_id]
                del self.external_req_ids[parent.external_req_id]
            request_output = parent.make_request_output()
            if request_output is not None:
                request_outputs.append(request_output)
        return OutputProcessorOutput(request_outputs, reqs_to_abort)

    def abort_requests(self, request_ids: Iterable[str], internal: bool = False) -> list[str]:
        """Forgets the requests; returns the core request ids still running, to abort there.

        `request_ids` are callers' ids or, with `internal`, the requests' own (internal) ids;
        a parent's id aborts all of its children. Unknown or finished ids are skipped.
        """
        ids = request_ids
        if not internal:  # lazily: a caller's id given twice is skipped the second time
            ids = (self.external_req_ids[i] for i in request_ids if i in self.external_req_ids)
        to_abort: list[str] = []
        for request_id in ids:
            parent = self.parent_requests.pop(request_id, None)
            if parent is not None:
                del self.external_req_ids[parent.external_req_id]
                core_ids = parent.child_ids
            elif (state := self.request_states.get(request_id)) is not None:
                del self.external_req_ids[state.external_req_id]
                core_ids = [request_id]
            else:
                continue
            to_abort += [i for i in core_ids if self.request_states.pop(i, None) is not None]
        return to_abort

    def get_num_unfinished_requests(self) -> int:
        """Requests the engine core still runs for us (a parent's children count one each)."""
        return len(self.request_states)

    def has_unfinished_requests(self) -> bool:
        return bool(self.request_states)


def _pooling_output(
    state: RequestState, output: EngineCoreOutput
) -> PoolingRequestOutput[PoolingOutput]:
    """A finished pooling request's output; an empty vector if it finished without one (the
    scheduler could never run it: `finish_reason` "length"). torch is imported here, at the
    first: a frontend that only generates never loads it."""
    load_torch_passively()
    import torch

    data = torch.tensor(output.pooling_output or [], dtype=torch.float32)
    return PoolingRequestOutput(
        state.external_req_id, PoolingOutput(data), state.prompt_token_ids, True
    )


def _external_req_id(request: EngineCoreRequest) -> str:
    assert request.external_req_id is not None, "Processor.process_inputs sets it"
    return request.external_req_id


def _snapshot(metrics: RequestMetrics) -> RequestMetrics:
    # A copy for the user, as ours keeps changing (dataclasses.replace is ~5x slower).
    return RequestMetrics(
        metrics.arrival_time,
        metrics.time_in_queue,
        metrics.first_token_time,
        metrics.last_token_time,
        metrics.finished_time,
    )


def _merge_metrics(into: RequestMetrics, child: RequestMetrics) -> None:
    """A parent's first token is its earliest child's; its last token its latest child's."""
    if child.first_token_time is not None:
        if into.first_token_time is None or child.first_token_time < into.first_token_time:
            into.first_token_time = child.first_token_time
    if child.last_token_time is not None:
        if into.last_token_time is None or child.last_token_time > into.last_token_time:
            into.last_token_time = child.last_token_time
