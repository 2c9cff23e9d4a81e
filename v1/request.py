"""A request as the engine core sees it, and the message that carries it there."""

import enum
import sys
import time
from concurrent.futures import Future
from typing import Any, Protocol

import msgspec

from v1.lora.request import LoRARequest
from v1.pooling_params import PoolingParams
from v1.sampling_params import SamplingParams


class EngineCoreRequest(msgspec.Struct, array_like=True, omit_defaults=True):
    """What a frontend sends the engine core: tokenized and validated already.

    `request_id` is the frontend's internal id, unique for the engine's life (the caller's
    id plus a random suffix; "{i}_{parent's id}" for child i of an n > 1 request): it is
    the only id the engine core, scheduler and runner see. `external_req_id` is the id the
    caller gave, which it sees again in its RequestOutputs and aborts by.

    A pooling request (runner="pooling") has `pooling_params`; its `sampling_params` are
    then `POOLING_SAMPLING_PARAMS` (one token at most, nothing else): the core's bookkeeping
    holds unchanged for it, as for vLLM's pooling requests (max_tokens 1), and it finishes
    when its prompt is computed, with its pooled vector instead of a token.
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_id: int | None = None
    arrival_time: float = 0.0
    priority: int = 0
    cache_salt: str | None = None
    client_index: int = 0
    external_req_id: str | None = None
    lora_request: LoRARequest | None = None
    pooling_params: PoolingParams | None = None


# The sampling params of every pooling request (see EngineCoreRequest); never sampled with.
POOLING_SAMPLING_PARAMS = SamplingParams(max_tokens=1)


class RequestStatus(enum.IntEnum):
    """Lifecycle: (WAITING_FOR_FSM ->) WAITING (-> WAITING_FOR_REMOTE_KVS -> WAITING) ->
    RUNNING -> (PREEMPTED -> WAITING ->)* -> FINISHED_*.

    Any unfinished state may go to FINISHED_ABORTED; FINISHED_IGNORED is for a request that
    can never be scheduled (it is rejected before it runs). A structured-output request waits
    in WAITING_FOR_FSM until its grammar is compiled; a request whose prefix is read back from
    the disk tier waits in WAITING_FOR_REMOTE_KVS (vLLM's name) until the read is done.
    Finished states compare greater than PREEMPTED, so `status > PREEMPTED` is the finished
    test.
    """

    WAITING = enum.auto()
    WAITING_FOR_FSM = enum.auto()
    WAITING_FOR_REMOTE_KVS = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH_CAPPED = enum.auto()
    FINISHED_ABORTED = enum.auto()
    FINISHED_IGNORED = enum.auto()

    @staticmethod
    def is_finished(status: "RequestStatus") -> bool:
        return status > RequestStatus.PREEMPTED

    @staticmethod
    def get_finished_reason(status: "RequestStatus") -> str | None:
        return _FINISHED_REASONS.get(status)


_FINISHED_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH_CAPPED: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    # vLLM reports an ignored request as capped by length: it could never fit.
    RequestStatus.FINISHED_IGNORED: "length",
}


class StructuredOutputGrammar(Protocol):
    """A request's grammar matcher, as the scheduler and the bitmask filler use it."""

    def accept_tokens(self, token_ids: list[int]) -> bool: ...

    def is_terminated(self) -> bool: ...

    def fill_bitmask(self, bitmask: Any, row: int) -> None: ...


BlockHash = bytes


class BlockHasher(Protocol):
    """(request) -> the hashes of the request's full blocks of `block_size` tokens not hashed
    yet (`v1.core.kv_cache_utils.make_block_hasher`)."""

    block_size: int

    def __call__(self, request: "Request") -> list[BlockHash]: ...


class Request:
    """One sequence in the engine core.

    Token layout: `all_token_ids = prompt_token_ids + output_token_ids`. The first
    `num_computed_tokens` of them have K/V in the cache. Under async scheduling the scheduler
    runs ahead of the model: `num_output_placeholders` counts tokens already scheduled whose
    ids are not known yet, so `num_computed_tokens` may exceed `num_tokens` by that many.

    Speculative decoding: `spec_token_ids` are the draft tokens the runner proposed to follow
    the request's tokens (never part of `all_token_ids`); a decode step computes them with its
    last token. Under async scheduling each such step adds `1 + len(drafts)` placeholders.
    """

    __slots__ = (
        "request_id", "client_index", "priority", "arrival_time", "prompt_token_ids",
        "sampling_params", "eos_token_id", "max_tokens", "output_token_ids", "all_token_ids",
        "status", "num_computed_tokens", "num_cached_tokens", "num_preemptions",
        "num_output_placeholders", "block_hashes", "cache_salt", "stop_reason",
        "queued_time", "scheduled_time", "_block_hasher", "_next_hash_len", "grammar_future",
        "grammar", "spec_token_ids", "num_passed_over", "lora_request", "pooling_params",
    )

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        eos_token_id: int | None = None,
        arrival_time: float | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
        client_index: int = 0,
        block_hasher: BlockHasher | None = None,
        lora_request: LoRARequest | None = None,
        pooling_params: PoolingParams | None = None,
    ) -> None:
        self.request_id = request_id
        # Its adapter (None: the base model); its id is in its first block's hash.
        self.lora_request = lora_request
        self.pooling_params = pooling_params
        self.client_index = client_index
        self.priority = priority
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.prompt_token_ids = prompt_token_ids
        self.sampling_params = sampling_params
        self.eos_token_id = eos_token_id
        self.max_tokens = sampling_params.max_tokens
        self.output_token_ids: list[int] = []
        self.all_token_ids: list[int] = list(prompt_token_ids)
        self.status = RequestStatus.WAITING
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0  # prefix-cache hits at first admission
        self.num_preemptions = 0
        self.num_output_placeholders = 0
        self.cache_salt = cache_salt
        self.stop_reason: int | str | None = None
        # Engine-core clock (monotonic): entering the scheduler, and first being scheduled.
        self.queued_time = 0.0
        self.scheduled_time: float | None = None
        # Structured output: the compilation in flight, then the matcher once it is done.
        self.grammar_future: Future[StructuredOutputGrammar] | None = None
        self.grammar: StructuredOutputGrammar | None = None
        self.spec_token_ids: list[int] = []
        # Steps it waited while a request behind it was admitted, or deferred for blocks
        # another request computes (prefix-aware admission); 0 again once admitted.
        self.num_passed_over = 0
        self.block_hashes: list[BlockHash] = []
        self._block_hasher = block_hasher
        # The length at which the next block to hash is full: appends below it skip the
        # hasher (a call per token and request per step adds up).
        self._next_hash_len = sys.maxsize
        if block_hasher is not None:
            self._hash_full_blocks(block_hasher)

    @classmethod
    def from_engine_core_request(
        cls, req: EngineCoreRequest, block_hasher: BlockHasher | None
    ) -> "Request":
        return cls(
            req.request_id, req.prompt_token_ids, req.sampling_params, req.eos_token_id,
            req.arrival_time or None, req.priority, req.cache_salt, req.client_index,
            block_hasher, req.lora_request, req.pooling_params,
        )

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    def append_output_token_ids(self, token_ids: list[int]) -> None:
        self.output_token_ids.extend(token_ids)
        self.all_token_ids.extend(token_ids)
        if len(self.all_token_ids) >= self._next_hash_len:
            assert self._block_hasher is not None
            self._hash_full_blocks(self._block_hasher)

    def _hash_full_blocks(self, hasher: BlockHasher) -> None:
        self.block_hashes.extend(hasher(self))
        self._next_hash_len = (len(self.block_hashes) + 1) * hasher.block_size

    def is_finished(self) -> bool:
        return self.status > RequestStatus.PREEMPTED

    def get_finished_reason(self) -> str | None:
        return _FINISHED_REASONS.get(self.status)

    def __lt__(self, other: "Request") -> bool:
        # Heap tie-breaker after (priority, arrival_time): the id keeps the order total.
        return self.request_id < other.request_id

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, status={self.status.name}, "
            f"computed={self.num_computed_tokens}/{self.num_tokens})"
        )
