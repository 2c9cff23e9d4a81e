"""The n-gram proposer, the runner's drafting policy (who drafts, how many tokens, priced on
fixed step-cost tables), and the suffix method's wiring."""

import itertools
from collections.abc import Callable

import numpy as np
import pytest

from tests.worker.step_costs import FixedStepCosts
from v1.config import SpeculativeConfig
from v1.sampling_params import SamplingParams
from v1.worker.spec_decode.drafter import PROBE_SHARE, Drafter, can_draft
from v1.worker.spec_decode.ngram import NgramProposer
from v1.worker.spec_decode.proposer import make_proposer
from v1.worker.spec_decode.step_cost import MEASURE_SHARE, MIN_SAMPLES, MeasuredStepCosts, StepCosts


def test_ngram_takes_the_longest_most_recent_match():
    p = NgramProposer(1, 3)
    # "1 2 3" occurs twice: the later occurrence's continuation wins.
    assert p.propose("r", [1, 2, 3, 4, 5, 1, 2, 3, 6, 7, 9, 1, 2, 3], 2) == [6, 7]
    # No 3- or 2-gram match: the 1-gram "9" does.
    assert p.propose("r", [9, 4, 5, 8, 9], 3) == [4, 5, 8]
    assert p.propose("r", [1, 2, 3, 4], 3) == []  # nothing repeats
    assert p.propose("r", [7, 7], 4) == [7]  # only what follows the match exists
    assert NgramProposer(2, 2).propose("r", np.array([5, 6, 1, 5, 6]), 2) == [1, 5]
    with pytest.raises(ValueError):
        NgramProposer(3, 2)


def test_requests_whose_rows_differ_are_not_drafted():
    assert can_draft(SamplingParams(temperature=0.8, logprobs=2), num_output=0)
    assert not can_draft(SamplingParams(repetition_penalty=1.2), num_output=0)
    assert not can_draft(SamplingParams(min_tokens=4), num_output=3)
    assert can_draft(SamplingParams(stop=["four one"]), num_output=0)  # the frontend cuts
    assert can_draft(SamplingParams(min_tokens=4), num_output=4)


class Fixed:
    """A proposer that always proposes 0, 1, 2, ..."""

    def __init__(self) -> None:
        self.finished: list[str] = []
        self.calls = 0
        self.silent: set[str] = set()  # requests it finds nothing for

    def propose(self, req_id, token_ids, k):
        self.calls += 1
        self.last_tokens = token_ids
        return [] if req_id in self.silent else list(range(k))

    def finish(self, req_id):
        self.finished.append(req_id)

    def drop(self, req_id):
        self.finished.append(f"dropped {req_id}")


def drafter_on(costs: "StepCosts | Callable[[float], float]", max_k: int = 8) -> Drafter:
    """A drafter of up to `max_k` tokens with the `Fixed` proposer, priced on `costs` (a
    function: the fixed table of that many milliseconds for a step of n rows)."""
    config = SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": max_k})
    if callable(costs):
        costs = FixedStepCosts(costs)
    return Drafter(config, costs, Fixed())


def draft_lengths(drafter: Drafter, steps: int, num_accepted=lambda drafts: 0,
                  req_id: str = "r", batch_size: int = 1) -> list[int]:
    """Each step's draft length for one request, its drafts verified with
    `num_accepted(drafts)` accepted."""
    lengths = []
    for _ in range(steps):
        drafts = drafter.propose(req_id, [0, 1, 2, 3], SamplingParams(), 1, batch_size)
        if drafts:
            drafter.observe(req_id, drafts, num_accepted(drafts))
        lengths.append(len(drafts))
    return lengths


# Milliseconds per step of n rows: each row costs half a step of one (compute-bound), or next
# to nothing; or rows are free up to 4 and then each costs more than a step of one.
def DEAR(n):
    return 5.0 + 5.0 * n


def CHEAP(n):
    return 10.0 + 0.1 * n


def KNEE(n):
    return 10.0 + 12.0 * max(n - 4, 0)


def test_drafts_are_priced_on_step_costs():
    # Every draft rejected (random text): where a row costs half a step, one draft is enough
    # to stop (the expected gain of even one token is below its row's cost); where rows are
    # nearly free, the request keeps drafting, shorter as its acceptance estimate falls.
    assert draft_lengths(drafter_on(DEAR), 10) == [8] + [0] * 9
    cheap = draft_lengths(drafter_on(CHEAP), 10)
    assert cheap[0] == 8 and all(cheap) and cheap == sorted(cheap, reverse=True)
    assert cheap[-1] < 8
    # Where drafts are accepted they pay even on dear rows: all accepted, all drafted.
    assert draft_lengths(drafter_on(DEAR), 10, len) == [8] * 10
    # Where a row costs more than a step of one, not even accepted drafts pay: no draft, no
    # probe, the proposer not asked.
    drafter = drafter_on(lambda n: 12.0 * n - 2)
    assert draft_lengths(drafter, 10, len) == [0] * 10 and drafter.proposer.calls == 0


def test_drafts_fill_the_rows_that_cost_less_than_the_tokens_they_save():
    # Every draft accepted. At batch 1 rows up to 4 are free and each one beyond costs 12
    # ms, more than the 10 a token saves: 3 drafts.
    assert draft_lengths(drafter_on(KNEE), 5, len) == [3] * 5
    # At batch 8 a token saves a request's share of the step, (10 + 48) / 8 ms, less than a
    # row: no drafts, no probes, the proposer not asked.
    drafter = drafter_on(KNEE)
    assert draft_lengths(drafter, 5, len, batch_size=8) == [0] * 5
    assert drafter.proposer.calls == 0


def test_random_text_backs_off_to_probes_of_a_bounded_cost():
    # Every draft rejected, 1000 steps at batch 1: after the first draft, the probes' rows
    # (5 ms each) cost at most PROBE_SHARE of the steps' tokens (10 ms each), one probe's
    # rounding aside.
    lengths = draft_lengths(drafter_on(DEAR), 1000)
    assert lengths[0] == 8 and max(lengths[1:]) == 1
    assert 5.0 * sum(lengths[1:]) <= PROBE_SHARE * 10.0 * 1000 + 5.0
    assert sum(lengths[1:]) >= 10  # it keeps probing


def test_a_request_that_stopped_drafting_probes_at_a_bounded_cost():
    drafter = drafter_on(DEAR)
    assert draft_lengths(drafter, 1) == [8]
    calls = drafter.proposer.calls
    # A probe row costs 5 ms, a token's share of a step 10: it waits 5 / (PROBE_SHARE * 10)
    # steps, the proposer not asked meanwhile.
    wait = round(5 / (PROBE_SHARE * 10))
    assert draft_lengths(drafter, wait) == [0] * wait
    assert drafter.proposer.calls == calls
    assert draft_lengths(drafter, 1) == [1]  # a rejected probe: the wait again
    assert draft_lengths(drafter, wait) == [0] * wait
    # Accepted probes: no wait, and acceptance brings longer drafts back.
    lengths = draft_lengths(drafter, 12, len)
    assert lengths[:3] == [1, 1, 1] and lengths == sorted(lengths) and lengths[-1] == 8


def test_a_new_request_starts_from_the_acceptance_of_the_others():
    drafter = drafter_on(CHEAP)
    draft_lengths(drafter, 10, req_id="r")
    first = draft_lengths(drafter, 1, req_id="s")[0]
    assert 0 < first < 8  # not every token, as the first request did
    drafter = drafter_on(DEAR)
    draft_lengths(drafter, 10, req_id="r")
    assert draft_lengths(drafter, 3, req_id="s") == [1, 0, 0]  # one probe, then waits
    # As the others' acceptance is now, not as it was when the request came.
    drafter = drafter_on(DEAR)
    drafter.proposer.silent.add("s")
    assert draft_lengths(drafter, 1, req_id="s") == [0]  # would have drafted all: none found
    draft_lengths(drafter, 10, req_id="r")
    drafter.proposer.silent.clear()
    assert draft_lengths(drafter, 1, req_id="s") == [1]  # a probe


def learnt(cost_ms, sizes=(1, 2, 4, 8, 16)) -> MeasuredStepCosts:
    """Step costs measured from steps that took `cost_ms(n)` milliseconds for n rows."""
    costs = MeasuredStepCosts()
    for n in sizes:
        for _ in range(MIN_SAMPLES):
            costs.record(n, cost_ms(n) / 1e3)
    return costs


def test_what_is_measured_first_and_what_teaches_the_costs():
    drafter = drafter_on(MeasuredStepCosts())
    # Nothing measured: first steps without drafts (the batch's own rows), the proposer not
    # asked; then steps with every token drafted, as if rows were free (the rows drafts add).
    assert draft_lengths(drafter, 2) == [0, 0] and drafter.proposer.calls == 0
    for _ in range(MIN_SAMPLES):
        drafter.record_step(2, 40, 0, 0.5)  # a prompt chunk's rows: not a decode step's
        drafter.record_step(1, 1, 0, 0.01)
    assert draft_lengths(drafter, 5) == [8] * 5
    for _ in range(MIN_SAMPLES):
        drafter.record_step(2, 9, 7, 0.05)  # two requests, one with 7 drafts
    assert drafter.costs.learnt(9) and drafter.costs.cost(1) == pytest.approx(0.01)
    assert drafter.costs.cost(41) == pytest.approx(0.01 + 40 * 0.005)  # not the chunk's
    assert draft_lengths(drafter, 1) == [0]  # rejected all along, rows now priced


def test_steps_larger_than_any_measured_are_drafted_and_measured():
    drafter = drafter_on(learnt(DEAR))  # measured up to 16 rows
    assert draft_lengths(drafter, 3) == [8, 0, 0]
    tokens, params = [0, 1, 2, 3], SamplingParams()
    # At 16 requests, 16 + 8 rows were never measured: it drafts, as before any measurement.
    assert len(drafter.propose("r", tokens, params, 1, batch_size=16)) == 8
    for _ in range(MIN_SAMPLES):
        drafter.record_step(16, 24, 8, DEAR(24) / 1e3)
    assert drafter.propose("r", tokens, params, 1, batch_size=16) == []  # priced now


def test_one_odd_step_does_not_flip_a_decision():
    drafter = drafter_on(learnt(lambda n: 15.0 * n - 5))  # a row: 1.5x a step of one
    assert draft_lengths(drafter, 3) == [0, 0, 0]
    drafter.costs.record(1, 1.0)  # one step 100x slower than its bucket (dearer tokens)
    drafter.costs.record(2, 0.0001)  # one of two rows 200x faster (a cheap draft row)
    assert draft_lengths(drafter, 1) == [0]


def test_drafts_priced_out_while_the_machine_was_busy_come_back():
    # Quiet, a step of one row takes 10 ms and each draft row 1 ms more; every draft is
    # accepted. While the machine was busy, steps of 5 rows measured 60 ms: a draft row
    # 12.5 ms, more than the 10 ms a token saves, so drafting stopped, and with it the
    # measuring of those steps.
    drafter = drafter_on(MeasuredStepCosts(), max_k=4)
    for _ in range(MIN_SAMPLES):
        drafter.record_step(1, 1, 0, 0.010)
        drafter.record_step(1, 5, 4, 0.060)
    lengths = []
    for _ in range(3000):
        k = draft_lengths(drafter, 1, len)[0]
        drafter.record_step(1, 1 + k, k, (10.0 + k) / 1e3)
        lengths.append(k)
    # Until the busy measurement ages out (MIN_SAMPLES x 60 ms / MEASURE_SHARE of steps of
    # 10 ms), none; then drafted, measured quiet, and drafted from then on, but for the
    # MIN_SAMPLES steps without drafts that measure a step of one row again when its
    # measurement ages out in turn (MIN_SAMPLES x 10 ms / MEASURE_SHARE of steps).
    runs = [(k, len(list(steps))) for k, steps in itertools.groupby(lengths)]
    assert runs[0][0] == 0
    assert runs[0][1] == pytest.approx(MIN_SAMPLES * 0.060 / MEASURE_SHARE / 0.010, abs=1)
    assert [k for k, _ in runs[1:]] == [4, 0] * ((len(runs) - 2) // 2) + [4]
    assert len(runs) > 6 and all(n == MIN_SAMPLES for k, n in runs[1:] if k == 0)
    for _, n in runs[1:-1:2]:  # steps of 14 ms
        assert n == pytest.approx(MIN_SAMPLES * 0.010 / MEASURE_SHARE / 0.014, abs=1)
    assert drafter.costs.cost(1) == pytest.approx(0.010)
    assert drafter.costs.cost(5) == pytest.approx(0.014)


@pytest.mark.parametrize("accepted", ["none", "all"])
def test_measured_costs_over_a_long_run(accepted):
    # Steps cost DEAR's milliseconds, measured; 5000 steps at batch 1. Random text: the rows
    # drafted (the first measuring, probes, measuring again as measurements age out) cost
    # under 2% of the steps' time. Every draft accepted: drafted but for the steps that
    # measure a step of one row again.
    drafter = drafter_on(MeasuredStepCosts(), max_k=4)
    total = extra = 0.0
    lengths = []
    for _ in range(5000):
        k = draft_lengths(drafter, 1, len if accepted == "all" else lambda drafts: 0)[0]
        drafter.record_step(1, 1 + k, k, DEAR(1 + k) / 1e3)
        total += DEAR(1 + k)
        extra += DEAR(1 + k) - DEAR(1)
        lengths.append(k)
    if accepted == "none":
        assert extra / total < 0.02
        assert lengths.count(4) > 3 * MIN_SAMPLES  # measured again, more than once
    else:
        assert lengths.count(4) > 0.95 * len(lengths)


def test_who_drafts_and_async_placeholders():
    drafter = drafter_on(DEAR)
    tokens, params = [0, 1, 2, 3], SamplingParams()
    assert drafter.propose("s", tokens, SamplingParams(repetition_penalty=1.2), 1) == []
    assert "s" in drafter.pending and drafter.proposer.calls == 0  # not asked: can't draft
    drafts = drafter.propose("r", tokens, params, 1)
    drafter.observe("r", drafts, 1)
    assert drafter.propose("r", tokens, params, 1) == [0]  # 1 of 8 accepted: one pays
    # Async placeholders are filled from the last proposal; the rest stay -1.
    assert drafter.drafts_for_step("r", [-1, -1, -1]) == [0, -1, -1]
    drafter.finish("q", preempted=True)
    drafter.finish("r")
    assert drafter.proposer.finished == ["dropped q", "r"]
    assert drafter.drafts_for_step("r", [-1]) == [-1]


def test_the_history_reaches_the_proposer_uncopied():
    # The runner's view of its token buffer goes as it is: no list of the whole history per
    # request and step (the proposers read it during the call and copy what they keep).
    drafter = drafter_on(CHEAP)
    history = np.arange(600, dtype=np.int32)[:512]
    drafter.propose("r", history, SamplingParams(), 1)
    assert drafter.proposer.last_tokens is history


def test_suffix_method_builds_its_proposer_or_says_why_not():
    config = SpeculativeConfig.from_dict(
        {"method": "suffix", "num_speculative_tokens": 4, "suffix_decoding_max_tree_depth": 8}
    )
    try:
        import v1.worker.spec_decode.suffix  # noqa: F401
    except ImportError:
        with pytest.raises(ValueError, match="suffix"):
            make_proposer(config)
    else:
        proposer = make_proposer(config)
        assert isinstance(proposer.propose("r", [1, 2, 3], 4), list)  # built from our keys
