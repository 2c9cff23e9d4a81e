"""Speculative decoding on vs off: the same requests through two in-process engines on the same
weights, one with `speculative_config`, in paired, interleaved runs (the order alternates
each round); the figure is the median over rounds of t_off / t_on (> 1: speculation is
faster). Per workload and concurrency (that many requests submitted at once):

- random: prompts of random tokens, sampled at temperature 1 (seeded): drafts rarely match,
  so this measures what speculating costs (target: >= 0.95x);
- repetitive: paragraphs of bench/data/perplexity.txt the model is asked to copy, greedy:
  drafts from the prompt are mostly right (the gain), and the tokens must equal spec-off's.

Also each configuration's acceptance (accepted / draft tokens) from `LLM.get_stats()`.
Prints a table and one JSON line.

    .venv/bin/python bench/bench_spec.py
    .venv/bin/python bench/bench_spec.py --concurrency 1 8 --rounds 5 --k 5
"""

import argparse
import json
import random
import sys
from pathlib import Path
from typing import Any

import common  # before torch: it sets the OpenMP wait policy, read when torch loads
from bench_throughput import paired_ratios, random_prompts, timed_generate

from v1.sampling_params import SamplingParams

TEXT = Path(__file__).parent / "data" / "perplexity.txt"


def repetitive_prompts(tokenizer: Any, n: int) -> list[list[int]]:
    paragraphs = [p.strip() for p in TEXT.read_text().split("\n\n") if p.strip()]
    prompts = []
    for i in range(n):
        para = paragraphs[i % len(paragraphs)]
        words = para.split()
        # Vary the start so that requests do not share a whole prompt.
        head = " ".join(words[: 2 + i % 5])
        text = f"Text:\n{para}\n\nThe same text, copied word for word:\n{head}"
        prompts.append(tokenizer.encode(text))
    return prompts


def run(args: argparse.Namespace) -> dict[str, Any]:
    common.setup_threads(args)
    loaded = common.load(args.model)
    spec = {"method": "ngram", "num_speculative_tokens": args.k,
            "prompt_lookup_min": args.lookup_min, "prompt_lookup_max": args.lookup_max}
    engine = {"max_num_seqs": max(args.concurrency), "num_gpu_blocks": args.num_gpu_blocks,
              "max_model_len": 1024}
    llms = {"off": common.make_llm(loaded, **engine),
            "on": common.make_llm(loaded, speculative_config=spec, **engine)}
    for llm in llms.values():  # first steps fault in the KV cache and warm the kernels
        timed_generate(llm, [[300 + i for i in range(64)]] * 4,
                       SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    tokenizer = llms["off"].get_tokenizer()
    rng = random.Random(args.seed)
    vocab = int(loaded.hf_config.vocab_size)
    results = []
    for conc in args.concurrency:
        workloads = {
            "random": (
                random_prompts(rng, conc, (32, 96), vocab),
                [SamplingParams(temperature=1.0, seed=args.seed + i, max_tokens=args.max_tokens,
                                ignore_eos=True) for i in range(conc)],
            ),
            "repetitive": (
                repetitive_prompts(tokenizer, conc),
                SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True),
            ),
        }
        for name, (prompts, params) in workloads.items():
            times: dict[str, list[float]] = {"off": [], "on": []}
            tokens: dict[str, list] = {}
            before = llms["on"].get_stats()
            for r in range(args.rounds):
                order = ["off", "on"] if r % 2 == 0 else ["on", "off"]
                for mode in order:
                    seconds, outputs = timed_generate(llms[mode], prompts, params)
                    times[mode].append(seconds)
                    tokens[mode] = [o.outputs[0].token_ids for o in outputs]
            after = llms["on"].get_stats()
            drafts = after.spec_decode_num_draft_tokens - before.spec_decode_num_draft_tokens
            accepted = (after.spec_decode_num_accepted_tokens
                        - before.spec_decode_num_accepted_tokens)
            num_tokens = sum(map(len, tokens["off"]))
            row = {
                "workload": name, "concurrency": conc,
                "speedup": common.median(paired_ratios(times["on"], times["off"])),
                "off_tok_s": num_tokens / common.median(times["off"]),
                "on_tok_s": num_tokens / common.median(times["on"]),
                "acceptance": accepted / drafts if drafts else 0.0,
                "accepted_per_step": accepted / max(
                    after.spec_decode_num_drafts - before.spec_decode_num_drafts, 1),
                "greedy_equal": tokens["on"] == tokens["off"] if name == "repetitive" else None,
            }
            results.append(row)
            print(json.dumps(row), file=sys.stderr)
    for llm in llms.values():
        llm.shutdown()
    return {"spec": spec, "rounds": args.rounds, "max_tokens": args.max_tokens,
            "results": results, "env": common.environment()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    common.add_model_args(parser)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 64])
    parser.add_argument("--rounds", type=int, default=3, help="paired runs per configuration")
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    parser.add_argument("--lookup-min", type=int, default=2)
    parser.add_argument("--lookup-max", type=int, default=4)
    parser.add_argument("--num-gpu-blocks", type=int, default=1024)
    parser.add_argument("--out", default=None, help="directory for the JSON result")
    args = parser.parse_args()
    result = run(args)
    common.print_table(
        ["workload", "requests", "off tok/s", "on tok/s", "on/off", "acceptance",
         "accepted/draft step", "greedy equal"],
        [[r["workload"], r["concurrency"], r["off_tok_s"], r["on_tok_s"], r["speedup"],
          r["acceptance"], r["accepted_per_step"], r["greedy_equal"]]
         for r in result["results"]],
    )
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "spec.json").write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
