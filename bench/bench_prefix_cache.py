"""Shared-system-prompt workload: the engine with and without prefix caching, against HF.

The workload (fixed seed): `--groups` system prompts of about `--system-len` tokens, each
followed by `--prompts-per-group` user questions of `--question-len` tokens (a range), as chat
conversations through the model's chat template (or plain text with `--plain`). The text is
real words: drawn from the tokenizer's vocabulary (whole-word tokens, the most frequent first
ones), cut into sentences. Every request generates exactly `--output-len` tokens (greedy,
ignore_eos on the engine, min_new_tokens on HF).

Three runs over the same token ids:
- engine, prefix caching on (the cache is reset before each run);
- engine, prefix caching off;
- HF transformers `generate`, fp32, left-padded batches of `--hf-batch-size` (the baseline).

`--modes` adds the engine in other numerics (quantized weights, 16-bit KV cache: see
quant_eval.py), prefix caching on, each run in every round right after the fp32 one (its
engine built before its run and shut down after it, so one extra KV pool at a time); per
mode: engine_s, speedup_vs_hf, time_vs_fp32 (median of the rounds' mode/fp32 times) and its
greedy agreement with fp32's tokens; a mode the engine refuses is reported unavailable.

`--llamacpp`: the same token ids through llama-cpp-python on the same GGUF file (as
`make bench-llamacpp` builds it, in its own process with a clean environment: bench/llamacpp.py),
one request after another, each reusing the KV of the previous prompt's longest common prefix
(its `generate` does so; its fastest mode for this workload), greedy, exactly --output-len
tokens each: llamacpp_s and speedup_vs_llamacpp (llamacpp_s / engine_s) for fp32 and every
mode. Without that build it says so and goes on (exit 0); it is outside `make setup`.

Prints a table, then one JSON line with engine_s, engine_no_cache_s, hf_s, speedup_vs_hf,
cache_speedup, hit_rate (the engine's prefix-cache hit rate in tokens, cached run),
ideal_hit_rate (shared full blocks over all prompt tokens, given the submission order),
out_tok_s, modes and more. `--out DIR` also writes prefix_cache.json and prefix_cache.png.

    .venv/bin/python bench/bench_prefix_cache.py                # the full comparison
    .venv/bin/python bench/bench_prefix_cache.py --no-hf --repeat 1   # engine only, quick
    .venv/bin/python bench/bench_prefix_cache.py --modes fp32 --llamacpp --no-cache-run
"""

import argparse
import json
import random
import sys
import time
from typing import Any

import llamacpp
import quant_eval
from common import (
    add_common_args,
    agreement,
    bar,
    environment,
    hf_generate,
    load,
    load_hf,
    make_llm,
    median,
    print_table,
    setup_threads,
    write_outputs,
)
from quant_eval import Mode, ModeUnavailable


def word_list(tokenizer: Any, size: int = 6000) -> list[str]:
    """Whole lower-case words of the vocabulary, most frequent (lowest id) first."""
    vocab = tokenizer.get_vocab()
    words = sorted(
        (i, tok[1:]) for tok, i in vocab.items()
        if tok.startswith("\u0120") and tok[1:].isalpha() and tok[1:].islower()
        and 3 <= len(tok) - 1 <= 12
    )
    return [w for _, w in words[:size]]


def sentences(rng: random.Random, words: list[str], num_tokens: int, tokenizer: Any) -> str:
    """Text of about `num_tokens` tokens: sentences of 6-16 words."""
    parts: list[str] = []
    count = 0
    while count < num_tokens:
        n = rng.randint(6, 16)
        sentence = " ".join(rng.choice(words) for _ in range(n))
        parts.append(sentence[0].upper() + sentence[1:] + ".")
        count = len(tokenizer.encode(" ".join(parts), add_special_tokens=False))
    text = " ".join(parts)
    ids = tokenizer.encode(text, add_special_tokens=False)[:num_tokens]
    return tokenizer.decode(ids)


def question(rng: random.Random, words: list[str], num_tokens: int, tokenizer: Any) -> str:
    text = sentences(rng, words, max(1, num_tokens - 1), tokenizer).rstrip(".")
    return text + "?"


def add_workload_args(
    parser: argparse.ArgumentParser, groups: int, output_len: int, interleave: bool
) -> None:
    """The options of `make_workload` (and the output length), with these defaults."""
    parser.add_argument("--groups", type=int, default=groups, help="distinct system prompts")
    parser.add_argument("--system-len", type=int, default=1000,
                        help="system prompt length in tokens (about)")
    parser.add_argument("--question-len", type=int, nargs=2, default=[10, 60],
                        metavar=("MIN", "MAX"), help="question length range in tokens")
    parser.add_argument("--output-len", type=int, default=output_len,
                        help="generated tokens per request")
    parser.add_argument("--plain", action="store_true",
                        help="plain text prompts instead of the chat template")
    parser.add_argument("--interleave", action=argparse.BooleanOptionalAction,
                        default=interleave,
                        help="submit the groups round robin (else one after another)")


def make_workload(args: argparse.Namespace, tokenizer: Any) -> list[list[int]]:
    rng = random.Random(args.seed)
    words = word_list(tokenizer)
    groups = []
    for g in range(args.groups):
        system = f"You are assistant number {g}. " + sentences(
            rng, words, args.system_len, tokenizer
        )
        prompts = []
        for _ in range(args.prompts_per_group):
            q = question(rng, words, rng.randint(*args.question_len), tokenizer)
            if args.plain:
                text = f"{system}\n\nQuestion: {q}\nAnswer:"
            else:
                text = tokenizer.apply_chat_template(
                    [{"role": "system", "content": system}, {"role": "user", "content": q}],
                    add_generation_prompt=True, tokenize=False,
                )
            # The template holds the special tokens: no BOS again (as LLM.chat does).
            prompts.append(tokenizer.encode(text, add_special_tokens=args.plain))
        groups.append(prompts)
    if args.interleave:  # round robin over the groups
        return [p for row in zip(*groups) for p in row]
    return [p for group in groups for p in group]


def ideal_hit_tokens(prompts: list[list[int]], block_size: int) -> list[int]:
    """Per prompt, the most tokens a prefix cache of `block_size` blocks can serve, given every
    earlier prompt was cached: its longest prefix of full blocks that an earlier prompt shares,
    capped below its last token (which must be computed)."""
    seen: set[int] = set()
    hits = []
    for p in prompts:
        max_blocks = (len(p) - 1) // block_size
        parent, hit, found = 0, 0, True
        for b in range(len(p) // block_size):
            parent = hash((parent, tuple(p[b * block_size : (b + 1) * block_size])))
            if found and b < max_blocks and parent in seen:
                hit = (b + 1) * block_size
            else:
                found = False
            seen.add(parent)
        hits.append(hit)
    return hits


def run_engine(llm: Any, prompts: list[list[int]], params: Any) -> tuple[float, list, Any]:
    assert llm.reset_prefix_cache(), "the prefix cache could not be reset (blocks in use)"
    t0 = time.perf_counter()
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    elapsed = time.perf_counter() - t0
    return elapsed, outputs, llm.get_stats()


def run_mode(mode: Mode, args: argparse.Namespace, loaded: Any, engine_kwargs: dict[str, Any],
             prompts: list[list[int]], params: Any) -> tuple[float, list, Any]:
    """One cached run of the engine in `mode`, built (and warmed up) for it and shut down
    after it: one extra KV pool at a time. Raises ModeUnavailable if the engine refuses it."""
    from v1.sampling_params import SamplingParams

    # fp32 weights: the ones already loaded; quantized ones: loaded for this engine.
    llm = quant_eval.make_llm(mode, model=args.model,
                              loaded=None if mode.quantization else loaded,
                              enable_prefix_caching=True, **engine_kwargs)
    try:
        llm.generate([{"prompt_token_ids": prompts[0][:64]}],
                     SamplingParams(max_tokens=2, ignore_eos=True), use_tqdm=False)
        return run_engine(llm, prompts, params)
    finally:
        llm.shutdown()


def run_llamacpp(args: argparse.Namespace, prompts: list[list[int]]) -> tuple[float, list]:
    """llama.cpp on the same GGUF (bench/llamacpp.py's worker: one request after another,
    greedy, exactly --output-len tokens each, reusing the previous prompt's common prefix)."""
    from v1.models.model_files import resolve_model

    path = resolve_model(args.model)
    if path.suffix != ".gguf":
        raise ValueError(f"--llamacpp needs a .gguf model, got {path}")
    n_ctx = max(len(p) for p in prompts) + args.output_len + 16
    with llamacpp.Worker(path, n_ctx, args.threads or None) as worker:
        return worker.run(prompts, args.output_len)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_workload_args(parser, groups=1, output_len=48, interleave=False)
    parser.add_argument("--prompts-per-group", type=int, default=64)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--no-cache-run", dest="no_cache_run", action="store_false",
                        help="skip the engine run without prefix caching")
    parser.add_argument("--modes", nargs="+", default=list(quant_eval.DEFAULT_MODES),
                        help="numerics modes to run besides fp32: fp32|gguf|int8, optionally "
                             "+bf16|+fp16 (the KV cache)")
    parser.add_argument("--llamacpp", action="store_true",
                        help="also run llama-cpp-python on the same GGUF "
                             "(when built: make bench-llamacpp)")
    add_common_args(parser)
    args = parser.parse_args()
    setup_threads(args)
    extra_modes = [m for m in dict.fromkeys(map(Mode.parse, args.modes)) if m != Mode()]

    from v1.sampling_params import SamplingParams

    # Float weights: the modes (--modes gguf ...) are measured against fp32's.
    loaded = load(args.model, "none")
    tokenizer = loaded.tokenizer
    prompts = make_workload(args, tokenizer)
    num_prompt_tokens = sum(len(p) for p in prompts)
    ideal = ideal_hit_tokens(prompts, args.block_size)
    ideal_hit_rate = sum(ideal) / num_prompt_tokens
    out_lens = [args.output_len] * len(prompts)
    num_out = sum(out_lens)
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    print(f"{len(prompts)} requests, {num_prompt_tokens} prompt tokens "
          f"(mean {num_prompt_tokens / len(prompts):.0f}), {num_out} output tokens, "
          f"ideal hit rate {ideal_hit_rate:.3f}", file=sys.stderr)

    engine_kwargs: dict[str, Any] = dict(block_size=args.block_size,
                                         max_num_seqs=args.max_num_seqs)
    if args.max_num_batched_tokens:
        engine_kwargs["max_num_batched_tokens"] = args.max_num_batched_tokens
    cached_llm = make_llm(loaded, enable_prefix_caching=True, **engine_kwargs)
    plain_llm = (make_llm(loaded, enable_prefix_caching=False, **engine_kwargs)
                 if args.no_cache_run else None)
    # Warm-up (allocator, first-call paths), untimed.
    cached_llm.generate([{"prompt_token_ids": prompts[0][:64]}],
                        SamplingParams(max_tokens=2, ignore_eos=True), use_tqdm=False)

    times: dict[str, list[float]] = {"cache": [], "no_cache": []}
    stats = None
    engine_out = None
    unavailable: dict[Mode, str] = {}
    mode_runs: dict[Mode, list[tuple[float, list, Any]]] = {m: [] for m in extra_modes}
    for r in range(args.repeat):
        t, engine_out, stats = run_engine(cached_llm, prompts, params)
        times["cache"].append(t)
        print(f"run {r}: engine (cache) {t:.2f} s", file=sys.stderr)
        for m in extra_modes:  # each right after fp32's: the pair saw the same machine
            if m in unavailable:
                continue
            try:
                mode_runs[m].append(run_mode(m, args, loaded, engine_kwargs, prompts, params))
            except ModeUnavailable as e:
                unavailable[m] = str(e)
                print(f"{m.name}: unavailable ({e})", file=sys.stderr)
                continue
            print(f"run {r}: engine {m.name} (cache) {mode_runs[m][-1][0]:.2f} s",
                  file=sys.stderr)
        if plain_llm is not None:
            t, _, _ = run_engine(plain_llm, prompts, params)
            times["no_cache"].append(t)
            print(f"run {r}: engine (no cache) {t:.2f} s", file=sys.stderr)
    assert engine_out is not None and stats is not None
    engine_tokens = [o.outputs[0].token_ids for o in engine_out]
    assert all(len(t) == args.output_len for t in engine_tokens)
    cached_llm.shutdown()
    if plain_llm is not None:
        plain_llm.shutdown()

    llama_run: tuple[float, list] | None = None
    if args.llamacpp:
        if reason := llamacpp.missing():
            print(f"--llamacpp skipped: {reason}", file=sys.stderr)
        else:
            llama_run = run_llamacpp(args, prompts)
            print(f"llama.cpp {llama_run[0]:.2f} s", file=sys.stderr)

    hf_times: list[float] = []
    hf_tokens = None
    if not args.no_hf:
        hf = load_hf(loaded)
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        for r in range(args.hf_repeat):
            t, hf_tokens = hf_generate(
                hf, prompts, out_lens, args.hf_batch_size, pad,
                lambda done, total: print(f"  hf {done}/{total}", file=sys.stderr),
            )
            hf_times.append(t)
            print(f"run {r}: hf {t:.2f} s", file=sys.stderr)
        del hf

    engine_s = median(times["cache"])
    no_cache_s = median(times["no_cache"]) if times["no_cache"] else None
    hf_s = median(hf_times) if hf_times else None
    result: dict[str, Any] = {
        "bench": "prefix_cache",
        "requests": len(prompts),
        "groups": args.groups,
        "system_len": args.system_len,
        "prompt_tokens": num_prompt_tokens,
        "output_tokens": num_out,
        "engine_s": round(engine_s, 3),
        "engine_no_cache_s": round(no_cache_s, 3) if no_cache_s else None,
        "hf_s": round(hf_s, 3) if hf_s else None,
        "speedup_vs_hf": round(hf_s / engine_s, 2) if hf_s else None,
        "cache_speedup": round(no_cache_s / engine_s, 2) if no_cache_s else None,
        "hit_rate": round(stats.prefix_cache_hit_rate, 4),
        "ideal_hit_rate": round(ideal_hit_rate, 4),
        "hit_rate_of_ideal": round(stats.prefix_cache_hit_rate / ideal_hit_rate, 4)
        if ideal_hit_rate else None,
        "out_tok_s": round(num_out / engine_s, 1),
        "total_tok_s": round((num_out + num_prompt_tokens) / engine_s, 1),
        "no_cache_out_tok_s": round(num_out / no_cache_s, 1) if no_cache_s else None,
        "hf_out_tok_s": round(num_out / hf_s, 1) if hf_s else None,
        "engine_runs_s": [round(t, 3) for t in times["cache"]],
        "engine_no_cache_runs_s": [round(t, 3) for t in times["no_cache"]],
        "hf_runs_s": [round(t, 3) for t in hf_times],
        **environment(),
    }
    if hf_tokens is not None:
        result["hf_agreement"] = {k: round(v, 4) for k, v in
                                  agreement(engine_tokens, hf_tokens).items()}
    llama_s = llama_run[0] if llama_run else None
    if args.llamacpp:
        result.update(
            llamacpp_s=round(llama_s, 3) if llama_s else None,
            speedup_vs_llamacpp=round(llama_s / engine_s, 2) if llama_s else None,
            llamacpp_agreement=round(quant_eval.agreement(llama_run[1], engine_tokens), 4)
            if llama_run else None,
            llamacpp_skipped=None if llama_run else llamacpp.missing(),
        )

    rows = [["engine, prefix cache", engine_s, num_out / engine_s,
             f"{stats.prefix_cache_hit_rate:.3f}"]]
    result["modes"] = {}
    for m in extra_modes:
        if m in unavailable:
            result["modes"][m.name] = {"unavailable": unavailable[m]}
            continue
        runs = mode_runs[m]
        mode_s = median([t for t, _, _ in runs])
        mode_tokens = [o.outputs[0].token_ids for o in runs[-1][1]]
        result["modes"][m.name] = {
            "engine_s": round(mode_s, 3),
            "speedup_vs_hf": round(hf_s / mode_s, 2) if hf_s else None,
            "speedup_vs_llamacpp": round(llama_s / mode_s, 2) if llama_s else None,
            # Its time over fp32's, median of the rounds' pairs (< 1: faster than fp32).
            "time_vs_fp32": round(median([t / f for (t, _, _), f in zip(runs, times["cache"])]),
                                  3),
            "agreement_vs_fp32": round(quant_eval.agreement(mode_tokens, engine_tokens), 4),
            "hit_rate": round(runs[-1][2].prefix_cache_hit_rate, 4),
            "runs_s": [round(t, 3) for t, _, _ in runs],
        }
        rows.append([f"engine {m.name}, prefix cache", mode_s, num_out / mode_s,
                     f"{runs[-1][2].prefix_cache_hit_rate:.3f}"])
    if no_cache_s:
        rows.append(["engine, no cache", no_cache_s, num_out / no_cache_s, "-"])
    if hf_s:
        rows.append([f"HF generate (batch {args.hf_batch_size})", hf_s, num_out / hf_s, "-"])
    if llama_s:
        rows.append(["llama.cpp (one by one, prefix KV kept)", llama_s, num_out / llama_s, "-"])
    print_table(["run", "seconds", "out tok/s", "hit rate"], rows)
    for name, v in result["modes"].items():
        print(f"{name}: " + (f"unavailable ({v['unavailable']})" if "unavailable" in v else
                             f"speedup vs HF {v['speedup_vs_hf']}, time vs fp32 "
                             f"{v['time_vs_fp32']}, agreement with fp32 {v['agreement_vs_fp32']}"))
    print(f"ideal hit rate {ideal_hit_rate:.3f}; speedup vs HF {result['speedup_vs_hf']}; "
          f"cache speedup {result['cache_speedup']}"
          + (f"; speedup vs llama.cpp {result['speedup_vs_llamacpp']}" if llama_s else ""))
    if args.llamacpp and not llama_s:
        print(f"--llamacpp: skipped ({llamacpp.missing()})")

    def plot(fig: Any) -> None:
        labels = [r[0].replace(", ", "\n") for r in rows]
        ax = fig.add_subplot(1, 2, 1)
        bar(ax, labels, [r[1] for r in rows], "seconds (median)",
            f"{len(prompts)} requests, shared ~{args.system_len}-token system prompts")
        if len(rows) > 4:  # the modes' bars: slanted labels, to stay readable
            ax.tick_params(axis="x", labelrotation=45)
        bar(fig.add_subplot(1, 2, 2), ["engine", "ideal"],
            [stats.prefix_cache_hit_rate, ideal_hit_rate], "prompt tokens served from cache",
            "prefix-cache hit rate")

    write_outputs(args.out, "prefix_cache", result, plot)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
