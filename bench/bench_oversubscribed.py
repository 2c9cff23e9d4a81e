"""Batch-1 decode on an oversubscribed machine: fp32 weights against a .gguf file's blocks (the
default), with --hogs busy processes beside the engine (more runnable threads than CPUs, as
on a loaded CI machine). Both use all cores' threads; the kernels' worker pool and OpenMP
each have to live with threads that lose their CPU mid-step.

Each round runs every mode once, alternating the order; a ratio is the median over rounds of
the round's gguf / fp32 tok/s. Prints a table and one JSON line.

    .venv/bin/python bench/bench_oversubscribed.py --hogs 4 --rounds 3
"""

import argparse
import json
import multiprocessing
import time

from common import environment, median, print_table

MODES = {"fp32": "none", "gguf": None}  # EngineArgs.quantization (None: the default)


def hog() -> None:
    while True:
        pass


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hogs", type=int, default=4, help="busy processes beside the engine")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=64, help="greedy tokens per run")
    args = parser.parse_args()

    from v1 import LLM, SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=args.tokens, ignore_eos=True)
    engines = {name: LLM(quantization=q, multiprocess=False) for name, q in MODES.items()}
    for llm in engines.values():
        llm.generate(["Hello"], params, use_tqdm=False)  # warm-up
    hogs = [multiprocessing.Process(target=hog, daemon=True) for _ in range(args.hogs)]
    for h in hogs:
        h.start()
    rates: dict[str, list[float]] = {name: [] for name in engines}
    try:
        for r in range(args.rounds):
            for name in list(engines)[:: 1 if r % 2 == 0 else -1]:
                engines[name].reset_prefix_cache()
                t = time.perf_counter()
                engines[name].generate(["Tell me a story about a cat."], params, use_tqdm=False)
                rates[name].append(args.tokens / (time.perf_counter() - t))
    finally:
        for h in hogs:
            h.kill()
        for llm in engines.values():
            llm.shutdown()
    ratio = median([g / f for g, f in zip(rates["gguf"], rates["fp32"])])
    print_table(["mode", "tok/s (median)", "runs"],
                [[n, median(v), " ".join(f"{x:.1f}" for x in v)] for n, v in rates.items()])
    print(f"gguf / fp32: {ratio:.2f} with {args.hogs} busy processes")
    print(json.dumps({"bench": "oversubscribed", "hogs": args.hogs, "tokens": args.tokens,
                      "tok_s": {n: round(median(v), 1) for n, v in rates.items()},
                      "gguf_vs_fp32": round(ratio, 3), **environment()}))


if __name__ == "__main__":
    main()
