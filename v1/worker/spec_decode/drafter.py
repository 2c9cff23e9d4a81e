"""The model runner's side of speculative decoding: which requests draft, how many tokens
each, and the drafts it proposed last.

After sampling, the runner asks the proposer for every request that sampled (so an index
such as the suffix one sees every request's tokens); the drafts go back to the scheduler,
which schedules them with the request's next decode step, and are kept here: under async
scheduling the scheduler sends -1 placeholders, which `drafts_for_step` fills.

Not drafted (the proposal is dropped): requests whose sampling depends on the tokens before it
in ways one step's rows would not see: penalties and bad words (counts and tails of the
output so far), `min_tokens` not yet reached (a row would ban stop tokens another may not),
and structured output (the grammar's bitmask covers one token: the simplest correct choice
is not drafting those requests). Logprobs, logit bias, allowed token ids, temperature and
the top-k/top-p/min-p filters are the same on every row, so those requests draft.

Adaptive: a request whose drafts were all rejected halves its draft length and skips the next
1, 2, 4, ... steps (up to `MAX_SKIP`); an accepted draft resets the back-off and grows the
length again (to the accepted count + 1, or double when all were accepted). Random text thus
costs little more than the proposer's lookup.
"""

from dataclasses import dataclass

import numpy as np

from v1.config import SpeculativeConfig
from v1.sampling_params import SamplingParams
from v1.worker.spec_decode.proposer import DraftProposer, make_proposer

MAX_SKIP = 16


@dataclass(slots=True)
class _Adaptive:
    k: int  # the next draft's length
    skip: int = 0  # steps left without drafting
    failures: int = 0  # consecutive fully rejected drafts


def can_draft(params: SamplingParams, num_output: int) -> bool:
    """Whether a request's next step may verify drafts (see the module docstring)."""
    return (
        params.structured_outputs is None
        and not params.has_penalties
        and not params.bad_words_token_ids
        and num_output >= params.min_tokens
    )


class Drafter:
    def __init__(self, config: SpeculativeConfig, proposer: DraftProposer | None = None) -> None:
        self.max_k = config.num_speculative_tokens
        self.proposer = proposer if proposer is not None else make_proposer(config)
        self._adaptive: dict[str, _Adaptive] = {}
        self.pending: dict[str, list[int]] = {}  # req_id -> its last proposal

    def propose(
        self, req_id: str, token_ids: np.ndarray, params: SamplingParams, num_output: int
    ) -> list[int]:
        """The drafts for the request's next step (also kept in `pending`)."""
        state = self._adaptive.get(req_id)
        if state is None:
            state = self._adaptive[req_id] = _Adaptive(self.max_k)
        drafts = self.proposer.propose(req_id, token_ids, state.k)
        if state.skip:
            state.skip -= 1
            drafts = []
        elif not can_draft(params, num_output):
            drafts = []
        self.pending[req_id] = drafts
        return drafts

    def drafts_for_step(self, req_id: str, scheduled: list[int]) -> list[int]:
        """The drafts to verify: the scheduled ones, with -1 placeholders (async) replaced by
        the last proposal's, or left -1 (never accepted) where it had fewer."""
        if not scheduled or scheduled[0] != -1:
            return scheduled
        pending = self.pending.get(req_id, [])[: len(scheduled)]
        return pending + [-1] * (len(scheduled) - len(pending))

    def observe(self, req_id: str, drafts: list[int], num_accepted: int) -> None:
        """Adapt to a verified step's outcome."""
        state = self._adaptive.get(req_id)
        num_drafts = len(drafts) - drafts.count(-1)
        if state is None or not num_drafts:
            return
        if num_accepted == 0:
            state.failures += 1
            state.skip = min(1 << (state.failures - 1), MAX_SKIP)
            state.k = max(1, state.k // 2)
        else:
            state.failures = 0
            grown = 2 * state.k if num_accepted == num_drafts else num_accepted + 1
            state.k = min(self.max_k, grown)

    def finish(self, req_id: str) -> None:
        """The request left the runner's batch (finished or preempted)."""
        self._adaptive.pop(req_id, None)
        self.pending.pop(req_id, None)
        self.proposer.finish(req_id)
