"""The n-gram proposer, the runner's drafting policy (who drafts, adaptive length), and the
suffix method's wiring."""

import numpy as np
import pytest

from v1.config import SpeculativeConfig
from v1.sampling_params import SamplingParams
from v1.worker.spec_decode.drafter import CHEAP_ROWS, MAX_SKIP, Drafter, can_draft
from v1.worker.spec_decode.ngram import NgramProposer
from v1.worker.spec_decode.proposer import make_proposer


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

    def propose(self, req_id, token_ids, k):
        self.calls += 1
        return list(range(k))

    def finish(self, req_id):
        self.finished.append(req_id)

    def drop(self, req_id):
        self.finished.append(f"dropped {req_id}")


def test_drafts_that_keep_failing_back_off():
    config = SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 8})
    drafter = Drafter(config, Fixed())
    tokens, params = [0, 1, 2, 3], SamplingParams()
    assert len(drafter.propose("r", tokens, params, 1)) == 8
    # In a step that shares one read of the weights, failures only halve the length.
    for k in (4, 2, 1, 1):
        drafts = drafter.propose("r", tokens, params, 1)
        drafter.observe("r", drafts, 0, step_tokens=1 + len(drafts))
        assert len(drafter.propose("r", tokens, params, 1)) == k
    drafter.observe("r", drafts, 1, step_tokens=2)  # an acceptance resets the failures
    skipped = []
    for _ in range(6):  # every draft rejected, in crowded steps
        drafts = drafter.propose("r", tokens, params, 1)
        assert drafts
        drafter.observe("r", drafts, 0, step_tokens=CHEAP_ROWS + 1)
        n, calls = 0, drafter.proposer.calls
        while not drafter.propose("r", tokens, params, 1):
            n += 1
        skipped.append(n)
        assert drafter.proposer.calls == calls + 1  # not asked while skipping
    assert skipped == [1, 2, 4, 8, MAX_SKIP, MAX_SKIP]
    assert drafter.propose("s", tokens, SamplingParams(repetition_penalty=1.2), 1) == []
    assert "s" in drafter.pending and drafter.proposer.calls == calls + 1  # nor when it can't
    drafts = drafter.propose("r", tokens, params, 1)
    assert len(drafts) == 1  # halved each time, down to one
    drafter.observe("r", drafts, 1, step_tokens=CHEAP_ROWS + 1)
    assert len(drafter.propose("r", tokens, params, 1)) == 2  # all accepted: doubled
    # Async placeholders are filled from the last proposal; the rest stay -1.
    assert drafter.drafts_for_step("r", [-1, -1, -1]) == [0, 1, -1]
    drafter.finish("q", preempted=True)
    drafter.finish("r")
    assert drafter.proposer.finished == ["dropped q", "r"]
    assert drafter.drafts_for_step("r", [-1]) == [-1]


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
