"""What the scheduler tells the model runner for one step.

New requests come in full (`NewRequestData`); requests the runner has seen before come as
deltas (`CachedRequestData`): new block ids to append, and the computed-token count. A request
resumed after preemption comes as a delta too, with `resumed_from_preemption` set: its block
ids then *replace* the old ones and `resumed_token_ids` carries all its tokens.
"""

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from v1.lora.request import LoRARequest
from v1.pooling_params import PoolingParams
from v1.request import BlockHash
from v1.sampling_params import SamplingParams

if TYPE_CHECKING:  # the core stays free of numpy at run time; the manager builds the array
    import numpy as np
    import numpy.typing as npt


@dataclass(slots=True)
class NewRequestData:
    req_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int
    lora_request: LoRARequest | None = None
    pooling_params: PoolingParams | None = None  # a pooling request's (v1.pooling_params)
    cache_salt: str | None = None  # whose cached data it may reach (its prefix cache hits')


@dataclass(slots=True)
class CachedRequestData:
    req_ids: list[str] = field(default_factory=list)
    resumed_from_preemption: list[bool] = field(default_factory=list)
    resumed_token_ids: list[list[int] | None] = field(default_factory=list)
    new_block_ids: list[list[int]] = field(default_factory=list)
    num_computed_tokens: list[int] = field(default_factory=list)

    @property
    def num_reqs(self) -> int:
        return len(self.req_ids)


@dataclass(slots=True)
class KVLoad:
    """Read one request's blocks back from the disk tier: `block_hashes[i]`'s file into block
    `block_ids[i]`, before this step's forward. The blocks are the request's and not in the
    prefix cache until the runner reports the load (`ModelRunnerOutput.kv_loaded`)."""

    req_id: str
    block_ids: list[int]
    block_hashes: list[BlockHash]


@dataclass(slots=True)
class SchedulerOutput:
    scheduled_new_reqs: list[NewRequestData]
    scheduled_cached_reqs: CachedRequestData
    # req_id -> tokens to compute this step; iteration order is the batch order.
    num_scheduled_tokens: dict[str, int]
    total_num_scheduled_tokens: int
    # Requests that left the batch since the last step: the runner drops their state.
    finished_req_ids: set[str]
    preempted_req_ids: set[str]
    # Speculative decoding: req_id -> the draft tokens scheduled after its last token (they are
    # the last of its `num_scheduled_tokens`); under async scheduling -1 placeholders, which
    # the runner fills with the drafts it proposed last (it runs ahead of the scheduler).
    scheduled_spec_decode_tokens: dict[str, list[int]] = field(default_factory=dict)
    # Structured output: the requests that sample this step under a grammar, in the order of
    # `grammar_bitmask`'s rows (int32, 32 tokens per word, bit set: allowed).
    structured_output_request_ids: list[str] = field(default_factory=list)
    grammar_bitmask: "npt.NDArray[np.int32] | None" = None
    # The disk tier (v1.core.kv_disk_index): blocks to read before the forward; (block id,
    # hash) of full blocks this step computes, to copy after the forward and write to disk;
    # files to remove (LRU beyond the byte bound).
    # (Empty tuples by default: a step without a tier allocates nothing for them.)
    kv_loads: Sequence[KVLoad] = ()
    kv_stores: Sequence[tuple[int, BlockHash]] = ()
    kv_deletes: Sequence[BlockHash] = ()
