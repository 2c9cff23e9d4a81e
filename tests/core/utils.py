"""Helpers for core tests: hand-made requests and model outputs, as vLLM's tests do."""

import itertools
import random
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass

from v1.config import CacheConfig, SchedulerConfig
from v1.core.kv_cache_utils import make_block_hasher
from v1.core.sched.output import SchedulerOutput
from v1.core.sched.scheduler import Scheduler
from v1.outputs import ModelRunnerOutput
from v1.request import Request
from v1.sampling_params import SamplingParams

EOS = 2
_ids = itertools.count()


def make_request(
    prompt: list[int] | int,
    block_size: int = 4,
    max_tokens: int = 16,
    priority: int = 0,
    arrival_time: float | None = None,
    cache_salt: str | None = None,
    request_id: str | None = None,
    **params,
) -> Request:
    n = next(_ids)
    if isinstance(prompt, int):  # distinct tokens per request: no accidental prefix hits
        prompt = [1000 * (n + 1) + i for i in range(prompt)]
    return Request(
        request_id or f"r{n}",
        prompt,
        SamplingParams(max_tokens=max_tokens, **params),
        eos_token_id=EOS,
        arrival_time=float(n) if arrival_time is None else arrival_time,
        priority=priority,
        cache_salt=cache_salt,
        block_hasher=make_block_hasher(block_size),
    )


def make_scheduler(
    num_blocks: int = 64,
    block_size: int = 4,
    max_num_seqs: int = 16,
    max_num_batched_tokens: int = 64,
    max_model_len: int = 64,
    policy: str = "fcfs",
    **kwargs,
) -> Scheduler:
    caching = kwargs.pop("enable_prefix_caching", True)
    preload_max_fraction = kwargs.pop("preload_max_fraction", 0.5)
    disk_index = kwargs.pop("disk_index", None)
    return Scheduler(
        SchedulerConfig(
            max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
            max_model_len=max_model_len, policy=policy, **kwargs,
        ),
        CacheConfig(block_size=block_size, enable_prefix_caching=caching,
                    preload_max_fraction=preload_max_fraction),
        num_blocks,
        disk_index=disk_index,
    )


def fake_model_output(
    scheduler: Scheduler, out: SchedulerOutput, token: int = 7
) -> ModelRunnerOutput:
    """Sample `token` for every request whose prompt (plus known output) is done."""
    req_ids = list(out.num_scheduled_tokens)
    sampled = []
    for req_id in req_ids:
        request = scheduler.requests.get(req_id)
        done = request is not None and request.num_computed_tokens >= request.num_tokens
        sampled.append([token] if done else [])
    return ModelRunnerOutput(req_ids, sampled)


def run_step(scheduler: Scheduler, token: int = 7):
    out = scheduler.schedule()
    return out, scheduler.update_from_output(out, fake_model_output(scheduler, out, token))


@dataclass(slots=True)
class _RunnerRequest:
    token_ids: list[int]
    block_ids: list[int]
    num_computed_tokens: int


class ShadowRunner:
    """A fake model runner that records what each KV slot holds.

    Like the real runner it learns each request's tokens and block table from the
    `SchedulerOutput` deltas alone, and appends the tokens it samples itself. Running a step,
    it first writes every computed position (as every layer writes K/V before attending), the
    slot then holding the token prefix that ends there; then it checks that every position each
    scheduled request attends to holds exactly that request's prefix. A prefix-cache hit or a
    resumed request on a block nobody wrote, or on one overwritten since, fails the check.

    It samples `EOS` for the batch row `eos_row`, else a token that depends on the prefix (as
    greedy decoding would), so that equal prefixes continue equally and share blocks.

    With `spec_k` > 0 it drafts too, as the real runner: up to `spec_k` tokens per request
    that sampled, each the right one (what it will sample there) or a wrong one at random
    (`seed`), verified in the request's next step: the drafts' slots are written like any
    computed position, the accepted prefix plus one token is returned, and only the accepted
    positions stay computed. Under async scheduling it fills the -1 placeholders with its
    last drafts (the scheduler's computed count may then run ahead of its own).

    With `disk` (a dict standing for the disk tier's directory: hash -> the block's slots) it
    does the disk tier's I/O as the real runner: `kv_loads` copy files into their blocks
    before the writes, `kv_stores` copy the step's blocks out after them (every slot must be
    written by then), `kv_deletes` remove files; a missing file ends a read.
    """

    def __init__(
        self,
        block_size: int,
        spec_k: int = 0,
        seed: int = 0,
        disk: dict[bytes, tuple[tuple[int, ...], ...]] | None = None,
    ) -> None:
        self.block_size = block_size
        self.disk = disk
        self.slots: dict[tuple[int, int], tuple[int, ...]] = {}
        self.requests: dict[str, _RunnerRequest] = {}
        self.sampled: dict[str, list[int]] = {}
        self.spec_k = spec_k
        self.rng = random.Random(seed)
        self.drafts: dict[str, list[int]] = {}  # the last proposal per request
        self.num_accepted = 0

    @staticmethod
    def _next_token(token_ids: list[int]) -> int:
        return 40 + sum(token_ids) % 7

    def _propose(self, req_id: str, token_ids: list[int]) -> list[int]:
        drafts: list[int] = []
        for _ in range(self.rng.randint(0, self.spec_k)):
            right = self._next_token(token_ids + drafts)
            drafts.append(right if self.rng.random() < 0.7 else 99)
        self.drafts[req_id] = drafts
        return drafts

    def _slot(self, req: _RunnerRequest, pos: int) -> tuple[int, int]:
        return req.block_ids[pos // self.block_size], pos % self.block_size

    def execute(self, out: SchedulerOutput, eos_row: int) -> ModelRunnerOutput:
        for req_id in out.preempted_req_ids:  # the real runner looks it up in its batch
            assert req_id in self.requests, f"{req_id} preempted, never sent to the runner"
        loaded = self._load(out) if out.kv_loads else None
        for req_id in out.finished_req_ids | out.preempted_req_ids:
            self.requests.pop(req_id, None)
        for new in out.scheduled_new_reqs:
            self.requests[new.req_id] = _RunnerRequest(
                list(new.prompt_token_ids), list(new.block_ids), new.num_computed_tokens
            )
        cached = out.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            if cached.resumed_from_preemption[i]:
                token_ids = cached.resumed_token_ids[i]
                assert token_ids is not None
                self.requests[req_id] = _RunnerRequest(
                    list(token_ids), list(cached.new_block_ids[i]), cached.num_computed_tokens[i]
                )
            else:
                req = self.requests[req_id]
                if self.spec_k:  # (async) the scheduler counts drafts in flight as accepted
                    assert req.num_computed_tokens <= cached.num_computed_tokens[i], req_id
                else:
                    assert req.num_computed_tokens == cached.num_computed_tokens[i], req_id
                req.block_ids.extend(cached.new_block_ids[i])
        scheduled = [(self.requests[r], n) for r, n in out.num_scheduled_tokens.items()]
        step_drafts: dict[str, list[int]] = {}
        for req_id, scheduled_drafts in out.scheduled_spec_decode_tokens.items():
            req = self.requests[req_id]
            assert self.spec_k, "drafts scheduled that nobody proposed"
            assert req.num_computed_tokens == len(req.token_ids) - 1, "drafted mid-prefill"
            drafts = scheduled_drafts
            if drafts[0] == -1:  # async placeholders
                last = self.drafts.get(req_id, [])[: len(drafts)]
                drafts = last + [-1] * (len(drafts) - len(last))
            step_drafts[req_id] = drafts
            req.token_ids.extend(max(d, 0) for d in drafts)
        for req, n in scheduled:
            end = req.num_computed_tokens + n
            assert end <= len(req.token_ids), "scheduled a token the runner does not know"
            assert len(req.block_ids) * self.block_size >= end, "blocks do not cover the step"
            for pos in range(req.num_computed_tokens, end):
                self.slots[self._slot(req, pos)] = tuple(req.token_ids[: pos + 1])
        sampled: list[list[int]] = []
        proposals: list[list[int]] = []
        for row, (req_id, (req, n)) in enumerate(zip(out.num_scheduled_tokens, scheduled)):
            end = req.num_computed_tokens + n
            for pos in range(end):
                held = self.slots.get(self._slot(req, pos))
                assert held == tuple(req.token_ids[: pos + 1]), (
                    f"{req_id} attends to position {pos} in block {self._slot(req, pos)}, "
                    f"which holds {held}, not its own prefix {req.token_ids[: pos + 1]}"
                )
            drafts = step_drafts.get(req_id, [])
            if drafts:
                del req.token_ids[-len(drafts):]
            req.num_computed_tokens = end - len(drafts)
            if req.num_computed_tokens < len(req.token_ids):
                sampled.append([])  # a prefill chunk short of the end
                proposals.append([])
                continue
            tokens: list[int] = []
            for draft in [*drafts, None]:  # verify: the accepted drafts, then one token
                token = EOS if row == eos_row else self._next_token(req.token_ids + tokens)
                tokens.append(token)
                if token != draft:
                    break
            self.num_accepted += len(tokens) - 1
            req.num_computed_tokens += len(tokens) - 1
            req.token_ids.extend(tokens)
            self.sampled.setdefault(req_id, []).extend(tokens)
            sampled.append(tokens)
            proposals.append(self._propose(req_id, req.token_ids) if self.spec_k else [])
        return ModelRunnerOutput(
            list(out.num_scheduled_tokens), sampled,
            spec_token_ids=proposals if self.spec_k else None,
            kv_loaded=loaded, kv_stored=self._store(out) if self.disk is not None else (),
        )

    def _load(self, out: SchedulerOutput) -> dict[str, int]:
        assert self.disk is not None, "a read handed out without a tier"
        loaded = {}
        for load in out.kv_loads:
            n = 0
            for block_id, block_hash in zip(load.block_ids, load.block_hashes):
                content = self.disk.get(block_hash)
                if content is None:
                    break
                for offset, held in enumerate(content):
                    self.slots[(block_id, offset)] = held
                n += 1
            loaded[load.req_id] = n
        return loaded

    def _store(self, out: SchedulerOutput) -> list[tuple[bytes, bool]]:
        assert self.disk is not None
        for block_hash in out.kv_deletes:
            self.disk.pop(block_hash, None)
        stored = []
        for block_id, block_hash in out.kv_stores:
            content = tuple(self.slots.get((block_id, o)) for o in range(self.block_size))
            assert None not in content, f"block {block_id} stored before it was written"
            self.disk[block_hash] = content  # type: ignore[assignment]
            stored.append((block_hash, True))
        return stored


class FakeGrammar:
    """Refuses the tokens `refuses` says (by default, all but token 7); terminates after
    `length` accepted ones."""

    def __init__(self, length: int = 100, refuses: Callable[[int], bool] = lambda t: t != 7):
        self.accepted: list[int] = []
        self.length = length
        self.refuses = refuses

    def accept_tokens(self, token_ids: list[int]) -> bool:
        if any(map(self.refuses, token_ids)):
            return False
        self.accepted.extend(token_ids)
        return True

    def is_terminated(self) -> bool:
        return len(self.accepted) >= self.length

    def fill_bitmask(self, bitmask: list[int], row: int) -> None:
        bitmask[row] = len(self.accepted)  # stands for "the mask after these tokens"


class FakeManager:
    """A structured-output manager whose compilations finish only when the test (through
    `futures`) says so."""

    def __init__(self) -> None:
        self.futures: dict[str, Future[FakeGrammar]] = {}
        self.aborted: list[str] = []

    def grammar_init(self, request: Request) -> None:
        request.grammar_future = self.futures[request.request_id] = Future()

    def grammar_abort(self, request: Request) -> None:
        self.aborted.append(request.request_id)

    def grammar_bitmask(self, requests: list[Request]) -> list[int]:
        bitmask = [0] * len(requests)
        for row, request in enumerate(requests):
            assert request.grammar is not None
            request.grammar.fill_bitmask(bitmask, row)
        return bitmask
