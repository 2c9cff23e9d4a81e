"""Prefix-aware admission (SchedulerConfig.enable_prefix_aware_scheduling) against FCFS,
on the real Scheduler with a fake executor (no model: every scheduled token is "computed",
each request samples token 7 when its known tokens are done; block size 16).

(a) cold burst: `--burst` (8) requests arrive at once, sharing a `--prefix-len` (2,000)
    token prefix nobody has computed, each with its own `--suffix-len` (32) tokens; a
    large pool (no eviction). Prefill tokens computed against the ideal, prefix + burst x
    suffix (the first computes the prefix, the others hit it), for several budgets and
    long-prefill caps (`max_num_batched_tokens` / `long_prefill_token_threshold`).
(b) interleaved groups on a small pool: `--groups` (4) system prompts of `--system-len`
    (590, ~37 blocks) tokens, `--requests` (32) requests at once, round robin over the groups
    (g0, g1, g2, g3, g0, ...), each with a question of 8-24 tokens (seeded) and
    `--output-len` (16) generated tokens, on `--pool` (96) blocks. Prefix-cache hit rate in
    prompt tokens (the engine's metric: first admissions only), preemptions, steps.

Prints tables, then one JSON line.

    PYTHONPATH=. .venv/bin/python bench/bench_queue.py
"""

import argparse
import json
import random
import sys
import time
from typing import Any

from v1.config import CacheConfig, SchedulerConfig
from v1.core.sched.scheduler import Scheduler
from v1.outputs import ModelRunnerOutput
from v1.request import EngineCoreRequest
from v1.sampling_params import SamplingParams

BLOCK_SIZE = 16


def make_scheduler(num_blocks: int, budget: int, threshold: int, aware: bool,
                   max_skips: int = 16, window: int = 32) -> Scheduler:
    return Scheduler(
        SchedulerConfig(
            max_num_seqs=256, max_num_batched_tokens=budget, max_model_len=8192,
            long_prefill_token_threshold=threshold, enable_prefix_aware_scheduling=aware,
            prefix_aware_max_skips=max_skips, prefix_aware_window=window,
        ),
        CacheConfig(block_size=BLOCK_SIZE),
        num_blocks,
    )


def run(s: Scheduler, prompts: list[list[int]], output_len: int) -> dict[str, Any]:
    """Add every prompt at once and step to completion; count the prompt tokens computed."""
    for i, prompt in enumerate(prompts):
        s.add_request(EngineCoreRequest(
            f"r{i}", prompt, SamplingParams(max_tokens=output_len, ignore_eos=True),
            eos_token_id=0, arrival_time=float(i),
        ))
    prefill_computed = steps = 0
    t0 = time.perf_counter()
    while s.has_requests():
        out = s.schedule()
        steps += 1
        sampled = []
        for req_id, n in out.num_scheduled_tokens.items():
            r = s.requests[req_id]
            end = r.num_computed_tokens  # advanced by schedule() already
            prefill_computed += max(0, min(end, r.num_prompt_tokens)
                                    - min(end - n, r.num_prompt_tokens))
            sampled.append([7] if end >= r.num_tokens else [])
        s.update_from_output(out, ModelRunnerOutput(list(out.num_scheduled_tokens), sampled))
    seconds = time.perf_counter() - t0
    s.check_integrity()
    stats = s.make_stats()
    return {
        "prefill_tokens": prefill_computed,
        "hit_rate": round(stats.prefix_cache_hit_rate, 4),
        "preemptions": stats.num_preemptions,
        "steps": steps,
        "ms_per_step": round(1e3 * seconds / steps, 3),
    }


def burst(args: argparse.Namespace) -> list[dict[str, Any]]:
    rng = random.Random(args.seed)
    prefix = [rng.randrange(100, 30000) for _ in range(args.prefix_len)]
    prompts = [prefix + [rng.randrange(100, 30000) for _ in range(args.suffix_len)]
               for _ in range(args.burst)]
    ideal = args.prefix_len + args.burst * args.suffix_len
    rows = []
    for budget, threshold in (
        (2048, 0), (2048, 256), (512, 0), (8192, 512), (1024, 128), (1024, 64), (2048, 32),
    ):
        for aware in (False, True):
            s = make_scheduler(4096, budget, threshold, aware)
            result = run(s, prompts, args.output_len)
            rows.append({"budget": budget, "threshold": threshold, "aware": aware,
                         "ideal": ideal, "x_ideal": round(result["prefill_tokens"] / ideal, 3),
                         **result})
    return rows


def groups(args: argparse.Namespace) -> list[dict[str, Any]]:
    rng = random.Random(args.seed)
    systems = [[rng.randrange(100, 30000) for _ in range(args.system_len)]
               for _ in range(args.groups)]
    prompts = [systems[i % args.groups]
               + [rng.randrange(100, 30000) for _ in range(rng.randint(8, 24))]
               for i in range(args.requests)]
    rows = []
    configs: list[tuple[bool, int, int]] = [(False, 16, 32)]
    configs += [(True, k, 32) for k in (4, 8, 16, 32, 64)]
    configs += [(True, 16, w) for w in (8, 16)]
    for aware, max_skips, window in configs:
        s = make_scheduler(args.pool, args.budget, 0, aware, max_skips, window)
        rows.append({"aware": aware, "max_skips": max_skips, "window": window,
                     **run(s, prompts, args.output_len)})
    return rows


def print_rows(title: str, rows: list[dict[str, Any]]) -> None:
    print(title)
    keys = list(rows[0])
    print("  ".join(f"{k:>14}" for k in keys))
    for row in rows:
        print("  ".join(f"{row[k]!s:>14}" for k in keys))
    print()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--burst", type=int, default=8)
    parser.add_argument("--prefix-len", type=int, default=2000)
    parser.add_argument("--suffix-len", type=int, default=32)
    parser.add_argument("--groups", type=int, default=4)
    parser.add_argument("--system-len", type=int, default=590)
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--pool", type=int, default=96, help="KV blocks of 16 tokens")
    parser.add_argument("--budget", type=int, default=2048, help="max_num_batched_tokens (b)")
    parser.add_argument("--output-len", type=int, default=16)
    args = parser.parse_args()
    a, b = burst(args), groups(args)
    print_rows(f"(a) {args.burst} cold requests on a {args.prefix_len}-token prefix "
               f"(+{args.suffix_len} each): prompt tokens computed", a)
    print_rows(f"(b) {args.groups} groups x {args.system_len} tokens, {args.requests} "
               f"requests interleaved, {args.pool} blocks: hit rate", b)
    json.dump({"burst": a, "groups": b}, sys.stdout)
    print()


if __name__ == "__main__":
    main()
