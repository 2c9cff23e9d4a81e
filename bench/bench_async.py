"""What async scheduling gains: the same greedy workload through a synchronous and an
async-scheduling engine, side by side in one process, on the same loaded weights.

With async scheduling the engine schedules step N+1 while the model runs step N on the
runner's thread, so the scheduler's work and the output handling overlap the model instead
of adding to it; the synchronous engine's time outside the model bounds the gain. Runs
alternate between the two engines (sync, async, sync, ...) so that drift in the machine's
load hits both alike.

    .venv/bin/python bench/bench_async.py [--num-requests 32] [--output-len 64]

Prints a table, then one JSON line with the median output tokens/s of each mode.
"""

import argparse
import json
import random
import statistics
import time

import torch

from v1.engine.core import resolve_device_and_dtype
from v1.entrypoints.llm import LLM
from v1.models.loader import load_model
from v1.sampling_params import SamplingParams
from v1.worker.model_runner import attention_impl_for


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="GGUF file or HF directory")
    parser.add_argument("--num-requests", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--repeat", type=int, default=3, help="runs per mode (median)")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=0,
                        help="torch intra-op threads (0: torch's default, one per core)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    device, dtype = resolve_device_and_dtype(args.device, "auto")
    loaded = load_model(args.model, dtype, device, attention_impl_for(device))
    rng = random.Random(args.seed)
    vocab = int(loaded.hf_config.vocab_size)
    # Random token prompts: no two share a prefix, so prefix caching plays no part.
    prompts = [
        {"prompt_token_ids": [rng.randrange(1000, vocab) for _ in range(args.prompt_len)]}
        for _ in range(args.num_requests)
    ]
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    blocks = args.num_requests * -(-(args.prompt_len + args.output_len) // 16) + 16
    engines = {
        mode: LLM(
            args.model, loaded_model=loaded, device=args.device, num_gpu_blocks=blocks,
            max_model_len=args.prompt_len + args.output_len, async_scheduling=mode == "async",
        )
        for mode in ("sync", "async")
    }
    model_time = time_model(engines["sync"])
    for llm in engines.values():  # warm up: first-call allocations, lazy inits
        llm.generate(prompts[:4], SamplingParams(max_tokens=4), use_tqdm=False)

    times: dict[str, list[float]] = {mode: [] for mode in engines}
    tokens: dict[str, list[list[int]]] = {}
    model_time[0] = 0.0
    for _ in range(args.repeat):
        for mode, llm in engines.items():
            start = time.perf_counter()
            outputs = llm.generate(prompts, params, use_tqdm=False)
            times[mode].append(time.perf_counter() - start)
            tokens[mode] = [o.outputs[0].token_ids for o in outputs]
    # The synchronous engine's time outside the model: what async scheduling could hide.
    hideable = 1 - model_time[0] / sum(times["sync"])
    for llm in engines.values():
        llm.shutdown()

    num_tokens = args.num_requests * args.output_len
    rate = {mode: num_tokens / statistics.median(t) for mode, t in times.items()}
    print(f"{args.num_requests} requests x {args.output_len} tokens (prompts of "
          f"{args.prompt_len}), {device.type}, {torch.get_num_threads()} threads, "
          f"median of {args.repeat}")
    print(f"{'mode':<8}{'median s':>10}{'min s':>8}{'max s':>8}{'output tok/s':>14}")
    for mode, t in times.items():
        print(f"{mode:<8}{statistics.median(t):>10.2f}{min(t):>8.2f}{max(t):>8.2f}"
              f"{rate[mode]:>14.1f}")
    speedup = rate["async"] / rate["sync"]
    identical = tokens["sync"] == tokens["async"]
    print(f"async / sync: {speedup:.3f}; outputs identical: {identical}; sync time outside "
          f"the model (the most async scheduling can hide): {hideable:.1%}")
    print(json.dumps({
        "num_requests": args.num_requests, "prompt_len": args.prompt_len,
        "output_len": args.output_len, "device": device.type,
        "threads": torch.get_num_threads(),
        "sync_tok_s": round(rate["sync"], 1), "async_tok_s": round(rate["async"], 1),
        "speedup": round(speedup, 3), "identical": identical,
        "sync_time_outside_model": round(hideable, 4),
    }))


def time_model(llm: LLM) -> list[float]:
    """Adds up the time the in-process engine of `llm` spends in the model runner."""
    runner = llm.llm_engine.client.engine_core.model_runner
    execute_model, spent = runner.execute_model, [0.0]

    def timed(scheduler_output):
        start = time.perf_counter()
        try:
            return execute_model(scheduler_output)
        finally:
            spent[0] += time.perf_counter() - start

    runner.execute_model = timed
    return spent


if __name__ == "__main__":
    main()
