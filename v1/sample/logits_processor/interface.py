"""vLLM's V1 logits-processor interface (`vllm.v1.sample.logits_processor.interface`).

A processor is one object for the whole batch: the runner tells it which requests entered,
left or changed rows (`update_state`, before every step) and hands it the batch's logits
(`apply`), one row per request at the request's row of the persistent batch.
"""

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum, auto
from typing import TYPE_CHECKING

import torch

from v1.sampling_params import SamplingParams

if TYPE_CHECKING:
    from v1.config import VllmConfig


class MoveDirectionality(Enum):
    UNIDIRECTIONAL = auto()  # the request at the first row moves to the second, now empty
    SWAP = auto()  # the two rows' requests trade places


# A row whose request left the batch.
RemovedRequest = int
# (row, params, prompt token ids, output token ids): the output list is the request's own,
# appended to as it samples, so a processor that keeps it sees every new token.
AddedRequest = tuple[int, SamplingParams, list[int] | None, list[int]]
# (row a, row b, how).
MovedRequest = tuple[int, int, MoveDirectionality]


@dataclass(frozen=True)
class BatchUpdate:
    """The persistent batch's changes since the previous step: `batch_size` requests now;
    apply `removed`, then `added` (an added row may reuse a removed one's row, in which case
    that row is not listed as removed), then `moved`, in list order."""

    batch_size: int
    removed: Sequence[RemovedRequest]
    added: Sequence[AddedRequest]
    moved: Sequence[MovedRequest]


class LogitsProcessor(ABC):
    """vLLM's base class of a custom logits processor (`LLM(logits_processors=[cls])`)."""

    @classmethod
    def validate_params(cls, sampling_params: SamplingParams) -> None:
        """Raises ValueError for a request whose parameters (its `extra_args`) this
        processor cannot take; called for every request before the engine sees it."""
        return None

    @abstractmethod
    def __init__(
        self, vllm_config: "VllmConfig", device: torch.device, is_pin_memory: bool
    ) -> None:
        raise NotImplementedError

    @abstractmethod
    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """The batch's logits ([batch_size, vocab], fp32) after this processor: changed in
        place or a new tensor."""
        raise NotImplementedError

    @abstractmethod
    def is_argmax_invariant(self) -> bool:
        """True when the processor never changes which token has a row's largest logit: it
        then runs for sampled (non-greedy) rows only, after the temperature."""
        raise NotImplementedError

    @abstractmethod
    def update_state(self, batch_update: BatchUpdate | None) -> None:
        """Called before every step; `batch_update` is None when the batch's rows did not
        change (the requests' output lists may have grown)."""
        raise NotImplementedError
