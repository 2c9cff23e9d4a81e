"""Prefix-aware admission (v1/core/sched/prefix_aware.py): grouping by prefix, waiting for
blocks another request is computing, and the bounds that keep both from starving anyone."""

import random

import pytest

from tests.core.utils import make_request, make_scheduler, run_step
from v1.config import SchedulerConfig


def step_counting_prompt_tokens(s) -> tuple[int, object]:
    """One step; the prompt tokens it computes (prefill, recomputation included)."""
    out, outs = run_step(s)
    computed = 0
    for req_id, n in out.num_scheduled_tokens.items():
        r = s.requests.get(req_id)
        if r is None:
            continue
        end = r.num_computed_tokens
        computed += max(0, min(end, r.num_prompt_tokens) - min(end - n, r.num_prompt_tokens))
    return computed, out


def drain_counting(s, max_steps: int = 1000) -> int:
    total = 0
    for _ in range(max_steps):
        if not s.has_requests():
            break
        total += step_counting_prompt_tokens(s)[0]
    assert not s.has_requests()
    s.check_integrity()
    return total


@pytest.mark.parametrize("aware,max_skips", [(True, 16), (True, 2), (False, 16)])
def test_cold_burst_computes_the_shared_prefix_once(aware, max_skips):
    # 4 requests arrive at once on a 32-token prefix nobody has computed; with a long-prefill
    # cap each is admitted with a chunk that (under FCFS) overlaps the others' later chunks.
    # The owner needs 4 steps for it, more than max_skips 2: the waiters wait it out anyway.
    s = make_scheduler(
        num_blocks=64, max_num_batched_tokens=64, long_prefill_token_threshold=8,
        enable_prefix_aware_scheduling=aware, prefix_aware_max_skips=max_skips,
    )
    prefix = list(range(100, 132))
    for i in range(4):
        s.add_request(make_request(prefix + [900 + 10 * i + j for j in range(4)], max_tokens=2))
    computed = drain_counting(s)
    ideal = 32 + 4 * 4
    if aware:
        assert computed == ideal
    else:
        assert computed > 1.5 * ideal


def interleaved_groups_hit_rate(aware: bool) -> float:
    """The issue's case: 4 system prompts of ~37 blocks of 16, 32 requests at once in round
    robin over them, a pool of 96 blocks."""
    rng = random.Random(0)
    s = make_scheduler(
        num_blocks=96, block_size=16, max_num_seqs=256, max_num_batched_tokens=2048,
        max_model_len=1024, enable_prefix_aware_scheduling=aware,
    )
    systems = [[rng.randrange(100, 30000) for _ in range(590)] for _ in range(4)]
    for i in range(32):
        question = [rng.randrange(100, 30000) for _ in range(rng.randint(8, 24))]
        s.add_request(make_request(systems[i % 4] + question, block_size=16, max_tokens=16,
                                   ignore_eos=True))
    drain_counting(s)
    return s.make_stats().prefix_cache_hit_rate


def test_interleaved_groups_hit_their_prefixes():
    assert interleaved_groups_hit_rate(aware=False) < 0.1  # FCFS: LRU thrashes
    assert interleaved_groups_hit_rate(aware=True) >= 0.5


def test_a_cached_prefix_goes_first():
    s = make_scheduler(num_blocks=64, max_num_batched_tokens=32, max_model_len=32)
    prefix = list(range(100, 124))
    s.add_request(make_request(prefix + [1], max_tokens=1))
    run_step(s)
    run_step(s)  # finished: its blocks are cached and free
    cold = make_request(31, max_tokens=1)
    hitter = make_request(prefix + [2, 3], max_tokens=1)
    s.add_request(cold)
    s.add_request(hitter)
    out = s.schedule()
    # The hitter costs 2 tokens; the cold one then gets what the budget leaves (FCFS: the
    # cold one 31, the hitter 1, short of its end).
    assert out.num_scheduled_tokens == {hitter.request_id: 2, cold.request_id: 30}
    assert list(out.num_scheduled_tokens) == [hitter.request_id, cold.request_id]


def passed_over_steps(max_skips: int, aware: bool = True) -> tuple[int, bool]:
    """A cold request X that does not fit the budget (chunked prefill off) waits at the head
    while a stream of short requests hitting a cached prefix arrives behind it. Returns the
    steps in which one of those was admitted while X waited, and whether X ran."""
    s = make_scheduler(
        num_blocks=128, max_num_batched_tokens=32, max_model_len=32, enable_chunked_prefill=False,
        prefix_aware_max_skips=max_skips, enable_prefix_aware_scheduling=aware,
    )
    prefix = list(range(100, 124))
    s.add_request(make_request(prefix + [1], max_tokens=1))
    run_step(s)
    run_step(s)
    # Running decodes keep the budget below X's 30 tokens.
    for i in range(4):
        s.add_request(make_request(prefix + [10 + i, 20 + i], max_tokens=4))
    run_step(s)
    x = make_request(30, max_tokens=1)
    s.add_request(x)
    passed = 0
    for step in range(60):
        for i in range(2):  # two more hitters every step
            s.add_request(make_request(prefix + [1000 + 10 * step + i, 7], max_tokens=4))
        out, _ = run_step(s)
        if x.request_id in out.num_scheduled_tokens:
            return passed, True
        passed += bool(out.scheduled_new_reqs)
        assert x.num_passed_over <= max_skips
    return passed, False


@pytest.mark.parametrize("max_skips", [1, 3, 8])
def test_a_passed_over_request_is_admitted_after_max_skips(max_skips):
    passed, ran = passed_over_steps(max_skips)
    assert ran
    assert 0 < passed <= max_skips


def test_without_the_bound_the_stream_would_starve_it():
    assert passed_over_steps(1000) == (60, False)
    assert passed_over_steps(3, aware=False) == (0, True)  # FCFS: nobody passes it


def deferral_setup(**kwargs):
    s = make_scheduler(num_blocks=64, max_num_batched_tokens=64, long_prefill_token_threshold=4,
                       **kwargs)
    prefix = list(range(100, 132))
    owner = make_request(prefix + [1, 2], max_tokens=2)
    s.add_request(owner)
    s.add_request(make_request(2, max_tokens=1))  # not alone: the owner's chunks are capped
    run_step(s)  # the owner computes 4 of its 34 tokens (the other one finishes)
    waiter = make_request(prefix + [3, 4], max_tokens=2)
    s.add_request(waiter)
    return s, owner, waiter


def test_a_request_waits_for_blocks_another_is_computing():
    s, owner, waiter = deferral_setup()
    for _ in range(6):  # the owner's next 24 tokens: the waiter is set aside meanwhile
        out, _ = run_step(s)
        assert waiter.request_id not in out.num_scheduled_tokens
    out, _ = run_step(s)  # the owner's chunk that ends the shared prefix: hit in this step
    assert out.num_scheduled_tokens[waiter.request_id] == 2  # it hits all 32 shared tokens
    assert waiter.num_cached_tokens == 32


def test_no_wait_for_an_aborted_owner():
    s, owner, waiter = deferral_setup()
    out, _ = run_step(s)
    assert waiter.request_id not in out.num_scheduled_tokens
    s.finish_requests(owner.request_id)
    out, _ = run_step(s)
    # It computes the rest itself, uncapped now that it is alone.
    assert out.num_scheduled_tokens[waiter.request_id] == 34 - 8
    assert waiter.num_cached_tokens == 8  # what the owner had computed


def test_no_wait_for_a_preempted_owner():
    # A decode admitted first grows until the pool runs out: the owner, last in the running
    # list, is preempted; the waiter must not wait for it any longer, nor deadlock with it.
    s = make_scheduler(num_blocks=11, max_num_batched_tokens=64, long_prefill_token_threshold=4)
    grower = make_request(4, max_tokens=40, ignore_eos=True)
    s.add_request(grower)
    run_step(s)
    owner = make_request(list(range(100, 132)) + [1, 2], max_tokens=2)
    s.add_request(owner)
    run_step(s)
    waiter = make_request(list(range(100, 132)) + [3, 4], max_tokens=2)
    s.add_request(waiter)
    for _ in range(100):
        out, _ = run_step(s)
        if owner.request_id in out.preempted_req_ids:
            break
        assert waiter.request_id not in out.num_scheduled_tokens
    else:
        raise AssertionError("the owner was never preempted")
    assert s.make_stats().num_preemptions == 1
    drain_counting(s)  # everyone finishes (no deadlock), integrity holds
    assert waiter.scheduled_time is not None


def test_a_waiter_whose_owner_progresses_is_not_passed_over():
    # The owner needs 7 more steps for the shared prefix, more than max_skips: the waiter is
    # being served (its owner is scheduled every step), so it still waits and hits it all.
    s, owner, waiter = deferral_setup(prefix_aware_max_skips=2)
    waited = 0
    while waiter.request_id not in run_step(s)[0].num_scheduled_tokens:
        assert waiter.num_passed_over == 0
        waited += 1
    assert waited == 6
    assert waiter.num_cached_tokens == 32


def head_wait(aware: bool, chunked: bool, max_skips: int = 1) -> int:
    """The step in which the queue head H is admitted, when a request R behind it ranks first
    (a cached prefix) but does not fit: the budget (chunking off) or the blocks (on)."""
    s = make_scheduler(
        num_blocks=400 if not chunked else 40, max_num_seqs=32, max_num_batched_tokens=64,
        max_model_len=64 if not chunked else 128, enable_chunked_prefill=chunked,
        enable_prefix_aware_scheduling=aware, prefix_aware_max_skips=max_skips,
    )
    prefix = list(range(100, 116))  # 4 blocks, cached by the running requests below
    if chunked:
        s.add_request(make_request(prefix + [1], max_tokens=20, ignore_eos=True))
        s.add_request(make_request(80, max_tokens=20, ignore_eos=True))  # 21 blocks
        r_prompt = prefix + list(range(500, 560))  # its 60-token chunk needs 15 blocks
    else:
        for i in range(18):  # decodes: 46 tokens of budget left for waiting requests
            s.add_request(make_request(prefix + [i], max_tokens=40, ignore_eos=True))
        r_prompt = prefix + list(range(500, 547))  # 47 tokens to compute: over 46
    run_step(s)
    run_step(s)
    head = make_request(6, max_tokens=1)  # cold: 6 tokens, 2 blocks, fits
    s.add_request(head)
    s.add_request(make_request(r_prompt, max_tokens=1))
    for step in range(100):
        out, _ = run_step(s)
        s.check_integrity()
        if head.request_id in out.num_scheduled_tokens:
            return step
    return -1


@pytest.mark.parametrize("chunked", [False, True])
@pytest.mark.parametrize("max_skips", [1, 16])
def test_the_head_is_admitted_when_a_request_ranked_first_does_not_fit(chunked, max_skips):
    assert head_wait(False, chunked) == 0  # FCFS
    assert head_wait(True, chunked, max_skips) == 0


def test_admission_re_ranks_by_the_blocks_an_admission_caches():
    # A (cold, first in the queue) computes P; then B, which starts with P, ranks before D
    # (cold, ahead of B): B costs 2 tokens, D gets what the budget leaves.
    s = make_scheduler(num_blocks=64, max_num_batched_tokens=32, max_model_len=64)
    prefix = list(range(100, 108))
    a, d, b = (make_request(prefix + [1]), make_request(30), make_request(prefix + [2, 3]))
    for r in (a, d, b):
        s.add_request(r)
    out = s.schedule()
    assert out.num_scheduled_tokens == {a.request_id: 9, b.request_id: 2, d.request_id: 21}


def test_no_admission_after_one_that_preempted_under_priority():
    # W1 (earliest arrival) preempts V (same priority, later arrival); V then ranks before
    # W2, which arrived after it: W2 must not be admitted in that step.
    s = make_scheduler(num_blocks=10, max_num_batched_tokens=64, policy="priority")
    v = make_request(20, max_tokens=8, arrival_time=1.0)
    s.add_request(v)
    run_step(s)
    w1 = make_request(24, max_tokens=1, arrival_time=0.0)
    w2 = make_request(4, max_tokens=1, arrival_time=2.0)
    s.add_request(w1)
    s.add_request(w2)
    out, _ = run_step(s)
    assert out.preempted_req_ids == {v.request_id}
    assert w1.request_id in out.num_scheduled_tokens
    assert w2.request_id not in out.num_scheduled_tokens
    drain_counting(s)


@pytest.mark.parametrize("tie", [True, False])
def test_priority_reorders_only_ties(tie):
    s = make_scheduler(num_blocks=64, max_num_batched_tokens=32, max_model_len=32,
                       enable_chunked_prefill=False, policy="priority")
    prefix = list(range(100, 124))
    s.add_request(make_request(prefix + [1], max_tokens=1))
    run_step(s)
    run_step(s)
    for _ in range(2):  # decodes that keep the budget short of 32
        s.add_request(make_request(4, max_tokens=8))
    run_step(s)
    cold = make_request(31, priority=0, max_tokens=1)
    hitter = make_request(prefix + [2, 3], priority=0 if tie else 1, max_tokens=1)
    s.add_request(cold)
    s.add_request(hitter)
    out, _ = run_step(s)
    assert cold.request_id not in out.num_scheduled_tokens  # 31 tokens do not fit
    assert (hitter.request_id in out.num_scheduled_tokens) is tie


def test_config_bounds():
    with pytest.raises(ValueError, match="prefix_aware_window"):
        SchedulerConfig(prefix_aware_window=0)
    with pytest.raises(ValueError, match="prefix_aware_max_skips"):
        SchedulerConfig(prefix_aware_max_skips=0)


def test_a_step_defers_at_most_a_window_of_requests():
    # Waiters on the owner's prefix fill the first window (2): the step stops there, so its
    # cost does not grow with the queue; the cold request behind them is not even tried.
    s, owner, waiter = deferral_setup(prefix_aware_window=2)
    others = [make_request(list(range(100, 132)) + [5, 6 + i], max_tokens=2) for i in range(2)]
    cold = make_request(4, max_tokens=1)
    for r in [*others, cold]:
        s.add_request(r)
    out, _ = run_step(s)
    assert list(out.num_scheduled_tokens) == [owner.request_id]
    assert [r.num_passed_over for r in (waiter, *others, cold)] == [0, 0, 0, 0]
    drain_counting(s)
    assert all(r.num_cached_tokens == 32 for r in (waiter, *others))
