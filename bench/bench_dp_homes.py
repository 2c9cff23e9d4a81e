"""Prefix homes across data-parallel cores: DP=N's prefix-cache hit rate against one core with
N times the blocks, for 2..16 prefix groups arriving at once, with homes chosen by capacity
(the router's), by rendezvous hashing alone (the same load guard), and by the router as it
was before homes by capacity (rendezvous homes, a load guard blind to what a spill loses), side by
side.

Simulated at the scheduler level, no model: each core is a real `Scheduler` (prefix cache,
chunked prefill, prefix-aware admission, preemption) stepped with fake sampled tokens (as
bench_scheduler.py), fed by the real `DPRouter`, which gets each core's published figures
after each of its steps, as the DP client does. A tick steps every core that has requests.
Real engines would take minutes per point on this machine; hit rates depend only on what
the schedulers and the router decide, which this runs unchanged.

The workload per group count G and seed: G system prompts of `--system-len` random tokens,
each followed by `--prompts-per-group` questions of `--question-len` random tokens, arriving
interleaved (g0, g1, ..., g0, ...), `--concurrency` in flight at a time (a closed loop),
`--output-len` tokens generated each. Each DP core has round(G x shared blocks /
`--kv-ratio`) blocks, so that the shared prefixes fit in the cluster's KV but not in one
core's; the one-core baseline has N times that. The defaults (~37-block prompts, kv-ratio
1.5, 32 in flight) are four prompts on 96-block cores at G = 4. `--seeds`
workloads per group count (other prompts, so other rendezvous draws): the table gives the
mean hit rates, the worst gap to one core over the seeds, the requests the load guard sent
away from their prefix's core (spills, summed over seeds), and "largest share": the
prefixes of the core homing the most (ceil(G / N) of them) over its blocks. Near or above
1, no policy with one home per prefix fits them with room for the running requests.

    cluster hit rate = prefix-cache hits / lookups, in prompt tokens, over all cores

    .venv/bin/python bench/bench_dp_homes.py
    .venv/bin/python bench/bench_dp_homes.py --concurrency 8
    .venv/bin/python bench/bench_dp_homes.py --groups 2 8 --prompts-per-group 32

(bench/results/dp_homes.txt holds those three runs.)
"""

import argparse
import json
import random
from typing import Any

from bench_scheduler import fake_output
from common import print_table

from v1.config import CacheConfig, SchedulerConfig
from v1.core.sched.scheduler import Scheduler
from v1.engine.dp_router import DPRouter
from v1.request import EngineCoreRequest
from v1.sampling_params import SamplingParams

VOCAB = 49152


class RendezvousHomes(DPRouter):
    """A new prefix's home is its key's rendezvous winner, blind to the cores' footprints
    (the load guard as the router's)."""

    def new_home(self, order: list[int], blocks: int) -> int:
        return order[0]


class Before(RendezvousHomes):
    """The router before homes by capacity: rendezvous homes, and a load guard that neither weighs
    the cached blocks a request would lose elsewhere nor counts what it needs of a full
    core's KV cache (it trips at the core's KV usage alone)."""

    saved_block_weight = 0.0

    def _fits(self, engine: int, hashes: list[bytes], cached: int) -> bool:
        return self.loads[engine].kv_usage < self.guard.kv_threshold


# DP=N routers: the router's homes by capacity; rendezvous homes with the same load guard;
# the router before homes by capacity.
POLICIES: dict[str, type[DPRouter]] = {
    "capacity": DPRouter, "rendezvous": RendezvousHomes, "before": Before,
}


def workload(args: argparse.Namespace, groups: int, seed: int) -> list[list[int]]:
    """Interleaved prompts of `groups` system prompts (random tokens)."""
    rng = random.Random(seed)
    systems = [[rng.randrange(VOCAB) for _ in range(args.system_len)] for _ in range(groups)]
    rows = [
        [system + [rng.randrange(VOCAB) for _ in range(rng.randint(*args.question_len))]
         for system in systems]
        for _ in range(args.prompts_per_group)
    ]
    return [p for row in rows for p in row]


def run(args: argparse.Namespace, prompts: list[list[int]], cores: int, blocks: int,
        router: DPRouter | None) -> dict[str, Any]:
    """Run the closed loop on `cores` schedulers of `blocks` blocks each; `router` picks the
    core (None: one core). Returns the cluster hit rate and the requests the load guard sent
    away from their prefix's core."""
    schedulers = [
        Scheduler(SchedulerConfig(max_num_seqs=args.max_num_seqs, max_model_len=4096),
                  CacheConfig(block_size=args.block_size), blocks)
        for _ in range(cores)
    ]
    params = SamplingParams(max_tokens=args.output_len, ignore_eos=True)
    queue = list(enumerate(prompts))
    queue.reverse()
    in_flight = 0
    while queue or any(s.has_requests() for s in schedulers):
        while queue and in_flight < args.concurrency:
            i, prompt = queue.pop()
            engine = router.route(prompt).engine if router is not None else 0
            schedulers[engine].add_request(EngineCoreRequest(
                f"r{i}", prompt, params, eos_token_id=0, arrival_time=float(i)))
            in_flight += 1
        for engine, s in enumerate(schedulers):
            if not s.has_requests():
                continue
            out = s.schedule()
            done = sum(o.finish_reason is not None
                       for outs in s.update_from_output(out, fake_output(s, out)).values()
                       for o in outs.outputs)
            in_flight -= done
            if router is not None:
                stats = s.make_stats()
                router.update_stats(engine, stats.num_waiting_reqs, stats.num_running_reqs,
                                    stats.kv_cache_usage)
                if done:
                    router.finished(engine, done)
    totals = [s.make_stats() for s in schedulers]
    queries = sum(t.prefix_cache_queries for t in totals)
    return {
        "hit_rate": round(sum(t.prefix_cache_hits for t in totals) / queries, 4),
        "spills": router.decisions["load"] if router is not None else 0,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--groups", type=int, nargs=2, default=[2, 16], metavar=("MIN", "MAX"))
    parser.add_argument("--seeds", type=int, default=8, help="workloads per group count")
    parser.add_argument("--dp", type=int, default=2)
    parser.add_argument("--system-len", type=int, default=590)
    parser.add_argument("--question-len", type=int, nargs=2, default=[8, 24])
    parser.add_argument("--prompts-per-group", type=int, default=8)
    parser.add_argument("--output-len", type=int, default=16)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--kv-ratio", type=float, default=1.5,
                        help="the shared prefixes need this many times one core's KV cache")
    parser.add_argument("--block-size", type=int, default=16)
    args = parser.parse_args()

    shared = args.system_len // args.block_size  # full blocks per group's shared prefix
    rows, points = [], []
    worst = dict.fromkeys(POLICIES, 0.0)
    for groups in range(args.groups[0], args.groups[1] + 1):
        blocks = round(groups * shared / args.kv_ratio)
        per_seed = []
        for seed in range(args.seeds):
            prompts = workload(args, groups, 1000 * groups + seed)
            point = {"one_core": run(args, prompts, 1, args.dp * blocks, None)}
            for name, cls in POLICIES.items():
                router = cls(args.dp, args.block_size, cache_blocks=[blocks] * args.dp)
                point[name] = run(args, prompts, args.dp, blocks, router)
            per_seed.append(point)
        one = [p["one_core"]["hit_rate"] for p in per_seed]
        # The prefixes of the core homing the most, against its cache: near 1, no one-home
        # policy fits them with room for the running requests.
        share = -(-groups // args.dp) * shared / blocks
        row: list[Any] = [groups, blocks, round(share, 2), sum(one) / len(one)]
        entry: dict[str, Any] = {"groups": groups, "blocks_per_core": blocks,
                                 "largest_home_share": round(share, 3),
                                 "one_core_hit_rates": one}
        for name in POLICIES:
            rates = [p[name]["hit_rate"] for p in per_seed]
            gap = max(100 * (o - r) for o, r in zip(one, rates))
            worst[name] = max(worst[name], gap)
            spills = sum(p[name]["spills"] for p in per_seed)
            entry[name] = {"hit_rates": rates, "worst_gap_points": round(gap, 2),
                           "spills": spills}
            row += [sum(rates) / len(rates), round(gap, 2), spills]
        rows.append(row)
        points.append(entry)
    header = ["groups", "blocks/core", "largest share", f"1 core {args.dp}x KV"]
    for name in POLICIES:
        header += [name, "worst gap", "spills"]
    print_table(header, rows)
    print(f"worst gap to one core with {args.dp}x the blocks over groups "
          f"{args.groups[0]}..{args.groups[1]} x {args.seeds} seeds (points): "
          + ", ".join(f"{name} {gap:.2f}" for name, gap in worst.items()))
    print(json.dumps({"bench": "dp_homes", **vars(args),
                      "worst_gap_points": {k: round(v, 2) for k, v in worst.items()},
                      "points": points}))


if __name__ == "__main__":
    main()
