"""What structured output costs batched decode: half the requests under a grammar, against none.

`--seqs` concurrent requests (32) of `--input-len` random tokens, each generating exactly
`--output-len` tokens, greedy, all prefilled in the first step (the workload of
`bench_throughput.py --decode`). Two configurations on the same prompts:
- plain: no request is structured;
- structured: every other request carries `structured_outputs`, a mix of kinds: a JSON
  schema (half of them: an array of objects with integer, string, boolean and enum fields),
  a regex (a quarter: words) and a choice (a quarter: four long sentences).

Every grammar has a lower bound on its length that `--output-len` tokens cannot reach (at
least `--output-len` array items, words, or words in each choice), so no structured request
can finish early: both configurations decode the same number of tokens over the same
contexts, and the only difference is the structured-output work (filling the bitmask in the
engine core, applying it to the logits, advancing the matchers). The script checks that
every request produced `--output-len` tokens; if one did not (another `--model`), the
comparison is by the mean decode step time instead, and the output says so.

Pairing, on a machine shared with other work: each configuration has its own in-process
engine (one copy of the weights), and a round runs both workloads at once, stepping the two
engines alternately (plain step, structured step, plain step, ...), so that both see the
same phase of the machine, step by step. A configuration's decode rate in a round is its
tokens after each request's first over the time of its steps after the prefill step:

    decode_tok_s = seqs * (output_len - 1) / sum(decode step seconds)

and the cost is the median over `--rounds` rounds (after a warm-up round, which also compiles
the grammars: they are cached then, so no timed step waits for a compilation) of the paired
ratios:

    slowdown = 1 - median_i(structured_tok_s[i] / plain_tok_s[i])     (target: <= 10%)

Then (unless `--no-profile`) one more round with timers around the structured-output calls
gives their milliseconds per decode step: the scheduler's bitmask fill
(`StructuredOutputManager.grammar_bitmask`), the runner's `apply_grammar_bitmask`, and the
matchers' `accept_tokens` (`Scheduler._advance_grammar`), beside the engine-core step.

Prints a table, then one JSON line. `--out DIR` writes structured.json and a PNG.

    .venv/bin/python bench/bench_structured.py
    .venv/bin/python bench/bench_structured.py --quick   # smoke test: 8 requests, 16 tokens
"""

import argparse
import functools
import json
import random
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from typing import Any
from unittest import mock

# common (through bench_throughput) must be imported before torch: see bench_step_breakdown.
from bench_throughput import (
    decode_engine_kwargs,
    decode_window,
    paired_ratios,
    random_prompts,
)
from common import (
    CallClock,
    add_model_args,
    bar,
    environment,
    load,
    make_llm,
    median,
    print_table,
    setup_threads,
    write_outputs,
)

from v1.core.sched.scheduler import Scheduler
from v1.engine import structured_output
from v1.engine.core import EngineCore
from v1.sampling_params import RequestOutputKind, SamplingParams, StructuredOutputsParams
from v1.worker import model_runner

KINDS = ("json", "regex", "choice")
WORDS = ("alpha beta gamma delta river stone cloud maple ember quiet lantern copper meadow "
         "harbor violet thunder willow saffron marble falcon").split()


def record_schema(min_items: int) -> dict[str, Any]:
    """An array of at least `min_items` objects with a few typed fields."""
    return {
        "type": "array",
        "minItems": min_items,
        "items": {
            "type": "object",
            "properties": {
                "id": {"type": "integer"},
                "name": {"type": "string"},
                "active": {"type": "boolean"},
                "status": {"enum": ["todo", "doing", "done"]},
            },
            "required": ["id", "name", "active", "status"],
        },
    }


def structured_params(kind: str, min_len: int, seed: int) -> StructuredOutputsParams:
    """A grammar of `kind` whose shortest text takes more than `min_len` tokens: at least
    `min_len` array items (each several tokens), words (a space-separated word is at least
    one token) or words in each choice."""
    if kind == "json":
        return StructuredOutputsParams(json=record_schema(min_len))
    if kind == "regex":
        return StructuredOutputsParams(regex=rf"[A-Z][a-z]*( [a-z]+){{{min_len},}}\.")
    rng = random.Random(seed)
    return StructuredOutputsParams(choice=[
        " ".join(rng.choice(WORDS) for _ in range(min_len + 1)) + "." for _ in range(4)
    ])


def workload_kinds(seqs: int) -> list[str | None]:
    """Every other request structured (odd ones plain); of the structured, half JSON schema,
    a quarter regex, a quarter choice."""
    cycle = ("json", "regex", "json", "choice")
    return [cycle[(i // 2) % len(cycle)] if i % 2 == 0 else None for i in range(seqs)]


def make_params(kinds: list[str | None], output_len: int) -> list[SamplingParams]:
    return [
        SamplingParams(
            temperature=0.0, max_tokens=output_len, ignore_eos=True,
            structured_outputs=None if kind is None else structured_params(kind, output_len, i),
            output_kind=RequestOutputKind.FINAL_ONLY,  # the loop reads finished outputs only
        )
        for i, kind in enumerate(kinds)
    ]


def run_round(engines: dict[str, Any], prompts: list[list[int]],
              params: dict[str, list[SamplingParams]]) -> dict[str, tuple[list[float], list]]:
    """Both workloads at once, the engines stepped alternately. Per configuration: the
    seconds of each of its steps, and its outputs in the order of the prompts."""
    for name, engine in engines.items():
        engine.reset_prefix_cache()
        for i, (prompt, p) in enumerate(zip(prompts, params[name])):
            engine.add_request(str(i), {"prompt_token_ids": prompt}, p)
    steps: dict[str, list[float]] = {name: [] for name in engines}
    outputs: dict[str, list] = {name: [None] * len(prompts) for name in engines}
    live = list(engines)
    while live:
        for name in list(live):
            engine = engines[name]
            t0 = time.perf_counter()
            finished = engine.step()
            steps[name].append(time.perf_counter() - t0)
            for out in finished:
                if out.finished:
                    outputs[name][int(out.request_id)] = out
            if not engine.has_unfinished_requests():
                live.remove(name)
    return {name: (steps[name], outputs[name]) for name in engines}


def decode_figures(step_s: list[float], outputs: list, output_len: int
                   ) -> tuple[float, float, bool]:
    """(decode tok/s, mean decode step ms, whether every request produced output_len
    tokens) of one configuration's round: its steps after the first, which prefilled every
    prompt and sampled each request's first token."""
    if decode_window(outputs) is None:
        raise RuntimeError("the prompts were not all prefilled in the first step")
    tokens = sum(len(o.outputs[0].token_ids) - 1 for o in outputs)
    full = all(len(o.outputs[0].token_ids) == output_len for o in outputs)
    decode_s = sum(step_s[1:])
    return tokens / decode_s, 1e3 * decode_s / max(1, len(step_s) - 1), full


# -- the structured-output calls' timers ---------------------------------------------------

PROFILED = ("fill bitmask", "apply bitmask", "accept tokens", "schedule", "runner",
            "update_from_output", "core step")


class StructuredClock(CallClock):
    """Seconds in each profiled call, per engine-core step that decoded every request, for
    each engine core (the timers patch the classes: every engine in this process)."""

    def __init__(self, seqs: int) -> None:
        self.seqs = seqs
        self.steps: dict[int, list[dict[str, float]]] = {}
        super().__init__(PROFILED)

    def _core_step(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        def step(core: Any) -> Any:
            self._reset()
            running = core.scheduler.running
            decoding = len(running) == self.seqs and all(
                r.num_computed_tokens >= r.num_prompt_tokens for r in running
            )
            t0 = time.perf_counter()
            out = fn(core)
            self._spent["core step"] = time.perf_counter() - t0
            if decoding:
                self.steps.setdefault(id(core), []).append(self._spent)
            return out
        return step

    @contextmanager
    def installed(self) -> Iterator[None]:
        timed = self._timed
        with ExitStack() as stack:
            for owner, attr, wrap in [
                (structured_output.StructuredOutputManager, "grammar_bitmask",
                 functools.partial(timed, "fill bitmask")),
                (model_runner, "apply_grammar_bitmask", functools.partial(timed, "apply bitmask")),
                (Scheduler, "schedule", functools.partial(timed, "schedule")),
                (model_runner.ModelRunner, "execute_model", functools.partial(timed, "runner")),
                (Scheduler, "update_from_output",
                 functools.partial(timed, "update_from_output")),
                (EngineCore, "step", self._core_step),
            ]:
                stack.enter_context(mock.patch.object(owner, attr, wrap(getattr(owner, attr))))
            accept = timed("accept tokens", Scheduler._advance_grammar)
            stack.enter_context(
                mock.patch.object(Scheduler, "_advance_grammar", staticmethod(accept)))
            yield

    def mean_ms(self, core: Any) -> dict[str, float]:
        steps = self.steps.get(id(core), [])
        return {p: 1e3 * statistics.fmean(s[p] for s in steps) if steps else 0.0
                for p in PROFILED}


def profile(engines: dict[str, Any], prompts: list[list[int]],
            params: dict[str, list[SamplingParams]], seqs: int) -> dict[str, dict[str, float]]:
    """Mean ms per decode step of each profiled call, per configuration (one round)."""
    clock = StructuredClock(seqs)
    with clock.installed():
        run_round(engines, prompts, params)
    return {name: clock.mean_ms(engine.client.engine_core) for name, engine in engines.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seqs", type=int, default=32, help="concurrent requests")
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=5,
                        help="paired rounds (one run of each configuration); the median pair")
    parser.add_argument("--quick", action="store_true",
                        help="smoke test: 8 requests, 32 prompt and 16 output tokens, 2 rounds")
    parser.add_argument("--no-profile", action="store_true",
                        help="skip the profiled run of each configuration")
    parser.add_argument("--out", default=None, help="directory for the JSON result and a PNG plot")
    add_model_args(parser)
    args = parser.parse_args()
    if args.quick:
        args.seqs, args.input_len, args.output_len, args.rounds = 8, 32, 16, 2
    if args.output_len < 2:
        parser.error("--output-len must be at least 2: the first token comes from the prefill")
    setup_threads(args)
    loaded = load(args.model)
    n, out_len = args.seqs, args.output_len
    prompts = random_prompts(random.Random(args.seed), n, (args.input_len, args.input_len),
                             int(loaded.hf_config.vocab_size))
    kinds = workload_kinds(n)
    params = {"plain": make_params([None] * n, out_len), "structured": make_params(kinds, out_len)}
    num_structured = sum(k is not None for k in kinds)
    kwargs = decode_engine_kwargs({"max_num_seqs": n}, n, args.input_len)
    engines = {name: make_llm(loaded, **kwargs).llm_engine for name in params}
    run_round(engines, prompts, params)  # warm-up; compiles (and caches) the grammars

    rates: dict[str, list[float]] = {name: [] for name in params}
    step_ms: dict[str, list[float]] = {name: [] for name in params}
    full = True
    texts: list[str] = []
    for r in range(args.rounds):
        order = list(params) if r % 2 == 0 else list(reversed(params))
        results = run_round({name: engines[name] for name in order}, prompts, params)
        for name in params:
            rate, ms, ran_full = decode_figures(*results[name], out_len)
            full = full and ran_full
            rates[name].append(rate)
            step_ms[name].append(ms)
        texts = [o.outputs[0].text for o, k in zip(results["structured"][1], kinds)
                 if k is not None]
        print(f"round {r}: " + ", ".join(
            f"{name} {rates[name][-1]:.1f} tok/s ({step_ms[name][-1]:.1f} ms/step)"
            for name in params) + ("" if full else " (some requests finished early)"),
            file=sys.stderr)
    profiled = {} if args.no_profile else profile(engines, prompts, params, n)
    for engine in engines.values():
        engine.shutdown()

    if full:
        method = "decode tok/s (every request produced --output-len tokens)"
        ratios = paired_ratios(rates["plain"], rates["structured"])
    else:
        method = ("mean decode step time (a grammar ended some requests early, so the token "
                  "counts differ): ratio = plain step ms / structured step ms")
        ratios = paired_ratios(step_ms["structured"], step_ms["plain"])
    ratio = median(ratios)
    plain_tok_s, structured_tok_s = median(rates["plain"]), median(rates["structured"])
    result: dict[str, Any] = {
        "bench": "structured",
        "concurrent": n,
        "structured_requests": num_structured,
        "kinds": {k: kinds.count(k) for k in KINDS},
        "input_len": args.input_len,
        "output_len": out_len,
        "rounds": args.rounds,
        "plain_tok_s": round(plain_tok_s, 1),
        "structured_tok_s": round(structured_tok_s, 1),
        "ratio": round(ratio, 4),
        "slowdown": round(1 - ratio, 4),
        "target_met": 1 - ratio <= 0.10,
        "method": method,
        "pair_ratios": [round(x, 4) for x in ratios],
        "plain_runs_tok_s": [round(x, 1) for x in rates["plain"]],
        "structured_runs_tok_s": [round(x, 1) for x in rates["structured"]],
        "plain_step_ms": round(median(step_ms["plain"]), 2),
        "structured_step_ms": round(median(step_ms["structured"]), 2),
        "profile_ms_per_step": {name: {p: round(v, 3) for p, v in ms.items()}
                                for name, ms in profiled.items()},
        "sample_output": texts[0][:120] if texts else None,
        **environment(),
    }
    rows = [[name, median(rates[name]), median(step_ms[name]),
             ", ".join(f"{x:.0f}" for x in rates[name])] for name in params]
    print_table(["requests", "decode tok/s", "step ms", "runs tok/s"], rows)
    print(f"{n} concurrent, {num_structured} structured ("
          + ", ".join(f"{kinds.count(k)} {k}" for k in KINDS)
          + f"), context {args.input_len}..{args.input_len + out_len}; compared by {method}")
    print("structured / plain, round by round: "
          + ", ".join(f"{x:.3f}" for x in ratios)
          + f"; median {ratio:.3f}: {1 - ratio:+.1%} slower (target <= 10%)")
    if profiled:
        print()
        print_table(["ms per decode step"] + list(profiled),
                    [[p] + [profiled[name][p] for name in profiled] for p in PROFILED])

    def plot(fig: Any) -> None:
        bar(fig.add_subplot(1, 2, 1), list(params), [median(rates[k]) for k in params],
            "decode tokens/s (median)",
            f"{n} concurrent, {num_structured} structured: {1 - ratio:+.1%}")
        if profiled:
            ax = fig.add_subplot(1, 2, 2)
            parts = ["fill bitmask", "apply bitmask", "accept tokens"]
            values = [profiled["structured"][p] for p in parts]
            bar(ax, parts, values, "ms per decode step",
                f"structured-output work (step {profiled['structured']['core step']:.1f} ms)")

    write_outputs(args.out, "structured", result, plot)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
