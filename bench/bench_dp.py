"""Data parallelism: prefix-affinity routing against round robin and least loaded, and what
two engine cores of one thread give against one core of two threads.

The workload (fixed seed): `--groups` system prompts of about `--system-len` tokens, each
followed by `--prompts-per-group` user questions of `--question-len` tokens, through the
chat template (bench_prefix_cache.py's generator), arriving interleaved: round robin over
the groups (g0, g1, ..., g12, g0, ...; `--no-interleave`: a seeded random order instead),
`--concurrency` of them in flight at a time (a closed loop: a new one as soon as one
finishes). Every request generates exactly `--output-len` tokens. The default 13 groups is
prime to the 2 cores: with an even count, round-robin routing of round-robin arrivals would
send each core a fixed half of the groups, an accidental partition that says nothing of the
policy.

Each engine core's KV cache (`num_gpu_blocks`) is sized so that the groups' shared prefixes
together need `--kv-ratio` (1.5) x one core's cache: one core cannot keep them all, two can
if each keeps its own half. One `LLM(data_parallel_size=--dp)` runs the workload under each
routing policy in turn (the same engine processes; prefix caches reset and a fresh router
before each run), and one core with --dp x the KV cache (and all the threads) runs it too:
the hit rate affinity should approach.

    cluster hit rate = prefix-cache hits / lookups, in prompt tokens, over all cores

Then the parallelism question: `--ratio-requests` (16) concurrent requests of unique prompts
(`--ratio-prompt-len` random tokens, `--ratio-output-len` generated), on DP=--dp cores with
cores // dp torch threads each, against DP=1 with all the threads. Runs alternate (paired,
interleaved: each pair saw the same phase of the shared machine) and the ratio reported is
the median over pairs of (DP=1 seconds / DP=N seconds): above 1, data parallelism is faster.

Prints tables, then one JSON line; `--out DIR` writes dp.json and dp.png.

    .venv/bin/python bench/bench_dp.py --out bench/results
"""

import argparse
import dataclasses
import json
import random
import sys
import time
from typing import Any

from bench_prefix_cache import add_workload_args, make_workload
from common import add_model_args, bar, environment, median, print_table, write_outputs

POLICIES = ("affinity", "round_robin", "least_loaded")


def shared_prefix_blocks(prompts: list[list[int]], groups: int, block_size: int) -> int:
    """Full blocks each group's prompts share (their common prefix), summed over groups.
    `prompts` are grouped: prompts [g * k, (g + 1) * k) are group g's."""
    per_group = len(prompts) // groups
    total = 0
    for g in range(groups):
        members = prompts[g * per_group : (g + 1) * per_group]
        common = min(len(p) for p in members)
        for i in range(common):
            if any(p[i] != members[0][i] for p in members):
                common = i
                break
        total += common // block_size
    return total


def closed_loop(llm: Any, prompts: list[list[int]], params: Any, concurrency: int) -> float:
    """Run every prompt, `concurrency` at a time, in order; return the wall time."""
    from v1.sampling_params import RequestOutputKind

    engine = llm.llm_engine
    # Only finished outputs are read: one each, as LLM.generate makes them.
    params = dataclasses.replace(params, output_kind=RequestOutputKind.FINAL_ONLY)
    queue = list(enumerate(prompts))
    in_flight = 0
    t0 = time.perf_counter()
    while queue or engine.has_unfinished_requests():
        while queue and in_flight < concurrency:
            i, prompt = queue.pop(0)
            engine.add_request(f"r{i}", {"prompt_token_ids": prompt}, params)
            in_flight += 1
        for out in engine.step():
            if out.finished:
                assert len(out.outputs[0].token_ids) == params.max_tokens
                in_flight -= 1
    return time.perf_counter() - t0


def use_router(llm: Any, policy: str) -> Any:
    """A fresh router of `policy` for the DP client (mirrors and counters empty)."""
    from v1.engine.dp_router import DPRouter

    client = llm.llm_engine.client
    old = client.router
    client.router = DPRouter(
        old.num_engines, old.block_size, policy, cache_blocks=old.capacity, guard=old.guard
    )
    return client.router


def run_workload(llm: Any, prompts: list[list[int]], params: Any, concurrency: int
                 ) -> dict[str, Any]:
    assert llm.reset_prefix_cache(), "the prefix caches could not be reset (blocks in use)"
    before = llm.get_stats()
    seconds = closed_loop(llm, prompts, params, concurrency)
    after = llm.get_stats()
    queries = after.prefix_cache_queries - before.prefix_cache_queries
    hits = after.prefix_cache_hits - before.prefix_cache_hits
    result = {
        "seconds": seconds,
        "hit_rate": hits / queries if queries else 0.0,
        "preemptions": after.num_preemptions - before.num_preemptions,
    }
    engines = getattr(after, "engines", None)
    if engines is not None:
        result["per_core_hit_rate"] = [
            round((a.prefix_cache_hits - b.prefix_cache_hits)
                  / max(1, a.prefix_cache_queries - b.prefix_cache_queries), 4)
            for a, b in zip(engines, before.engines)
        ]
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_workload_args(parser, groups=13, output_len=16, interleave=True)
    parser.set_defaults(system_len=256, question_len=[8, 24])
    parser.add_argument("--prompts-per-group", type=int, default=8)
    parser.add_argument("--concurrency", type=int, default=8, help="requests in flight")
    parser.add_argument("--dp", type=int, default=2, help="data_parallel_size")
    parser.add_argument("--kv-ratio", type=float, default=1.5,
                        help="the shared prefixes need this many times one core's KV cache")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--repeat", type=int, default=1,
                        help="runs of the workload per configuration (median seconds)")
    parser.add_argument("--ratio-requests", type=int, default=16)
    parser.add_argument("--ratio-prompt-len", type=int, default=128)
    parser.add_argument("--ratio-output-len", type=int, default=64)
    parser.add_argument("--ratio-pairs", type=int, default=5)
    parser.add_argument("--out", default=None, help="directory for dp.json and dp.png")
    add_model_args(parser)
    args = parser.parse_args()

    from v1.entrypoints.llm import LLM
    from v1.models.model_files import hf_dir_of, load_tokenizer, resolve_model
    from v1.sampling_params import SamplingParams

    model_path = resolve_model(args.model)
    tokenizer = load_tokenizer(hf_dir_of(model_path))
    interleave, args.interleave = args.interleave, False
    grouped = make_workload(args, tokenizer)  # group by group, to measure the shared prefixes
    prefix_blocks = shared_prefix_blocks(grouped, args.groups, args.block_size)
    k = args.prompts_per_group
    if interleave:  # round robin over the groups
        prompts = [grouped[g * k + i] for i in range(k) for g in range(args.groups)]
    else:
        prompts = list(grouped)
        random.Random(args.seed).shuffle(prompts)
    num_blocks = round(prefix_blocks / args.kv_ratio)
    max_len = max(len(p) for p in prompts) + args.output_len
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    prompt_tokens = sum(len(p) for p in prompts)
    print(f"{len(prompts)} requests in {args.groups} groups "
          f"({'interleaved' if interleave else 'shuffled'}), {prompt_tokens} prompt tokens; "
          f"shared prefixes {prefix_blocks} blocks; {num_blocks} blocks per core "
          f"(x{args.dp} = {num_blocks * args.dp})", file=sys.stderr)
    engine_kwargs = dict(block_size=args.block_size, max_model_len=max(max_len, 512),
                         seed=args.seed)
    dp = LLM(str(model_path), data_parallel_size=args.dp, num_gpu_blocks=num_blocks,
             **engine_kwargs)
    one = LLM(str(model_path), num_gpu_blocks=num_blocks * args.dp, **engine_kwargs)
    warm = SamplingParams(max_tokens=2, ignore_eos=True)
    for llm in (dp, one):  # first-call paths, untimed
        llm.generate([{"prompt_token_ids": prompts[0][:48]}] * 4, warm, use_tqdm=False)

    runs: dict[str, list[dict[str, Any]]] = {p: [] for p in (*POLICIES, "one_core")}
    routed: dict[str, Any] = {}
    for r in range(args.repeat):
        for policy in POLICIES:
            router = use_router(dp, policy)
            runs[policy].append(run_workload(dp, prompts, params, args.concurrency))
            routed[policy] = {"per_core": list(router.routed), "reasons": dict(router.decisions)}
            print(f"run {r}: {policy}: {runs[policy][-1]}", file=sys.stderr)
        runs["one_core"].append(run_workload(one, prompts, params, args.concurrency))
        print(f"run {r}: one core, {args.dp}x KV: {runs['one_core'][-1]}", file=sys.stderr)
    use_router(dp, "affinity")

    out_tokens = len(prompts) * args.output_len
    summary = {}
    for name, results in runs.items():
        seconds = median([x["seconds"] for x in results])
        summary[name] = {
            "seconds": round(seconds, 3),
            "out_tok_s": round(out_tokens / seconds, 1),
            "hit_rate": round(results[-1]["hit_rate"], 4),
            "preemptions": results[-1]["preemptions"],
            **({"per_core_hit_rate": results[-1]["per_core_hit_rate"]}
               if "per_core_hit_rate" in results[-1] else {}),
            **({"routed": routed[name]} if name in routed else {}),
        }

    # DP=N x (cores // N) threads against DP=1 x all threads, paired and interleaved.
    rng = random.Random(args.seed + 1)
    vocab = len(tokenizer)
    ratio_prompts = [{"prompt_token_ids": [rng.randrange(1000, vocab - 1000)
                                           for _ in range(args.ratio_prompt_len)]}
                     for _ in range(args.ratio_requests)]
    ratio_params = SamplingParams(temperature=0.0, max_tokens=args.ratio_output_len,
                                  ignore_eos=True)
    pairs: list[tuple[float, float]] = []
    for i in range(args.ratio_pairs):
        order = (dp, one) if i % 2 == 0 else (one, dp)  # who goes first alternates
        times = {}
        for llm in order:
            t0 = time.perf_counter()
            llm.generate(ratio_prompts, ratio_params, use_tqdm=False)
            times[id(llm)] = time.perf_counter() - t0
        pairs.append((times[id(dp)], times[id(one)]))
        print(f"pair {i}: DP={args.dp} {pairs[-1][0]:.2f} s, DP=1 {pairs[-1][1]:.2f} s",
              file=sys.stderr)
    ratio = median([t1 / tn for tn, t1 in pairs])
    dp_threads = dp.llm_engine.client.threads_per_engine
    dp_split = list(dp.llm_engine.client.router.routed)
    dp.shutdown()
    one.shutdown()

    aff, rr = summary["affinity"], summary["round_robin"]
    result: dict[str, Any] = {
        "bench": "dp",
        "dp": args.dp,
        "requests": len(prompts),
        "groups": args.groups,
        "arrivals": "interleaved" if interleave else "shuffled",
        "system_len": args.system_len,
        "concurrency": args.concurrency,
        "output_len": args.output_len,
        "prompt_tokens": prompt_tokens,
        "shared_prefix_blocks": prefix_blocks,
        "blocks_per_core": num_blocks,
        "kv_ratio": args.kv_ratio,
        "policies": summary,
        "hit_rate_affinity_over_round_robin": round(aff["hit_rate"] / rr["hit_rate"], 2)
        if rr["hit_rate"] else None,
        "hit_rate_gap_to_one_core_points": round(
            100 * (summary["one_core"]["hit_rate"] - aff["hit_rate"]), 2
        ),
        "throughput_affinity_over_round_robin": round(aff["out_tok_s"] / rr["out_tok_s"], 3),
        "parallel": {
            "requests": args.ratio_requests,
            "prompt_len": args.ratio_prompt_len,
            "output_len": args.ratio_output_len,
            "dp_threads_per_core": dp_threads,
            "dp_requests_per_core": dp_split,
            "pairs_s": [[round(a, 3), round(b, 3)] for a, b in pairs],
            "dp_over_one_core_speed": round(ratio, 3),
        },
        **environment(),
    }

    rows = [
        [name.replace("_", " ") if name != "one_core" else f"1 core, {args.dp}x KV",
         s["hit_rate"], s["seconds"], s["out_tok_s"],
         "/".join(map(str, s["routed"]["per_core"])) if "routed" in s else "-"]
        for name, s in summary.items()
    ]
    print_table([f"routing (DP={args.dp})", "hit rate", "seconds", "out tok/s",
                 "requests per core"], rows)
    times = result["hit_rate_affinity_over_round_robin"]
    print(f"affinity / round robin: hit rate {aff['hit_rate']:.3f} / {rr['hit_rate']:.3f}"
          f"{f' = x{times}' if times else ''}, "
          f"throughput x{result['throughput_affinity_over_round_robin']}; gap to one core "
          f"with {args.dp}x KV: {result['hit_rate_gap_to_one_core_points']} points")
    print(f"{args.ratio_requests} concurrent requests: DP={args.dp} x {dp_threads} thread(s) "
          f"vs DP=1 x all threads: speed ratio {ratio:.3f} (median of {len(pairs)} pairs)")

    def plot(fig: Any) -> None:
        labels = [r[0].replace(", ", "\n").replace(" ", "\n", 1) for r in rows]
        bar(fig.add_subplot(1, 3, 1), labels, [r[1] for r in rows],
            "prefix-cache hit rate", f"{args.groups} groups, prefixes {args.kv_ratio}x a core's KV")
        bar(fig.add_subplot(1, 3, 2), labels, [r[3] for r in rows], "output tok/s",
            f"throughput, {args.concurrency} in flight")
        bar(fig.add_subplot(1, 3, 3), [f"DP={args.dp}\n{dp_threads} thr/core", "DP=1\nall"],
            [median([args.ratio_requests * args.ratio_output_len / a for a, _ in pairs]),
             median([args.ratio_requests * args.ratio_output_len / b for _, b in pairs])],
            "output tok/s (median)", f"{args.ratio_requests} concurrent requests")

    write_outputs(args.out, "dp", result, plot)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
