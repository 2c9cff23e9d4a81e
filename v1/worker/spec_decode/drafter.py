"""The model runner's side of speculative decoding: which requests draft, how many tokens
each, the drafts it proposed last, and checking a step's sampled tokens against its drafts.

After sampling, the runner asks for drafts for every request that sampled; the proposer is
asked for those that draft (an index such as the suffix one catches up on the tokens it
missed the next time); the drafts go back to the scheduler, which schedules them with the
request's next decode step, and are kept here: under async scheduling the scheduler sends -1
placeholders, which `drafts_for_step` fills.

Not drafted: requests whose sampling depends on the tokens before it in ways one step's rows
would not see (`can_draft`: penalties, bad words, `min_tokens` not yet reached, structured
output). How many tokens the others draft is priced on step costs (`StepCosts`, given at
construction and fed through `record_step` with the steps the runner times): k drafts are
expected to save a(k) = q + q^2 + ... + q^k tokens, q the request's acceptance estimate (the
chance a draft token is accepted when the ones before it were), each worth one request's
share of a decode step of the batch, cost(b) / b; they add cost(n + k) - cost(n) to the next
step of n rows. The request drafts the k (0 to `num_speculative_tokens`) with the largest
gain over cost. A request at k = 0 where drafts accepted every time would pay still drafts
one token (a probe, to notice text that turns repetitive): at once if its last draft was
accepted, else once every so many steps that probes cost it at most `PROBE_SHARE` of its
tokens. Prices are measured before they are used, and measured again once they age out
(`MeasuredStepCosts`: a price taken while the machine was busy does not last): where steps
of the batch's own rows were not measured lately, no request drafts, so the step measures
them; where those as large as its drafts would make are not, it drafts every token, as if
rows were free, and so measures them. Why, with figures: docs/speculative.md.
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
from v1.worker.spec_decode.step_cost import StepCosts

# A request's acceptance estimate keeps this share of its evidence per verified step (the
# last few steps count: it follows the text), the estimate over all requests (each one's
# prior, worth one token tried: the workload's) of its own.
KEEP = 0.8
KEEP_OVERALL = 0.98
# Probes cost a request at most this share of what its tokens cost.
PROBE_SHARE = 0.01
MAX_PROBE_WAIT = 256  # steps; bounds the wait where a token's share of a step measures ~0


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


@dataclass(slots=True)
class _Acceptance:
    """Discounted counts of draft tokens accepted and tried (the accepted ones and the first
    rejected: those after it were never judged); `rate` estimates the chance that a draft
    token is accepted when the ones before it were, `prior` counting as one token tried."""

    accepted: float = 0.0
    tried: float = 0.0

    def add(self, accepted: int, tried: int, keep: float) -> None:
        self.accepted = keep * self.accepted + accepted
        self.tried = keep * self.tried + tried

    def rate(self, prior: float) -> float:
        return (self.accepted + prior) / (self.tried + 1.0)


@dataclass(slots=True)
class _Request:
    acceptance: _Acceptance
    # Steps without drafts since its last draft was all rejected; None: the last one was
    # accepted (or it has drafted none), so a probe is due at once.
    waited: int | None = None


def can_draft(params: SamplingParams, num_output: int) -> bool:
    """Whether a request's next step may verify drafts (see the module docstring)."""
    return (
        params.structured_outputs is None
        and not params.has_penalties
        and not params.bad_words_token_ids
        and num_output >= params.min_tokens
    )


class Drafter:
    def __init__(
        self, config: SpeculativeConfig, costs: StepCosts,
        proposer: DraftProposer | None = None,
    ) -> None:
        """`costs`: the step costs drafts are priced on, fed by `record_step` (the runner's
        are measured, `MeasuredStepCosts`; a fixed table makes the decisions independent of
        the machine's load). `proposer`: None, the one `config` names."""
        self.max_k = config.num_speculative_tokens
        self.proposer = proposer if proposer is not None else make_proposer(config)
        self.costs = costs
        self._overall = _Acceptance()  # all requests'; prior 1: a first request's drafts all pay
        self._requests: dict[str, _Request] = {}
        self.pending: dict[str, list[int]] = {}  # req_id -> its last proposal

    def propose(
        self, req_id: str, token_ids: "list[int] | np.ndarray", params: SamplingParams,
        num_output: int, batch_size: int = 1, other_rows: int = 0,
    ) -> list[int]:
        """The drafts for the request's next step (also kept in `pending`); `batch_size`:
        the requests decoding in that step, `other_rows`: the others' drafts (its rows but
        this request's drafts: `batch_size + other_rows`). The proposer is asked only when
        the request drafts (an index catches up on the tokens it missed the next time): no
        lookup for the others. `token_ids` goes to the proposer as given (the runner's view
        of its token buffer: never copied whole)."""
        drafts: list[int] = []
        if can_draft(params, num_output):
            state = self._requests.get(req_id)
            if state is None:
                state = self._requests[req_id] = _Request(_Acceptance())
            k = self.draft_length(state, batch_size, batch_size + other_rows)
            if k:
                drafts = self.proposer.propose(req_id, token_ids, k)
        self.pending[req_id] = drafts
        return drafts

    def draft_length(self, state: _Request, batch_size: int, num_rows: int) -> int:
        """How many tokens the request drafts in a step of `batch_size` decoding requests
        and `num_rows` rows before its drafts (module docstring); counts its probe wait."""
        costs = self.costs
        if not costs.measured(batch_size):
            return 0  # no request drafts: the step measures the batch's own rows
        if not costs.learnt(num_rows + self.max_k):
            return self.max_k  # steps of that size not measured lately: draft, and measure
        value = costs.cost(batch_size) / batch_size  # what an accepted draft saves
        # Read now, the workload's estimate follows the requests that drafted before this one.
        rate = state.acceptance.rate(self._overall.rate(1.0))
        best, could_pay = self._best_length(rate, value, num_rows)
        if best or not could_pay:
            return best  # drafting pays, or would not even if every draft were accepted
        if state.waited is None:
            return 1
        probe = costs.cost(num_rows + 1) - costs.cost(num_rows)
        if state.waited * PROBE_SHARE * value >= probe or state.waited >= MAX_PROBE_WAIT:
            return 1
        state.waited += 1
        return 0

    def _best_length(self, rate: float, value: float, num_rows: int) -> tuple[int, bool]:
        """The k with the largest gain over cost at acceptance `rate` (0: none gains), and
        whether some k would gain were every draft accepted."""
        base = self.costs.cost(num_rows)
        best, best_gain, expected, p, could_pay = 0, 0.0, 0.0, 1.0, False
        for k in range(1, self.max_k + 1):
            p *= rate
            expected += p
            extra = self.costs.cost(num_rows + k) - base
            if value * expected - extra > best_gain:
                best, best_gain = k, value * expected - extra
            could_pay = could_pay or value * k > extra
        return best, could_pay

    def drafts_for_step(self, req_id: str, scheduled: list[int]) -> list[int]:
        """The drafts to verify: the scheduled ones, with -1 placeholders (async) replaced by
        the last proposal's, or left -1 (never accepted) where it had fewer."""
        if not scheduled or scheduled[0] != -1:
            return scheduled
        pending = self.pending.get(req_id, [])[: len(scheduled)]
        return pending + [-1] * (len(scheduled) - len(pending))

    def observe(self, req_id: str, drafts: list[int], num_accepted: int) -> None:
        """Learn from a verified step's outcome: `num_accepted` of `drafts` accepted."""
        state = self._requests.get(req_id)
        num_drafts = len(drafts) - drafts.count(-1)
        if state is None or not num_drafts:
            return
        tried = num_accepted + (num_accepted < num_drafts)
        state.acceptance.add(num_accepted, tried, KEEP)
        self._overall.add(num_accepted, tried, KEEP_OVERALL)
        state.waited = None if num_accepted else 0

    def record_step(self, num_reqs: int, num_tokens: int, num_drafts: int,
                    seconds: float) -> None:
        """A step's shape and wall time, learnt when it only decoded (each request one token
        and its drafts: a prompt chunk's rows cost what decode rows do not)."""
        if num_tokens == num_reqs + num_drafts:
            self.costs.record(num_tokens, seconds)

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
                self.observe(step.req_ids[i], drafts, len(tokens) - 1)
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
        self, batch: InputBatch, req_ids: list[str], rows: np.ndarray, sample_idx: np.ndarray,
        drafts: StepDrafts,
    ) -> list[list[int]]:
        """The drafts of every request that sampled this step, for its next step ([] for the
        others), one list per `req_ids` entry; `drafts`: this step's, for the next one's
        size."""
        proposals: list[list[int]] = [[] for _ in req_ids]
        draft_rows = int(drafts.num.sum())
        for i in sample_idx.tolist():
            row = rows[i]
            num_tokens = int(batch.num_tokens[row])
            params = batch.sampling_params[row]
            assert params is not None
            proposals[i] = self.propose(
                req_ids[i], batch.token_ids[row, :num_tokens], params,
                num_tokens - int(batch.num_prompt_tokens[row]), len(sample_idx),
                draft_rows - int(drafts.num[i]),
            )
        return proposals

    def finish(self, req_id: str, preempted: bool = False) -> None:
        """The request left the runner's batch: finished (the proposer may keep its tokens for
        others) or `preempted` (it comes back with the same tokens: only its state goes)."""
        self._requests.pop(req_id, None)
        self.pending.pop(req_id, None)
        if preempted:
            self.proposer.drop(req_id)
        else:
            self.proposer.finish(req_id)
