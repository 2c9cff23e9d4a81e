"""The engine's custom logits processors and what the runner feeds them: `LogitsProcessors`
(loaded and built once per engine), `BatchUpdateBuilder` (the persistent batch's changes
between steps) and `BatchLogits` (one step's sampling rows mapped onto batch rows)."""

import importlib
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from v1.sample.logits_processor.interface import (
    AddedRequest,
    BatchUpdate,
    LogitsProcessor,
    MoveDirectionality,
    MovedRequest,
)
from v1.sampling_params import SamplingParams

if TYPE_CHECKING:
    from v1.config import VllmConfig


def load_logits_processors(specs: Sequence[Any] | None) -> list[type[LogitsProcessor]]:
    """vLLM's `logits_processors` option as classes: each a LogitsProcessor subclass, or its
    name as "module:Class" (the class may be nested: "module:Outer.Inner"). ValueError
    naming the entry otherwise."""
    classes = []
    for spec in specs or ():
        cls = spec
        if isinstance(spec, str):
            module_name, sep, qualname = spec.partition(":")
            if not sep or not module_name or not qualname:
                raise ValueError(
                    f"logits processor {spec!r} must be a class or 'module:Class'"
                )
            try:
                cls = importlib.import_module(module_name)
                for attr in qualname.split("."):
                    cls = getattr(cls, attr)
            except (ImportError, AttributeError) as e:
                raise ValueError(f"cannot load logits processor {spec!r}: {e}") from e
        if not (isinstance(cls, type) and issubclass(cls, LogitsProcessor)):
            raise ValueError(
                f"logits processor {spec!r} is not a subclass of vLLM's LogitsProcessor "
                "(v1.v1.sample.logits_processor.LogitsProcessor)"
            )
        classes.append(cls)
    return classes


class LogitsProcessors:
    """vLLM's: the engine's processors, in the order given, split by `is_argmax_invariant`
    (those that can change a greedy row's token run before the argmax; the others only for
    sampled rows, after the temperature)."""

    def __init__(self, processors: Iterable[LogitsProcessor] = ()) -> None:
        self.argmax_invariant: list[LogitsProcessor] = []
        self.non_argmax_invariant: list[LogitsProcessor] = []
        for processor in processors:
            (self.argmax_invariant if processor.is_argmax_invariant()
             else self.non_argmax_invariant).append(processor)

    def __iter__(self) -> Iterator[LogitsProcessor]:
        return iter(self.non_argmax_invariant + self.argmax_invariant)

    def __bool__(self) -> bool:
        return bool(self.argmax_invariant or self.non_argmax_invariant)

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        for processor in self:
            processor.update_state(batch_update)


def build_logitsprocs(
    vllm_config: "VllmConfig", device: torch.device, is_pin_memory: bool,
    is_pooling_model: bool, custom_logitsprocs: Sequence[Any] | None = (),
) -> LogitsProcessors:
    """vLLM's: each custom processor (a class or "module:Class") made once for the engine.
    A pooling engine samples nothing: custom processors there are a ValueError."""
    classes = load_logits_processors(custom_logitsprocs)
    if is_pooling_model and classes:
        raise ValueError("pooling models do not support custom logits processors")
    return LogitsProcessors(cls(vllm_config, device, is_pin_memory) for cls in classes)


class BatchUpdateBuilder:
    """Records the persistent batch's changes as they happen, in the order a `BatchUpdate`
    applies them: rows emptied, requests added (to empty rows), rows moved (to empty rows).
    Keeps each request's output-token list, the one `AddedRequest` handed out."""

    def __init__(self) -> None:
        self._removed: set[int] = set()
        self._added: list[AddedRequest] = []
        self._moved: list[MovedRequest] = []
        self.output_token_ids: dict[str, list[int]] = {}

    def add(self, row: int, req_id: str, params: SamplingParams, token_ids: list[int],
            num_prompt_tokens: int) -> None:
        self._removed.discard(row)  # refilled: its old request's state is replaced
        outputs = self.output_token_ids[req_id] = list(token_ids[num_prompt_tokens:])
        self._added.append((row, params, list(token_ids[:num_prompt_tokens]), outputs))

    def remove(self, row: int, req_id: str) -> None:
        self._removed.add(row)
        del self.output_token_ids[req_id]

    def move(self, src: int, dst: int) -> None:
        self._moved.append((src, dst, MoveDirectionality.UNIDIRECTIONAL))

    def get_and_reset(self, batch_size: int) -> BatchUpdate | None:
        """The changes since the last call (None: none)."""
        if not (self._removed or self._added or self._moved):
            return None
        update = BatchUpdate(batch_size, sorted(self._removed), self._added, self._moved)
        self._removed, self._added, self._moved = set(), [], []
        return update


@dataclass(slots=True)
class BatchLogits:
    """One step's processors with the batch row of each logits row (`rows`; None when logits
    row i is batch row i): processors index logits by batch row, while the sampler holds only
    the rows that sample."""

    processors: LogitsProcessors
    rows: torch.Tensor | None  # int64 [num_logits_rows]
    batch_size: int

    def apply(self, logits: torch.Tensor, argmax_invariant: bool) -> torch.Tensor:
        processors = (self.processors.argmax_invariant if argmax_invariant
                      else self.processors.non_argmax_invariant)
        if not processors:
            return logits
        if self.rows is None:
            for processor in processors:
                logits = _applied(processor, logits)
            return logits
        batch = logits.new_zeros((self.batch_size, logits.shape[-1]))
        batch[self.rows] = logits
        for processor in processors:
            batch = _applied(processor, batch)
        return batch[self.rows]


def _applied(processor: LogitsProcessor, logits: torch.Tensor) -> torch.Tensor:
    """`processor.apply(logits)`, whose answer must be logits of the same shape: another one
    would be sampled from anyway (broadcast, or over a cut vocabulary), every row's tokens
    wrong without an error. A RuntimeError naming the processor instead."""
    out = processor.apply(logits)
    if not isinstance(out, torch.Tensor) or out.shape != logits.shape:
        got = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
        raise RuntimeError(
            f"logits processor {type(processor).__qualname__}.apply returned {got} for logits "
            f"of shape {tuple(logits.shape)}: it must return logits of the same shape"
        )
    return out
