"""Helpers for core tests: hand-made requests and model outputs, as vLLM's tests do."""

import itertools

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
    return Scheduler(
        SchedulerConfig(
            max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
            max_model_len=max_model_len, policy=policy, **kwargs,
        ),
        CacheConfig(block_size=block_size, enable_prefix_caching=caching),
        num_blocks,
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
