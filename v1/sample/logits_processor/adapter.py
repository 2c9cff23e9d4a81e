"""vLLM's `AdapterLogitsProcessor`: per-request logits processors (a function of a request's
output token ids, or of its prompt and output ids, and its logits row) run through the
batch-level interface."""

import inspect
from abc import abstractmethod
from collections.abc import Callable
from functools import partial
from typing import TYPE_CHECKING, Any

import torch

from v1.sample.logits_processor.builtin import process_dict_updates
from v1.sample.logits_processor.interface import BatchUpdate, LogitsProcessor
from v1.sampling_params import SamplingParams

if TYPE_CHECKING:
    from v1.config import VllmConfig

# fn(output_ids, logits_row) or fn(prompt_ids, output_ids, logits_row) -> logits_row
RequestLogitsProcessor = Callable[..., torch.Tensor]


class AdapterLogitsProcessor(LogitsProcessor):
    """Subclasses give `is_argmax_invariant` and `new_req_logits_processor`; a subclass's
    `__init__` calls this one."""

    def __init__(
        self, vllm_config: "VllmConfig", device: torch.device, is_pin_memory: bool
    ) -> None:
        # Row -> its request's processor, with the request's token lists bound (the lists
        # grow as the request samples, so the processor always sees them whole).
        self.req_info: dict[int, partial[torch.Tensor]] = {}

    @abstractmethod
    def new_req_logits_processor(self, params: SamplingParams) -> RequestLogitsProcessor | None:
        """The request's processor, or None when this one does nothing to it."""
        raise NotImplementedError

    def _new_state(
        self, params: SamplingParams, prompt_ids: list[int] | None, output_ids: list[int]
    ) -> partial[torch.Tensor] | None:
        processor = self.new_req_logits_processor(params)
        if processor is None:
            return None
        takes_prompt = len(inspect.signature(processor).parameters) == 3
        args: list[Any] = [prompt_ids, output_ids] if takes_prompt else [output_ids]
        return partial(processor, *args)

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        process_dict_updates(self.req_info, batch_update, self._new_state)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        for row, processor in self.req_info.items():
            row_logits = logits[row]
            new = processor(row_logits)
            if new is not row_logits:  # a new tensor, not the row changed in place
                logits[row] = new
        return logits
