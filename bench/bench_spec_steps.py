"""Where a drafted run's time goes: the help desk of bench_llamacpp.py (one user at a time, a
shared system prompt, questions of which some repeat) run in this process without drafts and
with them, every model runner step timed and kept by its rows.

Per step: its token rows (a decode's 1 + its drafts; a prompt chunk's tokens), the tokens it
produced, its wall time (`ModelRunner.execute_model`, which on the CPU is its work) and
whether every request in it was past its prompt (a decode step). The table gives, per row
count of the decode steps, their number, median time and tokens per step (`--rounds` runs
pooled); then per run (means over the rounds) its wall time and tokens per second, and two
figures of the drafted run:
- rows' cost: what its decode steps of more than one row took beyond the median 1-row step,
  the price of the rows verified;
- rows free: its decode steps without that cost, the most the drafts could gain with these
  acceptances (the ratio then).
A drafted run gains over the plain one where a step's tokens outweigh its rows' cost, so its
ratio is bounded by how cheap a step's extra rows are on this machine (its matmuls' cost per
row at a few rows) as much as by how many drafts are accepted.

Prints the table and one JSON line; `--out DIR` writes NAME.json and NAME.png (the
steps' median time by rows).

    .venv/bin/python bench/bench_spec_steps.py [--helpdesk-requests 12] [--rounds 1]
"""

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any, NamedTuple
from unittest import mock

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.bench_llamacpp import (  # noqa: E402
    HELPDESK,
    chat_prompt,
    engine_run,
    helpdesk_questions,
    make_engine,
)
from bench.common import bar, environment, print_table, write_outputs  # noqa: E402


class Step(NamedTuple):
    rows: int  # token rows (a decode: each request's token and its drafts)
    drafts: int
    tokens: int  # tokens it produced (sampled and kept)
    seconds: float
    decode: bool  # every request past its prompt (else a prompt chunk is in it)


def summarize(steps: list[Step], runs: int = 1) -> dict[str, Any]:
    """Per row count of the decode steps their count, median ms and tokens per step; and per
    run (`steps` of `runs` runs pooled) the decode and prompt steps' seconds, the rows' cost
    (each decode step of more than one row beyond the median 1-row step) and the rows-free
    decode time (module docstring), where some 1-row decode steps were timed."""
    decode = [s for s in steps if s.decode]
    by_rows: dict[int, list[Step]] = {}
    for s in decode:
        by_rows.setdefault(s.rows, []).append(s)
    rows = {n: {"steps": len(group),
                "median_ms": round(1e3 * statistics.median(s.seconds for s in group), 2),
                "tokens_per_step": round(sum(s.tokens for s in group) / len(group), 2)}
            for n, group in sorted(by_rows.items())}
    decode_s = sum(s.seconds for s in decode) / runs
    result: dict[str, Any] = {
        "decode_steps": round(len(decode) / runs, 1), "decode_s": round(decode_s, 3),
        "prompt_s": round(sum(s.seconds for s in steps if not s.decode) / runs, 3),
        "by_rows": rows,
    }
    if 1 in by_rows:
        one = statistics.median(s.seconds for s in by_rows[1])
        cost = sum(s.seconds - one for s in decode if s.rows > 1) / runs
        result["rows_cost_s"] = round(cost, 3)
        result["rows_free_decode_s"] = round(decode_s - cost, 3)
    return result


def timed_run(llm: Any, prompts: list[list[int]], tokens: int) -> tuple[float, list[Step]]:
    """The prompts one after another (bench_llamacpp's `engine_run`), every runner step
    timed."""
    from v1.worker.model_runner import ModelRunner

    steps: list[Step] = []
    real = ModelRunner.execute_model

    def execute(runner: ModelRunner, out: Any) -> Any:
        batch = runner.input_batch  # before the step: a request's tokens computed so far
        rows = [batch.req_id_to_index.get(r) for r in out.num_scheduled_tokens]
        decode = all(i is not None and batch.num_computed_tokens[i] >= batch.num_prompt_tokens[i]
                     for i in rows)
        t = time.perf_counter()
        result = real(runner, out)
        seconds = time.perf_counter() - t
        drafts = sum(map(len, (out.scheduled_spec_decode_tokens or {}).values()))
        steps.append(Step(out.total_num_scheduled_tokens, drafts,
                          sum(map(len, result.sampled_token_ids or [])), seconds, decode))
        return result

    with mock.patch.object(ModelRunner, "execute_model", execute):
        wall, _ = engine_run(llm, prompts, tokens)
    return wall, steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--helpdesk-requests", type=int, default=12)
    parser.add_argument("--repeat-fraction", type=float, default=0.35)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tokens", type=int, default=128, help="greedy tokens per request")
    parser.add_argument("--speculative-config", default='{"method": "suffix"}')
    parser.add_argument("--rounds", type=int, default=1, help="runs of each, interleaved")
    parser.add_argument("--out", default=None)
    parser.add_argument("--name", default="spec_steps")
    args = parser.parse_args()

    from v1.models.model_files import default_model_path

    data = json.loads(HELPDESK.read_text())
    questions = helpdesk_questions(data["questions"], args.helpdesk_requests,
                                   args.repeat_fraction, args.seed)
    spec = json.loads(args.speculative_config)
    contenders = {"plain": {}, "drafts": {"speculative_config": spec}}
    walls: dict[str, list[float]] = {name: [] for name in contenders}
    steps: dict[str, list[Step]] = {name: [] for name in contenders}
    env = environment()  # before the runs: the load they started under
    for r in range(args.rounds):
        for name in (contenders if r % 2 == 0 else reversed(contenders)):
            # In this process (no engine process): the runner's steps are timed here.
            llm = make_engine(default_model_path(), multiprocess=False, **contenders[name])
            try:
                prompts = [chat_prompt(llm.get_tokenizer(), q, data["system"])
                           for q in questions]
                wall, run_steps = timed_run(llm, prompts, args.tokens)
            finally:
                llm.shutdown()
                del llm  # its weights and KV cache go before the next engine's
            walls[name].append(wall)
            steps[name].extend(run_steps)
    tokens = len(questions) * args.tokens
    result: dict[str, Any] = {"bench": "spec_steps", "requests": len(questions),
                              "tokens": tokens, "speculative_config": spec, **env}
    for name in contenders:
        wall = statistics.fmean(walls[name])
        result[name] = {"wall_s": round(wall, 3), "tok_s": round(tokens / wall, 1),
                        **summarize(steps[name], args.rounds)}
    plain, drafts = result["plain"], result["drafts"]
    result["ratio"] = round(plain["wall_s"] / drafts["wall_s"], 3)
    if "rows_free_decode_s" in drafts:
        rows_free = drafts["wall_s"] - drafts["rows_cost_s"]
        result["ratio_rows_free"] = round(plain["wall_s"] / rows_free, 3)

    print_table(["rows", "steps", "median ms", "tokens/step"],
                [[n, v["steps"], v["median_ms"], v["tokens_per_step"]]
                 for n, v in drafts["by_rows"].items()])
    for name in contenders:
        r = result[name]
        print(f"{name}: {r['tok_s']} tok/s, {r['wall_s']} s (prompt steps {r['prompt_s']} s, "
              f"{r['decode_steps']} decode steps {r['decode_s']} s)")
    print(f"drafts / plain: {result['ratio']}x; with the drafts' rows free: "
          f"{result.get('ratio_rows_free')}x (their rows cost {drafts.get('rows_cost_s')} s)")
    print(json.dumps(result))

    def plot(fig: Any) -> None:
        by_rows = drafts["by_rows"]
        bar(fig.add_subplot(1, 1, 1), [str(n) for n in by_rows],
            [v["median_ms"] for v in by_rows.values()], "median ms",
            "a decode step's time by its rows (1 + drafts)")

    write_outputs(args.out, args.name, result, plot)


if __name__ == "__main__":
    main()
