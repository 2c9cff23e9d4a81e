"""Scheduler behaviour with hand-made model outputs (block size 4)."""

import pytest

from tests.core.utils import (
    EOS,
    ShadowRunner,
    fake_model_output,
    make_request,
    make_scheduler,
    run_step,
)
from v1.core.sched.scheduler import PauseState
from v1.outputs import ModelRunnerOutput
from v1.request import RequestStatus


def drain(scheduler, token: int = 7, max_steps: int = 1000) -> dict[str, list]:
    """Run to completion; returns req_id -> finished EngineCoreOutput."""
    finished = {}
    for _ in range(max_steps):
        if not scheduler.has_requests():
            break
        _, outs = run_step(scheduler, token)
        for client_outs in outs.values():
            for o in client_outs.outputs:
                if o.finish_reason is not None:
                    finished[o.request_id] = o
    assert not scheduler.has_requests()
    scheduler.check_integrity()
    return finished


def test_mixed_prefill_and_decode_in_one_step():
    s = make_scheduler()
    a = make_request(6, max_tokens=4)
    s.add_request(a)
    run_step(s)
    b = make_request(10)
    s.add_request(b)
    out = s.schedule()
    assert out.num_scheduled_tokens == {a.request_id: 1, b.request_id: 10}
    assert [r.req_id for r in out.scheduled_new_reqs] == [b.request_id]
    assert out.scheduled_cached_reqs.req_ids == [a.request_id]
    assert out.total_num_scheduled_tokens == 11
    s.update_from_output(out, fake_model_output(s, out))
    drain(s)


def test_new_request_data_then_deltas():
    s = make_scheduler()
    a = make_request(7, max_tokens=3)
    s.add_request(a)
    out = s.schedule()
    new = out.scheduled_new_reqs[0]
    assert new.block_ids == [0, 1] and new.num_computed_tokens == 0
    s.update_from_output(out, fake_model_output(s, out))  # 8 tokens now
    out = s.schedule()  # computes position 7: block 1 still has room
    cached = out.scheduled_cached_reqs
    assert cached.new_block_ids == [[]] and cached.num_computed_tokens == [7]
    assert cached.resumed_from_preemption == [False]
    s.update_from_output(out, fake_model_output(s, out))
    out = s.schedule()  # position 8 opens a third block
    assert out.scheduled_cached_reqs.new_block_ids == [[2]]
    s.update_from_output(out, fake_model_output(s, out))
    assert a.status == RequestStatus.FINISHED_LENGTH_CAPPED
    out = s.schedule()
    assert out.finished_req_ids == {a.request_id}
    s.check_integrity()


def test_chunked_prefill_under_budget_and_per_request_cap():
    s = make_scheduler(max_num_batched_tokens=10, long_prefill_token_threshold=4)
    a, b, c = make_request(9), make_request(9), make_request(9)
    for r in (a, b, c):
        s.add_request(r)
    out = s.schedule()
    # Each prompt gets at most 4 tokens; the budget of 10 leaves 2 for the third.
    assert list(out.num_scheduled_tokens.values()) == [4, 4, 2]
    s.update_from_output(out, fake_model_output(s, out))
    out = s.schedule()
    assert list(out.num_scheduled_tokens.values()) == [4, 4, 2]
    s.update_from_output(out, fake_model_output(s, out))
    out = s.schedule()
    assert out.num_scheduled_tokens == {a.request_id: 1, b.request_id: 1, c.request_id: 4}
    assert out.total_num_scheduled_tokens <= 10
    s.update_from_output(out, fake_model_output(s, out))
    assert a.num_output_tokens == 1 and c.num_output_tokens == 0
    drain(s)


def test_a_request_alone_is_not_held_to_the_long_prefill_threshold():
    """As vLLM: the threshold shares steps between requests; a prompt alone in the scheduler
    takes what the budget allows, and is capped again once another request runs or waits."""
    s = make_scheduler(max_num_seqs=1, max_num_batched_tokens=10, long_prefill_token_threshold=4)
    a = make_request(30)
    s.add_request(a)
    out, _ = run_step(s)
    assert out.num_scheduled_tokens == {a.request_id: 10}
    b = make_request(30)
    s.add_request(b)  # waits for a's seat: it still counts
    out, _ = run_step(s)
    assert out.num_scheduled_tokens == {a.request_id: 4}
    s.finish_requests(a.request_id)
    out, _ = run_step(s)
    assert out.num_scheduled_tokens == {b.request_id: 10}
    drain(s)


def test_a_request_alone_is_held_to_the_threshold_with_cap_lone_prefill():
    """On CPU (cap_lone_prefill): a prompt alone takes threshold-sized chunks too, so one
    arriving meanwhile waits for a short step, not a whole budget's."""
    s = make_scheduler(max_num_seqs=2, max_num_batched_tokens=10, long_prefill_token_threshold=4,
                       cap_lone_prefill=True)
    a = make_request(30)
    s.add_request(a)
    out, _ = run_step(s)
    assert out.num_scheduled_tokens == {a.request_id: 4}
    b = make_request(3)
    s.add_request(b)
    out, _ = run_step(s)
    assert out.num_scheduled_tokens == {a.request_id: 4, b.request_id: 3}
    drain(s)


def test_pause_states():
    """vLLM's pause states: PAUSED_NEW runs the running requests only, PAUSED_ALL nothing;
    new requests queue; with nothing to step the scheduler reports no work (the engine
    idles); resumed, everything goes on."""
    s = make_scheduler()
    a = make_request(6, max_tokens=3)
    s.add_request(a)
    run_step(s)
    s.pause_state = PauseState.PAUSED_ALL
    b = make_request(6, max_tokens=3)
    s.add_request(b)
    assert not s.has_requests()
    out, _ = run_step(s)
    assert out.num_scheduled_tokens == {} and a.num_output_tokens == 1
    s.pause_state = PauseState.PAUSED_NEW
    assert s.has_requests()
    out, _ = run_step(s)
    assert out.num_scheduled_tokens == {a.request_id: 1}
    run_step(s)
    assert a.is_finished() and not s.has_requests() and b.status == RequestStatus.WAITING
    s.pause_state = PauseState.UNPAUSED
    out, _ = run_step(s)
    assert out.num_scheduled_tokens == {b.request_id: 6}
    drain(s)


def test_abort_all_reports_every_request():
    s = make_scheduler(max_num_seqs=1)
    a, b = make_request(6), make_request(6)
    s.add_request(a)
    run_step(s)
    s.add_request(b)
    s.abort_all()
    assert not s.requests and s.has_requests()  # the aborts are still to be reported
    out, outs = run_step(s)
    assert out.finished_req_ids == {a.request_id, b.request_id}
    assert [(o.request_id, o.finish_reason) for o in outs[0].outputs] == [
        (a.request_id, "abort"), (b.request_id, "abort")
    ]
    assert not s.has_requests()
    s.check_integrity()


def test_long_prompt_is_not_skipped_when_chunking_is_off():
    s = make_scheduler(max_num_batched_tokens=64, max_model_len=64, enable_chunked_prefill=False)
    a = make_request(40, max_tokens=2)
    s.add_request(a)
    run_step(s)
    long, short = make_request(60), make_request(5)
    s.add_request(long)
    s.add_request(short)
    out = s.schedule()
    # 63 tokens left after a's decode: the 60-token prompt fits and goes first.
    assert list(out.num_scheduled_tokens) == [a.request_id, long.request_id]
    s.update_from_output(out, fake_model_output(s, out))
    drain(s)

    s = make_scheduler(max_num_batched_tokens=64, max_model_len=64, enable_chunked_prefill=False)
    running = make_request(10, max_tokens=8)
    s.add_request(running)
    run_step(s)
    long, short = make_request(64), make_request(5)
    s.add_request(long)
    s.add_request(short)
    out = s.schedule()
    # 63 tokens left: the long prompt does not fit whole, and the short one must wait too.
    assert list(out.num_scheduled_tokens) == [running.request_id]
    s.update_from_output(out, fake_model_output(s, out))
    drain(s)


@pytest.mark.parametrize(
    "params, tokens, reason, stop_reason, num_out",
    [
        ({}, [EOS], "stop", None, 1),
        ({"ignore_eos": True, "max_tokens": 3}, [EOS, EOS, EOS], "length", None, 3),
        ({"stop_token_ids": [9]}, [5, 9], "stop", 9, 2),
        ({"min_tokens": 2}, [EOS, 5, EOS], "stop", None, 3),
        ({"min_tokens": 2, "stop_token_ids": [9]}, [9, 9], "stop", 9, 2),
        ({"max_tokens": 2}, [5, 5], "length", None, 2),
        # On the last allowed position a stop token still reports "stop" (vLLM's order).
        ({"max_tokens": 2}, [5, EOS], "stop", None, 2),
        ({"max_tokens": 1, "stop_token_ids": [9]}, [9], "stop", 9, 1),
        ({"max_tokens": 2, "min_tokens": 2, "stop_token_ids": [9]}, [9, 9], "stop", 9, 2),
    ],
)
def test_stop_conditions(params, tokens, reason, stop_reason, num_out):
    s = make_scheduler()
    r = make_request(5, **{"max_tokens": 16, **params})
    s.add_request(r)
    for tok in tokens:
        out, outs = run_step(s, tok)
    final = outs[0].outputs[0]
    assert final.finish_reason == reason and final.stop_reason == stop_reason
    assert r.output_token_ids == tokens[:num_out]
    assert not s.has_requests()
    s.check_integrity()


def test_stop_token_at_max_model_len_reports_stop():
    s = make_scheduler(max_model_len=12)
    r = make_request(11, max_tokens=100)
    s.add_request(r)
    _, outs = run_step(s, EOS)
    assert outs[0].outputs[0].finish_reason == "stop"
    assert r.num_tokens == 12


def test_first_output_carries_queue_time():
    s = make_scheduler(max_num_seqs=1)
    first, second = make_request(5, max_tokens=2), make_request(5, max_tokens=1)
    s.add_request(first)
    s.add_request(second)  # waits for the only seat
    queue_times: dict[str, list] = {first.request_id: [], second.request_id: []}
    while s.has_requests():
        for client_outs in run_step(s)[1].values():
            for o in client_outs.outputs:
                queue_times[o.request_id].append(o.queue_time)
    first_q, later = queue_times[first.request_id]
    assert later is None  # sent once
    (second_q,) = queue_times[second.request_id]
    assert 0 <= first_q < second_q == second.scheduled_time - second.queued_time


def test_max_model_len_caps_generation():
    s = make_scheduler(max_model_len=12)
    r = make_request(10, max_tokens=100)
    s.add_request(r)
    finished = drain(s)
    assert finished[r.request_id].finish_reason == "length"
    assert r.num_tokens == 12


@pytest.mark.parametrize("num_tokens, num_blocks", [(65, 64), (40, 8)])
def test_prompt_that_can_never_fit_is_ignored_not_wedged(num_tokens, num_blocks):
    s = make_scheduler(num_blocks=num_blocks, max_model_len=64)
    big, ok = make_request(num_tokens), make_request(5, max_tokens=2)
    s.add_request(big)
    s.add_request(ok)
    finished = drain(s)
    assert finished[big.request_id].finish_reason == "length"
    assert "exceeds" in finished[big.request_id].stop_reason
    assert big.status == RequestStatus.FINISHED_IGNORED
    assert finished[ok.request_id].finish_reason == "length"


def test_preemption_under_tiny_pool_and_resumption_with_all_tokens():
    s = make_scheduler(num_blocks=6, max_num_batched_tokens=64)
    a, b = make_request(7, max_tokens=8), make_request(7, max_tokens=8)
    s.add_request(a)
    s.add_request(b)
    seen_preempted = seen_resumed = False
    outputs: dict[str, list[int]] = {a.request_id: [], b.request_id: []}
    for step in range(100):
        if not s.has_requests():
            break
        out = s.schedule()
        if out.preempted_req_ids:
            seen_preempted = True
            assert out.preempted_req_ids == {b.request_id}  # FCFS evicts the last
            assert not out.scheduled_new_reqs  # nothing admitted in a preempting step
        cached = out.scheduled_cached_reqs
        for rid, resumed, toks in zip(
            cached.req_ids, cached.resumed_from_preemption, cached.resumed_token_ids
        ):
            if resumed:
                seen_resumed = True
                req = s.requests[rid]
                assert toks == req.prompt_token_ids + req.output_token_ids
                assert req.num_preemptions == 1
        model_out = fake_model_output(s, out, token=10 + step)
        for rid, toks in zip(model_out.req_ids, model_out.sampled_token_ids):
            outputs[rid] += toks
        s.update_from_output(out, model_out)
        s.check_integrity()
    assert seen_preempted and seen_resumed
    assert a.output_token_ids == outputs[a.request_id] and len(outputs[a.request_id]) == 8
    assert b.output_token_ids == outputs[b.request_id] and len(outputs[b.request_id]) == 8
    assert s.make_stats().num_preemptions >= 1
    s.check_integrity()


def test_priority_order_of_admission():
    s = make_scheduler(policy="priority", max_num_seqs=1)
    lax = make_request(4, priority=5, max_tokens=1)
    urgent = make_request(4, priority=0, max_tokens=1)
    s.add_request(lax)
    s.add_request(urgent)
    out = s.schedule()
    assert list(out.num_scheduled_tokens) == [urgent.request_id]
    s.update_from_output(out, fake_model_output(s, out))
    drain(s)


def test_priority_preemption_by_better_waiting_request():
    s = make_scheduler(policy="priority", max_num_seqs=2)
    lax1 = make_request(4, priority=5, max_tokens=20)
    lax2 = make_request(4, priority=3, max_tokens=20)
    s.add_request(lax1)
    s.add_request(lax2)
    run_step(s)
    urgent = make_request(4, priority=0, max_tokens=2)
    s.add_request(urgent)
    out = s.schedule()
    assert out.preempted_req_ids == {lax1.request_id}  # the worst priority goes
    assert urgent.request_id in out.num_scheduled_tokens
    assert lax1.request_id not in out.num_scheduled_tokens
    assert lax1.status == RequestStatus.PREEMPTED
    s.update_from_output(out, fake_model_output(s, out))
    s.check_integrity()
    drain(s)
    assert lax1.num_output_tokens == 20


def test_priority_preemption_when_blocks_run_out_takes_worst_running():
    s = make_scheduler(policy="priority", num_blocks=5, max_num_batched_tokens=64)
    good = make_request(7, priority=0, max_tokens=12, arrival_time=10.0)
    bad = make_request(7, priority=9, max_tokens=12, arrival_time=0.0)
    s.add_request(bad)
    s.add_request(good)
    victims = set()
    for _ in range(100):
        if not s.has_requests():
            break
        out, _ = run_step(s)
        victims |= out.preempted_req_ids
        s.check_integrity()
    assert victims == {bad.request_id}
    assert good.num_preemptions == 0 and bad.num_preemptions >= 1


def run_with_shadow(s, runner: ShadowRunner, max_steps: int = 200) -> set[str]:
    """Step to completion through the KV-checking runner; returns every preempted id."""
    preempted: set[str] = set()
    for _ in range(max_steps):
        if not s.has_requests():
            break
        out = s.schedule()
        preempted |= out.preempted_req_ids
        s.update_from_output(out, runner.execute(out, eos_row=-1))
        s.check_integrity()
    assert not s.has_requests()
    return preempted


def low_then_high(num_blocks: int, low_prompt: int, max_tokens: int):
    """Priority policy, chunks of 16: `low` runs its first chunk (beside a short request
    that then finishes), then an 8-token `high` arrives."""
    s = make_scheduler(
        policy="priority", num_blocks=num_blocks, max_num_batched_tokens=64,
        long_prefill_token_threshold=16,
    )
    low = make_request(low_prompt, priority=1, max_tokens=max_tokens)
    high = make_request(8, priority=0, max_tokens=max_tokens)
    runner = ShadowRunner(4)
    s.add_request(low)
    # Not alone, so that its chunk is capped; this one finishes in the step.
    s.add_request(make_request(2, priority=2, max_tokens=1))
    s.update_from_output(out := s.schedule(), runner.execute(out, eos_row=-1))
    s.add_request(high)
    return s, runner, low, high


def test_priority_preemption_never_undoes_a_scheduled_running_request():
    # `low` runs first; `high` joins. With 2 blocks left, `low`'s third chunk (2 blocks)
    # would fit and then `high`'s decode (1 block) would not: evicting `low` then would
    # undo a chunk whose full blocks were already findable. Running requests are served
    # best first instead, so `low` is the one that cannot allocate, and preempts itself.
    s, runner, low, high = low_then_high(num_blocks=12, low_prompt=40, max_tokens=4)
    assert run_with_shadow(s, runner) == {low.request_id}
    assert low.num_output_tokens == high.num_output_tokens == 4


def test_preempting_a_request_scheduled_this_step_unhashes_what_it_was_to_write():
    # `high` needs 2 blocks, 1 is free: it preempts `low`, whose second chunk (blocks 4-7,
    # made findable when scheduled) is then never computed.
    s, runner, low, high = low_then_high(num_blocks=9, low_prompt=32, max_tokens=3)
    out = s.schedule()
    assert out.preempted_req_ids == {low.request_id}
    assert list(out.num_scheduled_tokens) == [high.request_id]
    index = s.kv_cache_manager.block_pool.cached_block_hash_to_block
    assert all(h in index for h in low.block_hashes[:4])  # computed in step 1
    assert not any(h in index for h in low.block_hashes[4:])
    s.update_from_output(out, runner.execute(out, eos_row=-1))
    run_with_shadow(s, runner)
    assert low.num_output_tokens == high.num_output_tokens == 3


def test_no_preemption_for_a_waiting_request_that_still_would_not_fit():
    # Seats are full. Evicting `low` frees 2 blocks, 3 in all, and `mid` needs 4; `high`
    # ranks above `mid` and stays. So nobody is preempted, and `low` keeps running.
    s = make_scheduler(policy="priority", num_blocks=8, max_num_seqs=2)
    high = make_request(19, priority=0, max_tokens=8)
    low = make_request(7, priority=2, max_tokens=8)
    s.add_request(high)
    s.add_request(low)
    run_step(s)
    mid = make_request(16, priority=1, max_tokens=2)
    s.add_request(mid)
    out = s.schedule()
    assert not out.preempted_req_ids
    assert list(out.num_scheduled_tokens) == [high.request_id, low.request_id]
    s.update_from_output(out, fake_model_output(s, out))
    drain(s)


def test_no_preemption_for_token_budget():
    # Chunked prefill off: the better prompt (30 tokens) misses the budget by the decodes'
    # 4 tokens. Blocks and seats are plenty, so nobody loses their KV for it: it waits.
    s = make_scheduler(
        policy="priority", num_blocks=256, max_num_batched_tokens=32, max_model_len=32,
        enable_chunked_prefill=False,
    )
    low = [make_request(4, priority=1, max_tokens=20) for _ in range(4)]
    for r in low:
        s.add_request(r)
    run_step(s)
    s.add_request(make_request(30, priority=0, max_tokens=4))
    out = s.schedule()
    assert not out.preempted_req_ids
    assert list(out.num_scheduled_tokens) == [r.request_id for r in low]
    s.update_from_output(out, fake_model_output(s, out))
    drain(s)


def test_abort_frees_everything():
    s = make_scheduler()
    running, waiting = make_request(9), make_request(9)
    s.add_request(running)
    run_step(s)
    s.add_request(waiting)
    s.finish_requests([running.request_id, waiting.request_id, "unknown"])
    assert running.status == waiting.status == RequestStatus.FINISHED_ABORTED
    assert not s.has_requests()
    out = s.schedule()
    assert out.finished_req_ids == {running.request_id, waiting.request_id}
    s.check_integrity()
    assert s.kv_cache_manager.block_pool.get_num_free_blocks() == 64


def test_duplicate_request_id_rejected():
    s = make_scheduler()
    s.add_request(make_request(4, request_id="x"))
    with pytest.raises(ValueError, match="'x'"):
        s.add_request(make_request(4, request_id="x"))


def test_prefix_hit_reports_num_cached_tokens_and_stats():
    s = make_scheduler()
    a = make_request(13, max_tokens=1)
    s.add_request(a)
    drain(s)
    b = make_request(a.prompt_token_ids, max_tokens=1)
    s.add_request(b)
    out = s.schedule()
    assert out.scheduled_new_reqs[0].num_computed_tokens == 12
    assert out.num_scheduled_tokens[b.request_id] == 1
    _ = s.update_from_output(out, fake_model_output(s, out))
    assert b.num_cached_tokens == 12
    stats = s.make_stats()
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (26, 12)
    assert stats.num_prompt_tokens == 26 and stats.num_generation_tokens == 2


def test_async_scheduling_runs_one_step_ahead_with_placeholders():
    s = make_scheduler(async_scheduling=True)
    a = make_request(5, max_tokens=3)
    s.add_request(a)
    out1 = s.schedule()
    assert a.num_output_placeholders == 1
    out2 = s.schedule()  # before out1's result: decodes the placeholder position
    assert out2.num_scheduled_tokens == {a.request_id: 1}
    assert a.num_computed_tokens == 6 and a.num_output_placeholders == 2
    s.update_from_output(out1, ModelRunnerOutput([a.request_id], [[11]]))
    out3 = s.schedule()
    s.update_from_output(out2, ModelRunnerOutput([a.request_id], [[12]]))
    # max_tokens=3 and 3 are known or in flight: nothing more is scheduled.
    assert s.schedule().num_scheduled_tokens == {}
    s.update_from_output(out3, ModelRunnerOutput([a.request_id], [[13]]))
    assert a.output_token_ids == [11, 12, 13] and a.is_finished()
    s.check_integrity()


def test_empty_prompt_is_refused_not_queued():
    """A request with no prompt token (the processor refuses one; here it is bypassed) is a
    ValueError: queued, it would have nothing to compute and hold the FCFS queue's head
    forever."""
    s = make_scheduler()
    with pytest.raises(ValueError, match="'empty'.*no prompt tokens"):
        s.add_request(make_request([], request_id="empty"))
    assert not s.has_requests()
    ok = make_request(5, max_tokens=2)
    s.add_request(ok)
    assert drain(s)[ok.request_id].finish_reason == "length"
