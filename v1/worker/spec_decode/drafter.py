"""The model runner's side of speculative decoding: which requests draft, how many tokens
each, the drafts it proposed last, and checking a step's sampled tokens against its drafts.

After sampling, the runner asks the proposer for every request that sampled (so an index
such as the suffix one sees every request's tokens); the drafts go back to the scheduler,
which schedules them with the request's next decode step, and are kept here: under async
scheduling the scheduler sends -1 placeholders, which `drafts_for_step` fills.

Not drafted: requests whose sampling depends on the tokens before it in ways one step's rows
would not see (`can_draft`: penalties, bad words, `min_tokens` not yet reached, structured
output). Adaptive: a request whose drafts were all rejected halves its draft length, and in a
step of more than `CHEAP_ROWS` tokens (compute-bound) also skips drafting for its next 1, 2,
4, ... steps (up to `MAX_SKIP`); an accepted draft resets the back-off and grows the length
again. Why these rules, with figures: docs/speculative.md.
"""

from dataclasses import dataclass
from typing import NamedTuple, cast

import numpy as np
import torch

from v1.config import SpeculativeConfig
from v1.outputs import TokenLogprobs
from v1.sampling_params import SamplingParams
from v1.worker.input_batch import InputBatch
from v1.worker.rejection_sampler import accept_drafts, keep_draws
from v1.worker.sampler import StepTokens
from v1.worker.spec_decode.proposer import DraftProposer, make_proposer

MAX_SKIP = 16
# A step of at most this many tokens is weight-bound: a draft there is nearly free (above).
CHEAP_ROWS = 16


@dataclass(slots=True)
class StepDrafts:
    """The drafts a step verifies: per request index their count (`num`, 0: none), and
    them by request index."""

    num: np.ndarray  # int32 [num_reqs]
    by_index: dict[int, list[int]]


class Verification(NamedTuple):
    """What `Drafter.accept` checks: the step's sampled tokens (`first_logit_row[n]` on for
    the n-th sampling request, `sample_idx[n]` its request index) against its drafts."""

    req_ids: list[str]
    rows: np.ndarray  # batch row per request index
    sample_idx: np.ndarray
    first_logit_row: np.ndarray
    token_ids: list[int]
    token_logprobs: list[TokenLogprobs | None] | None
    drafts: StepDrafts
    generator_states: dict[int, torch.Tensor]  # from `generator_states`
    step_tokens: int  # the step's scheduled tokens, for the back-off


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
        self, req_id: str, token_ids: "list[int] | np.ndarray", params: SamplingParams,
        num_output: int,
    ) -> list[int]:
        """The drafts for the request's next step (also kept in `pending`). The proposer is
        asked only when the request drafts this step (an index catches up on the tokens it
        missed the next time): no lookup, and no copy of the history, for the others."""
        state = self._adaptive.get(req_id)
        if state is None:
            state = self._adaptive[req_id] = _Adaptive(self.max_k)
        if state.skip:
            state.skip -= 1
            drafts: list[int] = []
        elif not can_draft(params, num_output):
            drafts = []
        else:
            if isinstance(token_ids, np.ndarray):
                token_ids = token_ids.tolist()
            drafts = self.proposer.propose(req_id, token_ids, state.k)
        self.pending[req_id] = drafts
        return drafts

    def drafts_for_step(self, req_id: str, scheduled: list[int]) -> list[int]:
        """The drafts to verify: the scheduled ones, with -1 placeholders (async) replaced by
        the last proposal's, or left -1 (never accepted) where it had fewer."""
        if not scheduled or scheduled[0] != -1:
            return scheduled
        pending = self.pending.get(req_id, [])[: len(scheduled)]
        return pending + [-1] * (len(scheduled) - len(pending))

    def observe(
        self, req_id: str, drafts: list[int], num_accepted: int, step_tokens: int
    ) -> None:
        """Adapt to a verified step's outcome; `step_tokens`: the step's scheduled tokens."""
        state = self._adaptive.get(req_id)
        num_drafts = len(drafts) - drafts.count(-1)
        if state is None or not num_drafts:
            return
        if num_accepted == 0:
            state.failures += 1
            if step_tokens > CHEAP_ROWS:
                state.skip = min(1 << (state.failures - 1), MAX_SKIP)
            state.k = max(1, state.k // 2)
        else:
            state.failures = 0
            grown = 2 * state.k if num_accepted == num_drafts else num_accepted + 1
            state.k = min(self.max_k, grown)

    # -- the runner's step ----------------------------------------------------------------

    def write_drafts(
        self, batch: InputBatch, spec: dict[str, list[int]], req_ids: list[str]
    ) -> StepDrafts:
        """Writes each scheduled request's drafts after its known tokens (the step's inputs
        are read from there); returns their count and them by request index."""
        drafts = StepDrafts(np.zeros(len(req_ids), dtype=np.int32), {})
        index = {req_id: i for i, req_id in enumerate(req_ids)}
        for req_id, scheduled in spec.items():
            step_drafts = self.drafts_for_step(req_id, scheduled)
            i = index[req_id]
            row = batch.req_id_to_index[req_id]
            start = int(batch.num_tokens[row])
            # A -1 (no draft for a placeholder) computes token 0 and is never accepted.
            batch.token_ids[row, start : start + len(step_drafts)] = [
                max(d, 0) for d in step_drafts
            ]
            drafts.num[i] = len(step_drafts)
            drafts.by_index[i] = step_drafts
        return drafts

    @staticmethod
    def generator_states(
        batch: InputBatch, req_ids: list[str], drafts: StepDrafts
    ) -> dict[int, torch.Tensor]:
        """Before sampling: the generator state of each drafted request that draws from its
        own generator (seeded, not greedy), by request index, for `accept` to rewind to."""
        states = {}
        for i in drafts.by_index:
            generator = batch.generators.get(req_ids[i])
            params = batch.sampling_params[batch.req_id_to_index[req_ids[i]]]
            if generator is not None and params is not None and not params.greedy:
                states[i] = generator.get_state()
        return states

    def accept(self, batch: InputBatch, step: Verification) -> StepTokens:
        """Checks each sampling request's rows against its drafts and stores what it accepted
        in the batch (its one sampled token when it had no drafts). A seeded request that
        rejected drafts gets its generator back to where its kept rows leave it."""
        tokens_out = StepTokens.empty(len(step.req_ids), step.token_logprobs is not None)
        for n, i in enumerate(step.sample_idx.tolist()):
            first, end = int(step.first_logit_row[n]), int(step.first_logit_row[n + 1])
            tokens = step.token_ids[first:end]
            drafts = step.drafts.by_index.get(i)
            if drafts:
                tokens = accept_drafts(tokens, drafts)
                rejected = tokens_out.num_rejected[i] = len(drafts) + 1 - len(tokens)
                self.observe(step.req_ids[i], drafts, len(tokens) - 1, step.step_tokens)
                if rejected and i in step.generator_states:
                    keep_draws(batch.generators[step.req_ids[i]], step.generator_states[i],
                               len(tokens))
            row = step.rows[i]
            start = int(batch.num_tokens[row])
            batch.token_ids[row, start : start + len(tokens)] = tokens
            batch.num_tokens[row] += len(tokens)
            tokens_out.sampled[i] = tokens
            if step.token_logprobs is not None and tokens_out.logprobs is not None:
                lps = step.token_logprobs[first : first + len(tokens)]
                tokens_out.logprobs[i] = (None if lps[0] is None
                                          else cast(list[TokenLogprobs], lps))
        return tokens_out

    def propose_all(
        self, batch: InputBatch, req_ids: list[str], rows: np.ndarray, sample_idx: np.ndarray
    ) -> list[list[int]]:
        """The drafts of every request that sampled this step, for its next step ([] for the
        others), one list per `req_ids` entry."""
        proposals: list[list[int]] = [[] for _ in req_ids]
        for i in sample_idx.tolist():
            row = rows[i]
            num_tokens = int(batch.num_tokens[row])
            params = batch.sampling_params[row]
            assert params is not None
            proposals[i] = self.propose(
                req_ids[i], batch.token_ids[row, :num_tokens], params,
                num_tokens - int(batch.num_prompt_tokens[row]),
            )
        return proposals

    def finish(self, req_id: str, preempted: bool = False) -> None:
        """The request left the runner's batch: finished (the proposer may keep its tokens for
        others) or `preempted` (it comes back with the same tokens: only its state goes)."""
        self._adaptive.pop(req_id, None)
        self.pending.pop(req_id, None)
        if preempted:
            self.proposer.drop(req_id)
        else:
            self.proposer.finish(req_id)
