"""Scheduler step cost with many waiting requests that defer (prefix-aware admission), from
the review's r7: 255 decodes and an owner prefilling a 2,000-token prefix (long-prefill cap
64), 0 / 256 / 2,048 waiting requests on that prefix; p50 of 5 steps, FCFS vs aware.
Before the per-step cap on deferrals every waiting request was examined each step.
Usage: PYTHONPATH=. nice -n 19 python bench/bench_queue_step_cost.py
"""
import time

from v1.config import CacheConfig, SchedulerConfig
from v1.core.sched.scheduler import Scheduler
from v1.outputs import ModelRunnerOutput
from v1.request import EngineCoreRequest
from v1.sampling_params import SamplingParams

BS = 16


def step(s):
    out = s.schedule()
    ids = list(out.num_scheduled_tokens)
    sampled = []
    for r in ids:
        q = s.requests.get(r)
        sampled.append([7] if q is not None and q.num_computed_tokens >= q.num_tokens else [])
    s.update_from_output(out, ModelRunnerOutput(ids, sampled))
    return out


def run(aware: bool, num_waiting: int, prefix_len: int = 2000) -> float:
    s = Scheduler(
        SchedulerConfig(max_num_seqs=512, max_num_batched_tokens=8192, max_model_len=8192,
                        long_prefill_token_threshold=64, enable_prefix_aware_scheduling=aware),
        CacheConfig(block_size=BS), 20000)
    for i in range(255):  # 255 decodes
        s.add_request(EngineCoreRequest(f"d{i}", [50000 + 100 * i + j for j in range(20)],
                                        SamplingParams(max_tokens=10_000, ignore_eos=True)))
    step(s)
    step(s)
    prefix = list(range(1000, 1000 + prefix_len))
    s.add_request(EngineCoreRequest("owner", prefix + [1], SamplingParams(max_tokens=4)))
    step(s)
    for i in range(num_waiting):
        s.add_request(EngineCoreRequest(f"w{i}", prefix + [2, i], SamplingParams(max_tokens=4)))
    # max_num_seqs 512: seats for the burst; measure 5 steps while the owner prefills
    times = []
    for _ in range(5):
        t = time.perf_counter()
        step(s)
        times.append(time.perf_counter() - t)
    return sorted(times)[2] * 1e3


if __name__ == "__main__":
    for n in (0, 256, 2048):
        off, on = run(False, n), run(True, n)
        print(f"255 decodes + owner, {n:5d} waiting on its 2,000-token prefix: "
              f"step p50 FCFS {off:7.2f} ms, aware {on:7.2f} ms")
