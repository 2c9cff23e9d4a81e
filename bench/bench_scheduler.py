"""CPU cost of one engine step without a model: schedule() + update_from_output().

Scenarios (block size 16, fake sampled tokens, prefix caching on):
- decode: 256 running requests of ~1,000 context tokens (lengths spread over a block);
- decode-aligned: the same, all lengths equal, so every request fills a block (and hashes
  it) in the same step: the worst case for hashing spikes;
- mixed: a stream of new requests sharing a 512-token system prompt (prefix hits) arriving
  while ~128 decode, under chunked prefill.

Prints a table, then one JSON line: {"running": 256, "step_ms_p50": ..., "step_ms_p99": ...}.
"""

import argparse
import gc
import json
import random
import time

from v1.config import CacheConfig, SchedulerConfig
from v1.core.sched.scheduler import Scheduler
from v1.outputs import ModelRunnerOutput
from v1.request import EngineCoreRequest
from v1.sampling_params import SamplingParams


def make_scheduler(num_blocks: int, max_num_seqs: int = 256) -> Scheduler:
    return Scheduler(
        SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=8192,
                        max_model_len=4096),
        CacheConfig(block_size=16),
        num_blocks,
    )


def fake_output(s: Scheduler, out) -> ModelRunnerOutput:
    req_ids = list(out.num_scheduled_tokens)
    requests = s.requests
    sampled = [
        [1000] if requests[r].num_computed_tokens >= requests[r].num_tokens else []
        for r in req_ids
    ]
    return ModelRunnerOutput(req_ids, sampled)


def add(s: Scheduler, rng: random.Random, i: int, prompt: list[int], max_tokens: int) -> None:
    s.add_request(EngineCoreRequest(
        f"req-{i}", prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True),
        eos_token_id=0, arrival_time=float(i),
    ))


def timed_steps(s: Scheduler, steps: int, before_step=None) -> list[float]:
    times = []
    gc.collect()
    for step in range(steps):
        if before_step:
            before_step(step)
        t0 = time.perf_counter()
        out = s.schedule()
        t1 = time.perf_counter()
        model_output = fake_output(s, out)  # the model's work: not timed
        t2 = time.perf_counter()
        s.update_from_output(out, model_output)
        times.append((time.perf_counter() - t2 + t1 - t0) * 1e3)
    return times


def decode_scenario(aligned: bool, steps: int, seed: int) -> tuple[list[float], int]:
    rng = random.Random(seed)
    s = make_scheduler(num_blocks=256 * 100)
    for i in range(256):
        length = 1000 if aligned else rng.randint(992, 1008)
        add(s, rng, i, [rng.randrange(49152) for _ in range(length)], max_tokens=10_000)
    while s.waiting or any(r.num_computed_tokens < r.num_prompt_tokens for r in s.running):
        out = s.schedule()  # prefill, untimed
        s.update_from_output(out, fake_output(s, out))
    times = timed_steps(s, steps)
    return times, len(s.running)


def mixed_scenario(steps: int, seed: int) -> tuple[list[float], int]:
    rng = random.Random(seed)
    s = make_scheduler(num_blocks=256 * 100)
    system = [rng.randrange(49152) for _ in range(512)]
    counter = iter(range(10**9))
    for _ in range(128):
        add(s, rng, next(counter), system + [rng.randrange(49152) for _ in range(40)], 400)
    for _ in range(20):
        out = s.schedule()
        s.update_from_output(out, fake_output(s, out))

    def arrivals(step: int) -> None:
        for _ in range(2):
            question = [rng.randrange(49152) for _ in range(rng.randint(10, 60))]
            add(s, rng, next(counter), system + question, rng.randint(32, 64))

    times = timed_steps(s, steps, arrivals)
    return times, len(s.running)


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=300, help="timed steps per scenario")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    results = {
        "decode": decode_scenario(False, args.steps, args.seed),
        "decode-aligned": decode_scenario(True, args.steps, args.seed),
        "mixed": mixed_scenario(args.steps, args.seed),
    }
    print(f"{'scenario':<16}{'running':>8}{'p50 ms':>9}{'p90 ms':>9}{'p99 ms':>9}{'max ms':>9}")
    for name, (times, running) in results.items():
        print(f"{name:<16}{running:>8}{pct(times, .5):>9.3f}{pct(times, .9):>9.3f}"
              f"{pct(times, .99):>9.3f}{max(times):>9.3f}")
    decode, running = results["decode"]
    aligned, _ = results["decode-aligned"]
    mixed, _ = results["mixed"]
    print(json.dumps({
        "running": running,
        "step_ms_p50": round(pct(decode, .5), 4),
        "step_ms_p99": round(pct(decode, .99), 4),
        "aligned_step_ms_p50": round(pct(aligned, .5), 4),
        "aligned_step_ms_p99": round(pct(aligned, .99), 4),
        "mixed_step_ms_p50": round(pct(mixed, .5), 4),
        "mixed_step_ms_p99": round(pct(mixed, .99), 4),
    }))


if __name__ == "__main__":
    main()
