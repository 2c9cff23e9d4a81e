"""Numerics modes against fp32: accuracy, decode speed and memory.

Modes (`--modes`): fp32, gguf (the GGUF file's Q4_1/Q8_0 blocks run as they are), int8
(Q8_0-style groups of 32 made at load), each optionally with a 16-bit KV cache ("+bf16",
"+fp16"). A mode whose options the engine refuses is reported as unavailable, with its reason.
Every mode runs in its own child process (this script with --child), so peak RSS is per mode.

Per mode:
- accuracy (one child per mode; see quant_eval.py): perplexity on bench/data/perplexity.txt
  (windows of --ppl-window tokens, prefilled in 32-token chunks so that attention reads the
  KV cache) and its ratio to fp32's (target <= 1.01); greedy agreement
  with fp32 over the first 32 tokens of 12 chat prompts, positionwise (the share of the 12 x 32
  positions whose token equals fp32's; stated, not gated) and before the first
  divergence (`prefix_agreement`);
- speed (--rounds children per mode, rounds interleaved: round r runs every mode once, in
  reversed order on odd rounds): decode tok/s at --decode-seqs concurrent and at batch 1, as
  bench_throughput.py --decode measures it (the requests' own timestamps, pure decode), on a
  KV pool sized for that workload; the ratio to fp32 is the median over rounds of the round's
  mode/fp32 ratio (paired: both saw the same phase of the machine);
- memory: weight_mb (the model's tensors, packed copies included: quant_eval.weight_bytes)
  and the speed children's peak RSS (median over rounds).

Targets printed beside the figures: decode at 64 >= 350 tok/s with quantized weights and a
16-bit KV cache; batch-1 decode >= 3x fp32's; perplexity <= +1%.
Prints a table, then one JSON line; `--out DIR` writes quant.json and quant.png.

    .venv/bin/python bench/bench_quant.py
    .venv/bin/python bench/bench_quant.py --modes fp32 fp32+bf16 --rounds 1
"""

import argparse
import json
import math
import random
import subprocess
import sys
from pathlib import Path
from typing import Any

import quant_eval
from bench_throughput import (
    decode_engine_kwargs,
    decode_window,
    paired_ratios,
    random_prompts,
    timed_generate,
)
from common import add_model_args, bar, environment, median, print_table, write_outputs
from quant_eval import Mode, ModeUnavailable

DECODE_TARGET_TOK_S = 350.0  # at 64 concurrent, quantized weights + 16-bit KV
BATCH1_TARGET_RATIO = 3.0


# ---- children: one mode each --------------------------------------------------------------


def child_accuracy(args: argparse.Namespace, mode: Mode) -> dict[str, Any]:
    import torch

    from v1.models.model_files import resolve_model

    llm = quant_eval.make_llm(mode, model=args.model, **quant_eval.ACCURACY_ENGINE_ARGS)
    tokenizer = llm.get_tokenizer()
    window = args.ppl_window or llm.llm_engine.client.engine_core.scheduler_config.max_model_len
    text = quant_eval.text_token_ids(tokenizer)
    ppl = quant_eval.perplexity(llm, text, window)
    tokens = quant_eval.greedy_tokens(llm, quant_eval.chat_prompt_ids(tokenizer))
    weights = quant_eval.weight_bytes(quant_eval.engine_model(llm))
    llm.shutdown()
    return {"ppl": ppl, "tokens": tokens, "weight_mb": weights / 1e6, "ppl_tokens": len(text),
            "ppl_window": window, "model": str(resolve_model(args.model)),
            "threads": torch.get_num_threads()}


def child_speed(args: argparse.Namespace, mode: Mode) -> dict[str, Any]:
    from v1.sampling_params import SamplingParams

    n, in_len, out_len = args.decode_seqs, args.decode_input_len, args.decode_output_len
    block = 16
    kwargs = decode_engine_kwargs({"max_num_seqs": n}, n, in_len)
    # A pool for this workload (not the default budget), so RSS shows the KV dtype's share.
    kwargs.update(block_size=block, max_model_len=in_len + out_len,
                  num_gpu_blocks=n * math.ceil((in_len + out_len) / block) + 8)
    llm = quant_eval.make_llm(mode, model=args.model, **kwargs)
    vocab = len(llm.get_tokenizer())
    prompts = random_prompts(random.Random(args.seed), n, (in_len, in_len), vocab)
    params = SamplingParams(temperature=0.0, max_tokens=out_len, ignore_eos=True)
    timed_generate(llm, [prompts[0][:32]], SamplingParams(max_tokens=2, ignore_eos=True))
    rates = {}
    for name, batch in (("decode_tok_s", prompts), ("batch1_tok_s", prompts[:1])):
        _, outputs = timed_generate(llm, batch, params)
        window = decode_window(outputs)
        if window is None:
            raise RuntimeError(f"{mode.name}: the {len(batch)} prefills took several steps")
        rates[name] = window[1] / window[0]
    llm.shutdown()
    return {**rates, "peak_rss_mb": quant_eval.peak_rss_bytes() / 1e6}


def run_child(args: argparse.Namespace, task: str, mode: str) -> dict[str, Any]:
    """Runs this script as a child for one (task, mode); its last stdout line is the JSON."""
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", task, "--modes", mode,
           "--seed", str(args.seed), "--decode-seqs", str(args.decode_seqs),
           "--decode-input-len", str(args.decode_input_len),
           "--decode-output-len", str(args.decode_output_len),
           "--ppl-window", str(args.ppl_window), "--threads", str(args.threads)]
    if args.model:
        cmd += ["--model", args.model]
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{task} child for {mode} failed (exit {proc.returncode})")
    return json.loads(proc.stdout.strip().splitlines()[-1])


# ---- the parent ---------------------------------------------------------------------------


def paired_median_ratio(values: list[float], base: list[float]) -> float:
    """The median of the rounds' mode/fp32 ratios."""
    return median(paired_ratios(base, values))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--modes", nargs="+", default=list(quant_eval.DEFAULT_MODES),
                        help="fp32|gguf|int8, optionally +bf16|+fp16 (fp32 always runs)")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved speed rounds")
    parser.add_argument("--decode-seqs", type=int, default=64)
    parser.add_argument("--decode-input-len", type=int, default=64)
    parser.add_argument("--decode-output-len", type=int, default=64)
    parser.add_argument("--ppl-window", type=int, default=0,
                        help="perplexity window in tokens (0: the model's max length)")
    parser.add_argument("--child", choices=("accuracy", "speed"), help=argparse.SUPPRESS)
    parser.add_argument("--out", default=None, help="directory for quant.json and quant.png")
    add_model_args(parser)
    args = parser.parse_args()
    modes = [Mode.parse(m) for m in args.modes]
    if args.child:
        if args.threads:
            import torch

            torch.set_num_threads(args.threads)
        work = child_accuracy if args.child == "accuracy" else child_speed
        try:
            result = work(args, modes[0])
        except ModeUnavailable as e:
            result = {"unavailable": str(e)}
        print(json.dumps(result))
        return
    if args.rounds < 1:
        raise ValueError(f"--rounds must be >= 1, got {args.rounds}")
    fp32 = Mode()
    modes = [fp32] + [m for m in dict.fromkeys(modes) if m != fp32]

    accuracy: dict[Mode, dict[str, Any]] = {}
    for m in modes:
        accuracy[m] = run_child(args, "accuracy", m.name)
        print(f"{m.name}: accuracy "
              f"{accuracy[m].get('unavailable') or round(accuracy[m]['ppl'], 3)}",
              file=sys.stderr)
    if "unavailable" in accuracy[fp32]:
        raise RuntimeError(f"fp32 is unavailable: {accuracy[fp32]['unavailable']}")
    available = [m for m in modes if "unavailable" not in accuracy[m]]

    speed: dict[Mode, list[dict[str, Any]]] = {m: [] for m in available}
    for r in range(args.rounds):
        for m in available if r % 2 == 0 else available[::-1]:
            speed[m].append(run_child(args, "speed", m.name))
            if "unavailable" in speed[m][-1]:  # its accuracy child was not refused
                raise RuntimeError(f"speed run refused: {speed[m][-1]['unavailable']}")
            print(f"round {r}: {m.name} decode {speed[m][-1]['decode_tok_s']:.1f} tok/s, "
                  f"batch 1 {speed[m][-1]['batch1_tok_s']:.1f} tok/s", file=sys.stderr)

    base_ppl, base_tokens = accuracy[fp32]["ppl"], accuracy[fp32]["tokens"]
    base_runs = {k: [s[k] for s in speed[fp32]] for k in ("decode_tok_s", "batch1_tok_s")}
    results: dict[str, dict[str, Any]] = {}
    failures: list[str] = []
    for m in modes:
        acc = accuracy[m]
        if "unavailable" in acc:
            results[m.name] = {"unavailable": acc["unavailable"]}
            continue
        runs = {k: [s[k] for s in speed[m]] for k in base_runs}
        ppl_ratio = acc["ppl"] / base_ppl
        agree = quant_eval.agreement(acc["tokens"], base_tokens)
        failures += quant_eval.gate_failures(m, ppl_ratio)
        results[m.name] = {
            "ppl": round(acc["ppl"], 4),
            "ppl_ratio": round(ppl_ratio, 4),
            "agreement": round(agree, 4),
            "prefix_agreement": round(quant_eval.prefix_agreement(acc["tokens"], base_tokens),
                                      4),
            "decode_tok_s": round(median(runs["decode_tok_s"]), 1),
            "decode_ratio": round(paired_median_ratio(runs["decode_tok_s"],
                                                      base_runs["decode_tok_s"]), 3),
            "batch1_tok_s": round(median(runs["batch1_tok_s"]), 1),
            "batch1_ratio": round(paired_median_ratio(runs["batch1_tok_s"],
                                                      base_runs["batch1_tok_s"]), 3),
            "weight_mb": round(acc["weight_mb"], 1),
            "peak_rss_mb": round(median([s["peak_rss_mb"] for s in speed[m]]), 1),
            "decode_runs_tok_s": [round(x, 1) for x in runs["decode_tok_s"]],
            "batch1_runs_tok_s": [round(x, 1) for x in runs["batch1_tok_s"]],
        }

    measured = {k: v for k, v in results.items() if "unavailable" not in v}
    # The decode target's modes: quantized weights and a 16-bit KV cache.
    fast = [m.name for m in available if m.quantization and m.kv_cache_dtype]
    quantized = [m.name for m in available if m.quantization]
    result: dict[str, Any] = {
        "bench": "quant",
        "model": accuracy[fp32]["model"],
        "ppl_tokens": accuracy[fp32]["ppl_tokens"],
        "ppl_window": accuracy[fp32]["ppl_window"],
        "decode_concurrent": args.decode_seqs,
        "decode_context": [args.decode_input_len, args.decode_input_len + args.decode_output_len],
        "rounds": args.rounds,
        "modes": results,
        "targets": {
            "ppl_ratio_max": quant_eval.MAX_PPL_RATIO,
            "decode_tok_s_min (quantized + 16-bit KV)": DECODE_TARGET_TOK_S,
            "batch1_ratio_min (quantized)": BATCH1_TARGET_RATIO,
        },
        "decode_target_met": any(measured[k]["decode_tok_s"] >= DECODE_TARGET_TOK_S
                                 for k in fast) if fast else None,
        "batch1_target_met": any(measured[k]["batch1_ratio"] >= BATCH1_TARGET_RATIO
                                 for k in quantized) if quantized else None,
        "accuracy_failures": failures,
        **environment(),
    }
    header = ["mode", "ppl", "ppl/fp32", "agree", "prefix agree", f"decode@{args.decode_seqs}",
              "x fp32", "batch 1", "x fp32", "weights MB", "peak RSS MB"]
    rows = [[k, v["ppl"], v["ppl_ratio"], v["agreement"], v["prefix_agreement"],
             v["decode_tok_s"], v["decode_ratio"], v["batch1_tok_s"], v["batch1_ratio"],
             v["weight_mb"], v["peak_rss_mb"]] for k, v in measured.items()]
    print_table(header, rows)
    for k, v in results.items():
        if "unavailable" in v:
            print(f"{k}: unavailable ({v['unavailable']})")
    print(f"targets: ppl/fp32 <= {quant_eval.MAX_PPL_RATIO}; "
          f"decode@64 >= {DECODE_TARGET_TOK_S:.0f} tok/s with "
          f"quantized weights + 16-bit KV (met: {result['decode_target_met']}); batch 1 >= "
          f"{BATCH1_TARGET_RATIO:.0f}x fp32 with quantized weights "
          f"(met: {result['batch1_target_met']})")
    if failures:
        print("accuracy gates missed: " + "; ".join(failures))

    def plot(fig: Any) -> None:
        panels = [("decode_tok_s", "tok/s (median)", f"decode, {args.decode_seqs} concurrent"),
                  ("batch1_tok_s", "tok/s (median)", "decode, batch 1"),
                  ("ppl_ratio", "perplexity / fp32's", "accuracy")]
        for i, (key, ylabel, title) in enumerate(panels, 1):
            ax = fig.add_subplot(1, 3, i)
            bar(ax, list(measured), [v[key] for v in measured.values()], ylabel, title)
            ax.tick_params(axis="x", labelrotation=45)

    write_outputs(args.out, "quant", result, plot)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
