"""v1's side of bench_sizes.py (its `V1Child`): one GGUF file loaded as a user's script loads
it, then the tests on request.

The load is what a user's script pays: `from v1 import LLM` first, then `LLM()` and one tiny
untimed request (as bench_llamacpp's `make_engine`, not imported before: its module imports
torch, which this process must not load before the engine starts, as a user's script does
not). bench_sizes.py times it from this process's start to the ready line. --threads reaches
the engine as OMP_NUM_THREADS (its torch reads it when it loads).

JSON lines on the stdout it was given: {"load_s"} once ready (the `LLM()` and the request
alone), then {"kernels", "threads", "max_model_len", "torch_before_ready"} (the engine's kernel
libraries, torch's threads, the LLM's max_model_len, whether this process had loaded torch
by then); {"seconds"} per test named on stdin ("tg": a 1-token prompt and
--decode-tokens greedy tokens; "pp": a --prefill-tokens prompt and 1 token); {"peak_rss_mb"}
(the engine process's VmHWM) at the end of input. All else that would reach that stdout goes
to stderr.

    python bench/sizes_child.py FILE.gguf [--threads N] [--ctx 4096] ...  # from bench_sizes
"""

import argparse
import json
import os
import sys
import time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("path")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--decode-tokens", type=int, default=128)
    parser.add_argument("--prefill-tokens", type=int, default=512)
    parser.add_argument("--ctx", type=int, default=4096, help="LLM's max_model_len")
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)

    def reply(message: dict) -> None:
        out.write(json.dumps(message) + "\n")
        out.flush()

    from v1 import LLM, SamplingParams  # isort: skip  (first: see the module docstring)

    if args.threads:
        os.environ["OMP_NUM_THREADS"] = str(args.threads)
    t0 = time.perf_counter()
    llm = LLM(model=args.path, max_model_len=args.ctx)  # llama-server -c's context
    llm.generate([{"prompt_token_ids": [1, 2, 3, 4]}],
                 SamplingParams(max_tokens=2, ignore_eos=True), use_tqdm=False)
    reply({"load_s": round(time.perf_counter() - t0, 2)})
    torch_before_ready = "torch" in sys.modules
    import torch
    from bench_llamacpp import engine_kernels, engine_run, random_prompt
    from bench_sizes import vocab_size
    from common import engine_core_pid, rss_mb

    reply({"kernels": engine_kernels(), "threads": torch.get_num_threads(),
           "max_model_len": llm.llm_engine.max_model_len,
           "torch_before_ready": torch_before_ready})
    vocab = vocab_size(args.path)  # after the load: gguf's reader takes seconds on the header
    prompts = {"tg": (random_prompt(1, vocab, args.seed), args.decode_tokens),
               "pp": (random_prompt(args.prefill_tokens, vocab, args.seed + 1), 1)}
    try:
        for line in sys.stdin:
            prompt, max_tokens = prompts[line.strip()]
            reply({"seconds": engine_run(llm, [prompt], max_tokens)[0]})
        pid = engine_core_pid(os.getpid())
        reply({"peak_rss_mb": rss_mb(pid, "VmHWM") if pid else None})
    finally:
        llm.shutdown()


if __name__ == "__main__":
    main()
