"""vLLM's `vllm.v1.sample.logits_processor`: custom logits processors (`LLM(logits_processors=
[MyProcessor or "module:MyProcessor"])`), with per-request arguments in
`SamplingParams.extra_args`; `AdapterLogitsProcessor` runs per-request ones. The runner builds
them once (`build_logitsprocs`), calls `update_state` before every step with the batch's
changes, and the sampler runs `apply` among its own stages (v1.worker.sampler)."""

from v1.sample.logits_processor.adapter import AdapterLogitsProcessor
from v1.sample.logits_processor.builtin import process_dict_updates
from v1.sample.logits_processor.interface import (
    AddedRequest,
    BatchUpdate,
    LogitsProcessor,
    MoveDirectionality,
    MovedRequest,
    RemovedRequest,
)
from v1.sample.logits_processor.state import (
    BatchLogits,
    BatchUpdateBuilder,
    LogitsProcessors,
    build_logitsprocs,
    load_logits_processors,
)

__all__ = [
    "AdapterLogitsProcessor", "AddedRequest", "BatchLogits", "BatchUpdate", "BatchUpdateBuilder",
    "LogitsProcessor", "LogitsProcessors", "MoveDirectionality", "MovedRequest", "RemovedRequest",
    "build_logitsprocs", "load_logits_processors", "process_dict_updates",
]
