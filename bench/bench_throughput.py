"""Offline throughput without shared prefixes: the engine against HF transformers `generate`.

nano-vllm's benchmark scaled to a 2-core CPU: `--num-seqs` prompts of random token ids with
random input lengths in `--input-len` and random output lengths in `--output-len` (fixed seed),
every request generating exactly its output length (ignore_eos; min_new_tokens on HF). HF runs
the same prompts in left-padded batches of `--hf-batch-size`; a batch generates as many tokens
as its longest request wants (static batching), and only the requested tokens are counted.
With `--hf-sort` (default) HF batches requests of similar output length together, to waste
less.

`--decode` measures batched decode instead: `--decode-seqs` concurrent requests of
`--decode-input-len` random tokens, each generating `--decode-output-len` tokens. All prompts
are prefilled in the first step; the decode rate is the tokens after each request's first one
over the time from the first tokens to the last finish (the requests' own timestamps):

    decode_tok_s = seqs * (output_len - 1) / (finished - first_token)

(Without timestamps it falls back to the difference with a run that generates one token.)

`--engine-process` adds the default `LLM` (engine core in its own process, over ZMQ) on the
same prompts, its runs interleaved with the in-process ones (in-process, process, in-process,
...). Run i of each forms a pair that saw the same phase of the machine, so the overhead is
the median of the paired ratios (a ratio of the two medians mixes runs minutes apart):

    process_overhead = median_i(engine_process_runs_s[i] / engine_runs_s[i]) - 1

`--short` measures the engine process's cost on a short run instead: 32 chat requests
sharing a ~400-token system prompt (the workload of bench_prefix_cache.py, ~450 tokens each),
32 greedy tokens each, ~5 s. Each round builds a fresh `LLM` of each kind (in-process, then
engine process, or the other way round in odd rounds), times its construction (init), its
first run (cold: whatever start-up work is left after `LLM()` returns is inside) and a second
run (warm), and shuts it down. Per column, the overhead is the median over the rounds of the
paired process/in-process ratios, minus 1 (use --repeat 5 or more: the machine is shared).
Beside the wall times, the CPU seconds of each run (this process and the engine process):
equal CPU with a longer wall time means the engine waited rather than worked.

Prints a table, then one JSON line (engine_tok_s, hf_tok_s, speedup, ...; with --decode:
decode_tok_s, ...; with --short: process_overhead_cold, process_overhead_warm, ...).
`--out DIR` writes throughput.json / decode.json / short.json and a PNG.

    .venv/bin/python bench/bench_throughput.py
    .venv/bin/python bench/bench_throughput.py --decode --no-hf
    .venv/bin/python bench/bench_throughput.py --short --repeat 5
"""

import argparse
import json
import random
import sys
import time
from typing import Any

from common import (
    add_common_args,
    agreement,
    bar,
    cpu_seconds,
    environment,
    hf_generate,
    load,
    load_hf,
    make_llm,
    make_process_llm,
    median,
    print_table,
    setup_threads,
    write_outputs,
)


def random_prompts(
    rng: random.Random, n: int, lens: tuple[int, int], vocab: int
) -> list[list[int]]:
    # Ids from the vocabulary's ordinary range (skip the first 256: special and byte tokens).
    return [[rng.randrange(256, vocab) for _ in range(rng.randint(*lens))] for _ in range(n)]


def timed_generate(llm: Any, prompts: list[list[int]], params: Any) -> tuple[float, list]:
    llm.reset_prefix_cache()
    t0 = time.perf_counter()
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return time.perf_counter() - t0, outputs


def throughput(args: argparse.Namespace, loaded: Any, engine_kwargs: dict[str, Any]) -> None:
    from v1.sampling_params import SamplingParams

    rng = random.Random(args.seed)
    vocab = int(loaded.hf_config.vocab_size)
    prompts = random_prompts(rng, args.num_seqs, tuple(args.input_len), vocab)
    out_lens = [rng.randint(*args.output_len) for _ in prompts]
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in out_lens]
    num_in, num_out = sum(map(len, prompts)), sum(out_lens)
    print(f"{len(prompts)} requests, {num_in} prompt tokens, {num_out} output tokens",
          file=sys.stderr)

    llms = {"engine": make_llm(loaded, **engine_kwargs)}
    if args.engine_process:
        llms["engine process"] = make_process_llm(args.model, **engine_kwargs)
    runs: dict[str, list[float]] = {name: [] for name in llms}
    tokens: dict[str, list] = {}
    for llm in llms.values():
        timed_generate(llm, [prompts[0][:32]], SamplingParams(max_tokens=2, ignore_eos=True))
    for r in range(args.repeat):  # interleaved, so that both see the same machine
        for name, llm in llms.items():
            t, outputs = timed_generate(llm, prompts, params)
            runs[name].append(t)
            tokens[name] = [o.outputs[0].token_ids for o in outputs]
            print(f"run {r}: {name} {t:.2f} s", file=sys.stderr)
    for llm in llms.values():
        llm.shutdown()
    times, engine_tokens = runs["engine"], tokens["engine"]
    assert [len(t) for t in engine_tokens] == out_lens

    hf_times: list[float] = []
    hf_tokens = None
    if not args.no_hf:
        hf = load_hf(loaded)
        order = sorted(range(len(prompts)), key=lambda i: out_lens[i]) if args.hf_sort else list(
            range(len(prompts)))
        pad = loaded.tokenizer.pad_token_id if loaded.tokenizer is not None else 0
        for r in range(args.hf_repeat):
            t, hf_sorted = hf_generate(
                hf, [prompts[i] for i in order], [out_lens[i] for i in order],
                args.hf_batch_size, pad or 0,
                lambda done, total: print(f"  hf {done}/{total}", file=sys.stderr),
            )
            hf_times.append(t)
            print(f"run {r}: hf {t:.2f} s", file=sys.stderr)
        hf_tokens = [[] for _ in prompts]
        for i, toks in zip(order, hf_sorted):
            hf_tokens[i] = toks
        del hf

    engine_s = median(times)
    hf_s = median(hf_times) if hf_times else None
    result: dict[str, Any] = {
        "bench": "throughput",
        "requests": len(prompts),
        "prompt_tokens": num_in,
        "output_tokens": num_out,
        "engine_s": round(engine_s, 3),
        "hf_s": round(hf_s, 3) if hf_s else None,
        "engine_tok_s": round(num_out / engine_s, 1),
        "hf_tok_s": round(num_out / hf_s, 1) if hf_s else None,
        "speedup": round(hf_s / engine_s, 2) if hf_s else None,
        "engine_total_tok_s": round((num_in + num_out) / engine_s, 1),
        "engine_runs_s": [round(t, 3) for t in times],
        "hf_runs_s": [round(t, 3) for t in hf_times],
        **environment(),
    }
    if args.engine_process:
        ratios = paired_ratios(times, runs["engine process"])
        result.update(
            engine_process_s=round(median(runs["engine process"]), 3),
            engine_process_runs_s=[round(t, 3) for t in runs["engine process"]],
            process_pair_ratios=[round(r, 4) for r in ratios],
            process_overhead=round(median(ratios) - 1, 4),
            process_same_tokens=tokens["engine process"] == engine_tokens,
        )
    if hf_tokens is not None:
        result["hf_agreement"] = {k: round(v, 4) for k, v in
                                  agreement(engine_tokens, hf_tokens).items()}
    rows = [[name, median(ts), num_out / median(ts), (num_in + num_out) / median(ts)]
            for name, ts in runs.items()]
    if hf_s:
        rows.append([f"HF generate (batch {args.hf_batch_size})", hf_s, num_out / hf_s,
                     (num_in + num_out) / hf_s])
    print_table(["run", "seconds", "out tok/s", "total tok/s"], rows)
    if args.engine_process:
        print("engine process / in-process, run by run: " + ", ".join(
            f"{p:.2f}/{e:.2f} s = {r:.3f}"
            for e, p, r in zip(times, runs["engine process"], ratios)))
        print(f"process_overhead (median of the pairs): {median(ratios) - 1:+.1%}")

    def plot(fig: Any) -> None:
        labels = [r[0] for r in rows]
        bar(fig.add_subplot(1, 2, 1), labels, [r[1] for r in rows], "seconds (median)",
            f"{len(prompts)} random prompts, {num_out} output tokens")
        bar(fig.add_subplot(1, 2, 2), labels, [r[2] for r in rows], "output tokens/s",
            "throughput")

    write_outputs(args.out, "throughput", result, plot)
    print(json.dumps(result))


def paired_ratios(base: list[float], other: list[float]) -> list[float]:
    """other[i] / base[i] for each pair of interleaved runs."""
    if len(base) != len(other):
        raise ValueError(f"{len(base)} runs against {len(other)}: not pairs")
    return [o / b for b, o in zip(base, other)]


def decode_engine_kwargs(engine_kwargs: dict[str, Any], seqs: int,
                         input_len: int) -> dict[str, Any]:
    """Room for every prompt in the first step, so that all requests then decode together."""
    return dict(engine_kwargs, max_num_seqs=max(seqs, engine_kwargs.get("max_num_seqs") or 0),
                max_num_batched_tokens=max(seqs * input_len,
                                           engine_kwargs.get("max_num_batched_tokens") or 0,
                                           2048))


def decode_window(outputs: list) -> tuple[float, int] | None:
    """(seconds, tokens) of the pure-decode phase: from the last request's first token to the
    last one's finish, and the tokens generated in it (each request's all but its first, when
    every first token came out of the same step). None without per-request timestamps."""
    metrics = [o.metrics for o in outputs]
    if any(m is None or m.first_token_time is None or m.finished_time is None
           for m in metrics):
        return None
    first = [m.first_token_time for m in metrics]
    if max(first) - min(first) > 1e-3:
        return None  # prefills were spread over several steps
    tokens = sum(len(o.outputs[0].token_ids) - 1 for o in outputs)
    return max(m.finished_time for m in metrics) - max(first), tokens


def decode(args: argparse.Namespace, loaded: Any, engine_kwargs: dict[str, Any]) -> None:
    from v1.sampling_params import SamplingParams

    rng = random.Random(args.seed)
    vocab = int(loaded.hf_config.vocab_size)
    n, out_len = args.decode_seqs, args.decode_output_len
    prompts = random_prompts(rng, n, (args.decode_input_len, args.decode_input_len), vocab)
    llm = make_llm(loaded, **decode_engine_kwargs(engine_kwargs, n, args.decode_input_len))
    timed_generate(llm, [prompts[0][:32]], SamplingParams(max_tokens=2, ignore_eos=True))
    one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    full = SamplingParams(temperature=0.0, max_tokens=out_len, ignore_eos=True)
    total_times, rates, methods = [], [], []
    for r in range(args.repeat):
        tn, outputs = timed_generate(llm, prompts, full)
        assert all(len(o.outputs[0].token_ids) == out_len for o in outputs)
        total_times.append(tn)
        window = decode_window(outputs)
        if window is not None:
            rates.append(window[1] / window[0])
            methods.append("timestamps")
        else:  # fall back to the difference with a prefill-only run
            t1, _ = timed_generate(llm, prompts, one)
            rates.append(n * (out_len - 1) / (tn - t1))
            methods.append("difference")
        print(f"run {r}: total {tn:.2f} s, decode {rates[-1]:.1f} tok/s ({methods[-1]})",
              file=sys.stderr)
    llm.shutdown()
    decode_tok_s = median(rates)
    step_ms = 1e3 * n / decode_tok_s
    result = {
        "bench": "decode",
        "concurrent": n,
        "input_len": args.decode_input_len,
        "output_len": out_len,
        "kv_cache_dtype": args.kv_cache_dtype,
        "decode_tok_s": round(decode_tok_s, 1),
        "decode_step_ms": round(step_ms, 2),
        "total_s": round(median(total_times), 3),
        "total_out_tok_s": round(n * out_len / median(total_times), 1),
        "decode_runs_tok_s": [round(x, 1) for x in rates],
        "method": methods[0],
        **environment(),
    }
    print_table(["concurrent", "context", "decode tok/s", "step ms", "total s"],
                [[n, f"{args.decode_input_len}..{args.decode_input_len + out_len}",
                  decode_tok_s, step_ms, median(total_times)]])

    def plot(fig: Any) -> None:
        bar(fig.add_subplot(1, 1, 1), [f"{n} concurrent"], [decode_tok_s], "output tokens/s",
            f"batched decode, context {args.decode_input_len}..{args.decode_input_len + out_len}")

    write_outputs(args.out, "decode", result, plot)
    print(json.dumps(result))


def short_workload(args: argparse.Namespace, tokenizer: Any) -> list[list[int]]:
    """32 chat prompts behind one ~400-token system prompt (bench_prefix_cache's workload)."""
    from bench_prefix_cache import make_workload

    return make_workload(argparse.Namespace(
        seed=args.seed, groups=1, system_len=400, question_len=(10, 60), prompts_per_group=32,
        plain=False, interleave=False,
    ), tokenizer)


def short(args: argparse.Namespace) -> None:
    from v1.entrypoints.llm import LLM
    from v1.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    kinds = {"in-process": False, "engine process": True}
    columns = ("init", "cold", "warm")
    runs = {kind: {c: [] for c in columns} for kind in kinds}
    cpu = {kind: {c: [] for c in columns[1:]} for kind in kinds}
    prompts: list[list[int]] = []
    tokens: dict[str, list] = {}
    for r in range(args.repeat):
        order = list(kinds) if r % 2 == 0 else list(kinds)[::-1]  # neither always goes first
        for kind in order:
            t0 = time.perf_counter()
            llm = LLM(args.model, multiprocess=kinds[kind], max_num_seqs=args.max_num_seqs,
                      kv_cache_dtype=args.kv_cache_dtype)
            times = runs[kind]
            times["init"].append(time.perf_counter() - t0)
            prompts = prompts or short_workload(args, llm.get_tokenizer())
            for column in columns[1:]:
                assert llm.reset_prefix_cache()
                c0 = cpu_seconds()
                t, outputs = timed_generate(llm, prompts, params)
                cpu[kind][column].append(cpu_seconds() - c0)
                times[column].append(t)
            tokens[kind] = [o.outputs[0].token_ids for o in outputs]
            llm.shutdown()
            print(f"round {r}: {kind} " + ", ".join(
                f"{c} {times[c][-1]:.2f} s" for c in columns), file=sys.stderr)
    base, proc = runs["in-process"], runs["engine process"]
    ratios = {c: paired_ratios(base[c], proc[c]) for c in columns}
    result: dict[str, Any] = {
        "bench": "short",
        "requests": len(prompts),
        "prompt_tokens": sum(map(len, prompts)),
        "output_tokens": 32 * len(prompts),
        "rounds": args.repeat,
        **{f"{c}_s": round(median(base[c]), 3) for c in columns},
        **{f"engine_process_{c}_s": round(median(proc[c]), 3) for c in columns},
        **{f"process_overhead_{c}": round(median(ratios[c]) - 1, 4) for c in columns},
        "pair_ratios": {c: [round(x, 4) for x in ratios[c]] for c in columns},
        "runs_s": {kind: {c: [round(t, 3) for t in ts] for c, ts in times.items()}
                   for kind, times in runs.items()},
        "cpu_s": {kind: {c: round(median(ts), 3) for c, ts in cs.items()}
                  for kind, cs in cpu.items()},
        "process_same_tokens": tokens["engine process"] == tokens["in-process"],
        **environment(),
    }
    print_table(["", *(f"{c} s" for c in columns), "cold cpu s", "warm cpu s"],
                [[kind, *(median(times[c]) for c in columns),
                  *(median(cpu[kind][c]) for c in columns[1:])] for kind, times in runs.items()]
                + [["overhead (median of pairs)",
                    *(f"{median(ratios[c]) - 1:+.1%}" for c in columns), "", ""]])

    def plot(fig: Any) -> None:
        for i, c in enumerate(("cold", "warm")):
            bar(fig.add_subplot(1, 2, i + 1), list(runs), [median(t[c]) for t in runs.values()],
                "seconds (median)", f"{len(prompts)} shared-prompt chats, {c} run")

    write_outputs(args.out, "short", result, plot)
    print(json.dumps(result))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-seqs", type=int, default=64)
    parser.add_argument("--input-len", type=int, nargs=2, default=[50, 500], metavar=("MIN", "MAX"))
    parser.add_argument("--output-len", type=int, nargs=2, default=[50, 250],
                        metavar=("MIN", "MAX"))
    parser.add_argument("--hf-sort", action=argparse.BooleanOptionalAction, default=True,
                        help="batch HF requests by output length (less static-batching waste)")
    parser.add_argument("--engine-process", action="store_true",
                        help="also run the engine core in its own process (ZMQ), interleaved "
                             "with the in-process runs: process_overhead = median of the "
                             "paired process/in-process ratios - 1")
    parser.add_argument("--decode", action="store_true",
                        help="measure batched decode throughput instead")
    parser.add_argument("--decode-seqs", type=int, default=64)
    parser.add_argument("--decode-input-len", type=int, default=128)
    parser.add_argument("--decode-output-len", type=int, default=128)
    parser.add_argument("--kv-cache-dtype", default="auto",
                        help="the engine's kv_cache_dtype (auto: fp32 here; bf16, fp16)")
    add_common_args(parser)
    parser.add_argument("--short", action="store_true",
                        help="measure the engine process's cost on a short shared-prompt run "
                             "(fresh engines each round, in-process vs engine process)")
    args = parser.parse_args()
    setup_threads(args)
    if args.short:
        short(args)
        return
    loaded = load(args.model)
    engine_kwargs: dict[str, Any] = dict(max_num_seqs=args.max_num_seqs,
                                         kv_cache_dtype=args.kv_cache_dtype)
    if args.max_num_batched_tokens:
        engine_kwargs["max_num_batched_tokens"] = args.max_num_batched_tokens
    if args.decode:
        decode(args, loaded, engine_kwargs)
    else:
        throughput(args, loaded, engine_kwargs)


if __name__ == "__main__":
    main()
