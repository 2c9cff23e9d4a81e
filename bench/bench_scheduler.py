"""CPU cost of one engine step without a model: schedule() + update_from_output().

Scenarios (block size 16, fake sampled tokens, prefix caching on):
- decode: 256 running requests of ~1,000 context tokens (lengths spread over a block);
- decode-aligned: the same, all lengths equal, so every request fills a block (and hashes
  it) in the same step: the worst case for hashing spikes;
- mixed: a stream of new requests sharing a 512-token system prompt (prefix hits) arriving
  while ~128 decode, under chunked prefill.

Prints a table, then one JSON line: {"running": 256, "step_ms_p50": ..., "step_ms_p99": ...}.

`--clock thread` times with this thread's CPU time instead of the wall clock: on a machine
shared with other work, wall-clock tails include the time the OS gives to other processes.
(A thread-time reading costs ~1-2 us here, against ~0.1-0.3 us for the wall clock.)

`--nanovllm PATH` (a nano-vllm checkout: github.com/GeeeekExplorer/nano-vllm) also runs its
scheduler and block manager on the decode traces (schedule() + postprocess(); prefix caching
on, block 16) for a side-by-side figure. It does less per step: no token budget across
running requests, no per-step deltas, outputs, stop strings, stats or async placeholders.
Its mixed scenario would differ (it never mixes prefill and decode in a step): not run.
"""

import argparse
import gc
import importlib
import json
import random
import sys
import time
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

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


def timed_steps(
    schedule: Callable[[], Any],
    model: Callable[[Any], Any],
    update: Callable[[Any, Any], Any],
    steps: int,
    clock: Callable[[], float],
    before_step: Callable[[int], None] | None = None,
) -> list[float]:
    """Milliseconds per step of schedule() + update(); the model's work is not timed."""
    times = []
    gc.collect()
    for step in range(steps):
        if before_step:
            before_step(step)
        t0 = clock()
        out = schedule()
        t1 = clock()
        model_output = model(out)
        t2 = clock()
        update(out, model_output)
        times.append((clock() - t2 + t1 - t0) * 1e3)
    return times


def v1_steps(
    s: Scheduler, steps: int, clock: Callable[[], float], before_step=None
) -> list[float]:
    return timed_steps(
        s.schedule, lambda out: fake_output(s, out), s.update_from_output, steps, clock,
        before_step,
    )


def decode_scenario(
    aligned: bool, steps: int, seed: int, clock: Callable[[], float]
) -> tuple[list[float], int]:
    rng = random.Random(seed)
    s = make_scheduler(num_blocks=256 * 100)
    for i in range(256):
        length = 1000 if aligned else rng.randint(992, 1008)
        add(s, rng, i, [rng.randrange(49152) for _ in range(length)], max_tokens=10_000)
    while s.waiting or any(r.num_computed_tokens < r.num_prompt_tokens for r in s.running):
        out = s.schedule()  # prefill, untimed
        s.update_from_output(out, fake_output(s, out))
    times = v1_steps(s, steps, clock)
    return times, len(s.running)


def load_nanovllm(path: str) -> types.ModuleType:
    """nano-vllm's engine modules from a checkout, without its package __init__ (which
    loads the model runner: torch, flash-attn)."""
    root = Path(path) / "nanovllm"
    if not (root / "engine" / "scheduler.py").is_file():
        raise ValueError(f"--nanovllm {path!r}: no nanovllm/engine/scheduler.py under it")
    package = types.ModuleType("nanovllm")
    package.__path__ = [str(root)]
    sys.modules["nanovllm"] = package
    return importlib.import_module("nanovllm.engine.scheduler")


def nanovllm_decode_scenario(
    path: str, aligned: bool, steps: int, seed: int, clock: Callable[[], float]
) -> tuple[list[float], int]:
    """The decode trace through nano-vllm's Scheduler (same prompts as `decode_scenario`)."""
    nano = load_nanovllm(path)
    sequence = importlib.import_module("nanovllm.engine.sequence")
    params = importlib.import_module("nanovllm.sampling_params")
    sequence.Sequence.block_size = 16
    config = types.SimpleNamespace(
        max_num_seqs=256, max_num_batched_tokens=8192, eos=0, kvcache_block_size=16,
        num_kvcache_blocks=256 * 100,
    )
    s = nano.Scheduler(config)
    rng = random.Random(seed)
    for _ in range(256):
        length = 1000 if aligned else rng.randint(992, 1008)
        prompt = [rng.randrange(49152) for _ in range(length)]
        s.add(sequence.Sequence(prompt, params.SamplingParams(max_tokens=10_000, ignore_eos=True)))

    def sample(out: tuple[list, bool]) -> list[int]:
        return [1000] * len(out[0])

    def postprocess(out: tuple[list, bool], token_ids: list[int]) -> None:
        s.postprocess(out[0], token_ids, out[1])

    while s.waiting:  # prefill, untimed
        out = s.schedule()
        postprocess(out, sample(out))
    times = timed_steps(s.schedule, sample, postprocess, steps, clock)
    return times, len(s.running)


def mixed_scenario(
    steps: int, seed: int, clock: Callable[[], float]
) -> tuple[list[float], int]:
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

    times = v1_steps(s, steps, clock, arrivals)
    return times, len(s.running)


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=300, help="timed steps per scenario")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--nanovllm", metavar="PATH",
                        help="a nano-vllm checkout: also run its scheduler on the decode traces")
    parser.add_argument("--clock", choices=("wall", "thread"), default="wall",
                        help="wall clock, or this thread's CPU time (see above)")
    args = parser.parse_args()
    clock = time.perf_counter if args.clock == "wall" else time.thread_time

    results = {
        "decode": decode_scenario(False, args.steps, args.seed, clock),
        "decode-aligned": decode_scenario(True, args.steps, args.seed, clock),
        "mixed": mixed_scenario(args.steps, args.seed, clock),
    }
    if args.nanovllm:
        results["nanovllm-decode"] = nanovllm_decode_scenario(
            args.nanovllm, False, args.steps, args.seed, clock
        )
        results["nanovllm-aligned"] = nanovllm_decode_scenario(
            args.nanovllm, True, args.steps, args.seed, clock
        )
    print(f"{'scenario':<16}{'running':>8}{'p50 ms':>9}{'p90 ms':>9}{'p99 ms':>9}{'max ms':>9}")
    for name, (times, running) in results.items():
        print(f"{name:<16}{running:>8}{pct(times, .5):>9.3f}{pct(times, .9):>9.3f}"
              f"{pct(times, .99):>9.3f}{max(times):>9.3f}")
    decode, running = results["decode"]
    aligned, _ = results["decode-aligned"]
    mixed, _ = results["mixed"]
    summary = {
        "clock": args.clock,
        "running": running,
        "step_ms_p50": round(pct(decode, .5), 4),
        "step_ms_p99": round(pct(decode, .99), 4),
        "aligned_step_ms_p50": round(pct(aligned, .5), 4),
        "aligned_step_ms_p99": round(pct(aligned, .99), 4),
        "mixed_step_ms_p50": round(pct(mixed, .5), 4),
        "mixed_step_ms_p99": round(pct(mixed, .99), 4),
    }
    if args.nanovllm:
        nano, _ = results["nanovllm-decode"]
        nano_aligned, _ = results["nanovllm-aligned"]
        summary |= {
            "nanovllm_step_ms_p50": round(pct(nano, .5), 4),
            "nanovllm_step_ms_p99": round(pct(nano, .99), 4),
            "nanovllm_aligned_step_ms_p50": round(pct(nano_aligned, .5), 4),
            "nanovllm_aligned_step_ms_p99": round(pct(nano_aligned, .99), 4),
        }
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
