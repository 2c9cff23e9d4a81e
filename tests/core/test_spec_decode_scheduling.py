"""Speculative decoding in the scheduler: drafts are budgeted, get KV slots, are rolled back
when rejected, never hashed, never scheduled mid-prefill (block size 4, hand-made outputs)."""

from tests.core.utils import EOS, make_request, make_scheduler
from v1.outputs import ModelRunnerOutput


def decode_ready(s, prompt_len=6, max_tokens=16, **params):
    """A request past its prefill (one token sampled), with drafts [50, 51, 52] proposed."""
    r = make_request(prompt_len, max_tokens=max_tokens, **params)
    s.add_request(r)
    out = s.schedule()
    drafts = ModelRunnerOutput([r.request_id], [[7]], spec_token_ids=[[50, 51, 52]])
    s.update_from_output(out, drafts)
    return r


def test_drafts_are_scheduled_with_the_decode_and_rejected_ones_rolled_back():
    s = make_scheduler()
    r = decode_ready(s)
    assert r.spec_token_ids == [50, 51, 52]
    out = s.schedule()
    assert out.scheduled_spec_decode_tokens == {r.request_id: [50, 51, 52]}
    assert out.num_scheduled_tokens[r.request_id] == 4  # its last token + 3 drafts
    assert r.num_computed_tokens == 6 + 1 + 3
    assert len(s.kv_cache_manager.req_to_blocks[r.request_id]) == 3  # 10 slots
    # One draft accepted, then the runner's own token: two rejected.
    s.update_from_output(out, ModelRunnerOutput([r.request_id], [[50, 60]], spec_token_ids=[[]]))
    assert r.output_token_ids == [7, 50, 60]
    assert r.num_computed_tokens == 8 == r.num_tokens - 1
    # Blocks are hashed from accepted tokens only: 9 known tokens, 2 full blocks.
    assert len(r.block_hashes) == 2
    assert s.spec_stats.num_drafts == 1
    assert (s.spec_stats.num_draft_tokens, s.spec_stats.num_accepted_tokens) == (3, 1)
    assert s.spec_stats.accepted_per_pos == [1, 0, 0]
    stats = s.make_stats()
    assert stats.spec_decode_acceptance_rate == 1 / 3
    assert r.spec_token_ids == []
    out = s.schedule()
    assert not out.scheduled_spec_decode_tokens
    assert out.num_scheduled_tokens[r.request_id] == 1
    s.check_integrity()


def test_drafts_count_against_the_budget_and_max_tokens():
    s = make_scheduler(max_num_batched_tokens=3)
    r = decode_ready(s, prompt_len=3)
    out = s.schedule()
    assert out.scheduled_spec_decode_tokens == {r.request_id: [50, 51]}
    assert out.total_num_scheduled_tokens == 3

    s = make_scheduler()
    r = decode_ready(s, max_tokens=3)  # 1 sampled: 2 more at most, so one draft
    out = s.schedule()
    assert out.scheduled_spec_decode_tokens == {r.request_id: [50]}


def test_a_request_mid_prefill_is_not_drafted():
    s = make_scheduler(max_num_batched_tokens=4)
    r = make_request(10)
    s.add_request(r)
    r.spec_token_ids = [50, 51]  # as if proposed: a chunk must not carry them
    out = s.schedule()
    assert out.num_scheduled_tokens[r.request_id] == 4
    assert not out.scheduled_spec_decode_tokens


def test_tokens_after_a_stop_are_dropped():
    s = make_scheduler()
    r = decode_ready(s)
    out = s.schedule()
    outs = s.update_from_output(out, ModelRunnerOutput([r.request_id], [[50, EOS, 9]]))
    (o,) = outs[0].outputs
    assert o.new_token_ids == [50, EOS]
    assert o.finish_reason == "stop"
    assert not s.has_requests()
    s.check_integrity()


def test_a_block_completed_by_the_last_accepted_drafts_is_cached():
    """The step that verifies drafts and finishes the request completes a block with tokens
    not known when it was scheduled: it is cached before the request's blocks go, so a
    prompt repeating those tokens hits it."""
    s = make_scheduler()
    r = decode_ready(s, max_tokens=5)  # 6 prompt tokens + 7; drafts [50, 51, 52]
    out = s.schedule()
    outs = s.update_from_output(
        out, ModelRunnerOutput([r.request_id], [[50, 51, 52, 60]], spec_token_ids=[[]])
    )
    assert outs[0].outputs[0].finish_reason == "length"
    # Block 1 (positions 4-7) ends with draft 50; block 2 (8-11) is not full.
    again = make_request(r.all_token_ids[:8] + [99])
    s.add_request(again)
    s.schedule()
    assert again.num_cached_tokens == 8
    s.check_integrity()


def test_async_placeholders_cover_the_drafts():
    s = make_scheduler(async_scheduling=True)
    r = make_request(6)
    s.add_request(r)
    out1 = s.schedule()  # the prefill: one placeholder
    s.update_from_output(out1, ModelRunnerOutput([r.request_id], [[7]], spec_token_ids=[[50, 51]]))
    out2 = s.schedule()
    assert out2.scheduled_spec_decode_tokens == {r.request_id: [-1, -1]}  # the runner fills
    assert r.num_output_placeholders == 3  # 1 + k
    out3 = s.schedule()  # while out2 runs: as many placeholders for drafts as last proposed
    assert out3.scheduled_spec_decode_tokens == {r.request_id: [-1, -1]}
    assert r.num_output_placeholders == 6 and r.num_computed_tokens == 6 + 3 + 3
    # out2 accepted one draft of two: its three placeholders resolve, one slot rolls back.
    s.update_from_output(out2, ModelRunnerOutput([r.request_id], [[50, 60]], spec_token_ids=[[]]))
    assert r.num_output_placeholders == 3
    assert r.num_computed_tokens == 11 == r.num_tokens + r.num_output_placeholders - 1
    s.update_from_output(out3, ModelRunnerOutput([r.request_id], [[61]]))  # none accepted
    assert r.output_token_ids == [7, 50, 60, 61]
    assert r.num_output_placeholders == 0 and r.num_computed_tokens == r.num_tokens - 1
    s.check_integrity()


def test_preemption_drops_the_drafts():
    s = make_scheduler(num_blocks=4, max_num_seqs=2)
    a, b = make_request(6), make_request(6)
    s.add_request(a)
    s.add_request(b)
    out = s.schedule()  # both prefills: 2 blocks each
    ids = [a.request_id, b.request_id]
    s.update_from_output(out, ModelRunnerOutput(ids, [[7], [7]], spec_token_ids=[[50, 51]] * 2))
    out = s.schedule()  # each wants 9 slots (3 blocks): b is preempted
    assert b.request_id in out.preempted_req_ids
    assert b.spec_token_ids == []
    assert out.scheduled_spec_decode_tokens == {a.request_id: [50, 51]}
    s.check_integrity()


def test_unfilled_async_drafts_are_not_counted_as_drafts():
    """Under async a step is sized by an older proposal; drafts the runner had no proposal
    for (-1, never accepted) are not drafts in the metrics: acceptance is of real ones."""
    s = make_scheduler(async_scheduling=True)
    r = make_request(6)
    s.add_request(r)
    out1 = s.schedule()
    s.update_from_output(out1, ModelRunnerOutput([r.request_id], [[7]],
                                                 spec_token_ids=[[50, 51, 52]]))
    out2 = s.schedule()
    assert out2.scheduled_spec_decode_tokens == {r.request_id: [-1, -1, -1]}
    # The runner had one draft for it (50), accepted; two slots unfilled.
    s.update_from_output(out2, ModelRunnerOutput([r.request_id], [[50, 60]],
                                                 num_unfilled_drafts={r.request_id: 2}))
    stats = s.spec_stats
    assert (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens) == (1, 1, 1)
    assert stats.accepted_per_pos == [1]
    assert r.num_computed_tokens == r.num_tokens - 1  # all three rolled back but the one
