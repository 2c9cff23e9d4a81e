"""The scheduler's side of speculative decoding: how many drafts a decode step verifies,
what a verified step gives back, and the acceptance counters. Torch-free, as the core is.

A step with k drafts computes 1 + k tokens; the runner accepts a of them and adds one, so it
returns a + 1 tokens and `num_computed_tokens` goes back by k - a (under async scheduling all
1 + k placeholders resolve). Blocks hash only `all_token_ids`, which never holds a draft.
"""

from collections.abc import Callable

from v1.request import Request


def num_drafts_to_schedule(
    request: Request, token_budget: int, max_model_len: int, async_scheduling: bool
) -> int:
    """How many of the request's drafts a decode step can verify now: within the budget
    (with its last token), max_model_len and max_tokens (the step's 1 + k tokens may all be
    accepted; under async, counting the tokens still in flight)."""
    limit = min(
        len(request.spec_token_ids),
        token_budget - 1,
        max_model_len - request.num_computed_tokens - 1,
        request.max_tokens - len(request.output_token_ids) - 1
        - (request.num_output_placeholders if async_scheduling else 0),
    )
    return max(limit, 0)


def append_until_stop(
    request: Request,
    token_ids: list[int],
    check_stop: Callable[[Request, int], bool],
    max_model_len: int,
) -> tuple[list[int], bool]:
    """Append a verified step's tokens one by one, up to the first that finishes the request
    (`check_stop`, the scheduler's); returns the tokens appended and whether it finished."""
    for n, token_id in enumerate(token_ids, 1):
        request.append_output_token_ids([token_id])
        if check_stop(request, max_model_len):
            return token_ids[:n], True
    return token_ids, False


class SpecDecodingStats:
    """vLLM's counters: drafts (request-steps with drafts), draft tokens, accepted tokens,
    and accepted tokens per draft position."""

    __slots__ = ("num_drafts", "num_draft_tokens", "num_accepted_tokens", "accepted_per_pos")

    def __init__(self) -> None:
        self.num_drafts = 0
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.accepted_per_pos: list[int] = []

    def observe(self, num_draft_tokens: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted
        per_pos = self.accepted_per_pos
        if len(per_pos) < num_draft_tokens:
            per_pos.extend([0] * (num_draft_tokens - len(per_pos)))
        for i in range(num_accepted):
            per_pos[i] += 1
