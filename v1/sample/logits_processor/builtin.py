"""vLLM's `vllm.v1.sample.logits_processor.builtin` path, for the helper custom processors
use. The built-in processors themselves (min-p, logit bias, min-tokens, penalties, bans)
are stages of `v1.worker.sampler`, which runs the custom ones among them."""

from collections.abc import Callable
from typing import TypeVar

from v1.sample.logits_processor.interface import BatchUpdate, MoveDirectionality
from v1.sampling_params import SamplingParams

T = TypeVar("T")


def process_dict_updates(
    req_entries: dict[int, T],
    batch_update: BatchUpdate | None,
    new_state: Callable[[SamplingParams, list[int] | None, list[int]], T | None],
) -> bool:
    """vLLM's helper for a processor that keeps per-row state in a dict (row -> state):
    applies `batch_update` to it. `new_state(params, prompt ids, output ids)` gives an added
    request's state, or None when the processor does nothing to it. Returns whether the dict
    changed."""
    if not batch_update:
        return False
    changed = False
    for row, params, prompt_ids, output_ids in batch_update.added:
        state = new_state(params, prompt_ids, output_ids)
        if state is not None:
            req_entries[row] = state
            changed = True
        elif req_entries.pop(row, None) is not None:  # the row's previous request's
            changed = True
    for row in batch_update.removed:
        if req_entries.pop(row, None) is not None:
            changed = True
    for a, b, how in batch_update.moved:
        a_state, b_state = req_entries.pop(a, None), req_entries.pop(b, None)
        if a_state is not None:
            req_entries[b] = a_state
        if b_state is not None and how is MoveDirectionality.SWAP:
            req_entries[a] = b_state
        changed |= a_state is not None or b_state is not None
    return changed
