"""v1's side of bench_sizes.py (its `V1Child`): one GGUF file loaded as a user's script loads
it, then the tests on request.

The load is what a user's script pays: v1 imported before anything else imports torch
(v1/startup_gc.py pauses the collector over that import: the bench's helpers, imported first,
would load torch with the collector on, a cost no user's script has), then `LLM()` and one
tiny untimed request (bench_llamacpp's `make_engine`). bench_sizes.py times it from this
process's start to the ready line; it includes the helpers' import after v1's (~0.04 s, torch
being in).

JSON lines on the stdout it was given: {"load_s", "kernels", "threads", "max_model_len"} once
ready (`make_engine` alone; the engine's kernel libraries, torch's threads here, the LLM's
max_model_len); {"seconds"} per test named on stdin ("tg": a 1-token prompt and
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

    from v1 import LLM  # noqa: F401  # isort: skip  (first: see the module docstring)
    import torch
    from bench_llamacpp import engine_kernels, engine_run, make_engine, random_prompt
    from bench_sizes import vocab_size
    from common import engine_core_pid, rss_mb

    if args.threads:
        torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    llm = make_engine(args.path, max_model_len=args.ctx)  # llama-server -c's context
    reply({"load_s": round(time.perf_counter() - t0, 2), "kernels": engine_kernels(),
           "threads": torch.get_num_threads(), "max_model_len": llm.llm_engine.max_model_len})
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
