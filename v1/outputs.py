"""Outputs at each layer boundary: model runner -> scheduler -> frontend -> user."""

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Generic, NamedTuple, TypeVar

import msgspec

from v1.lora.request import LoRARequest

if TYPE_CHECKING:  # the core stays torch-free: only the frontend builds these tensors
    import torch


class TokenLogprobs(NamedTuple):
    """Logprobs for one sampled (or prompt) token: its id first, then the top-k ids."""

    token_ids: list[int]
    logprobs: list[float]
    sampled_rank: int  # 1-based rank of the first token in the full distribution


@dataclass(slots=True)
class ModelRunnerOutput:
    """One step's results, one row per scheduled request (in `req_ids` order).

    A request whose prompt is still being prefilled has an empty `sampled_token_ids` row.
    """

    req_ids: list[str]
    sampled_token_ids: list[list[int]]
    # Per request, the logprobs of its sampled tokens; None where not asked for.
    logprobs: list[list[TokenLogprobs] | None] | None = None
    # Request id -> the logprobs of its prompt tokens 1.., for requests asking for them whose
    # prompt this step finished (the runner keeps earlier chunks' until then).
    prompt_logprobs_dict: dict[str, list[TokenLogprobs]] = field(default_factory=dict)
    # Speculative decoding: per request, the drafts the runner proposes for its next step
    # (empty: none); None when no request has any.
    spec_token_ids: list[list[int]] | None = None
    # Async speculative decoding: request id -> how many of its scheduled drafts had no
    # proposal to fill them (the scheduler sized the step by an older proposal): computed,
    # never accepted, and not counted as drafts in the metrics.
    num_unfilled_drafts: dict[str, int] = field(default_factory=dict)
    # The disk tier: request id -> how many of its `KVLoad` blocks were read (a prefix; the
    # rest were missing or corrupt), for the loads of this step (None: none); (hash,
    # written) for every store finished since the last step (False: not written, e.g. the
    # queue was full).
    kv_loaded: dict[str, int] | None = None
    kv_stored: Sequence[tuple[bytes, bool]] = ()
    # A pooling engine (runner="pooling"): per request, its pooled vector on the step that
    # computed its prompt's last token (None before); None when the engine samples.
    pooler_output: list[list[float] | None] | None = None
    # LoRA: the requests whose rows this step came out non-finite (an adapter that
    # overflows): the K/V they wrote must never be served from the prefix cache.
    nonfinite_req_ids: list[str] = field(default_factory=list)


EMPTY_MODEL_RUNNER_OUTPUT = ModelRunnerOutput([], [])


class EngineCoreOutput(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """New tokens for one request since the last output, and how it finished, if it did."""

    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[tuple[list[int], list[float], int]] | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0
    # On a request's first output with tokens: seconds from entering the scheduler to first
    # being scheduled (the frontend keeps it: a stop string may end the request before the
    # core sends a finishing output).
    queue_time: float | None = None
    # With the first sampled token: the logprobs of prompt tokens 1.. (prompt_logprobs).
    new_prompt_logprobs: list[tuple[list[int], list[float], int]] | None = None
    # A pooling request's result, with its finishing output (v1.pooling_params).
    pooling_output: list[float] | None = None


class SchedulerStats(msgspec.Struct, omit_defaults=True):
    num_running_reqs: int = 0
    num_waiting_reqs: int = 0
    kv_cache_usage: float = 0.0
    prefix_cache_queries: int = 0  # tokens looked up, since start
    prefix_cache_hits: int = 0  # tokens found, since start
    prefix_cache_hit_rate: float = 0.0  # since start
    recent_prefix_cache_hit_rate: float = 0.0  # over the rolling window
    num_preemptions: int = 0
    num_prompt_tokens: int = 0
    num_generation_tokens: int = 0
    # Speculative decoding, since start (vLLM's SpecDecodingStats): steps that verified
    # drafts for a request, draft tokens verified, of which accepted, and accepted per
    # draft position (index 0: first drafts).
    spec_decode_num_drafts: int = 0
    spec_decode_num_draft_tokens: int = 0
    spec_decode_num_accepted_tokens: int = 0
    spec_decode_num_accepted_tokens_per_pos: list[int] = []
    # The disk tier (kv_cache_dir), since start: prompt tokens read back from disk (counted in
    # prefix_cache_hits too), blocks written, and blocks on disk now (this process's index).
    disk_cache_hits: int = 0
    disk_cache_stored_blocks: int = 0
    disk_cache_blocks: int = 0

    @property
    def spec_decode_acceptance_rate(self) -> float:
        """Accepted draft tokens / draft tokens (0 when none was verified)."""
        if not self.spec_decode_num_draft_tokens:
            return 0.0
        return self.spec_decode_num_accepted_tokens / self.spec_decode_num_draft_tokens


class EngineCoreOutputs(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """Everything one engine step produced for one client."""

    outputs: list[EngineCoreOutput] = []
    scheduler_stats: SchedulerStats | None = None
    timestamp: float = 0.0
    # Requests the core finished for reasons the client did not ask for (ids only).
    finished_requests: set[str] | None = None
    client_index: int = 0
    # Set when the engine reports an error it could not recover from.
    engine_error: str | None = None


@dataclass(slots=True)
class Logprob:
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass(slots=True)
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[dict[int, Logprob]] | None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    lora_request: LoRARequest | None = None  # the adapter it ran with, as vLLM's

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class RequestMetrics:
    arrival_time: float
    time_in_queue: float | None = None  # seconds in the scheduler's queue before first scheduled
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None


# Per prompt token, its logprob and the top ones; None for the first token, which has none.
PromptLogprobs = list[dict[int, Logprob] | None]


@dataclass(slots=True)
class RequestOutput:
    """What `LLM.generate` returns per prompt, shaped like vLLM's."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    # With prompt_logprobs; in delta mode only on the output that first has them.
    prompt_logprobs: PromptLogprobs | None = None
    num_cached_tokens: int = 0
    metrics: RequestMetrics | None = None
    lora_request: LoRARequest | None = None


# ---- pooling (runner="pooling"), shaped like vLLM's ------------------------------------------


@dataclass(slots=True)
class PoolingOutput:
    """A pooling request's result as the pooler returns it (`LLM.encode`)."""

    data: "torch.Tensor"


def _one_vector(output: PoolingOutput, what: str) -> list[float]:
    """A pooled output read as one vector (vLLM's typed outputs do the same check)."""
    if output.data.ndim != 1:
        raise ValueError(f"{what} is one vector, got shape {tuple(output.data.shape)}")
    return output.data.tolist()


@dataclass(slots=True)
class EmbeddingOutput:
    """A sentence embedding (`LLM.embed`)."""

    embedding: list[float]

    @classmethod
    def from_base(cls, output: PoolingOutput) -> "EmbeddingOutput":
        return cls(_one_vector(output, "an embedding"))

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclass(slots=True)
class ClassificationOutput:
    """Class probabilities (`LLM.classify`)."""

    probs: list[float]

    @classmethod
    def from_base(cls, output: PoolingOutput) -> "ClassificationOutput":
        return cls(_one_vector(output, "class probabilities"))

    @property
    def num_classes(self) -> int:
        return len(self.probs)


@dataclass(slots=True)
class ScoringOutput:
    """The relevance score of a text pair (`LLM.score`)."""

    score: float

    @classmethod
    def from_base(cls, output: PoolingOutput) -> "ScoringOutput":
        if output.data.numel() != 1:
            raise ValueError("a score is one value")
        return cls(float(output.data.reshape(()).item()))


_O = TypeVar("_O")


@dataclass(slots=True)
class PoolingRequestOutput(Generic[_O]):
    """What the pooling calls of `LLM` return per prompt, shaped like vLLM's."""

    request_id: str
    outputs: _O
    prompt_token_ids: list[int]
    finished: bool

    @classmethod
    def from_base(cls, base: "PoolingRequestOutput[Any]") -> "PoolingRequestOutput[Any]":
        return cls(base.request_id, _OUTPUT_TYPES[cls].from_base(base.outputs),
                   base.prompt_token_ids, base.finished)


class EmbeddingRequestOutput(PoolingRequestOutput[EmbeddingOutput]):
    __slots__ = ()


class ClassificationRequestOutput(PoolingRequestOutput[ClassificationOutput]):
    __slots__ = ()


class ScoringRequestOutput(PoolingRequestOutput[ScoringOutput]):
    __slots__ = ()


_OUTPUT_TYPES: dict[type, Any] = {
    EmbeddingRequestOutput: EmbeddingOutput,
    ClassificationRequestOutput: ClassificationOutput,
    ScoringRequestOutput: ScoringOutput,
}
