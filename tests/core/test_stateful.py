"""Random add / step / abort sequences on a small pool; invariants checked after every step.

Preemption happens by itself: the pool is small enough that running requests outgrow it.
Async scheduling keeps one step in flight, as the engine's batch queue does.
"""

from collections import deque

from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from tests.core.utils import EOS, make_request, make_scheduler
from v1.outputs import ModelRunnerOutput

BLOCK_SIZE = 4
PREFIXES = [[11] * 8, [22] * 12, []]


class SchedulerMachine(RuleBasedStateMachine):
    @initialize(
        num_blocks=st.integers(8, 24),
        budget=st.integers(8, 48),
        threshold=st.sampled_from([0, 3, 8]),
        policy=st.sampled_from(["fcfs", "priority"]),
        async_scheduling=st.booleans(),
        caching=st.booleans(),
    )
    def setup(self, num_blocks, budget, threshold, policy, async_scheduling, caching):
        self.s = make_scheduler(
            num_blocks=num_blocks, max_num_batched_tokens=budget, max_num_seqs=6,
            max_model_len=32, policy=policy, long_prefill_token_threshold=threshold,
            async_scheduling=async_scheduling, enable_prefix_caching=caching,
        )
        self.budget = budget
        self.in_flight: deque = deque()
        self.finished: set[str] = set()
        self.added: set[str] = set()

    @rule(
        prefix=st.sampled_from(PREFIXES),
        suffix_len=st.integers(1, 14),
        max_tokens=st.integers(1, 12),
        priority=st.integers(0, 3),
    )
    def add(self, prefix, suffix_len, max_tokens, priority):
        r = make_request(
            prefix + [500 + i for i in range(suffix_len)], block_size=BLOCK_SIZE,
            max_tokens=max_tokens, priority=priority,
        )
        self.added.add(r.request_id)
        self.s.add_request(r)

    @rule(eos_row=st.integers(0, 8))
    def step(self, eos_row):
        s = self.s
        placeholders = {rid: r.num_output_placeholders for rid, r in s.requests.items()}
        out = s.schedule()
        assert out.total_num_scheduled_tokens <= self.budget
        assert out.total_num_scheduled_tokens == sum(out.num_scheduled_tokens.values())
        assert len(out.num_scheduled_tokens) <= s.max_num_seqs
        if out.preempted_req_ids:
            event("preempted")
        if any(r.num_computed_tokens for r in out.scheduled_new_reqs):
            event("prefix hit")
        sampled = []
        for i, rid in enumerate(out.num_scheduled_tokens):
            r = s.requests[rid]
            if s.async_scheduling:
                samples = r.num_output_placeholders > placeholders.get(rid, 0)
            else:
                samples = r.num_computed_tokens >= r.num_tokens
            sampled.append([EOS if i == eos_row else 40 + i] if samples else [])
        self.in_flight.append((out, ModelRunnerOutput(list(out.num_scheduled_tokens), sampled)))
        if not s.async_scheduling or len(self.in_flight) == 2:
            self._finish_oldest()

    def _finish_oldest(self):
        out, model_out = self.in_flight.popleft()
        for client_outs in self.s.update_from_output(out, model_out).values():
            for o in client_outs.outputs:
                assert o.request_id not in self.finished
                if o.finish_reason is not None:
                    self.finished.add(o.request_id)

    @precondition(lambda self: bool(self.s.requests))
    @rule(data=st.data())
    def abort(self, data):
        # Arrival order, not sorted ids: ids come from a global counter, so their sort order
        # differs between replays of the same choices (hypothesis then reports it as flaky).
        rid = data.draw(st.sampled_from(list(self.s.requests)))
        self.s.finish_requests([rid])
        self.finished.add(rid)

    @invariant()
    def integrity(self):
        if hasattr(self, "s"):
            self.s.check_integrity()

    def teardown(self):
        if not hasattr(self, "s"):
            return
        for _ in range(500):
            if not self.s.has_requests() and not self.in_flight:
                break
            if self.s.has_requests():
                self.step(eos_row=99)
            else:
                self._finish_oldest()
        assert not self.s.has_requests()
        assert self.finished == self.added, "a request was lost"
        self.s.check_integrity()
        kv = self.s.kv_cache_manager
        assert kv.block_pool.get_num_free_blocks() == kv.num_blocks
        assert all(b.ref_cnt == 0 for b in kv.block_pool.blocks)


SchedulerMachine.TestCase.settings = settings(
    max_examples=150, stateful_step_count=40, deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestScheduler = SchedulerMachine.TestCase
