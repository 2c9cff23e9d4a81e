"""One start of v1 as a user's script makes it: `from v1 import LLM`, `LLM(model=...)` and a
first answer (4 prompt tokens, 2 generated) in this fresh process, each timed, with what
Python's cyclic collector took in this process meanwhile (its runs, timed by `gc.callbacks`;
the engine process's own are not seen here). Prints one JSON line.

The `v1` imported is whichever PYTHONPATH names first (no path of this folder is added), so
bench_trees.py can pair two checkouts' starts with this one script (an absolute path; each
tree's kernels built in place):

    git worktree add /tmp/old REV && cp v1/kernels/*.so /tmp/old/v1/kernels/
    .venv/bin/python bench/bench_trees.py --a /tmp/old --b . --rounds 9 -- \\
        $PWD/bench/bench_start.py --model $FILE  # a GGUF file (bench_sizes.py's 1B: --work-dir)
"""

import argparse
import gc
import json
import time

START = time.perf_counter()  # before v1's imports (Python's own start and these not counted)

COLLECTOR = {"runs": 0, "full_runs": 0, "s": 0.0}
_began: list[float] = []


def _timed(phase: str, info: dict[str, int]) -> None:
    if phase == "start":
        _began.append(time.perf_counter())
        return
    COLLECTOR["s"] += time.perf_counter() - _began.pop()
    COLLECTOR["runs"] += 1
    COLLECTOR["full_runs"] += info["generation"] == 2


def main() -> None:
    gc.callbacks.append(_timed)
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="a model path (default: v1's)")
    parser.add_argument("--max-model-len", type=int, default=None,
                        help="LLM's max_model_len (default: the model's context)")
    args = parser.parse_args()

    from v1 import LLM, SamplingParams

    imported = time.perf_counter()
    llm = LLM(model=args.model, max_model_len=args.max_model_len)
    built = time.perf_counter()
    llm.generate([{"prompt_token_ids": [1, 2, 3, 4]}],
                 SamplingParams(max_tokens=2, ignore_eos=True), use_tqdm=False)
    answered = time.perf_counter()
    llm.shutdown()
    print(json.dumps({
        "import_s": round(imported - START, 3), "llm_s": round(built - imported, 3),
        "first_answer_s": round(answered - built, 3), "start_s": round(answered - START, 3),
        "collector_s": round(COLLECTOR["s"], 3), "collector_full_runs": COLLECTOR["full_runs"],
    }))


if __name__ == "__main__":
    main()
