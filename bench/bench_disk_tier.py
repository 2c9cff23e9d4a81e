"""The disk tier under the RAM prefix cache (kv_cache_dir), against its targets.

1. restart: a cached ~--system-len-token system prompt (chat template), a new question. TTFT
   (generate with max_tokens=1) on a cold engine against an engine started on a kv_cache_dir
   that a previous engine filled with that system prompt (and another question), and the
   time of that engine's read of the blocks within its TTFT; the greedy
   tokens of the two (--output-len) must be equal. Start-up: `LLM()` with the model loaded
   from its converted copy, with no tier against with the filled directory (median of
   --rounds each, alternating). Targets: TTFT >= 8x faster, start-up <= 1.5x.
2. working set 2x the RAM pool, one core: --groups (4) system prompts of about
   --hit-system-len (592, 37 blocks) tokens, --prompts-per-group (8) questions each,
   interleaved, all 32 submitted at once, --num-blocks (96) blocks of 16: the prefix-cache hit
   rate (tokens) without and with the tier, and the ideal (an unbounded cache, this order).
   Target >= 0.8 with it.
3. cost on a workload that never hits the tier: --cost-requests unique prompts of
   --cost-prompt-len random tokens, --cost-output-len generated, all at once; an engine with
   the tier and one without (same weights) run in alternation, new prompts each pair, and the
   ratio reported is the median over pairs of (with / without), in wall time (each run
   includes waiting for its writes) and in this process's CPU time; and the fraction of the
   step loop's execute time spent copying blocks out for the writer. Target <= 1.05.
4. the I/O itself, for the design choices: copying out the K/V of a 1,300-token prompt (82
   blocks) after its forward, reading them back before a forward (files in the page cache),
   writing them (the writer thread's time), against that prompt's prefill time.

Run under nice -n 19 on a shared machine: the figures carry the 1-minute load average.

    nice -n 19 .venv/bin/python bench/bench_disk_tier.py --out bench/results
"""

import argparse
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench_dp import closed_loop, run_workload
from bench_prefix_cache import (
    add_workload_args,
    ideal_hit_tokens,
    make_workload,
    question,
    sentences,
    word_list,
)
from common import (
    add_model_args,
    cpu_seconds,
    environment,
    load,
    make_llm,
    median,
    print_table,
)

from v1 import LLM, SamplingParams
from v1.core.sched.output import KVLoad

BLOCK = 16


def chat(tokenizer: Any, system: str, q: str) -> list[int]:
    text = tokenizer.apply_chat_template(
        [{"role": "system", "content": system}, {"role": "user", "content": q}],
        add_generation_prompt=True, tokenize=False,
    )
    return tokenizer.encode(text, add_special_tokens=False)


def timed_generate(llm: LLM, prompt: list[int], max_tokens: int) -> tuple[float, list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    t0 = time.perf_counter()
    out = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]
    return time.perf_counter() - t0, list(out.outputs[0].token_ids)


def timed_into(spent: dict[str, float], name: str, fn: Any) -> Any:
    def timed(*args: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return fn(*args)
        finally:
            spent[name] += time.perf_counter() - t0
    return timed


def bench_restart(args: argparse.Namespace, loaded: Any) -> dict[str, Any]:
    tokenizer = loaded.tokenizer
    rng = random.Random(args.seed)
    words = word_list(tokenizer)
    engine = {"num_gpu_blocks": 256, "max_model_len": 2048}
    cold_ttft, warm_ttft, cold_start, warm_start, same, reads = [], [], [], [], [], []
    for r in range(args.rounds):
        system = f"You are help desk number {r}. " + sentences(
            rng, words, args.system_len, tokenizer
        )
        seen = chat(tokenizer, system, question(rng, words, 20, tokenizer))
        new = chat(tokenizer, system, question(rng, words, 20, tokenizer))
        with tempfile.TemporaryDirectory() as kv_dir:
            with make_llm(loaded, **engine) as cold:
                ttft, _ = timed_generate(cold, new, 1)
                cold_ttft.append(ttft)
                assert cold.reset_prefix_cache()
                _, cold_tokens = timed_generate(cold, new, args.output_len)
            with make_llm(loaded, kv_cache_dir=kv_dir, **engine) as first:
                timed_generate(first, seen, 1)  # the system prompt goes to disk
            with make_llm(loaded, kv_cache_dir=kv_dir, **engine) as restarted:
                store = restarted.llm_engine.client.engine_core.model_runner.kv_disk
                spent = {"read": 0.0}
                store.load = timed_into(spent, "read", store.load)
                ttft, _ = timed_generate(restarted, new, 1)
                warm_ttft.append(ttft)
                reads.append(spent["read"])
                assert restarted.reset_prefix_cache()  # RAM only: read from disk again
                _, warm_tokens = timed_generate(restarted, new, args.output_len)
            same.append(warm_tokens == cold_tokens)
            # Start-up, the model loaded from its converted copy each time, alternating.
            for with_tier in (False, True) if r % 2 == 0 else (True, False):
                options = {"kv_cache_dir": kv_dir} if with_tier else {}
                t0 = time.perf_counter()
                llm = LLM(model=args.model, multiprocess=False, **engine, **options)
                (warm_start if with_tier else cold_start).append(time.perf_counter() - t0)
                llm.shutdown()
    return {
        "prompt_tokens": len(new),
        "cold_ttft_s": round(median(cold_ttft), 3),
        "restart_ttft_s": round(median(warm_ttft), 3),
        "ttft_speedup": round(median(cold_ttft) / median(warm_ttft), 2),
        # Of the restart TTFT: reading the blocks (the rest is one forward of the tokens
        # after them, attending to the whole prompt, and the step around it).
        "restart_read_s": round(median(reads), 3),
        "same_tokens": all(same),
        "cold_start_s": round(median(cold_start), 3),
        "tier_start_s": round(median(warm_start), 3),
        "start_ratio": round(median(warm_start) / median(cold_start), 3),
    }


def bench_hit_rate(args: argparse.Namespace, loaded: Any) -> dict[str, Any]:
    workload = argparse.Namespace(**{**vars(args), "system_len": args.hit_system_len})
    prompts = make_workload(workload, loaded.tokenizer)
    params = SamplingParams(temperature=0.0, max_tokens=args.hit_output_len, ignore_eos=True)
    engine = {"num_gpu_blocks": args.num_blocks, "max_model_len": 1024}
    result: dict[str, Any] = {
        "num_requests": len(prompts), "num_blocks": args.num_blocks,
        # What an unbounded cache would hit, given the submission order.
        "ideal_hit_rate": round(
            sum(ideal_hit_tokens(prompts, BLOCK)) / sum(map(len, prompts)), 4
        ),
    }
    with make_llm(loaded, **engine) as llm:
        result["without_tier"] = run_workload(llm, prompts, params, args.concurrency)
    with tempfile.TemporaryDirectory() as kv_dir:
        with make_llm(loaded, kv_cache_dir=kv_dir, **engine) as llm:
            result["with_tier"] = run_workload(llm, prompts, params, args.concurrency)
            result["with_tier"]["disk_hit_tokens"] = llm.get_stats().disk_cache_hits
    return result


def bench_cost(args: argparse.Namespace, loaded: Any) -> dict[str, Any]:
    rng = random.Random(args.seed + 1)
    vocab = int(loaded.hf_config.vocab_size)
    params = SamplingParams(temperature=0.0, max_tokens=args.cost_output_len, ignore_eos=True)
    engine = {"num_gpu_blocks": 1024, "max_model_len": 1024}
    ratios, cpu_ratios, times = [], [], {"with": [], "without": []}
    with tempfile.TemporaryDirectory() as kv_dir, make_llm(loaded, **engine) as plain, \
            make_llm(loaded, kv_cache_dir=kv_dir, **engine) as tiered:
        # The tier's work on the step loop itself (copying blocks out for the writer), timed
        # directly: what noise cannot blur.
        runner = tiered.llm_engine.client.engine_core.model_runner
        spent = {"save": 0.0, "execute": 0.0}
        runner.kv_disk.save = timed_into(spent, "save", runner.kv_disk.save)
        runner.execute_model = timed_into(spent, "execute", runner.execute_model)
        for pair in range(args.cost_pairs):
            prompts = [
                [rng.randrange(100, vocab) for _ in range(args.cost_prompt_len)]
                for _ in range(args.cost_requests)
            ]
            order = [("without", plain), ("with", tiered)]
            if pair % 2:
                order.reverse()
            seconds, cpu = {}, {}
            for name, llm in order:
                c0 = cpu_seconds()
                seconds[name] = closed_loop(llm, prompts, params, len(prompts))
                if name == "with":
                    tiered.llm_engine.client.engine_core.model_runner.kv_disk.flush()
                cpu[name] = cpu_seconds() - c0
                times[name].append(seconds[name])
            ratios.append(seconds["with"] / seconds["without"])
            cpu_ratios.append(cpu["with"] / cpu["without"])
        stats = tiered.get_stats()
    return {
        "pairs": args.cost_pairs,
        "median_ratio": round(median(ratios), 4),
        "ratios": [round(r, 4) for r in ratios],
        # This process's CPU seconds (the writer thread's included; the kernel's writeback
        # of the files is not): what the tier costs us, apart from the machine's noise.
        "median_cpu_ratio": round(median(cpu_ratios), 4),
        "cpu_ratios": [round(r, 4) for r in cpu_ratios],
        "without_s": round(median(times["without"]), 3),
        "with_s": round(median(times["with"]), 3),
        "disk_hit_tokens": stats.disk_cache_hits,
        "stored_blocks": stats.disk_cache_stored_blocks,
        "step_loop_copy_fraction": round(spent["save"] / spent["execute"], 4),
    }


def bench_io(args: argparse.Namespace, loaded: Any) -> dict[str, Any]:
    num_blocks = 82
    with tempfile.TemporaryDirectory() as kv_dir, make_llm(
        loaded, kv_cache_dir=kv_dir, num_gpu_blocks=512, max_model_len=2048
    ) as llm:
        runner = llm.llm_engine.client.engine_core.model_runner
        store = runner.kv_disk
        prompt = [random.Random(0).randrange(100, 40000) for _ in range(num_blocks * BLOCK + 1)]
        prefill_s, _ = timed_generate(llm, prompt, 1)
        store.flush()
        store.take_stored()
        hashes = [h.to_bytes(16, "little") for h in range(num_blocks)]
        ids = list(range(num_blocks))
        t0 = time.perf_counter()
        store.save(runner.kv_caches, list(zip(ids, hashes)))
        copy_s = time.perf_counter() - t0
        store.flush()
        write_s = time.perf_counter() - t0 - copy_s
        assert all(ok for _, ok in store.take_stored())
        reads = []
        for _ in range(5):
            t0 = time.perf_counter()
            # As the steps would: a bounded read per call until the load is done.
            done = store.load(runner.kv_caches, [KVLoad("bench", ids[::-1], hashes)])
            while not done:
                done = store.load(runner.kv_caches, [])
            assert done == {"bench": num_blocks}
            reads.append(time.perf_counter() - t0)
    return {
        "blocks": num_blocks,
        "file_bytes": store.file_bytes,
        "prefill_s": round(prefill_s, 3),
        "copy_out_ms": round(copy_s * 1e3, 1),
        "write_ms_writer_thread": round(write_s * 1e3, 1),
        "read_ms_page_cache": round(median(reads) * 1e3, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_model_args(parser)
    add_workload_args(parser, groups=4, output_len=16, interleave=True)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--hit-system-len", type=int, default=592)
    parser.add_argument("--prompts-per-group", type=int, default=8)
    parser.add_argument("--num-blocks", type=int, default=96)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--hit-output-len", type=int, default=4)
    parser.add_argument("--cost-requests", type=int, default=8)
    parser.add_argument("--cost-prompt-len", type=int, default=256)
    parser.add_argument("--cost-output-len", type=int, default=16)
    parser.add_argument("--cost-pairs", type=int, default=5)
    parser.add_argument("--parts", nargs="+", default=["restart", "hit_rate", "cost", "io"],
                        choices=["restart", "hit_rate", "cost", "io"])
    parser.add_argument("--out", default=None, help="also write disk_tier.json here")
    parser.set_defaults(system_len=1300)
    args = parser.parse_args()
    loaded = load(args.model)
    parts = {"restart": bench_restart, "hit_rate": bench_hit_rate, "cost": bench_cost,
             "io": bench_io}
    result: dict[str, Any] = {"command": " ".join(sys.argv), "environment": environment()}
    for name in args.parts:
        result[name] = parts[name](args, loaded)
        print(f"{name}: {json.dumps(result[name])}", flush=True)
    result["loadavg_1m_end"] = round(os.getloadavg()[0], 2)
    rows = []
    if "restart" in result:
        r = result["restart"]
        rows += [("restart TTFT speedup", r["ttft_speedup"], ">= 8", r["same_tokens"]),
                 ("start-up ratio", r["start_ratio"], "<= 1.5", "")]
    if "hit_rate" in result:
        h = result["hit_rate"]
        rows += [("hit rate, 2x working set, no tier", h["without_tier"]["hit_rate"], "", ""),
                 ("hit rate, 2x working set, tier", h["with_tier"]["hit_rate"], ">= 0.8", "")]
    if "cost" in result:
        rows.append(("never-hit cost (with / without)", result["cost"]["median_ratio"],
                     "<= 1.05", ""))
    print_table(["figure", "value", "target", "same tokens"], rows)
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "disk_tier.json").write_text(json.dumps(result, indent=1))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
