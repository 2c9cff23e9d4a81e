"""Phase 2 of `Scheduler.schedule()`: admitting waiting requests.

`WaitingAdmission` is owned by the `Scheduler`, which gives it the waiting queue and running
list (changed in place), the KV cache manager, the disk tier, the limits (`AdmissionPolicy`),
and two operations: preempt a running request, drop a waiting one that can never run. Waiting
requests are tried a window at a time in `WindowOrder` (queue or prefix-aware order); those not
admitted go back in queue order. Invariants: nothing is admitted in a step that preempted for
lack of blocks; a request is preempted for a waiting one only if that one is then admitted; the
earliest request left in queue order that does not fit ends admission.
"""

import bisect
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import NamedTuple

from v1.config import CacheConfig, SchedulerConfig
from v1.core.block_pool import KVCacheBlock
from v1.core.kv_cache_manager import FreedBlocks, KVCacheManager
from v1.core.sched.disk_tier import DiskTierScheduling
from v1.core.sched.prefix_aware import PrefillIndex, WindowOrder
from v1.core.sched.request_queue import RequestQueue
from v1.request import Request, RequestStatus

RUNNING = RequestStatus.RUNNING
WAITING = RequestStatus.WAITING
WAITING_FOR_FSM = RequestStatus.WAITING_FOR_FSM
WAITING_FOR_REMOTE_KVS = RequestStatus.WAITING_FOR_REMOTE_KVS
FINISHED_ABORTED = RequestStatus.FINISHED_ABORTED


@dataclass(slots=True)
class StepState:
    """What one `schedule()` call has decided so far. `scheduled_running` and
    `scheduled_admitted` follow `num_scheduled_tokens`' order (batch order: the running
    requests scheduled, then the admitted ones)."""

    token_budget: int
    prefill_cap: int  # the step's cap on one request's tokens (0: none)
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    scheduled_running: list[Request] = field(default_factory=list)
    running_new_block_ids: list[list[int]] = field(default_factory=list)  # per scheduled_running
    scheduled_admitted: list[Request] = field(default_factory=list)
    scheduled_new: list[Request] = field(default_factory=list)
    scheduled_resumed: list[Request] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    spec_tokens: dict[str, list[int]] = field(default_factory=dict)


class Admission(NamedTuple):
    """How a waiting request is admitted: its prefix-cache hits and the tokens to compute."""

    hit_blocks: list[KVCacheBlock]
    num_hit_tokens: int
    num_new_tokens: int


def rank(request: Request) -> tuple[int, float]:
    """Priority order: lower is better."""
    return request.priority, request.arrival_time


@dataclass(frozen=True, slots=True)
class AdmissionPolicy:
    """The limits and switches admission goes by, from the scheduler's and cache's configs."""

    max_num_seqs: int
    chunked_prefill: bool
    priority_policy: bool
    prefix_aware: bool  # prefix-aware order (needs the prefix cache)
    window_size: int  # requests taken from the queue at a time (1: FCFS)
    block_size: int
    max_skips: int  # prefix-aware: steps a request that fits may be passed over
    max_loras: int  # distinct LoRA adapters per step (0: no limit)

    @classmethod
    def of(cls, config: SchedulerConfig, cache_config: CacheConfig) -> "AdmissionPolicy":
        prefix_aware = (
            config.enable_prefix_aware_scheduling and cache_config.enable_prefix_caching
        )
        return cls(
            max_num_seqs=config.max_num_seqs,
            chunked_prefill=config.enable_chunked_prefill,
            priority_policy=config.policy == "priority",
            prefix_aware=prefix_aware,
            window_size=config.prefix_aware_window if prefix_aware else 1,
            block_size=cache_config.block_size,
            max_skips=config.prefix_aware_max_skips,
            max_loras=config.max_loras,
        )


class WaitingAdmission:
    """Admits waiting requests into a step (`schedule_waiting`).

    `preempt(st, victim)` evicts a running request (undoing its scheduling in `st`) and puts
    it back in the waiting queue; `drop(request)` finishes a waiting request that can never
    run (its grammar failed to compile): its blocks freed, reported with the next outputs.
    """

    def __init__(
        self,
        policy: AdmissionPolicy,
        kv_cache_manager: KVCacheManager,
        waiting: RequestQueue,
        running: list[Request],
        disk_tier: DiskTierScheduling | None,
        preempt: Callable[[StepState, Request], None],
        drop: Callable[[Request], None],
    ) -> None:
        self.policy = policy
        self.kv_cache_manager = kv_cache_manager
        self.waiting = waiting
        self.running = running
        self.disk_tier = disk_tier
        self._preempt = preempt
        self._drop = drop

    def schedule_waiting(self, st: StepState) -> None:
        """Admit what fits of the waiting queue into the step `st` (see the module's
        invariants); those not admitted stay in the queue, in queue order."""
        kv = self.kv_cache_manager
        policy = self.policy
        aware = policy.prefix_aware
        window_size = policy.window_size
        prefill = PrefillIndex(self.running, kv.num_cached_block) if aware else None
        cached = kv.block_pool.cached_block_hash_to_block
        max_skips = policy.max_skips
        taken: list[Request] = []  # left the queue in this step, in queue order
        admitted: set[int] = set()  # their positions in `taken`
        deferred: dict[int, Request] = {}  # position -> the owner of the block it waits for
        stop = False
        # LoRA: the adapters of the step so far (running requests all run); a waiting
        # request of another adapter waits once there are max_loras (vLLM's rule). One that
        # waited so `max_skips` steps while requests behind it were admitted reserves the
        # step: no adapter request behind it is admitted but of its adapter, so the running
        # adapters drain and it gets their slot (else a tenant that keeps its adapter's
        # requests in flight holds the slot for ever).
        max_loras = policy.max_loras
        loras = (
            {r.lora_request.lora_int_id for r in self.running if r.lora_request is not None}
            if max_loras else None
        )
        reserved: int | None = None  # the adapter an aged waiting request holds the step for
        lora_waits: set[int] = set()  # positions in `taken` that waited for an adapter slot
        # At most a window's worth of deferrals per step: the step's cost stays bounded.
        while not stop and self.waiting and len(deferred) < window_size:
            window = self.waiting.pop_window(window_size)
            base = len(taken)
            taken += window
            order = (
                WindowOrder.ranked(window, cached, prefill, policy.block_size, max_skips)
                if prefill is not None else WindowOrder.fcfs(window)
            )
            while order.remaining:
                if st.token_budget <= 0:
                    stop = True
                    break
                i, first = order.pop()
                request = window[i]
                if request.status == WAITING_FOR_FSM and not self._grammar_ready(request):
                    continue  # set aside while its grammar compiles (or finished)
                if request.status == WAITING_FOR_REMOTE_KVS or (
                    self.disk_tier is not None and self.disk_tier.start_load(request)
                ):
                    continue  # set aside while its blocks are read from disk
                owner = order.awaited_owner(i)
                if owner is not None:
                    deferred[base + i] = owner
                    continue
                lora = request.lora_request
                if loras is not None and lora is not None and (
                    lora.lora_int_id not in loras and len(loras) >= max_loras
                    or reserved is not None and lora.lora_int_id != reserved
                ):
                    # The step has max_loras adapters already (or is reserved): it waits.
                    lora_waits.add(base + i)
                    if reserved is None and request.num_passed_over >= max_skips:
                        reserved = lora.lora_int_id
                    continue
                victims = self._admit(st, request)
                if victims is None:  # it does not fit now
                    if first:
                        stop = True
                        break
                    order.to_queue_order()
                    continue
                admitted.add(base + i)
                if loras is not None and lora is not None:
                    loras.add(lora.lora_int_id)
                if prefill is not None:
                    # Its blocks past this step's are others' awaited blocks now; those of
                    # the step are in the prefix cache already.
                    prefill.add(request, kv.num_cached_block[request.request_id])
                    order.refresh()
                    # A victim may rank before the rest of the window (priority ties):
                    # admit nobody else rather than pass it over.
                    if victims:
                        stop = True
                        break
        last_admitted = max(admitted, default=-1)
        scheduled = st.num_scheduled_tokens
        for pos in range(len(taken) - 1, -1, -1):
            request = taken[pos]
            if pos in admitted or request.is_finished():
                continue
            if aware and request.status not in (WAITING_FOR_FSM, WAITING_FOR_REMOTE_KVS):
                owner = deferred.get(pos)
                if (
                    owner.request_id not in scheduled if owner is not None
                    else pos < last_admitted
                ):
                    request.num_passed_over += 1
            elif pos in lora_waits and pos < last_admitted:
                request.num_passed_over += 1
            self.waiting.prepend_request(request)

    def _admit(self, st: StepState, request: Request) -> list[Request] | None:
        """Admit a waiting request if it fits, preempting victims (priority policy) if that
        makes it fit; returns the victims, or None (nothing changed) if it does not fit."""
        if request.num_output_placeholders or request in st.preempted:
            return None  # (async) its last step's output is not back yet; or just evicted
        kv = self.kv_cache_manager
        victims: list[Request] = []
        freed = FreedBlocks()
        candidates = self._victim_candidates(request, st.scheduled_admitted)
        while (plan := self.plan(
            request, st.token_budget, len(victims), freed, st.prefill_cap
        )) is None:
            victim = next(candidates, None)
            if victim is None:
                return None
            victims.append(victim)
            kv.add_to_freed(freed, victim)
        if not plan.num_new_tokens:
            return None
        for victim in victims:
            self._preempt(st, victim)
        hit_blocks, num_hit_tokens, num_new_tokens = plan
        new_blocks = kv.allocate_slots(request, num_new_tokens, hit_blocks, num_hit_tokens)
        assert new_blocks is not None, "an admission plan did not fit"
        kv.record_prefix_hit(request, num_hit_tokens)
        self._add_running(request)
        st.scheduled_admitted.append(request)
        if request.status == WAITING:
            st.scheduled_new.append(request)
        else:
            st.scheduled_resumed.append(request)
        request.status = RUNNING
        request.num_computed_tokens = num_hit_tokens
        request.num_passed_over = 0
        if request.scheduled_time is None:  # first admission
            request.num_cached_tokens = num_hit_tokens
            request.scheduled_time = time.monotonic()
        st.num_scheduled_tokens[request.request_id] = num_new_tokens
        st.token_budget -= num_new_tokens
        return victims

    def plan(
        self, request: Request, token_budget: int, num_victims: int, freed: FreedBlocks,
        prefill_cap: int,
    ) -> Admission | None:
        """What admitting a waiting request takes once the `freed` victims are preempted,
        at most `prefill_cap` tokens of it (0: no cap); None if it has no seat or not enough
        blocks then. `num_new_tokens` 0: it does not
        fit the token budget (chunked prefill off), which no preemption changes (victims'
        budget is not counted, so nobody is preempted for budget). Changes nothing."""
        policy = self.policy
        if len(self.running) - num_victims >= policy.max_num_seqs:
            return None
        kv = self.kv_cache_manager
        if request.sampling_params.prompt_logprobs is None:
            hit_blocks, num_hit_tokens = kv.get_computed_blocks(request)
        else:
            # As vLLM: cached positions' logits are never computed, and their logprobs are
            # asked for.
            hit_blocks, num_hit_tokens = [], 0
        if freed.unwritten:
            # Victims this step scheduled un-hash the blocks that step was to write: hits
            # end before the first of those.
            for i, block in enumerate(hit_blocks):
                if block in freed.unwritten:
                    hit_blocks = hit_blocks[:i]
                    num_hit_tokens = i * policy.block_size
                    break
        num_new_tokens = request.num_tokens - num_hit_tokens
        if 0 < prefill_cap < num_new_tokens:
            num_new_tokens = prefill_cap
        if num_new_tokens > token_budget:
            if not policy.chunked_prefill:
                # Do not skip a long prompt in favour of shorter ones.
                return Admission(hit_blocks, num_hit_tokens, 0)
            num_new_tokens = token_budget
        if not kv.can_allocate(request, num_new_tokens, hit_blocks, num_hit_tokens, freed):
            return None
        return Admission(hit_blocks, num_hit_tokens, num_new_tokens)

    def _victim_candidates(
        self, request: Request, admitted: list[Request]
    ) -> Iterator[Request]:
        """Priority policy: the running requests that rank below the waiting `request`,
        worst first, that may be preempted now: not one `admitted` in this step (the runner
        has not seen it: it cannot be reported preempted; prefix-aware admission may admit
        a later arrival of the same priority before an earlier one), nor one whose unwritten
        blocks another request already shares in this step (that request will read them)."""
        if not self.policy.priority_policy:
            return
        request_rank = rank(request)
        kv = self.kv_cache_manager
        for candidate in reversed(self.running):
            if rank(candidate) <= request_rank:
                return
            if candidate not in admitted and not kv.has_shared_unwritten_blocks(candidate):
                yield candidate

    def _add_running(self, request: Request) -> None:
        if self.policy.priority_policy:
            bisect.insort(self.running, request, key=rank)
        else:
            self.running.append(request)

    def _grammar_ready(self, request: Request) -> bool:
        """Whether a WAITING_FOR_FSM request's grammar is compiled (it becomes WAITING); a
        failed compilation finishes it, reported with the next outputs."""
        future = request.grammar_future
        assert future is not None
        if not future.done():
            return False
        exc = future.exception()
        if exc is not None:
            request.status = FINISHED_ABORTED
            request.stop_reason = f"structured output grammar failed to compile: {exc}"
            self._drop(request)
            return False
        request.grammar = future.result()
        request.grammar_future = None
        request.status = WAITING
        return True
