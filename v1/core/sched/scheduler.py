"""The unified token-budget scheduler: no prefill and decode phases.

Each step gives every request some of `num_tokens - num_computed_tokens` (output placeholders
included under async scheduling), under `max_num_batched_tokens` tokens and `max_num_seqs`
requests: running requests first, then waiting ones, admitted by `WaitingAdmission`
(v1.core.sched.admission). How preemption, drafts and pooling fit: docs/design.md, "The scheduler".

Invariants, every step:
- sum(num_scheduled_tokens) <= max_num_batched_tokens; len(running) <= max_num_seqs;
- a request is in exactly one of `running`, `waiting`, or neither (finished and gone);
- a request's blocks cover its computed tokens plus those scheduled this step;
- no waiting request is admitted in a step that preempted for lack of blocks;
- under the priority policy `running` is sorted by (priority, arrival_time), so the victim is
  `running[-1]`; a running request is never preempted after this step scheduled it;
- a request is preempted for a waiting one only if that one is then admitted;
- with LoRA (`max_loras` > 0), the running requests use at most `max_loras` adapters.

Paused (`pause_state`, vLLM's pause): new requests queue; PAUSED_NEW schedules only the running
requests, PAUSED_ALL nothing, and `has_requests()` is then False, so the engine idles.

Set aside without blocking the queue: WAITING_FOR_FSM (grammar compiling; a structured request
whose token is in flight is not scheduled again) and WAITING_FOR_REMOTE_KVS (disk-tier reads).
"""

import enum
import time
from collections.abc import Iterable
from typing import Any, Protocol

from v1.config import CacheConfig, SchedulerConfig
from v1.core.kv_cache_manager import KVCacheManager
from v1.core.kv_cache_utils import make_block_hasher
from v1.core.kv_disk_index import DiskBlockIndex
from v1.core.sched.admission import AdmissionPolicy, StepState, WaitingAdmission
from v1.core.sched.disk_tier import DiskTierScheduling
from v1.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput
from v1.core.sched.request_queue import create_request_queue
from v1.core.sched.spec_decode import (
    SpecDecodingStats,
    append_until_stop,
    num_drafts_to_schedule,
)
from v1.outputs import EngineCoreOutput, EngineCoreOutputs, ModelRunnerOutput, SchedulerStats
from v1.request import EngineCoreRequest, Request, RequestStatus

RUNNING = RequestStatus.RUNNING
WAITING = RequestStatus.WAITING
WAITING_FOR_FSM = RequestStatus.WAITING_FOR_FSM
WAITING_FOR_REMOTE_KVS = RequestStatus.WAITING_FOR_REMOTE_KVS
PREEMPTED = RequestStatus.PREEMPTED
FINISHED_STOPPED = RequestStatus.FINISHED_STOPPED
FINISHED_LENGTH_CAPPED = RequestStatus.FINISHED_LENGTH_CAPPED
FINISHED_ABORTED = RequestStatus.FINISHED_ABORTED

# Most decode steps add no block: they share this list, which nothing may mutate (the
# runner copies block ids), rather than allocate one per request per step.
_NO_BLOCK_IDS: list[int] = []


class StructuredOutputManagerProtocol(Protocol):
    """What the scheduler needs of the engine's `StructuredOutputManager`."""

    def grammar_init(self, request: Request) -> None:
        """Start compiling; set `request.grammar_future`."""
        ...

    def grammar_abort(self, request: Request) -> None:
        """The request leaves before its grammar is compiled."""
        ...

    def grammar_bitmask(self, requests: list[Request]) -> Any:
        """The token bitmask of these requests' next tokens, one row each."""
        ...


class PauseState(enum.Enum):
    """vLLM's: what a paused scheduler still schedules (new requests queue in every state)."""

    UNPAUSED = 0
    PAUSED_NEW = 1  # the running requests only: nobody is admitted from the queue
    PAUSED_ALL = 2  # nothing


def _queue_time(request: Request) -> float | None:
    if request.scheduled_time is None:
        return None
    return request.scheduled_time - request.queued_time


class Scheduler:
    def __init__(
        self,
        scheduler_config: SchedulerConfig,
        cache_config: CacheConfig,
        num_blocks: int,
        structured_output_manager: StructuredOutputManagerProtocol | None = None,
        disk_index: DiskBlockIndex | None = None,
    ) -> None:
        if disk_index is not None and not cache_config.enable_prefix_caching:
            raise ValueError("a disk tier (kv_cache_dir) needs enable_prefix_caching")
        self.max_num_seqs = scheduler_config.max_num_seqs
        self.max_num_batched_tokens = scheduler_config.max_num_batched_tokens
        self.max_model_len = scheduler_config.max_model_len
        self.long_prefill_token_threshold = scheduler_config.long_prefill_token_threshold
        self.cap_lone_prefill = scheduler_config.cap_lone_prefill
        self.async_scheduling = scheduler_config.async_scheduling
        self.block_size = cache_config.block_size
        self.kv_cache_manager = KVCacheManager(
            num_blocks, cache_config.block_size, cache_config.enable_prefix_caching,
            cache_config.preload_max_fraction, self.max_model_len,
            record_new_cached=disk_index is not None,
        )
        self.disk_tier = (
            DiskTierScheduling(disk_index, self.kv_cache_manager)
            if disk_index is not None else None
        )
        # LoRA: how many unfinished requests name each adapter id (those adapters stay
        # loaded and cannot be removed), and each removed id's generation, which goes into
        # its blocks' hashes: an id reused for another adapter never hits the blocks the
        # removed one cached (they are evicted as any unreachable block).
        self.lora_users: dict[int, int] = {}
        self.lora_generations: dict[int, int] = {}
        self.block_hasher = (
            make_block_hasher(cache_config.block_size, self.lora_generations)
            if cache_config.enable_prefix_caching else None
        )
        self.structured_output_manager = structured_output_manager
        self.requests: dict[str, Request] = {}
        # How many of `requests` are structured: no per-step scan for them when none is.
        self.num_structured_requests = 0
        self.waiting = create_request_queue(scheduler_config.policy)
        # Changed in place only: the admission holds it too.
        self.running: list[Request] = []
        # Left the batch since the last schedule(): the runner must forget them.
        self.finished_req_ids: set[str] = set()
        # Preempted outside schedule() (reset_prefix_cache), not finished since: the next
        # SchedulerOutput reports them preempted.
        self._preempted_between_steps: set[str] = set()
        # Finished by the scheduler, not by a step (FINISHED_IGNORED: it could never run;
        # or aborted by `abort_all`): reported with the next step's outputs.
        self._ignored: list[Request] = []
        self.pause_state = PauseState.UNPAUSED
        self.num_preemptions = 0
        self.num_prompt_tokens = 0
        self.num_generation_tokens = 0
        self.spec_stats = SpecDecodingStats()
        self.admission = WaitingAdmission(
            AdmissionPolicy.of(scheduler_config, cache_config), self.kv_cache_manager,
            self.waiting, self.running, self.disk_tier, self._preempt, self._drop_waiting,
        )

    # -- requests in and out -------------------------------------------------------------

    def add_request(self, request: Request | EngineCoreRequest) -> None:
        if isinstance(request, EngineCoreRequest):
            request = Request.from_engine_core_request(request, self.block_hasher)
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in the scheduler")
        if request.num_prompt_tokens == 0:
            # Nothing to compute: queued, it would stay at the head of the queue forever.
            raise ValueError(f"request {request.request_id!r} has no prompt tokens")
        # Blocks it needs besides the pinned ones its prompt starts with, which it only hits.
        kv = self.kv_cache_manager
        num_blocks_needed = (
            -(-request.num_tokens // self.block_size) - kv.num_pinned_prefix_blocks(request)
        )
        num_unpinned = kv.num_blocks - len(kv.block_pool.pinned)
        if request.num_tokens > self.max_model_len or num_blocks_needed > num_unpinned:
            # It can never run: finish it now rather than let it wedge the queue.
            request.status = RequestStatus.FINISHED_IGNORED
            request.stop_reason = (
                f"prompt of {request.num_tokens} tokens exceeds max_model_len "
                f"{self.max_model_len}" if request.num_tokens > self.max_model_len else
                f"prompt of {request.num_tokens} tokens needs {num_blocks_needed} blocks of "
                f"{self.block_size} besides its pinned prefix, which exceeds the KV cache's "
                f"{num_unpinned} unpinned blocks (of {kv.num_blocks})"
            )
            self._ignored.append(request)
            return
        if request.sampling_params.structured_outputs is not None:
            if self.structured_output_manager is None:
                raise ValueError("structured outputs need a model with a tokenizer")
            request.status = WAITING_FOR_FSM
            self.structured_output_manager.grammar_init(request)
            self.num_structured_requests += 1
        request.queued_time = time.monotonic()
        self.requests[request.request_id] = request
        if request.lora_request is not None:
            lora_id = request.lora_request.lora_int_id
            self.lora_users[lora_id] = self.lora_users.get(lora_id, 0) + 1
        self.waiting.add_request(request)
        self.num_prompt_tokens += request.num_prompt_tokens

    def finish_requests(
        self,
        request_ids: str | Iterable[str],
        status: RequestStatus = RequestStatus.FINISHED_ABORTED,
    ) -> None:
        """Finish requests from outside (abort, stop string); unknown ids are ignored."""
        if isinstance(request_ids, str):
            request_ids = (request_ids,)
        doomed_running: set[str] = set()
        doomed_waiting = []
        for req_id in request_ids:
            request = self.requests.get(req_id)
            if request is None or request.is_finished():
                continue
            if request.status == RUNNING:
                doomed_running.add(req_id)
            else:
                doomed_waiting.append(request)
            loading = request.status == WAITING_FOR_REMOTE_KVS
            request.status = status
            if loading:  # its blocks are freed when the runner reports the read
                assert self.disk_tier is not None
                self.disk_tier.aborted_loads[req_id] = request
                self._forget_request(request)
            else:
                self._free_request(request)
        if doomed_running:
            self.running[:] = [r for r in self.running if r.request_id not in doomed_running]
        if doomed_waiting:
            self.waiting.remove_requests(doomed_waiting)

    def _free_request(self, request: Request) -> None:
        self.kv_cache_manager.free(request)
        self._forget_request(request)

    def _drop_waiting(self, request: Request) -> None:
        """Finish a waiting request that can never run: reported with the next outputs."""
        self._free_request(request)
        self._ignored.append(request)

    def _forget_request(self, request: Request) -> None:
        self.finished_req_ids.add(request.request_id)
        self._preempted_between_steps.discard(request.request_id)
        del self.requests[request.request_id]
        if request.lora_request is not None:
            lora_id = request.lora_request.lora_int_id
            if self.lora_users[lora_id] == 1:
                del self.lora_users[lora_id]
            else:
                self.lora_users[lora_id] -= 1
        if request.sampling_params.structured_outputs is not None:
            self.num_structured_requests -= 1
            if request.grammar_future is not None and self.structured_output_manager:
                self.structured_output_manager.grammar_abort(request)

    def forget_lora(self, lora_int_id: int) -> None:
        """The adapter `lora_int_id` was removed (no request names it): its cached blocks
        are never hit again, whatever adapter the id names next."""
        assert lora_int_id not in self.lora_users, "an adapter in use was removed"
        self.lora_generations[lora_int_id] = self.lora_generations.get(lora_int_id, 0) + 1

    def has_requests(self) -> bool:
        """Whether a step has work: requests it may schedule (paused, not the queued ones;
        PAUSED_ALL, not the running ones either), or finished ones to report or free."""
        if self.pause_state is PauseState.UNPAUSED:
            schedulable = bool(self.requests)
        else:
            schedulable = self.pause_state is PauseState.PAUSED_NEW and bool(self.running)
        return schedulable or bool(self._ignored) or (
            self.disk_tier is not None and bool(self.disk_tier.aborted_loads)
        )

    def abort_all(self) -> None:
        """Abort every request, each reported ("abort") with the next step's outputs: their
        frontends did not ask for it (vLLM's pause in "abort" mode)."""
        doomed = list(self.requests.values())
        self.finish_requests([r.request_id for r in doomed])
        self._ignored += doomed

    def get_num_unfinished_requests(self) -> int:
        return len(self.requests)

    # -- scheduling ---------------------------------------------------------------------

    def prefill_token_cap(self) -> int:
        """The most tokens one request may get in the next step (0: no cap): the
        `long_prefill_token_threshold`, unless the request is alone in the scheduler and
        not `cap_lone_prefill`. The cap is there to share steps; a request alone would only
        get its first token later (vLLM's rule), but for one arriving while its step runs
        (on CPU, where that step takes seconds)."""
        alone = len(self.requests) <= 1 and not self.cap_lone_prefill
        return 0 if alone else self.long_prefill_token_threshold

    def schedule(self) -> SchedulerOutput:
        kv = self.kv_cache_manager
        threshold = self.prefill_token_cap()
        max_model_len = self.max_model_len
        st = StepState(self.max_num_batched_tokens, threshold)
        token_budget = st.token_budget
        num_scheduled_tokens = st.num_scheduled_tokens
        scheduled_running = st.scheduled_running
        running_new_block_ids = st.running_new_block_ids
        spec_tokens = st.spec_tokens

        # 1. Running requests, in order (by priority under the priority policy). This runs
        # for every running request every step: plain arithmetic, and no `allocate_slots`
        # call while the request stays within its `num_quiet_tokens` (most decodes).
        async_scheduling = self.async_scheduling
        paused = self.pause_state is not PauseState.UNPAUSED
        running = self.running if self.pause_state is not PauseState.PAUSED_ALL else []
        num_quiet_tokens = kv.num_quiet_tokens
        # Preemption here removes only requests after this one (from the end), which list
        # iteration tolerates: the loop ends sooner.
        for request in running:
            if token_budget <= 0:
                break
            num_computed = request.num_computed_tokens
            num_new_tokens = (
                len(request.all_token_ids) + request.num_output_placeholders - num_computed
            )
            num_drafts = 0
            if request.spec_token_ids and num_new_tokens == 1:
                # A decode with drafts: they are verified in the same step.
                num_drafts = num_drafts_to_schedule(
                    request, token_budget, max_model_len, async_scheduling
                )
                num_new_tokens += num_drafts
            # A synchronous decode's one token is within every limit below (the budget is
            # positive, and a running request's tokens never exceed max_model_len).
            if num_new_tokens != 1 or async_scheduling:
                if 0 < threshold < num_new_tokens:
                    num_new_tokens = threshold
                if num_new_tokens > token_budget:
                    num_new_tokens = token_budget
                if num_new_tokens > max_model_len - num_computed:
                    num_new_tokens = max_model_len - num_computed
                if async_scheduling and request.num_output_placeholders and (
                    len(request.output_token_ids) + request.num_output_placeholders
                    >= request.max_tokens
                ):
                    num_new_tokens = 0  # its last token is in flight already
                if num_new_tokens <= 0 or (
                    request.grammar is not None and request.num_output_placeholders
                ):
                    continue  # nothing to do; or (async) its mask awaits its token
                if num_drafts >= num_new_tokens:  # a cap cut into the drafts
                    num_drafts = num_new_tokens - 1
            req_id = request.request_id
            if num_computed + num_new_tokens <= num_quiet_tokens.get(req_id, -1):
                new_block_ids = _NO_BLOCK_IDS  # no block to add, none full to index
            else:
                new_blocks = kv.allocate_slots(request, num_new_tokens)
                while new_blocks is None:
                    # The last running request: not scheduled yet in this step (or `request`).
                    victim = running[-1]
                    self._preempt(st, victim)  # (no budget to return: not scheduled)
                    if victim is request:
                        break
                    new_blocks = kv.allocate_slots(request, num_new_tokens)
                if new_blocks is None:
                    break  # it preempted itself: nothing is left to evict for it
                new_block_ids = [b.block_id for b in new_blocks]
            scheduled_running.append(request)
            running_new_block_ids.append(new_block_ids)
            if num_drafts:
                spec_tokens[req_id] = (
                    [-1] * num_drafts if async_scheduling
                    else request.spec_token_ids[:num_drafts]
                )
            num_scheduled_tokens[req_id] = num_new_tokens
            token_budget -= num_new_tokens

        # 2. Waiting requests, unless this step had to preempt (v1.core.sched.admission).
        st.token_budget = token_budget
        if not st.preempted and self.waiting and token_budget > 0 and not paused:
            self.admission.schedule_waiting(st)
        token_budget = st.token_budget
        scheduled_admitted = st.scheduled_admitted

        # 3. The step's description for the runner.
        new_reqs_data = [
            NewRequestData(
                r.request_id, r.all_token_ids[:] if r.output_token_ids else r.prompt_token_ids,
                r.sampling_params, kv.get_block_ids(r.request_id), r.num_computed_tokens,
                r.lora_request, r.pooling_params, r.cache_salt,
            )
            for r in st.scheduled_new
        ]
        cached = self._make_cached_request_data(
            scheduled_running, running_new_block_ids, st.scheduled_resumed
        )
        preempted_ids = {r.request_id for r in st.preempted}
        if self._preempted_between_steps:
            preempted_ids |= self._preempted_between_steps
            self._preempted_between_steps = set()
        output = SchedulerOutput(
            new_reqs_data, cached, num_scheduled_tokens,
            self.max_num_batched_tokens - token_budget, self.finished_req_ids, preempted_ids,
            spec_tokens,
        )
        if self.disk_tier is not None:
            self.disk_tier.add_work(output)
        self.finished_req_ids = set()
        requests = self.requests
        if self.num_structured_requests and self.structured_output_manager is not None:
            # Those that sample this step (the chunk reaches the end of their known tokens).
            structured = [
                r for req_id, num in num_scheduled_tokens.items()
                if (r := requests[req_id]).grammar is not None
                and r.num_computed_tokens + num >= r.num_tokens
            ]
            if structured:
                output.structured_output_request_ids = [r.request_id for r in structured]
                output.grammar_bitmask = self.structured_output_manager.grammar_bitmask(
                    structured
                )

        # Advance the computed counts now, so the next schedule() can run before this
        # step's output is back (async scheduling). A step that completes a request's known
        # tokens samples one: under async its id is a placeholder until the output arrives,
        # as are its drafts (1 + k placeholders: the step computes them as if accepted).
        for request, num in zip(
            scheduled_running + scheduled_admitted, num_scheduled_tokens.values(), strict=True
        ):
            request.num_computed_tokens += num
            if async_scheduling and request.num_computed_tokens >= (
                request.num_tokens + request.num_output_placeholders
            ):
                request.num_output_placeholders = (
                    request.num_computed_tokens - request.num_tokens + 1
                )
        return output

    def _preempt(self, st: StepState, victim: Request) -> None:
        """Evict a running request; undo its scheduling if it had been scheduled."""
        self.running.remove(victim)
        num = st.num_scheduled_tokens.pop(victim.request_id, 0)
        if num:
            st.token_budget += num
            if victim in st.scheduled_running:
                i = st.scheduled_running.index(victim)
                del st.scheduled_running[i], st.running_new_block_ids[i]
            for group in (st.scheduled_admitted, st.scheduled_new, st.scheduled_resumed):
                if victim in group:
                    group.remove(victim)
        st.spec_tokens.pop(victim.request_id, None)
        self._requeue(victim)
        st.preempted.append(victim)

    def _requeue(self, victim: Request) -> None:
        """A request out of `running`: its blocks freed, at the front of the queue to
        recompute from zero."""
        self.kv_cache_manager.free(victim)
        victim.spec_token_ids = []  # it resumes with a prefill, which is not drafted
        victim.status = PREEMPTED
        victim.num_computed_tokens = 0
        victim.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.prepend_request(victim)

    def _make_cached_request_data(
        self,
        running: list[Request],
        running_new_block_ids: list[list[int]],
        resumed: list[Request],
    ) -> CachedRequestData:
        # A resumed request's blocks are all new to the runner.
        reqs = running + resumed
        num_running = len(running)
        return CachedRequestData(
            req_ids=[r.request_id for r in reqs],
            resumed_from_preemption=[False] * num_running + [True] * len(resumed),
            resumed_token_ids=[None] * num_running + [r.all_token_ids[:] for r in resumed],
            new_block_ids=running_new_block_ids
            + [self.kv_cache_manager.get_block_ids(r.request_id) for r in resumed],
            num_computed_tokens=[r.num_computed_tokens for r in reqs],
        )

    # -- results ------------------------------------------------------------------------

    def update_from_output(
        self, scheduler_output: SchedulerOutput, model_output: ModelRunnerOutput
    ) -> dict[int, EngineCoreOutputs]:
        """Append sampled tokens, apply stop conditions, free finished requests, and
        return the new tokens per client."""
        outputs: dict[int, list[EngineCoreOutput]] = {}
        if model_output.kv_loaded or model_output.kv_stored:
            assert self.disk_tier is not None
            self.disk_tier.update(model_output, self.requests)
        requests = self.requests
        for req_id in model_output.nonfinite_req_ids:
            if (request := requests.get(req_id)) is not None:
                self.kv_cache_manager.uncache_computed(request)
        max_model_len = self.max_model_len
        async_scheduling = self.async_scheduling
        req_ids = model_output.req_ids
        logprobs_rows = model_output.logprobs or [None] * len(req_ids)
        spec_tokens = scheduler_output.scheduled_spec_decode_tokens
        spec_rows = model_output.spec_token_ids
        prompt_logprobs_dict = model_output.prompt_logprobs_dict
        check_stop = self._check_stop
        stopped = False
        if model_output.pooler_output is not None:
            stopped = self._finish_pooled(model_output, outputs)
        num_generated = 0
        # The outputs of the last request's client: consecutive requests mostly share one.
        client_index, client_outputs = -1, []
        # Once per scheduled request per step: kept to plain attribute work.
        for i, (req_id, new_token_ids, logprobs) in enumerate(zip(
            req_ids, model_output.sampled_token_ids, logprobs_rows, strict=True
        )):
            if not new_token_ids:
                continue  # a prefill chunk that did not reach the end of the prompt
            request = requests.get(req_id)
            if request is None:
                continue  # finished or aborted while this step ran (async)
            status = request.status
            num_rejected = 0
            if spec_tokens and (drafts := spec_tokens.get(req_id)):
                num_rejected = len(drafts) + 1 - len(new_token_ids)
                proposed = len(drafts) - model_output.num_unfilled_drafts.get(req_id, 0)
                if proposed:
                    self.spec_stats.observe(proposed, len(drafts) - num_rejected)
                if status != PREEMPTED:  # (a preempted one computes everything anew)
                    request.num_computed_tokens -= num_rejected
            if async_scheduling:
                request.num_output_placeholders -= len(new_token_ids) + num_rejected
            # The first output with tokens (all of them this step's) carries the queue time.
            first_output = not request.output_token_ids
            if len(new_token_ids) == 1:
                request.append_output_token_ids(new_token_ids)
                stop = check_stop(request, max_model_len)
            else:  # verified drafts: tokens after one that stops the request are dropped
                new_token_ids, stop = append_until_stop(
                    request, new_token_ids, check_stop, max_model_len
                )
                if logprobs is not None:
                    logprobs = logprobs[: len(new_token_ids)]
            finish_reason = None
            grammar_done = not stop and request.grammar is not None and self._advance_grammar(
                request, new_token_ids
            )
            if grammar_done and request.status == FINISHED_ABORTED:
                # Refused: the mask allowed no token (a grammar no text matches), so this one
                # is noise; the client gets the reason, not its text.
                new_token_ids, logprobs = [], None
            num_generated += len(new_token_ids)
            if stop or grammar_done:
                stopped = True
                if status == PREEMPTED:  # (async) preempted while it ran: it is waiting
                    self.waiting.remove_request(request)
                elif req_id not in model_output.nonfinite_req_ids:
                    # Blocks its accepted drafts (or, async, its placeholders) completed are
                    # cached as any other; not those of a step still in flight.
                    self.kv_cache_manager.cache_blocks(request, min(
                        request.num_computed_tokens - request.num_output_placeholders,
                        request.num_tokens,
                    ))
                self._free_request(request)
                finish_reason = request.get_finished_reason()
            elif spec_rows is not None and status == RUNNING:
                request.spec_token_ids = spec_rows[i]
            out = EngineCoreOutput(
                req_id, new_token_ids, logprobs, finish_reason, request.stop_reason,
                request.num_cached_tokens, _queue_time(request) if first_output else None,
                prompt_logprobs_dict.get(req_id) if prompt_logprobs_dict else None,
            )
            if request.client_index != client_index:
                client_index = request.client_index
                client_outputs = outputs.setdefault(client_index, [])
            client_outputs.append(out)
        if stopped:
            self.running[:] = [r for r in self.running if r.status == RUNNING]
        for request in self._ignored:
            outputs.setdefault(request.client_index, []).append(
                EngineCoreOutput(
                    request.request_id, [], None, request.get_finished_reason(),
                    request.stop_reason,
                )
            )
        self._ignored.clear()
        self.num_generation_tokens += num_generated
        now = time.monotonic()
        return {
            client: EngineCoreOutputs(outs, timestamp=now, client_index=client)
            for client, outs in outputs.items()
        }

    def _finish_pooled(
        self, model_output: ModelRunnerOutput, outputs: dict[int, list[EngineCoreOutput]]
    ) -> bool:
        """A pooling engine's step: each request whose prompt is computed finishes with its
        pooled vector (its blocks freed now: nothing reads its KV again). True if any did."""
        assert model_output.pooler_output is not None
        finished = False
        for req_id, pooled in zip(model_output.req_ids, model_output.pooler_output, strict=True):
            request = self.requests.get(req_id)
            if pooled is None or request is None:
                continue  # a prompt chunk short of the end; or aborted meanwhile
            request.status = FINISHED_STOPPED
            self._free_request(request)
            finished = True
            outputs.setdefault(request.client_index, []).append(EngineCoreOutput(
                req_id, [], None, "stop", None, request.num_cached_tokens,
                _queue_time(request), pooling_output=pooled,
            ))
        return finished

    @staticmethod
    def _check_stop(request: Request, max_model_len: int) -> bool:
        """vLLM's order: nothing stops before `min_tokens` (but the length limits), then
        EOS, then stop token ids, then the length limits."""
        num_output = len(request.output_token_ids)
        params = request.sampling_params
        if num_output >= params.min_tokens:
            last = request.output_token_ids[-1]
            if last == request.eos_token_id and not params.ignore_eos:
                request.status = FINISHED_STOPPED
                return True
            if last in params.all_stop_token_ids:
                request.status = FINISHED_STOPPED
                request.stop_reason = last
                return True
        if len(request.all_token_ids) >= max_model_len or num_output >= request.max_tokens:
            request.status = FINISHED_LENGTH_CAPPED
            return True
        return False

    @staticmethod
    def _advance_grammar(request: Request, token_ids: list[int]) -> bool:
        """Feed the matcher the accepted tokens; finish the request when its grammar is
        complete, or (aborted) when it rejects a token: the mask allows only tokens it
        accepts, unless it allows none at all."""
        assert request.grammar is not None
        if not request.grammar.accept_tokens(token_ids):
            request.status = FINISHED_ABORTED
            request.stop_reason = f"structured output grammar rejected tokens {token_ids}"
            return True
        if request.grammar.is_terminated():
            request.status = FINISHED_STOPPED
            return True
        return False

    # -- utilities ----------------------------------------------------------------------

    def reset_prefix_cache(
        self, reset_running_requests: bool = False, reset_connector: bool = False
    ) -> bool:
        """Forget the RAM prefix cache but the pinned (declared) prefixes, as vLLM's.

        While requests hold blocks it is refused (False), unless `reset_running_requests`:
        then every running request is preempted first (it recomputes once admitted again),
        and blocks still held (disk-tier reads in flight) raise RuntimeError.
        `reset_connector` (vLLM's name for its external cache): the disk tier's index too,
        once the RAM cache is reset (the caller removes the files); False without a tier.
        """
        if reset_running_requests:
            # Last first, each to the front of the queue: they resume in their running order.
            for request in reversed(self.running):
                self._requeue(request)
                self._preempted_between_steps.add(request.request_id)
            self.running.clear()
        if not self.kv_cache_manager.reset_prefix_cache():
            if reset_running_requests:
                raise RuntimeError(
                    "the prefix cache cannot be reset while disk-tier reads are in flight"
                )
            return False
        if reset_connector:
            if self.disk_tier is None:
                return False
            self.disk_tier.index.clear()
        return True

    def make_stats(self) -> SchedulerStats:
        metrics = self.kv_cache_manager.prefix_cache_metrics
        total = metrics.total()
        stats = SchedulerStats(
            num_running_reqs=len(self.running),
            num_waiting_reqs=len(self.waiting),
            kv_cache_usage=self.kv_cache_manager.usage,
            prefix_cache_queries=total.queries,
            prefix_cache_hits=total.hits,
            prefix_cache_hit_rate=total.hit_rate,
            recent_prefix_cache_hit_rate=metrics.recent_hit_rate(),
            num_preemptions=self.num_preemptions,
            num_prompt_tokens=self.num_prompt_tokens,
            num_generation_tokens=self.num_generation_tokens,
            spec_decode_num_drafts=self.spec_stats.num_drafts,
            spec_decode_num_draft_tokens=self.spec_stats.num_draft_tokens,
            spec_decode_num_accepted_tokens=self.spec_stats.num_accepted_tokens,
            spec_decode_num_accepted_tokens_per_pos=list(self.spec_stats.accepted_per_pos),
        )
        if self.disk_tier is not None:
            self.disk_tier.add_stats(stats)
        return stats

    def check_integrity(self) -> None:
        """Assert the scheduler's and the cache's invariants; when idle, that nothing leaks."""
        self.kv_cache_manager.check_integrity()
        running_ids = {r.request_id for r in self.running}
        waiting_ids = {r.request_id for r in self.waiting}
        assert len(running_ids) == len(self.running), "a request is running twice"
        assert not running_ids & waiting_ids, "a request is both running and waiting"
        assert self._preempted_between_steps <= waiting_ids, "a preempted request is not queued"
        assert running_ids | waiting_ids == self.requests.keys(), "request state leaked"
        assert self.num_structured_requests == sum(
            r.sampling_params.structured_outputs is not None for r in self.requests.values()
        )
        assert len(self.running) <= self.max_num_seqs
        assert all(r.status == RUNNING for r in self.running)
        assert all(
            r.status in (WAITING, WAITING_FOR_FSM, WAITING_FOR_REMOTE_KVS, PREEMPTED)
            for r in self.waiting
        )
        aborted_loads = self.disk_tier.aborted_loads if self.disk_tier is not None else {}
        for req_id in self.kv_cache_manager.req_to_blocks:
            assert (
                req_id in running_ids or req_id in waiting_ids or req_id in aborted_loads
            ), f"{req_id} holds blocks"
        if self.disk_tier is not None:
            self.disk_tier.index.check_integrity()
        assert not _NO_BLOCK_IDS, f"the shared empty block-id list was mutated: {_NO_BLOCK_IDS}"
        if self.block_hasher is not None:
            # Appends skip the hasher until a block may be full: none may be left unhashed.
            block_size = self.block_hasher.block_size
            for r in self.requests.values():
                assert len(r.block_hashes) == r.num_tokens // block_size, f"{r}: unhashed block"
